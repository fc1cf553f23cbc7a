"""Score every response with a reward model or a python reward function: the body of ``rlhf score`` (also run by
``rlhf eval``).

    rlhf score --input runs/iter_0/generate --output runs/iter_0/score \\
        --reward-model RLHFlow/ArmoRM-Llama3-8B-v0.1 --trust-remote-code --batch-size 16
    rlhf score --input out/gen --output out/scored --reward-fn my_rewards.py:reward

Adds ``rewards`` (one float per response) to the generations. A NaN or infinite reward stops the stage with an
error naming the row; nothing is written then. See ``rlhf_pipeline.rewards`` for the truncation rule and the
reward-function signature.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from tqdm.auto import tqdm

from rlhf_pipeline.config import OutputOptions, option
from rlhf_pipeline.contracts import GENERATED_COLUMNS, GENERATIONS_COLUMNS, require_columns, require_types
from rlhf_pipeline.errors import PipelineError

# Columns of the generations contract that a reward function does not receive as extra columns.
NOT_PASSED = ("prompt", *GENERATED_COLUMNS, "rewards")


@dataclass(kw_only=True)
class ScoreConfig(OutputOptions):
    """Score every response with a reward model or a python reward function."""

    input: str = option(help="Generations dataset (the output of rlhf generate or rlhf merge).", semantic=False)
    reward_model: Optional[str] = option(
        None, help="Sequence-classification reward model (local directory or Hub id)."
    )
    reward_fn: Optional[str] = option(
        None, help="Python reward function as module:function or path/to/file.py:function."
    )
    batch_size: int = option(16, help="Sequences per reward-model forward; responses per reward-function call.")
    max_length: int = option(4096, help="Reward model: conversations longer than this keep their first tokens.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", help="Reward model dtype; auto = bfloat16 on a GPU that supports it, float32 on a CPU."
    )
    engine: Literal["hf", "vllm"] = option(
        "hf",
        help="Reward model engine: hf (transformers, length-sorted batches) or vllm (vLLM's pooling runner; needs "
        "the vLLM environment and a model vLLM supports as a sequence classifier).",
        semantic=False,  # the same rewards either way (measured within 1e-7): a scored output is reused across engines
    )
    trust_remote_code: bool = option(False, help="Allow custom model code (needed for ArmoRM); off by default.")

    def __post_init__(self) -> None:
        if (self.reward_model is None) == (self.reward_fn is None):
            raise ValueError("give exactly one of --reward-model and --reward-fn")
        if self.engine == "vllm" and self.reward_model is None:
            raise ValueError("--engine vllm scores with a --reward-model; a --reward-fn runs in python")
        if self.batch_size < 1:
            raise ValueError("--batch-size must be at least 1")
        if self.max_length < 1:
            raise ValueError("--max-length must be at least 1")


def _check_generations(ds, source: str) -> str:
    from rlhf_pipeline.chat import prompt_column

    require_columns(ds, GENERATIONS_COLUMNS, source, "score takes the output of rlhf generate")
    require_types(ds, {"responses": "list of text"}, source, "score takes the output of rlhf generate")
    if "rewards" in ds.column_names:
        raise PipelineError(f"{source}: already has a 'rewards' column (already scored?)")
    return prompt_column(ds, source)


def _rows_text(first: int, last: int) -> str:
    return f"row {first}" if first == last else f"rows {first}..{last}"


def main(config: ScoreConfig) -> Path:
    from datasets import List, Value

    from rlhf_pipeline.datasets_io import StageOutput, find_in_lineage, load_dataset_ref, parse_ref
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.rewards import RewardModelScorer, call_reward_fn, first_non_finite, load_reward_fn

    # The reward source first: a mistyped model or function fails before the data is read.
    if config.reward_model is not None:
        check_model_ref("--reward-model", config.reward_model)
        fn = None
    else:
        fn = load_reward_fn(config.reward_fn)
    ref = parse_ref(config.input)
    out = StageOutput("score", config, inputs=[ref])
    if out.done():
        return out.path
    ds = load_dataset_ref(ref)
    column = _check_generations(ds, ref.name)

    # Flatten to one entry per response; (row, j) locates each. Columns are read into python lists once: indexing
    # a datasets Column row by row decodes one Arrow row per access (~90 us each, seconds at 10^4 responses).
    responses_per_row = ds["responses"][:]
    locations = [(row, j) for row, rs in enumerate(responses_per_row) for j in range(len(rs))]
    responses = [r for rs in responses_per_row for r in rs]
    prompt_values = ds[column][:]
    prompts = [prompt_values[row] for row, _ in locations]

    extra = {}
    if config.reward_model is not None:
        scorer = RewardModelScorer(
            config.reward_model,
            dtype=config.dtype,
            trust_remote_code=config.trust_remote_code,
            batch_size=config.batch_size,
            max_length=config.max_length,
            engine=config.engine,
        )
        flat = scorer.score(prompts, responses)
        extra["reward"] = {"reward_model": config.reward_model, "engine": config.engine,
                           "truncated_sequences": scorer.truncated}
        source = f"reward model {config.reward_model}"
    else:
        from rlhf_pipeline.chat import as_text

        passed = [c for c in ds.column_names if c not in NOT_PASSED]
        per_row = {c: ds[c][:] for c in passed}
        finish = ds["finish_reasons"][:] if "finish_reasons" in ds.column_names else None
        flat = []
        for start in tqdm(range(0, len(locations), config.batch_size), desc="score (fn)", unit="batch"):
            chunk = locations[start : start + config.batch_size]
            batch = f"{_rows_text(chunk[0][0], chunk[-1][0])} (batch of {len(chunk)} response{'s' * (len(chunk) > 1)})"
            columns = {c: [values[row] for row, _ in chunk] for c, values in per_row.items()}
            if finish is not None:
                columns["finish_reasons"] = [finish[row][j] for row, j in chunk]
            flat += call_reward_fn(
                fn,
                [as_text(prompts[start + k]) for k in range(len(chunk))],
                responses[start : start + len(chunk)],
                columns,
                name=config.reward_fn,
                where=batch,
            )
        extra["reward"] = {"reward_fn": config.reward_fn}
        source = f"reward function {config.reward_fn}"

    bad = first_non_finite(flat)
    if bad is not None:
        row, j = locations[bad]
        raise PipelineError(
            f"{ref.name}: row {row} (prompt_id {ds[row]['prompt_id']}), response {j}: the {source} returned "
            f"{flat[bad]}; rewards must be finite numbers, so fix the reward (nothing was written)"
        )
    rewards: list[list[float]] = [[] for _ in range(ds.num_rows)]
    for (row, _), value in zip(locations, flat):
        rewards[row].append(value)
    # An explicit fingerprint (from the input's and the rewards' bytes): datasets would otherwise hash the whole
    # reward list with dill, which takes longer than writing it.
    digest = hashlib.sha256(f"{ds._fingerprint}:rewards:".encode())
    digest.update(array("d", flat).tobytes())
    result = ds.add_column("rewards", rewards, feature=List(Value("float64")), new_fingerprint=digest.hexdigest()[:32])
    sampling = find_in_lineage([ref], "sampling")
    out.save(result, rows_in=ds.num_rows, extra={**extra, "sampling": sampling})
    return out.path
