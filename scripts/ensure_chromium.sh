#!/usr/bin/env bash
# The browser test's Chromium (tests/test_ui_browser.py, scripts/ui_screenshots.py): Debian's `chromium` package,
# installed with apt-get (scripts/apt_install.sh) where /usr/bin/chromium (or $DAPO_CHROMIUM) is missing. `make test`
# calls this first. Where it cannot install, it says why and exits 0: the browser test then skips outside CI and
# fails in CI (CI=true) with the cause.
set -uo pipefail

chromium="${DAPO_CHROMIUM:-/usr/bin/chromium}"
[ -x "$chromium" ] && exit 0

note() { echo "ensure_chromium: $*; the browser test will skip (fail in CI)" >&2; exit 0; }
echo "ensure_chromium: installing Debian's chromium for the browser test (apt-get, a minute or two) ..."
"$(dirname "$0")/apt_install.sh" chromium
case $? in
  0) [ -x "$chromium" ] || note "chromium installed, but $chromium is still missing (DAPO_CHROMIUM points elsewhere?)"
     echo "ensure_chromium: $("$chromium" --version 2>/dev/null | head -1)" ;;
  2) note "no $chromium and no apt-get here (install Chromium, or set DAPO_CHROMIUM)" ;;
  3) note "no $chromium, and installing it needs root: sudo apt-get install -y chromium" ;;
  *) note "apt-get could not install chromium (output above)" ;;
esac
