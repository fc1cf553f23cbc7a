#!/usr/bin/env bash
# Evaluation of a policy: one response per held-out prompt, scored with the reward model; mean reward, and win rate
# against a baseline (BASELINE, by default the starting policy; BASELINE= for none). REBEL's own trainer evaluates
# only the regression loss on the test pairs (src/ultrafeedback_largebatch/rebel.py, evaluate()); its published
# numbers are AlpacaEval 2, MT-Bench, MMLU and GSM8K (the model table of REBEL's README.md), not this.
# REBEL file:line citations below: github.com/ZhaolinGao/REBEL at commit 4ad7c11, src/ultrafeedback_largebatch/.
#
#   conda env: rlhf-vllm (envs/vllm.yml): --engine vllm needs vLLM, which rlhf-train does not have; the reward
#              model runs on transformers, which rlhf-vllm has too. (With ENGINE=hf it runs in rlhf-train.)
#   hardware:  one node, 8 GPUs under `accelerate launch` (NUM_GPUS processes): the main process samples (vLLM on
#              its GPU, TP=1), then every process scores its share of the responses with a whole bf16 copy of the
#              reward model (data parallel, as score.sh); NUM_GPUS=1 runs it all on one 80 GB GPU
#   reads:     $EVAL_PROMPTS (held out: UltraFeedback's test prompts; REBEL trains on the train split),
#              $POLICY (ITER=0: $MODEL, the starting policy; ITER=t: $RUN/iter_t/train), $REWARD_MODEL, $BASELINE
#              (as `rlhf iterate` evaluates: ITER=0 against $MODEL itself, which keeps its samples as the baseline's;
#              ITER=t against those samples, $RUN/iter_0/eval, so the 8B baseline is not sampled again; where
#              iter_0's evaluation has not run, against $MODEL, sampled afresh)
#   writes:    $RUN/iter_$ITER/eval (generations, rewards, summary + manifest.json), the layout `rlhf iterate` uses
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: relative paths below resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}   # the policy of iteration 0 (REBEL generate.py:22)
RUN=${RUN:-runs/rebel_llama3}
ITER=${ITER:-1}                                       # 0 = the starting policy
if [ "$ITER" -eq 0 ]; then POLICY=${POLICY:-$MODEL}; else POLICY=${POLICY:-$RUN/iter_$ITER/train}; fi
if [ "$ITER" -eq 0 ] || [ ! -f "$RUN/iter_0/eval/manifest.json" ]; then BASELINE=${BASELINE-$MODEL}
else BASELINE=${BASELINE-$RUN/iter_0/eval}; fi   # BASELINE= (empty): no win rate
EVAL_PROMPTS=${EVAL_PROMPTS:-allenai/ultrafeedback_binarized_cleaned:test_prefs}
REWARD_MODEL=${REWARD_MODEL:-RLHFlow/ArmoRM-Llama3-8B-v0.1}   # REBEL's reward model (rank.py:14), custom code
OUT=${OUT:-$RUN/iter_$ITER/eval}
N=${N:-1}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-2048}   # REBEL's generation budget (generate.py:25)
TEMPERATURE=${TEMPERATURE:-0.8}          # REBEL's sampling (generate.py:61-66); TEMPERATURE=0 for greedy (needs N=1)
TOP_P=${TOP_P:-0.9}
SEED=${SEED:-0}
BATCH_SIZE=${BATCH_SIZE:-8}             # hf engine: prompts per generate call (unused by vLLM)
SCORE_BATCH_SIZE=${SCORE_BATCH_SIZE:-8}  # reward-model batch, as score.sh
MAX_LENGTH=${MAX_LENGTH:-4096}           # reward-model truncation, as REBEL's rank.py:25,41-47
DTYPE=${DTYPE:-bfloat16}                 # REBEL loads ArmoRM in bfloat16 (rank.py:25)
ENGINE=${ENGINE:-vllm}
NUM_GPUS=${NUM_GPUS:-8}                  # processes of the launch (1 = one process, no --multi_gpu)
ACCELERATE_ARGS=${ACCELERATE_ARGS:-}     # more `accelerate launch` options, e.g. --main_process_port 29501
PUSH_TO_HUB=${PUSH_TO_HUB:-}             # e.g. ORG/NAME-iter1-eval; the token comes from HF_TOKEN

command -v accelerate >/dev/null || { echo "accelerate not found: conda activate rlhf-vllm" >&2; exit 1; }
if [ "$ENGINE" = vllm ]; then
  python -c 'import vllm' 2>/dev/null || { echo "vllm does not import: conda activate rlhf-vllm" >&2; exit 1; }
fi
extra=()
[ -n "$BASELINE" ] && extra+=(--baseline "$BASELINE")
[ -n "$PUSH_TO_HUB" ] && extra+=(--push-to-hub "$PUSH_TO_HUB")
multi=(); [ "$NUM_GPUS" -gt 1 ] && multi=(--multi_gpu)

# shellcheck disable=SC2086  # ACCELERATE_ARGS: several words
accelerate launch ${multi[@]+"${multi[@]}"} --num_processes "$NUM_GPUS" --num_machines 1 --mixed_precision no \
  --dynamo_backend no $ACCELERATE_ARGS -m rlhf_pipeline.stages.eval \
  --model "$POLICY" --prompts "$EVAL_PROMPTS" --reward-model "$REWARD_MODEL" --trust-remote-code \
  --output "$OUT" --n "$N" --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE" --top-p "$TOP_P" \
  --seed "$SEED" --batch-size "$BATCH_SIZE" --engine "$ENGINE" \
  --score-batch-size "$SCORE_BATCH_SIZE" --max-length "$MAX_LENGTH" --dtype "$DTYPE" \
  ${extra[@]+"${extra[@]}"}
