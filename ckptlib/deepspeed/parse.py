"""Parsing the opened pickles of a tag folder into :class:`~ckptlib.deepspeed.records.Records`.

:func:`parse` reads only what opening the files unpickled (plus the optimizer's scalar step); it never
changes the unpickled trees. The stage-specific parts (ZeRO-1/2, ZeRO-3, stage 0) are in
:mod:`ckptlib.deepspeed.partitions`, the quirks and refusals of older releases in
:mod:`ckptlib.deepspeed.releases`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..dtypes import BY_NAME
from ..errors import IncompleteCheckpointError, NotACheckpointError, UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..mesh import Rank
from . import autoep
from . import files as fnames
from . import partitions
from .fileset import OpenedFiles
from .moe import expert_file_problems, expert_file_tensors, is_moe, with_experts
from .records import BF16_OPTIMIZER, NO_ZERO, ZERO, BufferInfo, OptimizerInfo, Records
from .releases import find_quirks, refuse_old_layouts, written_by
from .stage0 import build_stage0
from .states import group_states, stage0_states
from .values import as_int, as_str, get, plain


def parse(fs: OpenedFiles, notes: list, problems: list, mp: int = 0, module: Optional[dict] = None,
          shared: Optional[dict] = None, coordinate: Rank = Rank()) -> Records:
    """The records of model-parallel rank ``mp``'s ZeRO set in the tag folder ``fs`` opens; ``notes`` and
    ``problems`` are the lists to fill. ``module`` replaces the model-states file's ``module`` (a pipeline
    stage's, from its layer files; an MoE model's, with its experts), ``shared`` its ``shared_params``
    (the ties tensor rank 0 records, for every tensor rank). ``coordinate`` is the set's place in the
    mesh (its data ranks' files are keyed ``coordinate`` with their ``dp``).

    Raises:
        NotACheckpointError: no readable model-states file, or not DeepSpeed's.
        UnsupportedCheckpointError: a layout ckptlib refuses (older releases, unknown optimizer).
        IncompleteCheckpointError: no optimizer-state file can be read.
    """
    rec = Records(files=fs.files, notes=notes, problems=problems)
    model_files, optim_files = fs.of(fnames.MODEL_STATES, mp), fs.of(fnames.OPTIM_STATES, mp)
    if not model_files:
        raise NotACheckpointError("no model-states file (*_model_states.pt) in the tag folder",
                                  path=fs.location.tag_dir,
                                  hint="the save is incomplete, or this is not a DeepSpeed tag folder")
    model = _model_states(fs, model_files[0])
    if module is not None or shared is not None:  # a copy: the unpickled tree is never changed
        model = dict(model, **({"module": module} if module is not None else {}),
                     **({"shared_params": shared} if shared is not None else {}))
    rec.deepspeed_version = as_str(model.get("ds_version"))
    rec.dp_world_size = as_int(model.get("dp_world_size"))
    rec.mp_world_size = as_int(model.get("mp_world_size")) or 1
    rec.ds_config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
    rec.index.module = model.get("module") if isinstance(model.get("module"), dict) else {}
    layers = rec.autoep_layers = autoep.layers_of(model)
    if layers and module is None:  # AutoEP: stacked experts, their per-expert files checked
        problems += autoep.expert_file_problems(fs, layers)
    elif is_moe(fs, model) and module is None:  # the experts' 16-bit weights, under their global ids
        rec.index.module = with_experts(rec.index.module, expert_file_tensors(fs))
        model = dict(model, module=rec.index.module)
        problems += expert_file_problems(fs, model)

    optim_objs = [getattr(fs.get(f), "obj", None) for f in optim_files]
    first_optim: Optional[dict] = None
    for f, obj in zip(optim_files, optim_objs):
        if obj is None or f.dp_rank is None:
            continue
        osd = get(obj, "optimizer_state_dict")
        if isinstance(osd, dict):
            rec.index.optim[dataclasses.replace(coordinate, dp=f.dp_rank)] = osd
            first_optim = first_optim or osd
        else:
            problems.append(f"{f.relpath}: no 'optimizer_state_dict' in the optimizer file")
    if rec.deepspeed_version is None:  # DeepSpeed >= 0.4 also writes it at the optimizer files' top level
        rec.deepspeed_version = next((as_str(o.get("ds_version")) for o in optim_objs
                                      if isinstance(o, dict) and o.get("ds_version") is not None), None)
    refuse_old_layouts(rec.deepspeed_version, model, optim_files, optim_objs, first_optim)
    _stage_and_flavor(rec, fs, optim_files, first_optim)
    rec.dtype = _training_dtype(rec, model)
    if rec.flavor == NO_ZERO:
        build_stage0(rec, model, _expert_optimizers(fs))
    elif rec.zero_stage == 3:
        partitions.build_zero3(rec, fs, model, model_files, optim_files)
    else:
        partitions.build_zero12(rec, model, model_files[0], optim_files)
    rec.buffers = _buffers(model, rec.index.module)
    rec.optimizer = _optimizer(rec, model)
    rec.quirks = find_quirks(rec, model)
    if rec.quirks:
        notes.append(f"written by {written_by(rec.deepspeed_version)}: " + "; ".join(rec.quirks))
    return rec


# ---------------------------------------------------------------------------------------------- pieces
def _expert_optimizers(fs: OpenedFiles) -> dict:
    """ZeRO-0 MoE: each expert-parallel rank's whole optimizer state (``expp_rank_{e}`` files)."""
    out = {}
    for f in fs.files:
        if f.kind == fnames.EXPERT_OPTIM_STATES and f.dp_rank is not None:
            tf = fs.get(f)
            opt = get(tf.obj, "optimizer") if tf is not None else None
            if isinstance(opt, dict):
                out[f.dp_rank] = opt
    return out


def _model_states(fs: OpenedFiles, first) -> dict:
    mf = fs.get(first)
    if mf is None:
        cause = fs.error(first)
        raise type(cause)(f"the model-states file cannot be read: {cause.message}", path=first.path,
                          hint=cause.hint or "restore this file from a copy, or use another tag (--tag)")
    model = mf.obj
    if not isinstance(model, dict) or "module" not in model:
        raise NotACheckpointError("this model-states file has no 'module' entry: not a DeepSpeed checkpoint",
                                  path=first.path)
    return model


def _stage_and_flavor(rec: Records, fs: OpenedFiles, optim_files: list, first_optim: Optional[dict]) -> None:
    config_stage = as_int(get(rec.ds_config, "zero_optimization", "stage"))
    if not optim_files:
        rec.flavor, rec.zero_stage = NO_ZERO, config_stage or 0
        if rec.zero_stage:
            rec.problems.append(f"the config says ZeRO stage {rec.zero_stage} but there are no "
                                "*_optim_states.pt files: the save is incomplete")
        return
    if first_optim is None:
        broken = "; ".join(f"{f.path.name} ({_reason(fs, f)})" for f in optim_files)
        have = {f.dp_rank for f in optim_files if f.dp_rank is not None}
        like = optim_files[0]
        missing = [fnames.optim_states_name(r, like.mp_rank or 0, like.prefix)
                   for r in range(rec.dp_world_size or 0) if r not in have]
        raise IncompleteCheckpointError(
            f"none of the {len(optim_files)} optimizer-state files can be read: {broken}"
            + (f"; and missing: {', '.join(missing)} (the model-states file says {rec.dp_world_size} ranks)"
               if missing else ""), path=fs.location.tag_dir)
    if "zero_stage" in first_optim:
        rec.zero_stage, rec.flavor = int(first_optim["zero_stage"]), ZERO
    elif "single_partition_of_fp32_groups" in first_optim:
        rec.flavor = BF16_OPTIMIZER
        rec.zero_stage = config_stage if config_stage is not None else 1
    else:
        raise UnsupportedCheckpointError(
            "the optimizer-state files have neither 'zero_stage' nor 'single_partition_of_fp32_groups'",
            path=optim_files[0].path, hint="this optimizer layout is not known to ckptlib")


def _reason(fs: OpenedFiles, f) -> str:
    cause = fs.error(f)
    return cause.message if cause is not None else "unreadable"


def _training_dtype(rec: Records, model: dict) -> str:
    counts: dict[str, int] = {}
    buffer_names = set(model.get("buffer_names") or [])
    for name, t in rec.index.module.items():
        if isinstance(t, TensorHandle) and name not in buffer_names and BY_NAME[t.dtype_name].floating:
            counts[t.dtype_name] = counts.get(t.dtype_name, 0) + 1
    by_module = max(counts, key=counts.get) if counts else None
    cfg = rec.ds_config
    if get(cfg, "bf16", "enabled") or get(cfg, "bfloat16", "enabled"):
        return "bf16"
    if get(cfg, "fp16", "enabled"):
        return "fp16"
    if by_module is not None:
        return BY_NAME[by_module].short or "fp32"
    prefixes = {f.prefix for f in rec.files if f.kind == fnames.OPTIM_STATES}
    return "bf16" if "bf16_" in prefixes else "fp32"


def _buffers(model: dict, module: dict) -> list[BufferInfo]:
    out = []
    for name in model.get("buffer_names") or []:
        t = module.get(name)
        if isinstance(t, TensorHandle):
            out.append(BufferInfo(name=name, shape=tuple(t.shape), dtype=t.dtype_name))
    return out


def _optimizer(rec: Records, model: dict) -> Optional[OptimizerInfo]:
    if rec.flavor == NO_ZERO:
        opt = model.get("optimizer")
        if not isinstance(opt, dict):
            return None
        inner = opt.get("optimizer_state_dict") if "optimizer_state_dict" in opt else opt
        wrapper = "FP16_Optimizer" if "fp32_groups" in opt else "torch optimizer"
        base = inner if isinstance(inner, dict) else {}
        scale = opt.get("cur_scale")
        first = None
    else:
        first = rec.index.optim[min(rec.index.optim)]
        if rec.flavor == BF16_OPTIMIZER:
            wrapper, base = "BF16_Optimizer", first.get("base_optimizer_state")
        elif rec.zero_stage == 3:
            wrapper, base = "DeepSpeedZeroOptimizer_Stage3", first.get("optimizer_state_dict")
        else:
            wrapper, base = "DeepSpeedZeroOptimizer", first.get("base_optimizer_state")
        scale = getattr(first.get("loss_scaler"), "cur_scale", None)
    groups = []
    if isinstance(base, dict):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in base.get("param_groups") or []]
    if rec.flavor == NO_ZERO:
        per_group, problems = (stage0_states(base) if isinstance(base, dict) else []), []
    else:
        per_group, problems = group_states(rec)
    keys: list = []
    for gs in per_group:
        keys += [k for k in gs.key_names if k not in keys]
    step = next((gs.step for gs in per_group if gs.step is not None), None)
    if step is None and first is not None and not per_group:
        step = first.get("base_optimizer_state_step")
    if isinstance(step, TensorHandle):
        step = step.item() if step.numel == 1 else None
    return OptimizerInfo(wrapper=wrapper, state_keys=keys, step=int(step) if step is not None else None,
                         param_groups=[plain(g) for g in groups],
                         loss_scale=float(scale) if isinstance(scale, (int, float)) else None,
                         groups=per_group, state_problems=problems)


__all__ = ["parse"]
