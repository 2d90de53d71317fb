#!/usr/bin/env bash
# Set up ckptlib in ./.venv on a fresh machine (idempotent).
#   bash scripts/setup.sh          library + command line (+ notebook extras)
#   bash scripts/setup.sh --dev    also DeepSpeed 0.19.8 and the test tools
# ckptlib itself needs no torch (pip install ckptlib); the notebooks and the tests do: torch is installed
# first, pinned, so that nothing pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip >/dev/null
.venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || $PIP install "torch==2.13.0"
extras="notebooks"
[ "${1:-}" = "--dev" ] && extras="notebooks,dev"
DS_BUILD_OPS=0 $PIP install -e ".[${extras}]"
if [ "${1:-}" = "--dev" ]; then
  # torchtitan's own CheckpointManager loads the DCP exports in tests/test_dcp_fsdp.py. Without its
  # dependencies (they pin a nightly torch, datasets, wandb ...): what its checkpoint code imports.
  $PIP install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
  # transformers 4.57.1 (the release of the empty-adapter reports) for the peft fixtures' 4.x runs
  # (tests/fixtures/peft, CKPTLIB_PEFT_TF4_PYTHON): a venv holding it and its tokenizers and hub, which sees
  # every other package (torch, DeepSpeed, peft, accelerate) in .venv through a .pth file
  if [ ! -x .venv-tf4/bin/python ] || ! .venv-tf4/bin/python -c "import transformers, sys; sys.exit(transformers.__version__ != '4.57.1')" 2>/dev/null; then
    "$PY" -m venv .venv-tf4
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    tf4site=$(.venv-tf4/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" > "$tf4site/ckptlib-main-venv.pth"
    .venv-tf4/bin/python -m pip --disable-pip-version-check -q install --no-deps transformers==4.57.1 \
      tokenizers==0.22.2 huggingface_hub==0.36.2
  fi
fi
echo "ckptlib set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
