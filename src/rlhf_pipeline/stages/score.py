"""Score every response with a reward model or a python reward function.

    rlhf score --input runs/iter_0/generate --output runs/iter_0/score \\
        --reward-model RLHFlow/ArmoRM-Llama3-8B-v0.1 --trust-remote-code --batch-size 16
    rlhf score --input out/gen --output out/scored --reward-fn my_rewards.py:reward
    rlhf score --input out/gen --output out/scored --reward-model runs/rm --reward-fn checks.py:format \\
        --reward-weights 1 0.5      # several sources: rewards_<key> each, rewards = their standardised weighted sum
    accelerate launch --multi_gpu --num_processes 8 -m rlhf_pipeline.stages.score \\
        --input runs/iter_0/generate --output runs/iter_0/score --reward-model runs/rm   # data parallel

What is added and how: ``rlhf_pipeline.scoring`` (the reward sources are ``rlhf_pipeline.rewards``).
"""

from __future__ import annotations

import sys
from typing import Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.scoring import ScoreConfig, main


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(ScoreConfig, main, "rlhf score", argv)


if __name__ == "__main__":
    sys.exit(cli())
