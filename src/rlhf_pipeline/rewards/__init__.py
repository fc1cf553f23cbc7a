"""Rewards: a sequence-classification reward model, or a python function.

Reward model (``AutoModelForSequenceClassification``, one label): each prompt + response is rendered with the
*reward model's own* tokenizer and chat template (the policy's may differ), sequences are sorted by length and
scored in batches. Truncation rule: a conversation longer than ``max_length`` tokens keeps its first
``max_length`` tokens (as ``truncation=True`` does in REBEL's ``rank.py``); the count of truncated sequences goes in
the manifest. Models whose output has a ``.score`` field (ArmoRM, with ``--trust-remote-code``) are read from it,
others from ``.logits``.

Python function: ``module:function`` or ``path/to/file.py:function`` with the signature
``reward(prompts: list[str], responses: list[str], **columns) -> list[float]``; ``columns`` holds the dataset's
extra columns (``label``, ``prompt_id``, ...) and ``finish_reasons``, each aligned with ``responses`` (and
``reference``, the ground truth, with ``--reference-column``). Built-in verifiable rewards (a final answer checked
against the ground truth, a format check) are in :mod:`rlhf_pipeline.rewards.verifiable`.

Several sources (reward models and functions) combine by "normalise, then sum" (:func:`combine_rewards`): each
source is standardised on its own, ``(r_k - mean_k) / (std_k + eps)``, and the standardised rewards are summed with
weights. Summing raw rewards would let the source with the largest scale decide alone (a reward model's logits
spread over several units, a 0/1 format check over one); standardising each first is GDPO's remedy (Liu et al. 2026,
"GDPO: Group reward-Decoupled Normalization Policy Optimization", arXiv:2601.05242, which normalises each reward
within its group before summing; here the statistics are over the whole dataset, and the group algorithms then
normalise the sum per group as they would a single reward).
"""

from __future__ import annotations

import importlib
import inspect
import importlib.util
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from rlhf_pipeline.attention import DEFAULT_ATTENTION
from rlhf_pipeline.errors import PipelineError, UserCodeError, one_line
from rlhf_pipeline.files import sha256_file
from rlhf_pipeline.modeling import supports_fast_path

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]


def check_reward_fn_spec(spec: str, read_file: bool = False) -> tuple[str, str]:
    """``(module or file, function)`` of a ``--reward-fn`` spec, checked without importing anything (a file must
    exist); what :func:`load_reward_fn` checks first, and what ``rlhf iterate`` checks before it launches. With
    ``read_file`` a file's source is also parsed, not run, so that a misspelt function name or a syntax error is
    found before a run spends an hour sampling (names a file may make as it runs, through ``globals()``,
    ``exec``, a star import or a module ``__getattr__``, pass)."""
    import ast

    module_name, sep, fn_name = spec.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise PipelineError(f"--reward-fn {spec!r}: expected module:function or path/to/file.py:function")
    if not module_name.endswith(".py"):
        return module_name, fn_name
    path = Path(module_name).expanduser()
    if not path.is_file():
        raise PipelineError(f"--reward-fn {spec!r}: no such file {path}")
    if read_file:
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except SyntaxError as e:
            raise PipelineError(f"--reward-fn {spec!r}: {path} does not parse: {one_line(e)}") from None

        def bound(node) -> set[str]:  # the names a statement binds
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return {node.name}
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                return {(a.asname or a.name).split(".")[0] for a in node.names}
            return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}

        names: set[str] = set()
        for top in tree.body:  # at the top level, and in its if/try/with/for blocks (not inside functions)
            blocks = [top]
            while blocks:
                node = blocks.pop()
                names |= bound(node)
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    blocks += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
                    blocks += [h for h in getattr(node, "handlers", [])]
        dynamic = {"globals", "vars", "locals", "exec", "setattr"}  # ways a file makes names as it runs
        if fn_name not in names and "*" not in names and "__getattr__" not in names and \
                not dynamic & {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
            raise PipelineError(f"--reward-fn {spec!r}: {path} defines no {fn_name!r}; check the name after the ':'")
    return module_name, fn_name


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``module:function`` or ``path/to/file.py:function``. The module's own code raising on import (a
    syntax error, a missing package) is a :class:`UserCodeError`: the user's traceback, then one line."""
    module_name, fn_name = check_reward_fn_spec(spec)
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        mod_spec = importlib.util.spec_from_file_location(f"rlhf_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)
        try:
            mod_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            raise UserCodeError(f"the reward function {spec}: importing {path} raised {one_line(e)}", e) from e
    else:
        try:
            found = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:  # a parent package that does not exist
            found = None
        if found is None:
            as_file = Path(*module_name.split(".")).with_suffix(".py")
            fix = (f"; to load the file {as_file}, pass --reward-fn {as_file}:{fn_name}" if as_file.is_file() else
                   "; pass path/to/file.py:function for a file, or install the module")
            raise PipelineError(f"--reward-fn {spec!r}: cannot import module '{module_name}'{fix}")
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as e:
            raise UserCodeError(f"the reward function {spec}: importing {module_name} raised {one_line(e)}", e) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise PipelineError(f"--reward-fn {spec!r}: '{module_name}' has no function '{fn_name}'")
    return fn


def code_digest(spec: str) -> str | None:
    """The sha256 of the file a ``--reward-fn`` spec names: its FILE.py, or its module's file (imported by
    :func:`load_reward_fn` first), or None where there is none. ``rlhf score`` takes it when it loads the function and
    records it with each chunk of rewards it keeps, so that a rerun after the file was edited scores the chunk again
    rather than reusing the old code's rewards. A change in another module the file imports goes unseen."""
    module_name, _ = check_reward_fn_spec(spec)
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
    else:
        path = getattr(sys.modules.get(module_name), "__file__", None)
    if path is None or not Path(path).is_file():
        return None
    return sha256_file(Path(path))


def call_reward_fn(
    fn: RewardFn,
    prompts: list[str],
    responses: list[str],
    columns: dict[str, list[Any]],
    *,
    name: str | None = None,
    where: str = "",
) -> list[float]:
    """Call a reward function and check that it gave one number per response.

    ``name`` (the ``--reward-fn`` spec) and ``where`` (which rows the batch holds, e.g. ``rows 0..3 (batch of 16
    responses)``) go in the errors. The function raising is a :class:`UserCodeError` (its traceback is the user's to
    read); a wrong result is a one-line PipelineError.
    """
    label = f"the reward function {name or getattr(fn, '__qualname__', fn)}"
    at = f" on {where}" if where else ""
    clash = _argument_columns(fn, columns)
    if clash:  # the call would raise TypeError ("multiple values"), which reads as the function's own mistake
        raise PipelineError(f"{label}: the data has a column named {clash!r}, the name of the function's own "
                            f"argument; rename that column of the prompts (it is passed on as a keyword)")
    try:
        values = fn(prompts, responses, **columns)
        if isinstance(values, Iterator):  # a generator's body runs as it is read: here, where its errors are its own
            values = list(values)
    except PipelineError as e:
        if isinstance(e, UserCodeError):
            raise
        # a one-line problem with the data, from the built-in functions (rewards.verifiable): no traceback to read
        raise PipelineError(f"{label}{at}: {e}") from None
    except Exception as e:
        raise UserCodeError(f"{label} raised{at}: {one_line(e)}", e) from e
    except SystemExit as e:  # would end the run with its exit status and no word
        raise UserCodeError(f"{label} called sys.exit({e.code!r}){at}; a reward function returns one reward per "
                            "response: raise an exception to stop the run", e) from e
    try:
        returned = list(values)
    except TypeError as e:
        raise PipelineError(
            f"{label} returned something that is not a list of numbers{at} ({e}); return one float per response"
        ) from None
    values = []
    for i, v in enumerate(returned):  # numbers (bools and numpy's too), not text that float() would read
        try:
            values.append(float(v) if not isinstance(v, (str, bytes)) else None)
        except (TypeError, ValueError):
            values.append(None)
        if values[-1] is None:
            raise PipelineError(f"{label} returned {v!r} for the batch's response {i}{at}; return one float per "
                                "response")
    if len(values) != len(responses):
        raise PipelineError(
            f"{label} returned {len(values)} rewards for {len(responses)} responses{at}; return one per response"
        )
    return values


def _argument_columns(fn: Callable, columns: dict[str, Any]) -> str | None:
    """The column that the call would pass a second time, by keyword, to the parameter that takes the prompts or
    the responses by position (``prompts``, whatever a function names it), or None."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[:2]
    except (TypeError, ValueError):  # no signature to read (a builtin): the call says what it says
        return None
    for parameter in parameters:
        if parameter.kind == parameter.POSITIONAL_OR_KEYWORD and parameter.name in columns:
            return parameter.name
    return None


def first_non_finite(values: Sequence[float]) -> int | None:
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return None


# Added to each source's standard deviation before dividing (a guard; a source whose rewards are all equal is not
# divided at all, see combine_rewards).
STANDARDIZE_EPS = 1e-6


@dataclass(frozen=True)
class SourceStats:
    """One reward source's statistics over every response of a dataset: the mean, the population standard
    deviation (divided by the count, as a z-score's), and whether all the values are equal (max == min)."""

    mean: float
    std: float
    constant: bool

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "constant": self.constant}


def source_stats(values: Sequence[float]) -> SourceStats:
    """The :class:`SourceStats` of ``values`` (at least one value). ``constant`` is decided on the values themselves,
    not on a standard deviation that rounding may leave at 1e-17 for equal values."""
    if not values:
        raise ValueError("source_stats: no values")
    count = len(values)
    mean = math.fsum(values) / count
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / count)
    constant = max(values) == min(values)
    return SourceStats(mean=mean, std=0.0 if constant else std, constant=constant)


def combine_rewards(
    per_source: Sequence[Sequence[float]],
    weights: Sequence[float],
    stats: Sequence[SourceStats] | None = None,
    eps: float = STANDARDIZE_EPS,
) -> tuple[list[float], list[SourceStats]]:
    """``sum_k w_k (r_k - mean_k) / (std_k + eps)`` for every response, and the statistics used.

    ``per_source[k][i]`` is source k's reward of response i (every source scores the same responses, in the same
    order). ``stats`` (one per source) defaults to each source's own :func:`source_stats` over ``per_source[k]``;
    ``rlhf eval`` passes the baseline's, so that a policy and its baseline are measured on one scale. A source whose
    rewards are all equal (``constant``) carries no information about which response is better and contributes 0 to
    every response, exactly (its residuals, rounded, divided by eps would otherwise add noise of order 1e-10 that
    breaks the ties the filter relies on); the stage warns about it and records it in the manifest.
    """
    if len(per_source) != len(weights):
        raise ValueError(f"{len(per_source)} reward sources but {len(weights)} weights")
    if stats is None:
        stats = [source_stats(values) for values in per_source]
    count = len(per_source[0]) if per_source else 0
    if any(len(values) != count for values in per_source):
        raise ValueError("every reward source must score the same responses")
    combined = [0.0] * count
    for values, weight, st in zip(per_source, weights, stats):
        if st.constant or weight == 0:
            continue
        scale = weight / (st.std + eps)
        for i, v in enumerate(values):
            combined[i] += (v - st.mean) * scale
    return combined, list(stats)


def reward_from_output(output: Any):
    """The (B,) reward tensor of a reward model's output: its ``score`` when it has one (ArmoRM's remote code returns
    ``rewards`` per objective, ``gating_output`` and ``score``, the gated preference, (B,) or (B, 1)), else its
    ``logits`` (a sequence classifier's, (B, 1)). This is the one place a model's output becomes rewards."""
    import torch

    score = getattr(output, "score", None)
    values = score if torch.is_tensor(score) else getattr(output, "logits", None)
    if not torch.is_tensor(values):
        fields = ", ".join(output.keys()) if hasattr(output, "keys") else ""
        raise PipelineError(
            f"the reward model's output ({type(output).__name__}{': ' + fields if fields else ''}) has neither a score "
            "nor a logits tensor; score with a sequence-classification model (logits) or one whose output has a score "
            "field (ArmoRM)"
        )
    if values.dim() == 2:
        if values.shape[1] != 1:
            raise PipelineError(
                f"the reward model outputs {values.shape[1]} values per sequence; expected one "
                "(a sequence-classification model with num_labels=1)"
            )
        values = values[:, 0]
    if values.dim() != 1:
        raise PipelineError(f"the reward model outputs rewards of shape {tuple(values.shape)}; expected one per "
                            "sequence, (batch,) or (batch, 1)")
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


def prepare_reward_model(model, pad: int) -> int:
    """transformers finds each sequence's last real token through ``config.pad_token_id``; without one it refuses
    batches larger than 1. Set it from the tokenizer's pad (or EOS) when the model has none. Returns the id to pad
    the model's batches with: its own pad id (:func:`model_pad_id`), which may differ from the tokenizer's (a config
    naming ``<|finetune_right_pad_id|>`` beside a tokenizer that pads with EOS): padded with another id, a shorter
    sequence of a batch would be read at its last pad, a reward that changes with what shares its batch."""
    if model_pad_id(model.config) is None:
        model.config.pad_token_id = pad
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().pad_token_id = pad
    return model_pad_id(model.config)


class RewardModelScorer:
    """Batched, length-sorted scoring with a sequence-classification reward model.

    How a batch is scored (the same rewards as the model's own ``forward``; checked once per model, see below):

    * Sequences are sorted by length, longest first, so a batch of ``batch_size`` holds similar lengths and little
      padding (how little: docs/benchmarks.md, "Measurements quoted in the code's design notes"); packing several
      sequences into a row, as :func:`rlhf_pipeline.logprobs.build_batch` does for training, would need an explicit
      block-diagonal mask, which costs more attention than that padding saves.
    * Fast path, for a one-label classifier with a ``score`` head on a transformer body (``base_model_prefix``; every
      ``AutoModelForSequenceClassification`` built on a decoder): the body runs on right-padded ids *without* an
      attention mask. With right padding every real token sees only earlier real tokens under the causal mask alone,
      so the mask adds nothing but its construction and the slower masked attention kernel. The reward is ``score``
      applied to the final hidden state at each sequence's pooled token, chosen by transformers' rule (the rightmost
      token that is not ``config.pad_token_id``), so no position but that one goes through the head.

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
        engine: str = "hf",
        attn_implementation: str = DEFAULT_ATTENTION,
        device=None,
        load_model: bool = True,
        allow_special_tokens: bool = False,
        chat_template: str | None = None,
    ):
        """``load_model=False`` leaves the model to :meth:`score`, which loads it while it encodes the texts.
        ``attn_implementation``: the hf engine's (``rlhf_pipeline.attention``). ``allow_special_tokens``: read
        special-token strings in prompts and responses as tokens (``chat.ControlTokens``; by default they are text).
        ``chat_template``: ``--chat-template`` (``chat.use_chat_template``; default: the reward model's own)."""
        from rlhf_pipeline.chat import load_tokenizer, pad_id, use_chat_template

        self.path, self.dtype, self.trust_remote_code, self.device = path, dtype, trust_remote_code, device
        self.attn_implementation = attn_implementation
        self.allow_special_tokens = allow_special_tokens
        self.model = None
        self.closed = False
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.chat_template = use_chat_template(self.tokenizer, chat_template, path)
        self.batch_size = batch_size
        self.max_length = max_length
        self.pad_id = pad_id(self.tokenizer)
        self.truncated = 0
        self.vllm = None
        if engine == "vllm":
            # vLLM pools the last token it is given: each sequence is cut after the token transformers pools at (the
            # rightmost that is not the pad id, see pooled_index), so both engines read the same position.
            from transformers import AutoConfig

            from rlhf_pipeline.engines.vllm import VLLMRewardModel

            model_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            pad = model_pad_id(model_config)
            self.pooling_pad = self.pad_id if pad is None else pad  # as prepare_reward_model sets it
            # vLLM refuses a max_model_len over the model's context; sequences are cut at the shorter of the two
            context = getattr(model_config, "max_position_embeddings", None)
            if context is not None and context < max_length:
                log.info("--max-length %d is over the reward model's context (%d): sequences are cut at %d",
                         max_length, context, context)
                self.max_length = context
            self.vllm = VLLMRewardModel(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                        max_model_len=self.max_length)
            return
        # How batches are scored: "last_token" (the fast path) or "forward" (the model's own forward); decided on the
        # first batch (see the class docstring).
        self.mode: str | None = None
        if load_model:
            self.load_model()

    def load_model(self) -> None:
        from rlhf_pipeline.modeling import load_reward_model

        self.model = load_reward_model(self.path, dtype=self.dtype, trust_remote_code=self.trust_remote_code,
                                       device=self.device, attn_implementation=self.attn_implementation)
        self.pad_id = prepare_reward_model(self.model, self.pad_id)

    def encode(self, prompts: list, responses: list[str], meanwhile=None) -> list[list[int]]:
        from rlhf_pipeline.chat import encode_conversations

        return self.truncate(encode_conversations(self.tokenizer, prompts, responses, meanwhile=meanwhile,
                                                  allow_special_tokens=self.allow_special_tokens))

    def truncate(self, ids: list[list[int]]) -> list[list[int]]:
        """Sequences over ``max_length`` keep their first tokens (counted in ``truncated``, with a warning)."""
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

    def fast_rewards(self, sequences: list[list[int]]) -> list[float]:
        """The fast path on one batch (see the class docstring)."""
        import torch

        width = max(len(s) for s in sequences)
        input_ids = torch.tensor([list(s) + [self.pad_id] * (width - len(s)) for s in sequences], dtype=torch.long)
        pad = model_pad_id(self.model.config)
        pooled = torch.tensor([pooled_index(s, pad) for s in sequences], dtype=torch.long)
        device = self.model.device
        with torch.no_grad():
            values = last_token_rewards(self.model, input_ids.to(device), pooled.to(device))
        return values.tolist()

    def _choose_mode(self, sequences: list[list[int]]) -> str:
        """The fast path when it gives the model's own rewards on two short real sequences of different lengths, else
        the model's forward."""
        import torch

        if not supports_fast_path(self.model):
            return "forward"
        longest = max(sequences, key=len)
        probe = [list(longest[:24]), list(longest[: max(1, min(len(longest), 24) // 2)])]
        reference = self.forward_rewards(probe)
        tolerance = 1e-4 if next(self.model.parameters()).dtype in (torch.float32, torch.float64) else 3e-2
        name = type(self.model).__name__
        try:
            fast = self.fast_rewards(probe)
        except Exception as e:  # a body that will not run this way
            log.warning("reward model %s: the fast scoring path failed (%s)", name, e)
        else:
            if all(abs(a - b) <= tolerance * max(1.0, abs(b)) for a, b in zip(fast, reference)):
                return "last_token"
            log.warning("reward model %s: the fast scoring path disagrees with the model's forward (%s vs %s)",
                        name, fast, reference)
        log.warning("reward model %s: scoring with the model's own forward", name)
        return "forward"

    def score_ids(self, sequences: list[list[int]], world: int = 1, rank: int = 0) -> list[float | None]:
        """The reward of every sequence, in length-sorted batches of ``batch_size``. Under ``accelerate launch`` the
        batches are dealt out over ``world`` processes (``distributed.sharded_batches``: the same batches as one
        process makes, so the same rewards) and this process, ``rank``, scores its own: the others' entries are
        None, filled in when the results are gathered."""
        from rlhf_pipeline.distributed import sharded_batches
        from rlhf_pipeline.progress import bars_disabled

        if self.vllm is not None:  # vLLM schedules and batches the sequences itself
            return self.vllm.rewards([s[: pooled_index(s, self.pooling_pad) + 1] for s in sequences])
        rewards: list[float | None] = [None if world > 1 else 0.0] * len(sequences)
        if not sequences:
            return rewards
        if self.mode is None:  # decided on every process alike (on the longest sequence of all)
            self.mode = self._choose_mode(sequences)
        run = self.forward_rewards if self.mode == "forward" else self.fast_rewards
        batches = [b for b in sharded_batches([len(s) for s in sequences], self.batch_size, world, rank) if b]
        with tqdm(total=sum(map(len, batches)), desc="score", unit="seq", disable=rank != 0 or bars_disabled()) as bar:
            for batch in batches:
                for i, value in zip(batch, run([sequences[i] for i in batch])):
                    rewards[i] = value
                bar.update(len(batch))
        return rewards

    def score(self, prompts: list, responses: list[str], world: int = 1, rank: int = 0) -> list[float | None]:
        """The reward of every (prompt, response). A scorer made with ``load_model=False`` loads its model here once
        the conversations are rendered, while the Rust encoder (outside the GIL) encodes them, instead of one after
        the other, and checks the fast path on the first conversation before the encoding ends. The vLLM engine is
        made with the scorer, so there it only encodes."""
        if self.closed:
            raise RuntimeError("this scorer was closed; make a new one")
        if self.model is not None or self.vllm is not None:
            return self.score_ids(self.encode(prompts, responses), world, rank)

        def load() -> None:
            from rlhf_pipeline.chat import encode_conversations

            self.load_model()
            if self.mode is None and prompts:
                self.mode = self._choose_mode(encode_conversations(
                    self.tokenizer, prompts[:1], responses[:1], allow_special_tokens=self.allow_special_tokens))

        return self.score_ids(self.encode(prompts, responses, meanwhile=load), world, rank)

    def close(self) -> None:
        """Free the model (vLLM's engine is shut down), so that the next reward source of a stage has the memory."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None
        self.model = None
        self.closed = True


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


def last_token_rewards(model, input_ids, pooled):
    """(B,) float rewards: ``model.score`` on the final hidden state at ``pooled`` (B,) of right-padded ``input_ids``,
    the body run without an attention mask (causal attention alone keeps pads out of every real position)."""
    import torch

    body = getattr(model, model.base_model_prefix)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    hidden = body(input_ids=input_ids, use_cache=False).last_hidden_state[rows, pooled]
    return reward_from_output(SimpleNamespace(logits=model.score(hidden)))
