#!/usr/bin/env bash
# Create the virtual environment (.venv by default) and install torch and the package into it.
#   bash scripts/install.sh [EXTRAS]      e.g. bash scripts/install.sh dev   or   bash scripts/install.sh train,dev
#   TORCH_SPEC  the torch requirement to install first (default torch==2.13.0; a CPU build is enough here)
#   VENV        where the virtual environment lives (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${1:-}

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# torch first and pinned: the package asks for any torch>=2.1, which the pinned build then satisfies.
"$VENV/bin/pip" install -q "$TORCH_SPEC"
# DeepSpeed ships as a source package whose build imports torch: build it against the torch just installed
# (with build isolation pip would fetch another torch into the build environment).
case ",$EXTRAS," in
  *,train,*|*,dev,*|*,bench,*) "$VENV/bin/pip" install -q --no-build-isolation "deepspeed>=0.14" ;;
esac
"$VENV/bin/pip" install -q -e ".${EXTRAS:+[$EXTRAS]}"
