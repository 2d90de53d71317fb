"""Experts on expert-parallel ranks, and the pipeline x tensor x data grid of files, as plain facts.

Both read metadata only (the file list and :meth:`~ckptlib.deepspeed.Checkpoint.coordinates`, the ZeRO sets'
layouts and pieces, the AutoEP layers, the model view's blocks, tensor handles' shapes) and return JSON-ready data
(lists, strings, numbers; no tuple, no integer key), so that the same dict is ``ckpt inspect --json``'s
``placement.experts`` / ``placement.grid`` and the facts a picture carries.

- :func:`experts`: per MoE layer, each expert (global id) with its expert-parallel rank, the expert-data-parallel
  ranks that replicate it (with their optimizer-states files and how many of its elements each one's partition
  holds), and the files holding its values (AutoEP and DeepSpeed-MoE; a universal folder's ``zero/`` files).
- :func:`grid`: per (stage, tensor rank) its model-states file, the layer files it holds (pipeline) and the slice
  of every tensor it holds (tensor parallel), and per data rank its optimizer-states file and partition sizes.

Files are named by their ``relpath`` (as ``ckpt inspect`` names them).
"""
from __future__ import annotations

import os
from typing import Optional

from ..deepspeed import files as fnames
from ..deepspeed.autoep import ep_name
from ..deepspeed.moe import expert_id
from ..errors import CkptError
from ..layout.placement import row_major_strides

AUTOEP, DEEPSPEED_MOE = "autoep", "deepspeed_moe"
PER_EXPERT_FILES, ZERO3_PARTITIONED, UNIVERSAL = "per_expert_files", "zero3_partitioned", "universal"
_MARK = "deepspeed_experts."
_WEIGHTS = ("w1", "w2", "w3")


# ============================================================================================== experts
def experts(ckpt) -> Optional[dict]:
    """Where every expert of a mixture-of-experts checkpoint is (None for any other). Metadata only.

    ``kind`` (``autoep`` / ``deepspeed_moe``), ``format`` (``per_expert_files``: each expert's 16-bit weights in
    ``layer_L_expert_G_mp_rank_XX_model_states.pt``; ``zero3_partitioned``: AutoEP at ZeRO-3, the experts only in
    the partitions of their expert-data-parallel group; ``universal``: whole tensors in ``zero/``), ``zero_stage``,
    ``ep``, ``edp``, ``dp``, ``rank_rule`` (words), ``ranks`` (per data rank: ``data_rank``, ``ep_rank``,
    ``edp_rank``, ``optim_file``, ``model_file``, ``experts``: its global expert ids per layer), ``ep_ranks`` (per ep
    rank: ``data_ranks`` of its expert-data-parallel group, ``experts`` per layer), ``layers`` (see
    :func:`_expert_entry` for each expert) and ``notes``. Memory: a few dicts per expert."""
    uinfo = ckpt.universal
    if uinfo is not None:
        return _universal_experts(ckpt) if uinfo.experts else None
    if ckpt.records.autoep_layers:
        return _autoep(ckpt)
    if ckpt.num_experts:
        return _deepspeed_moe(ckpt)
    return None


def _relpaths(ckpt, kind: str, mp: int) -> dict:
    """``{dp rank: relpath}`` of the files of ``kind`` of model-parallel rank ``mp``."""
    return {f.dp_rank: f.relpath for f in ckpt.files if f.kind == kind and (f.mp_rank or 0) == mp}


def _expert_files(ckpt) -> dict:
    """``{(layer, global expert): relpath}`` of the per-expert 16-bit weight files."""
    return {(f.layer or 0, f.expert): f.relpath for f in ckpt.files if f.kind == fnames.EXPERT_STATES}


def _rank_table(ckpt, members: dict, per_layer: list, zs) -> tuple[list, list]:
    """``(ranks, ep_ranks)`` from ``members`` (ep rank -> its expert-data-parallel data ranks, in edp order) and
    ``per_layer`` (per layer: ep rank -> its global experts)."""
    optim = _relpaths(ckpt, fnames.OPTIM_STATES, zs.mp)
    model = _relpaths(ckpt, fnames.MODEL_STATES, zs.mp)
    ranks = []
    for e, group in sorted(members.items()):
        for k, r in enumerate(group):
            ranks.append({"data_rank": r, "ep_rank": e, "edp_rank": k, "optim_file": optim.get(r),
                          "model_file": model.get(r),
                          "experts": [list(layer.get(e, [])) for layer in per_layer]})
    ranks.sort(key=lambda x: x["data_rank"])
    ep_ranks = [{"ep_rank": e, "data_ranks": list(group), "experts": [list(layer.get(e, [])) for layer in per_layer],
                 "optim_file": None} for e, group in sorted(members.items())]
    return ranks, ep_ranks


def _elements(pieces: list, start: int, count: int) -> dict:
    """``{data rank: elements}`` of the parameter's elements ``[start, start + count)`` in ``pieces``."""
    out: dict = {}
    for pc in pieces:
        lo, hi = max(start, pc.param_start), min(start + count, pc.param_start + pc.count)
        if hi > lo:
            out[pc.rank] = out.get(pc.rank, 0) + hi - lo
    return out


def _expert_entry(g: int, e: int, local: int, tensors: list, held: dict, group: list, optim: dict,
                  file: Optional[str], keys: list, state_files: Optional[list] = None) -> dict:
    """One expert: ``expert`` (global id), ``ep_rank``, ``local`` (its index on its ep rank), ``tensors`` (the
    model's tensors that make it: ``name``, ``index`` along dim 0 of a stacked tensor or None, ``shape`` of its
    part, ``numel``), ``numel``, ``file`` (its 16-bit weights' file, None where there is none), ``keys`` (the
    file's keys for it), ``replicas`` (each data rank of its expert-data-parallel group: ``data_rank``,
    ``edp_rank``, ``file`` (its optimizer-states file), ``elements`` of this expert's fp32 master (and of each
    moment) in that file's partition), ``state_files`` (``file``, ``elements``: the files holding its optimizer
    state) and ``files`` (every file holding a value of it)."""
    replicas = [{"data_rank": r, "edp_rank": k, "file": optim.get(r), "elements": held.get(r, 0)}
                for k, r in enumerate(group)]
    if state_files is None:
        state_files = [{"file": x["file"], "elements": x["elements"]} for x in replicas if x["elements"]]
    files = sorted({x["file"] for x in state_files if x["file"]} | ({file} if file else set()))
    return {"expert": g, "ep_rank": e, "local": local, "tensors": tensors,
            "numel": sum(t["numel"] for t in tensors), "file": file, "keys": keys, "replicas": replicas,
            "state_files": state_files, "files": files}


def _autoep(ckpt) -> dict:
    zs = ckpt.main
    layers = ckpt.records.autoep_layers
    ep = layers[0].ep
    zero3 = zs.zero_stage == 3 or any(lay.checkpoint_format == ZERO3_PARTITIONED for lay in layers)
    members = _autoep_members(ckpt, zs, ep)
    optim = _relpaths(ckpt, fnames.OPTIM_STATES, zs.mp)
    weights = _expert_files(ckpt)
    out_layers, per_layer = [], []
    for lay in layers:
        entries, by_ep = [], {}
        for g in range(lay.num_experts):
            e, local = divmod(g, lay.num_local) if lay.num_local else (0, g)
            by_ep.setdefault(e, []).append(g)
            tensors, held = [], {}
            for w in _WEIGHTS:
                name = lay.weight(w)
                try:
                    p = zs.param(ep_name(name, e))
                except KeyError:
                    continue
                row = p.numel // p.shape[0] if p.shape and p.shape[0] else 0
                tensors.append({"name": name, "index": g, "shape": list(p.shape[1:]), "numel": row})
                for r, n in _elements(_pieces(zs, p.name), local * row, row).items():
                    held[r] = held.get(r, 0) + n
            file = weights.get((lay.layer, g))
            keys = [f"{lay.weight(w)}.{g}" for w in _WEIGHTS] if file else []
            entries.append(_expert_entry(g, e, local, tensors, held, members.get(e, []), optim, file, keys))
        per_layer.append(by_ep)
        out_layers.append({"layer": lay.layer, "module": lay.module_path, "prefix": lay.prefix,
                           "num_experts": lay.num_experts, "num_local": lay.num_local, "experts": entries})
    ranks, ep_ranks = _rank_table(ckpt, members, per_layer, zs)
    edp = max((len(m) for m in members.values()), default=0)
    notes = [f"AutoEP at ZeRO-3 (zero3_partitioned): no per-expert files; each ep rank's experts live in the "
             f"fp32 partitions of its {edp} expert-data-parallel rank(s) (their optimizer-states files), which "
             "ds_zero_partition_groups lists; the model-states files name each rank's ep rank" if zero3 else
             f"each expert's 16-bit weights in its own file (keys <prefix>.w1/w2/w3.<expert>); its fp32 master "
             f"and optimizer state in the expert group's partitions, split over its {edp} expert-data-parallel "
             "rank(s)"]
    return {"kind": AUTOEP, "format": ZERO3_PARTITIONED if zero3 else PER_EXPERT_FILES, "tag": ckpt.location.tag,
            "zero_stage": zs.zero_stage, "ep": ep, "edp": edp, "dp": ckpt.mesh.dp,
            "rank_rule": _rule(ckpt, members, ep) + ("; the groups as the optimizer files' ds_zero_partition_groups "
                                                     "list them" if zero3 else ""),
            "model_states": sorted(_relpaths(ckpt, fnames.MODEL_STATES, zs.mp).values()),
            "ranks": ranks, "ep_ranks": ep_ranks, "layers": out_layers, "notes": notes}


def _rule(ckpt, members: dict, ep: int) -> str:
    """The rank rule in words: DeepSpeed's default where every group follows it, else the groups themselves."""
    held = f"ep rank e holds the global experts [e * E/{ep}, (e + 1) * E/{ep}) of every MoE layer (E experts per layer)"
    if all(members.get(e) == list(range(e, ckpt.mesh.dp, ep)) for e in range(ep)):
        return f"data rank r is ep rank r % {ep} and expert-data-parallel rank r // {ep}; {held}"
    groups = "; ".join(f"ep rank {e}: data ranks {', '.join(map(str, g))}" for e, g in sorted(members.items()))
    return f"expert-data-parallel groups as the files record them ({groups}); {held}"


def _pieces(zs, name: str) -> list:
    try:
        return zs.pieces(name)
    except (CkptError, KeyError, IndexError):
        return []


def _autoep_members(ckpt, zs, ep: int) -> dict:
    """ep rank -> its expert-data-parallel data ranks (edp order): ZeRO-3's recorded partition ranks, the expert
    group's rule at ZeRO-1/2."""
    out: dict = {}
    for name, (g, e, _local) in zs.records.index.experts.items():
        if e in out:
            continue
        recorded = zs.records.index.zero3_members.get(name)
        eg = zs.records.expert_groups.get(g)
        if recorded:
            out[e] = list(recorded)
        elif eg is not None:
            out[e] = [eg.data_rank(e, k) for k in range(eg.edp)]
    for e in range(ep):  # no expert group recorded (ZeRO-0): the rule
        out.setdefault(e, list(range(e, ckpt.mesh.dp, ep)))
    return out


def _moe_layers(ckpt) -> list:
    """``[(prefix, {global id: [parameter names]})]`` of DeepSpeed-MoE's experts, per MoE layer in model order (the
    order DeepSpeed numbers its MoE layers in the expert files' ``layer_L``)."""
    layers: dict = {}
    for p in ckpt.parameters:
        g = expert_id(p.name)
        if g is None or p.tied_to:
            continue
        prefix = p.name[:p.name.find(_MARK)].rstrip(".")
        layers.setdefault(prefix, {}).setdefault(g, []).append(p.name)
    return list(layers.items())


def _deepspeed_moe(ckpt) -> dict:
    zs = ckpt.main
    ep = ckpt.mesh.ep or 1
    counts = list(ckpt.num_experts or [])
    optim = _relpaths(ckpt, fnames.OPTIM_STATES, zs.mp)
    weights = _expert_files(ckpt)
    expp = {f.dp_rank: f.relpath for f in ckpt.files if f.kind == fnames.EXPERT_OPTIM_STATES}
    stage0 = not zs.records.expert_groups
    members: dict = {}
    out_layers, per_layer = [], []
    for L, (prefix, by_id) in enumerate(_moe_layers(ckpt)):
        n = int(counts[L]) if L < len(counts) else len(by_id)
        num_local = max(1, n // ep)
        entries, by_ep = [], {}
        for g in sorted(by_id):
            e, local = divmod(g, num_local)
            tensors, held = [], {}
            group = None
            for name in by_id[g]:
                p = ckpt.param(name)
                tensors.append({"name": name, "index": None, "shape": list(p.shape), "numel": p.numel})
                where = zs.records.index.experts.get(name)
                if where is not None and where[0] in zs.records.expert_groups:
                    eg = zs.records.expert_groups[where[0]]
                    e = where[1]
                    group = [eg.data_rank(e, k) for k in range(eg.edp)]
                elif len(zs.records.index.stage0.get(name, ())) > 2:
                    e = zs.records.index.stage0[name][2]
                for r, c in _elements(_pieces(zs, name), 0, p.numel).items():
                    held[r] = held.get(r, 0) + c
            group = group or list(range(e, ckpt.mesh.dp, ep))
            members.setdefault(e, group)
            by_ep.setdefault(e, []).append(g)
            numel = sum(t["numel"] for t in tensors)
            state = ([{"file": expp[e], "elements": numel}] if stage0 and e in expp else None)
            file = weights.get((L, g))
            entries.append(_expert_entry(g, e, local, tensors, held, members[e], optim, file,
                                         by_id[g] if file else [], state))
        per_layer.append(by_ep)
        out_layers.append({"layer": L, "module": prefix, "prefix": prefix + "." + _MARK.rstrip("."),
                           "num_experts": n, "num_local": num_local, "experts": entries})
    for e in range(ep):
        members.setdefault(e, list(range(e, ckpt.mesh.dp, ep)))
    ranks, ep_ranks = _rank_table(ckpt, members, per_layer, zs)
    if stage0:
        for x in ranks:
            x["optim_file"] = None
        for x in ep_ranks:
            x["optim_file"] = expp.get(x["ep_rank"])
    edp = max((len(m) for m in members.values()), default=0)
    notes = ["each expert's 16-bit weights in its own file under its global id (layer_L_expert_G)"]
    notes.append(f"ZeRO-0: the whole optimizer state of ep rank e (dense and its experts) in "
                 f"expp_rank_e_mp_rank_XX_optim_states.pt, one per ep rank; its {edp} expert-data-parallel rank(s) "
                 "hold the same state" if stage0 else
                 f"the expert group's fp32 masters and optimizer state partitioned over each ep rank's {edp} "
                 "expert-data-parallel rank(s), under LOCAL names (deepspeed_experts.0 .. L-1) on every ep rank")
    return {"kind": DEEPSPEED_MOE, "format": PER_EXPERT_FILES, "tag": ckpt.location.tag,
            "zero_stage": zs.zero_stage, "ep": ep, "edp": edp, "dp": ckpt.mesh.dp,
            "rank_rule": _rule(ckpt, members, ep) + "; its optimizer state names them by their local ids 0 .. E/ep - 1",
            "model_states": sorted(_relpaths(ckpt, fnames.MODEL_STATES, zs.mp).values()),
            "ranks": ranks, "ep_ranks": ep_ranks, "layers": out_layers, "notes": notes}


def _universal_experts(ckpt) -> dict:
    """A universal folder: every expert whole in ``zero/`` (AutoEP: a row of the stacked tensor; DeepSpeed-MoE: its
    own folders, or a row of its local id's folder in ckptlib's folders for ep > 1)."""
    u, main = ckpt.universal, ckpt.main
    ep = u.source_mesh.ep or 1
    if u.experts == "AutoEP":
        groups = []
        for lay in ckpt.records.autoep_layers:
            by_id = {}
            for w in _WEIGHTS:
                p = ckpt.param(lay.weight(w))
                row = p.numel // p.shape[0] if p.shape and p.shape[0] else 0
                for g in range(lay.num_experts):
                    by_id.setdefault(g, []).append((lay.weight(w), g, list(p.shape[1:]), row, g * row))
            groups.append((lay.layer, lay.module_path, lay.prefix, lay.num_experts, by_id))
    else:
        groups = []
        for L, (prefix, ids) in enumerate(_moe_layers(ckpt)):
            by_id = {g: [(n, None, list(ckpt.param(n).shape), ckpt.param(n).numel, 0) for n in names]
                     for g, names in ids.items()}
            groups.append((L, prefix, prefix + "." + _MARK.rstrip("."), len(ids), by_id))
    out_layers, per_layer = [], []
    for L, module, prefix, n, by_id in groups:
        num_local = max(1, n // ep)
        entries, by_ep = [], {}
        for g in sorted(by_id):
            e, local = divmod(g, num_local)
            by_ep.setdefault(e, []).append(g)
            tensors, zero = [], []
            for name, index, shape, numel, start in by_id[g]:
                tensors.append({"name": name, "index": index, "shape": shape, "numel": numel})
                for key, frag in sorted(main.fragments.get(name, {}).items(), key=lambda kv: str(kv[0])):
                    if hasattr(frag, "info"):  # the step is a scalar of its own, not a fragment
                        zero.append({"tensor": name, "key": "fp32" if key is None else key,
                                     "file": frag.info.relpath, "start": frag.start + start, "count": numel})
            entry = _expert_entry(g, e, local, tensors, {}, [], {}, None, [], [])
            entry["zero"] = zero
            entry["files"] = sorted({z["file"] for z in zero})
            entries.append(entry)
        per_layer.append(by_ep)
        out_layers.append({"layer": L, "module": module, "prefix": prefix, "num_experts": n, "num_local": num_local,
                           "experts": entries})
    kind = AUTOEP if u.experts == "AutoEP" else DEEPSPEED_MOE
    return {"kind": kind, "format": UNIVERSAL, "tag": ckpt.location.tag, "zero_stage": u.source_stage,
            "ep": ep, "edp": max(1, u.source_mesh.dp // ep), "dp": u.source_mesh.dp,
            "rank_rule": f"as trained: ep {ep}, ep rank e held the global experts [e * E/{ep}, (e + 1) * E/{ep}); "
                         "a universal folder has no rank files",
            "model_states": sorted(f.relpath for f in ckpt.files if f.kind == fnames.MODEL_STATES),
            "ranks": [], "ep_ranks": [{"ep_rank": e, "data_ranks": [], "experts": [list(x.get(e, [])) for x in per_layer],
                                       "optim_file": None} for e in range(ep)],
            "layers": out_layers,
            "notes": ["a universal folder: every expert whole in zero/<tensor>/ (fp32 and each optimizer state), "
                      "no rank partitions and no per-expert files; `zero` gives each expert's element range in them"]}


# ============================================================================================== the grid
def grid(ckpt) -> Optional[dict]:
    """The pipeline x tensor x data grid of a pipeline or tensor-parallel checkpoint (None for any other, and for a
    universal folder, which has no rank files). Metadata only.

    ``kind``, ``pp``, ``tp``, ``dp``, ``zero_stage``, ``rank_rule`` (words), ``layers`` (pipeline: each layer file
    with its ``layer``, ``stage`` (None for a layer without state, which no stage records), ``tp_rank``, ``file``,
    ``tensors``), ``cells`` (see :func:`_cell`), ``tied`` (``name``, ``tied_to``: aliases, held as their owner),
    ``notes``. Memory: a few dicts per tensor and cell."""
    if ckpt.universal is not None or ckpt.kind not in ("pipeline", "tensor_parallel"):
        return None
    layer_tensors: dict = {}
    for zs in ckpt.sets.values():
        for name, h in zs.records.index.module.items():
            path = getattr(getattr(getattr(h, "storage", None), "file", None), "path", None)
            names = layer_tensors.setdefault(os.fspath(path), []) if path is not None else None
            if names is not None and name not in names:
                names.append(name)
    layers = []
    for f in ckpt.files:
        if f.kind == fnames.LAYER_STATES:
            c = ckpt.coordinates(f)
            layers.append({"layer": f.layer, "stage": c["stage"], "tp_rank": c["tp_rank"], "file": f.relpath,
                           "tensors": layer_tensors.get(os.fspath(f.path), [])})
    layers.sort(key=lambda x: (x["layer"], x["tp_rank"] or 0))
    held = _held(ckpt) if ckpt.view is not None else {}
    cells = [_cell(ckpt, mp, zs, layers, held.get(mp, [])) for mp, zs in sorted(ckpt.sets.items())]
    notes = []
    if ckpt.flavor == "no_zero":
        notes.append("ZeRO-0: no partitions; each model-parallel rank's optimizer state is whole (data rank 0's in "
                     "its model-states file, or in its optimizer-states file with BF16_Optimizer)")
    if ckpt.view is None:
        notes.append("how the tensor ranks' shards join is not known (no universal_checkpoint_info; --tp-rules): "
                     "the tensors each cell holds are not listed")
    if any(x["stage"] is None for x in layers):
        notes.append("a layer file without tensors (a layer without state) is listed with no stage: no file "
                     "records which stage holds it")
    return {"kind": ckpt.kind, "tag": ckpt.location.tag, "pp": ckpt.mesh.pp, "tp": ckpt.mesh.tp, "dp": ckpt.mesh.dp,
            "zero_stage": ckpt.zero_stage,
            "rank_rule": (f"model-parallel rank mp = stage * {ckpt.mesh.tp} + tensor rank (the mp_rank_XX of file "
                          "names); each (stage, tensor rank) has its data ranks zero_pp_rank_D"
                          + ("; layer files layer_LL[-model_TT] name the layer and tensor rank, held by the stage "
                             "whose set lists its tensors" if layers else "")),
            "layers": layers, "cells": cells,
            "tied": [{"name": p.name, "tied_to": p.tied_to} for p in ckpt.parameters if p.tied_to], "notes": notes}


def _held(ckpt) -> dict:
    """``{mp: [(name, block, replica)]}``: every block of the model view a set holds (``replica``: as a copy)."""
    out: dict = {}
    for name, blocks in ckpt.view.blocks.items():
        for b in blocks:
            if not (isinstance(b.source, tuple) and len(b.source) == 2):
                continue
            out.setdefault(b.source[0], []).append((name, b, False))
            for rep in b.replicas:
                if isinstance(rep, tuple) and len(rep) == 2:
                    out.setdefault(rep[0], []).append((name, b, True))
    return out


def _box(b, shape: tuple) -> Optional[list]:
    """The block's ``[start, end)`` per dim in the full tensor of ``shape`` (None: not a box of it)."""
    if tuple(b.full_strides) != row_major_strides(shape):
        return None
    rest, out = b.full_offset, []
    for d, st in enumerate(b.full_strides):
        i, rest = divmod(rest, st) if st else (0, rest)
        if i + b.shape[d] > shape[d]:
            return None
        out.append([i, i + b.shape[d]])
    return out if rest == 0 else None


def _slice(ckpt, name: str, mp: int, blocks: list, local_shape) -> dict:
    """What set ``mp`` holds of tensor ``name``: see :func:`_cell`."""
    view = ckpt.view
    shape = tuple(view.full_shape(name))
    boxes = [_box(b, shape) for b in blocks]
    copies = sorted({b.source[0] for b in blocks} | {r[0] for b in blocks for r in b.replicas if isinstance(r, tuple)})
    whole = all(bx is not None and all(lo == 0 and hi == s for (lo, hi), s in zip(bx, shape)) for bx in boxes)
    dims = sorted({d for bx in boxes if bx for d, (lo, hi) in enumerate(bx) if (lo, hi) != (0, shape[d])})
    entry = {"name": name, "role": view.roles.get(name), "shape": list(shape),
             "local_shape": list(local_shape) if local_shape is not None else None,
             "whole": whole, "replicated": whole and len(copies) > 1, "copies": copies,
             "dim": dims[0] if len(dims) == 1 and len(boxes) == 1 else None,
             "range": boxes[0][dims[0]] if len(dims) == 1 and len(boxes) == 1 and boxes[0] else None,
             "boxes": boxes if all(bx is not None for bx in boxes) else None}
    if entry["boxes"] is None:
        entry["pieces"] = [{"offset": b.full_offset, "shape": list(b.shape), "strides": list(b.full_strides)}
                           for b in blocks]
    padded = view.padded.get(name)
    if padded is not None:
        pshape = tuple(padded[0])
        mine = [_box(b, pshape) for b in padded[1] if isinstance(b.source, tuple) and b.source[0] == mp]
        if len(mine) == 1 and mine[0] and entry["dim"] is not None:
            entry["padded"] = {"shape": list(pshape), "range": mine[0][entry["dim"]]}
    return entry


def _local_shape(zs, name: str):
    for get in (zs.param, zs.buffer):
        try:
            return tuple(get(name).shape)
        except KeyError:
            continue
    return None


def _cell(ckpt, mp: int, zs, layers: list, held: list) -> dict:
    """One (stage, tensor rank): ``stage``, ``tp_rank``, ``mp_rank``, ``label``, ``model_states`` (its files),
    ``layers`` (pipeline: ``layer``, ``file``, ``tensors`` of the layer files its stage and tensor rank hold),
    ``tensors`` (every tensor of the model it holds: ``name``, ``role``, ``shape`` (the model's), ``local_shape``
    (as this set stores it), ``whole``, ``replicated`` (held whole by several sets: ``copies``, their mp ranks),
    ``dim`` and ``range`` (``[start, end)`` along ``dim``: the slice of a tensor split on one dim), ``boxes``
    (``[start, end)`` per dim of each block it holds), ``padded`` (a padded vocabulary: its ``shape`` and this
    rank's ``range`` of it)), and ``data`` (per data rank: ``dp_rank``, ``file`` (optimizer states),
    ``model_file`` (ZeRO-3's own model states), ``partitions`` (``group``, ``elements`` per partition, ``stored``:
    the fp32 elements its file holds) and ``elements``, their sum)."""
    stage = zs.coordinate.pp if ckpt.mesh.pp > 1 or ckpt.kind == "pipeline" else None
    tp = zs.coordinate.tp if ckpt.mesh.tp > 1 else None
    model, optim, own = [], {}, {}
    for f in ckpt.files:
        if f.kind in (fnames.MODEL_STATES, fnames.OPTIM_STATES) and (f.mp_rank or 0) == mp:
            if f.kind == fnames.OPTIM_STATES:
                optim[f.dp_rank] = f.relpath
            elif f.dp_rank is not None:
                own[f.dp_rank] = f.relpath
                model.append(f.relpath)
            else:
                model.append(f.relpath)
    by_name: dict = {}
    for name, b, _rep in held:
        by_name.setdefault(name, []).append(b)
    tensors = [_slice(ckpt, name, mp, bl, _local_shape(zs, bl[0].source[1] if bl[0].source[0] == mp else name))
               for name, bl in by_name.items()]
    data = []
    for d in range(zs.dp_world_size or ckpt.mesh.dp):
        parts = _partitions(zs, d)
        data.append({"dp_rank": d, "file": optim.get(d), "model_file": own.get(d), "partitions": parts,
                     "elements": sum(p["elements"] for p in parts)})
    mine = [x for x in layers if x["stage"] == stage and (x["tp_rank"] if tp is not None else None) == tp]
    return {"stage": stage, "tp_rank": tp, "mp_rank": mp, "label": ckpt.set_label(mp), "model_states": model,
            "layers": [{"layer": x["layer"], "file": x["file"], "tensors": x["tensors"]} for x in mine],
            "tensors": tensors, "data": data}


def _partitions(zs, d: int) -> list:
    out = []
    rank = zs.rank(d)
    for lay in zs.layouts:
        sizes = (list(enumerate(lay.sub_group_sizes)) if hasattr(lay, "sub_group_sizes") else
                 [(lay.group, lay.partition_size)])
        for g, size in sizes:
            try:
                stored = getattr(zs.partition_tensor(rank, g), "numel", None)
            except (CkptError, KeyError, IndexError):
                stored = None
            out.append({"group": g, "elements": int(size), "stored": stored})
    return out


__all__ = ["experts", "grid", "AUTOEP", "DEEPSPEED_MOE", "PER_EXPERT_FILES", "ZERO3_PARTITIONED", "UNIVERSAL"]
