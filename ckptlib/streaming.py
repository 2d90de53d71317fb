"""Streaming tensor bytes from stored ranges into a sink, through fixed buffers (shared by export and reshard).

A *range list* describes an output tensor as the concatenation of stored pieces
(:class:`~ckptlib.deepspeed.checkpoint.SourceRange`: ``count`` elements of a stored tensor from
``start``) and runs of zeros (:class:`Zeros`, the padding of a partition). :func:`copy_ranges` writes
them in order, in chunks, casting when the output dtype differs; ranges already in the output dtype go
file to file inside the kernel when the sink can do that (``copy_from``).

Memory: the two buffers of :class:`ChunkBuffers` (``2 * chunk_bytes``), whatever the tensor sizes.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch

from .layout import Zeros
from .progress import check_cancel

DEFAULT_CHUNK_BYTES = 16 * 2**20


class ChunkBuffers:
    """Two reusable byte buffers of ``chunk_bytes`` each: one to read into, one to cast into.

    Memory: exactly ``2 * chunk_bytes``, whatever the dtypes and tensor sizes.
    """

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes = max(16, chunk_bytes)
        self._read = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        self._cast = torch.empty(self.chunk_bytes, dtype=torch.uint8)

    def elems(self, *dtypes: torch.dtype) -> int:
        return self.chunk_bytes // max(d.itemsize for d in dtypes)

    def read_view(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self._read[:n * dtype.itemsize].view(dtype)

    def cast_view(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self._cast[:n * dtype.itemsize].view(dtype)


class WriteSink:
    """Adapts a ``write(memoryview)`` function to a sink."""

    def __init__(self, write: Callable[[memoryview], None]):
        self.write = write


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def copy_ranges(ranges: Sequence, dtype: torch.dtype, sink, bufs: ChunkBuffers,
                progress: Callable[[int], None] = lambda n: None, cancel: Optional[threading.Event] = None,
                drop_cache: bool = True) -> int:
    """Write the concatenation of ``ranges`` as ``dtype`` into ``sink``; returns the bytes written.

    ``sink`` has ``write(memoryview)`` and optionally ``copy_from(fd, offset, nbytes)``. With
    ``drop_cache`` the page-cache pages of each source range are released once it is copied.
    """
    direct = hasattr(sink, "copy_from")
    total = 0
    for r in ranges:
        if isinstance(r, Zeros):
            step = bufs.elems(dtype)
            left = r.count
            while left:
                n = min(step, left)
                z = bufs.cast_view(dtype, n)
                z.zero_()
                sink.write(_bytes(z))
                progress(n * dtype.itemsize)
                left -= n
            total += r.count * dtype.itemsize
            continue
        h = r.handle
        if direct and h.dtype == dtype and h.is_contiguous():
            step = max(1, bufs.chunk_bytes // h.itemsize)  # kernel copy: no buffer, same progress granularity
            pos = 0
            while pos < r.count:
                check_cancel(cancel)
                n = min(step, r.count - pos)
                sink.copy_from(h.storage.file.fileno(), h.byte_offset(r.start + pos), n * h.itemsize)
                h.storage.file.count_read(n * h.itemsize)
                progress(n * h.itemsize)
                pos += n
        else:
            step = bufs.elems(h.dtype, dtype)
            pos = 0
            while pos < r.count:
                check_cancel(cancel)
                n = min(step, r.count - pos)
                chunk = h.read_flat(r.start + pos, n, out=bufs.read_view(h.dtype, n))
                if chunk.dtype != dtype:
                    cast = bufs.cast_view(dtype, n)
                    cast.copy_(chunk)
                    chunk = cast
                sink.write(_bytes(chunk))
                progress(n * dtype.itemsize)
                pos += n
        if drop_cache:
            h.drop_cache(r.start, r.count)
        total += r.count * dtype.itemsize
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
