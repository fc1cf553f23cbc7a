"""Rewards: a sequence-classification reward model, or a python function.

Reward model (``AutoModelForSequenceClassification``, one label): each prompt + response is rendered with the
*reward model's own* tokenizer and chat template (the policy's may differ), sequences are sorted by length and
scored in batches. Truncation rule: a conversation longer than ``max_length`` tokens keeps its first
``max_length`` tokens (as ``truncation=True`` does in REBEL's ``rank.py``); the count of truncated sequences goes in
the manifest. Models whose output has a ``.score`` field (ArmoRM, with ``--trust-remote-code``) are read from it,
others from ``.logits``.

Python function: ``module:function`` or ``path/to/file.py:function`` with the signature
``reward(prompts: list[str], responses: list[str], **columns) -> list[float]``; ``columns`` holds the dataset's
extra columns (``label``, ``prompt_id``, ...) and ``finish_reasons``, each aligned with ``responses``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from rlhf_pipeline.errors import PipelineError

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``module:function`` or ``path/to/file.py:function``."""
    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise PipelineError(f"--reward-fn {spec!r}: expected module:function or path/to/file.py:function")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise PipelineError(f"--reward-fn {spec!r}: no such file {path}")
        mod_spec = importlib.util.spec_from_file_location(f"rlhf_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        if importlib.util.find_spec(module_name) is None:
            raise PipelineError(f"--reward-fn {spec!r}: cannot import module '{module_name}'")
        module = importlib.import_module(module_name)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise PipelineError(f"--reward-fn {spec!r}: '{module_name}' has no function '{fn_name}'")
    return fn


def call_reward_fn(fn: RewardFn, prompts: list[str], responses: list[str], columns: dict[str, list[Any]]) -> list[float]:
    """Call a reward function and check that it gave one number per response."""
    values = fn(prompts, responses, **columns)
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise PipelineError(f"reward function returned something that is not a list of numbers ({e})") from None
    if len(values) != len(responses):
        raise PipelineError(f"reward function returned {len(values)} rewards for {len(responses)} responses")
    return values


def first_non_finite(values: Sequence[float]) -> int | None:
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return None


def reward_from_output(output: Any):
    """The (B,) reward tensor of a reward model's output: ``.score`` when present (ArmoRM), else ``.logits``."""
    score = getattr(output, "score", None)
    values = score if score is not None else output.logits
    if values.dim() == 2:
        if values.shape[1] != 1:
            raise PipelineError(
                f"the reward model outputs {values.shape[1]} values per sequence; expected one "
                "(a sequence-classification model with num_labels=1)"
            )
        values = values[:, 0]
    return values.float()


def pad_right(sequences: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) long tensors, right-padded to the longest sequence: how reward models read
    batches here, in scoring and in training (the model finds each sequence's last real token through
    ``config.pad_token_id``)."""
    import torch

    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, : len(seq)] = 1
    return input_ids, attention_mask


def prepare_reward_model(model, pad: int) -> None:
    """transformers finds each sequence's last real token through ``config.pad_token_id``; without one it refuses
    batches larger than 1. Set it from the tokenizer's pad (or EOS) when the model has none."""
    if model.config.pad_token_id is None:
        model.config.pad_token_id = pad


class RewardModelScorer:
    """Batched, length-sorted scoring with a sequence-classification reward model."""

    def __init__(
        self,
        path: str,
        *,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        batch_size: int = 16,
        max_length: int = 4096,
    ):
        from rlhf_pipeline.chat import load_tokenizer, pad_id
        from rlhf_pipeline.modeling import load_reward_model

        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.model = load_reward_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.batch_size = batch_size
        self.max_length = max_length
        self.pad_id = pad_id(self.tokenizer)
        prepare_reward_model(self.model, self.pad_id)
        self.truncated = 0

    def encode(self, prompts: list, responses: list[str]) -> list[list[int]]:
        from rlhf_pipeline.chat import encode_conversations

        ids = encode_conversations(self.tokenizer, prompts, responses)
        over = sum(len(x) > self.max_length for x in ids)
        if over:
            log.warning("%d of %d sequences exceed --max-length %d and are truncated", over, len(ids), self.max_length)
            self.truncated += over
        return [x[: self.max_length] for x in ids]

    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        import torch

        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        rewards = [0.0] * len(sequences)
        device = self.model.device
        with tqdm(total=len(sequences), desc="score", unit="seq") as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                input_ids, attention_mask = pad_right([sequences[i] for i in batch], self.pad_id)
                with torch.no_grad():
                    out = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
                for i, value in zip(batch, reward_from_output(out).tolist()):
                    rewards[i] = value
                bar.update(len(batch))
        return rewards

    def score(self, prompts: list, responses: list[str]) -> list[float]:
        return self.score_ids(self.encode(prompts, responses))
