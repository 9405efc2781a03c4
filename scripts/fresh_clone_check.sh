#!/usr/bin/env bash
# Check the project the way a newcomer meets it: clone the committed HEAD of this repository into a fresh temporary
# directory and run the README's commands there, with CI=true and nothing on stdin, timing each.
#
#   scripts/fresh_clone_check.sh               # make test, then make run
#   scripts/fresh_clone_check.sh test          # make test only (likewise: run)
#   scripts/fresh_clone_check.sh run test      # both, in the order given
#   scripts/fresh_clone_check.sh --keep test   # keep the clone and its logs afterwards (default: removed)
#
# Every command runs even if an earlier one failed; the script ends with a summary (command, exit status, seconds)
# and exits 1 if any command failed, 2 on a usage error or a failed clone. Uncommitted changes are not in the
# clone: commit first. The tests that read the real AIME-2024 file take it from DAPO_AIME_PARQUET, which is passed
# through when set (a relative path is made absolute first); when it is unset and this checkout has
# data/aime-2024.parquet (git-ignored, so absent from the clone), it is pointed at that copy. Without either,
# those tests fail, since CI is set.
set -euo pipefail

prog="scripts/fresh_clone_check.sh"

usage() {
  echo "usage: $prog [--keep] [test|run ...]"
  echo "  test, run  the make targets to run in a fresh clone of HEAD, in the order given (default: test run)"
  echo "  --keep     keep the clone and its logs (default: remove them at the end)"
}

keep=0
targets=()
for arg in "$@"; do
  case "$arg" in
    test | run) targets+=("$arg") ;;
    --keep) keep=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      echo "$prog: unknown argument '$arg'" >&2
      usage >&2
      exit 2
      ;;
  esac
done
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(test run)
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! top="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null)"; then
  echo "$prog: $here is not inside a git repository" >&2
  exit 2
fi
head_sha="$(git -C "$top" rev-parse HEAD)"
if [[ -n "$(git -C "$top" status --porcelain --untracked-files=no)" ]]; then
  echo "note: $top has uncommitted changes; the clone has only the committed HEAD ($head_sha)"
fi

if [[ -n "${DAPO_AIME_PARQUET:-}" ]]; then
  if [[ "$DAPO_AIME_PARQUET" != /* ]]; then
    DAPO_AIME_PARQUET="$PWD/$DAPO_AIME_PARQUET"
  fi
  export DAPO_AIME_PARQUET
elif [[ -f "$top/data/aime-2024.parquet" ]]; then
  export DAPO_AIME_PARQUET="$top/data/aime-2024.parquet"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/dapo-fresh-clone.XXXXXX")"
cleanup() {
  if [[ "$keep" -eq 1 ]]; then
    echo "kept: the clone in $work/repo, the logs in $work/logs"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

clone="$work/repo"
logs="$work/logs"
mkdir -p "$logs"
# A plain clone checks out the source's default branch: check out HEAD's commit itself (fetched when no branch
# holds it), so the clone is what this checkout has committed, whichever branch or detached HEAD that is.
clone_head() {
  git clone --quiet --no-checkout "$top" "$clone" || return 1
  if ! git -C "$clone" cat-file -e "$head_sha^{commit}" 2>/dev/null; then
    git -C "$clone" fetch --quiet origin "$head_sha" || return 1
  fi
  git -C "$clone" checkout --quiet --detach "$head_sha"
}
if ! clone_head; then
  echo "$prog: could not clone $top at $head_sha into $clone" >&2
  exit 2
fi
echo "fresh clone of $top at $head_sha in $clone"
echo "DAPO_AIME_PARQUET=${DAPO_AIME_PARQUET:-(unset)}"

names=()
codes=()
times=()
failed=0
for target in "${targets[@]}"; do
  echo
  echo "== make $target (log: $logs/$target.log)"
  start=$SECONDS
  set +e
  # As a newcomer: no PYTHONPATH into another checkout, CI set, nothing to read on stdin.
  (cd "$clone" && env -u PYTHONPATH CI=true make "$target" </dev/null) 2>&1 | tee "$logs/$target.log"
  code=${PIPESTATUS[0]}
  set -e
  names+=("make $target")
  codes+=("$code")
  times+=("$((SECONDS - start))")
  if [[ "$code" -ne 0 ]]; then
    failed=1
  fi
done

echo
echo "== summary (clone of $head_sha)"
printf '%-10s %6s %9s\n' command exit seconds
for i in "${!names[@]}"; do
  printf '%-10s %6s %9s\n' "${names[$i]}" "${codes[$i]}" "${times[$i]}"
done
exit "$failed"
