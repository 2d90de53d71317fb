"""Planning an export whose source is a DCP checkpoint (FSDP2, torchtitan, Accelerate, or ckptlib's own
``--format dcp``; in torch.save, safetensors or Hugging Face storage): the model's tensors, assembled from their
chunks (pieces that overlap compared first: they must hold the same bytes), as consolidated safetensors or torch
files, and with ``states`` each per-element optimizer state in its own ``<key>/`` folder, as for a
DeepSpeed source. So ``ckpt export CKPT A`` and ``ckpt export DCP B`` can be diffed file for file.

From the ``.metadata`` files and each chunk's archive header alone; the plan is an ordinary
:class:`~ckptlib.export.plan.ExportPlan` (its source's ``flavor`` is ``"dcp"``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ..dcp import open_dcp
from ..dtypes import BY_SHORT, OUTPUT_DTYPES, is_floating
from ..errors import CkptError
from ..plan import PlannedTensor, SourceRef
from .weights import ExportPlan, weights_files


def plan_from_dcp(path: os.PathLike, out: os.PathLike, *, format: str, dtype: str, limit: int,
                  states: Sequence[str] = (), workers: int = 1, overwrite: bool = False, chunk_bytes: int,
                  sync: bool = True) -> ExportPlan:
    """Plan the export of the DCP checkpoint at ``path`` (see the module docstring).

    Memory: the plan; reads the metadata and a few hundred bytes per chunk (and compares overlapping pieces, two
    1 MiB chunks at a time).
    """
    if dtype not in OUTPUT_DTYPES:
        raise CkptError(f"unknown dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    d = open_dcp(path)
    out_dtype = BY_SHORT[dtype].name
    weights = [PlannedTensor(name, name, None, "trainable" if is_floating(t.dtype) else "buffer", t.shape,
                             out_dtype if is_floating(t.dtype) else t.dtype, tuple(d.sources(t)))
               for name, t in d.model.items()]
    sets = [("", weights)]
    known = sorted({k for (_, k), t in d.states.items() if t.shape})
    for key in states:
        if key not in known:
            raise CkptError(f"the optimizer state has no per-element '{key}' (it has: {', '.join(known) or 'none'})",
                            path=os.fspath(d.path))
        sets.append((key + "/", [PlannedTensor(name, name, key, "state", t.shape, "float32", tuple(d.sources(t)))
                                 for (name, k), t in d.states.items() if k == key]))
    step = _step(d) if states else None
    files, finals, index_files = weights_files(sets, format, limit, step)
    src = SourceRef(save_dir=os.fspath(d.path), tag="", tag_dir=os.fspath(d.path), zero_stage=None, flavor="dcp",
                    dtype=None, dp_world_size=None, partition_count=None, total_bytes=d.total_bytes,
                    stamps=d.stamps())
    return ExportPlan(source=src, out=Path(out).expanduser().resolve(), files=files, finals=finals, format=format,
                      dtype=dtype, max_shard_size=limit, states=tuple(states), index_files=index_files,
                      chunk_bytes=chunk_bytes, workers=workers, overwrite=overwrite, sync=sync,
                      notes=[f"source: a DCP checkpoint ({d.layout} layout)"] + d.notes)


def _step(d) -> Optional[int]:
    """The optimizer step when every parameter has the same whole-number one (as a DeepSpeed export records
    it), else None. Reads each step's few bytes."""
    from ..dtypes import decode_scalar, itemsize
    from ..io.sources import SourceFiles

    steps = set()
    with SourceFiles() as files:
        for (_, key), t in d.states.items():
            if key == "step" and t.numel == 1:
                r = d.sources(t)[0]
                raw = bytearray(itemsize(r.dtype))
                files.read_into(r.path, r.offset, memoryview(raw))
                steps.add(float(decode_scalar(raw, r.dtype)))
    if len(steps) != 1 or not float(next(iter(steps))).is_integer():
        return None
    return int(steps.pop())


__all__ = ["plan_from_dcp"]
