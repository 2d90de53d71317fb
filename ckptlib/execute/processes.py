"""Writing a plan's units in worker processes: each one receives the pickled plan and its share of units.

Processes are started with ``spawn`` (nothing of the parent is inherited but the plan), report bytes
written and read, and the CRC-32s of the spans they read (:class:`~ckptlib.io.crc.CrcLedger`), through a
queue, and are terminated if the run is cancelled or one fails.
Memory: ``plan.predicted_peak_bytes`` in each process (plus its interpreter).
"""
from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path
from typing import Any, Optional

from ..errors import CkptError
from ..io.crc import CrcLedger, source_files
from ..io.streaming import load_cast_kernels
from ..plan import Plan
from ..progress import Observer, check_cancel
from .writers import (WriteContext, assign, drops_source_pages, drops_written_pages, needs_cast_kernels, units,
                      unsynced_budget, write_unit)

REPORT_EVERY = 8 * 2**20


def _worker_main(plan: Plan, tmp: str, work: list, q) -> None:
    try:
        ledger = CrcLedger(plan.crc) if plan.crc else None
        files = source_files(ledger, drop=drops_source_pages(plan))
        pending = [0]

        def progress(n: int) -> None:
            pending[0] += n
            if pending[0] >= REPORT_EVERY:
                q.put(("bytes", pending[0]))
                pending[0] = 0

        if needs_cast_kernels(plan):
            load_cast_kernels()
        ctx = WriteContext(plan.chunk_bytes, files, progress, unsynced=unsynced_budget(plan, plan.workers),
                           drop_written=drops_written_pages(plan))
        for u in work:
            write_unit(plan, u, Path(tmp), ctx)
        ctx.close()
        q.put(("bytes", pending[0]))
        q.put(("read", files.stats.bytes_read))
        if ledger is not None:
            q.put(("crc", ledger.spans))
        files.close()
        q.put(("done", None))
    except BaseException as e:  # report, never hang the parent
        q.put(("error", str(e) if isinstance(e, CkptError) else f"{type(e).__name__}: {e}"))


def write_in_processes(plan: Plan, tmp: Path, observer: Observer, cancel: Any,
                       ledger: Optional[CrcLedger] = None) -> int:
    """Write the plan's units in ``plan.workers`` processes; returns the bytes they read. The CRC-32s of the spans
    they read go to ``ledger``."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    bins = [b for b in assign(units(plan, split=True), plan.workers) if b]
    procs = [ctx.Process(target=_worker_main, args=(plan, str(tmp), b, q), daemon=True) for b in bins]
    for p in procs:
        p.start()
    done, written, read = 0, 0, 0
    try:
        while done < len(procs):
            check_cancel(cancel)
            try:
                kind, value = q.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise CkptError(f"a writing process died (exit code {dead[0].exitcode})", path=plan.out)
                continue
            if kind == "bytes":
                written += value
                observer.on_bytes(written, plan.write_bytes)
            elif kind == "read":
                read += value
            elif kind == "crc":
                if ledger is not None:
                    ledger.add(value)
            elif kind == "done":
                done += 1
            else:
                raise CkptError(f"a writing process failed: {value}", path=plan.out)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    return read


__all__ = ["write_in_processes"]
