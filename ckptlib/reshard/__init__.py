"""Reshard a ZeRO-1/2/3 checkpoint for another data-parallel size: plan from metadata, then stream.

    plan = plan_reshard("ckpt", "ckpt_dp2", world_size=2)   # metadata only
    print(plan.describe())
    reshard(plan)                                          # DeepSpeed then loads "ckpt_dp2" at 2 ranks
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..deepspeed import Checkpoint, open_checkpoint
from ..deepspeed.checkpoint import NO_ZERO
from ..errors import CkptError, UnsupportedCheckpointError
from ..memory import measure_memory
from ..progress import Observer
from ..streaming import DEFAULT_CHUNK_BYTES
from ..summary import human_bytes
from ..torchzip.writer import NewTensor
from .build import StreamContext, TargetPlan, Zero3Resharder, Zero12Resharder
from .write import default_workers, write_plan



@dataclass
class TargetFile:
    """One file the reshard writes (``name`` relative to the output folder)."""

    name: str
    kind: str                     # "model_states", "optim_states" or "copy"
    rank: Optional[int]
    source_ranks: list
    read_bytes: int
    write_bytes: int
    obj: Any = field(default=None, repr=False)       # the object tree to write (None for copies)
    source: Optional[Path] = None                     # the file copied (kind "copy")


@dataclass(kw_only=True)
class ReshardPlan(TargetPlan):
    """What a reshard will write, computed from metadata. See :func:`plan_reshard`."""

    world_size: int

    def feeds(self) -> dict:
        """``{target rank: [source ranks whose bytes it reads]}``."""
        return {f.rank: f.source_ranks for f in self.files if f.kind == "optim_states"}

    def to_dict(self) -> dict:
        ck = self.checkpoint
        return {
            "source": str(ck.location.tag_dir), "out": str(self.out), "tag": ck.location.tag,
            "zero_stage": ck.zero_stage, "from_world_size": ck.partition_count, "to_world_size": self.world_size,
            "files": [{"name": f.name, "kind": f.kind, "rank": f.rank, "source_ranks": f.source_ranks,
                       "read_bytes": f.read_bytes, "write_bytes": f.write_bytes} for f in self.files],
            "feeds": {str(k): v for k, v in self.feeds().items()},
            "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes, "notes": list(self.notes),
        }

    def describe(self) -> str:
        ck = self.checkpoint
        lines = [f"reshard {ck.location.tag_dir}", f"     -> {self.out}/{ck.location.tag}",
                 f"ZeRO {ck.zero_stage} ({ck.flavor}), {ck.dtype}: {ck.partition_count} -> {self.world_size} "
                 "data-parallel ranks",
                 f"reads {human_bytes(self.read_bytes)} of {human_bytes(ck.total_bytes)}; writes "
                 f"{human_bytes(self.write_bytes)} in {len(self.files)} files; no temporary files",
                 f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} ({self.workers} writing "
                 "thread(s), 3 streaming buffers each; independent of the model size)", "target rank <- source ranks:"]
        for r, src in self.feeds().items():
            lines.append(f"  {r:>4} <- {', '.join(map(str, src))}")
        for f in self.files:
            lines.append(f"  {f.name:<60} {human_bytes(f.write_bytes):>10}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.describe())


def _tree_bytes(obj: Any) -> tuple[int, int]:
    """(bytes read, bytes written) for an object tree: new tensors stream their ranges, storages are copied."""
    from ..torchzip.writer import _walk_tensors

    tensors: list = []
    _walk_tensors(obj, tensors)
    read = written = 0
    seen = set()
    for t in tensors:
        if isinstance(t, NewTensor):
            read += getattr(t, "read_bytes", 0)
            written += t.nbytes
        elif id(t.storage) not in seen:
            seen.add(id(t.storage))
            read += t.storage.nbytes
            written += t.storage.nbytes
    return read, written


def plan_reshard(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike], world_size: int, *,
                 tag: Optional[str] = None, overwrite: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: Optional[int] = None) -> ReshardPlan:
    """Plan rewriting a ZeRO-1/2/3 checkpoint for ``world_size`` data-parallel ranks (metadata only).

    The target holds, for every target rank, the fp32 partition and every per-element optimizer state
    re-sliced with the new padding, with ``group_paddings``, ``partition_count``, ``param_slice_mappings``
    (and ZeRO-3 sub-groups, ``param_shapes`` and frozen fragments) recomputed, and everything else
    carried over; ``engine.load_checkpoint`` at ``world_size`` ranks accepts it. ``workers`` files
    are written at a time (default: 2 on machines with 2 cores or more).

    Memory: the plan (object trees whose tensors are not read yet).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag)
    ck._require_readable()
    if world_size < 1:
        raise CkptError("the target world size must be at least 1")
    if ck.flavor == NO_ZERO:
        raise UnsupportedCheckpointError(
            "this checkpoint has no ZeRO partitioning (stage 0): DeepSpeed loads it at any data-parallel size "
            "as it is", path=ck.location.tag_dir, hint="no reshard is needed")
    resharder = Zero3Resharder(ck, world_size) if ck.zero_stage == 3 else Zero12Resharder(ck, world_size)
    ctx = StreamContext()
    tag_name = ck.location.tag
    files: list[TargetFile] = []
    for name, obj in resharder.model_states(ctx).items():
        rank = int(name.split("_")[3]) if name.startswith("zero_pp_rank_") else None
        read, written = _tree_bytes(obj)
        files.append(TargetFile(f"{tag_name}/{name}", "model_states", rank, [], read, written, obj))
    for r in range(world_size):
        name, obj = resharder.optim_states(r, ctx)
        read, written = _tree_bytes(obj)
        files.append(TargetFile(f"{tag_name}/{name}", "optim_states", r, resharder.feeds(r), read, written, obj))
    for f in ck.files:
        if f.kind not in ("model_states", "optim_states"):
            files.append(TargetFile(f"{tag_name}/{f.path.name}", "copy", None, [], f.bytes, f.bytes, source=f.path))
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        p = ck.location.save_dir / script
        if p.is_file():
            size = p.stat().st_size
            files.append(TargetFile(script, "copy", None, [], size, size, source=p))
    plan = ReshardPlan(checkpoint=ck, out=Path(out).expanduser().resolve(), world_size=world_size, files=files,
                       chunk_bytes=chunk_bytes, overwrite=overwrite, notes=list(resharder.notes),
                       workers=workers or default_workers(), _ctx=ctx)
    return plan


@dataclass
class ReshardResult:
    out: Path
    files: list
    seconds: float
    bytes_read: int
    bytes_written: int
    plan: Optional[ReshardPlan] = field(default=None, repr=False)


@measure_memory  # the result carries result.memory (ckptlib.memory.MemoryReport)
def reshard(checkpoint: Union[Checkpoint, str, os.PathLike, ReshardPlan], out: Union[str, os.PathLike, None] = None,
            world_size: Optional[int] = None, *, observer: Optional[Observer] = None,
            cancel: Optional[threading.Event] = None, **options) -> ReshardResult:
    """Write the resharded checkpoint (``latest``, the tag folder, the converter scripts) into ``out``.

    Every target file is made by reading only the source byte ranges it needs, streamed through
    buffers of ``chunk_bytes`` (three per writing thread, ``plan.workers`` threads); there are no
    temporary files. Memory: ``plan.predicted_peak_bytes`` (about 104 MiB with the defaults) whatever
    the model size. The output appears atomically; the source is only read.
    """
    plan = checkpoint if isinstance(checkpoint, ReshardPlan) else plan_reshard(checkpoint, out, world_size, **options)
    observer = observer or Observer()
    ck = plan.checkpoint
    seconds, read = write_plan(plan, observer, cancel, ck.location.tag, ("latest", ck.location.tag))
    result = ReshardResult(out=plan.out, files=[(f.name, f.write_bytes) for f in plan.files],
                           seconds=seconds, bytes_read=read, bytes_written=plan.write_bytes, plan=plan)
    observer.on_finish(result)
    return result


from .universal import UniversalPlan, UniversalResult, plan_universal, write_universal  # noqa: E402

__all__ = ["plan_reshard", "reshard", "ReshardPlan", "ReshardResult", "TargetFile", "plan_universal",
           "write_universal", "UniversalPlan", "UniversalResult"]
