#!/usr/bin/env bash
# Set everything up and run the whole test suite (this is what CI runs).
# The first run makes the real DeepSpeed fixtures (a few minutes); they are cached in .fixture-cache/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
exec .venv/bin/python -m pytest "$@"
