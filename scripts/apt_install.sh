#!/usr/bin/env bash
# Install one Debian package with apt-get, quietly and non-interactively (no stdin needed, as in CI), as root or
# through password-less sudo: scripts/ensure_chromium.sh and scripts/ensure_postgres.sh call it.
#   scripts/apt_install.sh PACKAGE
# Exit status: 0 installed; 1 apt-get failed (its last lines on stderr); 2 no apt-get here; 3 installing needs root.
set -uo pipefail
pkg="${1:?usage: scripts/apt_install.sh PACKAGE}"
command -v apt-get >/dev/null 2>&1 || exit 2
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  exit 3
fi
log="$(mktemp)"
apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=300)
if "${apt[@]}" update >"$log" 2>&1 && "${apt[@]}" install -y "$pkg" >>"$log" 2>&1 </dev/null; then
  rm -f "$log"
  exit 0
fi
tail -n 15 "$log" >&2
rm -f "$log"
exit 1
