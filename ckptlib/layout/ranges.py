"""Where an output tensor's bytes come from, as plain data: stored byte ranges and runs of zeros.

A *range list* describes a tensor (flattened) as the concatenation of :class:`StoredRange` s (``count``
elements of dtype ``dtype`` at byte ``offset`` of file ``path``) and :class:`Zeros` (partition
padding). Plans hold range lists; the bytes are read only when the plan is run
(:func:`ckptlib.io.streaming.copy_ranges`). Pure data and arithmetic: no I/O, no torch.
"""
from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..dtypes import BY_NAME, itemsize

_ITEMSIZE = {name: d.itemsize for name, d in BY_NAME.items()}


def _size(dtype: str) -> int:
    return _ITEMSIZE.get(dtype) or itemsize(dtype)


# Ranges are hashable and compare by value, but not frozen: a frozen dataclass takes about four times as
# long to make, and the plans of large checkpoints make millions of ranges. Treat them as immutable.
@dataclass(slots=True, unsafe_hash=True)
class StoredRange:
    """``count`` elements of ``dtype`` (a dtype name) stored contiguously at byte ``offset`` of ``path``."""

    path: str
    offset: int
    dtype: str
    count: int

    @property
    def itemsize(self) -> int:
        return _size(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.count * _size(self.dtype)

    def sub(self, start: int, count: int) -> "StoredRange":
        """Elements ``[start, start+count)`` of this range."""
        if start < 0 or count < 0 or start + count > self.count:
            raise IndexError(f"[{start}, {start + count}) is outside a range of {self.count} elements")
        return StoredRange(self.path, self.offset + start * _size(self.dtype), self.dtype, count)


@dataclass(slots=True, unsafe_hash=True)
class Zeros:
    """``count`` zero elements (partition padding)."""

    count: int


Range = Union[StoredRange, Zeros]


_count = operator.attrgetter("count")
_dtype = operator.attrgetter("dtype")


def coalesce(ranges: Sequence[Range]) -> list[Range]:
    """The same elements in as few ranges as possible: a range that continues the one before it (the same
    file and dtype, starting at the byte where that one ends; zeros after zeros) joins it. Bytes that are
    contiguous in a file lie in one zip member (members are separated by their headers), so a joined range
    reads exactly what its parts read."""
    out: list = []
    for r in ranges:
        if out:
            last = out[-1]
            if type(r) is StoredRange and type(last) is StoredRange and r.path == last.path and \
                    r.dtype == last.dtype and r.offset == last.offset + last.count * _size(last.dtype):
                out[-1] = StoredRange(last.path, last.offset, last.dtype, last.count + r.count)
                continue
            if type(r) is Zeros and type(last) is Zeros:
                out[-1] = Zeros(last.count + r.count)
                continue
        out.append(r)
    return out


def numel(ranges: Sequence[Range]) -> int:
    return sum(map(_count, ranges))


def stored_bytes(ranges: Sequence[Range]) -> int:
    """Bytes the ranges read from files (zeros read nothing). Iterates in C where it can: plans of large
    checkpoints sum millions of ranges."""
    stored = [r for r in ranges if isinstance(r, StoredRange)]
    dtypes = set(map(_dtype, stored))
    if len(dtypes) == 1:
        return sum(map(_count, stored)) * _size(dtypes.pop())
    return sum(r.count * _size(r.dtype) for r in stored)


def paths(ranges: Sequence[Range]) -> list[str]:
    """The files the ranges read, sorted."""
    return sorted({r.path for r in ranges if isinstance(r, StoredRange)})


def range_starts(ranges: Sequence[Range]) -> list[int]:
    """Where each range starts in the concatenation of ``ranges`` (give it to :func:`slice_ranges` when
    slicing one list many times)."""
    out, pos = [], 0
    for r in ranges:
        out.append(pos)
        pos += r.count
    return out


def _cut(r: Range, at: int, count: int) -> Range:
    """Elements ``[at, at+count)`` of one range (the range itself when that is all of it: ranges are immutable,
    a whole one is shared, not copied)."""
    if at == 0 and count == r.count:
        return r
    if isinstance(r, Zeros):
        return Zeros(count)
    return StoredRange(r.path, r.offset + at * _size(r.dtype), r.dtype, count)


def slice_ranges(ranges: Sequence[Range], start: int, count: int, starts: Optional[Sequence[int]] = None
                 ) -> list[Range]:
    """The sub-list of ``ranges`` covering elements ``[start, start+count)`` of their concatenation.

    ``starts`` (:func:`range_starts` of ``ranges``) makes it begin at the first range concerned (a binary
    search) instead of walking from the first one: slicing a list of ``n`` ranges ``k`` times then costs
    ``k log n`` plus the ranges returned, not ``k n``."""
    out: list[Range] = []
    first = max(0, bisect.bisect_right(starts, start) - 1) if starts else 0
    pos, end = (starts[first] if starts else 0), start + count
    if ranges and start >= pos and end <= pos + ranges[first].count and count > 0:  # inside one range: the
        return [_cut(ranges[first], start - pos, count)]  # common case (a row of a shard stored in one
        # partition), without the walk
    if starts and count > 0 and ranges and end <= starts[-1] + ranges[-1].count:
        # across ranges (the rows of a tensor-parallel join): cut the first and the last, take those between
        # as they are (a list slice, not a walk; zero-length ones left out, as the walk leaves them)
        last = bisect.bisect_left(starts, end) - 1
        head, tail = ranges[first], ranges[last]
        out.append(_cut(head, start - pos, pos + head.count - start))
        out += [r for r in ranges[first + 1:last] if r.count]
        out.append(_cut(tail, 0, end - starts[last]))
        return out
    for i in range(first, len(ranges)):
        r = ranges[i]
        lo, hi = pos, pos + r.count
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append(_cut(r, a - lo, b - a))
        pos = hi
        if pos >= end:
            break
    if numel(out) != count:
        raise IndexError(f"ranges hold {pos} elements; [{start}, {end}) is out of bounds")
    return out


__all__ = ["StoredRange", "Zeros", "Range", "numel", "stored_bytes", "paths", "range_starts", "slice_ranges", "coalesce"]
