"""Iterative RLHF: T rounds of generate -> score -> filter -> train, the policy of round t sampling round t+1.

    rlhf iterate --config run.yaml
    rlhf iterate --config run.yaml --iterations 5          # flags override the file

The run's layout, plan, launch and resume are ``rlhf_pipeline.runs``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from rlhf_pipeline import runs
from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.runs import IterateConfig


def main(config: IterateConfig) -> Path:
    """Check what exists before the run does (the starting policy, the reward, the prompts), so a mistyped path
    fails in seconds and leaves no run directory; then run (``runs.main``). The later iterations' policies do not
    exist yet: each stage checks its own when it starts."""
    from rlhf_pipeline.datasets_io import parse_ref
    from rlhf_pipeline.modeling import check_model_ref
    from rlhf_pipeline.rewards import check_reward_fn_spec

    check_model_ref("--model", config.model)
    if config.reward_model is not None:
        check_model_ref("--reward-model", config.reward_model)
    if config.reward_fn is not None:
        check_reward_fn_spec(config.reward_fn)
    parse_ref(config.prompts)
    if config.eval_prompts is not None:
        parse_ref(config.eval_prompts)
    return runs.main(config)


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(IterateConfig, main, "rlhf iterate", argv)


if __name__ == "__main__":
    sys.exit(cli())
