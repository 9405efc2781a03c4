#!/usr/bin/env bash
# PostgreSQL's server for `make stack` (MLflow's and Prefect's store, flows/services/postgres.py): Debian's
# `postgresql` package, installed with apt-get (scripts/apt_install.sh) where no initdb is found (on PATH or in
# /usr/lib/postgresql/*/bin). Where it cannot install, it says why and exits 1: the stack cannot start without it.
# The package's own cluster (main, port 5432) is not needed: the stack runs a cluster of the project's own.
set -uo pipefail

found() { command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; }
found && exit 0
fail() { echo "ensure_postgres: $*" >&2; exit 1; }
echo "ensure_postgres: installing Debian's postgresql for the stack (apt-get, a minute or two) ..."
"$(dirname "$0")/apt_install.sh" postgresql
case $? in
  0) found || fail "postgresql installed, but no initdb found"
     echo "ensure_postgres: $(compgen -G "/usr/lib/postgresql/*/bin/postgres" | tail -1) installed" ;;
  2) fail "no PostgreSQL server and no apt-get here: install PostgreSQL (initdb on PATH)" ;;
  3) fail "no PostgreSQL server, and installing it needs root: sudo apt-get install -y postgresql" ;;
  *) fail "apt-get install postgresql failed (above)" ;;
esac
