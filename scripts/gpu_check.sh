#!/usr/bin/env bash
# One prepared check of the whole pipeline on one GPU, for any session or user that has one for a few minutes:
# the GPU-gated tests (the varlen kernel against its reference), every stage on the GPU with a random-initialised ~0.5B Llama (the tiny kit's tokenizer, 18 layers x 1536), the
# ZeRO-3 trainer under `accelerate launch` against the plain trainer, the hf engine on the GPU against the same
# machine's CPU, and the trainer benchmark against TRL (our step eager and compiled) with a profile of our steps.
# --cpu runs the same path with tiny sizes on a CPU (the test suite runs it).
#
#   bash scripts/gpu_check.sh                      # on a GPU machine: writes runs/gpu_check/ (JSON under out/)
#   bash scripts/gpu_check.sh --cpu                # the same path on a CPU, tiny sizes, in a few minutes
#   bash scripts/gpu_check.sh --out DIR --no-bench # elsewhere; without the (longest) trainer benchmark
#   bash scripts/gpu_check.sh --resume             # the steps an earlier run in the same --out did not pass (cut by
#                                                  # GPU_CHECK_DEADLINE, say), keeping those it did; one summary
#   bash scripts/gpu_check.sh --bench-only         # the GPU tests and the trainer benchmark alone (a few minutes);
#                                                  # --resume later runs the rest into the same summary
#
# Environment:
#   PYTHON   the interpreter (default: .venv/bin/python when it exists, else python3). The checkout's src/ goes first
#            on PYTHONPATH, so nothing needs installing beyond torch, transformers, accelerate, datasets, deepspeed
#            (and trl + peft for the benchmark's TRL sides).
#   WHEELS   a folder of wheels to install first into a temporary site-packages, for a machine whose image lacks
#            some of those (scripts/gpu_wheels.sh downloads the set a CUDA image with Python 3.12 needs).
#   GPU_CHECK_HIDDEN / GPU_CHECK_LAYERS   the model's size (default 1536 / 18 on a GPU, 64 / 2 with --cpu).
#   GPU_CHECK_BENCH_STEPS   timed steps of the trainer benchmark (default 12 on a GPU, after bench_gpu.py's 4 warmup).
#   GPU_CHECK_BENCH_SIDES   its sides, run in this order (default: ours_compile,trl,ours_bf16,ours_compile@16384,
#            trl_precomputed: the headline pair first, so that a lease cut short still has its ratio; see
#            scripts/bench_gpu.py --help), and GPU_CHECK_PROFILE_SIDES those profiled (default: ours_bf16,ours_compile).
#   GPU_CHECK_DEADLINE   seconds after which the remaining steps are skipped (and counted as failed), so that a
#            lease's end still finds the summary written (default: none). The bench stops its sides 20 s before it
#            (bench_gpu.py --deadline), keeping those that finished.
#   GPU_CHECK_SIDE_TIMEOUT   seconds one bench side may take (default: none).
#
# Writes OUT/out/gpu_check.json (every step: command, exit status, seconds; the generate timings; the ZeRO-3 vs
# plain losses; versions and device), OUT/out/bench.json (scripts/bench_gpu.py, with the profile of our sides), and
# the runs themselves under OUT/. Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

CPU=0 OUT=runs/gpu_check BENCH=1 RESUME=0 BENCH_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) CPU=1 ;;
    --out) OUT=$2; shift ;;
    --no-bench) BENCH=0 ;;
    --resume) RESUME=1 ;;
    --bench-only) BENCH_ONLY=1 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT/out"
OUT=$(cd "$OUT" && pwd)
RESULTS=$OUT/out

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
if [ -n "${WHEELS:-}" ]; then
  SITE=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "error: could not install the wheels in $WHEELS" >&2; exit 1; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error

if [ "$CPU" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu
  HIDDEN=${GPU_CHECK_HIDDEN:-64} LAYERS=${GPU_CHECK_LAYERS:-2}
  PROMPTS=32 EVAL_PROMPTS=16 NEW_TOKENS=16 GEN_PROMPTS=16 ZERO3_CFG=accelerate_cfgs/cpu_zero3.yaml
  TRAIN_FAST="{}" SFT="{max_steps: 8}" RM="{max_steps: 8}"  # float32 on a CPU
  BENCH_ARGS=(--device cpu --tiny) DEVICE=cpu
else
  HIDDEN=${GPU_CHECK_HIDDEN:-1536} LAYERS=${GPU_CHECK_LAYERS:-18}
  PROMPTS=32 EVAL_PROMPTS=16 NEW_TOKENS=32 GEN_PROMPTS=32 ZERO3_CFG=accelerate_cfgs/zero3.yaml
  # the trainer's GPU path: bf16 weights with float32 masters, varlen attention, micro-batches by a token budget
  BF16="bf16: true, bf16_weights: true"
  TRAIN_FAST="{$BF16, attn_implementation: varlen, max_tokens_per_micro_batch: 8192}"
  SFT="{max_steps: 10, $BF16}" RM="{max_steps: 10, $BF16}"
  BENCH_ARGS=(--steps 12) DEVICE=cuda  # 4 warmup + 12 timed steps a side: the bench fits a short lease
fi
RLHF=("$PYTHON" -m rlhf_pipeline.cli)
STEPS=$RESULTS/steps.jsonl
[ "$RESUME" = 1 ] && [ -f "$STEPS" ] || : > "$STEPS"  # --resume appends: the summary takes each step's last record
FAILED=0

DEADLINE=${GPU_CHECK_DEADLINE:-0}
case "$DEADLINE" in
  ''|*[!0-9]*) echo "error: GPU_CHECK_DEADLINE=$DEADLINE: give whole seconds (0 or unset: none)" >&2; exit 2 ;;
esac
DEADLINE=$((10#$DEADLINE))  # 08 is eight seconds, not an octal error
step() {  # step NAME COMMAND...: run it, log its output to OUT/out/NAME.log, record status and seconds
  local name=$1; shift
  local t0 t1 rc
  if [ "$BENCH_ONLY" = 1 ] && [ "$name" != gpu_tests ] && [ "$name" != bench ]; then
    return 0  # not run, not recorded: a later --resume runs it
  fi
  if [ "$RESUME" = 1 ] && grep -qF "{\"step\": \"$name\", \"rc\": 0," "$STEPS"; then
    echo "[gpu_check] $name: passed in an earlier run (--resume), kept"
    return 0
  fi
  if [ "$DEADLINE" -gt 0 ] && [ "$SECONDS" -ge "$DEADLINE" ]; then
    echo "[gpu_check] $name: skipped, past GPU_CHECK_DEADLINE ($DEADLINE s)"
    "$PYTHON" -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "rc": -1, "seconds": 0, "skipped": "deadline"}))' \
      "$name" >> "$STEPS"
    FAILED=1
    return 1
  fi
  echo "[gpu_check] $name: $*"
  t0=$(date +%s.%N)
  "$@" > "$RESULTS/$name.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  "$PYTHON" -c 'import json, sys; n, rc, a, b = sys.argv[1:5]
print(json.dumps({"step": n, "rc": int(rc), "seconds": round(float(b) - float(a), 2), "command": sys.argv[5:]}))' \
    "$name" "$rc" "$t0" "$t1" "$@" >> "$STEPS"
  if [ "$rc" != 0 ]; then
    FAILED=1
    echo "[gpu_check] $name FAILED (exit $rc); the end of $RESULTS/$name.log:"
    tail -n 25 "$RESULTS/$name.log"
  fi
  return "$rc"
}

# 0. The GPU-gated tests: the varlen kernel against its reference, forward and backward, in bf16 (skipped on a CPU).
step gpu_tests "$PYTHON" -m pytest tests/test_attention.py -q -p no:cacheprovider -k "cuda or gpu or bf16"

# 1. The trainer benchmark against TRL (scripts/bench_gpu.py): first, as the headline figures. Our step as the
#    check trains (bf16 weights, varlen, a token budget) and the same with each decoder layer compiled (--compile),
#    each profiled for a few more steps after its timed ones, in the same process.
[ -z "${GPU_CHECK_BENCH_STEPS:-}" ] || BENCH_ARGS+=(--steps "$GPU_CHECK_BENCH_STEPS")
if [ "$BENCH" = 1 ]; then
  # and the compiled step at twice the budget, where its memory may allow it (each side's own, bench_gpu.py --help)
  SIDES=${GPU_CHECK_BENCH_SIDES:-ours_compile,trl,ours_bf16,ours_compile@16384,trl_precomputed}
  SIDES=${SIDES// /}
  PROFILED=${GPU_CHECK_PROFILE_SIDES:-}
  if [ -z "$PROFILED" ]; then  # by default ours_bf16 and ours_compile, of those that run
    for side in ours_bf16 ours_compile; do
      case ",$SIDES," in *",$side,"*) PROFILED=${PROFILED:+$PROFILED,}$side ;; esac
    done
  fi
  PROFILE_ARGS=()
  [ -z "$PROFILED" ] || PROFILE_ARGS=(--profile --profile-sides "$PROFILED")
  # under a deadline, the bench stops its sides in time for the summary (it keeps those it finished)
  [ -z "${GPU_CHECK_SIDE_TIMEOUT:-}" ] || BENCH_ARGS+=(--worker-timeout "$GPU_CHECK_SIDE_TIMEOUT")
  [ "$DEADLINE" -le 0 ] || BENCH_ARGS+=(--deadline "$((DEADLINE - SECONDS - 20))")
  # (an empty array expanded under set -u is an error before bash 4.4: hence the +)
  step bench "$PYTHON" scripts/bench_gpu.py "${BENCH_ARGS[@]}" --sides "$SIDES" ${PROFILE_ARGS[@]+"${PROFILE_ARGS[@]}"} \
    --output "$RESULTS/bench.json"
fi

# 2. Every stage of one iteration, as rlhf demo runs them: sft, train-rm, generate (hf engine), score, filter,
#    train, eval (iterations 0 and 1) and the report, on the demo's reviews task with a model of the check's size.
step demo "${RLHF[@]}" demo --output "$OUT/demo" --iterations 1 --hidden-size "$HIDDEN" --num-layers "$LAYERS" \
  --prompts-per-iteration "$PROMPTS" --eval-prompts "$EVAL_PROMPTS" --max-new-tokens "$NEW_TOKENS" \
  --sft-epochs 1 --rm-epochs 1 --train "$TRAIN_FAST" --sft "$SFT" --train-rm "$RM" --device "$DEVICE"

# 3. The reference pass as its own stage, on the iteration's pairs.
step ref_logps "${RLHF[@]}" ref-logps --model "$OUT/demo/sft" --input "$OUT/demo/iter_1/filter" \
  --output "$OUT/ref_logps"

# 4. The same DPO steps plain and under ZeRO-3 (accelerate launch, one process): their losses must agree.
TRAIN_ARGS=(--algo dpo --model "$OUT/demo/sft" --data "$OUT/ref_logps" --max-steps 3 --batch-size 4
            --temperature 0.8 --learning-rate 1e-5 --report-to none --seed 0 --attn-implementation varlen
            --max-tokens-per-micro-batch 1024)
# on a GPU both in bf16 with float32 masters: the plain trainer's (--bf16-weights) and DeepSpeed's bf16 mode
[ "$CPU" = 1 ] || TRAIN_ARGS+=(--bf16 --bf16-weights)
step train_plain "$PYTHON" -m rlhf_pipeline.stages.train "${TRAIN_ARGS[@]}" --output "$OUT/train_plain"
step train_zero3 "$PYTHON" -m accelerate.commands.launch --config_file "$ZERO3_CFG" --num_processes 1 \
  -m rlhf_pipeline.stages.train "${TRAIN_ARGS[@]}" --output "$OUT/train_zero3"

# 5. The hf engine on the check's model, on the GPU and on the same machine's CPU. (A model of the demo's own size
#    is slower on a GPU than on its CPU, which is why rlhf demo --device auto keeps such models on the CPU; two
#    earlier runs measured it, docs/benchmarks.md, and this check no longer spends its minutes on it.)
PROMPT_FILE=$REPO/src/rlhf_pipeline/data/prompts.jsonl
GEN_ARGS=(--prompts "$PROMPT_FILE" --limit "$GEN_PROMPTS" --n 4 --max-new-tokens 32 --temperature 0.8 --seed 0
          --engine hf)
step generate_check_size_model_default "${RLHF[@]}" generate --model "$OUT/demo/sft" "${GEN_ARGS[@]}" \
  --output "$OUT/generate_check_size_model_default"
if [ "$CPU" = 0 ]; then
  step generate_check_size_model_cpu env CUDA_VISIBLE_DEVICES="" "${RLHF[@]}" generate --model "$OUT/demo/sft" \
    "${GEN_ARGS[@]}" --output "$OUT/generate_check_size_model_cpu"
fi

# The summary: every step, each stage's output checked, the ZeRO-3 vs plain losses, the generate timings.
"$PYTHON" - "$OUT" "$CPU" "$BENCH_ONLY" <<'EOF'
import json, math, platform, sys
from pathlib import Path

out, cpu, bench_only = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1"
results = out / "out"
records = [json.loads(l) for l in (results / "steps.jsonl").read_text().splitlines() if l]
steps = list({s["step"]: s for s in records}.values())  # each step's last record (--resume appends)
for s in steps:  # the summary names no machine's paths: OUT is the check's --out, . the checkout
    s["command"] = [a.replace(str(out), "OUT").replace(str(Path.cwd()), ".") for a in s.get("command", [])]
summary = {"cpu": cpu, "bench_only": bench_only, "python": platform.python_version(), "steps": steps, "checks": {}}
try:
    import torch, transformers

    summary["torch"], summary["transformers"] = torch.__version__, transformers.__version__
    summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
except Exception as e:  # noqa: BLE001
    summary["versions_error"] = repr(e)
for name in ("datasets", "accelerate", "deepspeed", "trl", "peft"):
    try:
        summary[name] = __import__(name).__version__
    except Exception:  # noqa: BLE001
        summary[name] = None
checks = summary["checks"]

# every stage's output is complete: its manifest (a model run's too) is there
outputs = {"sft": "demo/sft", "train-rm": "demo/reward_model", "generate": "demo/iter_1/generate",
           "score": "demo/iter_1/score", "filter": "demo/iter_1/filter", "train": "demo/iter_1/train",
           "eval": "demo/iter_1/eval", "ref-logps": "ref_logps", "train (plain)": "train_plain",
           "train (ZeRO-3)": "train_zero3"}
checks["outputs"] = {k: (out / v / "manifest.json").is_file() for k, v in outputs.items()}
checks["report"] = (out / "demo" / "report.md").is_file()


def trajectory(run):
    """Each training step's loss and gradient norm (before clipping), from the run's metrics.jsonl."""
    path = out / run / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()] if path.is_file() else []
    return [[r["loss/train"], r["grad_norm"]] for r in rows if "loss/train" in r and "grad_norm" in r]


plain, zero3 = trajectory("train_plain"), trajectory("train_zero3")
tolerance = 1e-4 if cpu else 2e-2  # float32 on a CPU; bf16 autocast on a GPU rounds differently per layout
diffs = [max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(p, z)) for p, z in zip(plain, zero3)]
checks["zero3_vs_plain"] = {"plain_loss_grad_norm": plain, "zero3_loss_grad_norm": zero3,
                            "relative_differences": diffs, "tolerance": tolerance,
                            "agree": bool(plain) and len(plain) == len(zero3) and max(diffs) <= tolerance}
seconds = {s["step"]: s["seconds"] for s in steps if s["rc"] == 0}
default, on_cpu = seconds.get("generate_check_size_model_default"), seconds.get("generate_check_size_model_cpu")
sampling = {}
for where in ("default", "cpu"):  # the engine's own sampling time, from the generate manifest
    path = out / f"generate_check_size_model_{where}" / "manifest.json"
    sampling[where] = json.loads(path.read_text()).get("timing", {}).get("sampling_s") if path.is_file() else None
gen = {"check_size_model": {
    "seconds_default_device": default, "seconds_cpu": on_cpu,
    "cpu_over_default": on_cpu / default if default and on_cpu else None,
    "sampling_seconds_default_device": sampling["default"], "sampling_seconds_cpu": sampling["cpu"],
    "sampling_cpu_over_default": sampling["cpu"] / sampling["default"] if sampling["default"] and sampling["cpu"]
    else None}}
checks["generate_seconds"] = gen  # the whole commands, and the engine's sampling alone
path = results / "bench.json"
bench_ran = any(s["step"] == "bench" for s in steps)
if path.is_file() and bench_ran:
    report = json.loads(path.read_text())
    fields = ("tokens_per_s_steps", "mfu_steps", "peak_memory_gib", "compiled_graphs", "error", "pending",
              "rounds_failed")
    checks["bench"] = {"ratios": report.get("ratios"), "runs_pending": report.get("runs_pending"),
                       "cut_by_deadline": report.get("cut_by_deadline", False),
                       "sides": {k: {f: v.get(f) for f in fields} for k, v in report["sides"].items()},
                       "profiles": {k: {f: v["profile"].get(f) for f in ("steps", "kernels", "wall_ms", "gpu_busy_ms",
                                                                        "gpu_busy_fraction")}
                                    for k, v in report["sides"].items() if v.get("profile")}}
    # the compiled step computes the eager one: each compiled side that ran is compared with an eager side, its
    # step-1 loss and gradient norm agree (bf16 on a GPU, where Inductor's fusions round differently; a NaN does
    # not), and none of its layers fell back to eager
    sides = report["sides"]
    ratios = report.get("ratios") or {}
    compiled = [k for k, v in sides.items() if k.startswith("ours_compile") and "tokens_per_s_steps" in v]
    compile_tolerance = 1e-3 if cpu else 2e-2
    verdicts = {}
    for side in compiled:
        pair = next((k for k in ratios if k.startswith(side + "_vs_ours_bf16")), None)
        if pair is None:
            verdicts[side] = {"compared_with": None, "agree": False}
            continue
        r, eager = ratios[pair], sides[pair.split("_vs_")[1]]
        loss = r["step1_loss_abs_diff"] / max(abs(eager["first_loss"]), 1e-6)
        grad = r["step1_grad_norm_rel_diff"]
        fell_back = (sides[side].get("compiled_graphs") or {}).get("frames_fell_back")
        verdicts[side] = {"compared_with": pair.split("_vs_")[1], "loss_relative_difference": loss,
                          "grad_norm_relative_difference": grad, "frames_fell_back": fell_back,
                          "agree": all(math.isfinite(x) and x <= compile_tolerance for x in (loss, grad))
                                   and fell_back == 0}
    checks["compile_vs_eager"] = {"sides": verdicts, "tolerance": compile_tolerance,
                                  "agree": all(v["agree"] for v in verdicts.values())}
ok = all(s["rc"] == 0 for s in steps) and checks.get("compile_vs_eager", {"agree": True})["agree"] and (
    "bench" in checks if bench_only
    else all(checks["outputs"].values()) and checks["report"] and checks["zero3_vs_plain"]["agree"])
summary["passed"] = ok
(results / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps({"passed": ok, "device": summary.get("device"), "outputs": checks["outputs"],
                  "zero3_vs_plain": checks["zero3_vs_plain"], "compile_vs_eager": checks.get("compile_vs_eager"),
                  "generate": gen,
                  "steps": {s["step"]: [s["rc"], s["seconds"]] for s in steps}}, indent=1))
sys.exit(0 if ok else 1)
EOF
rc=$?
[ "$FAILED" = 0 ] && [ "$rc" = 0 ]
