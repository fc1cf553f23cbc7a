"""Plots and a markdown report of a run directory written by ``rlhf iterate`` or ``rlhf demo``.

    rlhf report runs/my-run
    rlhf report --run-dir runs/my-run --output reports/my-run

What is read and written: ``rlhf_pipeline.reporting``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.reporting import ReportConfig, main


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        argv = ["--run-dir", argv[0], *argv[1:]]  # rlhf report RUN_DIR [options]
    return run_stage(ReportConfig, main, "rlhf report", argv)


if __name__ == "__main__":
    sys.exit(cli())
