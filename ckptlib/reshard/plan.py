"""Planning a reshard of a ZeRO-1/2/3 checkpoint for another data-parallel size (metadata only)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional, Union

from ..deepspeed import BF16_OPTIMIZER, NO_ZERO, Checkpoint, SplitRules, load_rules, open_checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.exactness import replica_checks, require_exact, value_proofs
from ..errors import CkptError, UnsupportedCheckpointError
from ..io.crc import attach_crc
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..kinds.optimizers import UNKNOWN
from ..mesh import Mesh
from ..plan import CopyFile, Plan, TextFile
from ..system.gcpause import gc_paused
from ..units import human_bytes, parse_size
from .autoep import plan_autoep_files
from .autoep_universal import plan_autoep_from_universal
from .moe_from_universal import plan_moe_from_universal
from .footprint import footprint, state_bytes
from .from_universal import refuse_for_native
from .mesh_plan import plan_mesh_files
from .moe import plan_moe_files
from .trees import TreeFiles, batch_note, carried, client_files, converter_scripts
from .zero3 import Zero3Resharder
from .zero12 import Zero12Resharder


def default_workers() -> int:
    """Two writing threads where there are two cores or more: one file's reads and CRCs overlap the
    other's writes (the work is mostly in the kernel and zlib, outside the GIL)."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@dataclass(kw_only=True, repr=False)  # Plan's repr and IPython display (its description)
class ReshardPlan(Plan):
    """What a reshard will write, computed from metadata (plain data). See :func:`plan_reshard`."""

    action: ClassVar[str] = "reshard"
    world_size: int
    from_mesh: Optional[Mesh] = None   # the source's and the target's sizes when tp or pp change
    to_mesh: Optional[Mesh] = None
    footprints: list = field(default_factory=list)  # per target set: RankFootprint (model states per rank)
    gpu_memory: Optional[int] = None   # what one GPU holds, to compare the footprints with
    state_keys: tuple = ()             # the optimizer's per-element state keys the footprints count

    def memory_lines(self) -> list[str]:
        """Each target set's training memory per rank, beside the GPU size given."""
        if not self.footprints:
            return []
        states = f"the optimizer's {', '.join(self.state_keys)}" if self.state_keys else "Adam's moments (assumed)"
        out = ["training memory per rank at the new mesh (model states only: 16-bit weights, gradients, the master "
               f"and {states}; activations and buffers come on top):"]
        for f in self.footprints:
            fits = ""
            if self.gpu_memory:
                share = f.total / self.gpu_memory
                fits = f"  {share:5.1%} of {human_bytes(self.gpu_memory)}" + ("  DOES NOT FIT" if share > 1 else "")
            out.append(f"  stage {f.stage} tensor rank {f.tp}: {f.numel:,} parameters; weights "
                       f"{human_bytes(f.weights)}, gradients {human_bytes(f.gradients)}, optimizer "
                       f"{human_bytes(f.optimizer)} = {human_bytes(f.total)}{fits}")
        return out

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
            **({"from_mesh": vars(self.from_mesh), "to_mesh": vars(self.to_mesh)} if self.to_mesh else {}),
            "training_memory_per_rank": [dict(vars(f), total=f.total) for f in self.footprints],
            "gpu_memory": self.gpu_memory,
        }

    def describe(self) -> str:
        src = self.source
        lines = [f"reshard {src.tag_dir}", f"     -> {self.out}/{src.tag}"]
        if self.to_mesh is not None:
            a, b = self.from_mesh, self.to_mesh
            lines += [f"ZeRO {src.zero_stage} ({src.flavor}), {src.dtype}: mesh pp={a.pp} tp={a.tp} dp={a.dp} -> "
                      f"pp={b.pp} tp={b.tp} dp={b.dp} ({b.pp * b.tp * b.dp} ranks)", *self.summary_lines(),
                      "no temporary files", *self.memory_lines()]
        else:
            lines += [f"ZeRO {src.zero_stage} ({src.flavor}), {src.dtype}: {src.partition_count} -> {self.world_size} "
                      "data-parallel ranks", *self.summary_lines(), "no temporary files", "target rank <- source ranks:"]
            for r, ranks in self.feeds().items():
                lines.append(f"  {r:>4} <- {', '.join(map(str, ranks))}")
            lines += self.memory_lines()
        width = max(len(f.name) for f in self.files)
        for f in self.files:
            lines.append(f"  {f.name:<{width}} {human_bytes(f.size):>10}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


@gc_paused
def plan_reshard(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike],
                 world_size: Optional[int] = None, *, tp: Optional[int] = None, pp: Optional[int] = None,
                 ep: Optional[int] = None, pp_partition: Optional[str] = None, pp_layers: Optional[int] = None,
                 pp_tied: Optional[dict] = None, tag: Optional[str] = None, overwrite: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: Optional[int] = None, tp_rules=None,
                 hf_files: bool = True, sync: bool = True, gpu_memory=None, verify_crc: bool = True,
                 model_config=None) -> ReshardPlan:
    """Plan rewriting a ZeRO-1/2/3 checkpoint for ``world_size`` data-parallel ranks (metadata only), and
    for ``tp`` tensor-parallel ranks and ``pp`` pipeline stages (unnamed sizes are kept).

    Keeping stages and tensor ranks, each one's ZeRO set is re-sliced for the new data-parallel size and the
    layer files are copied. Changing ``tp`` or ``pp`` (:mod:`ckptlib.reshard.mesh_plan`) writes every file of
    the new mesh from the full model: tensors cut again by the split rules (the source's, or ``tp_rules``),
    layers spread over the new stages as the ``PipelineModule`` would (``pp_partition``: ``"uniform"``,
    ``"parameters"`` or the boundaries ``"0,4,7"``; ``pp_layers``: the number of layer specs; ``pp_tied``:
    ``{tie key: [every layer using it]}``, for what the checkpoint does not show).

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
    ``gpu_memory`` (bytes, or ``"80GB"``): the plan compares each rank's training memory at the new mesh
    (model states, :mod:`ckptlib.reshard.footprint`) with it.

    ``model_config``: an AutoTP checkpoint's HF model config (``config.json``, its folder, or the dict; default:
    the ``config.json`` beside the tag folders), which says how AutoTP cuts it at another tensor size above 1
    (:mod:`ckptlib.reshard.autotp`).

    ``verify_crc``: check the CRC-32 of every zip member the reshard reads (copied files included) as its bytes
    stream (default; a mismatch is refused, naming the file and member, and nothing is written; False: unchecked).

    Memory: the plan (object trees whose tensors are range lists, not read yet).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag, tp_rules=tp_rules)
    require_exact(ck)  # the validation export and the universal checkpoint run too
    refuse_unplaced_states(ck)
    world_size = ck.mesh.dp if world_size is None else world_size
    for what, size in (("data-parallel", world_size), ("tensor-parallel", tp), ("pipeline", pp), ("expert-parallel", ep)):
        if size is not None and size < 1:
            raise CkptError(f"the target {what} size must be at least 1")
    like = ck.universal.source_mesh if ck.universal is not None else ck.mesh  # a universal folder: its source's
    mesh = Mesh(dp=world_size, tp=tp or like.tp, pp=pp or like.pp, ep=ep or like.ep)
    gpu = parse_size(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
    if ck.universal is not None:
        refuse_for_native(ck, mesh)
    moe_universal = ck.universal is not None and ck.universal.experts == "DeepSpeed-MoE"
    if ck.records.autoep_layers or moe_universal:  # each ep rank's experts cut from the full weights
        if moe_universal:
            files, notes, tag_name = plan_moe_from_universal(ck, mesh, hf_files=hf_files)
        elif ck.universal is not None:
            files, notes, tag_name = plan_autoep_from_universal(ck, mesh, hf_files=hf_files)
        else:
            (files, notes), tag_name = plan_autoep_files(ck, mesh, hf_files=hf_files), ck.location.tag
        return with_crc(ck, verify_crc, ReshardPlan(
                           source=ck.source_ref(), out=Path(out).expanduser().resolve(), world_size=world_size,
                           files=files, finals=[TextFile("latest", tag_name, kind="latest")],
                           folders=[tag_name], chunk_bytes=chunk_bytes, overwrite=overwrite, sync=sync,
                           notes=notes + optimizer_notes(ck), checks=replica_checks(ck) + value_proofs(ck),
                           workers=workers or default_workers(), from_mesh=ck.mesh, to_mesh=mesh, gpu_memory=gpu))
    if ck.num_experts:  # experts regrouped for the new expert-parallel and data-parallel sizes
        if (mesh.tp, mesh.pp) != (ck.mesh.tp, ck.mesh.pp):
            raise UnsupportedCheckpointError("changing the tensor or pipeline size of a mixture-of-experts checkpoint "
                                             "is not supported yet", path=ck.location.tag_dir)
        files, notes, prints = plan_moe_files(ck, mesh, hf_files=hf_files)
        return with_crc(ck, verify_crc, ReshardPlan(
                           source=ck.source_ref(), out=Path(out).expanduser().resolve(), world_size=world_size,
                           files=files, finals=[TextFile("latest", ck.location.tag, kind="latest")],
                           folders=[ck.location.tag], chunk_bytes=chunk_bytes, overwrite=overwrite, sync=sync,
                           notes=notes, checks=replica_checks(ck), workers=workers or default_workers(),
                           from_mesh=ck.mesh, to_mesh=mesh, footprints=prints, gpu_memory=gpu,
                           state_keys=state_bytes(ck)[1]))
    if mesh.ep != ck.mesh.ep:
        raise UnsupportedCheckpointError("this checkpoint has no experts: there is no expert-parallel size to change",
                                         path=ck.location.tag_dir)
    if (mesh.tp, mesh.pp) != (ck.mesh.tp, ck.mesh.pp) or ck.universal is not None:
        given = tp_rules if isinstance(tp_rules, SplitRules) or tp_rules is None else load_rules(tp_rules)
        files, notes, checks, folders, prints = plan_mesh_files(
            ck, mesh, tp_rules=given or ck.tp_rules, pp_partition=pp_partition, pp_layers=pp_layers, pp_tied=pp_tied,
            hf_files=hf_files, model_config=model_config)
        return with_crc(ck, verify_crc, ReshardPlan(
                           source=ck.source_ref(), out=Path(out).expanduser().resolve(), world_size=world_size,
                           files=files, finals=[TextFile("latest", folders[0], kind="latest")], folders=folders,
                           chunk_bytes=chunk_bytes, overwrite=overwrite, sync=sync,
                           notes=notes + optimizer_notes(ck), checks=checks,
                           workers=workers or default_workers(), from_mesh=ck.mesh, to_mesh=mesh, footprints=prints,
                           gpu_memory=gpu, state_keys=state_bytes(ck)[1]))
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
            files.append(carried(f"{tag_name}/{f.path.name}", os.fspath(f.path), f.bytes))  # legacy: as zip
    if any(f.kind == fnames.SWAP for f in ck.files):
        notes.append("NVMe offload: the partitions kept in offloaded_tensors/ are written into the .pt files; the "
                     "target has no swap files, so load it with offload_optimizer on cpu or none (DeepSpeed's "
                     "NVMe load reads offloaded_tensors/ instead of the .pt files; see docs/resume.md)")
    for script in converter_scripts(ck):
        files.append(CopyFile(Path(script).name, script, os.path.getsize(script)))
    if hf_files:
        client, client_notes = client_files(ck, world_size)
        files += client
        notes += client_notes
    note = batch_note(ck, world_size)
    notes += [note] if note else []
    if world_size != ck.partition_count:
        notes += optimizer_notes(ck)
    per, keys = state_bytes(ck)
    prints = [footprint(sum(p.numel for p in zs.parameters if p.trainable and not p.tied_to), ck.dtype,
                        ck.zero_stage or 0, world_size, bf16_optimizer=ck.flavor == BF16_OPTIMIZER,
                        stage=zs.coordinate.pp, tp=zs.coordinate.tp, per_element=per) for zs in ck.sets.values()]
    return with_crc(ck, verify_crc, ReshardPlan(
                       footprints=prints, state_keys=keys, gpu_memory=gpu, from_mesh=ck.mesh, source=ck.source_ref(), out=Path(out).expanduser().resolve(), world_size=world_size,
                       files=files, finals=[TextFile("latest", tag_name, kind="latest")], folders=[tag_name],
                       chunk_bytes=chunk_bytes, overwrite=overwrite, sync=sync, notes=notes,
                       workers=workers or default_workers(), checks=replica_checks(ck)))


def with_crc(ck: Checkpoint, verify_crc: bool, plan: Plan) -> Plan:
    """``plan`` with the CRC-32 checks of what it reads (:func:`ckptlib.io.crc.attach_crc`; none without
    ``verify_crc``). Reads the zip directories of the files it copies whole that are not open yet."""
    return attach_crc(plan, ck.zip_entries() if verify_crc else None)


def refuse_unplaced_states(ck: Checkpoint) -> None:
    """Refuse an optimizer state a reshard cannot re-cut exactly: an optimizer ckptlib does not know (its state
    might not be per element: a blockwise-quantised one would be scattered), or a state key whose stored sizes fit
    no layout (:mod:`ckptlib.kinds.optimizers`), naming the group and the key."""
    for zs in ck.sets.values():
        opt = zs.optimizer
        for gs in opt.groups if opt else []:
            if gs.family is UNKNOWN and gs.keys:
                raise UnsupportedCheckpointError(
                    f"{gs.label} keeps {', '.join(gs.key_names)}: ckptlib does not know this optimizer, so it cannot "
                    "prove that re-cutting its state element by element is exact", path=ck.location.tag_dir,
                    hint="`ckpt export --states all` writes each per-element state as stored; please report the "
                         "optimizer")
        if opt and opt.state_problems:
            raise UnsupportedCheckpointError(
                "optimizer state that cannot be placed: " + "; ".join(map(str, opt.state_problems)),
                path=ck.location.tag_dir, hint="the files are damaged, or this optimizer's layout is not known to "
                                               "ckptlib; `ckpt check --states` names them")


def optimizer_notes(ck: Checkpoint) -> list[str]:
    """What the optimizer of ``ck`` cannot keep at another size although every value is exact (the vocabulary's
    ``reshard_note``: Adafactor's partition-wide norms), once per optimizer."""
    fams = {gs.family.name: gs.family for zs in ck.sets.values() if zs.optimizer for gs in zs.optimizer.groups}
    return [f"{f.label}: {f.reshard_note}" for f in fams.values() if f.reshard_note]


def refuse_unsupported(ck: Checkpoint) -> None:
    """Checkpoints a reshard (direct or universal) does not apply to, or cannot rewrite yet, each with the reason
    (mixture-of-experts checkpoints: :mod:`ckptlib.reshard.moe` and :mod:`ckptlib.reshard.moe_universal`)."""
    where = ck.location.tag_dir
    if ck.flavor == NO_ZERO:
        raise UnsupportedCheckpointError(
            "this checkpoint has no ZeRO partitioning (stage 0): DeepSpeed loads it at any data-parallel size "
            "as it is", path=where, hint="no reshard is needed")
    if ck.kind == "pipeline" and ck.zero_stage == 0:
        raise UnsupportedCheckpointError(
            "a ZeRO-0 pipeline checkpoint with BF16_Optimizer: DeepSpeed 0.19.8 cannot load these even at the size "
            "they were saved with (KeyError: 0 in BF16_Optimizer._load_legacy_checkpoint)", path=where,
            hint="`ckpt export` writes its full model; train with ZeRO-1 to make checkpoints that reshard")


__all__ = ["ReshardPlan", "plan_reshard", "default_workers", "refuse_unsupported", "refuse_unplaced_states",
           "optimizer_notes",
           "with_crc"]
