"""``rlhf bench [--quick] --output DIR``: every benchmark, side by side, one command.

    rlhf bench --quick --output runs/bench_quick     # a few minutes on 2 CPU cores (docs/benchmarks.md)
    rlhf bench --output runs/bench                   # larger sizes and more rounds

Writes ``DIR/benchmarks.json`` (a list of ``{"name", "ours", "peer", "unit", "ratio", "target", "notes"}``; ratio
> 1 means we are better) and ``DIR/BENCHMARKS.md``. The trainer comparisons need TRL, a benchmark-only dependency:
``pip install -e '.[bench]'``. Everything runs offline on tiny random-initialised models built here.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from rlhf_pipeline.stages import run_stage
from rlhf_pipeline.config import option
from rlhf_pipeline.errors import PipelineError

GROUPS = ("trainer", "lora", "stages", "memory_growth", "overlap")


@dataclass(kw_only=True)
class BenchConfig:
    """Run the benchmarks and write benchmarks.json and BENCHMARKS.md."""

    output: str = option(help="Directory for benchmarks.json, BENCHMARKS.md and the scratch data.")
    quick: bool = option(False, help="Small sizes and fewer rounds (a few minutes on 2 cores).")
    only: Optional[str] = option(None, help=f"Run one group of benchmarks: {', '.join(GROUPS)}.")
    rounds: Optional[int] = option(None, help="Alternating rounds per comparison (default 2 quick, 3 full).")
    keep_scratch: bool = option(False, help="Keep the generated data and models under OUTPUT/scratch.")

    def __post_init__(self) -> None:
        if self.only is not None and self.only not in GROUPS:
            raise ValueError(f"--only must be one of {', '.join(GROUPS)}, got {self.only!r}")
        if self.rounds is not None and self.rounds < 1:
            raise ValueError("--rounds must be at least 1")

    @property
    def num_rounds(self) -> int:
        return self.rounds or (2 if self.quick else 3)


def context() -> dict[str, str]:
    import torch
    import transformers

    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch threads "
        f"{torch.get_num_threads()}" + (f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""),
        "python / torch / transformers": f"{platform.python_version()} / {torch.__version__} / {transformers.__version__}",
    }


def main(config: BenchConfig) -> Path:
    from rlhf_pipeline.bench import lora, memory, overlap, stages, trainer
    from rlhf_pipeline.bench.common import write_results

    output = Path(config.output).expanduser()
    scratch = output / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    entries, records = [], []
    started = time.time()
    for name, module in (("trainer", trainer), ("lora", lora), ("stages", stages), ("memory_growth", memory),
                         ("overlap", overlap)):
        if config.only in (None, name):
            group_entries, group_records = module.run(config, scratch / name)
            entries += group_entries
            records += group_records
    info = {**context(), "mode": "quick" if config.quick else "full", "rounds": str(config.num_rounds),
            "wall time": f"{time.time() - started:.0f} s", "command": "rlhf bench " + " ".join(sys.argv[2:])}
    write_results(output, entries, info, records)
    if not config.keep_scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    for e in entries:
        print(f"{e.name:34s} ratio {e.ratio:7.2f}  target {'-' if e.target is None else e.target}  {e.status()}")
    print(f"wrote {output / 'benchmarks.json'} and {output / 'BENCHMARKS.md'}")
    missed = [e.name for e in entries if e.met is False]
    if missed:
        raise PipelineError(f"targets missed: {', '.join(missed)} (see {output / 'BENCHMARKS.md'})")
    return output


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(BenchConfig, main, "rlhf bench", argv)


if __name__ == "__main__":
    sys.exit(cli())
