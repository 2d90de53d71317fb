"""The arithmetic of an average of checkpoints (:class:`~ckptlib.plan.AveragedTensor`), computed chunk by chunk as
the output is written, in numpy (no torch).

Each output element is defined as

    acc = w_1 · x_1;  acc = acc + w_i · x_i  for i = 2 .. N  (in the order given);  out = float32(acc)

with every ``x_i`` the source's stored value widened exactly to float64 (float32, bfloat16 and float16 masters all
widen exactly), every product and every sum rounded to float64 on its own (IEEE 754, round to nearest even; two
separate operations, never a fused multiply-add), and the float32 rounding round to nearest even. A 16-bit output
dtype is then that float32 value cast as torch's ``.to()`` casts it (:mod:`ckptlib.io.casting`). The weights are
float64 numbers (the plan holds them). The same value in torch, for checking::

    acc = w[0] * x[0].double()
    for wi, xi in zip(w[1:], x[1:]):
        acc = acc + wi * xi.double()
    out = acc.float()

:func:`write_averaged` is what the runner's writers call for such a tensor (a safetensors tensor, a torch file's
:class:`AveragedNewTensor`); :func:`first_averaged_difference` recomputes one and compares it with written ranges
(``--verify``).

Memory: one chunk of ``n`` elements at a time (``chunk_bytes / 8``, at most :data:`CHUNK_ELEMS`), whatever the
number of sources and the tensor size: the float64 sum, a block of float64 products, one source's chunk as float32
and a 16-bit source's stored bytes. :func:`write_averaged` works in the first few MiB of the calling thread's
:class:`~ckptlib.io.streaming.ChunkBuffers` (:class:`Work`: about 4.5 MiB at the default sizes): it adds nothing to
what a streaming copy holds. Sources are read one after the other, one chunk each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from ..dtypes import itemsize, name_of
from ..layout.ranges import StoredRange, Zeros, numel, paths, range_starts, slice_ranges, stored_bytes
from ..plan import AveragedTensor
from ..progress import check_cancel
from .castcopy import cast_bytes
from .sources import SourceFiles
from .streaming import DEFAULT_CHUNK_BYTES, ChunkBuffers, fill_bytes
from .torchzip.specs import NewTensor

#: elements of one chunk at most (2 MiB of float64 sums): the arithmetic's working set stays a few MiB whatever the
#: chunk of the streaming buffers it works in (the pages of those it does not touch cost nothing)
CHUNK_ELEMS = 1 << 18
#: elements of one product computed and added at a time (at most 1 MiB of float64: it stays in the CPU cache between
#: the multiplication and the addition, instead of a chunk-sized temporary going through memory)
BLOCK = 1 << 17
#: the dtypes a source's value may be stored in (widened exactly to float64), and those an output may have
SOURCE_DTYPES = ("float32", "bfloat16", "float16")
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")


class Work:
    """The arrays of the arithmetic, ``elems`` elements a chunk: ``acc`` (the float64 sum), ``tmp`` (a block's float64
    products), ``x`` (one source's chunk as float32; the float32 result goes there once the last source is summed) and
    ``raw`` (a 16-bit source's stored bytes; a 16-bit result); ``scratch``: the casts' work space (or None).

    Layout in ``8 * elems`` bytes of each of three areas: ``acc`` fills the first, ``tmp`` at most the second, ``x``
    and ``raw`` the first three quarters of the third."""

    def __init__(self, elems: int, first, second, third, scratch=None):
        import numpy as np

        self.elems, self.scratch = elems, scratch
        self.acc = np.frombuffer(first, dtype=np.float64, count=elems)
        self.block = min(BLOCK, elems)
        self.tmp = np.frombuffer(second, dtype=np.float64, count=self.block)
        self.x = np.frombuffer(third, dtype=np.float32, count=elems)
        self.raw = memoryview(third)[4 * elems:6 * elems]

    @classmethod
    def on(cls, bufs: ChunkBuffers) -> "Work":
        """Views into the start of a thread's streaming buffers (its two read buffers and its cast buffer): at most
        :data:`CHUNK_ELEMS` elements a chunk, so only their first few MiB are touched."""
        n = min(CHUNK_ELEMS, max(2, bufs.chunk_bytes // 8))
        return cls(n, bufs.read_view("float64", n, 0), bufs.read_view("float64", n, 1),
                   bufs.cast_view("float64", n), bufs.scratch)

    @classmethod
    def own(cls, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> "Work":
        """Arrays of its own (three of ``8 * elems`` bytes), e.g. for a verification."""
        n = min(CHUNK_ELEMS, max(2, chunk_bytes // 8))
        return cls(n, bytearray(8 * n), bytearray(8 * n), bytearray(8 * n))


def _load(pieces: Sequence, n: int, work: Work, files: SourceFiles, drop: bool) -> None:
    """Fill ``work.x[:n]`` with ``pieces`` (one source's ranges of a chunk) as float32: float32 runs read straight in
    (scatter reads), 16-bit runs read as stored into ``work.raw`` and widened exactly, zeros as zeros."""
    x = work.x
    pos = i = 0
    while i < len(pieces):
        r = pieces[i]
        if isinstance(r, Zeros):
            x[pos:pos + r.count] = 0
            pos += r.count
            i += 1
            continue
        j = i + 1
        while j < len(pieces) and isinstance(pieces[j], StoredRange) and pieces[j].dtype == r.dtype:
            j += 1
        run = pieces[i:j]
        k = sum(p.count for p in run)
        dst = memoryview(x[pos:pos + k]).cast("B")
        if r.dtype == "float32":
            files.read_gather(run, dst, drop)
        elif r.dtype in SOURCE_DTYPES:
            files.read_gather(run, work.raw[:2 * k], drop)
            cast_bytes(work.raw[:2 * k], r.dtype, dst, "float32", work.scratch)
        else:
            raise ValueError(f"an averaged tensor reads float32, bfloat16 or float16 values, not {r.dtype}")
        pos += k
        i = j
    if pos != n:
        raise ValueError(f"a source's chunk holds {pos} elements, not {n}")


def averaged_chunks(terms: Sequence, count: int, dtype: str, work: Work, files: SourceFiles, drop: bool = False,
                    cancel: Any = None) -> Iterator[tuple[int, int, memoryview]]:
    """``(start, elements, bytes)`` of each chunk of the average ``terms`` (``((weight, ranges), ...)``, ``count``
    elements each) as ``dtype`` (see the module docstring), in order; the bytes are a view into ``work``, valid until
    the next chunk is asked for. ``cancel`` stops it at the next chunk. (Reading each source's chunk in a thread beside
    the summing was slower on the 2-core machine of ``bench/``: the chunks come from the page cache.)"""
    import numpy as np

    starts = [range_starts(r) for _, r in terms]
    weights = [np.float64(w) for w, _ in terms]
    for pos in range(0, count, work.elems):
        check_cancel(cancel)
        n = min(work.elems, count - pos)
        x, acc = work.x[:n], work.acc[:n]
        for i, ((_, ranges), at, w) in enumerate(zip(terms, starts, weights)):
            _load(slice_ranges(ranges, pos, n, at), n, work, files, drop)
            if i == 0:
                np.multiply(x, w, out=acc, dtype=np.float64)
                continue
            for a in range(0, n, work.block):  # each product in a block that stays in the cache, then added
                b = min(n, a + work.block)
                tmp = work.tmp[:b - a]
                np.multiply(x[a:b], w, out=tmp, dtype=np.float64)
                np.add(acc[a:b], tmp, out=acc[a:b])
        np.copyto(x, acc, casting="same_kind")  # round to nearest even
        data = memoryview(x).cast("B")
        if dtype != "float32":
            out = work.raw[:n * itemsize(dtype)]
            cast_bytes(data, "float32", out, dtype, work.scratch)
            data = out
        yield pos, n, data


def write_averaged(terms: Sequence, dtype: str, count: int, sink, bufs: ChunkBuffers, files: SourceFiles,
                   progress: Callable[[int], None] = lambda n: None, cancel: Any = None) -> int:
    """Compute the average ``terms`` (``count`` elements) chunk by chunk and write it as ``dtype`` into ``sink``
    (``write(memoryview)``); returns the bytes written. ``cancel`` stops it at the next chunk.

    Memory: the start of the thread's buffers ``bufs`` (:meth:`Work.on`: about 4.5 MiB), nothing more."""
    total = 0
    for _, _, data in averaged_chunks(terms, count, dtype, Work.on(bufs), files, drop=True, cancel=cancel):
        sink.write(data)
        progress(data.nbytes)
        total += data.nbytes
    return total


def first_averaged_difference(terms: Sequence, dtype: str, got: Sequence, files: SourceFiles,
                              chunk_bytes: int = DEFAULT_CHUNK_BYTES, cancel: Any = None,
                              counted: Callable[[int], None] = lambda n: None) -> Optional[int]:
    """The first element where the ranges ``got`` (read as ``dtype``) differ bit for bit from the average ``terms``
    recomputed, or None where they are equal (0 when the lengths differ). ``counted(nbytes)`` is told the bytes
    compared. Memory: three arrays of ``8 * min(chunk_bytes / 8, CHUNK_ELEMS)`` bytes and one chunk of ``got``."""
    import numpy as np

    count = numel(got)
    if any(numel(r) != count for _, r in terms):
        return 0
    work = Work.own(chunk_bytes)
    size = itemsize(dtype)
    have = np.empty(work.elems * size, dtype=np.uint8)
    got_starts = range_starts(got)
    for pos, n, data in averaged_chunks(terms, count, dtype, work, files, cancel=cancel):
        want = np.frombuffer(data, dtype=np.uint8)
        mine = have[:n * size]
        fill_bytes(slice_ranges(got, pos, n, got_starts), dtype, files, memoryview(mine))
        counted(n * size)
        if not np.array_equal(want, mine):
            return pos + int(np.flatnonzero(want != mine)[0]) // size
    return None


@dataclass(eq=False)
class AveragedNewTensor(NewTensor):
    """A new tensor of a torch file (:mod:`ckptlib.io.torchzip.writer`) whose bytes are the average ``terms``
    (``((weight, ranges), ...)``, as :class:`~ckptlib.plan.AveragedTensor`), computed as the file is written
    (:meth:`write_into`) in ``dtype``. Plain data, like every spec."""

    terms: tuple = ()

    def __post_init__(self):
        self.dtype = name_of(self.dtype)
        self.shape = tuple(int(s) for s in self.shape)
        self.ranges, self.terms = (), tuple((float(w), tuple(r)) for w, r in self.terms)
        if len(self.terms) < 1 or any(numel(r) != self.numel for _, r in self.terms):
            raise ValueError(f"an averaged tensor of shape {list(self.shape)} needs {self.numel} elements from "
                             "every source")

    @property
    def read_bytes(self) -> int:
        return sum(stored_bytes(r) for _, r in self.terms)

    @property
    def sources(self) -> list[str]:
        return sorted({p for _, r in self.terms for p in paths(r)})

    def write_into(self, sink, bufs: ChunkBuffers, files: SourceFiles,
                   progress: Callable[[int], None] = lambda n: None, cancel: Any = None) -> int:
        """Write its bytes into ``sink`` (:func:`write_averaged`); what the torch file writer calls."""
        return write_averaged(self.terms, self.dtype, self.numel, sink, bufs, files, progress, cancel)


def averaged_spec(t: AveragedTensor, requires_grad: bool = False) -> AveragedNewTensor:
    """The torch-file spec of a plan's :class:`~ckptlib.plan.AveragedTensor`."""
    return AveragedNewTensor(t.dtype, tuple(t.shape), terms=t.terms, requires_grad=requires_grad)


__all__ = ["SOURCE_DTYPES", "OUTPUT_DTYPES", "CHUNK_ELEMS", "Work", "averaged_chunks", "write_averaged",
           "first_averaged_difference",
           "AveragedNewTensor", "averaged_spec"]
