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
# REBEL's src/ultrafeedback_largebatch/filter_tokenize.py (github.com/ZhaolinGao/REBEL at commit 4ad7c11; file:line):
MODE=${MODE:-pairs}                              # chosen = argmax, rejected = argmin of the 5 rewards (:96)
MAX_PROMPT_TOKENS=${MAX_PROMPT_TOKENS:-1024}     # --maxlen_prompt 1024 (:19, applied at :65)
MAX_RESPONSE_TOKENS=${MAX_RESPONSE_TOKENS:-2048} # --maxlen 2048 (:18, applied at :68)
TEST_SIZE=${TEST_SIZE:-1000}                     # train_test_split(test_size=1000), unseeded (:140; seeded here)
SEED=${SEED:-0}
# REBEL in effect drops responses that hit the 2048-token cap: its length check (:68) counts the template's
# <|eot_id|>, so a response cut at 2048 tokens measures 2049 (a reading of the code, not run); --drop-truncated
# does that explicitly. DROP_TRUNCATED=0 keeps them.
DROP_TRUNCATED=${DROP_TRUNCATED:-1}
PUSH_TO_HUB=${PUSH_TO_HUB:-}                     # e.g. ORG/NAME-iter1-filter; the token comes from HF_TOKEN

command -v rlhf >/dev/null || { echo "rlhf not found: conda activate rlhf-train" >&2; exit 1; }
extra=()
if [ "$DROP_TRUNCATED" = 1 ]; then extra+=(--drop-truncated); else extra+=(--no-drop-truncated); fi
[ -n "$PUSH_TO_HUB" ] && extra+=(--push-to-hub "$PUSH_TO_HUB")

rlhf filter --input "$INPUT" --output "$OUT" --tokenizer "$POLICY" --mode "$MODE" \
  --max-prompt-tokens "$MAX_PROMPT_TOKENS" --max-response-tokens "$MAX_RESPONSE_TOKENS" \
  --test-size "$TEST_SIZE" --seed "$SEED" --num-proc 0 "${extra[@]}"
