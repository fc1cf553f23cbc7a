"""Sample n responses per prompt.

    rlhf generate --model meta-llama/Meta-Llama-3-8B-Instruct --prompts HuggingFaceH4/ultrafeedback_binarized:train_prefs \\
        --output runs/iter_0/generate --n 5 --temperature 0.8 --top-p 0.9 --max-new-tokens 2048
    rlhf generate --model models/tiny-policy --prompts prompts.jsonl --output out/gen --n 5 --max-new-tokens 64

The options, the engines and the generations contract: ``rlhf_pipeline.generation``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from rlhf_pipeline.cli import run_stage
from rlhf_pipeline.generation import GenerateConfig, main


def cli(argv: Sequence[str] | None = None) -> int:
    return run_stage(GenerateConfig, main, "rlhf generate", argv)


if __name__ == "__main__":
    sys.exit(cli())
