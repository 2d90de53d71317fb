"""What ``ckpt inspect`` shows of a DCP checkpoint: its layout and storage, every tensor (key, dtype, shape,
chunks), the files with the chunks and bytes each holds, and the values (hyper-parameters, steps) by key; and
what ``ckpt check`` reads of one (:func:`plan_check_dcp`).

Inspect reads the ``.metadata`` files (or, for safetensors storage, the safetensors headers) alone: no chunk
archive is opened; values are not unpickled.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from ..dcp import DcpFolder, open_dcp
from ..dcp.folder import STORAGE_WORDS
from ..dtypes import is_floating, itemsize
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..plan import SourceRef
from ..units import human_bytes
from .health import CheckPlan
from .healthrules import StatsItem

#: per-element optimizer states (torch's names) that cannot be below zero, and why
NEVER_NEGATIVE = {"exp_avg_sq": "Adam/AdamW's exp_avg_sq (a running mean of squared gradients) is never negative",
                  "max_exp_avg_sq": "AdamW's max_exp_avg_sq (a maximum of exp_avg_sq) is never negative",
                  "sum": "Adagrad's sum (of squared gradients) is never negative",
                  "square_avg": "RMSprop's square_avg (a running mean of squared gradients) is never negative"}


def describe_dcp(d: DcpFolder) -> dict[str, Any]:
    """The JSON form of ``ckpt inspect`` for a DCP checkpoint."""
    files: dict = defaultdict(lambda: {"chunks": 0, "values": 0, "bytes": 0})
    tensors = []
    for t in d.tensors.values():
        chunks = t.entry.chunks
        for c in chunks:
            f = files[os.path.join(t.folder, c.file)]
            f["chunks"] += 1
            f["bytes"] += c.length
        tensors.append({"key": t.key, "name": t.name, "state": t.state, "dtype": t.dtype, "shape": list(t.shape),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file}
                                   for c in chunks]})
    for folder, e in d.values.values():
        f = files[os.path.join(folder, e.file)]
        f["values"] += 1
        f["bytes"] += e.length
    return {"path": os.fspath(d.path), "format": "dcp", "layout": d.layout, "storage": d.storage,
            "folders": {k or ".": {"version": md.version, "entries": len(md.entries)} for k, md in d.metadata.items()},
            "model_tensors": len(d.model), "optimizer_tensors": len(d.states), "values": sorted(d.values),
            "tensor_bytes": sum(t.numel * itemsize(t.dtype) for t in d.tensors.values()),
            "total_bytes": d.total_bytes, "files": dict(sorted(files.items())), "tensors": tensors,
            "notes": d.notes}


def format_dcp(d: DcpFolder, limit: int = 40) -> str:
    """The text form: a header, the files, and up to ``limit`` tensors (then how many more)."""
    info = describe_dcp(d)
    states = sorted({t.state for t in d.states.values()})
    lines = [f"DCP checkpoint ({d.layout} layout): {d.path}",
             f"storage: {STORAGE_WORDS.get(d.storage, d.storage)}",
             f"{info['model_tensors']} model tensors, {info['optimizer_tensors']} optimizer tensors"
             + (f" ({', '.join(states)})" if states else "") + f", {len(d.values)} values; "
             f"{human_bytes(info['tensor_bytes'])} of tensors in {human_bytes(info['total_bytes'])} of files"]
    for name, f in info["files"].items():
        lines.append(f"  {name:<40} {human_bytes(f['bytes']):>10}  {f['chunks']} chunks, {f['values']} values")
    width = max([len(t.key) for t in d.tensors.values()][:limit] + [20])
    for i, t in enumerate(d.tensors.values()):
        if i == limit:
            lines.append(f"  ... and {len(d.tensors) - limit} more (--json lists every tensor)")
            break
        n = len(t.entry.chunks)
        lines.append(f"  {t.key:<{width}} {t.dtype:<9} {str(list(t.shape)):<14} {n} chunk{'s' if n != 1 else ''}")
    lines += [f"note: {n}" for n in d.notes if not n.startswith("storage: ")]
    return "\n".join(lines)


def plan_check_dcp(path: os.PathLike, *, states: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> CheckPlan:
    """The health check of a DCP checkpoint (as ``ckpt check`` of a DeepSpeed one; run it with
    :func:`ckptlib.analysis.health.check`): statistics, NaN and Inf of every floating model tensor and, with
    ``states``, of every per-element optimizer state (a second moment below zero is a problem); a piece stored
    twice (overlapping pieces) is streamed beside the first and must hold the same bytes. Every tensor's pieces
    are proven to tile it (a hole is refused, naming the files); an integer tensor's overlapping pieces are
    compared here.

    Memory: the plan; comparing an integer tensor's overlaps, two chunks of 1 MiB.
    """
    from ..dcp.folder import prove_overlaps

    d = open_dcp(path)
    items = []
    chosen = list(d.model.values()) + ([t for t in d.states.values() if t.shape] if states else [])
    for t in chosen:
        ranges, overlaps = d.pieces(t)
        if not is_floating(t.dtype):
            prove_overlaps(t.key, t.dtype, overlaps, os.fspath(d.path / t.folder))
            continue
        items.append(StatsItem(t.key if t.state is None else f"{t.state}/{t.name}", "state" if t.state else "model",
                               t.dtype, tuple(t.shape), tuple(ranges), t.state, replicas=tuple(overlaps),
                               never_negative=NEVER_NEGATIVE.get(t.state or "", "")))
    src = SourceRef(save_dir=os.fspath(d.path), tag="", tag_dir=os.fspath(d.path), zero_stage=None, flavor="dcp",
                    dtype=None, dp_world_size=None, partition_count=None, total_bytes=d.total_bytes, stamps=d.stamps())
    skipped = [t.key for t in chosen if not is_floating(t.dtype)]
    notes = list(d.notes) + ([f"{len(skipped)} integer or bool tensors read for their placement only "
                              f"({', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''})"] if skipped else [])
    labels = {os.fspath(p): os.path.relpath(p, d.path) for p in d.files}
    return CheckPlan(source=src, items=items, steps=[], problems=[], labels=labels, states=states,
                     chunk_bytes=chunk_bytes, notes=notes)


__all__ = ["describe_dcp", "format_dcp", "plan_check_dcp"]
