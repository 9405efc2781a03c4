#!/usr/bin/env bash
# The browser test's Chromium (tests/test_ui_browser.py, scripts/ui_screenshots.py): Debian's `chromium` package,
# installed with apt-get where /usr/bin/chromium (or $DAPO_CHROMIUM) is missing. `make test` calls this first.
# Quiet and non-interactive (works with no stdin, as in CI); needs root or password-less sudo. Where it cannot
# install, it says why and exits 0: the browser test then skips outside CI and fails in CI (CI=true) with the cause.
set -uo pipefail

chromium="${DAPO_CHROMIUM:-/usr/bin/chromium}"
[ -x "$chromium" ] && exit 0

note() { echo "ensure_chromium: $*; the browser test will skip (fail in CI)" >&2; exit 0; }
command -v apt-get >/dev/null 2>&1 || note "no $chromium and no apt-get here (install Chromium, or set DAPO_CHROMIUM)"
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  note "no $chromium, and installing it needs root: sudo apt-get install -y chromium"
fi

echo "ensure_chromium: installing Debian's chromium for the browser test (apt-get, a minute or two) ..."
log="$(mktemp)"
apt=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=300)
if "${apt[@]}" update >"$log" 2>&1 && "${apt[@]}" install -y chromium >>"$log" 2>&1 </dev/null; then
  rm -f "$log"
  [ -x "$chromium" ] || note "chromium installed, but $chromium is still missing (DAPO_CHROMIUM points elsewhere?)"
  echo "ensure_chromium: $("$chromium" --version 2>/dev/null | head -1)"
else
  tail -n 15 "$log" >&2
  rm -f "$log"
  note "apt-get could not install chromium (output above)"
fi
