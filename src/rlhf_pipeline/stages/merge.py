"""Join the shards of a sharded ``rlhf generate`` run into one generations dataset.

    for i in 0 1 2 3; do
        CUDA_VISIBLE_DEVICES=$i rlhf generate --model M --prompts P --output runs/gen_shard$i --shard $i/4 &
    done; wait
    rlhf merge --inputs runs/gen_shard0 runs/gen_shard1 runs/gen_shard2 runs/gen_shard3 --output runs/gen

The shards must come from the same prompts and the same settings, and together cover every shard 0..N-1 once;
rows come out in prompt order. The merged manifest carries the sampling settings, so later stages read them.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import OutputOptions
from rlhf_pipeline.errors import PipelineError

# Settings that may differ between the shards of one run, besides those that do not change a run's output.
PER_SHARD = ("shard",)


@dataclass(kw_only=True)
class MergeConfig(OutputOptions):
    """Join the shards of a sharded generate run."""

    inputs: list[str] = field(
        metadata={"help": "The shard outputs of rlhf generate (any order).", "semantic": False}
    )


def main(config: MergeConfig) -> Path:
    from datasets import concatenate_datasets

    from rlhf_pipeline.datasets_io import StageOutput, load_dataset_ref, parse_ref, read_manifest
    from rlhf_pipeline.sharding import parse_shard

    refs = [parse_ref(text) for text in config.inputs]
    manifests = []
    for ref in refs:
        manifest = read_manifest(ref)
        if manifest is None or manifest.get("stage") != "generate" or not manifest.get("shard", {}).get("spec"):
            raise PipelineError(f"{ref}: not a shard written by rlhf generate --shard i/N")
        manifests.append(manifest)
    shards = [parse_shard(m["shard"]["spec"]) for m in manifests]
    counts = {n for _, n in shards}
    if len(counts) != 1:
        raise PipelineError(f"the inputs come from different shard counts: {sorted(counts)}")
    (num_shards,) = counts
    have = sorted(i for i, _ in shards)
    if have != list(range(num_shards)):
        missing = sorted(set(range(num_shards)) - set(have))
        dupes = sorted({i for i in have if have.count(i) > 1})
        raise PipelineError(
            f"the inputs do not cover shards 0..{num_shards - 1} once each"
            + (f"; missing {missing}" if missing else "")
            + (f"; repeated {dupes}" if dupes else "")
        )
    first = manifests[0]
    for ref, manifest in zip(refs, manifests):
        diffs = settings_differences(first, manifest)
        if diffs:
            raise PipelineError(f"{ref}: made with other settings than {refs[0]} ({', '.join(diffs)}); merge shards "
                                "of one run")

    order = sorted(range(len(refs)), key=lambda k: shards[k][0])
    out = StageOutput("merge", config, inputs=[refs[k] for k in order])  # in shard order: any order given is one run
    if out.done():
        return out.path
    merged = concatenate_datasets([load_dataset_ref(refs[k]) for k in order])
    out.save(
        merged,
        rows_in=sum(m["rows_out"] for m in manifests),
        extra={"sampling": first["sampling"], "shards": num_shards},
    )
    return out.path


def settings_differences(first: dict, manifest: dict) -> list[str]:
    """What makes the shard of ``manifest`` part of another run than that of ``first``: an option that changes the
    output (those that do not, such as how a path is spelled or the engine's memory share, may differ), the prompts'
    data, the policy's own output written again in between, or the sampling as the engine ran it."""
    from rlhf_pipeline.datasets_io import USED_OUTPUTS, same_inputs
    from rlhf_pipeline.stages.generate import GenerateConfig

    keys = [f.name for f in dataclasses.fields(GenerateConfig)
            if f.metadata.get("semantic", True) and f.name not in PER_SHARD]
    diffs = [k for k in keys if first["config"].get(k) != manifest["config"].get(k)]
    options = set(diffs)
    if not same_inputs(first["inputs"], manifest["inputs"]):
        diffs.append("the prompts' data")
    if (first.get(USED_OUTPUTS) or {}) != (manifest.get(USED_OUTPUTS) or {}):
        diffs.append("the model, written again between the shards")
    sampling, other = first.get("sampling") or {}, manifest.get("sampling") or {}
    diffs += [f"sampling {k}" for k in sorted(set(sampling) | set(other))
              if sampling.get(k) != other.get(k) and k not in options]  # an option named above: once
    return diffs


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(MergeConfig, main, "rlhf merge", argv)


if __name__ == "__main__":
    sys.exit(cli())
