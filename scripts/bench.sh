#!/usr/bin/env bash
# The benchmarks, side by side with what users would otherwise run (TRL's DPOTrainer, REBEL's per-row scripts).
# On a fresh machine it first installs what it needs into .venv (scripts/install.sh bench: TRL and DeepSpeed).
#   bash scripts/bench.sh --quick --output runs/bench_quick    # a few minutes on 2 CPU cores (docs/benchmarks.md)
#   bash scripts/bench.sh --output runs/bench                  # the full run (larger sizes, 3 rounds)
# Extra arguments go to `rlhf bench` (see `rlhf bench --help`). Exits 1 when a target is missed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
bash scripts/install.sh bench
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/rlhf" bench "$@"
