"""Where things lie in a checkpoint, as plain facts the summary states and the notebooks' pictures draw.

Each function reads metadata only (the layouts, the optimizer's groups, the file list; tensor handles' shapes) and
returns JSON-ready data. :func:`describe` gathers them under ``ckpt inspect --json``'s ``placement``:

- ``groups``: each flat group (ZeRO-1/2) or sub-group (ZeRO-3) of every ZeRO set, with the optimizer that steps it
  and the state keys it keeps;
- ``whole_matrices``: at ZeRO-1/2, a state kept per whole parameter (Muon's ``momentum_buffer``): which matrices each
  rank's state holds whole, and those that straddle a partition boundary, held whole by every rank they touch;
- ``universal``: a universal folder's parameters with the states each holds, and what it lacks;
- ``experts`` and ``grid`` (:mod:`ckptlib.analysis.meshmap`): experts on expert-parallel ranks, and the pipeline x
  tensor x data grid of files.
"""
from __future__ import annotations

import os
from typing import Optional

from ..deepspeed import Checkpoint
from ..dtypes import BY_NAME
from ..errors import CkptError
from ..kinds.optimizers import WHOLE_PARAMS


def masters(ckpt: Checkpoint) -> Optional[dict]:
    """``{"dtype", "text", "states"}``: the dtype the optimizer's master weights are stored in (each trainable
    parameter's master, as the files hold it), what that means for an export, and the dtype of each per-element state
    key (``{key: dtype}``; DeepSpeed's ``bf16_optimizer_states`` keeps the moments in bf16 beside bf16 masters); None
    where there is no trainable parameter or the values cannot be read. Metadata only."""
    dtypes: dict = {}
    try:
        ckpt.check_readable()
        for zs in ckpt.sets.values():  # every parameter of a flat group shares its master tensor: one per group
            seen = set()
            for p in zs.parameters:
                if p.trainable and not p.tied_to and (p.group not in seen or p.group is None):
                    seen.add(p.group)
                    for r in zs.sources(p.name):
                        if hasattr(r, "dtype"):
                            dtypes[r.dtype] = dtypes.get(r.dtype, 0) + 1
    except (CkptError, KeyError):
        return None
    if not dtypes:
        return None
    opt = ckpt.optimizer
    states = {k.name: k.dtype for g in (opt.groups if opt else ()) for k in g.keys}
    if list(dtypes) == ["float32"]:
        return {"dtype": "float32", "text": "fp32", "states": states}
    names = ", ".join(_short(d) for d in dtypes)
    if len(dtypes) == 1 and set(dtypes) <= {"bfloat16", "float16"}:
        d = next(iter(dtypes))
        short = _short(d)
        section = ckpt.ds_config.get(short) if isinstance(ckpt.ds_config, dict) else None
        said = (lambda key: f" ({key})" if isinstance(section, dict) and section.get(key) else "")
        same = [k for k, dt in states.items() if dt == d]
        other = [f"{k} ({_short(dt)})" for k, dt in states.items() if dt != d]
        text = (f"{short}: the optimizer's master weights themselves are {short}{said(short + '_master_weights_and_grads')}"
                + (f", and so are its {', '.join(same)}{said(short + '_optimizer_states')}" if same else "")
                + (f"; its {', '.join(other)}" if other else "")
                + f"; an fp32 export is the {short} masters widened, exactly (no bit is lost), and --dtype {short} "
                  "writes them as stored: nothing rounded")
        return {"dtype": d, "text": text, "states": states}
    return {"dtype": names, "text": f"{names}: the masters of some parameters are stored in another dtype than "
                                    "others; every value is read as stored and exported exactly", "states": states}


def _short(dtype: str) -> str:
    return (BY_NAME[dtype].short or dtype) if dtype in BY_NAME else dtype


def groups(ckpt: Checkpoint) -> list[dict]:
    """One entry per flat group (ZeRO-1/2) or sub-group (ZeRO-3) of every ZeRO set: ``set`` (mp rank),
    ``set_label``, ``label``, ``group``, ``zero3``, ``ranks`` (how many it is partitioned over),
    ``elements_per_rank``, ``parameters`` (names, in flat order), and the optimizer that steps it: ``optimizer`` (its
    label), ``family``, ``keys`` (``{key, dtype, layout}``), ``step``."""
    out = []
    for mp, zs in ckpt.sets.items():
        label = ckpt.set_label(mp)
        prefix = f"{label} · " if label else ""
        states = {g.group: g for g in zs.optimizer.groups} if zs.optimizer is not None else {}
        for lay in zs.layouts:
            if hasattr(lay, "sub_group_sizes"):  # ZeRO-3
                panels = [(k, f"sub-group {k}", size, lay.world_of(k), [s.name for s in lay.slots if s.sub_group == k])
                          for k, size in enumerate(lay.sub_group_sizes)]
                zero3 = True
            else:
                panels = [(lay.group, f"group {lay.group}", lay.partition_size, lay.world_size,
                           [s.name for s in lay.slots])]
                zero3 = False
            for g, what, size, ranks, names in panels:
                gs = states.get(g)
                out.append({"set": mp, "set_label": label, "label": prefix + what, "group": g, "zero3": zero3,
                            "ranks": ranks, "elements_per_rank": size, "parameters": names,
                            "name": gs.name if gs else None,
                            "optimizer": gs.family.label if gs else None, "family": gs.family.name if gs else None,
                            "keys": [{"key": k.name, "dtype": k.dtype, "layout": k.layout} for k in gs.keys] if gs else [],
                            "step": gs.step if gs else None})
    return out


def whole_matrices(ckpt: Checkpoint) -> list[dict]:
    """For each ZeRO-1/2 group whose state is kept per whole parameter (Muon's ``momentum_buffer``): ``set``,
    ``label``, ``group``, ``key``, ``optimizer``, ``partition`` (elements per rank), and per rank: its partition
    ``[start, end)`` of the flat group, the ``matrices`` its state holds whole (``name``, ``offset`` in the flat
    group, ``numel``, ``state_offset`` in the rank's state, ``ranks`` holding it, ``straddles``: more than one rank
    does), their total ``length``, and ``stored``: the elements the rank's file holds for the key (None where it
    cannot be read). Metadata only (tensor handles' shapes)."""
    out = []
    for mp, zs in ckpt.sets.items():
        if zs.optimizer is None:
            continue
        label = ckpt.set_label(mp)
        for lay in zs.layouts:
            if hasattr(lay, "sub_group_sizes"):
                continue
            gs = next((g for g in zs.optimizer.groups if g.group == lay.group), None)
            key = next((k for k in gs.keys if k.layout == WHOLE_PARAMS), None) if gs else None
            if key is None:
                continue
            places = {s.name: lay.whole_param_places(s.name) for s in lay.slots}
            ranks = []
            for r in range(lay.world_size):
                start, end = lay.rank_range(r)
                mats = [{"name": s.name, "offset": s.offset, "numel": s.numel,
                         "state_offset": dict(places[s.name])[r], "ranks": [q for q, _ in places[s.name]],
                         "straddles": len(places[s.name]) > 1} for s in lay.partition_params(r)]
                try:
                    stored = zs.partition_tensor(zs.rank(r), lay.group, key.name).numel
                except (CkptError, KeyError):
                    stored = None
                ranks.append({"rank": r, "partition": [start, end], "matrices": mats,
                              "length": lay.whole_params_length(r), "stored": stored})
            out.append({"set": mp, "label": (f"{label} · " if label else "") + f"group {lay.group}",
                        "group": lay.group, "name": gs.name, "key": key.name, "dtype": key.dtype,
                        "optimizer": gs.family.label, "partition": lay.partition_size, "ranks": ranks})
    return out


def universal(ckpt: Checkpoint) -> Optional[dict]:
    """A universal folder's contents (None for a native checkpoint): each trainable parameter with the states its
    ``zero/<parameter>/`` holds (``{key: file}``, ``fp32`` the master) and its step; each frozen parameter and buffer
    with the file its value comes from (None: the folder holds none); ``absent``: what it cannot give, in words."""
    u = ckpt.universal
    if u is None:
        return None
    main = ckpt.main
    base = os.fspath(ckpt.location.tag_dir).rstrip("/") + "/"
    rel = (lambda p: p[len(base):] if p and p.startswith(base) else p)
    params, frozen = [], []
    for p in ckpt.parameters:
        if p.tied_to:
            continue
        if p.trainable:
            frags = main.fragments.get(p.name, {})
            params.append({"name": p.name, "shape": list(p.shape),
                           "states": {("fp32" if k is None else k): frag.info.relpath for k, frag in frags.items()
                                      if hasattr(frag, "info")},
                           "step": u.steps.get(p.name)})
        else:
            frozen.append({"name": p.name, "shape": list(p.shape), "file": rel(main.value_file(p.name))})
    buffers = [{"name": b.name, "shape": list(b.shape), "file": rel(main.value_file(b.name))} for b in ckpt.buffers]
    lacks = [line for line in u.absent]
    return {"parameters": params, "frozen": frozen, "buffers": buffers, "absent": lacks,
            "written_by": u.written_by,
            "keys": sorted({k for p in params for k in p["states"]}, key=lambda k: (k != "fp32", k))}


def describe(ckpt: Checkpoint) -> dict:
    """Every placement fact of ``ckpt`` (see the module docstring). Metadata only."""
    from . import meshmap

    return {"groups": groups(ckpt), "whole_matrices": whole_matrices(ckpt), "universal": universal(ckpt),
            "experts": meshmap.experts(ckpt), "grid": meshmap.grid(ckpt)}


__all__ = ["masters", "groups", "whole_matrices", "universal", "describe"]
