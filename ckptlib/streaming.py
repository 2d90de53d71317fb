"""Streaming tensor bytes from stored ranges into a sink, through fixed buffers (shared by export and reshard).

A *range list* describes an output tensor as the concatenation of stored pieces
(:class:`~ckptlib.deepspeed.checkpoint.SourceRange`: ``count`` elements of a stored tensor from
``start``) and runs of zeros (:class:`Zeros`, the padding of a partition). :func:`copy_ranges` writes
them in order, in chunks, casting when the output dtype differs; ranges already in the output dtype go
file to file inside the kernel when the sink can do that (``copy_from``). A sink that keeps a CRC-32
of what it is given (``takes_crc``) gets each chunk's CRC computed in the read-ahead thread, beside
the read, so the writing thread only writes.

Memory: the three buffers of :class:`ChunkBuffers` (``3 * chunk_bytes``), whatever the tensor sizes.
"""
from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .layout import Zeros
from .progress import check_cancel
from .torchzip.zipfmt import crc32_combine

DEFAULT_CHUNK_BYTES = 16 * 2**20
# write(2) in pieces of this size: on the machine measured, writing 3.5 GiB into the page cache in
# 16 MiB calls took 3.7x the system time of 1 MiB calls (bench/write_path.py, docs/benchmarks.md)
WRITE_SLICE = 2**20
FIXED_OVERHEAD_BYTES = 8 * 2**20  # allowance for the plan's object trees and bookkeeping


def predicted_peak_bytes(chunk_bytes: int, threads: int = 1) -> int:
    """What a streaming run adds to a process: each writing thread's :class:`ChunkBuffers` (two read-ahead,
    one cast; storage copies use the same) plus a fixed allowance."""
    return threads * 3 * chunk_bytes + FIXED_OVERHEAD_BYTES


@dataclass(frozen=True)
class SourceRange:
    """``count`` elements of a stored tensor from element ``start`` (of its flattened value)."""

    handle: Any  # a ckptlib.torchzip.TensorHandle
    start: int
    count: int


class ChunkBuffers:
    """Reusable byte buffers of ``chunk_bytes`` each: two to read into (one is filled in the background
    while the other is written out) and one to cast into.

    Memory: ``3 * chunk_bytes``, whatever the dtypes and tensor sizes.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes = max(16, chunk_bytes)
        self._read = [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        self._cast = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        self._pool: Optional[ThreadPoolExecutor] = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-read")
        return self._pool

    def elems(self, *dtypes: torch.dtype) -> int:
        return self.chunk_bytes // max(d.itemsize for d in dtypes)

    def read_view(self, dtype: torch.dtype, n: int, slot: int = 0) -> torch.Tensor:
        return self._read[slot][:n * dtype.itemsize].view(dtype)

    def cast_view(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self._cast[:n * dtype.itemsize].view(dtype)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:  # the symbols already loaded into the process (libc among them); find_library would spawn ldconfig
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


class WriteBehind:
    """Writes an output file's dirty pages to disk as it grows and then drops them from the page cache.

    Every ``window`` bytes written in a row are handed to the disk at once (Linux ``sync_file_range``);
    once ``lag`` more windows are in flight, the oldest is waited for and its (now clean) pages are
    released (``posix_fadvise(DONTNEED)``). A multi-GB output then never fills the page cache with
    dirty pages, so the kernel neither throttles the writer nor starts bulk writeback in the middle
    of the run, and the final ``fsync`` has little left to do; the page cache the file takes stays
    about ``(lag + 1) * window`` (144 MiB by default; enough in flight for high-latency storage). On
    the 2-core VM of ``bench/`` writing 3.5 GiB took 1.6 s instead of 3.4 s without it (both with
    ``fsync``; ``bench/write_path.py``). Elsewhere it degrades to ``posix_fadvise`` alone, or to
    nothing. ``CKPTLIB_WRITE_BEHIND=0`` in the environment turns it off (plain buffered writes).
    """

    def __init__(self, fd: int, window: int = 16 * 2**20, lag: int = 8):
        self.fd, self.window, self.lag = fd, window, lag
        self.enabled = os.environ.get("CKPTLIB_WRITE_BEHIND", "1") != "0"
        self._run: Optional[list] = None  # [start, end) of the bytes written in a row, not handed over yet
        self._flight: collections.deque = collections.deque()

    def wrote(self, offset: int, nbytes: int) -> None:
        if nbytes <= 0 or not self.enabled:
            return
        if self._run is not None and self._run[1] == offset:
            self._run[1] += nbytes
        else:
            self._hand_over()
            self._run = [offset, offset + nbytes]
        if self._run[1] - self._run[0] >= self.window:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._run is None:
            return
        start, end = self._run
        self._run = None
        if _sync_file_range is not None:
            _sync_file_range(self.fd, start, end - start, _SFR_WRITE)
        self._flight.append((start, end))
        while len(self._flight) > self.lag:
            self._release(*self._flight.popleft())

    def _release(self, start: int, end: int) -> None:
        if _sync_file_range is not None:
            _sync_file_range(self.fd, start, end - start, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def close(self) -> None:
        """Hand over and release everything still pending (the data is then on its way to disk)."""
        self._hand_over()
        while self._flight:
            self._release(*self._flight.popleft())


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``, in :data:`WRITE_SLICE` pieces."""
    mv = memoryview(data).cast("B")
    done, n = 0, mv.nbytes
    while done < n:
        done += os.pwrite(fd, mv[done:done + WRITE_SLICE], offset + done)


def kernel_copy(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int,
                step: int = 64 * 2**20) -> None:
    """Copy ``nbytes`` between two files inside the kernel (``copy_file_range``: no user-space buffer),
    falling back to 1 MiB ``pread``/``pwrite`` where the kernel cannot."""
    done = 0
    while done < nbytes:
        n = min(step, nbytes - done)
        try:
            k = os.copy_file_range(src_fd, dst_fd, n, src_offset + done, dst_offset + done)
        except OSError:  # not supported between these files
            k = 0
        if k <= 0:
            data = os.pread(src_fd, min(n, 2**20), src_offset + done)
            if not data:
                raise OSError(f"unexpected end of file copying {nbytes} bytes")
            k = os.pwrite(dst_fd, data, dst_offset + done)
        done += k


class PwriteSink:
    """Writes consecutive chunks at a moving offset of an open file (``os.pwrite``); callable as ``write``.

    With ``crc=True`` it keeps the CRC-32 of everything written (``self.crc``); chunks may come with
    their CRC already computed. Without, :meth:`copy_from` copies bytes straight from another file
    inside the kernel (:func:`kernel_copy`). With a :class:`WriteBehind`, what is written goes on to
    disk as the file grows.
    """

    def __init__(self, fd: int, offset: int, crc: bool = False, behind: Optional[WriteBehind] = None):
        self.fd, self.offset, self.start = fd, offset, offset
        self.takes_crc = crc
        self.can_copy = not crc
        self.crc = 0
        self.behind = behind

    @property
    def written(self) -> int:
        return self.offset - self.start

    def write(self, data, crc: Optional[int] = None) -> None:
        mv = memoryview(data).cast("B")
        pwrite_all(self.fd, mv, self.offset)
        if self.takes_crc:
            self.crc = crc32_combine(self.crc, zlib.crc32(mv) if crc is None else crc, mv.nbytes)
        if self.behind is not None:
            self.behind.wrote(self.offset, mv.nbytes)
        self.offset += mv.nbytes

    __call__ = write

    def copy_from(self, src_fd: int, src_offset: int, nbytes: int) -> None:
        if self.takes_crc:
            raise RuntimeError("a CRC-keeping sink cannot copy inside the kernel")
        kernel_copy(src_fd, src_offset, self.fd, self.offset, nbytes)
        if self.behind is not None:
            self.behind.wrote(self.offset, nbytes)
        self.offset += nbytes


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def _plan_chunks(ranges: Sequence, dtype: torch.dtype, bufs: ChunkBuffers, direct: bool) -> list[tuple]:
    """The work of :func:`copy_ranges` as a list of ``("zeros", n)``, ``("copy", h, start, n)`` (kernel
    copy) and ``("read", h, start, n)`` (through the buffers) items, in output order."""
    items = []
    for r in ranges:
        if isinstance(r, Zeros):
            step = bufs.elems(dtype)
            items += [("zeros", min(step, r.count - i)) for i in range(0, r.count, step)]
            continue
        h = r.handle
        kind = "copy" if direct and h.dtype == dtype and h.is_contiguous() else "read"
        step = max(1, bufs.chunk_bytes // h.itemsize) if kind == "copy" else bufs.elems(h.dtype, dtype)
        items += [(kind, h, r.start + i, min(step, r.count - i)) for i in range(0, r.count, step)]
    return items


def copy_ranges(ranges: Sequence, dtype: torch.dtype, sink, bufs: ChunkBuffers,
                progress: Callable[[int], None] = lambda n: None, cancel: Optional[threading.Event] = None,
                drop_cache: bool = True) -> int:
    """Write the concatenation of ``ranges`` as ``dtype`` into ``sink``; returns the bytes written.

    ``sink`` has ``write(memoryview)`` and optionally ``copy_from(fd, offset, nbytes)``. Chunks that go
    through the buffers are read one ahead in a background thread, so reading the source and writing
    the output overlap. With ``drop_cache`` the page-cache pages of each source range are released
    once it is copied.
    """
    items = _plan_chunks(ranges, dtype, bufs, getattr(sink, "can_copy", False))
    reads = [i for i, it in enumerate(items) if it[0] == "read"]
    ahead: dict[int, Any] = {}
    want_crc = getattr(sink, "takes_crc", False)

    def submit(k: int) -> None:  # start reading the k-th buffered chunk into slot k % 2
        if k < len(reads):
            _, h, start, n = items[reads[k]]
            ahead[reads[k]] = bufs.pool.submit(_read_chunk, h, start, n, bufs.read_view(h.dtype, n, k % 2),
                                               want_crc and h.dtype == dtype)

    submit(0)
    k = 0
    total = 0
    for i, it in enumerate(items):
        check_cancel(cancel)
        if it[0] == "zeros":
            z = bufs.cast_view(dtype, it[1])
            z.zero_()
            sink.write(_bytes(z))
            nbytes = it[1] * dtype.itemsize
        elif it[0] == "copy":
            _, h, start, n = it
            sink.copy_from(h.storage.file.fileno(), h.byte_offset(start), n * h.itemsize)
            h.storage.file.count_read(n * h.itemsize)
            nbytes = n * h.itemsize
        else:
            _, h, start, n = it
            chunk, crc = ahead.pop(i).result()
            if chunk.dtype != dtype:
                cast = bufs.cast_view(dtype, n)
                cast.copy_(chunk)
                chunk = cast
            submit(k + 1)  # the read slot is free again once cast; else the other slot
            if want_crc:
                sink.write(_bytes(chunk), crc)
            else:
                sink.write(_bytes(chunk))
            k += 1
            nbytes = n * dtype.itemsize
        if drop_cache and it[0] != "zeros":
            it[1].drop_cache(it[2], it[3])
        progress(nbytes)
        total += nbytes
    return total


def _read_chunk(h, start: int, n: int, out: torch.Tensor, crc: bool) -> tuple:
    """Read ``n`` elements into ``out`` (in the read-ahead thread); with ``crc``, their CRC-32 too."""
    chunk = h.read_flat(start, n, out)
    return chunk, (zlib.crc32(_bytes(chunk)) if crc else None)


def slice_ranges(ranges: Sequence, start: int, count: int) -> list:
    """The sub-list of ``ranges`` covering elements ``[start, start+count)`` of their concatenation."""
    out, pos, end = [], 0, start + count
    for r in ranges:
        lo, hi = pos, pos + r.count
        a, b = max(lo, start), min(hi, end)
        if a < b:
            if isinstance(r, Zeros):
                out.append(Zeros(b - a))
            else:
                out.append(type(r)(r.handle, r.start + (a - lo), b - a))
        pos = hi
        if pos >= end:
            break
    if sum(r.count for r in out) != count:
        raise IndexError(f"ranges hold {pos} elements; [{start}, {end}) is out of bounds")
    return out
