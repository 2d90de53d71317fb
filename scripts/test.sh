#!/usr/bin/env bash
# Set everything up and run the whole test suite (this is what CI runs).
# The first run makes the real DeepSpeed and Hugging Face fixtures (a few minutes); they are cached in
# .fixture-cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# Two system packages, installed where we can (root with apt), else said plainly:
# - the real-browser test (tests/test_browser.py) drives Debian's Chromium with Playwright (no browser
#   download);
# - the NVMe (ZeRO-Infinity) tests (tests/test_nvme.py) need libaio-dev, for DeepSpeed's async_io op.
want=()
[ -x /usr/bin/chromium ] || want+=(chromium)
[ -f /usr/include/libaio.h ] || want+=(libaio-dev)
if [ ${#want[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${want[*]} for the browser and NVMe tests (apt-get install)" >&2
  export DEBIAN_FRONTEND=noninteractive
  for attempt in 1 2; do
    if apt-get update -qq && apt-get install -y -qq "${want[@]}" >/dev/null; then break; fi
    echo "installing ${want[*]} failed (attempt $attempt)" >&2
    sleep 5
  done
fi
if [ ! -x /usr/bin/chromium ]; then
  echo "NOTE: /usr/bin/chromium is missing, so tests/test_browser.py will be SKIPPED." >&2
  echo "      To run it: sudo apt-get install chromium   (Debian/Ubuntu), then run this script again." >&2
fi
builder=
if [ -f /usr/include/libaio.h ]; then
  # DeepSpeed's async_io and cpu_adam ops: a JIT build of about 20 CPU-minutes, once, into the fixture cache.
  # It starts now, at low priority, so that it uses what the other tests leave idle; the NVMe tests run last
  # (tests/conftest.py) and wait for it.
  export CKPTLIB_NVME_OPS=build
  if ! .venv/bin/python -m tests.fixtures.nvme.factory --ops-built >/dev/null 2>&1; then
    mkdir -p .fixture-cache
    echo "building DeepSpeed's async_io and cpu_adam ops for the NVMe tests in the background" \
         "(log .fixture-cache/nvme-ops-build.log)" >&2
    nice -n 19 .venv/bin/python -m tests.fixtures.nvme.factory --ops-only >.fixture-cache/nvme-ops-build.log 2>&1 &
    builder=$!
  fi
else
  echo "NOTE: libaio-dev is missing, so the NVMe tests in tests/test_nvme.py will be SKIPPED." >&2
  echo "      To run them: sudo apt-get install libaio-dev   (Debian/Ubuntu), then run this script again." >&2
fi
# the peft fixtures' transformers 4.x runs (scripts/setup.sh makes .venv-tf4)
[ -x .venv-tf4/bin/python ] && export CKPTLIB_PEFT_TF4_PYTHON="$PWD/.venv-tf4/bin/python"
status=0
# two workers (pytest-xdist), a test file each at a time: the fixture factories build under a lock
# (tests/fixtures/cache.py), each module's DeepSpeed launches stay in one worker; -n 0 runs in one process
# the 30 slowest steps in the log: where the suite's time goes (it must stay under 35 minutes on 2 cores)
.venv/bin/python -m pytest -n "${CKPTLIB_TEST_WORKERS:-2}" --dist loadfile --durations 30 "$@" || status=$?
if [ -n "$builder" ] && kill -0 "$builder" 2>/dev/null; then
  kill "$builder" 2>/dev/null || true  # the tests did not need it (a selection); a later run builds again
fi
exit $status
