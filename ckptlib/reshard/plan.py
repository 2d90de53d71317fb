"""Planning a reshard of a ZeRO-1/2/3 checkpoint for another data-parallel size (metadata only)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional, Union

from ..deepspeed import NO_ZERO, Checkpoint, open_checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.exactness import replica_checks, require_exact
from ..errors import CkptError, UnsupportedCheckpointError
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..plan import CopyFile, Plan, TextFile
from ..system.gcpause import gc_paused
from ..units import human_bytes
from .trees import TreeFiles, batch_note, client_files, converter_scripts
from .zero3 import Zero3Resharder
from .zero12 import Zero12Resharder


def default_workers() -> int:
    """Two writing threads where there are two cores or more: one file's reads and CRCs overlap the
    other's writes (the work is mostly in the kernel and zlib, outside the GIL)."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@dataclass(kw_only=True)
class ReshardPlan(Plan):
    """What a reshard will write, computed from metadata (plain data). See :func:`plan_reshard`."""

    action: ClassVar[str] = "reshard"
    world_size: int

    def feeds(self) -> dict:
        """``{target rank: [source ranks whose bytes it reads]}``."""
        return {f.rank: f.source_ranks for f in self.files if f.kind == "optim_states"}

    def to_dict(self) -> dict:
        src = self.source
        return {
            "source": src.tag_dir, "out": str(self.out), "tag": src.tag,
            "zero_stage": src.zero_stage, "from_world_size": src.partition_count, "to_world_size": self.world_size,
            "files": [{"name": f.name, "kind": f.kind, "rank": f.rank, "source_ranks": f.source_ranks,
                       "read_bytes": f.read_bytes, "write_bytes": f.write_bytes, "bytes": f.size} for f in self.files],
            "feeds": {str(k): v for k, v in self.feeds().items()},
            "read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "file_bytes": self.file_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes, "sync": self.sync, "notes": list(self.notes),
        }

    def describe(self) -> str:
        src = self.source
        lines = [f"reshard {src.tag_dir}", f"     -> {self.out}/{src.tag}",
                 f"ZeRO {src.zero_stage} ({src.flavor}), {src.dtype}: {src.partition_count} -> {self.world_size} "
                 "data-parallel ranks", *self.summary_lines(), "no temporary files", "target rank <- source ranks:"]
        for r, ranks in self.feeds().items():
            lines.append(f"  {r:>4} <- {', '.join(map(str, ranks))}")
        width = max(len(f.name) for f in self.files)
        for f in self.files:
            lines.append(f"  {f.name:<{width}} {human_bytes(f.size):>10}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@gc_paused
def plan_reshard(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike], world_size: int, *,
                 tag: Optional[str] = None, overwrite: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: Optional[int] = None, tp_rules=None,
                 hf_files: bool = True, sync: bool = True, verify_crc: bool = False) -> ReshardPlan:
    """Plan rewriting a ZeRO-1/2/3 checkpoint for ``world_size`` data-parallel ranks (metadata only).

    A pipeline or tensor-parallel checkpoint keeps its stages and tensor ranks: each one's ZeRO set is
    re-sliced for the new data-parallel size, its layer files are copied.

    The target holds, for every target rank, the fp32 partition and every per-element optimizer state
    re-sliced with the new padding, with ``group_paddings``, ``partition_count``, ``param_slice_mappings``
    (and ZeRO-3 sub-groups, ``param_shapes`` and frozen fragments) recomputed, and everything else
    carried over; ``engine.load_checkpoint`` at ``world_size`` ranks accepts it. ``workers`` files
    are written at a time (default: 2 on machines with 2 cores or more).

    ``hf_files``: carry over the HF Trainer / Accelerate files beside the checkpoint byte for byte
    (``trainer_state.json``, ``scheduler.pt``, ``training_args.bin``, the 16-bit ``model.safetensors``,
    config and tokenizer, ``scheduler.bin``, ...) with the RNG states of the ranks that exist at the new
    size, so that ``Trainer.train(resume_from_checkpoint=out)`` or ``accelerator.load_state(out)`` resumes
    from ``out`` as it is; the plan's notes say what was carried and what happens for new ranks.

    ``sync``: put the output on disk before it appears under its name (default); False leaves the
    writing to the kernel after the run (as DeepSpeed's own saving does; see :class:`~ckptlib.plan.Plan`).

    ``verify_crc``: verify the CRC-32 of every zip member of the tag folder's torch files before writing
    (one more read of the checkpoint; a mismatch is refused, naming the file and member).

    Memory: the plan (object trees whose tensors are range lists, not read yet).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag, tp_rules=tp_rules)
    require_exact(ck)  # the validation export and the universal checkpoint run too
    if world_size < 1:
        raise CkptError("the target world size must be at least 1")
    refuse_unsupported(ck)
    tag_name = ck.location.tag
    files: list = []
    notes: list = []
    trees = TreeFiles()  # the target files' common parts are converted and sized once
    for zs in ck.sets.values():  # one ZeRO set per stage or tensor rank: each re-sliced on its own
        resharder = Zero3Resharder(zs, world_size) if zs.zero_stage == 3 else Zero12Resharder(zs, world_size)
        notes += [n for n in resharder.notes if n not in notes]
        for name, obj in resharder.model_states().items():
            rank = fnames.classify(name).dp_rank
            files.append(trees.make(f"{tag_name}/{name}", "model_states", obj, rank))
        for r in range(world_size):
            name, obj = resharder.optim_states(r)
            files.append(trees.make(f"{tag_name}/{name}", "optim_states", obj, r, resharder.feeds(r)))
    for f in ck.files:
        if f.kind not in (fnames.MODEL_STATES, fnames.OPTIM_STATES, fnames.SWAP):
            files.append(CopyFile(f"{tag_name}/{f.path.name}", os.fspath(f.path), f.bytes))
    if any(f.kind == fnames.SWAP for f in ck.files):
        notes.append("NVMe offload: the partitions kept in offloaded_tensors/ are written into the .pt files; the "
                     "target has no swap files, so load it with offload_optimizer on cpu or none (DeepSpeed's "
                     "NVMe load reads offloaded_tensors/ instead of the .pt files; see docs/resume.md)")
    for script in converter_scripts(ck):
        files.append(CopyFile(Path(script).name, script, os.path.getsize(script)))
    if hf_files:
        carried, carried_notes = client_files(ck, world_size)
        files += carried
        notes += carried_notes
    note = batch_note(ck, world_size)
    notes += [note] if note else []
    return ReshardPlan(source=ck.source_ref(), out=Path(out).expanduser().resolve(), world_size=world_size,
                       files=files, finals=[TextFile("latest", tag_name, kind="latest")], folders=[tag_name],
                       chunk_bytes=chunk_bytes, overwrite=overwrite, sync=sync, notes=notes,
                       workers=workers or default_workers(), checks=replica_checks(ck),
                       crc=every_entry(ck) if verify_crc else [])


def every_entry(ck: Checkpoint) -> list:
    """Every zip member of every torch file of the tag folder (what ``--verify-crc`` verifies for a reshard,
    which reads or copies all of them)."""
    return [e for entries in ck.zip_entries(every=True).values() for e in entries]


def refuse_unsupported(ck: Checkpoint) -> None:
    """Checkpoints a reshard (direct or universal) does not apply to, or cannot rewrite yet, each with the reason."""
    where = ck.location.tag_dir
    if ck.flavor == NO_ZERO:
        raise UnsupportedCheckpointError(
            "this checkpoint has no ZeRO partitioning (stage 0): DeepSpeed loads it at any data-parallel size "
            "as it is", path=where, hint="no reshard is needed")
    if ck.num_experts:
        raise UnsupportedCheckpointError(
            "resharding a mixture-of-experts checkpoint is not supported yet (its expert groups are partitioned "
            "over the expert-data-parallel ranks, which change with the world size)", path=where,
            hint="`ckpt export` writes its full model (every expert under its global id)")
    if ck.kind == "pipeline" and ck.zero_stage == 0:
        raise UnsupportedCheckpointError(
            "a ZeRO-0 pipeline checkpoint with BF16_Optimizer: DeepSpeed 0.19.8 cannot load these even at the size "
            "they were saved with (KeyError: 0 in BF16_Optimizer._load_legacy_checkpoint)", path=where,
            hint="`ckpt export` writes its full model; train with ZeRO-1 to make checkpoints that reshard")


__all__ = ["ReshardPlan", "plan_reshard", "default_workers", "refuse_unsupported", "every_entry"]
