"""Writing the target files of a reshard or universal plan, a few at a time (shared by both).

Memory: each writing thread streams through its own buffers (:class:`~ckptlib.reshard.build.StreamContext`),
so ``workers * 3 * chunk_bytes`` plus the object trees of the plan.
"""
from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional

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
