"""peft's merge of an adapter into its base model, one tensor at a time: the base model's files, and the arithmetic of
a :class:`~ckptlib.plan.MergedTensor`.

The arithmetic is peft 0.21's ``merge_and_unload()`` on a base loaded in the merge dtype with the fp32 adapter, done
with torch as peft does it (so that the result is peft's bit for bit):

- ``linear``: ``(W.float() + scaling · B @ A).to(W.dtype)`` (``B @ A`` in fp32, then scaled);
- ``conv1d`` (a Conv1D, ``W`` stored ``[in, out]``; peft's ``fan_in_fan_out``): ``(W.float() + (B @ A)ᵀ ·
  scaling).to(W.dtype)``;
- ``embedding``: ``W + ((B @ A)ᵀ · scaling).to(W.dtype)`` (peft rounds the delta to the weight's dtype first);
- ``dora``: ``(m / ‖W + ΔW‖_row) · (W + ΔW)``, rounded to ``W.dtype``;
- ``dora_embedding``, ``dora_conv1d`` (``ΔW = (B @ A)ᵀ · scaling``, ``W`` ``[vocab, hidden]``, resp. ``[in, out]``):
  ``(m / ‖Wᵀ + ΔWᵀ‖_row)`` as a row, times ``W + ΔW``, rounded to ``W.dtype``: the magnitude is per column (one value
  per hidden feature, resp. per output feature); the norm is taken over the transposed sum, as peft does;
- ``bias``: the trained bias (or the base's) in the merge dtype, plus ``scaling · lora_B.bias`` where there is one;

``W`` being the base tensor as stored, widened to fp32 and rounded to the merge dtype. :func:`write_merged` is what
the runner's writer calls for such a tensor; :func:`largest_gap` computes the largest difference between the two
``--merge-on`` modes; :func:`arithmetic_bytes` is what merging one tensor holds. Needs torch (imported when used).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ..dtypes import import_torch, itemsize, torch_dtype
from ..errors import CkptError
from ..layout.ranges import StoredRange
from ..plan import MergedTensor
from ..progress import check_cancel
from .sources import SourceFiles
from .stformat import read_header
from .streaming import read_ranges

WHY_TORCH = "merging an adapter into its base (peft's arithmetic)"
#: the merges whose delta is ``(B @ A)ᵀ``: an embedding's, a Conv1D's (stored ``[in, out]``)
TRANSPOSED = ("embedding", "conv1d", "dora_embedding", "dora_conv1d")
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"


# ============================================================================================ the base's files
def base_files(base: Path) -> tuple[list[Path], Optional[Path]]:
    """``(the base's safetensors files, its index file or None)``: ``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names.

    Raises:
        CkptError: neither is there, or the index is not JSON."""
    index = base / INDEX
    if index.is_file():
        try:
            names = sorted(set((json.loads(index.read_text()).get("weight_map") or {}).values()))
        except (OSError, ValueError, AttributeError) as e:
            raise CkptError(f"not a readable index ({e})", path=index) from None
        return [base / n for n in names], index
    if (base / WEIGHTS).is_file():
        return [base / WEIGHTS], None
    raise CkptError("the base holds no model.safetensors (or shards with model.safetensors.index.json)", path=base,
                    hint="give the local folder of the base model the adapter was trained on (save_pretrained's)")


def base_headers(files: list[Path]) -> dict[Path, list]:
    """``{file: its tensors}`` (:class:`~ckptlib.io.stformat.StoredTensorInfo`, in file order), from the headers
    alone (a few KB a file).

    Raises:
        CkptError: a file that is not a readable safetensors file (named)."""
    out = {}
    for f in files:
        try:
            _, tensors = read_header(f)
        except (OSError, ValueError) as e:
            raise CkptError(f"not a readable safetensors file ({e})", path=f) from None
        out[f] = tensors
    return out


def stored_ranges(path: Path, t) -> tuple:
    """A tensor of a safetensors file (its :class:`~ckptlib.io.stformat.StoredTensorInfo`) as a range list."""
    return (StoredRange(os.fspath(path), t.offset, t.dtype, t.nbytes // itemsize(t.dtype)),)


def find_base_tensor(base: Path, name: str) -> Optional[tuple]:
    """The range list of the base's tensor ``name`` (None: the base does not hold it), read from the headers."""
    files, _ = base_files(Path(base))
    for f, tensors in base_headers(files).items():
        for t in tensors:
            if t.name == name:
                return stored_ranges(f, t)
    return None


# ============================================================================================ the arithmetic
def _read(torch, ranges, dtype: str, shape, files: SourceFiles):
    return read_ranges(ranges, dtype, files).reshape(tuple(shape))


def merged_value(t: MergedTensor, files: SourceFiles, merge_dtype: Optional[str] = None):
    """``t``'s value (a torch tensor of shape ``t.shape``), merged on the base rounded to ``merge_dtype`` (default
    ``t.merge_dtype``; ``"float32"``: on the fp32 base), as peft computes it; in that dtype.

    Memory: :func:`arithmetic_bytes` (the base tensor as stored, its fp32 and rounded copies, a few fp32
    temporaries, the factors)."""
    torch = import_torch(WHY_TORCH)
    md = torch_dtype(merge_dtype or t.merge_dtype)
    part = {f.role: f for f in t.factors}

    def factor(role: str):
        f = part[role]
        return _read(torch, f.ranges, "float32", f.shape, files)

    stored = t.ranges[0].dtype if t.ranges else t.dtype
    w32 = _read(torch, t.ranges, stored, t.shape, files).to(torch.float32)
    if t.how == "bias":
        start = factor("bias") if "bias" in part else w32
        del w32
        base = start.to(md)
        del start
        if "lora_bias" not in part:
            return base
        return (base.float() + factor("lora_bias") * t.scaling).to(base.dtype)
    base = w32.to(md)
    del w32
    a, b = factor("A"), factor("B")
    transposed = t.how in TRANSPOSED
    # peft's get_delta_weight: B @ A in fp32, transposed for an Embedding or a Conv1D (a view), then scaled
    delta = ((b @ a).T if transposed else b @ a) * t.scaling
    del a, b
    if t.how == "embedding":  # rounded to W's dtype before the sum
        return base + delta.to(base.dtype)
    if t.how in ("linear", "conv1d"):
        return (base.float() + delta).to(base.dtype)
    if t.how not in ("dora", "dora_embedding", "dora_conv1d"):
        raise ValueError(f"{t.name}: no merge of kind {t.how!r}")
    magnitude = factor("magnitude")
    if not transposed:
        norm = torch.linalg.norm(base + delta, dim=1).to(torch.float32)
        return ((magnitude / norm).view(-1, 1) * (base + delta)).to(base.dtype)
    # the norm of each column, taken as peft takes it: over the rows of Wᵀ + ΔWᵀ (the same layouts, so the same sums)
    norm = torch.linalg.norm(base.T + delta.T, dim=1).to(torch.float32)
    return ((magnitude / norm).view(1, -1) * (base + delta)).to(base.dtype)


def write_merged(t: MergedTensor, sink, files: SourceFiles, progress=lambda n: None) -> None:
    """Merge ``t`` and write its bytes to ``sink`` (a :class:`~ckptlib.io.sinks.PwriteSink` at its offset).

    Raises:
        ValueError: the arithmetic gave another dtype or shape than planned (a bug: nothing is written then)."""
    torch = import_torch(WHY_TORCH)
    value = merged_value(t, files)
    if value.dtype != torch_dtype(t.dtype) or tuple(value.shape) != tuple(t.shape):
        raise ValueError(f"{t.name}: the merge gave {value.dtype} {list(value.shape)}, the plan says {t.dtype} "
                         f"{list(t.shape)}")
    data = value.contiguous().view(torch.uint8).numpy()
    del value
    sink.write(memoryview(data))
    progress(t.nbytes)


def largest_gap(tensors, run_dtype: str, files: Optional[SourceFiles] = None, cancel: Any = None) -> float:
    """The largest ``|merge on the base rounded to run_dtype - merge on the fp32 base|`` over ``tensors`` (the
    :class:`~ckptlib.plan.MergedTensor` s of a plan; 0 when ``run_dtype`` is float32): how far the two ``--merge-on``
    modes lie apart. Reads each tensor's base and factors again; memory: one tensor's :func:`arithmetic_bytes` and
    its other mode's value."""
    if run_dtype == "float32":
        return 0.0
    import_torch(WHY_TORCH)
    own = files is None
    files = files or SourceFiles()
    gap = 0.0
    try:
        for t in tensors:
            check_cancel(cancel)
            if not isinstance(t, MergedTensor) or not t.numel:
                continue
            wide = merged_value(t, files, "float32")
            low = merged_value(t, files, run_dtype)
            gap = max(gap, float((low.float() - wide).abs().max()))
            del wide, low
    finally:
        if own:
            files.close()
    return gap


def arithmetic_bytes(t: MergedTensor) -> int:
    """What merging ``t`` holds at its peak (an upper bound): the base tensor as stored, its fp32 copy, its copy in the
    merge dtype, the fp32 temporaries of its ``how`` (``B @ A`` and the scaled delta; the sum; DoRA's product), the
    result, and the factors with their scaled copies."""
    n = t.numel
    stored = t.ranges[0].dtype if t.ranges else t.dtype
    s, m = itemsize(stored), itemsize(t.merge_dtype)
    held = n * s + (0 if s == 4 else 4 * n) + (0 if m == 4 else n * m)
    if t.how == "embedding":
        work = max(8 * n, 4 * n + 2 * n * m)
    elif t.how in ("linear", "conv1d"):
        work = max(8 * n, 4 * n + (4 * n if m != 4 else 0) + 4 * n + (n * m if m != 4 else 0))
    elif t.how in ("dora", "dora_embedding", "dora_conv1d"):
        work = max(8 * n, 12 * n + (n * m if m != 4 else 0))
    else:
        work = 8 * n + n * m
    return held + work + 2 * sum(4 * _numel(f.shape) for f in t.factors)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = ["base_files", "base_headers", "stored_ranges", "find_base_tensor", "merged_value", "write_merged",
           "largest_gap", "arithmetic_bytes", "WHY_TORCH", "TRANSPOSED"]
