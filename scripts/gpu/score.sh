#!/usr/bin/env bash
# Stage 2 of an iteration: one ArmoRM reward per response.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  one node, 8 GPUs, data parallel under `accelerate launch` (NUM_GPUS processes, each a whole bf16
#              copy of the 8B reward model, 16 GB; the length-sorted responses split between them, the rewards
#              gathered back in row order). REBEL's rank.py scores on one GPU (device_map="cuda", rank.py:25): about
#              300k forwards an iteration (60k prompts x 5), which 8 processes share.
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
NUM_GPUS=${NUM_GPUS:-8}              # processes of the launch (1 = one process, no --multi_gpu)
ACCELERATE_ARGS=${ACCELERATE_ARGS:-} # more `accelerate launch` options, e.g. --main_process_port 29501
PUSH_TO_HUB=${PUSH_TO_HUB:-}         # e.g. ORG/NAME-iter1-score; the token comes from HF_TOKEN

command -v accelerate >/dev/null || { echo "accelerate not found: conda activate rlhf-train" >&2; exit 1; }
push=(); [ -n "$PUSH_TO_HUB" ] && push=(--push-to-hub "$PUSH_TO_HUB")
multi=(); [ "$NUM_GPUS" -gt 1 ] && multi=(--multi_gpu)

# shellcheck disable=SC2086  # ACCELERATE_ARGS: several words
accelerate launch ${multi[@]+"${multi[@]}"} --num_processes "$NUM_GPUS" --num_machines 1 --mixed_precision no \
  --dynamo_backend no $ACCELERATE_ARGS -m rlhf_pipeline.stages.score --input "$INPUT" --output "$OUT" \
  --reward-model "$REWARD_MODEL" --trust-remote-code \
  --batch-size "$BATCH_SIZE" --max-length "$MAX_LENGTH" --dtype "$DTYPE" \
  ${push[@]+"${push[@]}"}
