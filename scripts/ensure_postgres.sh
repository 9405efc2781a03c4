#!/usr/bin/env bash
# PostgreSQL's server for `make stack` (MLflow's and Prefect's store, flows/services/postgres.py): Debian's
# `postgresql` package, installed with apt-get where no initdb is found (on PATH or in /usr/lib/postgresql/*/bin).
# Quiet and non-interactive (no stdin needed, as in CI); needs root or password-less sudo. Where it cannot install,
# it says why and exits 1: the stack cannot start without it.
set -uo pipefail

if command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  exit 0
fi
fail() { echo "ensure_postgres: $*" >&2; exit 1; }
command -v apt-get >/dev/null 2>&1 || fail "no PostgreSQL server and no apt-get here: install PostgreSQL (initdb on PATH)"
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  fail "no PostgreSQL server, and installing it needs root: sudo apt-get install -y postgresql"
fi

echo "ensure_postgres: installing Debian's postgresql for the stack (apt-get, a minute or two) ..."
log="$(mktemp)"
apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=300)
# the package's own cluster (main, port 5432) is not needed: the stack runs a cluster of the project's own
if "${apt[@]}" update >"$log" 2>&1 && "${apt[@]}" install -y postgresql >>"$log" 2>&1 </dev/null; then
  rm -f "$log"
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || fail "postgresql installed, but no initdb found"
  echo "ensure_postgres: $(compgen -G "/usr/lib/postgresql/*/bin/postgres" | tail -1) installed"
else
  tail -n 15 "$log" >&2
  rm -f "$log"
  fail "apt-get install postgresql failed (above)"
fi
