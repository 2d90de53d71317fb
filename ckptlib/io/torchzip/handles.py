"""Tensor handles: what a tensor in a checkpoint is, and where its bytes are, without its bytes.

A :class:`TensorHandle` knows dtype, shape, stride, storage offset and the byte range of its storage
in the file. :meth:`TensorHandle.ranges` gives the plain byte ranges of any run of its elements (what
plans hold); its ``read_*`` methods read just the requested elements with ``pread`` (no mmap) through
the :class:`~ckptlib.io.torchzip.reader.TorchFile` it came from, so reading a piece costs the memory of
that piece and no file-backed resident memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ...dtypes import BY_NAME, TORCH_TENSORS, decode_scalar, import_torch, torch_dtype
from ...errors import IncompleteCheckpointError
from ...dtypes import itemsize as dtype_itemsize
from ...layout.ranges import StoredRange
from .specs import StorageAddress, StoredTensor


@dataclass(eq=False)
class StorageRef:
    """One storage record of an opened torch zip file: ``numel`` elements of ``dtype_name`` at
    ``data_offset`` (see :class:`~ckptlib.io.torchzip.specs.StorageAddress`, its plain-data form)."""

    file: Any  # the ckptlib.io.torchzip.reader.TorchFile it belongs to (reads go through it)
    key: str
    dtype_name: str
    numel: int
    data_offset: int  # absolute byte offset of element 0 in the file
    stored_bytes: int  # size of the zip member
    stored_crc: Optional[int] = None  # the CRC-32 the zip directory records for the member

    @property
    def dtype(self):
        """The torch dtype."""
        return torch_dtype(self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype_name)

    @property
    def address(self) -> StorageAddress:
        return StorageAddress(self.file.path, self.key, self.dtype_name, self.numel, self.data_offset,
                              self.stored_bytes, self.stored_crc)


@dataclass(eq=False)
class TensorHandle:
    """A tensor inside a checkpoint file, known by its metadata only.

    Attributes:
        storage: where the bytes are.
        storage_offset, shape, stride: as in torch.
        requires_grad: as pickled (DeepSpeed's fp32 partitions carry ``True``).
        is_parameter: the pickle rebuilt an ``nn.Parameter``.
        py_state: Python attributes pickled with the tensor (e.g. ZeRO-3's ``ds_id``).
    """

    storage: StorageRef
    storage_offset: int
    shape: tuple
    stride: tuple
    requires_grad: bool = False
    is_parameter: bool = False
    py_state: Optional[dict] = None

    # ------------------------------------------------------------------ metadata
    @property
    def dtype(self):
        """The torch dtype."""
        return self.storage.dtype

    @property
    def dtype_name(self) -> str:
        return self.storage.dtype_name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return dtype_itemsize(self.storage.dtype_name)

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

    def byte_offset(self, start: int = 0) -> int:
        """Absolute file offset of flattened element ``start`` (contiguous tensors)."""
        return self.storage.data_offset + (self.storage_offset + start) * self.itemsize

    def check_bounds(self) -> None:
        """Raise ``ValueError`` if the tensor reaches outside its storage."""
        last = self.storage_offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if self.numel else 0
        if self.numel and (self.storage_offset < 0 or last >= self.storage.numel):
            raise IncompleteCheckpointError(f"tensor {self!r} reaches outside its storage of {self.storage.numel} "
                                            "elements", path=self.path)

    def ranges(self, start: int = 0, count: Optional[int] = None) -> list[StoredRange]:
        """The stored byte ranges of elements ``[start, start+count)`` of the flattened tensor, in order
        (one range when the tensor is contiguous; one per contiguous run otherwise). Metadata only."""
        shape = self.shape
        if len(shape) == 1 and (shape[0] <= 1 or self.stride[0] == 1):  # 1-D and contiguous (flat partitions)
            return self._flat_ranges(start, shape[0] - start if count is None else count)
        count = self.numel - start if count is None else count
        if start < 0 or count < 0 or start + count > self.numel:
            raise IndexError(f"element range [{start}, {start + count}) outside a tensor of {self.numel} elements")
        self.check_bounds()
        path, name, size = self.storage.file.path, self.storage.dtype_name, self.itemsize
        if count == 0:
            return []
        if self.is_contiguous():
            return [StoredRange(path, self.byte_offset(start), name, count)]
        # contiguous runs: the longest suffix of dimensions laid out row-major
        run, expected, k = 1, 1, len(self.shape)
        while k > 0 and (self.shape[k - 1] == 1 or self.stride[k - 1] == expected):
            run *= self.shape[k - 1]
            expected *= self.shape[k - 1]
            k -= 1
        out, i, end = [], start, start + count
        while i < end:
            base, within = divmod(i, run)
            offset = self.storage_offset + within  # within a run the elements are consecutive
            for dim in range(k - 1, -1, -1):  # the run's place, from the indices of the outer dimensions
                base, idx = divmod(base, self.shape[dim])
                offset += idx * self.stride[dim]
            n = min(run - within, end - i)
            out.append(StoredRange(path, self.storage.data_offset + offset * size, name, n))
            i += n
        return out

    def flat_base(self) -> Optional[tuple[str, int, str, int, int]]:
        """``(path, byte offset of element 0, dtype name, item size, numel)`` of a contiguous 1-D tensor (the
        flat partitions), None for other tensors: element ``i`` is at ``offset + i * item size``. Raises
        ``ValueError`` if the tensor reaches outside its storage. For callers that make many ranges of one
        tensor (plans of large checkpoints make millions); metadata only."""
        shape = self.shape
        if len(shape) != 1 or (shape[0] > 1 and self.stride[0] != 1):
            return None
        n, st = shape[0], self.storage
        if n and (self.storage_offset < 0 or self.storage_offset + n > st.numel):
            raise IncompleteCheckpointError(f"tensor {self!r} reaches outside its storage of {st.numel} elements",
                                            path=st.file.path)
        known = BY_NAME.get(st.dtype_name)
        size = known.itemsize if known is not None else dtype_itemsize(st.dtype_name)
        return st.file.path, st.data_offset + self.storage_offset * size, st.dtype_name, size, n

    def _flat_ranges(self, start: int, count: int) -> list[StoredRange]:
        """:meth:`ranges` of a contiguous 1-D tensor, with the same checks, in a few operations."""
        path, base, name, size, n = self.flat_base()
        if start < 0 or count < 0 or start + count > n:
            raise IndexError(f"element range [{start}, {start + count}) outside a tensor of {n} elements")
        return [StoredRange(path, base + start * size, name, count)] if count else []

    def stored(self) -> StoredTensor:
        """This tensor as a plain-data spec that the writer copies (storage and view as they are)."""
        return StoredTensor(self.storage.address, self.storage_offset, tuple(self.shape), tuple(self.stride),
                            self.requires_grad, dict(self.py_state) if self.py_state else None)

    def __repr__(self) -> str:
        return (f"TensorHandle({self.dtype_name}{list(self.shape)}, key={self.storage.key!r}, "
                f"offset={self.storage_offset})")

    # ------------------------------------------------------------------ data
    def read_flat(self, start: int = 0, count: Optional[int] = None, out=None):
        """Read elements ``[start, start+count)`` of the flattened tensor as a 1-D torch tensor.

        Memory: ``count`` elements (into ``out`` if given: a 1-D tensor of this dtype and length
        ``count``, which is then returned). Only those bytes are read from the file.
        """
        torch = import_torch(TORCH_TENSORS)
        count = self.numel - start if count is None else count
        ranges = self.ranges(start, count)
        if len(ranges) == 1:
            return self.storage.file.read_range(ranges[0], out=out)
        result = out if out is not None else torch.empty(count, dtype=self.dtype)
        pos = 0
        for r in ranges:
            self.storage.file.read_range(r, out=result[pos:pos + r.count])
            pos += r.count
        return result

    def drop_cache(self, start: int = 0, count: Optional[int] = None) -> None:
        """Advise the kernel that elements ``[start, start+count)`` will not be read again (page cache)."""
        count = self.numel - start if count is None else count
        if count > 0 and self.is_contiguous():
            self.storage.file.drop_cache(self.byte_offset(start), count * self.itemsize)

    def item(self):
        """The value of a one-element tensor as a Python number, read without torch. Memory: one element."""
        if self.numel != 1:
            raise ValueError(f"item() of a tensor of {self.numel} elements")
        r = self.ranges(0, 1)[0]
        raw = bytearray(r.nbytes)
        self.storage.file.read_into(r.offset, memoryview(raw))
        return decode_scalar(raw, self.dtype_name)

    def read(self):
        """The whole tensor with its shape. Memory: its ``nbytes``."""
        return self.read_flat().reshape(self.shape)
