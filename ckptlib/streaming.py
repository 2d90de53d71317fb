"""Streaming tensor bytes from stored ranges into a sink, through fixed buffers (shared by export and reshard).

A *range list* describes an output tensor as the concatenation of stored pieces
(:class:`~ckptlib.deepspeed.checkpoint.SourceRange`: ``count`` elements of a stored tensor from
``start``) and runs of zeros (:class:`Zeros`, the padding of a partition). :func:`copy_ranges` writes
them in order, in chunks, casting when the output dtype differs; ranges already in the output dtype go
file to file inside the kernel when the sink can do that (``copy_from``).

Memory: the three buffers of :class:`ChunkBuffers` (``3 * chunk_bytes``), whatever the tensor sizes.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .layout import Zeros
from .progress import check_cancel

DEFAULT_CHUNK_BYTES = 16 * 2**20


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


class WriteSink:
    """Adapts a ``write(memoryview)`` function to a sink."""

    def __init__(self, write: Callable[[memoryview], None]):
        self.write = write


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
    items = _plan_chunks(ranges, dtype, bufs, hasattr(sink, "copy_from"))
    reads = [i for i, it in enumerate(items) if it[0] == "read"]
    ahead: dict[int, Any] = {}

    def submit(k: int) -> None:  # start reading the k-th buffered chunk into slot k % 2
        if k < len(reads):
            _, h, start, n = items[reads[k]]
            ahead[reads[k]] = bufs.pool.submit(h.read_flat, start, n, bufs.read_view(h.dtype, n, k % 2))

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
            chunk = ahead.pop(i).result()
            if chunk.dtype != dtype:
                cast = bufs.cast_view(dtype, n)
                cast.copy_(chunk)
                chunk = cast
                submit(k + 1)  # the read slot is free again once cast
                sink.write(_bytes(chunk))
            else:
                submit(k + 1)  # the other slot; this one is written now
                sink.write(_bytes(chunk))
            k += 1
            nbytes = n * dtype.itemsize
        if drop_cache and it[0] != "zeros":
            it[1].drop_cache(it[2], it[3])
        progress(nbytes)
        total += nbytes
    return total


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
