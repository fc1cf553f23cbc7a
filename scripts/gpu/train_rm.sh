#!/usr/bin/env bash
# Optional: train a Bradley-Terry reward model (-logsigmoid(r_chosen - r_rejected), as REBEL's TL;DR
# src/tldr/rm.py:388) on preference pairs, to use instead of ArmoRM as REWARD_MODEL / `reward_model:`.
# REBEL's UltraFeedback recipe does not train one: it scores with RLHFlow/ArmoRM-Llama3-8B-v0.1
# (src/ultrafeedback_largebatch/rank.py:14). REBEL citations: github.com/ZhaolinGao/REBEL at commit 4ad7c11.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  one node, 8 x 80 GB GPUs, DeepSpeed ZeRO-3 (accelerate_cfgs/zero3.yaml), bf16
#   reads:     $DATA: rows with prompt/chosen/rejected (Hub id ORG/NAME[:SPLIT][@REV], save_to_disk directory or
#              .json/.jsonl/.parquet file); held-out pairs from its test split, or --test-size when it has none
#   writes:    $OUT (default $RUN/rm): a save_pretrained sequence classifier (one label) + tokenizer, metrics.jsonl,
#              TensorBoard logs, checkpoints/step_N every $SAVE_EVERY steps.
# Interrupted? Run the same command again: --resume continues from the newest checkpoint, a finished run is skipped.
#
# REBEL publishes no Llama-3 reward-model settings; the defaults follow the Llama-3-8B reward-model example of
# OpenRLHF's documentation (openrlhf.readthedocs.io): global batch 256, 1 epoch, max length 8192, ZeRO stage 3,
# learning rate 9e-6, bf16, gradient checkpointing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: accelerate_cfgs/ and relative paths resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}             # or the output of sft.sh ($RUN/sft)
DATA=${DATA:-HuggingFaceH4/ultrafeedback_binarized:train_prefs}  # prompt/chosen/rejected rows
RUN=${RUN:-runs/rebel_llama3}
OUT=${OUT:-$RUN/rm}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_cfgs/zero3.yaml}
NUM_GPUS=${NUM_GPUS:-8}
ACCELERATE_ARGS=${ACCELERATE_ARGS:-}  # more `accelerate launch` options, e.g. --main_process_port 29501

MAX_LENGTH=${MAX_LENGTH:-8192}           # pairs longer than this are dropped (OpenRLHF --max_len 8192)
TEST_SIZE=${TEST_SIZE:-1000}             # held-out pairs when $DATA has no test split (row count, or fraction < 1)
LEARNING_RATE=${LEARNING_RATE:-9e-6}     # OpenRLHF --learning_rate 9e-6
BATCH_SIZE=${BATCH_SIZE:-1}              # pairs per GPU per forward (chosen + rejected, up to 2 x 8192 tokens)
GLOBAL_BATCH=${GLOBAL_BATCH:-256}        # OpenRLHF --train_batch_size 256
GRAD_ACC=${GRAD_ACC:-$((GLOBAL_BATCH / (BATCH_SIZE * NUM_GPUS)))}   # 1 x 32 x 8 GPUs = 256
EPOCHS=${EPOCHS:-1}                      # OpenRLHF --max_epochs 1
WARMUP_RATIO=${WARMUP_RATIO:-0.03}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.0}
MAX_GRAD_NORM=${MAX_GRAD_NORM:-1.0}
EVAL_EVERY=${EVAL_EVERY:-50}
SAVE_EVERY=${SAVE_EVERY:-100}
SAVE_TOTAL_LIMIT=${SAVE_TOTAL_LIMIT:-2}  # checkpoints kept while training (0 = all); ~112 GB each at 8B
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-0}  # 1 = keep checkpoints/ after the run finishes (by default deleted then)
BF16=${BF16:-1}                          # bf16 mixed precision; 0 = float32 (launched with --mixed_precision no)
GRADIENT_CHECKPOINTING=${GRADIENT_CHECKPOINTING:-1}
SEED=${SEED:-0}
REPORT_TO=${REPORT_TO:-tensorboard}
PUSH_TO_HUB=${PUSH_TO_HUB:-}             # e.g. ORG/NAME-rm (a model repo); the token comes from HF_TOKEN

command -v accelerate >/dev/null || { echo "accelerate not found: conda activate rlhf-train" >&2; exit 1; }
if [ $((BATCH_SIZE * GRAD_ACC * NUM_GPUS)) -ne "$GLOBAL_BATCH" ]; then
  echo "batch $BATCH_SIZE x accumulation $GRAD_ACC x $NUM_GPUS GPUs != GLOBAL_BATCH $GLOBAL_BATCH" >&2; exit 1
fi
push=(); [ -n "$PUSH_TO_HUB" ] && push=(--push-to-hub "$PUSH_TO_HUB")
flags=()
precision=()  # the configs ask for bf16, which a run without --bf16 refuses: say float32 to the launcher too
if [ "$BF16" = 1 ]; then flags+=(--bf16); else flags+=(--no-bf16); precision=(--mixed_precision no); fi
if [ "$GRADIENT_CHECKPOINTING" = 1 ]; then flags+=(--gradient-checkpointing); fi
if [ "$KEEP_CHECKPOINTS" = 1 ]; then flags+=(--keep-checkpoints); fi

# shellcheck disable=SC2086  # ACCELERATE_ARGS: several words
accelerate launch --config_file "$ACCELERATE_CONFIG" --num_processes "$NUM_GPUS" \
  ${precision[@]+"${precision[@]}"} $ACCELERATE_ARGS \
  -m rlhf_pipeline.stages.train_rm \
  --model "$MODEL" --data "$DATA" --output "$OUT" \
  --max-length "$MAX_LENGTH" --test-size "$TEST_SIZE" \
  --epochs "$EPOCHS" --batch-size "$BATCH_SIZE" --gradient-accumulation-steps "$GRAD_ACC" \
  --learning-rate "$LEARNING_RATE" --weight-decay "$WEIGHT_DECAY" --warmup-ratio "$WARMUP_RATIO" \
  --max-grad-norm "$MAX_GRAD_NORM" "${flags[@]}" \
  --eval-every "$EVAL_EVERY" --save-every "$SAVE_EVERY" \
  --save-total-limit "$SAVE_TOTAL_LIMIT" --resume --seed "$SEED" --report-to "$REPORT_TO" \
  ${push[@]+"${push[@]}"}
