"""What ``ckpt inspect`` shows of a DCP checkpoint: its layout, every tensor (key, dtype, shape, chunks),
the files with the chunks and bytes each holds, and the values (hyper-parameters, steps) by key.

From the ``.metadata`` files alone (no chunk archive is opened; values are not unpickled).
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from ..dcp import DcpFolder
from ..units import human_bytes


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
    return {"path": os.fspath(d.path), "format": "dcp", "layout": d.layout,
            "folders": {k or ".": {"version": md.version, "entries": len(md.entries)} for k, md in d.metadata.items()},
            "model_tensors": len(d.model), "optimizer_tensors": len(d.states), "values": sorted(d.values),
            "tensor_bytes": sum(t.numel * _itemsize(t.dtype) for t in d.tensors.values()),
            "total_bytes": d.total_bytes, "files": dict(sorted(files.items())), "tensors": tensors}


def _itemsize(dtype: str) -> int:
    from ..dtypes import itemsize

    return itemsize(dtype)


def format_dcp(d: DcpFolder, limit: int = 40) -> str:
    """The text form: a header, the files, and up to ``limit`` tensors (then how many more)."""
    info = describe_dcp(d)
    states = sorted({t.state for t in d.states.values()})
    lines = [f"DCP checkpoint ({d.layout} layout): {d.path}",
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
    return "\n".join(lines)


__all__ = ["describe_dcp", "format_dcp"]
