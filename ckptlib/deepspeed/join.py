"""Opening every ZeRO set of a tag folder and joining them into the full model.

- one set (data parallel, also sequence parallel and MoE): the set's own names, experts made global;
- a pipeline (layer files): one set per stage, each parsed with the module its layer files give it;
  a parameter held by several stages (a tied layer) is read from the first;
- tensor parallel (several ``mp_rank`` sets, no layer files): the shards joined by split rules
  (:mod:`ckptlib.deepspeed.tensor_parallel`) from ``universal_checkpoint_info`` or ``tp_rules``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..errors import UnsupportedCheckpointError
from ..mesh import Mesh, Rank
from . import autoep
from . import files as fnames
from .fileset import OpenedFiles
from .model import ModelView, single_set_view
from .parse import parse
from .pipeline import has_tensor_axis, is_pipeline, layer_tp_ranks, stage_modules
from .records import ParameterInfo
from .tensor_parallel import RULES_HINT, SplitRules, tensor_parallel_view
from .values import as_int, get
from .zeroset import ZeroSet

DATA_PARALLEL, PIPELINE, TENSOR_PARALLEL = "data_parallel", "pipeline", "tensor_parallel"


@dataclass
class Joined:
    """What :func:`join` found: the sets by model-parallel rank, the model (None when it cannot be
    joined, see ``refusals``), the kind of parallelism and the mesh."""

    sets: dict
    view: Optional[ModelView]
    kind: str
    mesh: Mesh
    sequence_parallel: int = 1
    num_experts: Optional[list] = None
    refusals: list = field(default_factory=list)


def _mp_ranks(fs: OpenedFiles) -> list[int]:
    return sorted({f.mp_rank or 0 for f in fs.files if f.kind in (fnames.MODEL_STATES, fnames.OPTIM_STATES)
                   and f.mp_rank is not None} or {0})


def _model_obj(fs: OpenedFiles, mp: int) -> dict:
    for f in fs.of(fnames.MODEL_STATES, mp):
        tf = fs.get(f)
        if tf is not None and isinstance(tf.obj, dict):
            return tf.obj
    return {}


def _parse_set(fs: OpenedFiles, mp: int, coordinate: Rank, notes: list, problems: list, label: str,
               **kw) -> ZeroSet:
    own_notes, own_problems = [], []
    rec = parse(fs, own_notes, own_problems, mp=mp, coordinate=coordinate, **kw)
    notes += [n for n in own_notes if n not in notes]
    for p in own_problems:
        p = f"{label}: {p}" if label else p
        if p not in problems:
            problems.append(p)
    return ZeroSet(rec, mp, fs, coordinate)


def join(fs: OpenedFiles, notes: list, problems: list, tp_rules: Optional[SplitRules] = None) -> Joined:
    """Open and parse every ZeRO set of ``fs``'s tag folder and join them (see the module docstring)."""
    mps = _mp_ranks(fs)
    model0 = _model_obj(fs, mps[0])
    cfg = model0.get("ds_config") if isinstance(model0.get("ds_config"), dict) else {}
    sp = as_int(cfg.get("sequence_parallel_size")) or 1
    experts = model0.get("num_experts")
    if is_pipeline(fs) and len(mps) >= 1 and model0.get("module", 0) is None:
        return _join_pipeline(fs, mps, notes, problems, experts, tp_rules)
    if len(mps) > 1:
        return _join_tensor_parallel(fs, mps, notes, problems, tp_rules, experts)
    zs = _parse_set(fs, mps[0], Rank(), notes, problems, "")
    for f in (f for f in fs.files if f.kind == fnames.LAYER_STATES):  # layer files need pipeline stages
        problems.append(f"{f.relpath}: a pipeline layer file, but this checkpoint has no pipeline stages (its "
                        "model-states file holds the whole module): left over from another run?")
    dp = zs.partition_count or zs.dp_world_size or 1
    layers = autoep.layers_of(model0)
    view = autoep.autoep_view(zs, layers) if layers and not zs.records.unsupported else single_set_view(zs)
    if sp > 1:
        view.notes.append(f"sequence parallel (Ulysses) of size {sp}: the weights are not split; ZeRO partitions "
                          f"them over all {dp} ranks (sequence x data parallel)")
    ep = max([g.ep for g in zs.records.expert_groups.values()] + [len(zs.records.index.stage0_optimizers), 1]
             + [lay.ep for lay in layers])
    return Joined({mps[0]: zs}, view, DATA_PARALLEL, Mesh(dp=max(1, dp // sp), ep=ep), sequence_parallel=sp,
                  num_experts=list(experts) if isinstance(experts, (list, tuple)) else None)


def pipeline_sizes(fs: OpenedFiles, mps: list[int], models: dict, problems: list) -> tuple[int, int]:
    """``(pp, tp)`` of a pipeline checkpoint: the tensor size from the layer files' ``-model_YY`` names and
    ``checkpoint_parallel_dimensions``, the stages from the model-parallel ranks (``mp = stage * tp +
    tensor rank``). Disagreeing records are problems (the checkpoint is then not read)."""
    tps = layer_tp_ranks(fs)
    tp = len(tps) if has_tensor_axis(fs) else 1
    if tps != list(range(len(tps))):
        missing = sorted(set(range(max(tps) + 1)) - set(tps))
        problems.append(f"no layer file of tensor rank {', '.join(map(str, missing))} "
                        f"(layer_XX-model_{missing[0]:02d}-model_states.pt) although tensor rank {max(tps)} has them")
        tp = max(tps) + 1
    first = models.get(mps[0]) or {}
    dims = first.get("checkpoint_parallel_dimensions")
    if isinstance(dims, dict) and as_int(dims.get("tp_degree")) and as_int(dims.get("pp_degree")):
        rec_tp, rec_pp = as_int(dims["tp_degree"]), as_int(dims["pp_degree"])
        if rec_tp != tp:
            problems.append(f"{fs.of(fnames.MODEL_STATES, mps[0])[0].relpath}: checkpoint_parallel_dimensions say "
                            f"tp_degree {rec_tp}, but the layer files are written for {tp} tensor rank(s)")
        pp = rec_pp
    else:
        pp = max(1, (max(mps) + 1) // max(tp, 1))
    mp_world = as_int(first.get("mp_world_size"))
    if mp_world is not None and mp_world != pp * tp:
        problems.append(f"mp_world_size {mp_world} is not pp {pp} x tp {tp} (checkpoint_parallel_dimensions)")
    want = set(range(pp * tp))
    for mp in sorted(want & set(mps)):
        if not fs.of(fnames.MODEL_STATES, mp):
            problems.append(f"{fnames.model_states_name(mp)} is missing (stage {mp // tp}"
                            + (f", tensor rank {mp % tp}" if tp > 1 else "") + "; its optimizer files are there)")
    for mp in sorted(want - set(mps)):
        problems.append(f"{fnames.model_states_name(mp)} is missing (stage {mp // tp}"
                        + (f", tensor rank {mp % tp}" if tp > 1 else "") + ")")
    for mp in sorted(set(mps) - want):
        problems.append(f"{fnames.model_states_name(mp)}: model-parallel rank {mp} is outside the mesh of pp {pp} x "
                        f"tp {tp} (left over from another run?)")
    return pp, tp


def _join_pipeline(fs, mps, notes, problems, experts, tp_rules) -> Joined:
    models = {m: _model_obj(fs, m) for m in mps}
    optims = {m: [tf.obj for tf in (fs.get(f) for f in fs.of(fnames.OPTIM_STATES, m)) if tf is not None]
              for m in mps}
    problems_before = len(problems)
    pp, tp = pipeline_sizes(fs, mps, models, problems)
    axis = has_tensor_axis(fs)
    sets: dict = {}
    refusals: list = []
    for t in range(tp):
        own = [m for m in mps if m % tp == t and m < pp * tp and fs.of(fnames.MODEL_STATES, m)]
        modules, more = stage_modules(fs, {m // tp: models[m] for m in own}, {m // tp: optims[m] for m in own},
                                      problems, tp=t, tensor_axis=axis,
                                      tied_patterns=tp_rules.pipeline_replicated if tp_rules else (),
                                      refusals=refusals if t == 0 else None)
        notes += [n for n in more if n not in notes]
        for m in own:
            label = f"stage {m // tp}" + (f", tensor rank {t}" if tp > 1 else "")
            sets[m] = _parse_set(fs, m, Rank(pp=m // tp, tp=t), notes, problems, label, module=modules[m // tp])
    sets = dict(sorted(sets.items()))
    first = sets[min(sets)]
    mesh = Mesh(dp=first.partition_count or first.dp_world_size or 1, tp=tp, pp=pp)
    experts = list(experts) if isinstance(experts, (list, tuple)) else None
    if refusals:  # the stages' names are unknown: their sets were parsed to say so, but nothing joins
        problems[:] = [p for p in problems if "ZeRO-0: optimizer group" not in p]
        refusals.append("say which weights are tied with --tp-rules FILE holding "
                        "{\"pipeline_replicated_parameter_patterns\": [\"tied_modules\\\\.KEY\\\\.weight$\"]} "
                        "(the names as the PipelineModule's state_dict has them; DeepSpeed's universal_checkpoint_info "
                        "key of the same name, saved with the checkpoint, does the same)")
        return Joined(sets, None, PIPELINE, mesh, num_experts=experts, refusals=refusals)
    rules = None
    if tp > 1:
        rules = tp_rules or _recorded_rules(fs, first)
        if rules is None:
            why = (f"pipeline stages with {tp} tensor ranks each (layer_XX-model_YY files) without "
                   "universal_checkpoint_info: ckptlib cannot tell which tensors are replicated or split on which "
                   "dimension")
            return Joined(sets, None, PIPELINE, mesh, num_experts=experts, refusals=[why])
    stage_views = {}
    try:
        for s in range(pp):
            members = {m % tp: zs for m, zs in sets.items() if m // tp == s}
            if not members:
                continue
            stage_views[s] = tensor_parallel_view(members, rules) if tp > 1 else single_set_view(members[min(members)])
    except UnsupportedCheckpointError:
        if problems_before < len(problems):  # a stage lacks files (named in the problems): nothing joins
            return Joined(sets, None, PIPELINE, mesh, num_experts=experts)
        raise
    view = pipeline_view(stage_views, sets, tp, problems)
    return Joined(sets, view, PIPELINE, mesh, num_experts=experts)


def _recorded_rules(fs: OpenedFiles, first: ZeroSet) -> Optional[SplitRules]:
    info = first.model_states_file().obj.get("universal_checkpoint_info")
    if not isinstance(info, dict):
        return None
    return SplitRules.from_info(info, f"universal_checkpoint_info of {fs.of(fnames.MODEL_STATES, first.mp)[0].relpath}")


def pipeline_view(stage_views: dict, sets: dict, tp: int, problems: list) -> ModelView:
    """The full model of a pipeline from its stages' models: each parameter and buffer under its global name,
    in the stages' order; a tensor held by several stages (a tied layer's weight) is read from the first and
    its other copies become replicas of it (compared whenever it is read)."""
    params, blocks, order, buffers, roles, padded = [], {}, [], [], {}, {}
    holders: dict = {}
    for s, v in stage_views.items():
        order += [n for n in v.order if n not in blocks and n not in order]
        for p in v.parameters:
            if p.tied_to:
                continue
            holders.setdefault(p.name, []).append(s)
            if p.name in blocks:
                blocks[p.name] = _with_replicas(p.name, blocks[p.name], v.blocks[p.name], s, problems)
                continue
            params.append(ParameterInfo(p.name, tuple(p.shape), p.trainable, None, p.group, p.stored_dtype))
            blocks[p.name] = list(v.blocks[p.name])
            if p.name in v.roles:
                roles[p.name] = v.roles[p.name]
            if p.name in v.padded:
                padded[p.name] = v.padded[p.name]
        for b in v.buffers:
            if b.name not in blocks:
                buffers.append(b)
                blocks[b.name] = list(v.blocks[b.name])
                if b.name in v.roles:
                    roles[b.name] = v.roles[b.name]
    rank = {n: i for i, n in enumerate(order)}
    params.sort(key=lambda p: rank.get(p.name, len(rank)))
    shared = {n: ss for n, ss in holders.items() if len(ss) > 1}
    notes = [f"{len(stage_views)} pipeline stages" + (f" x {tp} tensor ranks" if tp > 1 else "")]
    notes += [f"{n} is held by stages {', '.join(map(str, ss))}: read from stage {ss[0]}, the other copies "
              "compared with it" for n, ss in shared.items()]
    for v in stage_views.values():
        notes += v.notes
    return ModelView(params, buffers, order, blocks, lambda source, key: sets[source[0]].sources(source[1], key),
                     PIPELINE, list(dict.fromkeys(notes)), roles=roles, padded=padded,
                     sets={zs.mp: zs for zs in sets.values()})


def _with_replicas(name: str, first: list, later: list, stage: int, problems: list) -> list:
    """``first``'s blocks with ``later``'s (another stage's copy, block for block in the same place) as replicas."""
    if len(first) != len(later) or any((a.shape, a.full_offset, a.full_strides) != (b.shape, b.full_offset, b.full_strides)
                                       for a, b in zip(first, later)):
        problems.append(f"{name}: stage {stage}'s copy is split differently from the first stage's")
        return first
    return [dataclasses.replace(a, replicas=a.replicas + (b.source,) + b.replicas) for a, b in zip(first, later)]


def _join_tensor_parallel(fs, mps, notes, problems, tp_rules, experts) -> Joined:
    first = _parse_set(fs, mps[0], Rank(tp=mps[0]), notes, problems, f"tensor rank {mps[0]}")
    shared = get(first.model_states_file().obj, "shared_params")
    sets = {mps[0]: first}
    for t in mps[1:]:
        sets[t] = _parse_set(fs, t, Rank(tp=t), notes, problems, f"tensor rank {t}", shared=shared)
    mesh = Mesh(dp=first.partition_count or first.dp_world_size or 1, tp=len(mps))
    rules = tp_rules or _recorded_rules(fs, first)
    if rules is None:
        why = ("tensor-parallel shards (mp_rank_00 ... mp_rank_%02d) without universal_checkpoint_info: ckptlib "
               "cannot tell which tensors are replicated or split on which dimension" % mps[-1])
        return Joined(sets, None, TENSOR_PARALLEL, mesh, refusals=[why])
    view = tensor_parallel_view(sets, rules)
    return Joined(sets, view, TENSOR_PARALLEL, mesh,
                  num_experts=list(experts) if isinstance(experts, (list, tuple)) else None)


__all__ = ["Joined", "join", "DATA_PARALLEL", "PIPELINE", "TENSOR_PARALLEL", "RULES_HINT"]
