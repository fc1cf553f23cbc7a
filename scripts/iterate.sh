#!/usr/bin/env bash
# All of REBEL's UltraFeedback recipe in one command: T iterations of generate -> score -> filter -> train
# (plus eval of iter_0 and every iteration when the config sets eval_prompts).
#
#   bash scripts/iterate.sh                                  # the config below, 3 iterations, 8 x 80 GB GPUs
#   CONFIG=my.yaml bash scripts/iterate.sh                   # another config
#   bash scripts/iterate.sh --push-to-hub ORG/NAME           # also upload every stage output
#
# - Run it from the rlhf-train env (conda activate rlhf-train; envs/train.yml). Once, before the first run:
#   bash scripts/gpu/prepare_prompts.sh (the config's `prompts:`), and `conda env create -f envs/vllm.yml`.
# - Each stage runs with its launcher from the config's `launchers:` (`-m rlhf_pipeline.stages.<stage> args`):
#   generate under `conda run -n rlhf-vllm python` (vLLM pins its own torch), train under
#   `accelerate launch --config_file accelerate_cfgs/zero3.yaml` (8 processes, ZeRO-3), score and eval under
#   `accelerate launch --multi_gpu --num_processes 8` (data parallel; eval in rlhf-vllm); filter in this env.
#   Another node size: --launchers '{score: ..., train: ...}' on the command line changes those stages' launchers
#   and keeps the config's others (so do --generate, --train, ... for their sections, key by key).
# - Outputs: <output>/iter_<t>/<stage>/, each with a manifest.json written last. Ctrl-C, a crash or a lost node:
#   run the same command again. Finished stages are skipped and it resumes at the first incomplete stage; an
#   interrupted train stage continues from its newest checkpoint (train.save_every).
# - --push-to-hub ORG/NAME (or `push_to_hub:` in the config) names the run's Hub repos: each stage's dataset goes
#   to the dataset repo ORG/NAME as the configuration iter<t>-<stage> (its manifest as manifests/iter<t>-<stage>.json),
#   each policy to the model repo ORG/NAME as the branch iter<t>-train; --private creates them private, and
#   --resume on another machine goes on from what is there. The token is read from HF_TOKEN in the environment
#   (export HF_TOKEN=...); it is never put on the command line or in the config.
# Other arguments are passed to `rlhf iterate` as they are (`rlhf iterate --help`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."   # repo root: the config's relative paths resolve from here

CONFIG=${CONFIG:-scripts/gpu/rebel_ultrafeedback.yaml}

command -v rlhf >/dev/null || { echo "rlhf not found: conda activate rlhf-train" >&2; exit 1; }
rlhf iterate --config "$CONFIG" "$@"
