"""Writing the target files of a reshard or universal plan, a few at a time (shared by both).

Memory: each writing thread streams through its own buffers (:class:`~ckptlib.reshard.build.StreamContext`):
``plan.predicted_peak_bytes``.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional

from ..output import AtomicOutputDir, reporting_failures
from ..progress import Observer, check_cancel
from ..torchzip.writer import save as torch_save
from .build import StreamContext


def default_workers() -> int:
    """Two writing threads where there are two cores or more: one file's reads and CRCs overlap the
    other's writes (the work is mostly in the kernel and zlib, outside the GIL)."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


class _AnyOf:
    """Set when any of the events is (the user's cancel, or a failure in another writing thread)."""

    def __init__(self, *events):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def write_target_files(files: list, tmp: Path, ctx: StreamContext, observer: Observer, workers: int = 1,
                       cancel: Optional[threading.Event] = None) -> None:
    """Write ``files`` (plan entries with ``name``, ``kind``, ``obj``/``source``, ``write_bytes``) into
    ``tmp``, largest first, with ``workers`` threads. The first failure stops the other threads at
    their next chunk and is raised; ``cancel`` stops them all."""
    failed = threading.Event()
    ctx.cancel = _AnyOf(cancel, failed)

    def write_one(f) -> None:
        check_cancel(ctx.cancel)
        observer.on_file(f.name)
        dst = tmp / f.name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if f.kind == "copy":
            shutil.copy2(f.source, dst)
            ctx.progress(f.write_bytes)
        else:
            torch_save(f.obj, dst, progress=ctx.progress, bufs=ctx.bufs)

    try:
        if workers <= 1:
            for f in files:
                write_one(f)
            return
        order = sorted(files, key=lambda f: -f.write_bytes)
        with ThreadPoolExecutor(workers, thread_name_prefix="ckptlib-write") as pool:
            futures = [pool.submit(write_one, f) for f in order]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                for fut in futures:
                    if fut in done and fut.exception() is not None:
                        raise fut.exception()
            except BaseException:
                failed.set()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        ctx.cancel = cancel
        ctx.close()


def _progress_to(observer: Observer, total: int):
    """A thread-safe ``progress(nbytes)`` that reports the running total to ``observer``, in increasing
    order (the observer is called under the lock, so its totals never go back)."""
    done, lock = [0], threading.Lock()

    def progress(n: int) -> None:
        with lock:
            done[0] += n
            observer.on_bytes(done[0], total)

    return progress


def write_plan(plan, observer: Observer, cancel: Optional[threading.Event], folder: str,
               latest: tuple[str, str]) -> tuple[float, int]:
    """Write every file of a reshard or universal ``plan`` into ``plan.out`` atomically: ``folder`` is
    made first, the ``latest`` file (name, text) last. Returns (seconds, bytes read from the source)."""
    ck, ctx = plan.checkpoint, plan._ctx
    ctx.chunk_bytes = plan.chunk_bytes
    ctx.progress = _progress_to(observer, plan.write_bytes)
    t0 = time.perf_counter()
    read0 = ck.stats.bytes_read
    observer.on_start(plan)
    with reporting_failures(plan.out, observer):
        with AtomicOutputDir(plan.out, source=ck.location.save_dir, overwrite=plan.overwrite) as tmp:
            (tmp / folder).mkdir(parents=True)
            write_target_files(plan.files, tmp, ctx, observer, plan.workers, cancel)
            (tmp / latest[0]).write_text(latest[1])
    return time.perf_counter() - t0, ck.stats.bytes_read - read0
