"""Executing an :class:`~ckptlib.export.plan.ExportPlan`: streaming, atomic, observable, parallel.

Each output tensor is produced by reading its source ranges (see ``Checkpoint.sources``) in chunks of
``plan.chunk_bytes`` into reusable buffers, casting a chunk when the output dtype differs, and writing
it straight to the output file: safetensors files get their header first (from the plan) and the
tensor bytes ``pwrite``-n at known offsets; torch files are streamed record by record. No tensor is
ever held whole, so memory is bounded by the buffers (``plan.predicted_peak_bytes``), whatever the
model size. Reads use ``pread`` (no mmap), so no file-backed memory accumulates either.

Everything is written into a temporary sibling of the output folder that is renamed into place at the
end (:class:`~ckptlib.output.AtomicOutputDir`).
"""
from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..deepspeed import Checkpoint, open_checkpoint
from ..errors import CkptError
from ..memory import measure_memory
from ..output import AtomicOutputDir, reporting_failures
from ..progress import Observer, check_cancel
from ..streaming import ChunkBuffers, PwriteSink, WriteBehind, copy_ranges
from ..torchzip.writer import NewTensor
from ..torchzip.writer import save as torch_save
from .formats import SafetensorsLayout, TensorSpec
from .plan import ExportPlan, PlannedFile, PlannedTensor


@dataclass
class ExportResult:
    """What an export produced."""

    out: Path
    files: list                      # (name, bytes)
    seconds: float
    bytes_read: int
    bytes_written: int
    plan: Optional[ExportPlan] = field(default=None, repr=False)


def stream_tensor(ck: Checkpoint, t: PlannedTensor, sink, bufs: ChunkBuffers,
                  progress: Callable[[int], None] = lambda n: None, cancel: Optional[threading.Event] = None) -> None:
    """Write the bytes of one planned tensor into ``sink`` (see :func:`ckptlib.streaming.copy_ranges`)."""
    copy_ranges(ck.sources(t.source, t.key), t.dtype, sink, bufs, progress, cancel)


def _specs(f: PlannedFile) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.dtype, t.shape) for t in f.tensors]


def _st_metadata(plan: ExportPlan, f: PlannedFile) -> dict:
    meta = {"format": "pt"}
    key = f.tensors[0].key if f.tensors else None
    if key:
        meta["optimizer_state"] = key
        if plan.checkpoint.optimizer and plan.checkpoint.optimizer.step is not None:
            meta["step"] = str(plan.checkpoint.optimizer.step)
    return meta


def prepare_files(plan: ExportPlan, tmp: Path) -> None:
    """Create sub-folders and every safetensors file with its header and final size."""
    for f in plan.files:
        (tmp / f.name).parent.mkdir(parents=True, exist_ok=True)
        if plan.format == "safetensors":
            SafetensorsLayout(_specs(f), _st_metadata(plan, f)).create(tmp / f.name)


def write_unit(ck: Checkpoint, plan: ExportPlan, tmp: Path, file_index: int, tensor_indices: Optional[list],
               bufs: ChunkBuffers, progress: Callable[[int], None], cancel=None,
               observer: Optional[Observer] = None) -> None:
    """Write one unit of work: some tensors of a safetensors file (at their offsets), or a whole torch file."""
    f = plan.files[file_index]
    path = tmp / f.name
    if observer:
        observer.on_file(f.name)
    if plan.format == "safetensors":
        layout = SafetensorsLayout(_specs(f), _st_metadata(plan, f))
        fd = os.open(path, os.O_WRONLY)
        try:
            behind = WriteBehind(fd)  # written bytes go on to disk and leave the page cache as we go
            for i in (tensor_indices if tensor_indices is not None else range(len(f.tensors))):
                t = f.tensors[i]
                if observer:
                    observer.on_tensor(t.name)
                sink = PwriteSink(fd, layout.tensor_offset(t.name), behind=behind)
                stream_tensor(ck, t, sink, bufs, progress, cancel)
            behind.close()
        finally:
            os.close(fd)
    else:  # a torch zip file: one storage per tensor, each streamed in when the writer reaches it
        def producer(t):
            def produce(sink):
                if observer:
                    observer.on_tensor(t.name)
                stream_tensor(ck, t, sink, bufs, progress, cancel)
            return produce

        torch_save(collections.OrderedDict((t.name, NewTensor(t.dtype, t.shape, producer(t))) for t in f.tensors),
                   path, archive=Path(f.name).name.split(".")[0])


def work_units(plan: ExportPlan) -> list[tuple[int, Optional[list], int]]:
    """``(file index, tensor indices or None for the whole file, bytes)``: safetensors tensors can be
    written independently (known offsets), torch files only whole."""
    units = []
    for fi, f in enumerate(plan.files):
        if plan.format == "safetensors":
            units += [(fi, [ti], t.nbytes) for ti, t in enumerate(f.tensors)]
        else:
            units.append((fi, None, f.nbytes))
    return units


def assign(units: list, bins: int) -> list[list]:
    """Greedy balance of units over ``bins`` workers by bytes (largest first)."""
    loads = [0] * bins
    out: list[list] = [[] for _ in range(bins)]
    for u in sorted(units, key=lambda u: -u[2]):
        i = loads.index(min(loads))
        out[i].append(u)
        loads[i] += u[2]
    return out


def write_indexes(plan: ExportPlan, tmp: Path) -> None:
    for index_name, names in plan.index_files.items():
        files = [f for f in plan.files if f.name in names]
        weight_map = {t.name: Path(f.name).name for f in files for t in f.tensors}
        total = sum(f.nbytes for f in files)
        meta = {"total_size": total}
        key = files[0].tensors[0].key if files and files[0].tensors else None
        if key:
            meta["optimizer_state"] = key
        with open(tmp / index_name, "w") as fh:
            json.dump({"metadata": meta, "weight_map": weight_map}, fh, indent=2, sort_keys=True)
            fh.write("\n")


# ---------------------------------------------------------------------------------------------- workers
def _worker_main(ckpt_dir: str, tag: str, plan_state: dict, tmp: str, units: list, q) -> None:
    try:
        ck = open_checkpoint(ckpt_dir, tag=tag)
        plan = ExportPlan(checkpoint=ck, **plan_state)
        bufs = ChunkBuffers(plan.chunk_bytes)
        pending = [0]

        def progress(n):
            pending[0] += n
            if pending[0] >= 8 * 2**20:
                q.put(("bytes", pending[0]))
                pending[0] = 0

        for fi, tis, _ in units:
            write_unit(ck, plan, Path(tmp), fi, tis, bufs, progress)
        q.put(("bytes", pending[0]))
        q.put(("read", ck.stats.bytes_read))
        q.put(("done", None))
        ck.close()
    except BaseException as e:  # report, never hang the parent
        q.put(("error", f"{type(e).__name__}: {e}" if not isinstance(e, CkptError) else str(e)))


def _plan_state(plan: ExportPlan) -> dict:
    keys = ["out", "format", "dtype", "max_shard_size", "exclude_frozen", "states", "files", "index_files",
            "chunk_bytes", "workers", "overwrite", "warnings"]
    return {k: getattr(plan, k) for k in keys}


def _run_workers(plan: ExportPlan, tmp: Path, observer: Observer, cancel) -> int:
    """Run the units in ``plan.workers`` processes; returns the bytes they read."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    bins = [b for b in assign(work_units(plan), plan.workers) if b]
    loc = plan.checkpoint.location
    procs = [ctx.Process(target=_worker_main, args=(str(loc.save_dir), loc.tag, _plan_state(plan), str(tmp), b, q),
                         daemon=True) for b in bins]
    for p in procs:
        p.start()
    done, written, read, total = 0, 0, 0, plan.write_bytes
    try:
        while done < len(procs):
            check_cancel(cancel)
            try:
                kind, value = q.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise CkptError(f"an export worker died (exit code {dead[0].exitcode})")
                continue
            if kind == "bytes":
                written += value
                observer.on_bytes(written, total)
            elif kind == "read":
                read += value
            elif kind == "done":
                done += 1
            else:
                raise CkptError(f"an export worker failed: {value}")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    return read


# ---------------------------------------------------------------------------------------------- entry point
@measure_memory  # the result carries result.memory (ckptlib.memory.MemoryReport)
def run_export(plan: ExportPlan, observer: Optional[Observer] = None,
               cancel: Optional[threading.Event] = None) -> ExportResult:
    """Execute ``plan``. See :func:`ckptlib.export.export` for the contract."""
    observer = observer or Observer()
    ck = plan.checkpoint
    t0 = time.perf_counter()
    read0 = ck.stats.bytes_read
    worker_read = 0
    observer.on_start(plan)
    with reporting_failures(plan.out, observer):
        with AtomicOutputDir(plan.out, source=ck.location.save_dir, overwrite=plan.overwrite) as tmp:
            prepare_files(plan, tmp)
            if plan.workers > 1:
                worker_read = _run_workers(plan, tmp, observer, cancel)
            else:
                bufs = ChunkBuffers(plan.chunk_bytes)
                written = [0]
                total = plan.write_bytes

                def progress(n):
                    written[0] += n
                    observer.on_bytes(written[0], total)

                for fi in range(len(plan.files)):
                    write_unit(ck, plan, tmp, fi, None, bufs, progress, cancel, observer)
            write_indexes(plan, tmp)
            check_cancel(cancel)
    result = ExportResult(out=plan.out, files=[(f.name, f.nbytes) for f in plan.files],
                          seconds=time.perf_counter() - t0, bytes_read=ck.stats.bytes_read - read0 + worker_read,
                          bytes_written=plan.write_bytes, plan=plan)
    observer.on_finish(result)
    return result
