"""One DCP checkpoint (a folder, or Accelerate's pair of folders) known from its ``.metadata`` files.

Memory: the metadata (a few hundred bytes per entry); chunk archives are parsed (a few hundred bytes
each) only when a tensor's ranges are asked for.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from ..errors import CkptError, IncompleteCheckpointError, NotACheckpointError
from ..io.dcp import BytesEntry, DcpMetadata, TensorEntry
from ..io.dcp.reader import METADATA, chunk_ranges, read_metadata, read_value
from ..io.sources import stamp
from ..layout.placement import Block, row_major_strides, runs
from ..layout.ranges import range_starts, slice_ranges

ACCELERATE_FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")


@dataclass
class DcpTensor:
    """A tensor of the checkpoint: its flattened ``key``, the DCP folder it is in (``folder``, relative),
    dtype, full shape, and the parameter it belongs to: ``name`` (its FQN) and ``state`` (None for the
    model's own tensor, else the optimizer state key)."""

    key: str
    folder: str
    dtype: str
    shape: tuple
    name: str
    state: Optional[str] = None
    entry: Any = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def is_dcp(path: os.PathLike) -> bool:
    """Whether ``path`` is a DCP folder (a ``.metadata`` in it) or an Accelerate FSDP save dir."""
    p = Path(path)
    return p.is_dir() and ((p / METADATA).is_file() or (p / ACCELERATE_FOLDERS[0] / METADATA).is_file())


def _split(md: DcpMetadata, e, layout: str) -> tuple[str, Optional[str]]:
    """``(parameter name, state key or None)`` of a flattened key, from the path it was flattened from."""
    path = md.planner_data.get(e.fqn)
    if path and path[0] == "model" and len(path) == 2:
        return str(path[1]), None
    if path and path[0] == "optimizer" and len(path) == 4 and path[1] == "state":
        return str(path[2]), str(path[3])
    if path and path[0] == "optimizer" and len(path) == 2 and str(path[1]).startswith("state."):
        name, _, key = str(path[1])[len("state."):].rpartition(".")
        return name, key
    key = e.fqn
    if key.startswith("optimizer.state."):
        name, _, state = key[len("optimizer.state."):].rpartition(".")
        return name, state
    if layout != "torchtitan" and key.startswith("model."):
        return key[len("model."):], None
    return key, None


class DcpFolder:
    """A DCP checkpoint: ``path``, ``layout`` (``torch``, ``torchtitan``, ``accelerate`` or ``dcp`` for other
    key layouts), ``metadata`` per DCP folder (``""`` for ``path`` itself), its tensors and values."""

    def __init__(self, path: Path):
        self.path = path
        if (path / ACCELERATE_FOLDERS[0] / METADATA).is_file():
            self.layout = "accelerate"
            folders = [f for f in ACCELERATE_FOLDERS if (path / f / METADATA).is_file()]
        else:
            folders = [""]
            self.layout = "dcp"
        self.metadata = {f: read_metadata(path / f) for f in folders}
        if self.layout == "dcp":
            keys = [e.fqn for e in self.metadata[""].entries]
            if any(k.startswith("model.") for k in keys):
                self.layout = "torch"
            elif any(k.startswith("optimizer.param_groups.") and not k.split(".")[2].isdigit() for k in keys):
                self.layout = "torchtitan"
        self.tensors: dict[str, DcpTensor] = {}
        self.values: dict[str, tuple] = {}
        for folder, md in self.metadata.items():
            for e in md.entries:
                if e.fqn in self.tensors or e.fqn in self.values:
                    raise CkptError(f"the key {e.fqn} is in two DCP folders", path=os.fspath(path))
                if isinstance(e, TensorEntry):
                    name, state = _split(md, e, self.layout)
                    self.tensors[e.fqn] = DcpTensor(e.fqn, folder, e.dtype, tuple(e.shape), name, state, e)
                else:
                    self.values[e.fqn] = (folder, e)

    # ------------------------------------------------------------------ what it holds
    @cached_property
    def model(self) -> dict:
        """``{parameter or buffer name: DcpTensor}`` of the model's own tensors."""
        return {t.name: t for t in self.tensors.values() if t.state is None}

    @cached_property
    def states(self) -> dict:
        """``{(parameter name, state key): DcpTensor}`` of the optimizer's per-parameter tensors."""
        return {(t.name, t.state): t for t in self.tensors.values() if t.state is not None}

    @property
    def files(self) -> list[Path]:
        out = []
        for folder, md in self.metadata.items():
            out.append(self.path / folder / METADATA)
            names = {c.file for e in md.tensors for c in e.chunks} | {e.file for e in md.values}
            out += [self.path / folder / n for n in sorted(names)]
        return out

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files if p.is_file())

    def stamps(self) -> tuple:
        return tuple(stamp(os.fspath(p)) for p in self.files)

    def value(self, key: str) -> Any:
        """The Python value stored under ``key`` (unpickled safely)."""
        folder, e = self.values[key]
        return read_value(self.path / folder, e)

    # ------------------------------------------------------------------ bytes
    def sources(self, t: DcpTensor) -> list:
        """The stored ranges that, concatenated, give ``t``'s full value flattened in row-major order.

        Raises:
            IncompleteCheckpointError: the chunks do not tile the tensor exactly once, or an archive is damaged.
        """
        folder = self.path / t.folder
        e: TensorEntry = t.entry
        if len(e.chunks) == 1 and tuple(e.chunks[0].sizes) == tuple(e.shape):
            return chunk_ranges(folder, e, e.chunks[0])
        full = row_major_strides(e.shape)
        blocks = [Block(i, tuple(c.sizes), sum(o * s for o, s in zip(c.offsets, full)), full, 0,
                        row_major_strides(c.sizes)) for i, c in enumerate(e.chunks)]
        try:
            pieces = runs(blocks, t.numel, t.key)
        except ValueError as err:
            raise IncompleteCheckpointError(f"{t.key}: its chunks do not cover it exactly once ({err})",
                                            path=os.fspath(folder)) from None
        local: dict = {}
        out: list = []
        for r in pieces:
            if r.source not in local:
                ranges = chunk_ranges(folder, e, e.chunks[r.source])
                local[r.source] = (ranges, range_starts(ranges))
            ranges, starts = local[r.source]
            out += slice_ranges(ranges, r.local_start, r.count, starts)
        return out

    def __repr__(self) -> str:
        return f"DcpFolder({os.fspath(self.path)!r}, {self.layout}, {len(self.model)} model tensors, " \
               f"{len(self.states)} optimizer tensors)"


def open_dcp(path: os.PathLike) -> DcpFolder:
    """Open the DCP checkpoint at ``path`` (metadata only).

    Raises:
        NotACheckpointError: no ``.metadata`` there. UnsafeCheckpointError, IncompleteCheckpointError.
    """
    p = Path(path).expanduser().resolve()
    if not is_dcp(p):
        raise NotACheckpointError("not a torch.distributed.checkpoint folder (no .metadata)", path=os.fspath(p))
    return DcpFolder(p)


__all__ = ["DcpFolder", "DcpTensor", "is_dcp", "open_dcp", "BytesEntry"]
