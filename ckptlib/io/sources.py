"""Reading the source files of a plan by path: one read-only descriptor per file, shared by threads.

Plans name their bytes by file path and byte offset (:mod:`ckptlib.layout.ranges`); :class:`SourceFiles`
opens each file when first needed, reads with ``pread`` (no mmap), counts every byte (``stats``),
drops pages from the page cache once they are copied (where the run's reads would crowd it: ``drop``), and
checks that the files are the ones the plan was made from (:func:`check_unchanged`).
"""
from __future__ import annotations

import bisect
import itertools
import os
import threading
from typing import Iterable, Optional, Sequence

from ..errors import IncompleteCheckpointError
from .torchzip.reader import GLOBAL_STATS, ReadStats

#: buffers one ``preadv`` takes at most (Linux's ``IOV_MAX``)
IOV_MAX = getattr(os, "IOV_MAX", 1024) or 1024


def stamp(path: str) -> tuple[str, int, int]:
    """``(path, size, mtime_ns)`` of a file: what :func:`check_unchanged` compares."""
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


def check_unchanged(stamps: Iterable[tuple[str, int, int]]) -> None:
    """Raise :class:`IncompleteCheckpointError` naming the first file that is gone or differs (size or
    modification time) from when the plan was made."""
    for path, size, mtime in stamps:
        try:
            now = stamp(path)
        except OSError:
            raise IncompleteCheckpointError("this file of the checkpoint is gone since the plan was made", path=path,
                                            hint="make the plan again") from None
        if now[1:] != (size, mtime):
            raise IncompleteCheckpointError(
                f"this file changed since the plan was made ({size} -> {now[1]} bytes)", path=path,
                hint="make the plan again; ckptlib never writes into a checkpoint, something else did")


def _pread_all(fd: int, path: str, offset: int, target: memoryview) -> None:
    done, nbytes = 0, target.nbytes
    while done < nbytes:
        n = os.preadv(fd, [target[done:]], offset + done)
        if n <= 0:
            raise IncompleteCheckpointError("unexpected end of file (the file shrank or is truncated)",
                                            path=path, hint="copy the file again or use another tag")
        done += n


class SourceFiles:
    """Read access to files by path (thread-safe). ``stats`` counts the bytes read, kernel copies included.
    Without ``drop``, :meth:`drop_cache` does nothing: pages read stay in the page cache for the kernel to
    evict when it needs the room (a run decides with
    :func:`ckptlib.execute.writers.drops_source_pages`, which says what dropping costs).

    Memory: none beyond the descriptors.
    """

    def __init__(self, stats: Optional[ReadStats] = None, drop: bool = True):
        self.stats = stats or ReadStats()
        self.drops = drop
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._keep: dict[str, list] = {}  # path -> sorted (start, end) spans whose pages stay cached
        self._keep_ends: dict[str, list] = {}  # path -> running maximum of those ends

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            return fd
        with self._lock:
            if path not in self._fds:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise IncompleteCheckpointError(f"cannot open this file of the checkpoint ({e.strerror})",
                                                    path=path, hint="restore the file, or make the plan again") from e
            return self._fds[path]

    def read_into(self, path: str, offset: int, target: memoryview) -> None:
        """Fill ``target`` with the bytes of ``path`` from ``offset``."""
        _pread_all(self.fd(path), path, offset, target)
        self.count(target.nbytes)

    def read_scattered(self, path: str, offset: int, targets: list) -> None:
        """Fill the buffers ``targets`` in turn with the bytes of ``path`` from ``offset`` on (a scatter read:
        one ``preadv`` per :data:`IOV_MAX` buffers), e.g. the rows of one tensor-parallel shard, which lie
        back to back in their file, into every other row of a joined tensor."""
        fd, pos = self.fd(path), offset
        for a in range(0, len(targets), IOV_MAX):
            views = targets[a:a + IOV_MAX]
            want = sum(v.nbytes for v in views)
            n = os.preadv(fd, views, pos)
            if n < want:  # a short read (a signal, the end of the file): the rest buffer by buffer
                done = 0
                for v in views:
                    if done + v.nbytes > n:
                        skip = max(0, n - done)
                        _pread_all(fd, path, pos + done + skip, v[skip:])
                    done += v.nbytes
            pos += want
        self.count(pos - offset)

    def read_gather(self, gather: Sequence, out: memoryview, drop: bool = False) -> list[tuple[str, int, int]]:
        """Read the stored ranges ``gather`` (each with ``path``, ``offset`` and ``nbytes``) back to back into
        ``out``; returns the ``(path, offset, nbytes)`` spans read. The ranges of one file that continue each
        other there (the rows of a tensor-parallel shard, interleaved with another shard's in ``out``) are one
        span, read by one scatter read. With ``drop`` the page-cache pages of each span are released as soon
        as it is read."""
        runs: dict[str, list] = {}  # path -> [[file offset, end, [buffers]], ...]
        pos = 0
        for r in gather:  # one pass, a few operations a range: the rows of a join are tens of thousands
            end = pos + r.nbytes
            mine = runs.get(r.path)
            if mine is None:
                runs[r.path] = [[r.offset, r.offset + end - pos, [out[pos:end]]]]
            else:
                last = mine[-1]
                if last[1] == r.offset:
                    last[1] += end - pos
                    last[2].append(out[pos:end])
                else:
                    mine.append([r.offset, r.offset + end - pos, [out[pos:end]]])
            pos = end
        spans = []
        for path, mine in runs.items():
            for start, end, views in mine:
                self.read_scattered(path, start, views)
                spans.append((path, start, end - start))
                if drop:  # the bytes are in ``out`` now: their pages are not needed again
                    self.drop_cache(path, start, end - start)
        return spans

    def count(self, nbytes: int) -> None:
        """Account for bytes read outside :meth:`read_into` (copies inside the kernel)."""
        self.stats.add(nbytes)
        GLOBAL_STATS.add(nbytes)

    def keep_cached(self, spans: Iterable[tuple[str, int, int]]) -> None:
        """Never drop the page-cache pages of these ``(path, offset, nbytes)`` spans (:meth:`drop_cache` leaves
        any span that touches them): another reader still needs them, e.g. the copies a run compares beside
        its writing."""
        for path, offset, nbytes in spans:
            self._keep.setdefault(path, []).append((offset, offset + nbytes))
        for path in self._keep:
            self._keep[path].sort()
            self._keep_ends[path] = list(itertools.accumulate((e for _, e in self._keep[path]), max))

    def _kept(self, path: str, offset: int, nbytes: int) -> bool:
        spans = self._keep.get(path)
        if not spans:
            return False
        i = bisect.bisect_left(spans, (offset + nbytes,))  # the spans starting before this one ends
        return i > 0 and self._keep_ends[path][i - 1] > offset  # ... the furthest of them reaches into it

    def drop_cache(self, path: str, offset: int, nbytes: int) -> None:
        """Tell the kernel these bytes are not needed in the page cache any more (unless kept:
        :meth:`keep_cached`, or this reader does not drop pages at all)."""
        if not self.drops or self._keep and self._kept(path, offset, nbytes):
            return
        fd = self._fds.get(path)
        if fd is not None and nbytes > 0 and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> "SourceFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["SourceFiles", "stamp", "check_unchanged"]
