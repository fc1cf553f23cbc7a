"""Join the shards of a sharded ``rlhf generate`` run into one generations dataset.

    for i in 0 1 2 3; do
        CUDA_VISIBLE_DEVICES=$i rlhf generate --model M --prompts P --output runs/gen_shard$i --shard $i/4 &
    done; wait
    rlhf merge --inputs runs/gen_shard0 runs/gen_shard1 runs/gen_shard2 runs/gen_shard3 --output runs/gen

The shards must come from the same prompts and the same settings, and together cover every shard 0..N-1 once;
rows come out in prompt order. The merged manifest carries the sampling settings, so later stages read them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import OutputOptions
from rlhf_pipeline.errors import PipelineError

# Settings that may differ between the shards of one run.
PER_SHARD = ("shard", "output", "overwrite", "push_to_hub", "hub_config", "private", "gpu_memory_utilization")


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
        diffs = [
            k
            for k in set(first["config"]) | set(manifest["config"])
            if k not in PER_SHARD and first["config"].get(k) != manifest["config"].get(k)
        ]
        if manifest["inputs"] != first["inputs"]:
            diffs.append("prompts")
        if diffs:
            raise PipelineError(f"{ref}: made with other settings than {refs[0]} ({', '.join(sorted(diffs))})")

    out = StageOutput("merge", config, inputs=refs)
    if out.done():
        return out.path
    order = sorted(range(len(refs)), key=lambda k: shards[k][0])
    merged = concatenate_datasets([load_dataset_ref(refs[k]) for k in order])
    out.save(
        merged,
        rows_in=sum(m["rows_out"] for m in manifests),
        extra={"sampling": first["sampling"], "shards": num_shards},
    )
    return out.path


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(MergeConfig, main, "rlhf merge", argv)


if __name__ == "__main__":
    sys.exit(cli())
