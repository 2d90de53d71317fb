"""Where streamed bytes go: output files written with ``pwrite`` at known offsets, going on to disk as
they grow (:class:`WriteBehind`), and copies between files inside the kernel (:func:`kernel_copy`).

Memory: none beyond the bytes handed in.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import os
import sys
import threading
from typing import Optional

from .torchzip.zipfmt import crc32_combine
from .crc32 import crc32

# write(2) in pieces of this size: on the machine measured, writing 3.5 GiB into the page cache in
# 16 MiB calls took 3.7x the system time of 1 MiB calls (bench/write_path.py; the run is in the git history
# of docs/benchmarks.md)
WRITE_SLICE = 2**20


def _linux_call(name: str, *argtypes):
    """The libc function ``name`` (an int-returning system call wrapper) with ``argtypes``, or None off Linux or
    where this libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:  # the symbols already loaded into the process (libc among them); find_library would spawn ldconfig
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _linux_call("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_fallocate = _linux_call("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4
#: what fallocate(2) answers where the file system cannot reserve blocks: the file then stays sparse
_CANNOT_PREALLOCATE = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.EPERM}


def preallocate(fd: int, offset: int, nbytes: int) -> bool:
    """Reserve the disk blocks of bytes ``[offset, offset + nbytes)`` of an output file before they are
    written (Linux ``fallocate(2)``, mode 0: they read as zeros until written, and the file is at least that
    long). Writing into reserved blocks skips the file system's block reservation page by page (ext4's
    delayed allocation): on the machine of ``bench/``, 512 MiB of ``pwrite`` took 0.06-0.07 s of CPU instead of
    0.10-0.11 s, the ``fsync`` after it no longer. Returns whether the blocks were reserved; where the file
    system cannot (or off Linux) nothing happens and the file stays as it was (glibc's ``posix_fallocate``
    would write zeros instead: never used).

    Raises:
        OSError: the disk is full (``ENOSPC``) or another failure: before anything is written.
    """
    if _fallocate is None or nbytes <= 0:
        return False
    if _fallocate(fd, 0, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in _CANNOT_PREALLOCATE:
        return False
    raise OSError(err, os.strerror(err))


class UnsyncedBudget:
    """How many written bytes a run that does not sync (``Plan.sync`` False) may leave in the page cache
    for the kernel to write after it has ended; thread-safe, shared by the run's files. Once spent,
    further writes go to disk as they are made (:class:`WriteBehind`), so a large output never piles
    up more dirty pages than this."""

    def __init__(self, nbytes: int):
        self.left = max(0, nbytes)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` of the budget if that much is left; False (nothing spent) if not."""
        with self._lock:
            if nbytes > self.left:
                self.left = 0  # from now on everything goes write-behind: no gaps in the written runs
                return False
            self.left -= nbytes
            return True


#: a run that syncs flushes its output file in the background every this many write-behind windows (128 MiB)
FLUSH_EVERY = 8


class WriteBehind:
    """Writes an output file's dirty pages to disk as it grows and then, with ``drop``, drops them from the
    page cache.

    Every ``window`` bytes written in a row are handed to the disk at once (Linux ``sync_file_range``);
    once ``lag`` more windows are in flight, the oldest is waited for, and with ``drop`` its (now clean)
    pages are released (``posix_fadvise(DONTNEED)``). A multi-GB output then never fills the page cache with
    dirty pages, so the kernel neither throttles the writer nor starts bulk writeback in the middle
    of the run, and the final ``fsync`` has little left to do; with ``drop`` the page cache the file takes
    stays about ``(lag + 1) * window`` (144 MiB by default; enough in flight for high-latency storage).
    Without, the clean pages stay for the kernel to evict when it needs the room, as after ``cp``: dropping
    them costs CPU on the writing thread (``execute.writers.drops_written_pages`` says when a run does). On
    the 2-core VM of ``bench/`` writing 3.5 GiB took 1.6 s instead of 3.4 s without it (both with
    ``fsync``; ``bench/write_path.py``). Elsewhere it degrades to ``posix_fadvise`` alone, or to
    nothing. ``CKPTLIB_WRITE_BEHIND=0`` in the environment turns it off (plain buffered writes).

    With an ``unsynced`` budget (a run that does not sync its output), bytes are left to the kernel
    while the budget lasts: an output smaller than it is never waited for.

    A window that fills is handed over at the next :meth:`catch_up`, or when the window after it fills,
    whichever comes first (at most one window waits): a writer with a helper thread calls ``catch_up`` once
    the helper is busy (:func:`~ckptlib.io.castcopy.cast_pieces`), so the system calls that start the writing
    (the file system allocates the blocks then) and wait for old windows run beside the helper's casts
    instead of between them, while it idles. Every call is made by the thread that writes the file.

    A run that syncs (no budget) also has the file flushed (``fdatasync``) in a background thread every
    :data:`FLUSH_EVERY` windows, one flush at a time: a virtual disk may keep written blocks in its own cache
    until it is told to flush, and the run's final ``fsync`` then waits for all of them (0.7 s of 512 MiB
    on the project's machine, whatever the write-behind did); flushed as the file grows, that time passes
    beside the copying. A flush that fails is raised by :meth:`close` (its error would otherwise be taken
    from the file's error state and the final ``fsync`` could pass).
    """

    def __init__(self, fd: int, window: int = 16 * 2**20, lag: int = 8, unsynced: Optional[UnsyncedBudget] = None,
                 drop: bool = True):
        self.fd, self.window, self.lag, self.drop = fd, window, lag, drop
        self.enabled = os.environ.get("CKPTLIB_WRITE_BEHIND", "1") != "0"
        self.unsynced = unsynced
        self._run: Optional[list] = None  # [start, end) of the bytes written in a row, not handed over yet
        self._due: Optional[tuple] = None  # a full window, handed over at the next catch_up
        self._flight: collections.deque = collections.deque()
        self._released = 0
        self._flusher: Optional[threading.Thread] = None
        self._flush_error: Optional[OSError] = None

    def wrote(self, offset: int, nbytes: int) -> None:
        if nbytes <= 0 or not self.enabled:
            return
        if self.unsynced is not None and self.unsynced.take(nbytes):
            return
        if self._run is not None and self._run[1] == offset:
            self._run[1] += nbytes
        else:
            self._hand_over()
            self._run = [offset, offset + nbytes]
        if self._run[1] - self._run[0] >= self.window:
            self.catch_up()  # the window before, if still waiting
            self._due, self._run = tuple(self._run), None

    def catch_up(self) -> None:
        """Hand over the full window that waits, if one does (and wait for the oldest beyond ``lag``)."""
        if self._due is not None:
            start, end = self._due
            self._due = None
            self._start(start, end)

    def _hand_over(self) -> None:
        self.catch_up()
        if self._run is None:
            return
        start, end = self._run
        self._run = None
        self._start(start, end)

    def _start(self, start: int, end: int) -> None:
        if _sync_file_range is not None:
            _sync_file_range(self.fd, start, end - start, _SFR_WRITE)
        self._flight.append((start, end))
        while len(self._flight) > self.lag:
            self._release(*self._flight.popleft())

    def _release(self, start: int, end: int) -> None:
        if _sync_file_range is not None:
            _sync_file_range(self.fd, start, end - start, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
        if self.drop and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        self._released += 1
        if self.unsynced is None and self._released % FLUSH_EVERY == 0:
            self._flush_behind()

    def _flush_behind(self) -> None:
        """Start an ``fdatasync`` of the file in a thread of its own (on a duplicate descriptor, so closing
        the file never races it), unless one is still running or there is no room for a thread."""
        if self._flusher is not None and self._flusher.is_alive():
            return
        from .threads import thread_room

        try:
            thread_room()
            fd = os.dup(self.fd)
        except (MemoryError, OSError):
            return

        def flush() -> None:
            try:
                os.fdatasync(fd)
            except OSError as e:
                self._flush_error = e
            finally:
                os.close(fd)

        self._flusher = threading.Thread(target=flush, name="ckptlib-flush", daemon=True)
        self._flusher.start()

    def close(self) -> None:
        """Hand over and release everything still pending (the data is then on its way to disk); wait for a
        background flush and raise its error."""
        self._hand_over()
        while self._flight:
            self._release(*self._flight.popleft())
        if self._flusher is not None:
            self._flusher.join()
            self._flusher = None
        if self._flush_error is not None:
            raise self._flush_error


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
            self.crc = crc32_combine(self.crc, crc32(mv) if crc is None else crc, mv.nbytes)
        if self.behind is not None:
            self.behind.wrote(self.offset, mv.nbytes)
        self.offset += mv.nbytes

    __call__ = write

    def put(self, at: int, data) -> None:
        """Write ``data`` ``at`` bytes past the end written so far, which stays where it is: threads may fill
        a stretch in any order (``pwrite`` is positional); :meth:`advance` then takes the stretch in."""
        pwrite_all(self.fd, data, self.offset + at)

    def advance(self, nbytes: int, crc: Optional[int] = None) -> None:
        """Take in the ``nbytes`` that :meth:`put` wrote past the end (``crc``: their CRC-32, for a sink
        that keeps one): the write-behind and the CRC go on as after :meth:`write`."""
        if self.takes_crc:
            self.crc = crc32_combine(self.crc, crc, nbytes)
        if self.behind is not None:
            self.behind.wrote(self.offset, nbytes)
        self.offset += nbytes

    def catch_up(self) -> None:
        """The write-behind's hand-over that waits, if any (:meth:`WriteBehind.catch_up`)."""
        if self.behind is not None:
            self.behind.catch_up()

    def copy_from(self, src_fd: int, src_offset: int, nbytes: int) -> None:
        if self.takes_crc:
            raise RuntimeError("a CRC-keeping sink cannot copy inside the kernel")
        kernel_copy(src_fd, src_offset, self.fd, self.offset, nbytes)
        if self.behind is not None:
            self.behind.wrote(self.offset, nbytes)
        self.offset += nbytes


__all__ = ["WriteBehind", "UnsyncedBudget", "PwriteSink", "pwrite_all", "kernel_copy", "preallocate", "WRITE_SLICE"]
