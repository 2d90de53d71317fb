"""What older DeepSpeed releases wrote differently: the layouts refused (with the version found) and the
quirks of the ones read, named from the keys found (metadata only)."""
from __future__ import annotations

from typing import Optional

from ..dtypes import BY_SHORT
from ..errors import UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from .records import NO_ZERO, ZERO, FileInfo, Records
from .values import as_int


def version_tuple(v: Optional[str]) -> Optional[tuple]:
    """``"0.10.3"`` -> ``(0, 10, 3)``; ``"0.16.9+abc"`` -> ``(0, 16, 9)``; None if it does not parse."""
    if not v:
        return None
    parts = []
    for piece in str(v).split("+")[0].split(".")[:3]:
        digits = piece[:len(piece) - len(piece.lstrip("0123456789"))]  # leading digits: "0rc1" -> "0"
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


def written_by(version: Optional[str]) -> str:
    """"DeepSpeed 0.10.3", or what is known when the files record no version."""
    if version:
        return f"DeepSpeed {version}"
    return "a DeepSpeed release that recorded no ds_version (older than 0.4)"


def refuse_old_layouts(version: Optional[str], model: dict, optim_files: list[FileInfo], optim_objs: list,
                       first_optim: Optional[dict]) -> None:
    """Refuse, naming the version found, the layouts of DeepSpeed before 0.6 that ckptlib cannot read.

    ``optim_objs`` are the top-level objects of ``optim_files`` (None where a file could not be read).
    """
    by = written_by(version)
    if isinstance(first_optim, dict) and "local_sub_partitions_of_fp32_groups" in first_optim:
        raise UnsupportedCheckpointError(
            f"written by {by}: legacy ZeRO-1 optimizer state ('local_sub_partitions_of_fp32_groups', "
            "the interleaved sub-partitions of zero_optimization.legacy_stage1, removed in DeepSpeed 0.5.9) "
            "is not supported",
            path=optim_files[0].path,
            hint=f"load it with {by} at the same world size and save the fp32 weights from there "
                 "(legacy ZeRO-1 checkpoints cannot be loaded by later DeepSpeed releases either)")
    if model.get("param_shapes") is None:
        for f, obj in zip(optim_files, optim_objs):
            if isinstance(obj, dict) and "param_shapes" in obj:
                raise UnsupportedCheckpointError(
                    f"written by {by}: the parameter shapes are in the optimizer-state files "
                    "('param_shapes' at their top level), the layout of DeepSpeed before 0.6; checkpoints "
                    "from before 0.6 are not supported",
                    path=f.path,
                    hint="use the zero_to_fp32.py saved beside the tag folder, with the DeepSpeed release that "
                         "wrote it, to get the fp32 weights")


def find_quirks(rec: Records, model: dict) -> list[str]:
    """How this checkpoint differs from what DeepSpeed 0.19.8 writes, one short phrase each (and the
    problems of elastic optimizer state, appended to ``rec.problems``)."""
    q: list[str] = []
    version = version_tuple(rec.deepspeed_version)
    optim = rec.index.optim
    if version is not None and version < (0, 10):
        q.append("older than the DeepSpeed releases ckptlib is tested with (0.10.3 to 0.19.8)")
    if rec.flavor != NO_ZERO and optim:
        osd = optim[min(optim)]
        if rec.flavor == ZERO and rec.zero_stage in (1, 2):
            if "param_alignment_paddings" not in osd:
                q.append("no param_alignment_paddings")
            if "group_paddings" not in osd:
                q.append("no group_paddings")
            if isinstance(osd.get("base_optimizer_state"), (list, tuple)):
                q.append("elastic optimizer state (base_optimizer_state is a list of unpadded per-group "
                         "states, saved with elastic_checkpoint: true): read and export only")
                rec.problems += elastic_problems(rec)
        step = rec.optimizer.step if rec.optimizer else None
        gsteps, skipped = as_int(model.get("global_steps")), as_int(model.get("skipped_steps")) or 0
        if step is not None and gsteps is not None and step == gsteps - skipped + 1:
            q.append(f"optimizer step {step} = global_steps + 1 (the optimizer's initialising step on zero "
                     "gradients is counted)")
    if "sparse_tensor_module_names" in model:
        q.append("sparse_tensor_module_names present")
    if "checkpoint_parallel_dimensions" not in model and version is not None and version < (0, 19, 5):
        q.append("no checkpoint_parallel_dimensions")
    if rec.dtype in ("bf16", "fp16"):
        half = [b.name for b in rec.buffers if BY_SHORT[rec.dtype].name == b.dtype]
        if half:
            q.append(f"float buffers saved in {rec.dtype} ({', '.join(half)}), cast with the module")
    if rec.ties_from_storage:
        q.append("shared_params not recorded: ties found from the module's shared storage ("
                 + ", ".join(f"{a} -> {o}" for a, o in rec.ties_from_storage.items()) + ")")
    return q


def elastic_problems(rec: Records) -> list[str]:
    """Elastic ZeRO-1/2 state: per rank, one dict per group of tensors as long as the lean fp32 partition."""
    out = []
    for rank, osd in sorted(rec.index.optim.items()):
        r = rank.dp
        base = osd.get("base_optimizer_state")
        if not isinstance(base, (list, tuple)) or len(base) != len(rec.layouts):
            out.append(f"rank {r}: the elastic base_optimizer_state has "
                       f"{len(base) if isinstance(base, (list, tuple)) else 'no'} groups, "
                       f"param_shapes has {len(rec.layouts)}")
            continue
        for g, (st, lay) in enumerate(zip(base, rec.layouts)):
            for k, t in (st.items() if isinstance(st, dict) else []):
                if k != "step" and isinstance(t, TensorHandle) and t.numel != lay.lean_length(r):
                    out.append(f"rank {r} group {g}: elastic state '{k}' holds {t.numel} elements, "
                               f"{lay.lean_length(r)} are expected")
    return out


__all__ = ["version_tuple", "written_by", "refuse_old_layouts", "find_quirks", "elastic_problems"]
