#!/usr/bin/env bash
# Optional stage 3b of an iteration: log-probs of chosen/rejected under pi_t, the policy that sampled them.
# REBEL precomputes these once per iteration with the freshly loaded base model (gather_all_logprob in
# src/ultrafeedback_largebatch/rebel.py:158-191,336-357, github.com/ZhaolinGao/REBEL at commit 4ad7c11).
# `rlhf train` does the same pass itself when the columns are missing (kept in OUTPUT/ref_logps); running it here
# as its own stage lets it use plain data parallelism (no ZeRO-3 gathering) and be checked before training.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  one node, 8 GPUs, data parallel (one bf16 copy of the model per GPU; batches split over processes)
#   reads:     $RUN/iter_$ITER/filter and $POLICY (iteration 1 $MODEL, iteration t > 1 $RUN/iter_<t-1>/train)
#   writes:    $RUN/iter_$ITER/ref_logps (the pairs plus chosen_ref_logp / rejected_ref_logp, both splits)
# The temperature is not passed: it is read from the generate manifest (0.8, REBEL's sampling temperature, which
# REBEL also divides the logits by, rebel.py:40,149).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: relative paths below resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}   # the policy of iteration 0
RUN=${RUN:-runs/rebel_llama3}
ITER=${ITER:-1}
if [ "$ITER" -le 1 ]; then POLICY=${POLICY:-$MODEL}; else POLICY=${POLICY:-$RUN/iter_$((ITER - 1))/train}; fi
INPUT=${INPUT:-$RUN/iter_$ITER/filter}
OUT=${OUT:-$RUN/iter_$ITER/ref_logps}
NUM_GPUS=${NUM_GPUS:-8}           # processes of the launch (1 = one process, no --multi_gpu)
ACCELERATE_ARGS=${ACCELERATE_ARGS:-}  # more `accelerate launch` options, e.g. --main_process_port 29501
BATCH_SIZE=${BATCH_SIZE:-8}       # pairs per forward (2 x 8 sequences); REBEL: 1 (rebel.py:172-173); speed only
BF16=${BF16:-1}                   # as train.sh's BF16: rlhf train takes the columns only at its own precision
if [ "$BF16" = 1 ]; then DTYPE=${DTYPE:-bfloat16}; else DTYPE=${DTYPE:-float32}; fi  # the policy's weights
PUSH_TO_HUB=${PUSH_TO_HUB:-}      # e.g. ORG/NAME-iter1-ref_logps; the token comes from HF_TOKEN

command -v accelerate >/dev/null || { echo "accelerate not found: conda activate rlhf-train" >&2; exit 1; }
push=(); [ -n "$PUSH_TO_HUB" ] && push=(--push-to-hub "$PUSH_TO_HUB")
multi=(); [ "$NUM_GPUS" -gt 1 ] && multi=(--multi_gpu)

# shellcheck disable=SC2086  # ACCELERATE_ARGS: several words
accelerate launch ${multi[@]+"${multi[@]}"} --num_processes "$NUM_GPUS" --num_machines 1 --mixed_precision no \
  --dynamo_backend no $ACCELERATE_ARGS -m rlhf_pipeline.stages.ref_logps \
  --model "$POLICY" --input "$INPUT" --output "$OUT" --batch-size "$BATCH_SIZE" --dtype "$DTYPE" \
  ${push[@]+"${push[@]}"}
