#!/usr/bin/env bash
# The Hugging Face round trip on the tests' tiny Llama, from a fresh terminal, nothing copied by hand:
# train with transformers.Trainer + DeepSpeed ZeRO-2 at 2 ranks, export, from_pretrained, reshard to 3
# ranks, resume with the Trainer at 3 ranks.   bash scripts/hf_roundtrip.sh [WORK_DIR]
# (needs the dev setup: bash scripts/setup.sh --dev)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ge 1 ]; then
  W=$1; [ -e "$W" ] && { echo "$W exists: give a folder that does not exist yet" >&2; exit 1; }
else
  W=/tmp/ckptlib-hf-roundtrip; rm -rf "$W"
fi
mkdir -p "$W"
export DS_ACCELERATOR=cpu PATH="$PWD/.venv/bin:$PATH"
run() { echo; echo "\$ $*"; "$@"; }

train() { echo; echo "\$ torchrun --standalone --nproc_per_node $*"; torchrun --standalone --nproc_per_node "$@" \
    --log-level warning 2>&1 | grep -E "loss|Error" || true; }

train 2 tests/fixtures/hf/train.py --model llama --zero 2 --output-dir "$W/run" --steps 6 --save-steps 2
run ls "$W/run" "$W/run/checkpoint-4"
run ckpt inspect "$W/run" | head -12
run ckpt export "$W/run" "$W/hf"
run ls "$W/hf"
run python -c "
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained('$W/hf')
tok = AutoTokenizer.from_pretrained('$W/hf')
ids = tok.apply_chat_template([{'role': 'user', 'content': 'w5 w6 w7'}], add_generation_prompt=True,
                              return_tensors='pt', return_dict=True)['input_ids']
print('dtype', model.dtype, '- generated', model.generate(ids, max_new_tokens=4, do_sample=False).tolist())"
run ckpt reshard "$W/run/checkpoint-4" "$W/w3" --world-size 3
run ls "$W/w3"
train 3 tests/fixtures/hf/train.py --model llama --zero 2 --resume "$W/w3" --more-steps 2 --output-dir "$W/resumed"
run python -c "
import json
a = {s['step']: s['loss'] for s in json.load(open('$W/run/losses.json'))['steps']}
b = {s['step']: s['loss'] for s in json.load(open('$W/resumed/losses.json'))['steps']}
for k in sorted(b): print(f'step {k}: original run (2 ranks) {a[k]:.7f}   resumed from the reshard (3 ranks) {b[k]:.7f}')"
