"""Sample n responses per prompt.

    rlhf generate --model meta-llama/Meta-Llama-3-8B-Instruct --prompts HuggingFaceH4/ultrafeedback_binarized:train_prefs \\
        --output runs/iter_0/generate --n 5 --temperature 0.8 --top-p 0.9 --max-new-tokens 2048
    rlhf generate --model models/tiny-policy --prompts prompts.jsonl --output out/gen --n 5 --max-new-tokens 64

Prompts come as ``prompt`` text or ``messages``; the chat template is applied once and the engine receives token
ids. All n samples of a prompt come from one request (``n=``), not n passes. Each prompt gets its own seed derived
from ``--seed`` and its row, so with vLLM a prompt's samples do not depend on sharding or batching.

Shards: ``--shard i/N`` takes the i-th of N contiguous slices, so N engines can work in parallel; ``rlhf merge``
joins them. Output columns (the generations contract): ``prompt_id``, the prompt columns and every other input
column, ``prompt_token_ids``, ``responses``, ``response_token_ids`` (as sampled, the stop token included when the
sample stopped), ``finish_reasons`` (``stop`` / ``length``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.config import OutputOptions, option
from rlhf_pipeline.errors import PipelineError

GENERATED_COLUMNS = ("prompt_token_ids", "responses", "response_token_ids", "finish_reasons")


@dataclass(kw_only=True)
class GenerateConfig(OutputOptions):
    """Sample n responses per prompt with vLLM or Hugging Face generate."""

    model: str = option(help="Policy to sample from: a local directory or a Hub model id.")
    prompts: str = option(
        help="Prompt dataset: directory, .json/.jsonl/.parquet file, or Hub id (ORG/NAME[:SPLIT]).",
        semantic=False,  # compared by the data's fingerprint, not by how the path is spelled
    )
    n: int = option(5, help="Responses sampled per prompt, in one request.")
    temperature: float = option(0.8, help="Sampling temperature (0 = greedy, needs --n 1).")
    top_p: float = option(0.9, help="Nucleus sampling: keep the smallest token set with this probability mass.")
    top_k: int = option(0, help="Keep the k most likely tokens; 0 turns top-k off (both engines).")
    max_new_tokens: int = option(2048, help="Maximum tokens per response; longer samples end with 'length'.")
    seed: int = option(0, help="Random seed; the same seed gives the same output.")
    engine: Literal["auto", "hf", "vllm"] = option(
        "auto", help="auto: vLLM when it imports and a GPU is present, else Hugging Face generate."
    )
    shard: Optional[str] = option(None, help="Generate only shard i of N contiguous slices, written as i/N.")
    offset: int = option(0, help="Skip the first OFFSET prompts (rlhf iterate gives each iteration its own rows).")
    limit: Optional[int] = option(None, help="Use only LIMIT prompts (after --offset).")
    batch_size: int = option(16, help="hf engine: prompts per generate call (each expands to n sequences).")
    use_chat_template: bool = option(True, help="Apply the tokenizer's chat template (when it has one).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", help="Model dtype; auto = bfloat16 on a GPU that supports it, float32 on a CPU."
    )
    tensor_parallel_size: int = option(1, help="vllm engine: GPUs per model (tensor parallelism).")
    gpu_memory_utilization: Optional[float] = option(
        None,
        help="vllm engine: fraction of GPU memory vLLM may use (default 0.9). On vLLM's CPU backend it is the "
        "fraction of the machine's memory to reserve, so there the default is a fixed KV cache instead "
        "(VLLM_CPU_KVCACHE_SPACE GiB, 4 if unset).",
        semantic=False,
    )
    max_model_len: Optional[int] = option(None, help="vllm engine: context length (default: the model's).")
    trust_remote_code: bool = option(False, help="Allow custom model code from the model repo (off by default).")

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("--n must be at least 1")
        if self.offset < 0 or (self.limit is not None and self.limit < 1):
            raise ValueError("--offset must be >= 0 and --limit >= 1")
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0")
        if self.temperature == 0 and self.n > 1:
            raise ValueError("--temperature 0 (greedy) gives n identical samples; use --n 1 or a temperature > 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top-p must be in (0, 1]")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.shard is not None:
            parse_shard(self.shard)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` -> ``(i, N)`` with 0 <= i < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r}: expected i/N, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--shard {text!r}: need 0 <= i < N")
    return i, n


def shard_indices(num_rows: int, index: int, num_shards: int) -> range:
    """Rows of contiguous shard ``index`` (the first ``num_rows % num_shards`` shards get one row more)."""
    size, extra = divmod(num_rows, num_shards)
    start = index * size + min(index, extra)
    return range(start, start + size + (1 if index < extra else 0))


def make_prompt_id(value: str | list) -> str:
    """A stable id from the prompt's content (as UltraFeedback's ``prompt_id`` is), for data without one."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def request_seed(seed: int, row: int) -> int:
    """The seed of one prompt's request: depends on the run's seed and the prompt's row in the full prompt set."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{row}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def main(config: GenerateConfig) -> Path:
    from datasets import Dataset, Features, List, Value, concatenate_datasets

    from rlhf_pipeline.chat import encode_prompts, load_tokenizer, stop_token_ids, validate_prompts
    from rlhf_pipeline.datasets_io import StageOutput, load_dataset_ref, parse_ref
    from rlhf_pipeline.engines import SamplingSettings, load_engine, resolve_engine_name

    ref = parse_ref(config.prompts)
    out = StageOutput("generate", config, inputs=[ref])
    if out.done():
        return out.path

    ds = load_dataset_ref(ref)
    rows_total = ds.num_rows
    clash = [c for c in GENERATED_COLUMNS if c in ds.column_names]
    if clash:
        raise PipelineError(f"{ref.name}: already has column(s) {', '.join(clash)}; pass a prompt dataset")
    column = validate_prompts(ds, ref.name)
    if config.offset >= rows_total:
        raise PipelineError(f"{ref.name}: --offset {config.offset} skips all of its {rows_total} prompts")
    end = rows_total if config.limit is None else min(config.offset + config.limit, rows_total)
    rows = range(config.offset, end)
    if config.shard is not None:
        i, n = parse_shard(config.shard)
        part = shard_indices(len(rows), i, n)
        rows = rows[part.start : part.stop]
    if len(rows) != rows_total:
        ds = ds.select(rows)
    if ds.num_rows == 0:
        raise PipelineError(f"{ref.name}: no prompts to generate for (rows {rows.start}..{rows.stop})")

    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    prompt_values = ds[column]
    prompt_ids = encode_prompts(tokenizer, prompt_values, config.use_chat_template)
    sampling = SamplingSettings(
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        stop_token_ids=tuple(stop_token_ids(tokenizer, config.model, config.trust_remote_code)),
    )
    engine = load_engine(
        config.engine,
        config.model,
        tokenizer,
        dtype=config.dtype,
        trust_remote_code=config.trust_remote_code,
        batch_size=config.batch_size,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
    )
    completions = engine.generate(prompt_ids, [request_seed(config.seed, r) for r in rows], sampling)

    if "prompt_id" in ds.column_names:
        ids = [str(x) for x in ds["prompt_id"]]
        ds = ds.remove_columns("prompt_id")
    elif "id" in ds.column_names:
        ids = [str(x) for x in ds["id"]]
    else:
        ids = [make_prompt_id(v) for v in prompt_values]
    generated = Dataset.from_dict(
        {
            "prompt_id": ids,
            "prompt_token_ids": prompt_ids,
            "responses": [c.texts for c in completions],
            "response_token_ids": [c.token_ids for c in completions],
            "finish_reasons": [c.finish_reasons for c in completions],
        },
        features=Features(
            {
                "prompt_id": Value("string"),
                "prompt_token_ids": List(Value("int32")),
                "responses": List(Value("string")),
                "response_token_ids": List(List(Value("int32"))),
                "finish_reasons": List(Value("string")),
            }
        ),
    )
    result = concatenate_datasets([generated.select_columns(["prompt_id"]), ds, generated.remove_columns("prompt_id")], axis=1)
    stopped = sum(r == "stop" for c in completions for r in c.finish_reasons)
    out.save(
        result,
        rows_in=len(rows),
        extra={
            "sampling": {
                **dataclasses.asdict(sampling),
                "stop_token_ids": list(sampling.stop_token_ids),
                "model": config.model,
                "engine": resolve_engine_name(config.engine),
                "use_chat_template": config.use_chat_template,
            },
            "shard": {"spec": config.shard, "rows": [rows.start, rows.stop], "rows_total": rows_total},
            "responses": {"total": stopped + sum(c.finish_reasons.count("length") for c in completions),
                          "stopped": stopped},
        },
    )
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(GenerateConfig, main, "rlhf generate", argv)


if __name__ == "__main__":
    sys.exit(cli())
