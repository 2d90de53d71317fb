"""Streaming tensor bytes from stored ranges into a sink, through fixed buffers (every writer uses it).

:func:`copy_ranges` writes a range list (:mod:`ckptlib.layout.ranges`: stored ranges and zeros) in order,
in chunks, casting when the output dtype differs. Ranges already in the output dtype go file to file
inside the kernel when the sink can do that (``copy_from``). Chunks that go through the buffers are
read one ahead in a background thread; a sink that keeps a CRC-32 (``takes_crc``) gets each chunk's
CRC computed there too, beside the read, so the writing thread only writes. A chunk that needs a cast
goes piece by piece through :func:`~ckptlib.io.castcopy.cast_pieces` instead, on two threads, when the
sink writes at positions (``put``).

The buffers are plain bytes (anonymous memory maps) and the casts between float32, bfloat16 and float16 are
:mod:`ckptlib.io.casting`'s, bit for bit torch's: nothing here imports torch, except a cast between other
dtypes (float64 buffers to float32, say), which is left to torch, and :func:`read_ranges`, which makes
a tensor.

Memory: the three buffers of :class:`ChunkBuffers` (``3 * chunk_bytes``) and a cast scratch
(:class:`~ckptlib.io.casting.Scratch`, 1.6 MiB), whatever the tensor sizes.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..dtypes import TORCH_TENSORS, import_torch, itemsize, torch_dtype
from ..layout.ranges import StoredRange, Zeros, numel, range_starts, slice_ranges
from ..plan import DEFAULT_CHUNK_BYTES, FIXED_OVERHEAD_BYTES, predicted_peak_bytes
from ..progress import check_cancel
from .sources import SourceFiles
from .castcopy import cast_bytes, cast_pieces
from .crc import CRC_PIECE_BYTES, joined_crc
from .threads import thread_room
from .crc32 import crc32

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor


class ChunkBuffers:
    """Reusable byte buffers of ``chunk_bytes`` each: two to read into (one is filled in the background
    while the other is written out) and one to cast into, with the cast's scratch (made on first use).
    The buffers are private anonymous memory maps made here, once (a run that cannot get them fails before it
    writes anything); their pages are only touched where bytes go through them, so a run whose bytes are
    all copied inside the kernel leaves them untouched. Nothing here needs numpy or torch until a cast.

    Memory: ``3 * chunk_bytes`` (plus the cast scratch once a cast runs, and 256 KiB once the CRC-32 of a
    kernel copy is checked), whatever the dtypes and tensor sizes.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes = max(16, chunk_bytes)
        self._read = [_private_map(self.chunk_bytes) for _ in range(2)]
        self._cast = _private_map(self.chunk_bytes)
        self._cast_start = ctypes.c_char.from_buffer(self._cast)  # for memset
        self._zeroed = self.chunk_bytes  # the cast buffer holds zeros up to here (a new map is all zeros)
        self._scratch = None
        self._crc: Optional[memoryview] = None
        self._pool: Optional[ThreadPoolExecutor] = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The read-ahead thread, started on first use once there is room for it (:func:`thread_room`)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor  # only runs that read through the buffers need it

            thread_room()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-read")
        return self._pool

    def elems(self, *dtypes: str) -> int:
        """Elements of the widest of ``dtypes`` (names) that fit in one buffer."""
        return self.chunk_bytes // max(itemsize(d) for d in dtypes)

    def read_view(self, dtype: str, n: int, slot: int = 0) -> memoryview:
        """The bytes of ``n`` elements of ``dtype`` at the start of read buffer ``slot``."""
        return memoryview(self._read[slot])[:n * itemsize(dtype)]

    def cast_view(self, dtype: str, n: int) -> memoryview:
        """The bytes of ``n`` elements of ``dtype`` at the start of the cast buffer."""
        self._zeroed = 0
        return memoryview(self._cast)[:n * itemsize(dtype)]

    def zeros(self, nbytes: int) -> memoryview:
        """``nbytes`` zero bytes (the cast buffer, zeroed once for as long as no cast reuses it)."""
        if self._zeroed < nbytes:
            ctypes.memset(ctypes.addressof(self._cast_start) + self._zeroed, 0, nbytes - self._zeroed)
            self._zeroed = nbytes
        return memoryview(self._cast)[:nbytes]

    def lane(self, slot: int, lane: int, read_bytes: int, out_bytes: int) -> tuple[memoryview, memoryview]:
        """Thread ``lane``'s (0 or 1) stretches of read buffer ``slot`` (``read_bytes``) and of the cast
        buffer (``out_bytes``), each at most half a buffer, for :func:`~ckptlib.io.castcopy.cast_pieces`."""
        half = self.chunk_bytes // 2
        if max(read_bytes, out_bytes) > half or lane not in (0, 1):
            raise ValueError(f"a lane holds at most {half} bytes")
        self._zeroed = 0
        at = lane * half
        return memoryview(self._read[slot])[at:at + read_bytes], memoryview(self._cast)[at:at + out_bytes]

    @property
    def crc_piece(self) -> memoryview:
        """A small buffer (:data:`~ckptlib.io.crc.CRC_PIECE_BYTES`, made on first use) through which the
        read-ahead thread reads again the bytes a kernel copy moves, for their CRC-32."""
        if self._crc is None:
            self._crc = memoryview(_private_map(CRC_PIECE_BYTES))
        return self._crc

    @property
    def scratch(self):
        if self._scratch is None:
            from .casting import Scratch

            self._scratch = Scratch()
        return self._scratch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


#: what importing numpy (the casts' kernels) maps into the data segment, measured with numpy 2.4 and its
#: OpenBLAS 0.3.31: about 3 MiB, plus about 41 MiB of buffers for each thread OpenBLAS starts at import. OpenBLAS
#: takes them while numpy loads and ends the process when it cannot ("OpenBLAS error: Memory allocation still
#: failed after 10 retries"), so :func:`load_cast_kernels` checks the room first.
NUMPY_IMPORT_BYTES, OPENBLAS_THREAD_BYTES = 4 * 2**20, 42 * 2**20


def openblas_threads() -> int:
    """The threads OpenBLAS will start when numpy loads (its environment variables, else the usable cores)."""
    for var in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), 64)
    try:
        return min(len(os.sched_getaffinity(0)), 64)
    except (AttributeError, OSError):
        return min(os.cpu_count() or 1, 64)


def load_cast_kernels() -> None:
    """Load the casts' kernels (numpy, :mod:`ckptlib.io.casting`) now, before a run writes anything, or a
    check or diff starts its clock and memory watch: numpy's first import (about 40 MiB of OpenBLAS
    buffers with one thread, once per process) is not a run's memory or time.

    Raises:
        OutOfMemoryError: numpy is not loaded yet and there is less room (``ulimit -d``, the cgroup, the
            machine) than loading it takes (:data:`NUMPY_IMPORT_BYTES` and :data:`OPENBLAS_THREAD_BYTES`
            per OpenBLAS thread).
    """
    if "numpy" not in sys.modules:
        from ..errors import OutOfMemoryError
        from ..system.allocation import out_of_memory_message
        from ..system.memory import system_memory

        threads = openblas_threads()
        need = NUMPY_IMPORT_BYTES + OPENBLAS_THREAD_BYTES * threads
        room = system_memory()
        if room.headroom < need:
            raise OutOfMemoryError(
                out_of_memory_message(need, "loading numpy for the casts", room),
                hint=f"free memory or raise the limit (numpy's OpenBLAS starts {threads} thread(s) with buffers of "
                     "their own; OPENBLAS_NUM_THREADS=1 needs the least); nothing was written")
    from . import casting  # noqa: F401 - loaded here, on purpose


def _private_map(nbytes: int) -> mmap.mmap:
    """Anonymous private memory of ``nbytes`` (counted as the process's anonymous memory and against
    ``ulimit -d``, as any allocation; untouched pages cost nothing)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


#: a same-dtype range at least this long goes file to file inside the kernel (``copy_from``) when the sink can;
#: shorter ones (the rows of an interleaved tensor-parallel join, say) are gathered into one buffer with their
#: neighbours and written at once: one write per chunk instead of a copy per piece
KERNEL_COPY_MIN_BYTES = 256 * 2**10


def _plan_chunks(ranges: Sequence, dtype: str, bufs: ChunkBuffers, direct: bool) -> list[tuple]:
    """The work of :func:`copy_ranges` as ``("zeros", n)``, ``("copy", range)`` (kernel copy) and
    ``("read", (range, ...))`` items (ranges of one stored dtype read back to back into one buffer, at most
    one chunk), in output order."""
    items: list[tuple] = []
    gather: list = []
    room = 0
    steps: dict = {}  # stored dtype -> elements per chunk

    def flush() -> None:
        nonlocal room
        if gather:
            items.append(("read", tuple(gather)))
            gather.clear()
        room = 0

    for r in ranges:
        if isinstance(r, Zeros):
            flush()
            step = bufs.elems(dtype)
            items += [("zeros", min(step, r.count - i)) for i in range(0, r.count, step)]
            continue
        if direct and r.dtype == dtype and r.nbytes >= KERNEL_COPY_MIN_BYTES:
            flush()
            step = max(1, bufs.chunk_bytes // r.itemsize)
            items += [("copy", r.sub(i, min(step, r.count - i))) for i in range(0, r.count, step)]
            continue
        if gather and gather[0].dtype != r.dtype:
            flush()
        step = steps.get(r.dtype)
        if step is None:
            step = steps[r.dtype] = bufs.elems(r.dtype, dtype)
        i = 0
        while i < r.count:
            if room == 0:
                room = step
            take = min(room, r.count - i)
            gather.append(r if take == r.count else r.sub(i, take))
            i += take
            room -= take
            if room == 0:
                flush()
    flush()
    return items


def copy_ranges(ranges: Sequence, dtype: str, sink, bufs: ChunkBuffers, files: SourceFiles,
                progress: Callable[[int], None] = lambda n: None, cancel: Any = None,
                drop_cache: bool = True) -> int:
    """Write the concatenation of ``ranges`` as ``dtype`` (a name) into ``sink``; returns the bytes written.

    ``sink`` has ``write(memoryview[, crc])`` and optionally ``copy_from(fd, offset, nbytes)``
    (``can_copy``) and ``takes_crc``. Long same-dtype ranges go inside the kernel when the sink can; the
    rest is read (in the read-ahead thread, short ranges gathered back to back into one buffer), cast
    where the stored dtype differs, and written a chunk at a time. Where ``files`` checks the CRC-32 of the
    source (:class:`~ckptlib.io.crc.CrcSourceFiles`) it is computed beside each read, in the read-ahead thread
    (beside a kernel copy, on the same pages: :func:`crc_beside`). With ``drop_cache`` the page-cache
    pages of each source range are released once copied. ``cancel`` (anything with ``is_set()``) stops
    it at the next chunk. Memory: the buffers ``bufs``; nothing per chunk.
    """
    items = _plan_chunks(ranges, dtype, bufs, getattr(sink, "can_copy", False))
    reads = [i for i, it in enumerate(items) if it[0] == "read"]
    ahead: dict[int, Any] = {}
    want_crc = getattr(sink, "takes_crc", False)
    pieces = hasattr(sink, "put")  # casts go piece by piece (cast_pieces) into a sink that writes at positions
    size = itemsize(dtype)

    def view(k: int):  # (ranges, read buffer, whether to take the CRC-32 beside the read: not before a cast)
        gather = items[reads[k]][1]
        src = gather[0].dtype
        return gather, bufs.read_view(src, sum(r.count for r in gather), k % 2), want_crc and src == dtype, drop_cache

    def inline(k: int) -> bool:  # a few short ranges in the output dtype: read when written, no read-ahead;
        gather = items[reads[k]][1]  # a cast, piece by piece in cast_pieces
        if gather[0].dtype != dtype:
            return pieces
        return sum(r.nbytes for r in gather) < KERNEL_COPY_MIN_BYTES

    def submit(k: int) -> None:  # start reading the k-th buffered chunk into slot k % 2
        if k < len(reads) and not inline(k):
            ahead[reads[k]] = bufs.pool.submit(_read_gather, files, *view(k))

    submit(0)
    k = total = 0
    besides: list = []  # the CRC-32s of kernel copies being read beside them (crc_beside), oldest first
    try:
        for i, it in enumerate(items):
            check_cancel(cancel)
            if it[0] == "zeros":
                nbytes = it[1] * size
                sink.write(bufs.zeros(nbytes))
            elif it[0] == "copy":
                r = it[1]
                pages = crc_beside(files, bufs, r, drop_cache, besides)
                sink.copy_from(files.fd(r.path), r.offset, r.nbytes)
                files.count(r.nbytes)
                nbytes = r.nbytes
                if pages is not None:
                    pages.done()
                elif drop_cache:
                    files.drop_cache(r.path, r.offset, r.nbytes)
            else:
                gather = it[1]
                count = sum(r.count for r in gather)
                if gather[0].dtype != dtype and pieces:
                    submit(k + 1)
                    cast_pieces(gather, dtype, sink, bufs, files, k % 2, drop_cache)
                else:
                    chunk, crc, _ = ahead.pop(i).result() if i in ahead else _read_gather(files, *view(k))
                    submit(k + 1)  # into the other slot, whose chunk is written
                    if gather[0].dtype != dtype:
                        out = bufs.cast_view(dtype, count)
                        cast_bytes(chunk, gather[0].dtype, out, dtype, bufs.scratch)
                        sink.write(out, None) if want_crc else sink.write(out)
                    elif want_crc:
                        sink.write(chunk, crc)
                    else:
                        sink.write(chunk)
                k += 1
                nbytes = count * size
            progress(nbytes)
            total += nbytes
        for fut in besides:
            fut.result()  # every CRC-32 noted before the range list counts as written
    finally:
        for fut in [*ahead.values(), *besides]:  # a failure or cancel: let the read-ahead finish before its buffer
            fut.cancel() or fut.exception()    # is reused
    return total


#: kernel copies whose bytes the read-ahead thread may still be reading for their CRC-32 (:func:`crc_beside`)
CRC_BEHIND = 4


class _CopiedPages:
    """The source pages of a kernel copy whose bytes are also read for their CRC-32: they leave the page cache
    (with ``drop``) once both the copy and that read are done, whichever ends last."""

    def __init__(self, files: SourceFiles, r: StoredRange, drop: bool):
        self.files, self.r, self.drop = files, r, drop
        self.left = 2
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last and self.drop:
            self.files.drop_cache(self.r.path, self.r.offset, self.r.nbytes)

    def crc(self, buf: memoryview) -> None:  # in the read-ahead thread
        try:
            self.files.crc_span(self.r.path, self.r.offset, self.r.nbytes, buf)
        finally:
            self.done()


def crc_beside(files: SourceFiles, bufs: ChunkBuffers, r: StoredRange, drop: bool, besides: list):
    """For a copy inside the kernel of stored range ``r`` whose CRC-32 ``files`` checks
    (:meth:`~ckptlib.io.crc.CrcSourceFiles.crc_span`): its bytes read again for it in the read-ahead thread,
    beside the copy and the next ones (at most :data:`CRC_BEHIND` behind; their futures go to ``besides``).
    Returns the pages' :class:`_CopiedPages` (the copy calls ``done()``), or None where nothing is checked."""
    if getattr(files, "crc_span", None) is None or not files.tracks(r.path):
        return None
    while len(besides) >= CRC_BEHIND:
        besides.pop(0).result()
    pages = _CopiedPages(files, r, drop)
    besides.append(bufs.pool.submit(pages.crc, bufs.crc_piece))
    return pages


def _read_gather(files: SourceFiles, gather: Sequence, out: memoryview, crc: bool, drop: bool = False) -> tuple:
    """:meth:`SourceFiles.read_gather` (in the read-ahead thread); returns ``out``, its CRC-32 with ``crc``
    (else None; from the CRC-32s of the spans where a :class:`~ckptlib.io.crc.CrcSourceFiles` computed them
    as it read) and the spans read."""
    with_crc = getattr(files, "read_gather_crc", None)
    if with_crc is None:
        spans = files.read_gather(gather, out, drop)
        return out, (crc32(out) if crc else None), spans
    spans = with_crc(gather, out, drop, crc)
    return out, (joined_crc(spans, out) if crc else None), spans


def copy_file(src: str, sink, nbytes: int, bufs: ChunkBuffers, files: SourceFiles,
              progress: Callable[[int], None] = lambda n: None, cancel: Any = None) -> int:
    """Copy the first ``nbytes`` of file ``src`` into ``sink`` as one range of bytes (:func:`copy_ranges`: inside
    the kernel where the sink can, a chunk at a time), so that ``files`` sees every byte: a
    :class:`~ckptlib.io.crc.CrcSourceFiles` checks the CRC-32 of the zip members in it as they pass. Returns the
    bytes written. Memory: the buffers ``bufs``."""
    return copy_ranges([StoredRange(src, 0, "uint8", nbytes)], "uint8", sink, bufs, files, progress, cancel)


def fill_bytes(ranges: Sequence, dtype: str, files: SourceFiles, out: memoryview,
               bufs: Optional[ChunkBuffers] = None) -> None:
    """Fill ``out`` with the concatenation of ``ranges`` as ``dtype`` (zeros, reads, casts where a range is
    stored in another dtype). Memory: a range's stored bytes when it needs a cast; else none."""
    pos, size = 0, itemsize(dtype)
    for r in ranges:
        n = r.count * size
        dst = out[pos:pos + n]
        if isinstance(r, Zeros):
            dst[:] = bytes(n)
        elif r.dtype == dtype:
            files.read_into(r.path, r.offset, dst)
        else:
            tmp = memoryview(bytearray(r.nbytes))
            files.read_into(r.path, r.offset, tmp)
            cast_bytes(tmp, r.dtype, dst, dtype, bufs.scratch if bufs is not None else None)
        pos += n


def first_difference(a: Sequence, b: Sequence, dtype: str, files: SourceFiles,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, cancel: Any = None) -> Optional[int]:
    """The first element where ranges ``a`` and ``b`` (both read as ``dtype``) differ bit for bit, or None
    when they are equal (also in length). Memory: two chunks of ``chunk_bytes``. No torch."""
    return first_differences(a, [b], dtype, files, chunk_bytes, cancel)[0]


def first_differences(a: Sequence, others: Sequence[Sequence], dtype: str, files: SourceFiles,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES, cancel: Any = None,
                      a_files: Optional[SourceFiles] = None) -> list[Optional[int]]:
    """For each of ``others``, the first element where it differs from ``a`` bit for bit (both read as
    ``dtype``; 0 when the lengths differ), or None where equal. ``a`` is read once for all of them (a
    tensor stored on several ranks, compared with its first copy), through ``a_files`` if given (a run reads
    the others through the reader that checks their CRC-32s, ``a`` where its writers read it). Ranges stored
    in ``dtype`` are read by scatter reads (:meth:`SourceFiles.read_gather`); the bytes are compared eight at a
    time. Memory: two chunks of ``chunk_bytes``. No torch."""
    import numpy as np

    n = numel(a)
    found: list[Optional[int]] = [None if numel(b) == n else 0 for b in others]
    todo = [i for i, f in enumerate(found) if f is None]
    if not todo or n == 0:
        return found
    size = itemsize(dtype)
    step = max(1, chunk_bytes // size)
    x, y = (np.empty(min(step, n) * size, dtype=np.uint8) for _ in range(2))
    starts = [range_starts(a)] + [range_starts(b) for b in others]

    def fill(ranges: Sequence, at: list, pos: int, k: int, out, reader: SourceFiles = files) -> None:
        part = slice_ranges(ranges, pos, k, at)
        if all(isinstance(r, StoredRange) and r.dtype == dtype for r in part):
            reader.read_gather(part, memoryview(out))
        else:
            fill_bytes(part, dtype, reader, memoryview(out))

    for pos in range(0, n, step):
        check_cancel(cancel)
        k = min(step, n - pos)
        xs, ys = x[:k * size], y[:k * size]
        fill(a, starts[0], pos, k, xs, a_files or files)
        wide = np.uint64 if xs.nbytes % 8 == 0 else np.uint8
        for i in list(todo):
            fill(others[i], starts[i + 1], pos, k, ys)
            if not np.array_equal(xs.view(wide), ys.view(wide)):
                found[i] = pos + int(np.flatnonzero(xs != ys)[0]) // size
                todo.remove(i)
        if not todo:
            break
    return found


def read_ranges(ranges: Sequence, dtype: str, files: SourceFiles):
    """The concatenation of ``ranges`` as one 1-D torch tensor of ``dtype`` (cast where needed; imports torch).

    Memory: the result plus the largest range in its stored dtype.
    """
    torch = import_torch(TORCH_TENSORS)
    out = torch.empty(numel(ranges), dtype=torch_dtype(dtype))
    pos = 0
    for r in ranges:
        dst = out[pos:pos + r.count]
        if isinstance(r, Zeros):
            dst.zero_()
        elif r.dtype == dtype:
            files.read_into(r.path, r.offset, _tensor_bytes(dst))
        else:
            tmp = torch.empty(r.count, dtype=torch_dtype(r.dtype))
            files.read_into(r.path, r.offset, _tensor_bytes(tmp))
            dst.copy_(tmp)
        pos += r.count
    return out


def _tensor_bytes(t) -> memoryview:
    return memoryview(t.view(import_torch(TORCH_TENSORS).uint8).numpy())


__all__ = ["DEFAULT_CHUNK_BYTES", "FIXED_OVERHEAD_BYTES", "predicted_peak_bytes", "ChunkBuffers", "load_cast_kernels",
           "openblas_threads",
           "cast_bytes", "copy_ranges", "copy_file", "fill_bytes", "read_ranges", "first_difference", "first_differences"]
