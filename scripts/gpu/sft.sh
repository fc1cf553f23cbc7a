#!/usr/bin/env bash
# Optional, before the RLHF iterations: supervised fine-tuning (loss on the answers only).
# REBEL's UltraFeedback recipe skips it: it starts from the already instruction-tuned
# meta-llama/Meta-Llama-3-8B-Instruct (src/ultrafeedback_largebatch/generate.py:22 and rebel.py:89 of
# github.com/ZhaolinGao/REBEL at commit 4ad7c11); its SFT code, src/tldr/sft.py, is for TL;DR on Pythia. Use this
# to start the loop from a base model instead.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  one node, 8 x 80 GB GPUs, DeepSpeed ZeRO-3 (accelerate_cfgs/zero3.yaml), bf16
#   reads:     $DATA: rows with prompt/answer or messages (a Hub id ORG/NAME[:SPLIT][@REV], a save_to_disk directory
#              or a .json/.jsonl/.parquet file); held-out rows come from its test split, or --test-size when it has none
#   writes:    $OUT (default $RUN/sft): a save_pretrained model + tokenizer, metrics.jsonl, TensorBoard logs,
#              checkpoints/step_N every $SAVE_EVERY steps. Use it as MODEL of the other scripts / `model:` of the yaml.
# Interrupted? Run the same command again: --resume continues from the newest checkpoint, a finished run is skipped.
#
# REBEL publishes no Llama-3 SFT settings; the defaults follow the Llama-3-8B SFT example of OpenRLHF's
# documentation (openrlhf.readthedocs.io, "Supervised & Preference Training"): max length 2048, global batch 256,
# 1 epoch, learning rate 5e-6, bf16, gradient checkpointing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: accelerate_cfgs/ and relative paths resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B}            # a base (not instruction-tuned) model
DATA=${DATA:-HuggingFaceH4/ultrachat_200k:train_sft}  # messages rows; any prompt/answer or messages data works
CHAT_TEMPLATE=${CHAT_TEMPLATE:-llama3}   # the base model ships none: the layout it learns, saved into $OUT's tokenizer
RUN=${RUN:-runs/rebel_llama3}
OUT=${OUT:-$RUN/sft}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_cfgs/zero3.yaml}
NUM_GPUS=${NUM_GPUS:-8}
ACCELERATE_ARGS=${ACCELERATE_ARGS:-}  # more `accelerate launch` options, e.g. --main_process_port 29501

MAX_LENGTH=${MAX_LENGTH:-2048}           # rows longer than this are dropped (OpenRLHF --max_len 2048)
TEST_SIZE=${TEST_SIZE:-1000}             # held-out rows when $DATA has no test split (row count, or fraction < 1)
LEARNING_RATE=${LEARNING_RATE:-5e-6}     # OpenRLHF --learning_rate 5e-6
BATCH_SIZE=${BATCH_SIZE:-4}              # sequences per GPU per forward
GLOBAL_BATCH=${GLOBAL_BATCH:-256}        # OpenRLHF --train_batch_size 256
GRAD_ACC=${GRAD_ACC:-$((GLOBAL_BATCH / (BATCH_SIZE * NUM_GPUS)))}   # 4 x 8 x 8 GPUs = 256
EPOCHS=${EPOCHS:-1}                      # OpenRLHF --max_epochs 1
WARMUP_RATIO=${WARMUP_RATIO:-0.03}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.0}
MAX_GRAD_NORM=${MAX_GRAD_NORM:-1.0}
EVAL_EVERY=${EVAL_EVERY:-200}
SAVE_EVERY=${SAVE_EVERY:-100}
SAVE_TOTAL_LIMIT=${SAVE_TOTAL_LIMIT:-2}  # checkpoints kept while training (0 = all); ~112 GB each at 8B
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-0}  # 1 = keep checkpoints/ after the run finishes (by default deleted then)
BF16=${BF16:-1}                          # bf16 mixed precision; 0 = float32 (launched with --mixed_precision no)
GRADIENT_CHECKPOINTING=${GRADIENT_CHECKPOINTING:-1}
SEED=${SEED:-0}
REPORT_TO=${REPORT_TO:-tensorboard}
PUSH_TO_HUB=${PUSH_TO_HUB:-}             # e.g. ORG/NAME-sft (a model repo); the token comes from HF_TOKEN

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
  -m rlhf_pipeline.stages.sft \
  --model "$MODEL" --data "$DATA" --output "$OUT" --chat-template "$CHAT_TEMPLATE" \
  --max-length "$MAX_LENGTH" --test-size "$TEST_SIZE" \
  --epochs "$EPOCHS" --batch-size "$BATCH_SIZE" --gradient-accumulation-steps "$GRAD_ACC" \
  --learning-rate "$LEARNING_RATE" --weight-decay "$WEIGHT_DECAY" --warmup-ratio "$WARMUP_RATIO" \
  --max-grad-norm "$MAX_GRAD_NORM" "${flags[@]}" \
  --eval-every "$EVAL_EVERY" --save-every "$SAVE_EVERY" \
  --save-total-limit "$SAVE_TOTAL_LIMIT" --resume --seed "$SEED" --report-to "$REPORT_TO" \
  ${push[@]+"${push[@]}"}
