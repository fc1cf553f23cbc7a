"""Build training data from scored generations: length filters; best/worst pairs, whole groups, unpaired responses or
each prompt's best; train/test split.

    rlhf filter --input runs/iter_0/score --output runs/iter_0/filter --tokenizer meta-llama/Meta-Llama-3-8B-Instruct \\
        --mode pairs --max-prompt-tokens 1024 --max-response-tokens 2048 --test-size 1000
    rlhf filter --input out/scored --output out/groups --tokenizer models/tiny-policy --mode groups --test-size 0.1
    rlhf filter --input out/scored --output out/unpaired --tokenizer models/tiny-policy --mode unpaired  # KTO

Lengths are measured on the token ids the engine saw and sampled, so nothing is re-tokenized. Scored data from
elsewhere without token ids is tokenized here (prompt with the chat template, each response in its conversation,
ending as sampling ends it: with the template's turn end, or none when cut at the token limit): the template is
``--chat-template``, else the one the generate manifest records, else the tokenizer's own, and one that differs
from what the sampler recorded is refused (``_chat_template``). Rows dropped per reason go in the manifest. The
work runs as one batched ``datasets.map`` over ``--num-proc`` processes. Output: ``train`` and
``test`` splits of the pairs, groups or unpaired contract (``rlhf_pipeline.contracts``; unpaired mode: see
``filter_unpaired``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import (
    DATASET_REF, ChatTemplateOptions, ControlTokenOptions, OutputOptions, check_test_size, option,
    trust_remote_code_option,
)
from rlhf_pipeline.contracts import (
    BEST,
    CHOSEN_REJECTED_COLUMNS,
    GROUPS,
    PAIRS,
    PER_RESPONSE_COLUMNS,
    SAMPLER_LOGPROBS,
    SAMPLER_LOGPROBS_OUT,
    SCORED_COLUMNS,
    UNPAIRED_COLUMNS,
    SCORED_KINDS,
    TRAINING_DATA_KINDS,
    UNPAIRED,
    check_prompt_ids,
    require_columns,
    require_token_ids,
    require_types,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.selection import LengthLimits, OverlongPenalty, decide_group, decide_pair, split_by_prompt
from rlhf_pipeline.selection import decide_unpaired, mismatched_partners


@dataclass(kw_only=True)
class FilterConfig(ChatTemplateOptions, ControlTokenOptions, OutputOptions):
    """Length-filter scored generations and build pairs (REBEL, DPO family), groups (PPO family), unpaired responses
    (KTO) or each prompt's best response (RAFT)."""

    input: str = option(help=f"Scored dataset (the output of rlhf score): {DATASET_REF}.", semantic=False)
    tokenizer: str = option(help="The policy's tokenizer (checks token ids; tokenizes data that has none).")
    mode: Literal[TRAINING_DATA_KINDS] = option(  # type: ignore[valid-type]
        PAIRS, help="pairs: best vs worst response; groups: all n; unpaired (KTO): one row per response, desirable "
        "above its prompt's mean reward, undesirable below it (--test-size then counts prompts); best (rejection "
        "sampling, RAFT): each prompt's best response, as SFT data on its sampled token ids."
    )
    max_prompt_tokens: int = option(1024, help="Drop prompts longer than this many tokens.")
    max_response_tokens: int = option(2048, help="Leave out responses longer than this many tokens.")
    drop_truncated: bool = option(False, help="Leave out responses that hit the token limit (finish 'length').")
    test_size: float = option(1000, help="Test split: a count of prompts, or a fraction of them when below 1; a "
                              "prompt's rows go to one side, chosen by a seeded hash of its prompt_id.")
    seed: int = option(0, help="Seed of the train/test split.")
    num_proc: int = option(0, help="Worker processes; 0 = one per CPU core for large inputs.", semantic=False)
    drop_uniform_groups: bool = option(
        False, help="groups: leave out prompts whose rewards are all equal (their group advantages are all 0; "
        "DAPO's dynamic sampling). Counted in the manifest as uniform_rewards."
    )
    overlong_buffer: int = option(
        0, help="DAPO's soft overlong penalty: over the last N tokens before the generation's --max-new-tokens, "
        "a response's reward falls linearly by up to --overlong-penalty (0 = off)."
    )
    overlong_penalty: float = option(1.0, help="The overlong penalty at the token limit (see --overlong-buffer).")
    trust_remote_code: bool = trust_remote_code_option("tokenizer code")

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        check_test_size(self.test_size)
        if self.num_proc < 0:
            raise ValueError("--num-proc must be >= 0 (0 = one per CPU core for large inputs)")
        if self.drop_uniform_groups and self.mode != GROUPS:
            raise ValueError("--drop-uniform-groups is for --mode groups (pairs mode already drops prompts whose "
                             "rewards are all equal)")
        if self.overlong_buffer < 0:
            raise ValueError("--overlong-buffer must be >= 0 (0 = no overlong penalty)")
        if self.overlong_penalty < 0:
            raise ValueError("--overlong-penalty must be >= 0")
        if self.overlong_penalty != 1.0 and not self.overlong_buffer:
            raise ValueError("--overlong-penalty is the penalty over --overlong-buffer's last tokens; give the buffer")


# What to change when no row survives, by the reason that dropped the most.
_NOTHING_LEFT_FIXES = {
    "prompt_too_long": "raise --max-prompt-tokens",
    "fewer_than_two_responses_left": "raise --max-response-tokens or drop --drop-truncated",
    "equal_rewards": "every prompt's responses got one reward: check the reward (a right/wrong reward the policy "
                     "always fails or always passes ranks nothing), or sample more responses a prompt (--n)",
    "uniform_rewards": "every group's rewards are equal: check the reward, sample more responses a prompt (--n), or "
                       "drop --drop-uniform-groups",
    "identical_chosen_rejected": "the best and the worst response are the same text: sample more varied responses "
                                 "(a higher --temperature, more --n)",
    "no_responses": "no prompt has a response: filter the output of rlhf score on rlhf generate",
}


def _stops_for_missing_ids(config: FilterConfig, tokenizer: Any, ds: Any) -> tuple[int, ...]:
    """The ids generation stops on (``chat.stop_token_ids``), for :func:`_tokenize_missing`; none needed when the
    data has its token ids."""
    from rlhf_pipeline.chat import stop_token_ids

    if "response_token_ids" in ds.column_names:
        return ()
    return tuple(stop_token_ids(tokenizer, config.tokenizer, config.trust_remote_code))


def nothing_left(source: str, dropped: Counter) -> PipelineError:
    """The error when the filters leave no row: the counts, and the fix for the reason that dropped the most."""
    reasons = [r for r, _ in dropped.most_common() if r in _NOTHING_LEFT_FIXES]
    fixes = "; or ".join(_NOTHING_LEFT_FIXES[r] for r in reasons) or "loosen the filters"
    counts = {r: n for r, n in dropped.items() if n}
    return PipelineError(f"{source}: no rows survive the filters (dropped: {counts}); {fixes}")


def _tokenize_missing(batch: dict[str, list], indices: list[int], source: str, tokenizer: Any, prompt_column: str,
                      stop_ids: tuple[int, ...], allow_special_tokens: bool = False) -> None:
    """Token ids for data that arrives without them, as the policy samples them: each response encoded in its
    conversation (:func:`chat.encode_answers`), so it ends in the template's turn end (Llama-3's ``<|eot_id|>``,
    Gemma's ``<end_of_turn>``) rather than the tokenizer's EOS; a response cut at the token limit
    (``finish_reasons`` "length") ends without one. Where the template rewrites the answer it renders (a reasoning
    template's empty think block, say), the response is encoded as its text, followed by that stop token."""
    from rlhf_pipeline.chat import ChatTemplateRefused, encode_answers, encode_plain, encode_prompts

    counts = [len(rs) for rs in batch["responses"]]
    try:
        batch["prompt_token_ids"] = encode_prompts(tokenizer, batch[prompt_column],
                                                   allow_special_tokens=allow_special_tokens)
    except ChatTemplateRefused as e:
        raise e.at(source, indices[e.index]) from None
    prompts = [p for p, n in zip(batch[prompt_column], counts) for _ in range(n)]
    flat = [r for rs in batch["responses"] for r in rs]
    try:
        _, answers, _ = encode_answers(tokenizer, prompts, flat, stop_ids, allow_special_tokens)
    except ChatTemplateRefused as e:  # its index counts responses: the row that holds that one
        raise e.at(source, [indices[k] for k, n in enumerate(counts) for _ in range(n)][e.index]) from None
    stops = set(stop_ids) | {tokenizer.eos_token_id}
    finish = batch.get("finish_reasons") or [None] * len(counts)
    reasons = [r for rs, n in zip(finish, counts) for r in (rs or ["stop"] * n)]
    out = []
    for text, ids, reason in zip(flat, answers, reasons):
        stop = ids[-1:] if ids and ids[-1] in stops else []
        body = ids[: len(ids) - len(stop)]
        if tokenizer.decode(body).strip() != text.strip():  # the template changed the answer: its text as it is
            (body,) = encode_plain(tokenizer, [text], allow_special_tokens)
            stop = stop or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        out.append(body if reason == "length" else body + stop)
    it = iter(out)
    batch["response_token_ids"] = [[next(it) for _ in range(n)] for n in counts]


def _check_rows(batch: dict[str, list], indices: list[int], source: str) -> None:
    """Each row's per-response columns hold one entry per response, and its rewards are numbers: data made by
    hand that does not fails here, naming the row, instead of deep in the selection."""
    import math

    for k, row in enumerate(indices):
        for column in ("responses", "prompt_token_ids", "response_token_ids", SAMPLER_LOGPROBS):
            if column in batch and batch[column][k] is None:
                raise PipelineError(f"{source}: row {row}: '{column}' is null; give it a value, or drop the row")
        n = len(batch["responses"][k])
        if batch["rewards"][k] is None:
            raise PipelineError(f"{source}: row {row} has no rewards (null); score it again (rlhf score) or drop it")
        for column in (c for c in (*PER_RESPONSE_COLUMNS, SAMPLER_LOGPROBS) if c in batch and c != "responses"):
            values = batch[column][k]
            if values is not None and len(values) != n:
                raise PipelineError(f"{source}: row {row} has {n} responses but {len(values)} entries in '{column}'; "
                                    "give every response one")
        for reward in batch["rewards"][k]:
            if reward is None or not math.isfinite(reward):
                raise PipelineError(f"{source}: row {row} has a reward of {reward}; score it again (rlhf score) or "
                                    "drop the row")


# What best mode writes (rejection sampling / RAFT): each prompt's best response, SFT data on its sampled token ids
# (the contract rlhf sft and rlhf train --algo raft read: prompt_token_ids + completion_token_ids).
BEST_COLUMNS = ("completion", "completion_token_ids", "reward", "finish_reason")

# Columns build_rows adds for the counts in the manifest; removed from the output.
_WORK_COLUMNS = ("_drop", "_response_too_long", "_response_truncated", "_penalised")


def rename_clashes(ds, mode: str):
    """Input columns that carry an output column's name (UltraFeedback's own ``chosen``/``rejected``, say) are kept
    as ``source_<name>``. Returns the dataset and the renames."""
    taken = set({PAIRS: CHOSEN_REJECTED_COLUMNS, UNPAIRED: UNPAIRED_OUTPUT, BEST: BEST_COLUMNS}.get(mode, ()))
    taken |= set(_WORK_COLUMNS)
    renames = {c: f"source_{c}" for c in ds.column_names if c in taken}
    return (ds.rename_columns(renames) if renames else ds), renames


def build_rows(
    batch: dict[str, list],
    indices: list[int],
    *,
    mode: str,
    limits: LengthLimits,
    tokenizer: Any,
    prompt_column: str,
    source: str,
    penalty: OverlongPenalty | None = None,
    uniform_dropped: bool = False,
    allow_special_tokens: bool = False,
    stop_ids: tuple[int, ...] = (),
) -> dict[str, list]:
    """The batched map function: one output row per input row, with ``_drop`` set on rows to leave out. With
    ``penalty`` the rewards are shaped by length first (the output's rewards are the shaped ones)."""
    _check_rows(batch, indices, source)
    if "response_token_ids" not in batch:
        batch = dict(batch)  # a copy: datasets would keep columns added to its own batch, with the input's length
        _tokenize_missing(batch, indices, source, tokenizer, prompt_column, stop_ids, allow_special_tokens)
    finish = batch.get("finish_reasons")
    sampler = batch.get(SAMPLER_LOGPROBS)
    carried = [c for c in batch if c not in PER_RESPONSE_COLUMNS and c not in ("prompt_token_ids", SAMPLER_LOGPROBS)]
    out: dict[str, list] = {c: [] for c in carried}
    out.update({"prompt_token_ids": [], **{c: [] for c in _WORK_COLUMNS}})
    if mode in (PAIRS, BEST):
        for key in CHOSEN_REJECTED_COLUMNS if mode == PAIRS else BEST_COLUMNS:  # replace the per-response columns
            out[key] = []
    else:
        for key in PER_RESPONSE_COLUMNS:
            out[key] = []
    if sampler is not None:
        for key in SAMPLER_LOGPROBS_OUT[mode]:
            out[key] = []

    for k in range(len(batch["prompt_token_ids"])):
        ids, rewards = batch["response_token_ids"][k], batch["rewards"][k]
        shaped = [penalty(len(x)) for x in ids] if penalty is not None else []
        out["_penalised"].append(sum(p < 0 for p in shaped))
        if shaped:
            rewards = [r + p for r, p in zip(rewards, shaped)]
        fr = finish[k] if finish is not None else None
        prompt_length = len(batch["prompt_token_ids"][k])
        for c in carried:
            out[c].append(batch[c][k])
        out["prompt_token_ids"].append(batch["prompt_token_ids"][k])
        if mode in (PAIRS, BEST):
            # best mode keeps the pair's chosen response: the same choice, and the same prompts dropped (no response
            # better than another: nothing to select)
            decision = decide_pair(prompt_length, ids, rewards, fr, limits)
            out["_drop"].append(decision.reason or "")
            out["_response_too_long"].append(decision.response_problems.get("response_too_long", 0))
            out["_response_truncated"].append(decision.response_problems.get("response_truncated", 0))
            best, worst = decision.pair or (0, 0)
            if sampler is not None:
                for key, j in zip(SAMPLER_LOGPROBS_OUT[mode], (best, worst)):
                    out[key].append(sampler[k][j])
            if mode == BEST:
                out["completion"].append(batch["responses"][k][best])
                out["completion_token_ids"].append(ids[best])
                out["reward"].append(float(rewards[best]))
                out["finish_reason"].append(fr[best] if fr is not None else "stop")
                continue
            out["chosen"].append(batch["responses"][k][best])
            out["rejected"].append(batch["responses"][k][worst])
            out["chosen_token_ids"].append(ids[best])
            out["rejected_token_ids"].append(ids[worst])
            out["chosen_reward"].append(float(rewards[best]))
            out["rejected_reward"].append(float(rewards[worst]))
        else:
            out["_drop"].append(decide_group(prompt_length, ids, fr, limits, rewards, uniform_dropped) or "")
            out["_response_too_long"].append(0)
            out["_response_truncated"].append(0)
            out["responses"].append(batch["responses"][k])
            out["response_token_ids"].append(ids)
            out["rewards"].append(rewards)
            out["finish_reasons"].append(fr if fr is not None else ["stop"] * len(ids))
            if sampler is not None:
                out[SAMPLER_LOGPROBS].append(sampler[k])
    return out


def _overlong_penalty(config: FilterConfig, sampling: dict | None, source: str) -> OverlongPenalty | None:
    """``--overlong-buffer``'s penalty, its token limit read from the generation's manifest."""
    if not config.overlong_buffer:
        return None
    limit = (sampling or {}).get("max_new_tokens")
    if not limit:
        raise PipelineError(f"{source}: --overlong-buffer needs the generation's token limit, and no generate "
                            "manifest is in the data's lineage; filter the output of rlhf score on rlhf generate")
    if config.overlong_buffer > limit:
        raise PipelineError(f"--overlong-buffer {config.overlong_buffer} is longer than the generation's token limit "
                            f"(--max-new-tokens {limit}); pass at most {limit}")
    return OverlongPenalty(int(limit), config.overlong_buffer, config.overlong_penalty)


def _check_input(ds, config: FilterConfig, source: str, sampling: dict | None) -> str:
    from rlhf_pipeline.chat import check_message_roles, prompt_column

    require_columns(ds, SCORED_COLUMNS, source, "filter takes the output of rlhf score")
    require_types(ds, SCORED_KINDS, source, "filter takes the output of rlhf score")
    ids = [c for c in ("prompt_token_ids", "response_token_ids") if c in ds.column_names]
    if len(ids) == 1:
        (missing,) = {"prompt_token_ids", "response_token_ids"} - set(ids)
        raise PipelineError(f"{source}: has {ids[0]} but no {missing}; give both (as rlhf generate writes them), or "
                            "neither, and filter tokenizes the text with --tokenizer")
    if config.mode in (PAIRS, UNPAIRED, BEST):
        needs = f"{source}: --mode {config.mode} needs at least 2 responses per prompt"
        if sampling and sampling["n"] < 2:
            raise PipelineError(f"{needs}, but the data was generated with --n {sampling['n']}; regenerate with --n 2 "
                                "or more, or use --mode groups")
        if not sampling:  # data from elsewhere: the row with the fewest (Arrow's list lengths: no text decoded)
            import pyarrow.compute as pc

            counts = [n or 0 for n in pc.list_value_length(ds.with_format("arrow")["responses"]).to_pylist()]
            if counts and min(counts) < 2:
                row = counts.index(min(counts))
                raise PipelineError(f"{needs}, but row {row} has {counts[row]}; drop such rows, or use --mode groups")
    if config.drop_truncated and "finish_reasons" not in ds.column_names:
        raise PipelineError(f"{source}: has no finish_reasons column, so --drop-truncated cannot tell which responses "
                            "hit the token limit (every one would be kept); give the column (as rlhf generate writes "
                            "it: 'stop' or 'length' per response) or drop --drop-truncated")
    column = prompt_column(ds, source)
    check_message_roles(ds, column, source)
    check_prompt_ids(ds, source, column)  # the split goes by them (selection.split_by_prompt)
    return column


def _chat_template(config: FilterConfig, tokenizer, ds, column: str, source: str, sampling: dict | None):
    """The template filter renders prompts with (data that arrives without token ids): ``--chat-template``, else the
    one the sampler's manifest records, else the tokenizer's own. One that differs from what the sampler recorded
    is refused, whether or not filter renders anything: the pairs must be the ids that template gave."""
    from rlhf_pipeline.chat import check_same_template, raw_conversation_error, recorded_chat_template
    from rlhf_pipeline.chat import use_chat_template

    recorded = (sampling or {}).get("chat_template")  # None in manifests from before it (use_chat_template only)
    renders = "response_token_ids" not in ds.column_names
    value = config.chat_template if config.chat_template is not None else recorded_chat_template(recorded)
    template = use_chat_template(tokenizer, value, config.tokenizer, required=renders)
    check_same_template(template, recorded, source, f"--tokenizer {config.tokenizer}")
    if renders and template.text is None and column == "messages":
        raise raw_conversation_error(source, 0)
    return template


def main(config: FilterConfig) -> Path:
    from datasets import DatasetDict, List, Value

    from rlhf_pipeline.chat import TOKENIZER_PROBE_KEY, check_same_tokenizer, load_tokenizer, tokenizer_probe
    from rlhf_pipeline.datasets_io import StageOutput, find_in_lineage, load_dataset_ref, parse_ref
    from rlhf_pipeline.modeling import check_model_ref

    check_model_ref("--tokenizer", config.tokenizer, model=False)
    ref = parse_ref(config.input)
    out = StageOutput("filter", config, inputs=[ref])
    if out.done():
        return out.path
    ds = load_dataset_ref(ref)
    sampling = find_in_lineage([ref], "sampling")
    column = _check_input(ds, config, ref.name, sampling)
    ds, renamed = rename_clashes(ds, config.mode)
    tokenizer = load_tokenizer(config.tokenizer, config.trust_remote_code)
    if "response_token_ids" in ds.column_names:  # the sampler's ids are kept: --tokenizer must read them as it did
        check_same_tokenizer((sampling or {}).get(TOKENIZER_PROBE_KEY), tokenizer, ref.name,
                             f"the tokenizer given (--tokenizer {config.tokenizer})",
                             f"pass the sampling model's tokenizer (--tokenizer {(sampling or {}).get('model')})")
        require_token_ids(ds, len(tokenizer), ref.name, "pass the tokenizer of the policy that generated the data as "
                          "--tokenizer", owner="the tokenizer given")
    template = _chat_template(config, tokenizer, ds, column, ref.name, sampling)
    limits = LengthLimits(config.max_prompt_tokens, config.max_response_tokens, config.drop_truncated)
    penalty = _overlong_penalty(config, sampling, ref.name)
    num_proc = config.num_proc or (min(os.cpu_count() or 1, 8) if ds.num_rows >= 20_000 else None)
    if config.mode == UNPAIRED:  # KTO: one row per labelled response, split by prompt (filter_unpaired)
        return filter_unpaired(out, ds, config, ref.name, column, tokenizer, limits, penalty, num_proc, sampling,
                               renamed, find_in_lineage([ref], "reward"), template.record())

    built = ds.map(
        build_rows,
        batched=True,
        batch_size=1000,
        with_indices=True,
        num_proc=num_proc,
        remove_columns=ds.column_names,
        fn_kwargs={
            "mode": config.mode,
            "limits": limits,
            "tokenizer": tokenizer,
            "prompt_column": column,
            "source": ref.name,
            "penalty": penalty,
            "uniform_dropped": config.drop_uniform_groups,
            "allow_special_tokens": config.allow_special_tokens_in_text,
            "stop_ids": _stops_for_missing_ids(config, tokenizer, ds),
        },
        desc=f"filter ({config.mode})",
    )
    reasons = built["_drop"]
    dropped = Counter(r for r in reasons if r)
    responses_left_out = {
        "response_too_long": sum(built["_response_too_long"]),
        "response_truncated": sum(built["_response_truncated"]),
    }
    kept = built.select([i for i, r in enumerate(reasons) if not r]).remove_columns(list(_WORK_COLUMNS))
    token_columns = ["prompt_token_ids"] + {PAIRS: ["chosen_token_ids", "rejected_token_ids"],
                                            BEST: ["completion_token_ids"]}.get(config.mode, ["response_token_ids"])
    for name in token_columns:
        feature = List(Value("int32")) if name != "response_token_ids" else List(List(Value("int32")))
        kept = kept.cast_column(name, feature)
    if kept.num_rows == 0:
        raise nothing_left(ref.name, dropped)
    try:
        train_rows, test_rows = split_by_prompt(kept["prompt_id"], config.test_size, config.seed)
    except ValueError as e:
        raise PipelineError(
            f"{ref.name}: {len(set(kept['prompt_id']))} prompts survive the filters, and --test-size "
            f"{config.test_size:g} cannot be split from them ({e}); pass a smaller --test-size, e.g. 0.1 for 10%"
        ) from None
    # --test-size 0: no test split at all (datasets cannot read back a split saved with no rows)
    result = DatasetDict({"train": kept.select(train_rows), **({"test": kept.select(test_rows)} if test_rows else {})})
    extra: dict[str, Any] = {"mode": config.mode, "sampling": sampling, "renamed_columns": renamed,
                             "reward": find_in_lineage([ref], "reward"),  # how it was scored (PPO's critic reads it)
                             "chat_template": template.record(), TOKENIZER_PROBE_KEY: tokenizer_probe(tokenizer)}
    if config.mode in (PAIRS, BEST):
        extra["responses_left_out"] = responses_left_out
    if penalty is not None:
        extra["reward_shaping"] = {"overlong_penalty": {**dataclasses.asdict(penalty),
                                                        "penalised_responses": sum(built["_penalised"])}}
    out.save(result, rows_in=ds.num_rows, dropped=dict(dropped), extra=extra)
    _say_dropped(dropped, ds.num_rows)
    return out.path


def _say_dropped(dropped: Counter, prompts: int) -> None:
    """The prompts the filters dropped, by reason, after the output's line (the manifest's ``dropped`` keeps them)."""
    counts = {reason: n for reason, n in dropped.most_common() if n and reason != "response_at_mean"}
    if counts:
        print(f"[filter] dropped {sum(counts.values())} of {prompts} prompts: "
              + ", ".join(f"{reason} {n}" for reason, n in counts.items()))


# ----------------------------------------------------------------------------------------------------------------
# Unpaired mode (KTO): one row per labelled response (selection.decide_unpaired), the split made by prompt

# What unpaired mode writes besides the carried columns (an input column of one of these names is renamed).
UNPAIRED_OUTPUT = ("response_index", "finish_reason", *UNPAIRED_COLUMNS)
# Work columns of build_unpaired_rows: the input row (the prompt), why it was dropped, the responses left out.
_UNPAIRED_WORK = ("_prompt_row", "_drop", "_response_too_long", "_response_truncated", "_response_at_mean",
                  "_penalised")


def build_unpaired_rows(
    batch: dict[str, list],
    indices: list[int],
    *,
    limits: LengthLimits,
    tokenizer: Any,
    prompt_column: str,
    source: str,
    penalty: OverlongPenalty | None = None,
    allow_special_tokens: bool = False,
    stop_ids: tuple[int, ...] = (),
) -> dict[str, list]:
    """The batched map function of unpaired mode: a row per kept response (carrying the prompt's columns), and one
    row with ``_drop`` set for a dropped prompt; a prompt's counts of left-out responses ride on its first row."""
    from rlhf_pipeline.selection import REWARD_AT_MEAN, RESPONSE_TOO_LONG, RESPONSE_TRUNCATED

    _check_rows(batch, indices, source)
    if "response_token_ids" not in batch:
        batch = dict(batch)  # a copy: datasets would keep columns added to its own batch, with the input's length
        _tokenize_missing(batch, indices, source, tokenizer, prompt_column, stop_ids, allow_special_tokens)
    finish = batch.get("finish_reasons")
    sampler = batch.get(SAMPLER_LOGPROBS)
    carried = [c for c in batch if c not in PER_RESPONSE_COLUMNS and c not in ("prompt_token_ids", SAMPLER_LOGPROBS)]
    columns = [*carried, "prompt_token_ids", "response_index", "completion", "completion_token_ids", "reward",
               "desirable", "finish_reason", *_UNPAIRED_WORK, *(("completion_logprobs",) if sampler is not None else ())]
    out: dict[str, list] = {c: [] for c in columns}
    for k, row in enumerate(indices):
        ids, rewards = batch["response_token_ids"][k], batch["rewards"][k]
        shaped = [penalty(len(x)) for x in ids] if penalty is not None else []
        if shaped:
            rewards = [r + p for r, p in zip(rewards, shaped)]
        fr = finish[k] if finish is not None else None
        decision = decide_unpaired(len(batch["prompt_token_ids"][k]), ids, rewards, fr, limits)
        counts = {"_response_too_long": decision.response_problems.get(RESPONSE_TOO_LONG, 0),
                  "_response_truncated": decision.response_problems.get(RESPONSE_TRUNCATED, 0),
                  "_response_at_mean": decision.response_problems.get(REWARD_AT_MEAN, 0),
                  "_penalised": sum(p < 0 for p in shaped)}
        for n, (j, desirable) in enumerate(decision.labels or [(0, False)]):  # a dropped prompt: one marker row
            for c in carried:
                out[c].append(batch[c][k])
            out["prompt_token_ids"].append(batch["prompt_token_ids"][k])
            out["response_index"].append(j)
            out["completion"].append(batch["responses"][k][j])
            out["completion_token_ids"].append(ids[j])
            out["reward"].append(float(rewards[j]))
            out["desirable"].append(desirable)
            out["finish_reason"].append(fr[j] if fr is not None else "stop")
            if sampler is not None:
                out["completion_logprobs"].append(sampler[k][j])
            out["_prompt_row"].append(row)
            out["_drop"].append(decision.reason or "")
            for c, v in counts.items():
                out[c].append(v if n == 0 else 0)
    return out


def filter_unpaired(out, ds, config: FilterConfig, source: str, column: str, tokenizer, limits: LengthLimits,
                    penalty: OverlongPenalty | None, num_proc: int | None, sampling: dict | None,
                    renamed: dict, reward: dict | None, chat_template: dict | None = None) -> Path:
    """``rlhf filter --mode unpaired``: label, split the prompts into train and test (``--test-size`` counts
    prompts, so no prompt has responses on both sides), pair each row with a response of another prompt of its
    split (``selection.mismatched_partners``), write the splits and the manifest.

    Manifest: ``dropped`` counts prompts per reason (``equal_rewards``: all usable rewards equal, no signal) and the
    responses whose reward is exactly their prompt's mean (``response_at_mean``); ``responses_left_out`` the
    responses the length filters left out; ``unpaired`` the rule and each split's prompts and class counts."""
    from datasets import DatasetDict, List, Value

    from rlhf_pipeline.chat import TOKENIZER_PROBE_KEY, tokenizer_probe

    built = ds.map(
        build_unpaired_rows,
        batched=True,
        batch_size=1000,
        with_indices=True,
        num_proc=num_proc,
        remove_columns=ds.column_names,
        fn_kwargs={"limits": limits, "tokenizer": tokenizer, "prompt_column": column, "source": source,
                   "penalty": penalty, "allow_special_tokens": config.allow_special_tokens_in_text,
                   "stop_ids": _stops_for_missing_ids(config, tokenizer, ds)},
        desc="filter (unpaired)",
    )
    reasons, prompt_rows = built["_drop"], built["_prompt_row"]
    dropped = Counter(r for r, first in zip(reasons, _first_of_prompt(prompt_rows)) if r and first)
    dropped["response_at_mean"] = sum(built["_response_at_mean"])
    kept = built.select([i for i, r in enumerate(reasons) if not r])
    if kept.num_rows == 0:
        raise nothing_left(source, dropped)
    try:  # by prompt_id: the rows of one prompt (a prompt given twice included) on one side
        rows = dict(zip(("train", "test"), split_by_prompt(kept["prompt_id"], config.test_size, config.seed)))
    except ValueError as e:
        raise PipelineError(
            f"{source}: {len(set(kept['prompt_id']))} prompts survive the filters, and --test-size "
            f"{config.test_size:g} cannot be split from them ({e}); pass a smaller --test-size, e.g. 0.1 for 10%"
        ) from None
    ids = kept["prompt_id"]
    prompts_in = {split: len({str(ids[i]) for i in chosen}) for split, chosen in rows.items()}
    result, counts = {}, {}
    for split, chosen in rows.items():
        if not chosen:  # --test-size 0: no test split (datasets cannot read back a split saved with no rows)
            continue
        part = kept.select(chosen)
        try:
            partners = mismatched_partners([str(i) for i in part["prompt_id"]], config.seed)
        except ValueError:
            raise PipelineError(
                f"{source}: the {split} split holds the responses of only one prompt, and KTO pairs each response "
                f"with one of another prompt; --test-size {config.test_size:g} leaves {prompts_in['train']} "
                f"prompt(s) to train and {prompts_in['test']} to test: give each split at least 2 (--test-size 0: "
                "no test split)"
            ) from None
        completions, prompt_ids = part["completion_token_ids"], part["prompt_id"]
        part = part.add_column("kl_completion_token_ids", [completions[j] for j in partners])
        part = part.add_column("kl_prompt_id", [prompt_ids[j] for j in partners])
        part = part.remove_columns(list(_UNPAIRED_WORK))
        for name in ("prompt_token_ids", "completion_token_ids", "kl_completion_token_ids"):
            part = part.cast_column(name, List(Value("int32")))
        desirable = sum(part["desirable"])
        counts[split] = {"prompts": prompts_in[split], "desirable": desirable,
                         "undesirable": part.num_rows - desirable}
        result[split] = part
    extra: dict[str, Any] = {
        "mode": UNPAIRED, "sampling": sampling, "renamed_columns": renamed, "reward": reward,
        "chat_template": chat_template, TOKENIZER_PROBE_KEY: tokenizer_probe(tokenizer),
        "responses_left_out": {"response_too_long": sum(built["_response_too_long"]),
                               "response_truncated": sum(built["_response_truncated"])},
        UNPAIRED: {"rule": "desirable above the prompt's mean reward, undesirable below it, at it left out",
                     **counts},
    }
    if penalty is not None:
        extra["reward_shaping"] = {"overlong_penalty": {**dataclasses.asdict(penalty),
                                                        "penalised_responses": sum(built["_penalised"])}}
    out.save(DatasetDict(result), rows_in=ds.num_rows, dropped=dict(dropped), extra=extra)
    _say_dropped(dropped, ds.num_rows)
    return out.path


def _first_of_prompt(prompt_rows: list[int]) -> list[bool]:
    return [i == 0 or prompt_rows[i - 1] != p for i, p in enumerate(prompt_rows)]


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(FilterConfig, main, "rlhf filter", argv)


if __name__ == "__main__":
    sys.exit(cli())
