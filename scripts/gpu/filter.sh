#!/usr/bin/env bash
# Stage 3 of an iteration: length filters, best-vs-worst pairs, train/test split.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  CPU only (tokenizer work; --num-proc 0 = one worker per core)
#   reads:     $RUN/iter_$ITER/score, and the policy's tokenizer ($POLICY: iteration 1 $MODEL, iteration t > 1
#              $RUN/iter_<t-1>/train)
#   writes:    $RUN/iter_$ITER/filter (pairs: prompt/chosen/rejected token ids, rewards, texts; train and test
#              splits + manifest.json)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: relative paths below resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}   # the policy of iteration 0
RUN=${RUN:-runs/rebel_llama3}
ITER=${ITER:-1}
if [ "$ITER" -le 1 ]; then POLICY=${POLICY:-$MODEL}; else POLICY=${POLICY:-$RUN/iter_$((ITER - 1))/train}; fi
INPUT=${INPUT:-$RUN/iter_$ITER/score}
OUT=${OUT:-$RUN/iter_$ITER/filter}
# REBEL's filter_tokenize.py (rebel-repo.md lines 30 and 128-142):
MODE=${MODE:-pairs}                              # chosen = argmax, rejected = argmin of the 5 rewards (line 135)
MAX_PROMPT_TOKENS=${MAX_PROMPT_TOKENS:-1024}     # --maxlen_prompt 1024 (lines 30, 128)
MAX_RESPONSE_TOKENS=${MAX_RESPONSE_TOKENS:-2048} # --maxlen 2048 (lines 30, 129)
TEST_SIZE=${TEST_SIZE:-1000}                     # train_test_split(test_size=1000) (line 142; seeded here)
SEED=${SEED:-0}
# REBEL in effect drops responses that hit the 2048-token cap (they re-tokenize to 2049 with <|eot_id|>, line 130,
# marked inferred there); --drop-truncated does that explicitly. DROP_TRUNCATED=0 keeps them.
DROP_TRUNCATED=${DROP_TRUNCATED:-1}
PUSH_TO_HUB=${PUSH_TO_HUB:-}                     # e.g. ORG/NAME-iter1-filter; the token comes from HF_TOKEN

command -v rlhf >/dev/null || { echo "rlhf not found: conda activate rlhf-train" >&2; exit 1; }
extra=()
if [ "$DROP_TRUNCATED" = 1 ]; then extra+=(--drop-truncated); else extra+=(--no-drop-truncated); fi
[ -n "$PUSH_TO_HUB" ] && extra+=(--push-to-hub "$PUSH_TO_HUB")

rlhf filter --input "$INPUT" --output "$OUT" --tokenizer "$POLICY" --mode "$MODE" \
  --max-prompt-tokens "$MAX_PROMPT_TOKENS" --max-response-tokens "$MAX_RESPONSE_TOKENS" \
  --test-size "$TEST_SIZE" --seed "$SEED" --num-proc 0 "${extra[@]}"
