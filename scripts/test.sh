#!/usr/bin/env bash
# Set everything up and run the whole test suite (this is what CI runs).
# The first run makes the real DeepSpeed and Hugging Face fixtures (a few minutes); they are cached in
# .fixture-cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# The real-browser test (tests/test_browser.py) drives Debian's Chromium with Playwright (no browser
# download). Install it where we can (root with apt); otherwise say plainly that the test will skip.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Chromium for the browser test (apt-get install chromium)" >&2
    export DEBIAN_FRONTEND=noninteractive
    for attempt in 1 2; do
      if apt-get update -qq && apt-get install -y -qq chromium >/dev/null; then break; fi
      echo "installing chromium failed (attempt $attempt)" >&2
      sleep 5
    done
  fi
  if [ ! -x /usr/bin/chromium ]; then
    echo "NOTE: /usr/bin/chromium is missing, so tests/test_browser.py will be SKIPPED." >&2
    echo "      To run it: sudo apt-get install chromium   (Debian/Ubuntu), then run this script again." >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
