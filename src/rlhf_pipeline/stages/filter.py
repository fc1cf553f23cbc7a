"""Build training data from scored generations: length filters, best/worst pairs or whole groups, train/test split.

    rlhf filter --input runs/iter_0/score --output runs/iter_0/filter --tokenizer meta-llama/Meta-Llama-3-8B-Instruct \\
        --mode pairs --max-prompt-tokens 1024 --max-response-tokens 2048 --test-size 1000
    rlhf filter --input out/scored --output out/groups --tokenizer models/tiny-policy --mode groups --test-size 0.1

Lengths are measured on the token ids the engine saw and sampled, so nothing is re-tokenized. Scored data from
elsewhere without token ids is tokenized here once (prompt with the chat template, each response followed by
EOS). Rows dropped per reason go in the manifest. The work runs as one batched ``datasets.map`` over
``--num-proc`` processes. Output: ``train`` and ``test`` splits of the pairs or groups contract.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.config import OutputOptions, check_test_size, option
from rlhf_pipeline.contracts import (
    CHOSEN_REJECTED_COLUMNS,
    PER_RESPONSE_COLUMNS,
    SCORED_COLUMNS,
    SCORED_KINDS,
    require_columns,
    require_types,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.selection import LengthLimits, decide_group, decide_pair, split_indices


@dataclass(kw_only=True)
class FilterConfig(OutputOptions):
    """Length-filter scored generations and build pairs (REBEL, DPO family) or groups (PPO family)."""

    input: str = option(help="Scored dataset (the output of rlhf score).", semantic=False)
    tokenizer: str = option(help="The policy's tokenizer (checks token ids; tokenizes data that has none).")
    mode: Literal["pairs", "groups"] = option("pairs", help="pairs: best vs worst response; groups: all n.")
    max_prompt_tokens: int = option(1024, help="Drop prompts longer than this many tokens.")
    max_response_tokens: int = option(2048, help="Leave out responses longer than this many tokens.")
    drop_truncated: bool = option(False, help="Leave out responses that hit the token limit (finish 'length').")
    test_size: float = option(1000, help="Test split: a row count, or a fraction when below 1.")
    seed: int = option(0, help="Seed of the train/test split.")
    num_proc: int = option(0, help="Worker processes; 0 = one per CPU core for large inputs.", semantic=False)
    trust_remote_code: bool = option(False, help="Allow custom tokenizer code (off by default).")

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_response_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        check_test_size(self.test_size)
        if self.num_proc < 0:
            raise ValueError("--num-proc must be >= 0 (0 = one per CPU core for large inputs)")


def _tokenize_missing(batch: dict[str, list], tokenizer: Any, prompt_column: str) -> None:
    """Token ids for data that arrives without them: each text is tokenized exactly once."""
    from rlhf_pipeline.chat import encode_prompts

    batch["prompt_token_ids"] = encode_prompts(tokenizer, batch[prompt_column])
    flat = [r for rs in batch["responses"] for r in rs]
    encoded = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    eos = [tokenizer.eos_token_id]
    it = iter(encoded)
    batch["response_token_ids"] = [[list(next(it)) + eos for _ in rs] for rs in batch["responses"]]


def _check_vocab(batch: dict[str, list], indices: list[int], vocab_size: int, source: str) -> None:
    for row, prompt_ids, responses in zip(indices, batch["prompt_token_ids"], batch["response_token_ids"]):
        top = max([max(prompt_ids, default=0)] + [max(r, default=0) for r in responses])
        if top >= vocab_size:
            raise PipelineError(
                f"{source}: row {row} has token id {top}, outside the tokenizer's {vocab_size} ids; "
                "pass the tokenizer of the policy that generated the data as --tokenizer"
            )


def rename_clashes(ds, mode: str):
    """Input columns that carry an output column's name (UltraFeedback's own ``chosen``/``rejected``, say) are kept
    as ``source_<name>``. Returns the dataset and the renames."""
    taken = set(CHOSEN_REJECTED_COLUMNS if mode == "pairs" else ())
    taken |= {"_drop", "_response_too_long", "_response_truncated"}
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
) -> dict[str, list]:
    """The batched map function: one output row per input row, with ``_drop`` set on rows to leave out."""
    if "response_token_ids" not in batch:
        _tokenize_missing(batch, tokenizer, prompt_column)
    _check_vocab(batch, indices, len(tokenizer), source)
    finish = batch.get("finish_reasons")
    carried = [c for c in batch if c not in PER_RESPONSE_COLUMNS and c != "prompt_token_ids"]
    out: dict[str, list] = {c: [] for c in carried}
    out.update({"prompt_token_ids": [], "_drop": [], "_response_too_long": [], "_response_truncated": []})
    if mode == "pairs":
        for key in CHOSEN_REJECTED_COLUMNS:  # pairs mode replaces the per-response columns by these
            out[key] = []
    else:
        for key in PER_RESPONSE_COLUMNS:
            out[key] = []

    for k in range(len(batch["prompt_token_ids"])):
        ids, rewards = batch["response_token_ids"][k], batch["rewards"][k]
        fr = finish[k] if finish is not None else None
        prompt_length = len(batch["prompt_token_ids"][k])
        for c in carried:
            out[c].append(batch[c][k])
        out["prompt_token_ids"].append(batch["prompt_token_ids"][k])
        if mode == "pairs":
            decision = decide_pair(prompt_length, ids, rewards, fr, limits)
            out["_drop"].append(decision.reason or "")
            out["_response_too_long"].append(decision.response_problems.get("response_too_long", 0))
            out["_response_truncated"].append(decision.response_problems.get("response_truncated", 0))
            best, worst = decision.pair or (0, 0)
            out["chosen"].append(batch["responses"][k][best])
            out["rejected"].append(batch["responses"][k][worst])
            out["chosen_token_ids"].append(ids[best])
            out["rejected_token_ids"].append(ids[worst])
            out["chosen_reward"].append(float(rewards[best]))
            out["rejected_reward"].append(float(rewards[worst]))
        else:
            out["_drop"].append(decide_group(prompt_length, ids, fr, limits) or "")
            out["_response_too_long"].append(0)
            out["_response_truncated"].append(0)
            out["responses"].append(batch["responses"][k])
            out["response_token_ids"].append(ids)
            out["rewards"].append(rewards)
            out["finish_reasons"].append(fr if fr is not None else ["stop"] * len(ids))
    return out


def _check_input(ds, config: FilterConfig, source: str, sampling: dict | None) -> str:
    from rlhf_pipeline.chat import prompt_column

    require_columns(ds, SCORED_COLUMNS, source, "filter takes the output of rlhf score")
    require_types(ds, SCORED_KINDS, source, "filter takes the output of rlhf score")
    if config.mode == "pairs":
        n = sampling["n"] if sampling else min((len(r) for r in ds["rewards"]), default=0)
        if n < 2:
            raise PipelineError(
                f"{source}: --mode pairs needs at least 2 responses per prompt, but the data has {n} "
                f"(generated with --n {n}); regenerate with --n 2 or more, or use --mode groups"
            )
    return prompt_column(ds, source)


def main(config: FilterConfig) -> Path:
    from datasets import DatasetDict, List, Value

    from rlhf_pipeline.chat import load_tokenizer
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
    limits = LengthLimits(config.max_prompt_tokens, config.max_response_tokens, config.drop_truncated)
    num_proc = config.num_proc or (min(os.cpu_count() or 1, 8) if ds.num_rows >= 20_000 else None)

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
        },
        desc=f"filter ({config.mode})",
    )
    reasons = built["_drop"]
    dropped = Counter(r for r in reasons if r)
    responses_left_out = {
        "response_too_long": sum(built["_response_too_long"]),
        "response_truncated": sum(built["_response_truncated"]),
    }
    kept = built.select([i for i, r in enumerate(reasons) if not r]).remove_columns(
        ["_drop", "_response_too_long", "_response_truncated"]
    )
    token_columns = ["prompt_token_ids"] + (
        ["chosen_token_ids", "rejected_token_ids"] if config.mode == "pairs" else ["response_token_ids"]
    )
    for name in token_columns:
        feature = List(Value("int32")) if name != "response_token_ids" else List(List(Value("int32")))
        kept = kept.cast_column(name, feature)
    if kept.num_rows == 0:
        raise PipelineError(
            f"{ref.name}: no rows survive the filters (dropped: {dict(dropped)}); "
            "raise --max-prompt-tokens / --max-response-tokens or drop --drop-truncated"
        )
    try:
        train_rows, test_rows = split_indices(kept.num_rows, config.test_size, config.seed)
    except ValueError as e:
        raise PipelineError(
            f"{ref.name}: {kept.num_rows} rows survive the filters, and --test-size {config.test_size:g} "
            f"cannot be split from them ({e}); pass a smaller --test-size, e.g. 0.1 for 10%"
        ) from None
    result = DatasetDict({"train": kept.select(train_rows), "test": kept.select(test_rows)})
    extra: dict[str, Any] = {"mode": config.mode, "sampling": sampling, "renamed_columns": renamed,
                             "reward": find_in_lineage([ref], "reward")}  # how it was scored (PPO's critic reads it)
    if config.mode == "pairs":
        extra["responses_left_out"] = responses_left_out
    out.save(result, rows_in=ds.num_rows, dropped=dict(dropped), extra=extra)
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(FilterConfig, main, "rlhf filter", argv)


if __name__ == "__main__":
    sys.exit(cli())
