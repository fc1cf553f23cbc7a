#!/usr/bin/env bash
# Stage 1 of an iteration: sample n=5 responses per prompt from the current policy with vLLM.
#
#   conda env: rlhf-vllm (envs/vllm.yml; vLLM pins its own torch, so generation lives apart from rlhf-train);
#              with ENGINE=hf (Hugging Face generate, what the tests run on a CPU) rlhf-train works too
#   hardware:  one node, 8 x 80 GB GPUs (REBEL's setting)
#   reads:     $PROMPTS (default runs/prompts/ultrafeedback, made by scripts/gpu/prepare_prompts.sh) and $POLICY
#              (iteration 1: $MODEL; iteration t > 1: $RUN/iter_<t-1>/train)
#   writes:    $RUN/iter_$ITER/generate  (generations: responses, token ids, finish reasons + manifest.json)
#              with SHARDS > 1 also $RUN/iter_$ITER/generate_shards/<i> (one per shard, joined by `rlhf merge`)
#
# Two ways to use the 8 GPUs:
#   TP=8 SHARDS=1 (default): one vLLM engine with tensor parallelism over 8 GPUs, as REBEL's tutorial
#       (tensor_parallel_size=8 in the tutorial linked from REBEL's README, huggingface.co/blog/GitBag/rebel;
#       REBEL's src/ultrafeedback_largebatch/generate.py:29,47 passes --world_size as the TP size, at commit
#       4ad7c11 of github.com/ZhaolinGao/REBEL). Same setting as scripts/gpu/rebel_ultrafeedback.yaml.
#   TP=1 SHARDS=8: eight independent engines (`--shard i/8`, one GPU each), then `rlhf merge`. Usually faster for
#       an 8B model (no all-reduce per layer); a prompt's samples do not depend on the sharding (per-prompt seeds).
#       scripts/iterate.sh does not take this merged output as its own generate step (another config): continue
#       such an iteration with the scripts.
# Rerunning with the same settings skips finished outputs (shards included) and, in an unfinished one, the chunks of
# 4,096 prompts it finished: a crash loses at most the chunk it was sampling.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # repo root: relative paths below resolve from here

MODEL=${MODEL:-meta-llama/Meta-Llama-3-8B-Instruct}   # the policy of iteration 0 (REBEL generate.py:22)
RUN=${RUN:-runs/rebel_llama3}
ITER=${ITER:-1}
if [ "$ITER" -le 1 ]; then POLICY=${POLICY:-$MODEL}; else POLICY=${POLICY:-$RUN/iter_$((ITER - 1))/train}; fi
PROMPTS=${PROMPTS:-runs/prompts/ultrafeedback}         # allenai/ultrafeedback_binarized_cleaned_train:train, prompt columns only
OUT=${OUT:-$RUN/iter_$ITER/generate}

# REBEL's sampling (generate.py:25,28,59-66): 5 responses per prompt, temperature 0.8, top-p 0.9, 2048 new
# tokens. REBEL makes 5 separate passes with seeds p*50; here one request with n=5 and a per-prompt seed.
N=${N:-5}
TEMPERATURE=${TEMPERATURE:-0.8}
TOP_P=${TOP_P:-0.9}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-2048}
SEED=${SEED:-0}
TP=${TP:-8}                    # GPUs per vLLM engine (--tensor-parallel-size)
SHARDS=${SHARDS:-1}            # independent engines, each on TP GPUs (SHARDS x TP <= number of GPUs)
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9}
ENGINE=${ENGINE:-vllm}         # or hf (transformers' generate: slower, no vLLM needed)
DTYPE=${DTYPE:-bfloat16}       # the policy's weights (REBEL samples in bf16)
LIMIT=${LIMIT:-}               # e.g. LIMIT=100 for a quick trial on the first 100 prompts
PUSH_TO_HUB=${PUSH_TO_HUB:-}   # e.g. ORG/NAME-iter1-generate; the token comes from HF_TOKEN

command -v rlhf >/dev/null || { echo "rlhf not found: conda activate rlhf-vllm" >&2; exit 1; }
if [ "$ENGINE" = vllm ]; then
  python -c 'import vllm' 2>/dev/null || { echo "vllm does not import: conda activate rlhf-vllm" >&2; exit 1; }
fi
if [ "$PROMPTS" = runs/prompts/ultrafeedback ] && [ ! -e "$PROMPTS" ]; then
  echo "$PROMPTS is missing: run scripts/gpu/prepare_prompts.sh first" >&2; exit 1
fi

common=(--model "$POLICY" --prompts "$PROMPTS"
        --n "$N" --temperature "$TEMPERATURE" --top-p "$TOP_P" --max-new-tokens "$MAX_NEW_TOKENS" --seed "$SEED"
        --engine "$ENGINE" --dtype "$DTYPE" --tensor-parallel-size "$TP"
        --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION")
[ -n "$LIMIT" ] && common+=(--limit "$LIMIT")
push=(); [ -n "$PUSH_TO_HUB" ] && push=(--push-to-hub "$PUSH_TO_HUB")

if [ "$SHARDS" -le 1 ]; then
  rlhf generate "${common[@]}" --output "$OUT" ${push[@]+"${push[@]}"}
  exit 0
fi

# Sharded: shard i runs on GPUs [i*TP, (i+1)*TP), in the background; then the shards are joined. Every shard needs
# its own TP GPUs: SHARDS=8 with the default TP=8 would give shards 1-7 GPUs that do not exist.
gpus_here=0
command -v nvidia-smi >/dev/null && gpus_here=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus_here:-0}" -gt 0 ]; then  # where nvidia-smi lists none (no driver here), the shards say why themselves
  if [ $((SHARDS * TP)) -gt "$gpus_here" ]; then
    echo "SHARDS=$SHARDS x TP=$TP needs $((SHARDS * TP)) GPUs, and this machine has $gpus_here: set TP=1 with" \
      "SHARDS=$gpus_here (one engine per GPU), or fewer shards" >&2
    exit 1
  fi
fi
mkdir -p "$RUN/iter_$ITER"
pids=(); shard_dirs=()
for ((i = 0; i < SHARDS; i++)); do
  gpus=$(seq -s, $((i * TP)) $((i * TP + TP - 1)))
  dir=$RUN/iter_$ITER/generate_shards/$i
  shard_dirs+=("$dir")
  CUDA_VISIBLE_DEVICES=$gpus rlhf generate "${common[@]}" --shard "$i/$SHARDS" --output "$dir" \
    > "$RUN/iter_$ITER/generate_shard_$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < SHARDS; i++)); do
  wait "${pids[$i]}" || { echo "shard $i/$SHARDS failed: see $RUN/iter_$ITER/generate_shard_$i.log" >&2; failed=1; }
done
[ "$failed" -eq 0 ] || exit 1
rlhf merge --inputs "${shard_dirs[@]}" --output "$OUT" ${push[@]+"${push[@]}"}
