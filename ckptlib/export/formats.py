"""The safetensors side of streaming export (torch files are written by :mod:`ckptlib.torchzip.writer`).

:class:`SafetensorsLayout` computes the header from the plan, so every tensor's byte range in the file
is known before any data is written; writers (also several processes at once) ``pwrite`` the chunks
at their offsets through :class:`~ckptlib.streaming.PwriteSink`, or copy them file to file in the kernel.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


# ---------------------------------------------------------------------------------------------- safetensors
class SafetensorsLayout:
    """The byte layout of a safetensors file holding ``tensors`` in the given order."""

    def __init__(self, tensors: Sequence[TensorSpec], metadata: Optional[dict] = None):
        self.tensors = list(tensors)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for t in self.tensors:
            if t.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors cannot hold dtype {t.dtype}")
            header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [pos, pos + t.nbytes]}
            self.offsets[t.name] = (pos, pos + t.nbytes)
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header)
        self.file_size = self.data_start + pos

    def create(self, path: str | os.PathLike) -> None:
        """Create the file with its header and its final size (data filled in by :meth:`open_for_data`)."""
        with open(path, "wb") as f:
            f.write(self.header)
            f.truncate(self.file_size)

    def tensor_offset(self, name: str) -> int:
        return self.data_start + self.offsets[name][0]
