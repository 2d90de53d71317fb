"""Running a plan under ``torchrun``: every rank writes a disjoint share of the units, rank 0 finishes.

Each rank makes the same plan from metadata (or receives it). Rank 0 checks the source, creates the
temporary output folder and the safetensors headers and tells the others where it is; every rank
writes the units :func:`~ckptlib.execute.writers.assign` gives it; rank 0 writes the text finals and
renames the folder into place once every rank reported success, or removes it if any failed. The
output folder must be on a file system all ranks share. Uses ``torch.distributed`` with whatever
backend is initialised (gloo if ckptlib initialises it).

Memory per rank: ``plan.predicted_peak_bytes``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from ..errors import CkptError
from ..memory import watch_memory
from ..output import AtomicOutputDir
from ..plan import Plan
from ..progress import Observer
from ..sources import check_unchanged
from .runner import RunResult, compare_copies, finished, write_in_threads
from .writers import assign, prepare, units, write_finals


def run_distributed(plan: Plan, observer: Optional[Observer] = None, cancel: Any = None) -> RunResult:
    """Execute ``plan`` cooperatively on all ranks of the default process group; returns the result
    on every rank (``bytes_read`` summed over the ranks; ``memory`` is this rank's)."""
    import torch.distributed as dist

    own_group = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        own_group = True
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        observer = observer if (observer is not None and rank == 0) else Observer()
        t0 = time.perf_counter()
        with watch_memory() as watch:
            observer.on_start(plan)
            atomic, msg = None, [None]
            if rank == 0:
                try:
                    check_unchanged(plan.source.stamps)
                    compare_copies(plan, cancel)
                    atomic = AtomicOutputDir(plan.out, source=plan.source.save_dir, overwrite=plan.overwrite)
                    tmp = atomic.__enter__()
                    prepare(plan, tmp)
                    msg = [("ok", str(tmp))]
                except BaseException as e:  # tell the others before raising
                    if atomic is not None and atomic.tmp is not None:
                        atomic.__exit__(type(e), e, None)
                    msg = [("error", str(e))]
            dist.broadcast_object_list(msg, src=0)
            if msg[0][0] == "error":
                raise CkptError(f"rank 0 could not prepare the output: {msg[0][1]}", path=plan.out)
            tmp = Path(msg[0][1])
            error, read = None, 0
            try:
                read = write_in_threads(plan, assign(units(plan, split=True), world)[rank], tmp, observer, cancel, 1)
            except BaseException as e:
                error = f"rank {rank}: {e}"
            errors: list = [None] * world
            dist.all_gather_object(errors, error)
            failed = [e for e in errors if e]
            final: list = [None]
            if rank == 0:
                try:
                    if failed:
                        atomic.__exit__(CkptError, CkptError("; ".join(failed)), None)
                        final = [("error", "; ".join(failed))]
                    else:
                        write_finals(plan, tmp)
                        atomic.__exit__(None, None, None)
                        final = [("ok", None)]
                except BaseException as e:
                    final = [("error", str(e))]
            dist.broadcast_object_list(final, src=0)
            if final[0][0] == "error":
                err = CkptError(f"distributed {plan.action} failed, nothing was created: {final[0][1]}", path=plan.out)
                observer.on_error(err)
                raise err
            reads = [0] * world
            dist.all_gather_object(reads, read)
        result = finished(plan, time.perf_counter() - t0, sum(reads), watch.report)
        observer.on_finish(result)
        return result
    finally:
        if own_group:
            dist.destroy_process_group()


__all__ = ["run_distributed"]
