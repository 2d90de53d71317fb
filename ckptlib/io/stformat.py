"""The safetensors format: a file's header and byte layout, computed before any data is written, and
read back from an existing file (no torch, no safetensors package needed).

A safetensors file is an 8-byte little-endian header length, a JSON header (``__metadata__`` and, per
tensor, ``dtype``, ``shape`` and ``data_offsets`` relative to the data start), padded to 8 bytes, then
the tensors' bytes in order.

Every tensor starts at an offset that is a multiple of its element size, as the official writer does it:
the data is laid out widest element first (8-, then 4-, 2- and 1-byte dtypes; the given order within each
size), so that zero-copy readers can view each tensor in place (a 3-byte bool buffer before float32
tensors would leave them at odd offsets). The order of the tensors as given (a model's ``state_dict``
order) is kept wherever it does not cost alignment.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

from ..dtypes import BY_NAME, Shaped, itemsize, lookup

_FROM_CODE = {d.safetensors: d.name for d in BY_NAME.values() if d.safetensors}
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorSpec(Shaped):
    """A tensor of a safetensors file: ``name``, ``dtype`` (a name) and ``shape``."""

    name: str
    dtype: str
    shape: tuple


def aligned_order(tensors: Sequence[TensorSpec]) -> list[TensorSpec]:
    """``tensors`` ordered widest element first (stable): laid out in this order from an offset that is a
    multiple of 8, every tensor starts at a multiple of its element size (sizes are powers of two)."""
    return sorted(tensors, key=lambda t: -itemsize(t.dtype))


class SafetensorsLayout:
    """The byte layout of a safetensors file holding ``tensors``: their data in :func:`aligned_order`, each at
    an offset that is a multiple of its element size (``tensors`` keeps the order given)."""

    def __init__(self, tensors: Sequence[TensorSpec], metadata: Optional[dict] = None):
        self.tensors = list(tensors)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for t in aligned_order(self.tensors):
            code = lookup(t.dtype).safetensors
            if code is None:
                raise ValueError(f"safetensors cannot hold dtype {t.dtype}")
            header[t.name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            self.offsets[t.name] = (pos, pos + t.nbytes)
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header)
        self.file_size = self.data_start + pos

    def create(self, path: str | os.PathLike) -> None:
        """Create the file with its header and its final size (the data is written at :meth:`tensor_offset`)."""
        with open(path, "wb") as f:
            f.write(self.header)
            f.truncate(self.file_size)

    def tensor_offset(self, name: str) -> int:
        """Absolute byte offset of tensor ``name``'s data in the file."""
        return self.data_start + self.offsets[name][0]


@dataclass(frozen=True)
class StoredTensorInfo:
    """A tensor found in an existing safetensors file: its spec and where its bytes are."""

    name: str
    dtype: str
    shape: tuple
    offset: int   # absolute byte offset in the file
    nbytes: int


def read_header(path: str | os.PathLike) -> tuple[dict, list[StoredTensorInfo]]:
    """``(metadata, tensors)`` of a safetensors file, from its header alone (reads a few KB).

    Raises:
        ValueError: the file is not a safetensors file (the message says what is wrong).
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"header of {n} bytes is larger than safetensors allows")
        raw = f.read(n)
        size = os.fstat(f.fileno()).st_size
    if len(raw) != n:
        raise ValueError("the header is truncated")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the header is not JSON ({e})") from None
    meta = header.pop("__metadata__", None) or {}
    out = []
    for name, entry in header.items():
        try:
            dtype = _FROM_CODE[entry["dtype"]]
            start, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(s) for s in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed header entry") from None
        if end - start != math.prod(shape) * itemsize(dtype) or 8 + n + end > size:
            raise ValueError(f"tensor {name!r}: its data_offsets do not match its shape or the file size")
        out.append(StoredTensorInfo(name, dtype, shape, 8 + n + start, end - start))
    return meta, sorted(out, key=lambda t: t.offset)


__all__ = ["TensorSpec", "SafetensorsLayout", "StoredTensorInfo", "aligned_order", "read_header"]
