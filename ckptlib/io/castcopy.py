"""Casting stored tensor bytes into a sink in pieces that stay in the CPU cache, on two cores.

:func:`cast_bytes` casts one buffer (:mod:`.casting`'s kernels, bit for bit torch's, or torch for other
dtype pairs). :func:`cast_pieces` streams a chunk that needs a cast (stored ranges of one dtype, up to a
chunk of :class:`~ckptlib.io.streaming.ChunkBuffers`) into a sink that writes at positions (``put``): it
cuts the chunk into pieces of :data:`PIECE_BYTES` stored bytes, and one thread reads a piece into a small
buffer, casts it and writes it at its place, with no hand-over between threads. The piece's bytes stay in
that core's cache from the read to the write, so memory carries what the page cache gives and takes and
little more. Reading a whole 16 MiB chunk first, then casting it, then writing it moved each byte through
memory about three times more, and on the 2-core machine measured memory is what a down-casting export
waits on (``bench/floor_bench.py``). The writing thread and the process's cast helper
(:class:`~ckptlib.io.threads.CastHelper`) take the pieces in turn, whichever is free first; the writing
thread first hands the sink's last full window to the disk (``catch_up``), while the helper has begun.

Memory: nothing of its own; each of the two threads uses a stretch of a piece in one read buffer and in
the cast buffer of the caller's :class:`~ckptlib.io.streaming.ChunkBuffers`.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Optional, Sequence

from ..dtypes import import_torch, itemsize, torch_dtype
from ..layout.ranges import range_starts, slice_ranges
from .sources import SourceFiles
from .threads import CastHelper
from .torchzip.zipfmt import crc32_combine
from .crc32 import crc32

#: stored bytes one thread reads, casts and writes at a time: with its cast (at most as many bytes again)
#: and the part of the cast's scratch a step uses, two threads' pieces stay in the 8 MiB cache of the machine
#: measured
PIECE_BYTES = 2**20


def cast_bytes(src: memoryview, src_dtype: str, out: memoryview, dtype: str, scratch: Any = None) -> None:
    """Write the elements in ``src`` (of ``src_dtype``) into ``out`` as ``dtype``, bit for bit as torch casts:
    :mod:`ckptlib.io.casting` for float32/bfloat16/float16 (and same-dtype copies), torch for other pairs.
    Memory: ``scratch`` (a :class:`~ckptlib.io.casting.Scratch`, or one made for the call)."""
    from .casting import can_cast, cast

    if can_cast(src_dtype, dtype):
        cast(src, src_dtype, out, dtype, scratch)
        return
    # a pair ckptlib.io.casting does not do (float64, integers to floats): torch's own cast
    torch = import_torch(f"casting {src_dtype} to {dtype}")

    n = src.nbytes // itemsize(src_dtype)
    if n:
        dst = torch.frombuffer(out, dtype=torch_dtype(dtype), count=n)
        dst.copy_(torch.frombuffer(src, dtype=torch_dtype(src_dtype), count=n))


def piece_elems(chunk_bytes: int, src_dtype: str, dtype: str) -> int:
    """Elements of one piece: :data:`PIECE_BYTES` of the wider dtype, at most half a chunk (two threads
    share the buffers), at least one."""
    return max(1, min(PIECE_BYTES, chunk_bytes // 2) // max(itemsize(src_dtype), itemsize(dtype)))


def cast_pieces(gather: Sequence, dtype: str, sink, bufs, files: SourceFiles, slot: int,
                drop: bool = False) -> int:
    """Read the stored ranges ``gather`` (one stored dtype, other than ``dtype``, at most one chunk of
    ``bufs``), cast them to ``dtype`` and write them at the end of ``sink``, piece by piece, on this thread
    and the cast helper when it is free; returns the bytes written. ``sink`` has ``put(at, data)`` and
    ``advance(nbytes, crc)`` (:class:`~ckptlib.io.sinks.PwriteSink`); read buffer ``slot`` of ``bufs`` (a
    :class:`~ckptlib.io.streaming.ChunkBuffers`) and its cast buffer hold the pieces. With ``drop`` the pages read are released from the page cache.
    Memory: none beyond ``bufs``."""
    src = gather[0].dtype
    n = sum(r.count for r in gather)
    per = piece_elems(bufs.chunk_bytes, src, dtype)
    count = -(-n // per)
    si, di = itemsize(src), itemsize(dtype)
    starts = range_starts(gather)
    crcs: Optional[list] = [0] * count if getattr(sink, "takes_crc", False) else None
    tickets = itertools.count()  # the next piece to take (next() on it is atomic under the GIL)
    failed = threading.Event()

    def work(lane: int, scratch) -> None:
        read, out = bufs.lane(slot, lane, per * si, per * di)
        for i in tickets:
            if i >= count or failed.is_set():
                return
            a = i * per
            k = min(per, n - a)
            files.read_gather(slice_ranges(gather, a, k, starts), read[:k * si], drop)
            cast_bytes(read[:k * si], src, out[:k * di], dtype, scratch)
            sink.put(a * di, out[:k * di])
            if crcs is not None:
                crcs[i] = crc32(out[:k * di])

    helper = CastHelper.get() if count > 1 else None
    if helper is not None and helper.lock.acquire(blocking=False):
        try:
            fut = helper.pool.submit(work, 1, helper.scratch)
            try:
                catch_up = getattr(sink, "catch_up", None)
                if catch_up is not None:  # the write-behind's system calls, while the helper casts
                    catch_up()
                work(0, bufs.scratch)
            except BaseException:
                failed.set()
                fut.exception()  # the helper stops at its next piece, before the buffers are used again
                raise
            fut.result()
        finally:
            helper.lock.release()
    else:
        work(0, bufs.scratch)
    crc = None
    if crcs is not None:
        crc = crcs[0]
        for i in range(1, count):
            crc = crc32_combine(crc, crcs[i], (min(per, n - i * per)) * di)
    sink.advance(n * di, crc)
    return n * di


__all__ = ["PIECE_BYTES", "cast_bytes", "piece_elems", "cast_pieces"]
