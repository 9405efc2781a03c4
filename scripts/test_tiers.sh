#!/usr/bin/env bash
# `make test`'s two pytest runs, side by side: the vllm-marked tests in .venv-vllm (built first where missing) in
# the background, the rest in .venv on $TEST_WORKERS pytest-xdist workers. The vllm side's output goes to
# outputs/test/vllm-tier.log and is printed when both are done; the exit status is non-zero if either failed.
# Run by the Makefile (it exports BIN, VLLM_VENV, TEST_WORKERS and PYTEST_ARGS); docs/development.md says why.
set -u
cd "$(dirname "$0")/.."
: "${BIN:=.venv/bin}" "${TEST_WORKERS:=2}" "${PYTEST_ARGS:=}"
log_dir=outputs/test
mkdir -p "$log_dir"
vllm_log=$log_dir/vllm-tier.log
# the project's own bytecode is cached across the suite's many subprocesses even where the shell turns it off
export PYTHONDONTWRITEBYTECODE=

# its own process group, so that an interrupted run stops it too; at the lowest CPU priority, so that it takes the
# time the .venv tests leave idle (they wait on servers and subprocesses) rather than slowing them down
set -m
nice -n 19 make --no-print-directory test-vllm >"$vllm_log" 2>&1 &
vllm_pid=$!
set +m
trap 'kill -- -"$vllm_pid" 2>/dev/null; exit 130' INT TERM
echo "the vllm tier runs in the background (.venv-vllm; its log: $vllm_log)"

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
OMP_NUM_THREADS=1 "$BIN/python" -m pytest -m "not vllm" -n "$TEST_WORKERS" --dist loadfile --no-loadscope-reorder \
  $PYTEST_ARGS
main_rc=$?

wait "$vllm_pid"
vllm_rc=$?
trap - INT TERM
echo
echo "== the vllm tier (.venv-vllm), from $vllm_log:"
cat "$vllm_log"
if [ "$main_rc" -ne 0 ] || [ "$vllm_rc" -ne 0 ]; then
  echo "make test: the .venv tests exited $main_rc, the vllm tier $vllm_rc" >&2
  exit 1
fi
