"""Tensors to write into a torch file, as plain data (no open file, no closure, no torch needed).

- :class:`StorageAddress` — where a storage record of an existing torch file is.
- :class:`StoredTensor` — a tensor of an existing file, written by copying its storage byte for byte
  (views and shared storages stay as they were).
- :class:`NewTensor` — a new contiguous tensor whose bytes are a range list
  (:mod:`ckptlib.layout.ranges`), read and written only when the file is written, or small inline bytes.

Object trees made of plain values, the unpickler's stand-ins and these specs pickle as they are, so a
plan holding them can be sent to another process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...dtypes import Shaped, itemsize, name_of
from ...layout.ranges import numel as ranges_numel
from ...layout.ranges import paths as ranges_paths
from ...layout.ranges import stored_bytes


@dataclass(frozen=True, slots=True)
class StorageAddress:
    """One storage record of a torch zip file: ``numel`` elements of ``dtype`` (a name) whose bytes start
    at ``data_offset`` of ``path``; ``stored_bytes`` is the zip member's size and ``stored_crc`` the
    CRC-32 its directory records."""

    path: str
    key: str
    dtype: str
    numel: int
    data_offset: int
    stored_bytes: int
    stored_crc: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(eq=False)
class StoredTensor:
    """A tensor of an existing torch file: its storage is copied whole (once per file written)."""

    storage: StorageAddress
    storage_offset: int
    shape: tuple
    stride: tuple
    requires_grad: bool = False
    py_state: Optional[dict] = None


@dataclass(eq=False)
class NewTensor(Shaped):
    """A new contiguous tensor of ``dtype`` and ``shape`` whose bytes are ``ranges`` (stored ranges and
    zeros, cast to ``dtype`` when written) or, for small in-memory values, ``data``.

    ``dtype`` may be given as a torch dtype or a name; it is kept as a name.
    """

    dtype: Any
    shape: tuple
    ranges: tuple = ()
    data: Optional[bytes] = field(default=None, repr=False)
    requires_grad: bool = False
    py_state: Optional[dict] = None

    def __post_init__(self):
        self.dtype = name_of(self.dtype)
        self.shape = tuple(int(s) for s in self.shape)
        self.ranges = tuple(self.ranges)
        if self.data is None and ranges_numel(self.ranges) != self.numel:
            raise ValueError(f"a new tensor of shape {list(self.shape)} needs {self.numel} elements; its ranges "
                             f"hold {ranges_numel(self.ranges)}")

    @property
    def read_bytes(self) -> int:
        """Bytes read from source files to write it."""
        return stored_bytes(self.ranges)

    @property
    def sources(self) -> list[str]:
        """The files its bytes come from."""
        return ranges_paths(self.ranges)

    @classmethod
    def from_tensor(cls, t, requires_grad: bool = False) -> "NewTensor":
        """A new tensor holding a copy of the bytes of the in-memory torch tensor ``t`` (small values)."""
        import torch

        t = t.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(t.dtype, tuple(t.shape), data=raw, requires_grad=requires_grad)


__all__ = ["StorageAddress", "StoredTensor", "NewTensor"]
