"""Export under ``torchrun``: every rank writes a disjoint share of the output, rank 0 finishes.

Each rank makes the same plan from metadata. Rank 0 creates the temporary output folder and the
safetensors files (headers, final sizes) and tells the others where it is; then every rank writes the
units :func:`~ckptlib.export.run.assign` gives it (safetensors tensors at their offsets, or whole torch
files); rank 0 writes the index files and renames the folder into place once every rank reported
success, or removes it if any failed. The output folder must be on a file system all ranks share.
Uses ``torch.distributed`` with whatever backend is initialised (gloo if ckptlib initialises it).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Optional

from ..errors import CkptError
from ..output import AtomicOutputDir
from ..progress import Observer, check_cancel
from .plan import ExportPlan
from ..streaming import ChunkBuffers
from .run import ExportResult, assign, prepare_files, work_units, write_indexes, write_unit


def run_export_distributed(plan: ExportPlan, observer: Optional[Observer] = None,
                           cancel: Optional[threading.Event] = None) -> Optional[ExportResult]:
    """Execute ``plan`` cooperatively on all ranks of the default process group.

    Returns the result on every rank. Memory per rank: as for a single-process export.
    """
    import torch.distributed as dist

    own_group = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        own_group = True
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        observer = observer if (observer is not None and rank == 0) else Observer()
        ck = plan.checkpoint
        t0 = time.perf_counter()
        observer.on_start(plan)

        atomic = None
        msg: list = [None]
        if rank == 0:
            try:
                atomic = AtomicOutputDir(plan.out, source=ck.location.save_dir, overwrite=plan.overwrite)
                tmp = atomic.__enter__()
                prepare_files(plan, tmp)
                msg = [("ok", str(tmp))]
            except BaseException as e:  # tell the others before raising
                if atomic is not None and atomic.tmp is not None:
                    atomic.__exit__(type(e), e, None)
                msg = [("error", str(e))]
        dist.broadcast_object_list(msg, src=0)
        if msg[0][0] == "error":
            raise CkptError(f"rank 0 could not prepare the output: {msg[0][1]}")
        tmp = Path(msg[0][1])

        error = None
        written = [0]
        try:
            bufs = ChunkBuffers(plan.chunk_bytes)
            mine = assign(work_units(plan), world)[rank]

            def progress(n):
                written[0] += n
                observer.on_bytes(written[0], plan.write_bytes)

            for fi, tis, _ in mine:
                check_cancel(cancel)
                write_unit(ck, plan, tmp, fi, tis, bufs, progress, cancel)
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
                    write_indexes(plan, tmp)
                    atomic.__exit__(None, None, None)
                    final = [("ok", None)]
            except BaseException as e:
                final = [("error", str(e))]
        dist.broadcast_object_list(final, src=0)
        if final[0][0] == "error":
            err = CkptError(f"distributed export failed, nothing was created: {final[0][1]}", path=plan.out)
            observer.on_error(err)
            raise err
        read = [0] * world
        dist.all_gather_object(read, ck.stats.bytes_read)
        result = ExportResult(out=plan.out, files=[(f.name, f.nbytes) for f in plan.files],
                              seconds=time.perf_counter() - t0, bytes_read=sum(read),
                              bytes_written=plan.write_bytes, plan=plan)
        observer.on_finish(result)
        return result
    finally:
        if own_group:
            dist.destroy_process_group()
