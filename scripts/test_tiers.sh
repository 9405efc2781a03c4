#!/usr/bin/env bash
# `make test`'s two pytest runs: the tests outside the vllm tier in .venv on $TEST_WORKERS pytest-xdist workers,
# then the vllm-marked tests in .venv-vllm. Where .venv-vllm is missing it is built in the background while the
# .venv tests run (its log: outputs/test/vllm-venv.log). The vllm tier itself runs after them, on an idle machine:
# run beside them, Ray's 30-second start deadline for its raylet (hard-coded in Ray) was missed once in CI.
# The exit status is non-zero if either run failed. Run by the Makefile (it exports BIN, VLLM_VENV, TEST_WORKERS and
# PYTEST_ARGS); docs/development.md says why.
set -u
cd "$(dirname "$0")/.."
: "${BIN:=.venv/bin}" "${TEST_WORKERS:=2}" "${PYTEST_ARGS:=}"
log_dir=outputs/test
mkdir -p "$log_dir"
venv_log=$log_dir/vllm-venv.log
# the project's own bytecode is cached across the suite's many subprocesses even where the shell turns it off
export PYTHONDONTWRITEBYTECODE=

# the venv build in its own process group, so that an interrupted run stops it too, at the lowest CPU priority, so
# that it takes the time the .venv tests leave idle (they wait on servers and subprocesses)
set -m
nice -n 19 make --no-print-directory vllm-venv >"$venv_log" 2>&1 &
venv_pid=$!
set +m
trap 'kill -- -"$venv_pid" 2>/dev/null; exit 130' INT TERM

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
OMP_NUM_THREADS=1 "$BIN/python" -m pytest -m "not vllm" -n "$TEST_WORKERS" --dist loadfile --no-loadscope-reorder \
  $PYTEST_ARGS
main_rc=$?

wait "$venv_pid"
venv_rc=$?
trap - INT TERM
if [ "$venv_rc" -ne 0 ]; then
  echo "make test: building .venv-vllm failed (exit $venv_rc); its log, $venv_log:" >&2
  cat "$venv_log" >&2
  exit 1
fi
echo
echo "== the vllm tier (.venv-vllm)"
make --no-print-directory test-vllm
vllm_rc=$?
if [ "$main_rc" -ne 0 ] || [ "$vllm_rc" -ne 0 ]; then
  echo "make test: the .venv tests exited $main_rc, the vllm tier $vllm_rc" >&2
  exit 1
fi
