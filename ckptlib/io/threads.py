"""The threads a streaming run may add beside its writing threads, and the room each needs.

- :func:`thread_room`: whether there is memory for one more thread (its stack and Python's state), checked
  before a read-ahead or cast thread starts;
- :class:`CastHelper`: one thread per process that takes pieces of a cast beside the writing thread, so a
  cast runs on two cores (:func:`ckptlib.io.castcopy.cast_pieces`).
"""
from __future__ import annotations

import os
import threading
from typing import Optional

#: what a new thread takes beyond its stack (Python's thread state, locks, the first frames)
THREAD_EXTRA_BYTES = 4 * 2**20


def thread_room() -> None:
    """Raise ``MemoryError`` unless there is room (``ulimit -d``, cgroup, machine) for one more thread: its
    stack (``ulimit -s``) and :data:`THREAD_EXTRA_BYTES`. A thread that gets its stack but then fails to
    allocate inside Python's own start-up leaves ``Thread.start()`` waiting for ever; this check turns that
    case, at the memory floor, into the run's one-line out-of-memory error."""
    import resource

    from ..system.memory import system_memory

    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = 8 * 2**20 if stack == resource.RLIM_INFINITY or stack <= 0 else stack
    if system_memory().headroom < stack + THREAD_EXTRA_BYTES:
        raise MemoryError("no room for the read-ahead thread")


_HELPER_LOCK = threading.Lock()


class CastHelper:
    """One thread per process that reads, casts and writes pieces of a chunk beside the writing thread
    (:func:`~ckptlib.io.castcopy.cast_pieces`), with a scratch of its own, so a run's casts use two cores
    (numpy releases the GIL in the kernels, the reads and writes release it too). It serves one chunk at a
    time (``lock``): a writing thread that finds it busy does all of its chunk itself, so several writing
    threads never queue behind it. Made on first use when the process may run on two cores or more and there is room for a thread
    (:func:`thread_room`); else there is none and casts stay in one thread.

    Memory: a thread (its stack) and a cast scratch (:class:`~ckptlib.io.casting.Scratch`), once per process."""

    _made = False
    _helper: Optional["CastHelper"] = None

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        from .casting import Scratch

        self.lock = threading.Lock()
        self.scratch = Scratch()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckptlib-cast")

    @classmethod
    def get(cls) -> Optional["CastHelper"]:
        with _HELPER_LOCK:
            if not cls._made:
                cls._made = True
                cls._helper = cls._make()
        return cls._helper

    @classmethod
    def _make(cls) -> Optional["CastHelper"]:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        if cores < 2 or os.environ.get("CKPTLIB_CAST_THREADS", "2") == "1":
            return None
        try:
            thread_room()
        except MemoryError:
            return None
        return cls()


__all__ = ["THREAD_EXTRA_BYTES", "thread_room", "CastHelper"]
