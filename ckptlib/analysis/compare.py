"""Streaming range lists window by window, and comparing two of them: the engine that :mod:`ckptlib.analysis.verify`,
:mod:`ckptlib.analysis.health` and :mod:`ckptlib.analysis.tensordiff` share.

- :class:`WindowReader` reads consecutive windows of a range list (:mod:`ckptlib.layout.ranges`) into two
  reusable buffers, the next window in a background thread while the caller works on the current one.
- :class:`Comparer` streams two range lists side by side: :meth:`Comparer.equal` (bit for bit, both cast
  to one dtype; what ``verify`` checks) and :meth:`Comparer.difference` (floating values compared in
  fp32, integer and bool ones exactly; what ``ckpt diff`` reports). Windows whose bytes are identical
  are passed over without arithmetic.

Windows are numpy arrays (bfloat16, which numpy lacks, as its 16-bit patterns: :func:`np_type`); casts
between dtypes are torch's, bit for bit (:func:`cast_values`, through :mod:`ckptlib.io.casting`). Neither
torch nor a thread pool of its is involved: numpy's loops here are single-threaded.

Memory: a reader holds two buffers of ``slot_bytes``; a comparer two readers and four work buffers, all
of ``chunk_bytes / 4`` (2 ``chunk_bytes`` in all), whatever the tensor sizes; a cast between 16-bit
dtypes and float64 adds one fixed block of :data:`ckptlib.io.casting.BLOCK` float32.
"""
from __future__ import annotations

import bisect
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from ..dtypes import is_floating, itemsize
from ..io.sources import SourceFiles
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..layout.ranges import StoredRange, Zeros, numel
from ..progress import check_cancel


def stored_dtype(ranges: Sequence, default: str = "float32") -> str:
    """The dtype the stored ranges hold (the first one's; ``default`` for zeros only)."""
    return next((r.dtype for r in ranges if isinstance(r, StoredRange)), default)


class RangeIndex:
    """A range list with the start of each range, for slicing it quickly (bisect, not a scan)."""

    def __init__(self, ranges: Sequence):
        self.ranges = list(ranges)
        self.starts, pos = [], 0
        for r in self.ranges:
            self.starts.append(pos)
            pos += r.count
        self.numel = pos

    def slice(self, start: int, count: int) -> list:
        """The ranges covering elements ``[start, start+count)``."""
        out, i, end = [], max(0, bisect.bisect_right(self.starts, start) - 1), start + count
        while count and i < len(self.ranges) and self.starts[i] < end:
            r, lo = self.ranges[i], self.starts[i]
            a, b = max(lo, start), min(lo + r.count, end)
            if a < b:
                out.append(Zeros(b - a) if isinstance(r, Zeros) else r.sub(a - lo, b - a))
            i += 1
        if numel(out) != count:
            raise IndexError(f"ranges hold {self.numel} elements; [{start}, {end}) is out of bounds")
        return out

    def spans(self, step: int, split: bool = False) -> list[tuple[int, int]]:
        """Windows ``(start, count)`` of at most ``step`` elements covering everything; with ``split`` no
        window crosses from one range into the next (so each lies in one file)."""
        if not split:
            return [(s, min(step, self.numel - s)) for s in range(0, self.numel, step)]
        return [(lo + i, min(step, r.count - i)) for lo, r in zip(self.starts, self.ranges)
                for i in range(0, r.count, step)]


#: how numpy holds each dtype's elements: bfloat16, which numpy lacks, as its 16-bit patterns
NP_TYPES = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8", "int32": "<i4",
            "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}


def np_type(dtype: str):
    """The numpy dtype holding ``dtype``'s elements (:data:`NP_TYPES`)."""
    import numpy as np

    try:
        return np.dtype(NP_TYPES[dtype])
    except KeyError:
        raise ValueError(f"ckptlib cannot compare {dtype} values") from None


def cast_values(src, src_dtype: str, out, dtype: str) -> None:
    """Write numpy array ``src`` (of ``src_dtype``) into ``out`` (as long, of ``dtype``) as torch's CPU cast
    writes it: between float32, bfloat16 and float16 (and the same dtype) by :mod:`ckptlib.io.casting`, a 16-bit
    float to or from float64 through float32 (exact both ways into float64), anything else as numpy casts
    (widening floats and integers exactly, float64 to float32 rounding to nearest even, as torch).
    Memory: one block of float32 for the 16-bit and float64 pairs; else none."""
    import numpy as np

    from ..io.casting import BLOCK, can_cast, cast

    if can_cast(src_dtype, dtype):
        cast(src, src_dtype, out, dtype)
        return
    half = ("bfloat16", "float16")
    if src_dtype in half or dtype in half:
        if "float64" not in (src_dtype, dtype):
            raise ValueError(f"no cast from {src_dtype} to {dtype} here")
        block = np.empty(min(BLOCK, src.size), np.float32)
        for a in range(0, src.size, BLOCK):
            b = min(a + BLOCK, src.size)
            f = block[:b - a]
            if src_dtype in half:  # 16-bit -> float32 (exact) -> float64 (exact)
                cast(src[a:b], src_dtype, f, "float32")
                np.copyto(out[a:b], f)
            else:  # float64 -> float32 (rounded as torch) -> 16-bit (rounded again, as torch does)
                np.copyto(f, src[a:b], casting="unsafe")
                cast(f, "float32", out[a:b], dtype)
        return
    np.copyto(out, src, casting="unsafe")


class WindowReader:
    """Reads windows of range lists into two reusable buffers of ``slot_bytes``, one window ahead.

    Memory: ``2 * slot_bytes`` (plus a temporary for a range stored in another dtype than asked, which
    real checkpoints never have).
    """

    def __init__(self, files: SourceFiles, slot_bytes: int, drop_cache: bool = True):
        import numpy as np

        self.files, self.slot_bytes, self.drop_cache = files, max(16, slot_bytes), drop_cache
        self._slots = [np.empty(self.slot_bytes, np.uint8) for _ in range(2)]  # pages touched when used
        self._pool: Optional[ThreadPoolExecutor] = None

    def _fill(self, pieces: list, dtype: str, slot: int):
        """Read ``pieces`` back to back into slot ``slot`` as ``dtype``; the pieces of one file that continue
        each other there (rows of a tensor-parallel shard) by one scatter read."""
        import numpy as np

        size = itemsize(dtype)
        raw = self._slots[slot][:numel(pieces) * size]
        out = raw.view(np_type(dtype))
        runs: dict[str, list] = {}  # path -> [[file offset, end, [buffers]], ...]
        pos = 0
        for r in pieces:
            if isinstance(r, Zeros):
                out[pos:pos + r.count].fill(0)
            elif r.dtype == dtype:
                view = memoryview(raw[pos * size:(pos + r.count) * size])
                mine = runs.setdefault(r.path, [])
                if mine and mine[-1][1] == r.offset:
                    mine[-1][1] += r.nbytes
                    mine[-1][2].append(view)
                else:
                    mine.append([r.offset, r.offset + r.nbytes, [view]])
            else:
                tmp = np.empty(r.count, np_type(r.dtype))
                self.files.read_into(r.path, r.offset, memoryview(tmp.view(np.uint8)))
                cast_values(tmp, r.dtype, out[pos:pos + r.count], dtype)
                if self.drop_cache:
                    self.files.drop_cache(r.path, r.offset, r.nbytes)
            pos += r.count
        for path, mine in runs.items():
            for start, end, views in mine:
                self.files.read_scattered(path, start, views)
                if self.drop_cache:
                    self.files.drop_cache(path, start, end - start)
        return out

    def windows(self, index: RangeIndex, dtype: str, spans: Sequence[tuple[int, int]]) -> Iterator[tuple[int, Any]]:
        """``(start, values)`` for each span: a 1-D numpy array of ``dtype`` (:func:`np_type`) that stays valid
        until the next one is asked for. Each span must fit a slot (``count * itemsize(dtype) <= slot_bytes``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-window")
        ahead: dict[int, Any] = {}

        def submit(i: int) -> None:
            if i < len(spans):
                s, k = spans[i]
                ahead[i] = self._pool.submit(self._fill, index.slice(s, k), dtype, i % 2)

        submit(0)
        try:
            for i, (s, _) in enumerate(spans):
                values = ahead.pop(i).result()
                submit(i + 1)  # into the other slot, while the caller works on this one
                yield s, values
        finally:
            for fut in ahead.values():  # let a read in flight finish before its slot is used again
                fut.cancel() or fut.exception()

    def read(self, index: RangeIndex, dtype: str, start: int, count: int):
        """One window, read now (into slot 0)."""
        return self._fill(index.slice(start, count), dtype, 0)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def same_bytes(x, y) -> bool:
    """Whether two windows (numpy arrays) hold the same bytes, compared as the widest integers that divide
    their size (single-threaded: several times faster than torch.equal here)."""
    import numpy as np

    if x.dtype != y.dtype or x.size != y.size:
        return False
    a, b = x.view(np.uint8), y.view(np.uint8)
    wide = next(t for t, s in ((np.int64, 8), (np.int32, 4), (np.int16, 2), (np.uint8, 1)) if a.size % s == 0)
    return bool(np.array_equal(a.view(wide), b.view(wide)))


@dataclass
class PairDiff:
    """How two tensors' values differ: ``changed`` elements (outside the tolerance; ``nonfinite`` of them
    are NaN or Inf on one side and not the same on the other), the largest ``|a - b|`` over the elements
    finite on both sides, and the float64 sums of squares of ``a - b`` and of ``a`` over those elements."""

    numel: int = 0
    changed: int = 0
    nonfinite: int = 0
    max_abs_diff: float = 0.0
    sumsq_diff: float = 0.0
    sumsq_a: float = 0.0
    skipped: bool = False  # windows with the same bytes on both sides were passed over: ``sumsq_a`` is not known

    @property
    def rel_diff(self) -> float:
        """``||a - b|| / ||a||`` (0 when both are 0; inf when only ``a`` is)."""
        if self.sumsq_diff == 0:
            return 0.0
        return math.sqrt(self.sumsq_diff) / math.sqrt(self.sumsq_a) if self.sumsq_a > 0 else math.inf


class Comparer:
    """Streams pairs of range lists chunk by chunk (each side read one window ahead) and compares them.

    ``compared`` counts the bytes compared (both sides, in the dtype compared); ``progress(nbytes)`` is
    called with the bytes of each window; ``cancel`` (anything with ``is_set()``) stops at the next one.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: Callable[[int], None] = lambda n: None,
                 cancel: Any = None, files: Optional[SourceFiles] = None):
        import numpy as np

        self.own_files = files is None
        self.files = files or SourceFiles()
        self.slot_bytes = max(64, chunk_bytes // 32 * 8)  # a multiple of 8: float64 work views
        self.readers = (WindowReader(self.files, self.slot_bytes), WindowReader(self.files, self.slot_bytes))
        self.work = [np.empty(self.slot_bytes, np.uint8) for _ in range(4)]  # pages touched when used
        self.progress, self.cancel = progress, cancel
        self.compared = 0

    def _pairs(self, a: Sequence, b: Sequence, dtypes: tuple[str, str]) -> Iterator[tuple[int, Any, Any]]:
        ia, ib = RangeIndex(a), RangeIndex(b)
        step = max(1, self.slot_bytes // max(8, *(itemsize(d) for d in dtypes)))
        spans = ia.spans(step)
        wa = self.readers[0].windows(ia, dtypes[0], spans)
        wb = self.readers[1].windows(ib, dtypes[1], spans)
        try:
            for (s, x), (_, y) in zip(wa, wb):
                check_cancel(self.cancel)
                yield s, x, y
        finally:
            wa.close()
            wb.close()

    def equal(self, a: Sequence, b: Sequence, dtype: str) -> bool:
        """Whether ranges ``a`` and ``b``, both cast to ``dtype``, hold the same bits."""
        if numel(a) != numel(b):
            return False
        size = itemsize(dtype)
        dtypes = (stored_dtype(a, dtype), stored_dtype(b, dtype))
        for _, x, y in self._pairs(a, b, dtypes):
            k = x.size
            x, y = self._as(x, dtypes[0], dtype, 0), self._as(y, dtypes[1], dtype, 1)
            self.compared += 2 * k * size
            self.progress(k * size)
            if not same_bytes(x, y):
                return False
        return True

    def _as(self, t, t_dtype: str, dtype: str, slot: int):
        """Window ``t`` (of ``t_dtype``) as ``dtype``: itself, or cast into work buffer ``slot``."""
        if t_dtype == dtype:
            return t
        out = self.work[slot][:t.size * itemsize(dtype)].view(np_type(dtype))
        cast_values(t, t_dtype, out, dtype)
        return out

    def difference(self, a: Sequence, b: Sequence, atol: float = 0.0, rtol: float = 0.0) -> PairDiff:
        """How ``b`` differs from ``a`` (same element count): floating values compared in fp32 (``a - b``
        computed in fp32 as torch does; NaN equals NaN, an infinity itself), integer and bool ones exactly
        when both sides are; an element is changed when ``|a - b| > atol + rtol * |b|`` (torch.isclose's
        rule). The sums of squares are accumulated in float64."""
        import numpy as np

        if numel(a) != numel(b):
            raise ValueError(f"{numel(a)} and {numel(b)} elements cannot be compared")
        da, db = stored_dtype(a), stored_dtype(b)
        exact = not is_floating(da) and not is_floating(db)
        out = PairDiff(numel=numel(a))
        identical = []  # windows passed over: their ||a||^2 is only needed if another window differs
        for s, x, y in self._pairs(a, b, (da, db)):
            k = x.size
            self.compared += k * (x.itemsize + y.itemsize)
            self.progress(k * x.itemsize)
            if same_bytes(x, y):
                identical.append((s, k))
            elif exact:
                self._exact(out, x, y)
            else:
                self._floating(out, self._fp32(x, da, 1), self._fp32(y, db, 2), atol, rtol)
        if out.changed or out.sumsq_diff:
            index = RangeIndex(a)
            w = self.work[0].view(np.float64)
            for s, k in identical:  # ||a|| over the windows passed over
                x = self._fp32(self.readers[0].read(index, da, s, k), da, 1)
                np.copyto(w[:k], x)
                np.nan_to_num(w[:k], copy=False, nan=0.0, posinf=0.0, neginf=0.0)
                out.sumsq_a += float(np.einsum("i,i->", w[:k], w[:k]))
        else:
            out.skipped = bool(identical)
        return out

    def _fp32(self, t, t_dtype: str, slot: int):
        """Window ``t`` (of ``t_dtype``) as fp32: itself, or cast into work buffer ``slot``."""
        import numpy as np

        if t_dtype == "float32":
            return t
        out = self.work[slot][:t.size * 4].view(np.float32)
        if t_dtype == "bfloat16":
            cast_values(t, t_dtype, out, "float32")
        else:
            np.copyto(out, t, casting="unsafe")
        return out

    def _sumsq(self, a) -> float:
        """The float64 sum of squares of numpy array ``a`` (through work buffer 0)."""
        import numpy as np

        w = self.work[0][:a.size * 8].view(np.float64)
        np.copyto(w, a)
        return float(np.einsum("i,i->", w, w))  # single-threaded: no BLAS thread pool

    def _floating(self, out: PairDiff, a, b, atol: float, rtol: float) -> None:
        """Add one window of fp32 values (numpy arrays; they may be overwritten) to ``out``."""
        import numpy as np

        d = self.work[3][:a.size * 4].view(np.float32)
        np.subtract(a, b, out=d)  # in fp32, as torch computes a - b
        sa, sd = self._sumsq(a), self._sumsq(d)
        if not (math.isfinite(sa) and math.isfinite(sd)):  # NaN or Inf on a side (or an fp32 overflow)
            finite = np.isfinite(a) & np.isfinite(b)
            same = (np.isnan(a) & np.isnan(b)) | (np.isinf(a) & (a == b))
            bad = int(np.count_nonzero(~finite & ~same))
            out.changed += bad
            out.nonfinite += bad
            a[~finite] = 0.0
            d[~finite] = 0.0
            sa, sd = self._sumsq(a), self._sumsq(d)
        out.sumsq_a += sa
        out.sumsq_diff += sd
        out.max_abs_diff = max(out.max_abs_diff, -float(d.min()), float(d.max()))
        if atol == 0 and rtol == 0:
            out.changed += int(np.count_nonzero(d != 0))
        else:
            bound = self.work[2][:b.size * 4].view(np.float32)
            np.abs(b, out=bound)
            bound *= rtol
            bound += atol
            np.abs(d, out=d)
            out.changed += int(np.count_nonzero(d > bound))

    @staticmethod
    def _exact(out: PairDiff, x, y) -> None:
        """Add one window of integer or bool values to ``out`` (compared exactly, as int64)."""
        import numpy as np

        d = x.astype(np.int64) - y.astype(np.int64)
        out.changed += int(np.count_nonzero(d))
        dd, xa = d.astype(np.float64), x.astype(np.float64)
        out.max_abs_diff = max(out.max_abs_diff, float(np.abs(dd).max()))
        out.sumsq_diff += float(np.einsum("i,i->", dd, dd))
        out.sumsq_a += float(np.einsum("i,i->", xa, xa))

    def close(self) -> None:
        for r in self.readers:
            r.close()
        if self.own_files:
            self.files.close()


__all__ = ["stored_dtype", "RangeIndex", "NP_TYPES", "np_type", "cast_values", "WindowReader", "same_bytes", "PairDiff",
           "Comparer"]
