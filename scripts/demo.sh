#!/usr/bin/env bash
# Set up and run the main job on the bundled sample checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ckpt inspect samples/zero2_bf16_w2/ckpt
