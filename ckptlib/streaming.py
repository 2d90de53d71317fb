"""Streaming tensor bytes from stored ranges into a sink, through fixed buffers (every writer uses it).

:func:`copy_ranges` writes a range list (:mod:`ckptlib.ranges`: stored ranges and zeros) in order,
in chunks, casting when the output dtype differs. Ranges already in the output dtype go file to file
inside the kernel when the sink can do that (``copy_from``). Chunks that go through the buffers are
read one ahead in a background thread; a sink that keeps a CRC-32 (``takes_crc``) gets each chunk's
CRC computed there too, beside the read, so the writing thread only writes.

Memory: the three buffers of :class:`ChunkBuffers` (``3 * chunk_bytes``), whatever the tensor sizes.
"""
from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from .dtypes import itemsize, torch_dtype
from .progress import check_cancel
from .ranges import StoredRange, Zeros, slice_ranges
from .sources import SourceFiles

DEFAULT_CHUNK_BYTES = 16 * 2**20
FIXED_OVERHEAD_BYTES = 8 * 2**20  # allowance for the plan's object trees and bookkeeping


def predicted_peak_bytes(chunk_bytes: int, threads: int = 1) -> int:
    """What a streaming run adds to a process: each writing thread's :class:`ChunkBuffers` (two read-ahead,
    one cast; storage copies use the same) plus a fixed allowance."""
    return threads * 3 * chunk_bytes + FIXED_OVERHEAD_BYTES


class ChunkBuffers:
    """Reusable byte buffers of ``chunk_bytes`` each: two to read into (one is filled in the background
    while the other is written out) and one to cast into.

    Memory: ``3 * chunk_bytes``, whatever the dtypes and tensor sizes.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        import torch

        self.chunk_bytes = max(16, chunk_bytes)
        self._read = [torch.empty(self.chunk_bytes, dtype=torch.uint8) for _ in range(2)]
        self._cast = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        self._pool: Optional[ThreadPoolExecutor] = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-read")
        return self._pool

    def elems(self, *dtypes: str) -> int:
        """Elements of the widest of ``dtypes`` (names) that fit in one buffer."""
        return self.chunk_bytes // max(itemsize(d) for d in dtypes)

    def read_view(self, dtype: str, n: int, slot: int = 0):
        return self._read[slot][:n * itemsize(dtype)].view(torch_dtype(dtype))

    def cast_view(self, dtype: str, n: int):
        return self._cast[:n * itemsize(dtype)].view(torch_dtype(dtype))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _bytes(t) -> memoryview:
    import torch

    return memoryview(t.view(torch.uint8).numpy())


def _plan_chunks(ranges: Sequence, dtype: str, bufs: ChunkBuffers, direct: bool) -> list[tuple]:
    """The work of :func:`copy_ranges` as ``("zeros", n)``, ``("copy", range)`` (kernel copy) and
    ``("read", range)`` (through the buffers) items, in output order, each at most one chunk."""
    items: list[tuple] = []
    for r in ranges:
        if isinstance(r, Zeros):
            step = bufs.elems(dtype)
            items += [("zeros", min(step, r.count - i)) for i in range(0, r.count, step)]
            continue
        kind = "copy" if direct and r.dtype == dtype else "read"
        step = max(1, bufs.chunk_bytes // r.itemsize) if kind == "copy" else bufs.elems(r.dtype, dtype)
        items += [(kind, r.sub(i, min(step, r.count - i))) for i in range(0, r.count, step)]
    return items


def copy_ranges(ranges: Sequence, dtype: str, sink, bufs: ChunkBuffers, files: SourceFiles,
                progress: Callable[[int], None] = lambda n: None, cancel: Any = None,
                drop_cache: bool = True) -> int:
    """Write the concatenation of ``ranges`` as ``dtype`` (a name) into ``sink``; returns the bytes written.

    ``sink`` has ``write(memoryview[, crc])`` and optionally ``copy_from(fd, offset, nbytes)``
    (``can_copy``) and ``takes_crc``. With ``drop_cache`` the page-cache pages of each source range
    are released once copied. ``cancel`` (anything with ``is_set()``) stops it at the next chunk.
    """
    items = _plan_chunks(ranges, dtype, bufs, getattr(sink, "can_copy", False))
    reads = [i for i, it in enumerate(items) if it[0] == "read"]
    ahead: dict[int, Any] = {}
    want_crc = getattr(sink, "takes_crc", False)
    size = itemsize(dtype)

    def submit(k: int) -> None:  # start reading the k-th buffered chunk into slot k % 2
        if k < len(reads):
            r = items[reads[k]][1]
            ahead[reads[k]] = bufs.pool.submit(_read_chunk, files, r, bufs.read_view(r.dtype, r.count, k % 2),
                                               want_crc and r.dtype == dtype)

    submit(0)
    k = total = 0
    try:
        for i, it in enumerate(items):
            check_cancel(cancel)
            if it[0] == "zeros":
                z = bufs.cast_view(dtype, it[1])
                z.zero_()
                sink.write(_bytes(z))
                nbytes = it[1] * size
            elif it[0] == "copy":
                r = it[1]
                sink.copy_from(files.fd(r.path), r.offset, r.nbytes)
                files.count(r.nbytes)
                nbytes = r.nbytes
            else:
                r = it[1]
                chunk, crc = ahead.pop(i).result()
                if r.dtype != dtype:
                    cast = bufs.cast_view(dtype, r.count)
                    cast.copy_(chunk)
                    chunk = cast
                submit(k + 1)  # the read slot is free again once cast; else the other slot
                if want_crc:
                    sink.write(_bytes(chunk), crc)
                else:
                    sink.write(_bytes(chunk))
                k += 1
                nbytes = r.count * size
            if drop_cache and it[0] != "zeros":
                files.drop_cache(it[1].path, it[1].offset, it[1].nbytes)
            progress(nbytes)
            total += nbytes
    finally:
        for fut in ahead.values():  # a failure or cancel: let the read-ahead finish before its buffer is reused
            fut.cancel() or fut.exception()
    return total


def _read_chunk(files: SourceFiles, r: StoredRange, out, crc: bool) -> tuple:
    """Read range ``r`` into ``out`` (in the read-ahead thread); with ``crc``, its CRC-32 too."""
    files.read_into(r.path, r.offset, _bytes(out))
    return out, (zlib.crc32(_bytes(out)) if crc else None)


def first_difference(a: Sequence, b: Sequence, dtype: str, files: SourceFiles,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, cancel: Any = None) -> Optional[int]:
    """The first element where ranges ``a`` and ``b`` (both read as ``dtype``) differ bit for bit, or None
    when they are equal (also in length). Memory: two chunks of ``chunk_bytes``."""
    import torch

    n = sum(r.count for r in a)
    if sum(r.count for r in b) != n:
        return 0
    step = max(1, chunk_bytes // itemsize(dtype))
    for pos in range(0, n, step):
        check_cancel(cancel)
        k = min(step, n - pos)
        x = read_ranges(slice_ranges(a, pos, k), dtype, files).view(torch.uint8)
        y = read_ranges(slice_ranges(b, pos, k), dtype, files).view(torch.uint8)
        if not torch.equal(x, y):
            return pos + int((x != y).nonzero()[0]) // itemsize(dtype)
    return None


def read_ranges(ranges: Sequence, dtype: str, files: SourceFiles):
    """The concatenation of ``ranges`` as one 1-D torch tensor of ``dtype`` (cast where needed).

    Memory: the result plus the largest range in its stored dtype.
    """
    import torch

    out = torch.empty(sum(r.count for r in ranges), dtype=torch_dtype(dtype))
    pos = 0
    for r in ranges:
        dst = out[pos:pos + r.count]
        if isinstance(r, Zeros):
            dst.zero_()
        elif r.dtype == dtype:
            files.read_into(r.path, r.offset, _bytes(dst))
        else:
            tmp = torch.empty(r.count, dtype=torch_dtype(r.dtype))
            files.read_into(r.path, r.offset, _bytes(tmp))
            dst.copy_(tmp)
        pos += r.count
    return out


__all__ = ["DEFAULT_CHUNK_BYTES", "FIXED_OVERHEAD_BYTES", "predicted_peak_bytes", "ChunkBuffers",
           "copy_ranges", "read_ranges", "first_difference"]
