"""Log-probs of chosen and rejected responses under the sampling policy, computed once per dataset.

    rlhf ref-logps --model runs/iter_0/policy --input runs/iter_0/filter --output runs/iter_0/ref_logps
    accelerate launch --num_processes 8 -m rlhf_pipeline.stages.ref_logps --model M --input PAIRS --output DIR

Adds ``chosen_ref_logp`` and ``rejected_ref_logp`` (sums over response tokens) to both splits, so training needs
no second model in memory. The temperature defaults to the one the data was sampled at (read from the generate
stage's manifest through the inputs' lineage) and is recorded in this output's manifest; ``rlhf train`` checks
that it computes the policy's log-probs at the same temperature. ``rlhf train`` runs this pass itself when the
columns are missing. One batched pass, sequences sorted by length; under ``accelerate launch`` the batches are
split over the processes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.config import OutputOptions, option
from rlhf_pipeline.errors import PipelineError

REF_COLUMNS = ("chosen_ref_logp", "rejected_ref_logp")
PAIR_COLUMNS = ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")


@dataclass(kw_only=True)
class RefLogpsConfig(OutputOptions):
    """Add chosen_ref_logp / rejected_ref_logp columns computed with the sampling policy."""

    model: str = option(help="The policy that sampled the data (the reference of the next training run).")
    input: str = option(help="Pairs dataset with train and test splits (the output of rlhf filter).", semantic=False)
    temperature: Optional[float] = option(
        None, help="Temperature of the log-probs (default: the sampling temperature recorded upstream)."
    )
    batch_size: int = option(8, help="Pairs per forward pass (each pass holds 2 x batch_size sequences).")
    pack_ratio: float = option(
        2.0, help="Pack sequences into rows of up to this many times the longest one (0 = pad each to the longest).",
        semantic=False,
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", help="Model dtype; auto = bfloat16 on a GPU that supports it, float32 on a CPU."
    )
    trust_remote_code: bool = option(False, help="Allow custom model code from the model repo (off by default).")


def check_pairs(ds, source: str) -> None:
    missing = [c for c in PAIR_COLUMNS if c not in ds.column_names]
    if missing:
        raise PipelineError(
            f"{source}: missing column(s) {', '.join(missing)}; pass pairs made by rlhf filter --mode pairs"
        )


def pair_lengths(ds) -> list[int]:
    """Tokens in one pair's forward: the prompt twice plus both responses."""
    return [
        2 * len(p) + len(c) + len(r)
        for p, c, r in zip(ds["prompt_token_ids"], ds["chosen_token_ids"], ds["rejected_token_ids"])
    ]


def pair_logps(model, rows: list[dict[str, Any]], pad_id: int, temperature: float, pack_ratio: float = 0.0):
    """Sequence log-probs of the chosen and rejected responses of ``rows``: one forward over 2B sequences, padded or
    packed (``pack_ratio``; see ``logprobs.build_batch``)."""
    from rlhf_pipeline.logprobs import build_batch, sequence_logps

    prompts = [r["prompt_token_ids"] for r in rows]
    batch = build_batch(
        prompts + prompts, [r["chosen_token_ids"] for r in rows] + [r["rejected_token_ids"] for r in rows], pad_id,
        pack_ratio=pack_ratio,
    )
    batch = batch.to(next(model.parameters()).device)
    logps = sequence_logps(model, batch, temperature=temperature)  # (2B,)
    return logps[: len(rows)], logps[len(rows) :], batch


def compute_ref_logps(
    accelerator, model, ds, pad_id: int, temperature: float, batch_size: int, pack_ratio: float = 0.0
) -> tuple[list, list]:
    """Reference log-probs of every pair in ``ds``, computed in length-sorted batches shared over processes."""
    from rlhf_pipeline.trainer import sharded_inference

    def compute(ids: list[int]) -> list[tuple[float, float]]:
        chosen, rejected, _ = pair_logps(model, ds.select(ids).to_list(), pad_id, temperature, pack_ratio)
        return list(zip(chosen.tolist(), rejected.tolist()))

    values = sharded_inference(accelerator, model, pair_lengths(ds), batch_size, compute, "reference log-probs")
    return [c for c, _ in values], [r for _, r in values]


def add_ref_columns(dd, values: dict[str, tuple[list, list]]):
    from datasets import Value

    out = {}
    for split, ds in dd.items():
        chosen, rejected = values[split]
        ds = ds.remove_columns([c for c in REF_COLUMNS if c in ds.column_names])
        ds = ds.add_column("chosen_ref_logp", chosen, feature=Value("float64"))
        out[split] = ds.add_column("rejected_ref_logp", rejected, feature=Value("float64"))
    return type(dd)(out)


def resolve_temperature(requested: float | None, sampling: dict | None, source: str, default: float | None) -> float:
    """The log-prob temperature: asked for, else ``default``, else the recorded sampling temperature."""
    if requested is not None:
        return requested
    if default is not None:
        return default
    if sampling is None or sampling.get("temperature") is None:
        raise PipelineError(
            f"{source}: no sampling temperature recorded upstream (no generate manifest in its lineage); "
            "pass --temperature with the temperature the responses were sampled at"
        )
    if sampling["temperature"] == 0:
        raise PipelineError(f"{source}: the data was sampled greedily (temperature 0); pass --temperature")
    return float(sampling["temperature"])


def main(config: RefLogpsConfig) -> Path:
    from accelerate import Accelerator

    from rlhf_pipeline.chat import load_tokenizer, pad_id
    from rlhf_pipeline.datasets_io import StageOutput, find_in_lineage, load_dataset_dict, parse_ref
    from rlhf_pipeline.modeling import load_causal_lm

    ref = parse_ref(config.input)
    out = StageOutput("ref-logps", config, inputs=[ref])
    if out.done():
        return out.path
    dd = load_dataset_dict(ref, required=("train",))
    for split, ds in dd.items():
        check_pairs(ds, f"{ref}:{split}")
    sampling = find_in_lineage([ref], "sampling")
    temperature = resolve_temperature(config.temperature, sampling, str(ref), None)

    accelerator = Accelerator()
    tokenizer = load_tokenizer(config.model, config.trust_remote_code)
    model = load_causal_lm(
        config.model, dtype=config.dtype, trust_remote_code=config.trust_remote_code, device=accelerator.device
    )
    values = {
        split: compute_ref_logps(
            accelerator, model, ds, pad_id(tokenizer), temperature, config.batch_size, config.pack_ratio
        )
        for split, ds in dd.items()
    }
    if accelerator.is_main_process:
        out.save(
            add_ref_columns(dd, values),
            rows_in=sum(ds.num_rows for ds in dd.values()),
            extra={"sampling": sampling, "ref_logps": {"model": config.model, "temperature": temperature}},
        )
    accelerator.wait_for_everyone()
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(RefLogpsConfig, main, "rlhf ref-logps", argv)


if __name__ == "__main__":
    sys.exit(cli())
