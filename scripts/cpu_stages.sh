#!/usr/bin/env bash
# One RLHF iteration's data stages on a CPU, offline: tiny models -> generate -> score -> filter,
# on the bundled 200-prompt set (n=5, 64 new tokens). Prints each stage's wall time and rows/s.
#   bash scripts/cpu_stages.sh [OUT_DIR]      (default: runs/cpu_stages; rerunning skips finished stages)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu_stages}
bash scripts/install.sh  # a no-op when .venv is already set up
RLHF="${VENV:-.venv}/bin/rlhf"
PROMPTS=$(python3 -c 'import pathlib; print(pathlib.Path("src/rlhf_pipeline/data/prompts.jsonl").resolve())')
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

[ -d "$OUT/models/policy" ] || $RLHF tiny-model --output "$OUT/models/policy" --kind policy --seed 0
[ -d "$OUT/models/rm" ] || $RLHF tiny-model --output "$OUT/models/rm" --kind reward --seed 1

timed() {  # name rows command...
  local name=$1 rows=$2; shift 2
  local t0 t1
  t0=$(date +%s.%N); "$@"; t1=$(date +%s.%N)
  python3 -c "import sys; n,r,a,b=sys.argv[1:]; s=float(b)-float(a); print(f'{n:<10} {s:6.1f} s  {int(r)/s:8.1f} rows/s')" \
    "$name" "$rows" "$t0" "$t1" >> "$OUT/timings.txt"
}
: > "$OUT/timings.txt"
timed generate 200 $RLHF generate --model "$OUT/models/policy" --prompts "$PROMPTS" --output "$OUT/generate" \
  --n 5 --temperature 0.8 --top-p 0.9 --max-new-tokens 64 --seed 0 --engine hf
timed score 200 $RLHF score --input "$OUT/generate" --output "$OUT/score" --reward-model "$OUT/models/rm"
timed filter 200 $RLHF filter --input "$OUT/score" --output "$OUT/filter" --tokenizer "$OUT/models/policy" \
  --mode pairs --max-prompt-tokens 1024 --max-response-tokens 2048 --test-size 20 --seed 0
cat "$OUT/timings.txt"
