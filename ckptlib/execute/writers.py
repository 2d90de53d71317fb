"""Writing the files of a plan into the (temporary) output folder, one unit at a time.

A *unit* is the smallest piece of a plan that can be written on its own: one tensor of a safetensors
file (its offset is known from the header), one item of a DCP ``.distcp`` file (its offset is fixed by
the plan), or one whole torch, copied or small binary file. A merge's :class:`~ckptlib.plan.MergedTensor`
is computed whole (:mod:`ckptlib.io.lora_merge`) and then written; an average's
:class:`~ckptlib.plan.AveragedTensor` chunk by chunk (:mod:`ckptlib.io.averaging`). Writers read the
plan's source ranges through a :class:`~ckptlib.io.sources.SourceFiles` and stream them through the
calling thread's buffers (:class:`WriteContext`).
"""
from __future__ import annotations

import collections
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..io.averaging import averaged_spec, write_averaged
from ..io.dcp import write_item
from ..io.sinks import PwriteSink, UnsyncedBudget, WriteBehind, preallocate, pwrite_all
from ..io.sources import SourceFiles
from ..io.stformat import SafetensorsLayout, TensorSpec
from ..io.streaming import ChunkBuffers, copy_file, copy_ranges
from ..io.torchzip.specs import NewTensor
from ..io.torchzip.trees import walk_tensors
from ..io.torchzip.writer import save as torch_save
from ..layout.ranges import StoredRange
from ..plan import AveragedTensor, BlobFile, CopyFile, DistcpFile, MergedTensor, Plan, TextFile, TreeFile, WeightsFile
from ..progress import Observer, check_cancel
from ..system.memory import system_memory


@dataclass(frozen=True)
class Unit:
    """File ``file`` of the plan: its tensor ``tensor`` (safetensors), or all of it (``tensor`` None)."""

    file: int
    tensor: Optional[int]
    nbytes: int


class WriteContext:
    """What writers need while a run goes on: the source files, one set of buffers per thread (made on
    first use, released by :meth:`close`), progress (thread-safe; totals only go up), cancellation, for a
    run that does not sync, the bytes it may leave to the kernel (:func:`unsynced_budget`), and whether the
    output's pages leave the page cache once on disk (:func:`drops_written_pages`)."""

    def __init__(self, chunk_bytes: int, files: SourceFiles, progress: Callable[[int], None] = lambda n: None,
                 cancel: Any = None, observer: Optional[Observer] = None, unsynced: Optional[UnsyncedBudget] = None,
                 drop_written: bool = True):
        self.chunk_bytes, self.files, self.progress = chunk_bytes, files, progress
        self.cancel = cancel
        self.unsynced = unsynced
        self.drop_written = drop_written
        self.observer = observer or Observer()
        self._local = threading.local()
        self._made: list[ChunkBuffers] = []
        self._lock = threading.Lock()

    def write_behind(self, fd: int) -> WriteBehind:
        """The write-behind of an output file open as ``fd``, under this run's budget and page-cache rule."""
        return WriteBehind(fd, unsynced=self.unsynced, drop=self.drop_written)

    @property
    def bufs(self) -> ChunkBuffers:
        b = getattr(self._local, "bufs", None)
        if b is None:
            b = self._local.bufs = ChunkBuffers(self.chunk_bytes)
            with self._lock:
                self._made.append(b)
        return b

    def close(self) -> None:
        """Release every thread's buffers."""
        with self._lock:
            made, self._made = self._made, []
        for b in made:
            b.close()
        self._local = threading.local()


def kernel_writeback_threshold() -> int:
    """Bytes of dirty page cache the kernel lets pile up before it starts writing back on its own: Linux
    ``vm.dirty_background_bytes``, or ``vm.dirty_background_ratio`` percent of the available memory (in a
    memory cgroup, of what it still allows, where the kernel throttles too); 256 MiB where that cannot be
    read. Reads a few small files under ``/proc`` and ``/sys/fs/cgroup`` (:func:`ckptlib.system.memory.system_memory`)."""
    def read(path: str) -> int:
        with open(path) as f:
            return int(f.read().split()[0])

    try:
        fixed = read("/proc/sys/vm/dirty_background_bytes")
        ratio = read("/proc/sys/vm/dirty_background_ratio")
    except (OSError, ValueError, IndexError):
        return 256 * 2**20
    room = page_cache_room()
    return min(fixed, room) if fixed > 0 else room * ratio // 100


def page_cache_room() -> int:
    """The memory available to the page cache: the machine's available memory, or what a memory cgroup still
    allows where that is less (:func:`ckptlib.system.memory.system_memory`)."""
    mem = system_memory()
    room = mem.available
    if mem.cgroup_limit is not None:
        room = min(room, max(0, mem.cgroup_limit - (mem.cgroup_usage or 0)))
    return room


#: a run drops the source pages it has read (the output pages it has written) from the page cache when it
#: reads (writes) more than this share of the memory available to the page cache (:func:`drops_source_pages`,
#: :func:`drops_written_pages`)
DROP_SHARE = 4


def drops_source_pages(plan: Plan) -> bool:
    """Whether a run of ``plan`` drops source pages from the page cache once it has read them: when it reads
    more than a quarter (:data:`DROP_SHARE`) of the memory available to the page cache
    (:func:`page_cache_room`; the whole plan's reads, whatever the number of writing processes sharing them),
    so that a checkpoint larger than the machine does not push everything else out. A smaller read leaves
    its pages to the kernel, which evicts them when it needs the room: dropping costs CPU (0.1-0.3 s per GB
    read on the 2-core machine of ``bench/``), and the next run on the same checkpoint finds it cached.
    Reads a few small files under ``/proc``."""
    return plan.read_bytes > page_cache_room() // DROP_SHARE


def drops_written_pages(plan: Plan) -> bool:
    """Whether a run of ``plan`` drops its output's pages from the page cache once they are on disk
    (:class:`~ckptlib.io.sinks.WriteBehind`): by the rule of :func:`drops_source_pages`, on the bytes it
    writes. Below it the written pages stay, clean, for the kernel to evict, as ``cp`` leaves them: dropping
    them is done on the writing thread, while the cast helper waits (0.07 s of a 0.48 s bf16 export of 1 GB
    of masters on the machine of ``bench/``). Reads a few small files under ``/proc``."""
    return plan.write_bytes > page_cache_room() // DROP_SHARE


def unsynced_budget(plan: Plan, writers: int = 1) -> Optional[UnsyncedBudget]:
    """None for a plan that syncs its output; else one writing process's share (of ``writers``) of what
    the kernel keeps dirty before it starts writing back by itself (so that, below it, the disk is left
    alone while the run reads). Reads two small files under ``/proc``."""
    if plan.sync:
        return None
    return UnsyncedBudget(kernel_writeback_threshold() // max(1, writers))


def safetensors_layout(f: WeightsFile) -> SafetensorsLayout:
    return SafetensorsLayout([TensorSpec(t.name, t.dtype, t.shape) for t in f.tensors], f.metadata)


def prepare(plan: Plan, tmp: Path) -> None:
    """Make the plan's folders, every file's parent folder, and each safetensors and DCP file with its
    header and final size (so its tensors can then be written in any order, by any process), its data's
    disk blocks reserved where the file system can (:func:`~ckptlib.io.sinks.preallocate`; a full disk is
    found here, before any data is written)."""
    for folder in plan.folders:
        (tmp / folder).mkdir(parents=True, exist_ok=True)
    for f in plan.files:
        path = tmp / f.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(f, WeightsFile) and f.format == "safetensors":
            layout = safetensors_layout(f)
            layout.create(path)
            with open(path, "r+b") as fh:
                preallocate(fh.fileno(), layout.data_start, layout.file_size - layout.data_start)
        elif isinstance(f, DistcpFile):
            with open(path, "wb") as fh:
                fh.truncate(f.size)
                preallocate(fh.fileno(), 0, f.size)


def units(plan: Plan, split: bool = False) -> list[Unit]:
    """The plan's units in plan order: each file whole, or with ``split`` (writers in several processes)
    each tensor of a safetensors file on its own (its bytes have a fixed place in the file)."""
    out = []
    for i, f in enumerate(plan.files):
        if split and isinstance(f, WeightsFile) and f.format == "safetensors":
            out += [Unit(i, k, t.nbytes) for k, t in enumerate(f.tensors)]
        elif split and isinstance(f, DistcpFile):
            out += [Unit(i, k, it.nbytes) for k, it in enumerate(f.items)]
        else:
            out.append(Unit(i, None, f.write_bytes))
    return out


def assign(work: list[Unit], bins: int) -> list[list[Unit]]:
    """Greedy balance of units over ``bins`` writers by bytes (largest first)."""
    loads = [0] * bins
    out: list[list[Unit]] = [[] for _ in range(bins)]
    for u in sorted(work, key=lambda u: -u.nbytes):
        i = loads.index(min(loads))
        out[i].append(u)
        loads[i] += u.nbytes
    return out


def write_unit(plan: Plan, unit: Unit, tmp: Path, ctx: WriteContext) -> None:
    """Write one unit into ``tmp`` (the plan's folders and safetensors headers must exist)."""
    check_cancel(ctx.cancel)
    f = plan.files[unit.file]
    path = tmp / f.name
    if unit.tensor is None or unit.tensor == 0:
        ctx.observer.on_file(f.name)
    if isinstance(f, WeightsFile) and f.format == "safetensors":
        _write_safetensors(f, [unit.tensor] if unit.tensor is not None else range(len(f.tensors)), path, ctx)
    elif isinstance(f, WeightsFile):
        if any(isinstance(t, MergedTensor) for t in f.tensors):
            raise TypeError(f"{f.name}: a merged tensor is written in safetensors only")
        for t in f.tensors:
            ctx.observer.on_tensor(t.name)
        tree = collections.OrderedDict((t.name, averaged_spec(t) if isinstance(t, AveragedTensor) else
                                        NewTensor(t.dtype, t.shape, t.ranges)) for t in f.tensors)
        torch_save(tree, path, archive=Path(f.name).name.split(".")[0], progress=ctx.progress, bufs=ctx.bufs,
                   files=ctx.files, cancel=ctx.cancel, unsynced=ctx.unsynced, drop_written=ctx.drop_written)
    elif isinstance(f, TreeFile):
        torch_save(f.obj, path, progress=ctx.progress, bufs=ctx.bufs, files=ctx.files, cancel=ctx.cancel,
                   unsynced=ctx.unsynced, drop_written=ctx.drop_written)
    elif isinstance(f, DistcpFile):
        _write_distcp(f, [unit.tensor] if unit.tensor is not None else range(len(f.items)), path, ctx)
    elif isinstance(f, BlobFile):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pwrite_all(fd, f.data, 0)
        finally:
            os.close(fd)
    elif isinstance(f, CopyFile):
        if getattr(ctx.files, "tracks", lambda p: False)(f.source):  # its zip members' CRC-32s checked as it streams
            _copy_checked(f, path, ctx)
        else:
            shutil.copy2(f.source, path)
            ctx.files.count(f.write_bytes)
            ctx.progress(f.write_bytes)
    else:
        raise TypeError(f"a plan cannot write a {type(f).__name__}")


def _write_safetensors(f: WeightsFile, which, path: Path, ctx: WriteContext) -> None:
    layout = safetensors_layout(f)
    fd = os.open(path, os.O_WRONLY)
    try:
        behind = ctx.write_behind(fd)  # written bytes go on to disk as the file grows
        for i in sorted(which, key=lambda i: layout.tensor_offset(f.tensors[i].name)):  # in file order
            t = f.tensors[i]
            ctx.observer.on_tensor(t.name)
            sink = PwriteSink(fd, layout.tensor_offset(t.name), behind=behind)
            if isinstance(t, MergedTensor):  # an adapter merged into its base: computed, then written
                from ..io.lora_merge import write_merged  # torch, only for a merge

                check_cancel(ctx.cancel)
                write_merged(t, sink, ctx.files, ctx.progress)
                continue
            if isinstance(t, AveragedTensor):  # an average of checkpoints: computed chunk by chunk as written
                write_averaged(t.terms, t.dtype, t.numel, sink, ctx.bufs, ctx.files, ctx.progress, ctx.cancel)
                continue
            copy_ranges(t.ranges, t.dtype, sink, ctx.bufs, ctx.files, ctx.progress, ctx.cancel)
        behind.close()
    finally:
        os.close(fd)


def _copy_checked(f: CopyFile, path: Path, ctx: WriteContext) -> None:
    """Copy ``f`` a chunk at a time (:func:`~ckptlib.io.streaming.copy_file`: every byte seen by the run's reader,
    which checks the CRC-32 of the zip members in it), then its mode and times, as ``shutil.copy2`` does."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        behind = ctx.write_behind(fd)
        copy_file(f.source, PwriteSink(fd, 0, behind=behind), f.write_bytes, ctx.bufs, ctx.files, ctx.progress,
                  ctx.cancel)
        behind.close()
    finally:
        os.close(fd)
    shutil.copystat(f.source, path)


def _write_distcp(f: DistcpFile, which, path: Path, ctx: WriteContext) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        behind = ctx.write_behind(fd)
        for i in which:
            it = f.items[i]
            ctx.observer.on_tensor(it.fqn)
            write_item(fd, it, progress=ctx.progress, bufs=ctx.bufs, files=ctx.files, cancel=ctx.cancel, behind=behind)
        behind.close()
    finally:
        os.close(fd)


def needs_cast_kernels(plan: Plan) -> bool:
    """Whether a run of ``plan`` casts (a tensor read from ranges of another dtype) or compares copies: then
    it needs numpy (:func:`ckptlib.io.streaming.load_cast_kernels`), which a run loads before it writes anything.
    Metadata only."""
    if plan.checks or plan.action == "average":  # an average's arithmetic is numpy's (ckptlib.io.averaging)
        return True

    def casts(ranges, dtype: str) -> bool:
        return any(isinstance(r, StoredRange) and r.dtype != dtype for r in ranges)

    for f in plan.files:
        if isinstance(f, WeightsFile) and any(casts(t.ranges, t.dtype) for t in f.tensors):
            return True
        if isinstance(f, DistcpFile) and any(it.is_tensor and casts(it.value.ranges, it.value.dtype) for it in f.items):
            return True
        if isinstance(f, TreeFile) and any(isinstance(t, NewTensor) and casts(t.ranges, t.dtype)
                                           for t in walk_tensors(f.obj, [])):
            return True
    return False


def write_finals(plan: Plan, tmp: Path) -> None:
    """The plan's text files, in order (``latest`` last of all, so it never names an unfinished tag)."""
    for f in plan.finals:
        if not isinstance(f, TextFile):
            raise TypeError(f"a plan's finals are text files, not {type(f).__name__}")
        (tmp / f.name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / f.name).write_text(f.text)


__all__ = ["Unit", "WriteContext", "unsynced_budget", "kernel_writeback_threshold", "page_cache_room",
           "drops_source_pages", "drops_written_pages", "DROP_SHARE", "safetensors_layout", "prepare", "units",
           "assign", "write_unit", "write_finals", "needs_cast_kernels"]
