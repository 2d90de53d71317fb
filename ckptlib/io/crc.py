"""Verifying the CRC-32 that a torch zip file records for each of its members (torch itself never checks
them): damaged bytes inside tensor data otherwise read as valid numbers.

A member is checked whole (its CRC-32 covers all its bytes): :func:`entries_touching` gives the members
a list of stored ranges reads from, :func:`verify_entries` streams each through one reusable buffer and
returns those whose bytes no longer match. Plans carry the members as plain data
(:class:`~ckptlib.io.torchzip.ZipEntry`).

Memory: one buffer of ``chunk_bytes``. Time: reading the members' bytes once more (the page cache
usually holds them); ``zlib.crc32`` runs at several GB/s.
"""
from __future__ import annotations

import bisect
import zlib
from typing import Any, Callable, Iterable, Sequence

from ..layout.ranges import StoredRange
from ..progress import check_cancel
from .sources import SourceFiles
from .torchzip.reader import ZipEntry


def entries_touching(entries: dict[str, Sequence[ZipEntry]], ranges: Iterable) -> list[ZipEntry]:
    """The members (``entries``: per path, sorted by offset) that the stored ranges read bytes of, in
    (path, offset) order, each once."""
    starts = {path: [e.offset for e in es] for path, es in entries.items()}
    found: set = set()
    for r in ranges:
        if not isinstance(r, StoredRange) or r.path not in entries:
            continue
        es, st = entries[r.path], starts[r.path]
        i = max(0, bisect.bisect_right(st, r.offset) - 1)
        end = r.offset + r.nbytes
        while i < len(es) and es[i].offset < end:
            if es[i].offset + es[i].size > r.offset:
                found.add(es[i])
            i += 1
    return sorted(found, key=lambda e: (e.path, e.offset))


def verify_entries(entries: Sequence[ZipEntry], files: SourceFiles, chunk_bytes: int = 16 * 2**20,
                   progress: Callable[[int], None] = lambda n: None, cancel: Any = None) -> list[tuple[ZipEntry, int]]:
    """``[(member, the CRC-32 of its bytes now)]`` for every member whose bytes do not match the CRC-32 its
    file records. Memory: one buffer of ``chunk_bytes``."""
    buf = bytearray(max(4096, min(chunk_bytes, max((e.size for e in entries), default=0))))
    view = memoryview(buf)
    bad = []
    for e in entries:
        crc, pos = 0, 0
        while pos < e.size:
            check_cancel(cancel)
            n = min(len(buf), e.size - pos)
            files.read_into(e.path, e.offset + pos, view[:n])
            crc = zlib.crc32(view[:n], crc)
            pos += n
            progress(n)
        if crc != e.crc:
            bad.append((e, crc))
    return bad


def describe_mismatch(e: ZipEntry, got: int) -> str:
    """One sentence for a member whose bytes changed."""
    return (f"zip entry {e.name} ({e.size:,} bytes) has CRC-32 {got:08x}, the file records {e.crc:08x}: its bytes "
            "changed after it was saved (bit rot, a bad copy or a damaged disk)")


__all__ = ["entries_touching", "verify_entries", "describe_mismatch"]
