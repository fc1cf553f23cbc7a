"""Sample n responses per prompt: the body of ``rlhf generate`` (also run by ``rlhf eval``).

    rlhf generate --model meta-llama/Meta-Llama-3-8B-Instruct --prompts HuggingFaceH4/ultrafeedback_binarized:train_prefs \\
        --output runs/iter_0/generate --n 5 --temperature 0.8 --top-p 0.9 --max-new-tokens 2048
    rlhf generate --model models/tiny-policy --prompts prompts.jsonl --output out/gen --n 5 --max-new-tokens 64

Prompts come as ``prompt`` text or ``messages``; the chat template (``--chat-template``, else the tokenizer's own;
``chat.use_chat_template``) is applied once and the engine receives token ids, and the manifest's ``sampling``
records which template it was (``chat_template``: its source and a hash of its text). All n samples of a prompt
come from one request (``n=``), not n passes. Each prompt gets its own seed derived from ``--seed`` and its row,
so with vLLM (and the hf engine at ``--batch-size 1``) a prompt's samples do not depend on sharding or batching.
The sampling and engine options (``sampling_options.SamplingOptions``) are the ones ``rlhf eval`` takes too.

Shards: ``--shard i/N`` takes the i-th of N contiguous slices, so N engines can work in parallel; ``rlhf merge``
joins them. ``--executor ray --replicas N`` does both in one run: N engine replicas on a Ray cluster (local when
no ``--ray-address`` is given) sample the N shards through :func:`sample`, the same function a local run calls,
and this process writes the one output, the same as the N shard runs merged (``executors.py``).

    rlhf generate --model models/tiny-policy --prompts prompts.jsonl --output out/gen --executor ray --replicas 2 Output columns (the generations contract): ``prompt_id``, the prompt columns and every other input
column, ``prompt_token_ids``, ``responses``, ``response_token_ids`` (as sampled, the stop token included when the
sample stopped), ``finish_reasons`` (``stop`` / ``length``).
"""

from __future__ import annotations

import sys
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rlhf_pipeline.config import DATASET_REF, ChatTemplateOptions, ControlTokenOptions, OutputOptions, option
from rlhf_pipeline.contracts import GENERATED_COLUMNS, SAMPLER_LOGPROBS, check_prompt_ids
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.sampling_options import SamplingOptions
from rlhf_pipeline.sharding import parse_shard, request_seed, shard_indices
from rlhf_pipeline.stages import run_stage

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class GenerateConfig(ChatTemplateOptions, ControlTokenOptions, SamplingOptions, OutputOptions):
    """Sample n responses per prompt with vLLM or Hugging Face generate."""

    model: str = option(help="Policy to sample from: a local directory or a Hub model id.")
    prompts: str = option(
        help=f"Prompt dataset: {DATASET_REF}.",
        semantic=False,  # compared by the data's fingerprint, not by how the path is spelled
    )
    shard: Optional[str] = option(None, help="Generate only shard i of N contiguous slices, written as i/N.")
    offset: int = option(
        0, help="Skip the first OFFSET prompts; --limit counts from there (rlhf iterate gives each iteration its "
        "own rows)."
    )
    wrap: bool = option(
        False, help="Where --offset + --limit runs past the last prompt, go on from the first (rlhf iterate's "
        "prompts_per_iteration chunks), up to every prompt once."
    )
    logprobs: bool = option(
        True, help="Keep each sampled token's log-prob as the sampler drew it (after temperature, top-k and top-p) "
        "in response_logprobs, for the PPO family's rollout correction (--rollout-correction)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # the sampling options' checks
        if self.offset < 0:
            raise ValueError("--offset must be >= 0")
        if self.shard is not None:
            parse_shard(self.shard)
            if self.wrap:
                raise ValueError("--wrap takes its rows from the whole prompt set: not with --shard")


def make_prompt_id(value: str | list) -> str:
    """A stable id from the prompt's content (as UltraFeedback's ``prompt_id`` is), for data without one."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def ids_of_prompts(part, column: str) -> list[str]:
    """The ``prompt_id`` of each prompt of ``part`` (a dataset or a batch's columns): its own ``prompt_id`` or
    ``id`` column, else :func:`make_prompt_id` of the prompt."""
    names = getattr(part, "column_names", part)
    if "prompt_id" in names:
        return [str(x) for x in part["prompt_id"]]
    if "id" in names:
        return [str(x) for x in part["id"]]
    return [make_prompt_id(v) for v in part[column]]


def prompt_context(config: GenerateConfig) -> tuple[int, str] | None:
    """The longest a prompt plus its response may be, and where that number comes from: ``--max-model-len``, else
    the model config's ``max_position_embeddings``; None when the config names none. A prompt as long (vLLM refuses
    it, with a traceback, once its engine has loaded; transformers samples past the positions the model knows)
    is refused before any engine starts."""
    if config.max_model_len is not None:
        return config.max_model_len, "--max-model-len"
    from transformers import AutoConfig

    from rlhf_pipeline.modeling import context_length

    return context_length(AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code))


def select_prompts(ref, offset: int = 0, limit: int | None = None, shard: str | None = None, wrap: bool = False,
                   prompt_column: str | None = None):
    """The prompts a run samples for, checked: ``(dataset of the selected rows, prompt column, rows, rows_total)``;
    ``rows`` a range, or with ``wrap`` a list that goes on from the first row; ``prompt_column`` (``--prompt-column``)
    renamed to the prompt column the stages read. ``rlhf eval`` calls it too, to check its prompts before it makes
    its output directory."""
    from rlhf_pipeline.chat import use_prompt_column, validate_prompts
    from rlhf_pipeline.datasets_io import load_dataset_ref

    ds = load_dataset_ref(ref)
    if prompt_column is not None:
        ds = use_prompt_column(ds, prompt_column, ref.name)
    rows_total = ds.num_rows
    clash = [c for c in GENERATED_COLUMNS if c in ds.column_names]
    if clash:
        raise PipelineError(f"{ref.name}: already has column(s) {', '.join(clash)}; pass a prompt dataset")
    column = validate_prompts(ds, ref.name)
    check_prompt_ids(ds, ref.name, column)
    if offset >= rows_total:
        raise PipelineError(f"{ref.name}: --offset {offset} skips all of its {rows_total} prompts")
    end = rows_total if limit is None else min(offset + limit, rows_total)
    rows = range(offset, end)
    if wrap and limit is not None and offset + limit > rows_total:  # on from the first row, each row once at most
        rows = [*rows, *range(min(offset + limit - rows_total, offset))]
    if shard is not None:
        i, n = parse_shard(shard)
        part = shard_indices(len(rows), i, n)
        if not part:
            raise PipelineError(f"{ref.name}: --shard {shard} gets no prompts: {n} shards of its {len(rows)} "
                                f"prompts (rows {offset}..{end}) leave shard {i} empty; give at most {len(rows)} "
                                "shards")
        rows = rows[part.start : part.stop]
    if rows != range(rows_total):  # a wrapped list of every row is in another order
        ds = ds.select(rows)
    if ds.num_rows == 0:
        raise PipelineError(f"{ref.name}: no prompts to generate for (rows {offset}..{end})")
    return ds, column, rows, rows_total


def row_spans(rows: Sequence[int]) -> list[list[int]]:
    """The rows ``select_prompts`` chose as ``[start, stop)`` spans: one for a range, two where --wrap went on from
    the first row."""
    spans: list[list[int]] = []
    for row in rows:
        if spans and spans[-1][1] == row:
            spans[-1][1] += 1
        else:
            spans.append([row, row + 1])
    return spans


# Prompts sampled and written at a time: the stage holds one chunk's samples, not the whole output's. vLLM's samples
# do not depend on it (a seed per prompt); the hf engine's do where --batch-size > 1 (which prompts share a batch
# depends on the chunk, as on --batch-size), but no two of its batches draw the same random numbers.
CHUNK_PROMPTS = 4096


def open_engine(config: GenerateConfig, tokenizer):
    from rlhf_pipeline.engines import load_engine

    return load_engine(
        config.engine,
        config.model,
        tokenizer,
        dtype=config.dtype,
        trust_remote_code=config.trust_remote_code,
        batch_size=config.batch_size,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        attn_implementation=config.attn_implementation,
    )


def sample(config: GenerateConfig, tokenizer, prompt_ids: list[list[int]], seeds: list[int], sampling):
    """The engine's samples for these prompts (token ids) and seeds: ``(engine name, completions)``, for each Ray
    replica (a local run samples chunk by chunk with one engine, in :func:`main`); the engine is closed when it
    returns."""
    engine = open_engine(config, tokenizer)
    try:
        return engine.name, engine.generate(prompt_ids, seeds, sampling, logprobs=config.logprobs)
    finally:
        engine.close()


def sample_replica(config: GenerateConfig, prompt_ids: list[list[int]], seeds: list[int], sampling):
    """:func:`sample` in a Ray replica, which loads its own tokenizer (to decode) from the model's path."""
    from rlhf_pipeline.chat import load_tokenizer

    return sample(config, load_tokenizer(config.model, config.trust_remote_code), prompt_ids, seeds, sampling)


def replicas_for(config: GenerateConfig, num_prompts: int) -> int:
    """Replicas that get prompts: --replicas, or fewer when there are fewer prompts (1 for a local run)."""
    return min(config.replicas, num_prompts) if config.executor == "ray" else 1


def sample_on_ray(config: GenerateConfig, prompt_ids: list[list[int]], seeds: list[int], rows: range, sampling):
    """:func:`sample` on Ray replicas, replica i on the i-th of N contiguous shards (``sharding.shard_indices``, as
    ``--shard i/N`` takes them), the samples joined in prompt order: what the N shard runs merged hold."""
    from rlhf_pipeline.executors import run_on_ray

    count = replicas_for(config, len(rows))
    if count < config.replicas:
        log.warning("--replicas %d: only %d prompts, so %d replicas", config.replicas, len(rows), count)
    parts = [shard_indices(len(rows), i, count) for i in range(count)]
    if Path(config.model).expanduser().is_dir():  # a cluster's workers do not start in this working directory
        config = dataclasses.replace(config, model=str(Path(config.model).expanduser().resolve()))
    results = run_on_ray(
        sample_replica,
        [(config, prompt_ids[p.start : p.stop], seeds[p.start : p.stop], sampling) for p in parts],
        gpus_per_replica=config.gpus_per_replica,
        address=config.ray_address,
        describe=lambda i: f"replica {i} (shard {i}/{count}, prompts {rows[parts[i].start]}..{rows[parts[i].stop - 1]})",
        desc="generate (ray)",
    )
    names = {name for name, _ in results}
    if len(names) > 1:  # --engine auto resolved differently on different nodes
        raise PipelineError(f"--engine {config.engine}: the replicas ran different engines ({', '.join(sorted(names))}); "
                            "name one with --engine")
    return names.pop(), [c for _, completions in results for c in completions]


def main(config: GenerateConfig) -> Path:
    from datasets import Features, List, Value, concatenate_datasets

    from rlhf_pipeline.attention import check_attn_implementation, check_engine
    from rlhf_pipeline.chat import (TOKENIZER_PROBE_KEY, ChatTemplateRefused, encode_prompts, load_tokenizer,
                                    raw_conversation_error, tokenizer_probe)
    from rlhf_pipeline.chat import stop_token_ids
    from rlhf_pipeline.chat import use_chat_template
    from rlhf_pipeline.datasets_io import OutputParts, StageOutput, parse_ref
    from rlhf_pipeline.engines import SamplingSettings, resolve_engine_name
    from rlhf_pipeline.modeling import check_model_ref

    if config.executor == "ray":
        from rlhf_pipeline.executors import check_ray_installed

        check_ray_installed()
    check_model_ref("--model", config.model)
    check_attn_implementation(config.attn_implementation)
    if config.executor == "local":  # --engine auto, now resolved (a Ray replica resolves its own)
        check_engine(config.attn_implementation, resolve_engine_name(config.engine))
    ref = parse_ref(config.prompts)
    out = StageOutput("generate", config, inputs=[ref])
    if out.done(resume=True):  # an interrupted run with these options goes on from its finished chunks
        return out.path
    ds, column, rows, rows_total = select_prompts(ref, config.offset, config.limit, config.shard, config.wrap,
                                                  config.prompt_column)

    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    template = use_chat_template(tokenizer, config.chat_template, config.model)
    if template.text is None and column == "messages":
        raise raw_conversation_error(ref.name, rows[0])
    sampling = SamplingSettings(
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        stop_token_ids=tuple(stop_token_ids(tokenizer, config.model, config.trust_remote_code)),
    )
    features = {
        "prompt_id": Value("string"),
        "prompt_token_ids": List(Value("int32")),
        "responses": List(Value("string")),
        "response_token_ids": List(List(Value("int32"))),
        "finish_reasons": List(Value("string")),
        **({SAMPLER_LOGPROBS: List(List(Value("float32")))} if config.logprobs else {}),
    }
    counts = {"stop": 0, "length": 0}
    timing: dict[str, float] = {"new_tokens": 0}

    def tally(finish_reasons: list[list[str]], token_ids: list[list[list[int]]]) -> int:
        """Count a chunk's finish reasons into ``counts``; its new tokens."""
        for reasons in finish_reasons:
            for reason in reasons:
                counts[reason] = counts.get(reason, 0) + 1
        return sum(len(t) for ids in token_ids for t in ids)

    def columns(part: dict, prompt_ids: list[list[int]], completions) -> dict[str, list]:
        ids = ids_of_prompts(part, column)
        timing["new_tokens"] += tally([c.finish_reasons for c in completions], [c.token_ids for c in completions])
        out = {"prompt_id": ids, "prompt_token_ids": prompt_ids, "responses": [c.texts for c in completions],
               "response_token_ids": [c.token_ids for c in completions],
               "finish_reasons": [c.finish_reasons for c in completions]}
        if config.logprobs:
            out[SAMPLER_LOGPROBS] = [c.logprobs for c in completions]
        return out

    context = prompt_context(config)

    def encoded(start: int, stop: int) -> tuple[dict, list[list[int]]]:
        part = ds[start:stop]
        try:
            ids = encode_prompts(tokenizer, part[column], allow_special_tokens=config.allow_special_tokens_in_text)
        except ChatTemplateRefused as e:
            raise e.at(ref.name, rows[start + e.index]) from None
        long = next((k for k, x in enumerate(ids) if context is not None and len(x) >= context[0]), None)
        if long is not None:
            raise PipelineError(
                f"{ref.name}: row {rows[start + long]}: the prompt is {len(ids[long])} tokens, which fills the "
                f"model's context of {context[0]} ({context[1]}) and leaves no room to sample; shorten the prompt or "
                "drop the row")
        return part, ids

    # Every prompt the template refuses, or too long for the context, stops the run before an engine loads, not
    # hours into sampling: the chunks after the first are encoded once here to check them (their ids are not kept,
    # which at the 8B recipe's size would be gigabytes) and again when their turn comes.
    chunk = ds.num_rows if config.executor == "ray" else CHUNK_PROMPTS  # Ray's replicas take their shards at once
    first = encoded(0, chunk)
    for start in range(chunk, ds.num_rows, chunk):
        encoded(start, start + chunk)
    # Each chunk is kept in OUTPUT/parts/ as it finishes: a rerun of a run that stopped (a crash, a kill, a lost
    # node) samples only the chunks it had not finished. Every prompt has its own seed (the hf engine's batches
    # start at a chunk's start), so the rows are those one uninterrupted run writes. datasets_io.OutputParts says
    # when the output directory is made and what --overwrite does to a finished output.
    keys = [f"rows-{start:09d}-{min(start + chunk, ds.num_rows):09d}" for start in range(0, ds.num_rows, chunk)]
    with OutputParts(out, Features(features)) as parts:
        finished = parts.finished(keys)  # key -> (rows, notes) or None
        this_engine = resolve_engine_name(config.engine) if config.executor == "local" else None
        if this_engine is not None:
            other = {found[1]["engine"] for found in finished.values() if found is not None} - {this_engine}
            if other and not config.overwrite:
                raise PipelineError(
                    f"--output {out.path}: its finished chunks were sampled with the {other.pop()} engine, and "
                    f"--engine {config.engine} is {this_engine} here; finish it where --engine {config.engine} is "
                    f"that engine again, or pass --overwrite to sample every chunk with {this_engine}")
            if other:
                parts.discard()
                finished = dict.fromkeys(keys)
        pieces, engine, engine_names, reused_tokens = [], None, set(), 0
        try:
            for start, key in zip(range(0, ds.num_rows, chunk), keys):
                stop = min(start + chunk, ds.num_rows)
                found = finished[key]
                if found is not None:
                    piece = found[0]
                    reused_tokens += tally(piece["finish_reasons"], piece["response_token_ids"])
                    engine_names.add(found[1]["engine"])
                    pieces.append(piece)
                    continue
                part, prompt_ids = first if start == 0 else encoded(start, stop)
                seeds = [request_seed(config.seed, r) for r in rows[start:stop]]
                started = time.perf_counter()
                if config.executor == "ray":
                    name, completions = sample_on_ray(config, prompt_ids, seeds, rows, sampling)
                else:
                    if engine is None:
                        engine = open_engine(config, tokenizer)
                        timing["engine_start_s"] = time.perf_counter() - started
                        started = time.perf_counter()
                    name, completions = engine.name, engine.generate(prompt_ids, seeds, sampling,
                                                                     logprobs=config.logprobs)
                # Ray's: the replicas' start-up included
                timing["sampling_s"] = timing.get("sampling_s", 0.0) + time.perf_counter() - started
                engine_names.add(name)
                pieces.append(parts.keep(key, columns(part, prompt_ids, completions), {"engine": name}))
        finally:
            if engine is not None:
                engine.close()  # eval goes on to score, or to sample a baseline with an engine of its own
        (engine_name,) = engine_names
        generated = concatenate_datasets(pieces)
        if "prompt_id" in ds.column_names:
            ds = ds.remove_columns("prompt_id")
        result = concatenate_datasets([generated.select_columns(["prompt_id"]), ds,
                                       generated.remove_columns("prompt_id")], axis=1)
        stopped = counts["stop"]
        out.save(
            result,
            rows_in=len(rows),
            extra={
                "sampling": {
                    **dataclasses.asdict(sampling),
                    "stop_token_ids": list(sampling.stop_token_ids),
                    "model": config.model,
                    "engine": engine_name,
                    "use_chat_template": template.text is not None,  # what manifests before chat_template say
                    "chat_template": template.record(),
                    TOKENIZER_PROBE_KEY: tokenizer_probe(tokenizer),  # what made the token ids (chat.py)
                },
                "shard": {"spec": config.shard, "rows": row_spans(rows), "rows_total": rows_total},
                "executor": {"name": config.executor, "replicas": replicas_for(config, len(rows)),
                             "gpus_per_replica": config.gpus_per_replica, "ray_address": config.ray_address},
                "responses": {"total": stopped + counts["length"], "stopped": stopped},
                # what the engine took, apart from the process's start and the stage's reading and writing (the
                # manifest's wall_time_s): loading the model and starting the engine, then sampling, in this run;
                # the chunks an interrupted one finished are in new_tokens, not in the rate, which is this run's
                "timing": {**{k: round(v, 3) for k, v in timing.items() if k != "new_tokens"},
                           "new_tokens": int(timing["new_tokens"]) + reused_tokens,
                           "new_tokens_per_s": round(timing["new_tokens"] / timing["sampling_s"], 1)
                           if timing.get("sampling_s") else None},
                "sampler_logprobs": {
                    "column": SAMPLER_LOGPROBS, "engine": engine_name, "dtype": "float32",
                    "computed": "each sampled token's log-prob under the distribution it was drawn from: "
                                "log_softmax of the logits / temperature, renormalised over what top-k and top-p kept",
                } if config.logprobs else None,
            },
        )
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(GenerateConfig, main, "rlhf generate", argv)


if __name__ == "__main__":
    sys.exit(cli())
