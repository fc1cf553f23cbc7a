"""Score every response with a reward model or a python reward function: the body of ``rlhf score`` (also run by
``rlhf eval``).

    rlhf score --input runs/iter_0/generate --output runs/iter_0/score \\
        --reward-model RLHFlow/ArmoRM-Llama3-8B-v0.1 --trust-remote-code --batch-size 16
    rlhf score --input out/gen --output out/scored --reward-fn my_rewards.py:reward
    rlhf score --input out/gen --output out/scored --reward-model runs/rm --reward-fn checks.py:format \\
        --reward-weights 1 0.5      # several sources: rewards_<key> each, rewards = their standardised weighted sum
    accelerate launch --multi_gpu --num_processes 8 -m rlhf_pipeline.stages.score \\
        --input runs/iter_0/generate --output runs/iter_0/score --reward-model runs/rm   # data parallel

Adds ``rewards`` (one float per response) to the generations. A reward model reads each prompt + response as a
conversation rendered with its own chat template (it is another model than the policy, trained on its own layout),
or with ``--chat-template`` (``chat.use_chat_template``; a reward model without a template needs it); the manifest
records the template of each reward model. A NaN or infinite reward stops the stage with an error naming the row;
the output is not written then. Each source's rewards are kept in ``OUTPUT/parts/`` a chunk at a time as they are
made (:class:`_Results`), so the same command run again after a crash scores only the chunks it had not finished.
See ``rlhf_pipeline.rewards`` for the truncation rule and the reward-function signature.

Several reward sources (``--reward-model`` and ``--reward-fn`` each take one or more; repeat the flag, or give a
YAML list) are combined by "normalise, then sum" (``rewards.combine_rewards``)::

    rlhf score --input out/gen --output out/scored --reward-model runs/rm \
        --reward-fn checks.py:format --reward-fn checks.py:length --reward-weights 1 0.5 -0.2

Each source's raw rewards go in a column of their own, ``rewards_<key>`` (:func:`reward_sources` names them), and
``rewards`` is ``sum_k w_k (r_k - mean_k) / (std_k + 1e-6)``, the statistics taken over every response of the
dataset; the manifest records each source's spec, column, weight and statistics. One source alone is not
standardised: ``rewards`` is its raw reward, as it always was.

Verifiable rewards (a final answer checked against the ground truth: ``rlhf_pipeline.rewards.verifiable``'s
``math_equal``, ``exact_match``, ``regex_match``, and the format check ``boxed_format``)::

    rlhf score --input out/gen --output out/scored --reference-column answer \
        --reward-fn rlhf_pipeline.rewards.verifiable:math_equal

``--reference-column NAME`` passes the column NAME (carried from the prompts through ``rlhf generate``) to every
reward function as the keyword ``reference``.
"""

from __future__ import annotations

import sys
import hashlib
import logging
import math
import re
from array import array
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional, Sequence

from tqdm.auto import tqdm

from rlhf_pipeline.attention import DEFAULT_ATTENTION, AttnImplementation, attn_help, check_engine
from rlhf_pipeline.config import (
    DATASET_REF, ChatTemplateOptions, ControlTokenOptions, DtypeName, OutputOptions, option, trust_remote_code_option,
)
from rlhf_pipeline.contracts import (
    GENERATED_COLUMNS,
    GENERATIONS_COLUMNS,
    SAMPLER_LOGPROBS,
    SOURCE_REWARDS_PREFIX,
    require_columns,
    require_types,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.layout import MANIFEST
from rlhf_pipeline.stages import run_stage

log = logging.getLogger(__name__)

# Columns of the generations contract that a reward function does not receive as extra columns.
NOT_PASSED = ("prompt", *GENERATED_COLUMNS, "rewards")
# The kinds of reward source, as their options are named (--reward-model, --reward-fn), in the order their sources
# are combined (and --reward-weights given); the checks, the keys and rlhf iterate's reserved keys follow it.
SOURCE_KINDS = ("reward_model", "reward_fn")


class RewardSource(NamedTuple):
    """One reward source: ``kind`` (``reward_model`` or ``reward_fn``), its ``spec`` (a model, or
    ``module:function``) and its ``key``, which names its column (``rewards_<key>``), its ``rlhf eval`` scorer and
    its part of ``rlhf eval``'s output."""

    kind: str
    spec: str
    key: str

    @property
    def column(self) -> str:
        return SOURCE_REWARDS_PREFIX + self.key

    @property
    def flag(self) -> str:
        return "--" + self.kind.replace("_", "-")


def as_list(value: str | Sequence[str] | None) -> list[str]:
    """A ``--reward-model`` / ``--reward-fn`` value as a list (a config holds one source as a plain string)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def one_or_list(value: str | Sequence[str] | None) -> str | list[str] | None:
    """What a config keeps of a reward option: None, one source as its string (so that a one-source config, its
    manifest and the reuse check read exactly as before several sources existed), or a list of two or more."""
    values = as_list(value)
    return None if not values else values[0] if len(values) == 1 else values


def _source_name(kind: str, spec: str) -> str:
    """A model's directory (or Hub repo) name, a function's name; made of letters, digits and ``_``."""
    raw = Path(spec.rstrip("/\\")).name if kind == "reward_model" else spec.rpartition(":")[2]
    return re.sub(r"[^0-9A-Za-z_]+", "_", raw).strip("_") or "source"


def reward_sources(reward_model: str | Sequence[str] | None, reward_fn: str | Sequence[str] | None) -> list[RewardSource]:
    """The reward sources in their fixed order, the reward models then the functions, each in the order given (the
    order of ``--reward-weights``), with their keys: the kind alone (``reward_model``, ``reward_fn``) for the only
    source of its kind, else ``<kind>_<name>`` with the name of :func:`_source_name`
    (``reward_fn_format``); a name taken already gets ``_2``, ``_3``, ... in order. So one reward model and one
    function give ``rewards_reward_model`` and ``rewards_reward_fn``, the columns ``rlhf eval`` has always written."""
    sources: list[RewardSource] = []
    taken: set[str] = set()
    for kind, specs in zip(SOURCE_KINDS, (as_list(reward_model), as_list(reward_fn))):
        for spec in specs:
            key = kind if len(specs) == 1 else f"{kind}_{_source_name(kind, spec)}"
            base, k = key, 2
            while key in taken:
                key, k = f"{base}_{k}", k + 1
            taken.add(key)
            sources.append(RewardSource(kind, spec, key))
    return sources


def check_reward_options(reward_model, reward_fn, reward_weights, *, exactly_one_kind: bool = False) -> None:
    """The checks shared by rlhf score and rlhf eval (ValueErrors, one line each): at least one source, no source
    twice, and ``reward_weights`` one finite number per source, not all 0, given only with several sources."""
    models, fns = as_list(reward_model), as_list(reward_fn)
    if not models and not fns:
        raise ValueError("give a reward source: --reward-model, --reward-fn, or several of them")
    for kind, specs in zip(SOURCE_KINDS, (models, fns)):
        flag = "--" + kind.replace("_", "-")
        twice = sorted({s for s in specs if specs.count(s) > 1})
        if twice:
            raise ValueError(f"{flag} {twice[0]} is given twice; give each reward source once (weigh it with "
                             "--reward-weights)")
    count = len(models) + len(fns)
    if reward_weights is None:
        return
    if count == 1:
        raise ValueError("--reward-weights weighs several reward sources; with one source the rewards are its own, "
                         "unscaled, so drop --reward-weights")
    if len(reward_weights) != count:
        order = ", ".join(f"{s.flag} {s.spec}" for s in reward_sources(models, fns))
        raise ValueError(f"--reward-weights has {len(reward_weights)} value(s) for {count} reward sources; give one "
                         f"per source, in this order: {order}")
    bad = [w for w in reward_weights if not math.isfinite(w)]
    if bad:
        raise ValueError(f"--reward-weights must be finite numbers, got {bad[0]}")
    if all(w == 0 for w in reward_weights):
        raise ValueError("--reward-weights are all 0, which makes every reward 0; give at least one source a weight")


@dataclass(kw_only=True)
class ScoreConfig(ChatTemplateOptions, ControlTokenOptions, OutputOptions):
    """Score every response with a reward model or a python reward function (or several, combined)."""

    input: str = option(help=f"Generations dataset (the output of rlhf generate or rlhf merge): {DATASET_REF}.",
                        semantic=False)
    # One source is kept as a plain string (one_or_list), as it was before several existed: its manifest and the
    # reuse check of existing outputs are unchanged.
    reward_model: Optional[list[str]] = option(
        None, help="Sequence-classification reward model (local directory or Hub id); several combine (repeat the "
        "flag, or a YAML list)."
    )
    reward_fn: Optional[list[str]] = option(
        None, help="Python reward function as module:function or path/to/file.py:function; several combine."
    )
    reward_weights: Optional[list[float]] = option(
        None, help="With several reward sources: one weight per source, the reward models first, then the functions, "
        "each in the order given (default 1 each). rewards = sum of weight * (r - mean) / (std + 1e-6) per source, "
        "the statistics over every response of the dataset; each source's raw rewards go in rewards_<key>."
    )
    batch_size: int = option(16, help="Sequences per reward-model forward; responses per reward-function call.")
    max_length: int = option(4096, help="Reward model: conversations longer than this keep their first tokens.")
    dtype: DtypeName = option(
        "auto", help="Reward model dtype; auto = bfloat16 on a GPU that supports it, float32 on a CPU."
    )
    engine: Literal["hf", "vllm"] = option(
        "hf",
        help="Reward model engine: hf (transformers, length-sorted batches) or vllm (vLLM's pooling runner; needs "
        "the vLLM environment and a model vLLM supports as a sequence classifier).",
        semantic=False,  # the same rewards either way (tests/vllm_env): a scored output is reused across engines
    )
    attn_implementation: AttnImplementation = option(
        DEFAULT_ATTENTION, help=attn_help("hf engine: the reward model's", "vLLM picks its own."),
        semantic=False,
    )
    trust_remote_code: bool = trust_remote_code_option(note=" (ArmoRM needs it)")
    reference_column: Optional[str] = option(
        None, help="The column holding each prompt's ground truth (carried from the prompt dataset through rlhf "
        "generate), passed to reward functions as the keyword 'reference' (see rlhf_pipeline.rewards.verifiable); "
        "default: the functions read a column named reference, answer, solution or ground_truth."
    )
    sampled_ids: bool = option(
        False, help="Reward model: read each conversation as the token ids the policy sampled (prompt_token_ids, "
        "the response_token_ids up to the stop token, then the template's end of turn), with no rendering or "
        "tokenization. For a reward model that shares the policy's tokenizer and chat template: each chunk's first "
        "prompts, rendered with the reward model's template, must give the stored prompt_token_ids."
    )

    def __post_init__(self) -> None:
        self.reward_model = one_or_list(self.reward_model)
        self.reward_fn = one_or_list(self.reward_fn)
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]
        check_reward_options(self.reward_model, self.reward_fn, self.reward_weights)
        if self.engine == "vllm" and self.reward_model is None:
            raise ValueError("--engine vllm scores with a --reward-model; a --reward-fn runs in python")
        check_engine(self.attn_implementation, self.engine, error=ValueError)
        if self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.max_length < 1:
            raise ValueError("--max-length must be at least 1")
        if self.sampled_ids and self.reward_model is None:
            raise ValueError("--sampled-ids is how a --reward-model reads the conversations; give one")

    @property
    def sources(self) -> list[RewardSource]:
        return reward_sources(self.reward_model, self.reward_fn)

    @property
    def weights(self) -> list[float]:
        return list(self.reward_weights) if self.reward_weights is not None else [1.0] * len(self.sources)


def _check_generations(ds, source: str, sources: Sequence[RewardSource] = ()) -> str:
    from rlhf_pipeline.chat import check_message_roles, prompt_column

    require_columns(ds, GENERATIONS_COLUMNS, source, "score takes the output of rlhf generate")
    require_types(ds, {"responses": "list of text"}, source, "score takes the output of rlhf generate")
    if "rewards" in ds.column_names:
        raise PipelineError(f"{source}: already has a 'rewards' column (already scored?)")
    _check_responses(ds, source)
    if len(sources) > 1:
        taken = [s.column for s in sources if s.column in ds.column_names]
        if taken:
            raise PipelineError(f"{source}: already has a '{taken[0]}' column, where rlhf score would put the rewards "
                                "of a source (already scored?); remove or rename that column")
    column = prompt_column(ds, source)
    check_message_roles(ds, column, source)
    return column


def _check_responses(ds, source: str) -> None:
    """Every response is text, and the per-response columns a row has hold one entry per response: generations made
    elsewhere that do not fail here, naming the row, rather than inside a reward function. Read with Arrow's list
    lengths: no token list is decoded."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")
    responses = table["responses"]
    counts = pc.list_value_length(responses).to_pylist()
    if None in counts:
        raise PipelineError(f"{source}: row {counts.index(None)}: 'responses' is null; give it a list of texts or drop "
                            "the row")
    if pc.list_flatten(responses).null_count:
        row = next(i for i, rs in enumerate(ds["responses"]) if any(r is None for r in rs))
        raise PipelineError(f"{source}: row {row} has a response that is null; give it a text or drop the row")
    if counts and not any(counts):
        raise PipelineError(f"{source}: no row has a response; score the output of rlhf generate")
    for column in ("response_token_ids", "finish_reasons", SAMPLER_LOGPROBS):
        if column in ds.column_names:
            for row, (n, m) in enumerate(zip(counts, pc.list_value_length(table[column]).to_pylist())):
                if m is None and n:
                    raise PipelineError(f"{source}: row {row}: '{column}' is null; give each of its {n} responses "
                                        "an entry, or drop the row")
                if m is not None and n != m:
                    raise PipelineError(f"{source}: row {row} has {n} responses but {m} entries in '{column}'; give "
                                        "every response one")


def check_reference_column(ds, source: str, name: str | None, carried: str, fns=()) -> None:
    """A ``--reference-column`` that ``ds`` (read from ``source``) lacks is one line: the columns it has, and the fix
    (``carried`` says how the column gets there). Without one, a reward function of ``fns`` that reads a ground truth
    (``needs_reference``: the verifiable rewards) given data with none of the columns it looks for is that error,
    before any response is sampled or scored."""
    if name is None:
        from rlhf_pipeline.rewards.verifiable import REFERENCE_COLUMNS, no_reference

        for fn in fns:
            if getattr(fn, "needs_reference", False) and not set(REFERENCE_COLUMNS) & set(ds.column_names):
                raise no_reference(getattr(fn, "__name__", "the reward function"), ds.column_names, source)
    if name is not None and name not in ds.column_names:
        raise PipelineError(
            f"{source}: has no column '{name}' for --reference-column (its columns: {', '.join(ds.column_names)}); "
            f"give the prompts a '{name}' column ({carried} the prompt dataset's columns) or name the column that "
            "holds the ground truth"
        )


def _check_not_a_shard(ref) -> None:
    """Several sources are standardised with statistics over the whole dataset: a shard's statistics are not the
    whole run's, so separately scored shards would each be on a scale of their own. Refused; merge first."""
    from rlhf_pipeline.datasets_io import read_manifest

    shard = ((read_manifest(ref) or {}).get("shard") or {}).get("spec")
    if shard:
        raise PipelineError(
            f"{ref.name}: is shard {shard} of a generate run; several reward sources are standardised with "
            "statistics over the whole dataset, which one shard does not have: rlhf merge the shards, then score the "
            "merged output"
        )


def _rows_text(first: int, last: int) -> str:
    return f"row {first}" if first == last else f"rows {first}..{last}"


class _SourceScorer:
    """One reward source's rewards on this process, a chunk of responses at a time (:func:`_chunks`): its share of
    the chunk, or the whole chunk in one process (see :func:`score`). A reward model is loaded at the first chunk
    this run scores, not before: a rerun whose chunks were all finished loads nothing. The texts are read from the
    data a slice at a time."""

    def __init__(self, source: RewardSource, fn, config: ScoreConfig, work: _Work, todo: list[tuple[int, int]],
                 accelerator=None):
        from rlhf_pipeline.distributed import world_and_rank

        self.source, self.fn, self.config, self.work = source, fn, config, work
        self.world, self.rank = world_and_rank(accelerator)
        self.device = None if accelerator is None else accelerator.device
        self.todo = todo
        self.scorer = self.bar = self.table = None
        self.truncated = 0  # by the last chunk

    def chunk(self, start: int, end: int) -> list[float | None]:
        """The rewards of the responses ``start..end`` of ``work.locations``: None for those another process
        scores."""
        if self.source.kind == "reward_model":
            return self._model_chunk(start, end)
        return self._fn_chunk(start, end)

    def note(self) -> dict[str, Any]:
        """What a kept chunk records besides its rewards (:func:`scorer_identity`, and the source's part of the
        manifest)."""
        note = dict(self.work.made_by[self.source.key])
        if self.scorer is not None:
            note.update(truncated=self.truncated, chat_template=self.scorer.chat_template.record(),
                        engine=self.config.engine)
        return note

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()  # before the next source loads its model
        if self.bar is not None:
            self.bar.close()

    def _model_chunk(self, start: int, end: int) -> list[float | None]:
        from rlhf_pipeline.chat import ChatTemplateRefused
        from rlhf_pipeline.rewards import RewardModelScorer

        config, work = self.config, self.work
        if self.scorer is None:
            self.scorer = RewardModelScorer(
                self.source.spec,
                dtype=config.dtype,
                trust_remote_code=config.trust_remote_code,
                batch_size=config.batch_size,
                max_length=config.max_length,
                engine=config.engine,
                attn_implementation=config.attn_implementation,
                device=self.device,
                load_model=config.sampled_ids,  # else score() loads it while the conversations are encoded
                allow_special_tokens=config.allow_special_tokens_in_text,
                chat_template=config.chat_template,
            )
            if self.scorer.chat_template.text is None and work.column == "messages" and not config.sampled_ids:
                from rlhf_pipeline.chat import raw_conversation_error

                raise raw_conversation_error(config.input, work.locations[0][0])
        scorer, before = self.scorer, self.scorer.truncated
        scorer.mode = None  # the fast path is checked on each chunk's first conversation
        locations = work.locations[start:end]
        if config.sampled_ids:
            sequences = _sampled_sequences(scorer.tokenizer, work.ds, work.column, locations,
                                           config.allow_special_tokens_in_text, config.input, self.source.spec)
            values = scorer.score_ids(scorer.truncate(sequences), self.world, self.rank)
        else:
            try:
                values = scorer.score(*_texts(work.ds, work.column, locations), self.world, self.rank)
            except ChatTemplateRefused as e:  # its index counts the chunk's responses
                raise e.at(config.input, work.locations[start + e.index][0]) from None
        self.truncated = scorer.truncated - before  # every process encodes the whole chunk: the same count
        return values

    def _fn_chunk(self, start: int, end: int) -> list[float | None]:
        from rlhf_pipeline.chat import as_text
        from rlhf_pipeline.progress import bars_disabled
        from rlhf_pipeline.rewards import call_reward_fn

        config, ds, column, size = self.config, self.work.ds, self.work.column, self.config.batch_size
        passed = [c for c in ds.column_names if c not in NOT_PASSED]
        reference = config.reference_column  # checked by _read: the dataset has it
        if self.bar is None:  # the source's first chunk: the columns its calls read, and one bar for all its chunks
            read = [*passed, column, "responses", *(["finish_reasons"] if "finish_reasons" in ds.column_names else []),
                    *([reference] if reference else [])]
            self.table = ds.select_columns(list(dict.fromkeys(read)))
            batches = sum(len(range(s, e, size)[self.rank :: self.world]) for s, e in self.todo)
            self.bar = tqdm(total=batches, desc="score (fn)", unit="batch",
                            disable=self.rank != 0 or bars_disabled())
        table = self.table
        values: list[float | None] = [None] * (end - start)
        # The chunk's batches dealt out in turn over the processes: a chunk holds whole batches (_chunks), so each
        # call sees the responses it would see in one process, and a function of the whole batch gives the same
        # rewards however many processes run.
        for first_response in range(start, end, size)[self.rank :: self.world]:
            batch_end = min(first_response + size, end)
            chunk = self.work.locations[first_response:batch_end]
            first, last = chunk[0][0], chunk[-1][0]
            where = f"{_rows_text(first, last)} (batch of {len(chunk)} response{'s' * (len(chunk) > 1)})"
            part = table[first : last + 1]  # this batch's rows only
            columns = {c: [part[c][row - first] for row, _ in chunk] for c in passed}
            if "finish_reasons" in part:
                columns["finish_reasons"] = [part["finish_reasons"][row - first][j] for row, j in chunk]
            if reference:  # the named column as "reference", in place of any column of that name
                columns["reference"] = [part[reference][row - first] for row, _ in chunk]
            values[first_response - start : batch_end - start] = call_reward_fn(
                self.fn,
                [as_text(part[column][row - first]) for row, _ in chunk],
                [part["responses"][row - first][j] for row, j in chunk],
                columns,
                name=self.source.spec,
                where=where,
            )
            self.bar.update()
        return values


def scorer_identity(source: RewardSource) -> dict[str, Any]:
    """What a kept chunk of ``source``'s rewards must record for a rerun to reuse it, taken as the run starts: the
    source, a function's file (``rewards.code_digest``) and a local reward model's files
    (``files.directory_signature``; a model an ``rlhf train-rm`` run wrote again is caught as ``used_outputs`` too).
    A Hub model is its id alone."""
    from rlhf_pipeline.files import directory_signature
    from rlhf_pipeline.rewards import code_digest

    if source.kind == "reward_fn":
        return {"spec": source.spec, "code": code_digest(source.spec)}
    # not its manifest, which an upload that was pending (--push-to-hub) rewrites
    return {"spec": source.spec, "model_files": directory_signature(source.spec, skip=(MANIFEST,))}


class _Results:
    """The main process's side of a scoring run: each source's rewards, chunk by chunk as they are gathered from
    the processes, each chunk checked and kept in ``OUTPUT/parts/`` (``datasets_io.OutputParts``) so that a rerun
    of a run that stopped scores only the chunks it had not finished; then the output, written at the end."""

    def __init__(self, config: ScoreConfig, work: _Work, chunks: list[list[tuple[int, int]]]):
        from datasets import Features, Value

        from rlhf_pipeline.datasets_io import OutputParts

        self.config, self.work, self.sources = config, work, config.sources
        self.rewards = [array("d", [math.nan]) * len(work.locations) for _ in self.sources]
        self.notes: list[list[dict[str, Any]]] = [[] for _ in self.sources]
        self.parts = OutputParts(work.out, Features({"rewards": Value("float64")}))
        self.finished: set[str] = set()
        stale = 0
        for k, (source, bounds) in enumerate(zip(self.sources, chunks)):
            keys = [_chunk_key(source, start, end) for start, end in bounds]
            made_by = work.made_by[source.key]
            for (start, end), (key, found) in zip(bounds, self.parts.finished(keys).items()):
                if found is None:
                    continue
                values, note = found[0]["rewards"], found[1]
                if len(values) != end - start or any(note.get(f) != v for f, v in made_by.items()):
                    stale += 1  # a function's file edited since, a model directory replaced: scored again
                    continue
                self.rewards[k][start:end] = array("d", values)
                self.notes[k].append(note)
                self.finished.add(key)
        if self.finished or stale:
            total = sum(map(len, chunks))
            print(f"[score] {work.out.path}: reusing {len(self.finished)} of {total} chunks an interrupted run "
                  f"finished" + (f"; {stale} made by an earlier version of a reward source are scored again"
                                 if stale else ""))

    def keep(self, k: int, start: int, end: int, shares: list[list[float | None]], note: dict[str, Any]) -> None:
        """Source ``k``'s rewards of the responses ``start..end``, from each process's share: checked, kept."""
        from rlhf_pipeline.rewards import first_non_finite

        source, work = self.sources[k], self.work
        merged = array("d", [math.nan]) * (end - start)
        for share in shares:
            for i, value in enumerate(share):
                if value is not None:
                    merged[i] = value
        bad = first_non_finite(merged)
        if bad is not None:
            row, j = work.locations[start + bad]
            what = "reward model" if source.kind == "reward_model" else "reward function"
            raise PipelineError(
                f"{work.ref.name}: row {row} (prompt_id {work.ds[row]['prompt_id']}), response {j}: the {what} "
                f"{source.spec} returned {merged[bad]}; rewards must be finite numbers, so fix the reward (the "
                "output was not written)"
            )
        self.parts.keep(_chunk_key(source, start, end), {"rewards": merged.tolist()}, note)
        self.rewards[k][start:end] = merged
        self.notes[k].append(note)

    def write(self, processes: int) -> None:
        records = []
        for source, notes in zip(self.sources, self.notes):
            if source.kind == "reward_model":  # the engines of all chunks (rlhf score --engine: the same rewards)
                engines = ", ".join(sorted({n.get("engine", self.config.engine) for n in notes}))
                records.append({"reward_model": source.spec, "engine": engines or self.config.engine,
                                "truncated_sequences": sum(n["truncated"] for n in notes),
                                "chat_template": notes[-1]["chat_template"] if notes else None})
            else:
                records.append({"reward_fn": source.spec})
        _write(self.config, self.work, self.rewards, records, processes)

    def close(self) -> None:
        self.parts.close()


# A reward function's responses per kept chunk, rounded up to whole batches, and at least FN_CHUNK_BATCHES batches so
# that up to that many processes each get work in every chunk whatever --batch-size is (a reward model's chunks are
# CHUNK_ROWS rows of responses). Neither depends on the number of processes: a rerun with another reuses the chunks.
FN_CHUNK_RESPONSES = 8192
FN_CHUNK_BATCHES = 64


def _chunks(source: RewardSource, config: ScoreConfig, locations: Locations) -> list[tuple[int, int]]:
    """[start, end) ranges of the flattened responses that ``source`` scores and keeps one at a time: a reward
    model's of :data:`CHUNK_ROWS` rows (its batches are length-sorted within one), a function's of whole batches."""
    if source.kind == "reward_model":
        return _row_chunks(locations, CHUNK_ROWS)
    size = config.batch_size * max(-(-FN_CHUNK_RESPONSES // config.batch_size), FN_CHUNK_BATCHES)
    return [(start, min(start + size, len(locations))) for start in range(0, len(locations), size)]


def _chunk_key(source: RewardSource, start: int, end: int) -> str:
    return f"{source.key}-{start:010d}-{end:010d}"


def _per_row(flat: Sequence[float], locations: Locations, num_rows: int):
    """The rewards as a column of one list per row (an Arrow list array made from the flat values and the rows'
    offsets: no Python list per row, no Python float per reward)."""
    import numpy as np
    import pyarrow as pa

    offsets = np.zeros(num_rows + 1, dtype=np.int64)
    np.add.at(offsets, np.frombuffer(locations.rows, dtype=np.int64) + 1, 1)
    values = np.frombuffer(flat, dtype=np.float64) if isinstance(flat, array) else np.asarray(flat, dtype=np.float64)
    return pa.ListArray.from_arrays(pa.array(np.cumsum(offsets)), pa.array(values))


class Locations:
    """Where each response is, ``(row, j)``, indexed by the flattened response: two int arrays (12 bytes a response,
    where a list of tuples takes about 100), sliced, indexed and iterated like the list of tuples they stand for."""

    __slots__ = ("rows", "js")

    def __init__(self, rows: array | None = None, js: array | None = None):
        self.rows = array("q") if rows is None else rows
        self.js = array("i") if js is None else js

    def extend(self, first_row: int, counts: Sequence[int]) -> None:
        for k, n in enumerate(counts):
            self.rows.extend(repeat(first_row + k, n))
            self.js.extend(range(n))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Locations(self.rows[i], self.js[i])
        return self.rows[i], self.js[i]

    def __iter__(self):
        return zip(self.rows, self.js)


class _Work(NamedTuple):
    """What every process of a scoring run reads before it scores: the output, the data (memory-mapped, read a slice
    at a time), its prompt column, and where each response is (``locations``: (row, j), one per response)."""

    out: Any
    ref: Any
    ds: Any
    fns: dict[str, Any]
    locations: Locations
    column: str
    made_by: dict[str, dict[str, Any]]  # each source's :func:`scorer_identity`, by key


# Rows whose texts a reward model encodes and scores at a time: the stage's memory does not grow with the dataset
# (the encoded sequences of a chunk, not of every response, are held; batches are length-sorted within a chunk).
CHUNK_ROWS = 2048


def _texts(ds, column: str, locations: Locations) -> tuple[list, list[str]]:
    """The prompt and the response text of each (row, j) of ``locations`` (consecutive rows), read from one slice."""
    first = locations[0][0]
    part = ds.select_columns([column, "responses"])[first : locations[-1][0] + 1]
    return ([part[column][row - first] for row, _ in locations],
            [part["responses"][row - first][j] for row, j in locations])


SAMPLED_IDS_CHECKED = 8  # --sampled-ids: prompts per chunk whose stored ids are checked against the reward model's


def _sampled_sequences(tokenizer, ds, column: str, locations: Locations, allow_special_tokens: bool,
                       data: str, reward_model: str) -> list[list[int]]:
    """``--sampled-ids``: each (row, j) of ``locations`` as the policy's ids, ``prompt_token_ids`` + the response's
    ``response_token_ids`` without the stop token it ended on + what the reward model's template writes after a
    response (its end of turn: ``<|eot_id|>``, ``<|im_end|>\\n``). That is the text path's input wherever
    re-tokenizing a response gives the ids it was sampled as, without rendering or encoding anything; the policy's
    sampled ids are what the reward model reads otherwise, special ids it sampled included.

    The reward model must share the policy's tokenizer and template: the chunk's first :data:`SAMPLED_IDS_CHECKED`
    prompts are rendered with the reward model's and must give the stored ids, and its template must render a
    prompt as the start of the conversation (Mistral's does not), else this is a PipelineError."""
    from rlhf_pipeline.chat import ChatTemplateRefused, encode_conversations, encode_prompts

    require_columns(ds, ("prompt_token_ids", "response_token_ids", "finish_reasons"), data,
                    "--sampled-ids reads the token ids rlhf generate stores")
    first = locations[0][0]
    part = ds.select_columns([column, "prompt_token_ids", "response_token_ids", "finish_reasons"])[
        first : locations[-1][0] + 1]
    prompt_ids, response_ids, finish = part["prompt_token_ids"], part["response_token_ids"], part["finish_reasons"]
    rows = sorted({row for row, _ in locations})[:SAMPLED_IDS_CHECKED]
    prompts = [part[column][row - first] for row in rows]
    try:
        rendered = encode_prompts(tokenizer, prompts, allow_special_tokens=allow_special_tokens)
    except ChatTemplateRefused as e:
        raise e.at(data, rows[e.index]) from None
    for row, ids in zip(rows, rendered):
        if ids != list(prompt_ids[row - first]):
            raise PipelineError(
                f"{reward_model}: its tokenizer and chat template render row {row}'s prompt as other ids than the "
                "policy's (prompt_token_ids); --sampled-ids needs a reward model that shares both: score without it"
            )
    (whole,) = encode_conversations(tokenizer, prompts[:1], [""], allow_special_tokens=allow_special_tokens)
    if whole[: len(rendered[0])] != rendered[0] or len(whole) == len(rendered[0]):
        raise PipelineError(f"{reward_model}: its chat template does not render a prompt as the start of the "
                            "conversation, so the sampled ids cannot be read as one; score without --sampled-ids")
    close = whole[len(rendered[0]):]
    return [list(prompt_ids[row - first])
            + list(response_ids[row - first][j][: -1 if finish[row - first][j] == "stop" else None]) + close
            for row, j in locations]


def _row_chunks(locations: Locations, rows: int) -> list[tuple[int, int]]:
    """[start, end) ranges of ``locations`` that cover ``rows`` rows each (the last fewer)."""
    from bisect import bisect_left

    bounds, start = [], 0
    while start < len(locations):
        end = bisect_left(locations.rows, locations.rows[start] + rows, lo=start)
        bounds.append((start, end))
        start = end
    return bounds


def _read(config: ScoreConfig, processes: int) -> _Work | None:
    """Check the sources and the input, and read the responses; None when the output holds this run already."""
    if config.engine == "vllm" and processes > 1:
        raise PipelineError("rlhf score --engine vllm runs in one process (vLLM batches and schedules the sequences "
                            "itself); run it without accelerate launch, or score with --engine hf")
    from rlhf_pipeline.attention import check_attn_implementation
    from rlhf_pipeline.datasets_io import StageOutput, load_dataset_ref, parse_ref
    from rlhf_pipeline.modeling import check_reward_model
    from rlhf_pipeline.rewards import load_reward_fn

    # The reward sources first: a mistyped model or function fails before the data is read (and a model's own code
    # that was not allowed, or a causal LM, before any of it is loaded).
    sources = config.sources
    fns = {}
    for source in sources:
        if source.kind == "reward_model":
            check_reward_model(source.flag, source.spec, config.trust_remote_code)
            check_attn_implementation(config.attn_implementation)
        else:
            fns[source.key] = load_reward_fn(source.spec)
    ref = parse_ref(config.input)
    if len(sources) > 1:
        _check_not_a_shard(ref)
    out = StageOutput("score", config, inputs=[ref])
    if out.done(resume=True):  # an interrupted run with these options goes on from its finished chunks
        return None
    ds = load_dataset_ref(ref)
    column = _check_generations(ds, ref.name, sources)
    check_reference_column(ds, ref.name, config.reference_column, "rlhf generate carries", fns.values())

    # One entry per response, (row, j) locating each: the counts come from the Arrow list lengths, a slice of rows at
    # a time, so no text is read here (the texts are read a slice at a time as they are scored).
    import pyarrow.compute as pc

    locations = Locations()
    first = 0
    for part in ds.select_columns(["responses"]).with_format("arrow").iter(batch_size=CHUNK_ROWS):
        counts = [n or 0 for n in pc.list_value_length(part["responses"]).to_pylist()]
        locations.extend(first, counts)
        first += len(counts)
    return _Work(out, ref, ds, fns, locations, column, {source.key: scorer_identity(source) for source in sources})


def main(config: ScoreConfig) -> Path:
    """``rlhf score``: in one process, or under ``accelerate launch --num_processes N`` (see :func:`score`)."""
    from rlhf_pipeline.distributed import run_inference

    return run_inference("rlhf score", lambda accelerator: score(config, accelerator))


def score(config: ScoreConfig, accelerator=None) -> Path:
    """Score and write the output. With an ``accelerator`` of several processes (``rlhf score`` under
    ``accelerate launch``, or ``rlhf eval``'s scoring there) every process reads the input and scores its share of
    each chunk's batches (length-sorted for a reward model, in order for a function; the same batches as one
    process makes); each chunk's shares are gathered in the original order, and the main process checks the chunk,
    keeps it (``OUTPUT/parts/``: a rerun of a run that stopped scores only the chunks it had not finished) and at
    the end writes the output alone. A failure on any process fails them all, with one error from the main process.
    The manifest records the number of processes, which does not change the rewards (a rerun with another number
    reuses the output, and an interrupted run's chunks)."""
    from rlhf_pipeline.distributed import gather_guarded, guarded, on_main_process, world_and_rank

    world, _ = world_and_rank(accelerator)
    work = guarded(accelerator, lambda: _read(config, world))
    if work is None:
        return Path(config.output).expanduser()
    sources = config.sources
    chunks = [_chunks(source, config, work.locations) for source in sources]
    main = accelerator is None or accelerator.is_main_process
    results: _Results | None = None

    def open_results() -> list[str] | None:
        nonlocal results
        if main:
            results = _Results(config, work, chunks)
            return sorted(results.finished)
        return None

    try:
        finished = set(gather_guarded(accelerator, open_results)[0])  # the main process's, on every process
        for k, source in enumerate(sources):
            todo = [(start, end) for start, end in chunks[k] if _chunk_key(source, start, end) not in finished]
            if not todo:
                continue
            scorer = _SourceScorer(source, work.fns.get(source.key), config, work, todo, accelerator)
            try:
                for start, end in todo:
                    shares = gather_guarded(accelerator, lambda: scorer.chunk(start, end))
                    on_main_process(accelerator, lambda: results.keep(k, start, end, shares, scorer.note()))
            finally:
                scorer.close()
        # the others wait, and fail with the main process if it fails
        on_main_process(accelerator, lambda: results.write(world))
    finally:
        if results is not None:
            results.close()
    return work.out.path


def _write(config: ScoreConfig, work: _Work, per_source: list[array], records: list[dict[str, Any]],
           processes: int) -> None:
    """Combine several sources, and write the scored dataset (the main process only; every reward was checked as
    its chunk was kept)."""
    from datasets import List, Value

    from rlhf_pipeline.datasets_io import find_in_lineage
    from rlhf_pipeline.rewards import STANDARDIZE_EPS, combine_rewards

    sources, ds, ref, locations = config.sources, work.ds, work.ref, work.locations
    # An explicit fingerprint (from the input's and the rewards' bytes): datasets would otherwise hash the whole
    # reward list with dill, which takes longer than writing it.
    digest = hashlib.sha256(f"{ds._fingerprint}:rewards:".encode())
    feature = List(Value("float64"))
    if len(sources) == 1:  # the raw rewards, not standardised: one source scores as it always has
        (flat,), (reward,) = per_source, records
        result = ds
        if len(flat) > 1 and min(flat) == max(flat):
            (source,) = sources
            log.warning("%s %s gave every one of the %d responses %r: no response is preferred to another, so "
                        "training on them teaches nothing; check the reward (a verifiable reward needs each prompt's "
                        "answer, --reference-column, in the form it extracts)", source.flag, source.spec, len(flat),
                        flat[0])
    else:
        flat, stats = combine_rewards(per_source, config.weights)
        reward = {"sources": [], "combination": "sum_k weight_k * (r_k - mean_k) / (std_k + eps)",
                  "eps": STANDARDIZE_EPS}
        result = ds
        for source, values, record, weight, st in zip(sources, per_source, records, config.weights, stats):
            digest.update(f"{source.column}:{weight!r}:".encode())
            digest.update(array("d", values).tobytes())
            result = result.add_column(source.column, _per_row(values, locations, ds.num_rows), feature=feature,
                                       new_fingerprint=digest.copy().hexdigest()[:32])
            reward["sources"].append({"key": source.key, "column": source.column, **record, "weight": weight,
                                      **st.as_dict()})
            line = f"[score] {source.column} ({source.spec}): weight {weight:g}, mean {st.mean:.4g}, std {st.std:.4g}"
            print(line + (" (all equal: it adds 0 to every reward)" if st.constant else ""))
            if st.constant:
                log.warning("%s %s gave every response %r: it carries no preference, and adds 0 to every reward",
                            source.flag, source.spec, values[0])
        digest.update(b"combined:")
    digest.update(array("d", flat).tobytes())
    result = result.add_column("rewards", _per_row(flat, locations, ds.num_rows), feature=feature,
                               new_fingerprint=digest.hexdigest()[:32])
    sampling = find_in_lineage([ref], "sampling")
    # each source's files or code as the run started (scorer_identity): an evaluation reused as a baseline is scored
    # again when its scorer has changed since (rlhf eval)
    work.out.save(result, rows_in=ds.num_rows, extra={"reward": reward, "sampling": sampling, "processes": processes,
                                                      "scored_by": list(work.made_by.values())})


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(ScoreConfig, main, "rlhf score", argv)


if __name__ == "__main__":
    sys.exit(cli())
