"""The anchor of `ckpt check` and `ckpt diff` in bench/floor_bench.py: what a DeepSpeed user does without ckptlib.

    python bench/ds_check_diff.py check CKPT          # per tensor: nan, inf, zeros, min, max, mean, std, norm
    python bench/ds_check_diff.py diff CKPT EXPORT    # each fp32 master against EXPORT/model*.safetensors

DeepSpeed has no tool for either; the nearest is its converter's library function
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` (the consolidated fp32 state dict,
in memory) followed by torch's reductions. Prints one summary line; exit 1 if a tensor differs (diff).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import load_file


def statistics(t: torch.Tensor) -> tuple:
    """What ckpt check reports, as a torch user would compute it (in float64, as ckpt check accumulates)."""
    t = t.double()
    return (int(torch.isnan(t).sum()), int(torch.isinf(t).sum()), int((t == 0).sum()), float(t.min()),
            float(t.max()), float(t.mean()), float(t.std()) if t.numel() > 1 else 0.0, float(t.norm()))


def main() -> int:
    mode, ckpt = sys.argv[1], Path(sys.argv[2])
    masters = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    if mode == "check":
        found = [statistics(t) for t in masters.values()]
        bad = sum(1 for s in found if s[0] + s[1])
        print(f"{len(masters)} tensors checked, {bad} with NaN/Inf")
        return 0
    other = {}
    for f in sorted(Path(sys.argv[3]).glob("model*.safetensors")):
        other.update(load_file(f))
    changed = [k for k, t in masters.items() if k not in other or not torch.equal(t, other[k])]
    print(f"{len(masters)} tensors compared, {len(changed)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
