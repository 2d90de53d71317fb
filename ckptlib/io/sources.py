"""Reading the source files of a plan by path: one read-only descriptor per file, shared by threads.

Plans name their bytes by file path and byte offset (:mod:`ckptlib.layout.ranges`); :class:`SourceFiles`
opens each file when first needed, reads with ``pread`` (no mmap), counts every byte (``stats``),
drops pages from the page cache once they are copied, and checks that the files are the ones the plan
was made from (:func:`check_unchanged`).
"""
from __future__ import annotations

import os
import threading
from typing import Iterable, Optional

from ..errors import IncompleteCheckpointError
from .torchzip.reader import GLOBAL_STATS, ReadStats


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


class SourceFiles:
    """Read access to files by path (thread-safe). ``stats`` counts the bytes read, kernel copies included.

    Memory: none beyond the descriptors.
    """

    def __init__(self, stats: Optional[ReadStats] = None):
        self.stats = stats or ReadStats()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

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
        fd, done, nbytes = self.fd(path), 0, target.nbytes
        while done < nbytes:
            n = os.preadv(fd, [target[done:]], offset + done)
            if n <= 0:
                raise IncompleteCheckpointError("unexpected end of file (the file shrank or is truncated)",
                                                path=path, hint="copy the file again or use another tag")
            done += n
        self.count(nbytes)

    def count(self, nbytes: int) -> None:
        """Account for bytes read outside :meth:`read_into` (copies inside the kernel)."""
        self.stats.add(nbytes)
        GLOBAL_STATS.add(nbytes)

    def drop_cache(self, path: str, offset: int, nbytes: int) -> None:
        """Tell the kernel these bytes are not needed in the page cache any more."""
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
