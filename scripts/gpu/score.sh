#!/usr/bin/env bash
# Stage 2 of an iteration: one ArmoRM reward per response.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  one GPU (an 8B reward model in bf16 fits in 80 GB; REBEL's rank.py also uses one GPU,
#              device_map="cuda" at rank.py:25)
# REBEL file:line citations: src/ultrafeedback_largebatch/rank.py of github.com/ZhaolinGao/REBEL at commit 4ad7c11.
#   reads:     $RUN/iter_$ITER/generate (the output of generate.sh, or of `rlhf merge` after a sharded run)
#   writes:    $RUN/iter_$ITER/score (the generations plus `rewards`, n floats per row, + manifest.json)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: relative paths below resolve from here

RUN=${RUN:-runs/rebel_llama3}
ITER=${ITER:-1}
INPUT=${INPUT:-$RUN/iter_$ITER/generate}
OUT=${OUT:-$RUN/iter_$ITER/score}
# REBEL's reward model (rank.py --reward_model default, rank.py:14). Its custom code returns a `.score`
# field (rank.py:50), so it needs --trust-remote-code (REBEL loads it with trust_remote_code=True, rank.py:62).
REWARD_MODEL=${REWARD_MODEL:-RLHFlow/ArmoRM-Llama3-8B-v0.1}
BATCH_SIZE=${BATCH_SIZE:-8}          # REBEL scores one sample at a time (rank.py:65-70); batching changes only speed
MAX_LENGTH=${MAX_LENGTH:-4096}       # REBEL: apply_chat_template(truncation=True, max_length=4096) (rank.py:25,41-47)
DTYPE=${DTYPE:-bfloat16}             # REBEL loads ArmoRM in bfloat16 (rank.py:25)
GPU=${GPU:-0}                        # which GPU to use
PUSH_TO_HUB=${PUSH_TO_HUB:-}         # e.g. ORG/NAME-iter1-score; the token comes from HF_TOKEN

command -v rlhf >/dev/null || { echo "rlhf not found: conda activate rlhf-train" >&2; exit 1; }
push=(); [ -n "$PUSH_TO_HUB" ] && push=(--push-to-hub "$PUSH_TO_HUB")

CUDA_VISIBLE_DEVICES=$GPU rlhf score --input "$INPUT" --output "$OUT" \
  --reward-model "$REWARD_MODEL" --trust-remote-code \
  --batch-size "$BATCH_SIZE" --max-length "$MAX_LENGTH" --dtype "$DTYPE" \
  ${push[@]+"${push[@]}"}
