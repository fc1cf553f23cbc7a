"""Iterative RLHF: T rounds of generate -> score -> filter -> train, the policy of round t sampling round t+1.

    rlhf iterate --config run.yaml
    rlhf iterate --config run.yaml --iterations 5          # flags override the file

The run's layout, plan, launch and resume are ``rlhf_pipeline.runs``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.runs import IterateConfig, main


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(IterateConfig, main, "rlhf iterate", argv)


if __name__ == "__main__":
    sys.exit(cli())
