#!/usr/bin/env bash
# Set up ckptlib (with the notebook extras) and open the notebooks in JupyterLab.
#   bash scripts/lab.sh                        opens notebooks/00_start_here.ipynb
#   bash scripts/lab.sh --no-browser --ip=0.0.0.0 --port=8899     any other JupyterLab options
# The notebooks default to the bundled sample checkpoint (samples/zero2_bf16_w2/ckpt); set
# checkpoint_dir in their first cell to use yours. Results go to notebooks/output/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=()
[ "$(id -u)" = 0 ] && args+=(--allow-root)   # JupyterLab refuses root without it
echo "Opening JupyterLab on notebooks/ (stop it with Ctrl-C)"
exec .venv/bin/jupyter lab ${args[@]+"${args[@]}"} "$@" notebooks/00_start_here.ipynb
