"""Tensor handles: what a tensor in a checkpoint is, and where its bytes are, without its bytes.

A :class:`TensorHandle` knows dtype, shape, stride, storage offset and the byte range of its storage
in the file. Its ``read_*`` methods read just the requested elements with ``pread`` (no mmap), so
reading a piece costs the memory of that piece and no file-backed resident memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .reader import TorchFile

DTYPE_BY_STORAGE: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPE_BY_STORAGE[_name] = getattr(torch, _name)

#: short names used in summaries and JSON
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class StorageRef:
    """One storage record of a torch zip file: ``numel`` elements of ``dtype`` at ``data_offset``."""

    file: "TorchFile"
    key: str
    dtype: torch.dtype
    numel: int
    data_offset: int  # absolute byte offset of element 0 in the file
    stored_bytes: int  # size of the zip member
    stored_crc: Optional[int] = None  # the CRC-32 the zip directory records for the member

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass
class TensorHandle:
    """A tensor inside a checkpoint file, known by its metadata only.

    Attributes:
        storage: where the bytes are.
        storage_offset, shape, stride: as in torch.
        requires_grad: as pickled (DeepSpeed's fp32 partitions carry ``True``).
        is_parameter: the pickle rebuilt an ``nn.Parameter``.
    """

    storage: StorageRef
    storage_offset: int
    shape: tuple
    stride: tuple
    requires_grad: bool = False
    is_parameter: bool = False
    py_state: Optional[dict] = None  # Python attributes pickled with the tensor (e.g. ZeRO-3 ``ds_id``)

    # ------------------------------------------------------------------ metadata
    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def path(self) -> str:
        return self.storage.file.path

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def byte_range(self) -> tuple[int, int]:
        """``(start, end)`` in the file of the bytes this (contiguous) tensor covers."""
        start = self.storage.data_offset + self.storage_offset * self.itemsize
        return start, start + self.nbytes

    def __repr__(self) -> str:
        return (f"TensorHandle({dtype_name(self.dtype)}{list(self.shape)}, key={self.storage.key!r}, "
                f"offset={self.storage_offset})")

    def _check_bounds(self):
        last = self.storage_offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel else 0
        if self.numel and (self.storage_offset < 0 or last >= self.storage.numel):
            raise ValueError(f"tensor {self!r} reaches outside its storage of {self.storage.numel} elements")

    # ------------------------------------------------------------------ data
    def read_flat(self, start: int = 0, count: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Read elements ``[start, start+count)`` of the flattened tensor as a 1-D tensor.

        Memory: ``count`` elements (into ``out`` if given: a 1-D tensor of this dtype and length
        ``count``, which is then returned). Only those bytes are read from the file.
        """
        numel = self.numel
        if count is None:
            count = numel - start
        if start < 0 or count < 0 or start + count > numel:
            raise IndexError(f"element range [{start}, {start + count}) outside a tensor of {numel} elements")
        self._check_bounds()
        if self.is_contiguous():
            return self.storage.file.read_elements(self.storage, self.storage_offset + start, count, out=out)
        # Non-contiguous (rare in checkpoints): read the covering storage span, then gather.
        lo = self.storage_offset
        hi = lo + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) + 1
        span = self.storage.file.read_elements(self.storage, lo, hi - lo)
        full = torch.as_strided(span, self.shape, self.stride, 0).reshape(-1)[start:start + count]
        if out is not None:
            out.copy_(full)
            return out
        return full.clone()

    def byte_offset(self, start: int = 0) -> int:
        """Absolute file offset of flattened element ``start`` (contiguous tensors)."""
        return self.storage.data_offset + (self.storage_offset + start) * self.itemsize

    def drop_cache(self, start: int = 0, count: Optional[int] = None) -> None:
        """Advise the kernel that elements ``[start, start+count)`` will not be read again (page cache)."""
        count = self.numel - start if count is None else count
        if count > 0 and self.is_contiguous():
            self.storage.file.drop_cache(self.byte_offset(start), count * self.itemsize)

    def read(self) -> torch.Tensor:
        """The whole tensor with its shape. Memory: its ``nbytes``."""
        return self.read_flat().reshape(self.shape)
