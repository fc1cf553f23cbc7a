#!/usr/bin/env bash
# The wheels a CUDA machine image with Python 3.12 and torch, transformers, accelerate and peft (but no datasets, TRL
# or DeepSpeed) needs for scripts/gpu_check.sh, downloaded here into one folder (default .whl) for a machine that
# cannot reach a package index:
#   bash scripts/gpu_wheels.sh [DIR]
#   (there)  WHEELS=DIR bash scripts/gpu_check.sh
# DeepSpeed is built here as a pure-Python wheel (DS_BUILD_OPS=0); the ops it needs are JIT-built there with nvcc
# and ninja. PYTHON_VERSION and PIP (default .venv/bin/pip, else pip3) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON_VERSION:-3.12}
if [ -z "${PIP:-}" ]; then
  if [ -x .venv/bin/pip ]; then PIP=.venv/bin/pip; else PIP=pip3; fi
fi
mkdir -p "$DIR"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# datasets and what it needs beyond such an image; trl; DeepSpeed's pure-Python requirements
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp "${platforms[@]}" -d "$DIR" \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 trl==1.16.0 hjson pydantic pydantic-core \
  annotated-types typing-inspection typing_extensions
DS_BUILD_OPS=0 "$PIP" wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$DIR"
ls -la "$DIR"
