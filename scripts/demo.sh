#!/usr/bin/env bash
# The demo: the whole RLHF loop on a CPU, offline, in a few minutes (SFT -> reward model -> 3 REBEL iterations ->
# evaluation -> report). On a fresh machine it first installs what it needs into .venv (scripts/install.sh).
#   bash scripts/demo.sh                          # writes runs/demo/ (report.md, plots/, summary.json)
#   bash scripts/demo.sh --algo dpo --output runs/demo_dpo
# Extra arguments go to `rlhf demo` (see `rlhf demo --help`). Run it again after Ctrl-C: it resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
bash scripts/install.sh report
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/rlhf" demo "$@"
