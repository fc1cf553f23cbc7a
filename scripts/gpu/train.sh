#!/usr/bin/env bash
# Stage 4 of an iteration: REBEL on the iteration's pairs; the result is the next policy pi_{t+1}.
#
#   conda env: rlhf-train (envs/train.yml)
#   hardware:  one node, 8 x 80 GB GPUs, DeepSpeed ZeRO-3 (accelerate_cfgs/zero3.yaml), bf16, gradient
#              checkpointing. REBEL's large-batch run uses 8 processes and ZeRO-3 (the tutorial linked from its
#              README, huggingface.co/blog/GitBag/rebel, launches src/ultrafeedback_largebatch/rebel.py with
#              accelerate_cfgs/deepspeed_config_stage_3.yaml and --num_processes 8).
#   reads:     $DATA (default $RUN/iter_$ITER/ref_logps when ref_logps.sh has run, else $RUN/iter_$ITER/filter) and
#              $POLICY (iteration 1 $MODEL, iteration t > 1 $RUN/iter_<t-1>/train)
#   writes:    $RUN/iter_$ITER/train: a save_pretrained model (safetensors + tokenizer; what generate.sh loads for
#              the next iteration), metrics.jsonl, TensorBoard logs in runs/, checkpoints/step_N every $SAVE_EVERY
#              steps; with no ref-logp columns in $DATA also ref_logps/ (pi_t log-probs, computed once).
# Interrupted? Run the same command again: --resume continues from the newest checkpoint, a finished run is skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: accelerate_cfgs/ and relative paths resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}   # the policy of iteration 0
RUN=${RUN:-runs/rebel_llama3}
ITER=${ITER:-1}
if [ "$ITER" -le 1 ]; then POLICY=${POLICY:-$MODEL}; else POLICY=${POLICY:-$RUN/iter_$((ITER - 1))/train}; fi
if [ -z "${DATA:-}" ]; then
  if [ -e "$RUN/iter_$ITER/ref_logps/manifest.json" ]; then DATA=$RUN/iter_$ITER/ref_logps; else DATA=$RUN/iter_$ITER/filter; fi
fi
OUT=${OUT:-$RUN/iter_$ITER/train}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-accelerate_cfgs/zero3.yaml}
NUM_GPUS=${NUM_GPUS:-8}
ACCELERATE_ARGS=${ACCELERATE_ARGS:-}  # more `accelerate launch` options, e.g. --main_process_port 29501

# REBEL's large-batch UltraFeedback settings (src/ultrafeedback_largebatch/rebel.py of github.com/ZhaolinGao/REBEL
# at commit 4ad7c11; rebel.py:N below): eta = 1e6 (rebel.py:31; its loss at rebel.py:441-443). rlhf train logs the
# paper's loss ((dlogratio)/eta - dr)^2 and backpropagates REBEL's code form (dlogratio - eta*dr)^2 (eta^2 larger,
# same minimiser), so AdamW sees the gradients REBEL's run saw.
ETA=${ETA:-1e6}
LEARNING_RATE=${LEARNING_RATE:-3e-7}     # AdamW lr=3e-7 (rebel.py:62)
WEIGHT_DECAY=${WEIGHT_DECAY:-1e-6}       # AdamW weight_decay=1e-6 (rebel.py:64)
ADAM_BETA2=${ADAM_BETA2:-0.95}           # AdamW betas=(0.9, 0.95) (rebel.py:322-328)
WARMUP_RATIO=${WARMUP_RATIO:-0.1}        # cosine schedule with warmup ratio 0.1 (rebel.py:68,329)
MAX_GRAD_NORM=${MAX_GRAD_NORM:-0}        # REBEL's rebel.py clips no gradients; 0 = off
BATCH_SIZE=${BATCH_SIZE:-1}              # per_device_train_batch_size=1 pair per forward (rebel.py:73)
GLOBAL_BATCH=${GLOBAL_BATCH:-128}        # 1 x 16 accumulation (rebel.py:71) x 8 GPUs = 128 pairs per update
GRAD_ACC=${GRAD_ACC:-$((GLOBAL_BATCH / (BATCH_SIZE * NUM_GPUS)))}   # 16 on 8 GPUs, as REBEL
EPOCHS=${EPOCHS:-1}                      # total_episodes=60000 -> 468 updates, about one pass (rebel.py:77,247)
EVAL_EVERY=${EVAL_EVERY:-200}            # REBEL's test-split loss at updates 1, 201, 401, end (rebel.py:56,387-390,485)
SAVE_EVERY=${SAVE_EVERY:-100}            # resumable checkpoints (REBEL saves, rebel.py:395, but never resumes)
SAVE_TOTAL_LIMIT=${SAVE_TOTAL_LIMIT:-2}  # checkpoints kept while training (0 = all); ~112 GB each at 8B
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-0}  # 1 = keep checkpoints/ after the run finishes (by default deleted then)
BF16=${BF16:-1}                          # bf16 mixed precision; 0 = float32 (launched with --mixed_precision no)
GRADIENT_CHECKPOINTING=${GRADIENT_CHECKPOINTING:-1}
SEED=${SEED:-0}
REPORT_TO=${REPORT_TO:-tensorboard}      # or wandb (REBEL's default, rebel.py:50; pip install wandb first) or none
PUSH_TO_HUB=${PUSH_TO_HUB:-}             # e.g. ORG/NAME-iter1-train (a model repo); the token comes from HF_TOKEN

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

# --temperature is not passed: REBEL's log-probs use the sampling temperature 0.8 (rebel.py:40,149), which
# rlhf train reads from the generate manifest.
# shellcheck disable=SC2086  # ACCELERATE_ARGS: several words
accelerate launch --config_file "$ACCELERATE_CONFIG" --num_processes "$NUM_GPUS" \
  ${precision[@]+"${precision[@]}"} $ACCELERATE_ARGS \
  -m rlhf_pipeline.stages.train \
  --algo rebel --model "$POLICY" --data "$DATA" --output "$OUT" \
  --eta "$ETA" --learning-rate "$LEARNING_RATE" --weight-decay "$WEIGHT_DECAY" --adam-beta2 "$ADAM_BETA2" --warmup-ratio "$WARMUP_RATIO" \
  --max-grad-norm "$MAX_GRAD_NORM" --batch-size "$BATCH_SIZE" --gradient-accumulation-steps "$GRAD_ACC" \
  --epochs "$EPOCHS" "${flags[@]}" --eval-every "$EVAL_EVERY" --save-every "$SAVE_EVERY" \
  --save-total-limit "$SAVE_TOTAL_LIMIT" \
  --resume --seed "$SEED" --report-to "$REPORT_TO" \
  ${push[@]+"${push[@]}"}
