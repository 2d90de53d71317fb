"""Tensors stored raw in a file: a run of little-endian elements at a byte offset, with no header (what
DeepSpeed's NVMe swap files hold). :class:`RawTensor` offers the parts of
:class:`~ckptlib.io.torchzip.TensorHandle` that plans use for flat 1-D tensors (``ranges``, ``flat_base``,
sizes, ``requires_grad``), so a partition kept in such a file is read like one in a ``.pt`` file.
Metadata only: nothing here reads the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..dtypes import itemsize
from ..layout.ranges import StoredRange


@dataclass(frozen=True)
class RawTensor:
    """``count`` elements of ``dtype_name`` at byte ``offset`` of file ``path``, as a 1-D tensor.

    ``file_bytes``: the file's size (what lies past the tensor, e.g. alignment padding, is not part of it);
    ``requires_grad``: the flag the tensor is saved with wherever it is written out."""

    path: str
    dtype_name: str
    count: int
    offset: int = 0
    file_bytes: Optional[int] = None
    requires_grad: bool = False

    @property
    def shape(self) -> tuple:
        return (self.count,)

    @property
    def stride(self) -> tuple:
        return (1,)

    @property
    def numel(self) -> int:
        return self.count

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def is_contiguous(self) -> bool:
        return True

    def flat_base(self) -> tuple[str, int, str, int, int]:
        """``(path, byte offset of element 0, dtype name, item size, numel)``, as
        :meth:`~ckptlib.io.torchzip.TensorHandle.flat_base` gives it."""
        return self.path, self.offset, self.dtype_name, self.itemsize, self.count

    def ranges(self, start: int = 0, count: Optional[int] = None) -> list[StoredRange]:
        """The stored range of elements ``[start, start+count)`` (none when empty)."""
        count = self.count - start if count is None else count
        if start < 0 or count < 0 or start + count > self.count:
            raise IndexError(f"element range [{start}, {start + count}) outside a tensor of {self.count} elements")
        return [StoredRange(self.path, self.offset + start * self.itemsize, self.dtype_name, count)] if count else []

    def __repr__(self) -> str:
        return f"RawTensor({self.dtype_name}[{self.count}] at {self.offset} of {self.path!r})"


__all__ = ["RawTensor"]
