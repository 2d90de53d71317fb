"""Planning an export from metadata alone: which files, which tensors in each, bytes, memory.

:func:`plan_export` reads nothing beyond what opening the checkpoint read. The plan is a plain object
the notebook shows before the user runs it, and the executor (:mod:`ckptlib.export.run`) follows it.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ..deepspeed import Checkpoint, open_checkpoint
from ..errors import CkptError
from ..summary import human_bytes
from ..streaming import DEFAULT_CHUNK_BYTES, predicted_peak_bytes
from ..torchzip import itemsize

OUTPUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("safetensors", "torch")
#: interpreter-side allowance for metadata, headers and bookkeeping


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` → 5·10⁹ (decimal units as huggingface_hub; ``KiB``/``MiB``/``GiB`` are binary)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read the size {size!r}; write it like 5GB, 500MB or 2GiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    factor = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * factor)


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor and where it comes from."""

    name: str                 # key in the output state dict
    source: str               # parameter or buffer name in the checkpoint
    key: Optional[str]        # optimizer state key, or None for weights/buffers
    kind: str                 # "trainable", "frozen", "tied", "buffer" or "state"
    shape: tuple
    dtype: torch.dtype        # output dtype
    read_bytes: int           # bytes read from the checkpoint to make it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass
class PlannedFile:
    """One output file (path relative to the output folder) and its tensors, in write order."""

    name: str
    tensors: list

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ExportPlan:
    """Everything an export will do, computed from metadata.

    Attributes:
        checkpoint: the opened source.
        out: the destination folder.
        format, dtype: output format (``"safetensors"``/``"torch"``) and weight dtype name.
        files: every output file with its tensors (weights first, then one set per optimizer state).
        index_files: ``{index file name: [file names]}`` for sharded sets.
        read_bytes / write_bytes: bytes read from the checkpoint / written to ``out``.
        predicted_peak_bytes: anonymous memory the export adds to the process (per worker),
            whatever the model size: the streaming buffers plus a fixed allowance.
    """

    checkpoint: Checkpoint
    out: Path
    format: str
    dtype: str
    max_shard_size: int
    exclude_frozen: bool
    states: tuple
    files: list
    index_files: dict
    chunk_bytes: int
    workers: int
    overwrite: bool
    warnings: list = field(default_factory=list)

    @property
    def tensors(self) -> list:
        return [t for f in self.files for t in f.tensors]

    @property
    def read_bytes(self) -> int:
        return sum(t.read_bytes for t in self.tensors)

    @property
    def write_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def largest_tensor_bytes(self) -> int:
        return max((t.nbytes for t in self.tensors), default=0)

    @property
    def predicted_peak_bytes(self) -> int:
        return predicted_peak_bytes(self.chunk_bytes)

    def to_dict(self) -> dict:
        return {
            "source": str(self.checkpoint.location.tag_dir),
            "out": str(self.out),
            "format": self.format,
            "dtype": self.dtype,
            "max_shard_size": self.max_shard_size,
            "exclude_frozen": self.exclude_frozen,
            "states": list(self.states),
            "workers": self.workers,
            "files": [{"name": f.name, "bytes": f.nbytes, "tensors": [t.name for t in f.tensors]} for f in self.files],
            "index_files": self.index_files,
            "read_bytes": self.read_bytes,
            "write_bytes": self.write_bytes,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "warnings": list(self.warnings),
        }

    def describe(self) -> str:
        ck = self.checkpoint
        lines = [
            f"export {ck.location.tag_dir}",
            f"    -> {self.out}  ({self.format}, {self.dtype}"
            + (f", shards up to {human_bytes(self.max_shard_size)}" if len(self.files) > 1 else "") + ")",
            f"ZeRO {ck.zero_stage}, {ck.dtype}, {ck.dp_world_size} ranks; {len(self.tensors)} tensors "
            f"in {len(self.files)} files",
            f"reads {human_bytes(self.read_bytes)} of {human_bytes(ck.total_bytes)}; "
            f"writes {human_bytes(self.write_bytes)}",
            f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} per process "
            f"(largest tensor {human_bytes(self.largest_tensor_bytes)}; streamed in "
            f"{human_bytes(self.chunk_bytes)} chunks)",
        ]
        for f in self.files:
            lines.append(f"  {f.name:<44} {human_bytes(f.nbytes):>10}  {len(f.tensors)} tensors")
        for idx in self.index_files:
            lines.append(f"  {idx}")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # IPython
        p.text(self.describe())

    def __repr__(self) -> str:
        return f"ExportPlan({len(self.files)} files, {human_bytes(self.write_bytes)} -> {self.out})"


def _shard(tensors: list, max_size: int) -> list[list]:
    """Group tensors into shards in order, like huggingface_hub: a tensor larger than the limit gets
    a shard of its own; otherwise a shard is closed when the next tensor would not fit."""
    shards, current, size = [], [], 0
    for t in tensors:
        if t.nbytes > max_size:
            shards.append([t])
            continue
        if current and size + t.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def _file_names(fmt: str, n: int) -> tuple[list[str], Optional[str]]:
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if n == 1:
        return [f"{stem}.{ext}"], None
    return [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)], f"{stem}.{ext}.index.json"


def plan_export(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike], *,
                tag: Optional[str] = None, format: str = "safetensors", dtype: str = "fp32",
                max_shard_size: Union[int, str] = "5GB", exclude_frozen: bool = False,
                states: Sequence[str] = (), workers: int = 1, overwrite: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ExportPlan:
    """Plan the export of consolidated weights (and optionally optimizer states); reads no tensor data.

    Args:
        checkpoint: an opened :class:`Checkpoint` or a path for :func:`open_checkpoint`.
        out: the output folder (must be empty or absent unless ``overwrite``).
        tag: tag to export when ``checkpoint`` is a path.
        format: ``"safetensors"`` (default) or ``"torch"`` (``pytorch_model*.bin``).
        dtype: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` for parameters and floating buffers;
            integer and bool buffers keep their dtype.
        max_shard_size: shard limit, e.g. ``"5GB"`` (decimal units) or bytes.
        exclude_frozen: leave out frozen parameters (and aliases of them).
        states: optimizer state keys to export too, e.g. ``("exp_avg", "exp_avg_sq")``; each goes
            to its own sub-folder ``out/<key>/`` in the same layout (fp32, trainable parameters).
        workers: processes to write with.
        chunk_bytes: streaming chunk size; the memory bound follows from it.

    Memory: the plan itself (one small record per tensor).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag)
    if format not in FORMATS:
        raise CkptError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in OUTPUT_DTYPES:
        raise CkptError(f"unknown dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    if workers < 1:
        raise CkptError("workers must be at least 1")
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise CkptError("max_shard_size must be positive")
    out_path = Path(out).expanduser().resolve()
    ck._require_readable()
    warnings = []
    if ck.flavor != "no_zero" and ck.zero_stage == 1 and any(not p.trainable and not p.tied_to for p in ck.parameters):
        warnings.append("ZeRO-1 does not save fp32 copies of frozen parameters: they are exported from the "
                        f"{ck.dtype} module weights (DeepSpeed's converter drops them)")
    out_dtype = OUTPUT_DTYPES[dtype]
    params = {p.name: p for p in ck.parameters}
    buffers = {b.name: b for b in ck.buffers}

    weights = []
    for name in ck.state_dict_names():
        if name in buffers:
            b = buffers[name]
            h = ck._model["module"][name]
            dt = out_dtype if h.dtype.is_floating_point else h.dtype
            weights.append(PlannedTensor(name, name, None, "buffer", tuple(b.shape), dt, h.nbytes))
            continue
        p = params[name]
        owner = params[p.tied_to] if p.tied_to else p
        if exclude_frozen and not owner.trainable:
            continue
        kind = "tied" if p.tied_to else ("trainable" if p.trainable else "frozen")
        read = sum(r.count * r.handle.itemsize for r in ck.sources(owner.name))
        weights.append(PlannedTensor(name, owner.name, None, kind, tuple(owner.shape), out_dtype, read))

    sets = [("", weights)]
    known = set(ck.optimizer.state_keys) if ck.optimizer else set()
    for key in states:
        if key not in known:
            raise CkptError(f"the optimizer state has no '{key}' (it has: {', '.join(sorted(known)) or 'none'})",
                            path=ck.location.tag_dir)
        tensors = []
        for p in ck.parameters:
            if p.trainable and not p.tied_to:
                read = sum(r.count * r.handle.itemsize for r in ck.sources(p.name, key))
                tensors.append(PlannedTensor(p.name, p.name, key, "state", tuple(p.shape), torch.float32, read))
        sets.append((key + "/", tensors))

    files, index_files = [], {}
    for prefix, tensors in sets:
        shards = _shard(tensors, limit)
        names, index = _file_names(format, max(len(shards), 1))
        for name, shard in zip(names, shards or [[]]):
            files.append(PlannedFile(prefix + name, shard))
        if index:
            index_files[prefix + index] = [prefix + n for n in names]
    return ExportPlan(checkpoint=ck, out=out_path, format=format, dtype=dtype, max_shard_size=limit,
                      exclude_frozen=exclude_frozen, states=tuple(states), files=files, index_files=index_files,
                      chunk_bytes=chunk_bytes, workers=workers, overwrite=overwrite, warnings=warnings)
