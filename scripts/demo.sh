#!/usr/bin/env bash
# Set up and open the notebooks in JupyterLab on the bundled sample checkpoint (see scripts/lab.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/lab.sh "$@"
