"""Building blocks of the target object trees of a reshard or a universal checkpoint (metadata only).

Each target file is a source file's object tree with the partition-dependent entries replaced:
tensors become :class:`~ckptlib.torchzip.specs.NewTensor` s whose bytes are the source ranges that
:mod:`ckptlib.layout` says make them, and sizes, paddings and fragment addresses are recomputed. The
carried-over rest keeps its tensors as :class:`~ckptlib.torchzip.specs.StoredTensor` s (copied storage).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..deepspeed import Checkpoint, ZeroSet
from ..plan import TreeFile
from ..ranges import Zeros
from ..torchzip import TensorHandle
from ..torchzip.specs import NewTensor
from ..torchzip.trees import as_specs, tree_bytes

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size


def replace(d: dict, **new) -> dict:
    """A copy of ``d`` (same type, same key order) with some values replaced."""
    out = type(d)()
    for k, v in d.items():
        out[k] = new[k] if k in new else v
    return out


def streamed(dtype: str, ranges: list, requires_grad: bool = False, shape: Optional[tuple] = None) -> NewTensor:
    """A new tensor made of ``ranges`` (source ranges and zeros), 1-D unless ``shape`` is given."""
    n = sum(r.count for r in ranges)
    return NewTensor(dtype, shape if shape is not None else (n,), tuple(ranges), requires_grad=requires_grad)


def copied(h: TensorHandle) -> NewTensor:
    """A copy of a stored tensor with a storage of its own (so that no two target tensors share one)."""
    return NewTensor(h.dtype_name, tuple(h.shape), tuple(h.ranges()), requires_grad=h.requires_grad)


def to_ranges(ck: ZeroSet, pieces: list, key: Optional[str]) -> list:
    """Layout pieces (and zeros) of a set as stored ranges of state ``key`` (None: the fp32 master)."""
    out: list = []
    for p in pieces:
        if isinstance(p, Zeros):
            out.append(p)
        else:
            out += ck.partition_tensor(ck.rank(p.rank), p.group, key).ranges(p.rank_start, p.count)
    return out


def optim_prefix(ck: ZeroSet) -> str:
    """``"bf16_"``, ``"fp16_"`` or ``""``: how the source names its optimizer-state files."""
    return next((f.prefix for f in ck.files if f.kind == "optim_states"), "")


def tree_file(name: str, kind: str, obj: Any, rank: Optional[int] = None,
              source_ranks: Optional[list] = None) -> TreeFile:
    """A :class:`TreeFile` for ``obj`` (tensor handles become plain specs; bytes counted)."""
    obj = as_specs(obj)
    read, written = tree_bytes(obj)
    return TreeFile(name, kind, obj, read, written, rank, list(source_ranks or []))


def sub_group_size(ck: ZeroSet) -> int:
    zcfg = ck.ds_config.get("zero_optimization") or {}
    return int(float(zcfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))


def converter_scripts(ck: Checkpoint) -> list[str]:
    """The converter scripts DeepSpeed saved beside the tag folders (copied with a reshard)."""
    out = []
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        p = ck.location.save_dir / script
        if p.is_file():
            out.append(os.fspath(p))
    return out


__all__ = ["DEFAULT_SUB_GROUP_SIZE", "replace", "streamed", "copied", "to_ranges", "optim_prefix", "tree_file",
           "sub_group_size", "converter_scripts"]
