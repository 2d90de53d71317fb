"""Where an output tensor's bytes come from, as plain data: stored byte ranges and runs of zeros.

A *range list* describes a tensor (flattened) as the concatenation of :class:`StoredRange` s (``count``
elements of dtype ``dtype`` at byte ``offset`` of file ``path``) and :class:`Zeros` (partition
padding). Plans hold range lists; the bytes are read only when the plan is run
(:func:`ckptlib.streaming.copy_ranges`). Pure data and arithmetic: no I/O, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .dtypes import itemsize


@dataclass(frozen=True, slots=True)
class StoredRange:
    """``count`` elements of ``dtype`` (a dtype name) stored contiguously at byte ``offset`` of ``path``."""

    path: str
    offset: int
    dtype: str
    count: int

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.count * itemsize(self.dtype)

    def sub(self, start: int, count: int) -> "StoredRange":
        """Elements ``[start, start+count)`` of this range."""
        if start < 0 or count < 0 or start + count > self.count:
            raise IndexError(f"[{start}, {start + count}) is outside a range of {self.count} elements")
        return StoredRange(self.path, self.offset + start * itemsize(self.dtype), self.dtype, count)


@dataclass(frozen=True, slots=True)
class Zeros:
    """``count`` zero elements (partition padding)."""

    count: int


Range = Union[StoredRange, Zeros]


def numel(ranges: Sequence[Range]) -> int:
    return sum(r.count for r in ranges)


def stored_bytes(ranges: Sequence[Range]) -> int:
    """Bytes the ranges read from files (zeros read nothing)."""
    return sum(r.nbytes for r in ranges if isinstance(r, StoredRange))


def paths(ranges: Sequence[Range]) -> list[str]:
    """The files the ranges read, sorted."""
    return sorted({r.path for r in ranges if isinstance(r, StoredRange)})


def slice_ranges(ranges: Sequence[Range], start: int, count: int) -> list[Range]:
    """The sub-list of ``ranges`` covering elements ``[start, start+count)`` of their concatenation."""
    out: list[Range] = []
    pos, end = 0, start + count
    for r in ranges:
        lo, hi = pos, pos + r.count
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append(Zeros(b - a) if isinstance(r, Zeros) else r.sub(a - lo, b - a))
        pos = hi
        if pos >= end:
            break
    if numel(out) != count:
        raise IndexError(f"ranges hold {pos} elements; [{start}, {end}) is out of bounds")
    return out


__all__ = ["StoredRange", "Zeros", "Range", "numel", "stored_bytes", "paths", "slice_ranges"]
