"""Opening every ZeRO set of a tag folder and joining them into the full model.

- one set (data parallel, also sequence parallel and MoE): the set's own names, experts made global;
- a pipeline (layer files): one set per stage, each parsed with the module its layer files give it;
  a parameter held by several stages (a tied layer) is read from the first;
- tensor parallel (several ``mp_rank`` sets, no layer files): the shards joined by split rules
  (:mod:`ckptlib.deepspeed.tensor_parallel`) from ``universal_checkpoint_info`` or ``tp_rules``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..mesh import Mesh, Rank
from . import files as fnames
from .fileset import OpenedFiles
from .model import ModelView, single_set_view, whole
from .parse import parse
from .pipeline import is_pipeline, stage_modules
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
        return _join_pipeline(fs, mps, notes, problems, experts)
    if len(mps) > 1:
        return _join_tensor_parallel(fs, mps, notes, problems, tp_rules, experts)
    zs = _parse_set(fs, mps[0], Rank(), notes, problems, "")
    for f in (f for f in fs.files if f.kind == fnames.LAYER_STATES):  # layer files need pipeline stages
        problems.append(f"{f.relpath}: a pipeline layer file, but this checkpoint has no pipeline stages (its "
                        "model-states file holds the whole module): left over from another run?")
    dp = zs.partition_count or zs.dp_world_size or 1
    view = single_set_view(zs)
    if sp > 1:
        view.notes.append(f"sequence parallel (Ulysses) of size {sp}: the weights are not split; ZeRO partitions "
                          f"them over all {dp} ranks (sequence x data parallel)")
    ep = max([g.ep for g in zs.records.expert_groups.values()] + [len(zs.records.index.stage0_optimizers), 1])
    return Joined({mps[0]: zs}, view, DATA_PARALLEL, Mesh(dp=max(1, dp // sp), ep=ep), sequence_parallel=sp,
                  num_experts=list(experts) if isinstance(experts, (list, tuple)) else None)


def _join_pipeline(fs, mps, notes, problems, experts) -> Joined:
    models = {s: _model_obj(fs, s) for s in mps}
    optims = {s: [tf.obj for tf in (fs.get(f) for f in fs.of(fnames.OPTIM_STATES, s)) if tf is not None]
              for s in mps}
    modules, more = stage_modules(fs, models, optims, problems)
    notes += more
    sets = {s: _parse_set(fs, s, Rank(pp=s), notes, problems, f"stage {s}", module=modules[s]) for s in mps}
    params, blocks, order, buffers, seen = [], {}, [], [], set()
    for s, zs in sets.items():
        for name in zs.state_dict_names():
            if name in seen:
                continue
            seen.add(name)
            order.append(name)
        for p in zs.parameters:
            if p.name not in blocks:
                params.append(ParameterInfo(p.name, tuple(p.shape), p.trainable, p.tied_to, p.group, p.stored_dtype))
                blocks[p.name] = [whole((s, p.name), tuple(p.shape))]
        for b in zs.buffers:
            if b.name not in blocks:
                buffers.append(b)
                blocks[b.name] = [whole((s, b.name), tuple(b.shape))]
    rank = {n: i for i, n in enumerate(order)}
    params.sort(key=lambda p: rank.get(p.name, len(rank)))
    shared = [p.name for p in params if sum(p.name in {q.name for q in zs.parameters} for zs in sets.values()) > 1]
    view = ModelView(params, buffers, order, blocks, lambda source, key: sets[source[0]].sources(source[1], key),
                     PIPELINE, [f"{len(mps)} pipeline stages"] + ([f"held by several stages (read from the first): "
                                                                  f"{', '.join(shared)}"] if shared else []))
    first = sets[mps[0]]
    return Joined(sets, view, PIPELINE, Mesh(dp=first.partition_count or first.dp_world_size or 1, pp=len(mps)),
                  num_experts=list(experts) if isinstance(experts, (list, tuple)) else None)


def _join_tensor_parallel(fs, mps, notes, problems, tp_rules, experts) -> Joined:
    first = _parse_set(fs, mps[0], Rank(tp=mps[0]), notes, problems, f"tensor rank {mps[0]}")
    shared = get(first.model_states_file().obj, "shared_params")
    sets = {mps[0]: first}
    for t in mps[1:]:
        sets[t] = _parse_set(fs, t, Rank(tp=t), notes, problems, f"tensor rank {t}", shared=shared)
    mesh = Mesh(dp=first.partition_count or first.dp_world_size or 1, tp=len(mps))
    info = first.model_states_file().obj.get("universal_checkpoint_info")
    rules = tp_rules
    if rules is None and isinstance(info, dict):
        rules = SplitRules.from_info(info, f"universal_checkpoint_info of {fs.of(fnames.MODEL_STATES, mps[0])[0].relpath}")
    if rules is None:
        why = ("tensor-parallel shards (mp_rank_00 ... mp_rank_%02d) without universal_checkpoint_info: ckptlib "
               "cannot tell which tensors are replicated or split on which dimension" % mps[-1])
        return Joined(sets, None, TENSOR_PARALLEL, mesh, refusals=[why])
    view = tensor_parallel_view(sets, rules)
    return Joined(sets, view, TENSOR_PARALLEL, mesh,
                  num_experts=list(experts) if isinstance(experts, (list, tuple)) else None)


__all__ = ["Joined", "join", "DATA_PARALLEL", "PIPELINE", "TENSOR_PARALLEL", "RULES_HINT"]
