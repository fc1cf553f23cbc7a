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
from types import SimpleNamespace
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
    """Batched, length-sorted scoring with a sequence-classification reward model.

    How a batch is scored (the same rewards as the model's own ``forward``; checked once per model, see below):

    * Sequences are sorted by length, longest first, so a batch of ``batch_size`` holds similar lengths and little
      padding (on generated responses about 2% of the positions; packing several sequences into a row, as
      :func:`rlhf_pipeline.logprobs.build_batch` does for training, would need an explicit block-diagonal mask, which
      costs more attention than that padding saves).
    * Fast path, for a one-label classifier with a ``score`` head on a transformer body (``base_model_prefix``; every
      ``AutoModelForSequenceClassification`` built on a decoder): the body runs on right-padded ids *without* an
      attention mask. With right padding every real token sees only earlier real tokens under the causal mask alone,
      so the mask adds nothing but its construction and the slower masked attention kernel. The reward is ``score``
      applied to the final hidden state at each sequence's pooled token, chosen by transformers' rule (the rightmost
      token that is not ``config.pad_token_id``), so no position but that one goes through the head.
    * Llama-family bodies (Llama, Mistral, Qwen2, Qwen3 without sliding windows): only the pooled token's state
      leaves the last decoder layer, so that layer computes keys and values for every position but the query,
      attention output, MLP and final norm for the pooled token alone. On a deep model that saves a small fraction
      of one layer; on a two-layer model close to half the work.

    The first batch on a model checks the fast path against the model's own padded, masked ``forward`` on two short
    real sequences, and falls back to that forward (with a warning) if they disagree or the fast path fails, so a
    custom model (ArmoRM's gating head, anything with its own pooling) is still scored correctly.
    """

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
        # How batches are scored: "pruned" (fast path, last layer at the pooled token only), "last_token" (fast path,
        # whole body) or "forward" (the model's own forward); decided on the first batch (see the class docstring).
        self.mode: str | None = None

    def encode(self, prompts: list, responses: list[str]) -> list[list[int]]:
        from rlhf_pipeline.chat import encode_conversations

        ids = encode_conversations(self.tokenizer, prompts, responses)
        over = sum(len(x) > self.max_length for x in ids)
        if over:
            log.warning("%d of %d sequences exceed --max-length %d and are truncated", over, len(ids), self.max_length)
            self.truncated += over
            ids = [x[: self.max_length] if len(x) > self.max_length else x for x in ids]
        return ids

    def forward_rewards(self, sequences: list[list[int]]) -> list[float]:
        """The model's own ``forward`` on one right-padded, masked batch: the reference the fast path must match."""
        import torch

        device = self.model.device
        input_ids, attention_mask = pad_right(sequences, self.pad_id)
        with torch.no_grad():
            out = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
        return reward_from_output(out).tolist()

    def fast_rewards(self, sequences: list[list[int]], prune: bool = True) -> list[float]:
        """The fast path on one batch (see the class docstring); ``prune``: the last layer at the pooled token only
        (Llama-family bodies; others run the whole body either way)."""
        import torch

        width = max(len(s) for s in sequences)
        input_ids = torch.tensor([list(s) + [self.pad_id] * (width - len(s)) for s in sequences], dtype=torch.long)
        pad = model_pad_id(self.model.config)
        pooled = torch.tensor([pooled_index(s, pad) for s in sequences], dtype=torch.long)
        device = self.model.device
        with torch.no_grad():
            values = last_token_rewards(self.model, input_ids.to(device), pooled.to(device), prune=prune)
        return values.tolist()

    def _choose_mode(self, sequences: list[list[int]]) -> str:
        """The fastest way to score that gives the model's own rewards on two short real sequences of different
        lengths: pruned, then last-token, then the model's forward."""
        import torch

        if not supports_fast_path(self.model):
            return "forward"
        longest = max(sequences, key=len)
        probe = [list(longest[:24]), list(longest[: max(1, min(len(longest), 24) // 2)])]
        reference = self.forward_rewards(probe)
        tolerance = 1e-4 if next(self.model.parameters()).dtype in (torch.float32, torch.float64) else 3e-2
        name = type(self.model).__name__
        candidates = ["pruned", "last_token"] if prunable_last_layer(self.model) is not None else ["last_token"]
        for mode in candidates:
            try:
                fast = self.fast_rewards(probe, prune=mode == "pruned")
            except Exception as e:  # a body that will not run this way
                log.warning("reward model %s: the %s scoring path failed (%s)", name, mode, e)
                continue
            if all(abs(a - b) <= tolerance * max(1.0, abs(b)) for a, b in zip(fast, reference)):
                return mode
            log.warning("reward model %s: the %s scoring path disagrees with the model's forward (%s vs %s)",
                        name, mode, fast, reference)
        log.warning("reward model %s: scoring with the model's own forward", name)
        return "forward"

    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        rewards = [0.0] * len(sequences)
        if not sequences:
            return rewards
        if self.mode is None:
            self.mode = self._choose_mode(sequences)
        if self.mode == "forward":
            run = self.forward_rewards
        else:
            prune = self.mode == "pruned"

            def run(batch: list[list[int]]) -> list[float]:
                return self.fast_rewards(batch, prune=prune)

        with tqdm(total=len(sequences), desc="score", unit="seq") as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                for i, value in zip(batch, run([sequences[i] for i in batch])):
                    rewards[i] = value
                bar.update(len(batch))
        return rewards

    def score(self, prompts: list, responses: list[str]) -> list[float]:
        return self.score_ids(self.encode(prompts, responses))


# Decoder layers whose structure the pruned last layer reproduces: input norm -> attention (q/k/v/o projections,
# optional per-head q/k norms, rotary embeddings) -> residual -> post-attention norm -> MLP -> residual.
PRUNABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def supports_fast_path(model) -> bool:
    """A one-label classifier whose reward is ``score(last hidden state)`` of a body named by ``base_model_prefix``."""
    import torch

    config = getattr(model, "config", None)
    prefix = getattr(model, "base_model_prefix", None)
    return (
        config is not None
        and getattr(config, "num_labels", None) == 1
        and isinstance(getattr(model, "score", None), torch.nn.Module)
        and isinstance(prefix, str)
        and isinstance(getattr(model, prefix, None), torch.nn.Module)
    )


def model_pad_id(config) -> int | None:
    """The pad id a sequence classifier's own pooling skips (``config.get_text_config().pad_token_id``)."""
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).pad_token_id


def pooled_index(sequence: list[int], pad: int | None) -> int:
    """The position transformers' sequence classifiers read the reward from: the rightmost token that is not
    ``pad`` (0 when every token is), or the last token when the model has no pad id."""
    if pad is None:
        return len(sequence) - 1
    for j in range(len(sequence) - 1, -1, -1):
        if sequence[j] != pad:
            return j
    return 0


def prunable_last_layer(model):
    """The body's last decoder layer when its structure is one :func:`_last_layer_at` reproduces, else None."""
    config = model.config
    body = getattr(model, model.base_model_prefix)
    if getattr(config, "model_type", None) not in PRUNABLE_MODEL_TYPES:
        return None
    if getattr(config, "sliding_window", None) is not None:
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return None
    layers = getattr(body, "layers", None)
    if not layers or not hasattr(body, "norm"):
        return None
    layer = layers[-1]
    attn = getattr(layer, "self_attn", None)
    needed = (
        all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp"))
        and attn is not None
        and all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
    )
    return layer if needed else None


class _StopBeforeLastLayer(Exception):
    pass


def _rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _last_layer_at(layer, hidden, position_embeddings, pooled):
    """The output of ``layer`` (a Llama-family decoder layer, causal attention) at one position per row.

    ``hidden`` (B, T, H) is the layer's input; ``pooled`` (B,) the positions wanted. Keys and values come from every
    position up to the pooled one; the query, attention output, MLP and residuals only from the pooled one.
    """
    import torch
    import torch.nn.functional as F

    attn = layer.self_attn
    batch, width, _ = hidden.shape
    rows = torch.arange(batch, device=hidden.device)
    x = layer.input_layernorm(hidden)
    k = attn.k_proj(x).view(batch, width, -1, attn.head_dim)
    if hasattr(attn, "k_norm"):  # Qwen3: RMS norm per head before the rotary embedding
        k = attn.k_norm(k)
    k = k.transpose(1, 2)  # (B, kv heads, T, D)
    v = attn.v_proj(x).view(batch, width, -1, attn.head_dim).transpose(1, 2)
    q = attn.q_proj(x[rows, pooled]).view(batch, 1, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = q.transpose(1, 2)  # (B, heads, 1, D)

    cos, sin = position_embeddings  # (B or 1, T, D)
    cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
    q = q * cos[rows, pooled][:, None, None] + _rotate_half(q) * sin[rows, pooled][:, None, None]

    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads in a row
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    visible = torch.arange(width, device=hidden.device)[None, :] <= pooled[:, None]  # causal, for the one query
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None, :], scale=attn.scaling)
    h = hidden[rows, pooled] + attn.o_proj(out.transpose(1, 2).reshape(batch, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def last_token_rewards(model, input_ids, pooled, prune: bool = True):
    """(B,) float rewards: ``model.score`` on the final hidden state at ``pooled`` (B,) of right-padded ``input_ids``,
    the body run without an attention mask (causal attention alone keeps pads out of every real position).
    ``prune``: compute the last decoder layer at the pooled positions only, when the body is one
    :func:`prunable_last_layer` accepts."""
    import torch

    body = getattr(model, model.base_model_prefix)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    layer = prunable_last_layer(model) if prune else None
    if layer is None:
        hidden = body(input_ids=input_ids, use_cache=False).last_hidden_state[rows, pooled]
    else:
        captured: dict = {}

        def stop(module, args, kwargs):
            captured["hidden"] = args[0] if args else kwargs["hidden_states"]
            captured["position_embeddings"] = kwargs["position_embeddings"]
            raise _StopBeforeLastLayer

        handle = layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            body(input_ids=input_ids, use_cache=False)
        except _StopBeforeLastLayer:
            pass
        finally:
            handle.remove()
        if "hidden" not in captured:
            raise RuntimeError("the body never reached its last decoder layer")
        hidden = body.norm(_last_layer_at(layer, captured["hidden"], captured["position_embeddings"], pooled))
    values = model.score(hidden)
    return reward_from_output(SimpleNamespace(logits=values))
