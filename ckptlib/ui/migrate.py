"""Trying a DCP export in the notebook's own kernel: an FSDP2 model on a process group of one loads it; and what
the optimizer state is and where it goes.

:func:`optimizer_groups` lists the checkpoint's optimizer groups as ``ckpt inspect`` does (:func:`ckptlib.describe`:
each group's optimizer, its own state keys, its step) and, for a DCP export, the torch optimizer that keeps the
same state (:mod:`ckptlib.kinds.optimizers`: its class and its name for each key, or why there is none) and the
param groups a plan wrote them to; :func:`optimizer_groups_html` shows that as a table whose facts are also in a
``data-facts`` attribute.

:func:`stand_in_model` builds an ``nn.Module`` with exactly the checkpoint's parameter and buffer names
and shapes (tied aliases tied, frozen parameters frozen): a placeholder for the user's own model class,
which is what a real migration loads into. :func:`load_into_fsdp2` does what a training script does:
``fully_shard``, the torch optimizers over the groups the export wrote (``torch.optim.Muon`` and ``AdamW`` for a
Muon run, ``SGD``, ``Adagrad``, ``RMSprop``, ``AdamW``; their hyper-parameters are replaced by the loaded ones
anyway), ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``. :func:`compare_with_checkpoint` then reads
each fp32 master and optimizer state back from the DeepSpeed checkpoint and compares them with what the model
and optimizers hold, bit for bit.

Memory: the model and its optimizer state (this runs the model, unlike the rest of ckptlib).
"""
from __future__ import annotations

import html
import json
import os
from typing import Any, Optional


def process_group_of_one() -> None:
    """A gloo process group of one rank in this process (an in-memory store), unless there is one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def stand_in_model(ckpt) -> Any:
    """An ``nn.Module`` with the checkpoint's names, shapes and dtypes, frozen and tied as in the checkpoint."""
    import torch
    import torch.nn as nn

    root = nn.Module()

    def owner(name: str):
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        return m, leaf

    made = {}
    for p in ckpt.parameters:
        if p.tied_to:
            continue
        m, leaf = owner(p.name)
        made[p.name] = nn.Parameter(torch.zeros(p.shape), requires_grad=p.trainable)
        m.register_parameter(leaf, made[p.name])
    for p in ckpt.parameters:
        if p.tied_to:
            m, leaf = owner(p.name)
            m.register_parameter(leaf, made[p.tied_to])
    for b in ckpt.buffers:
        m, leaf = owner(b.name)
        m.register_buffer(leaf, torch.zeros(b.shape, dtype=getattr(torch, b.dtype)))
    return root


def load_into_fsdp2(model, dcp_dir: os.PathLike, groups: list, classes: Optional[list] = None,
                    settings: Optional[list] = None) -> tuple:
    """Shard ``model`` with FSDP2, build the torch optimizers over ``groups`` (lists of parameter names;
    ``classes``: each group's ``torch.optim`` class name, as :attr:`~ckptlib.export.dcp.DcpPlan.torch_optimizers`
    says, default AdamW for all: one optimizer per class, in the order the classes first appear, as a training
    script builds them; ``settings``: each group's state-deciding hyper-parameters, ``DcpPlan.torch_settings``,
    which each optimizer is built with), load the DCP folder ``dcp_dir`` (torch layout) into both; returns
    ``(model, optimizers)``. No ``groups`` (an export of the model alone): the model only, and no optimizer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)
    from torch.distributed.fsdp import fully_shard

    process_group_of_one()
    fully_shard(model)
    if not groups:
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=os.fspath(dcp_dir))
        set_model_state_dict(model, sd["model"])
        return model, []
    named = dict(model.named_parameters())
    classes = list(classes or ["AdamW"] * len(groups))
    settings = list(settings or [{}] * len(groups))
    optims = []
    for cls in dict.fromkeys(classes):  # each optimizer's hyper-parameters are replaced by the loaded ones
        mine = [{"params": [named[n] for n in names], **s} for names, c, s in zip(groups, classes, settings) if c == cls]
        optims.append(getattr(torch.optim, cls)(mine))
    msd, osd = get_state_dict(model, optims)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=os.fspath(dcp_dir))
    set_state_dict(model, optims, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    return model, optims


def compare_with_checkpoint(ckpt, model, optimizers) -> dict:
    """``{"masters": (equal, total), <state key>: (equal, total), ..., "step": set of steps}``: what the FSDP2
    model and its optimizers hold against the checkpoint's values, read afresh, bit for bit (each state under the
    name torch's optimizer of its kind gives it: DeepSpeed's CPU Adagrad ``exp_avg_sq`` is torch's ``sum``)."""
    import torch

    optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    params = dict(model.named_parameters())
    out: dict = {"masters": [0, 0], "step": set()}
    for p in ckpt.parameters:
        if not p.trainable or p.tied_to:
            continue
        live = params[p.name]
        full = live.full_tensor() if hasattr(live, "full_tensor") else live
        out["masters"][0] += bool(torch.equal(full.detach(), ckpt.read_param(p.name)))
        out["masters"][1] += 1
        if not optimizers:  # the model alone: no state to compare
            continue
        st = next((o.state[live] for o in optimizers if live in o.state), {})
        gs = ckpt.state_group(p.name)
        for key in gs.key_names if gs is not None else ():
            v = st.get(gs.family.torch_key(key))
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            tally = out.setdefault(key, [0, 0])
            tally[0] += bool(v is not None and torch.equal(v.float(), ckpt.read_state(p.name, key)))
            tally[1] += 1
        if "step" in st:
            out["step"].add(float(st["step"]))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def held_line(same: dict) -> str:
    """:func:`compare_with_checkpoint`'s result in one line: ``"FSDP2 holds, bit for bit: 10 of 10 masters, 10 of 10
    exp_avg, ...; step [2.0]"`` (the step where the optimizers keep one)."""
    line = "FSDP2 holds, bit for bit: " + ", ".join(f"{v[0]} of {v[1]} {k}" for k, v in same.items() if k != "step")
    return line + (f"; step {sorted(same['step'])}" if same.get("step") else "")


def optimizer_refused(exc: BaseException) -> bool:
    """Whether ``exc``, a DCP export's refusal, is of its optimizer state alone (its hint is to export the model
    only: no torch optimizer keeps that state, or there is none), so that the weights alone can still be exported."""
    import ckptlib
    from ckptlib.export.dcp_optim import HINT

    return isinstance(exc, ckptlib.CkptError) and exc.hint == HINT


# ============================================================================================ the optimizer's groups
def optimizer_groups(ckpt, plan=None) -> list:
    """One dict per optimizer group of ``ckpt`` (flat group at ZeRO-1/2, sub-group at ZeRO-3), as
    :func:`ckptlib.describe` gives it (``group``, ``name``, ``optimizer``, ``label``, ``keys`` with their ``layout``
    and ``dtype``, ``step``, ``parameters``), with what a DCP export makes of it: ``torch`` (the ``torch.optim``
    class keeping the same state; None: none does, ``not_torch`` says why), ``torch_keys`` (torch's name of each
    key, and ``step`` where it counts one), and with ``plan`` (a DCP export plan writing the optimizer state)
    ``torch_groups``: ``[(torch param group, class)]`` its parameters were written to (None: no such plan; ``(-1,
    "")``: torchtitan's layout, which keeps a group per parameter).
    Metadata only."""
    from ckptlib.analysis.summary import describe
    from ckptlib.kinds.optimizers import FAMILIES, UNKNOWN

    families = {f.name: f for f in FAMILIES + (UNKNOWN,)}
    opt = describe(ckpt)["optimizer"]
    written = None
    if plan is not None and getattr(plan, "optimizer", False) and getattr(plan, "torch_optimizers", None):
        written = {}  # DeepSpeed group -> {(torch group, class)}
        titan = getattr(plan, "layout", "") == "torchtitan"  # a group per parameter: its index is not the class's
        where = {name: i for i, names in enumerate(plan.param_groups) for name in names}
        for p in ckpt.parameters:
            gs = ckpt.state_group(p.name) if p.trainable and not p.tied_to else None
            if gs is not None and p.name in where:
                i = where[p.name]
                written.setdefault(gs.group, set()).add((-1, "") if titan else (i, plan.torch_optimizers[i]))
    rows = []
    for g in (opt or {}).get("groups") or []:
        fam = families.get(g["optimizer"], UNKNOWN)
        keys = [k["key"] for k in g["keys"]]
        carried = fam.torch is not None and fam is not UNKNOWN
        rows.append(dict(g, torch=fam.torch if carried else None, not_torch="" if carried else fam.not_torch,
                         torch_keys={**{k: fam.torch_key(k) for k in keys},
                                     **({"step": "step"} if fam.steps and g["step"] is not None else {})}
                         if carried else {},
                         torch_groups=None if written is None else sorted(written.get(g["group"], ()))))
    return rows


def _keys_cell(g: dict) -> str:
    from ckptlib.kinds.optimizers import WHOLE_PARAMS

    return ", ".join(f"<code>{html.escape(k['key'])}</code> ({html.escape(k['dtype'])}"
                     + (", whole matrices per rank" if k["layout"] == WHOLE_PARAMS else "") + ")"
                     for k in g["keys"]) or "<i>no per-element state</i>"


def optimizer_groups_html(ckpt, plan=None, torch: bool = False) -> str:
    """:func:`optimizer_groups` as a table (``table.ckpt-optimizer-groups``, the rows in ``data-facts``): each group,
    its optimizer, its own state keys (dtype; Muon's whole matrices), its step and parameters; with ``torch`` the
    ``torch.optim`` class each becomes in a DCP export, torch's name of each key (``exp_avg_sq &rarr; sum``) or why
    no torch optimizer keeps that state, and where ``plan`` wrote it."""
    rows = optimizer_groups(ckpt, plan)
    if not rows:
        opt = ckpt.optimizer
        said = ("no optimizer state" if opt is None else
                f"its optimizer state ({', '.join(opt.state_keys) or 'no per-element keys'}) but not its groups")
        return f"<p class='ckpt-optimizer-groups'>the checkpoint records {html.escape(said)}</p>"
    head = ["group", "optimizer", "state keys (as saved)", "step", "parameters"]
    if torch:
        head = ["group", "optimizer", "state keys (as saved)", "&rarr; torch.optim", "torch's keys", "in the DCP export"]
    body, said = [], ""
    for g in rows:
        name = f"{g['group']}" + (f" <span style='color:#555'>{html.escape(g['name'])}</span>" if g["name"] else "")
        cells = [name, html.escape(g["label"]), _keys_cell(g)]
        if not torch:
            cells += ["&ndash;" if g["step"] is None else str(g["step"]), str(g["parameters"])]
        elif g["torch"] is None:  # why: said once for the groups that follow with the same reason
            why = html.escape(g["not_torch"]) if g["not_torch"] != said else "as above"
            said = g["not_torch"]
            cells += ["<b style='color:#b71c1c'>none</b>", f"<span style='color:#b71c1c'>{why}</span>", "&ndash;"]
        else:
            tk = ", ".join(html.escape(k if k == t else f"{k} → {t}") for k, t in g["torch_keys"].items())
            if g["torch_groups"] is None:
                where = "<i>not written</i>" if plan is not None else "&ndash;"
            else:
                where = ", ".join(f"param group {i} of torch.optim.{html.escape(c)}" if i >= 0 else
                                  "written, a group per parameter (torchtitan)" for i, c in g["torch_groups"])
            cells += [f"<b>torch.optim.{html.escape(g['torch'])}</b>", tk, where]
        body.append("<tr>" + "".join(f"<td style='text-align:left;padding:2px 8px'>{c}</td>" for c in cells) + "</tr>")
    facts = html.escape(json.dumps(rows, separators=(",", ":"), default=str), quote=True)
    heads = "".join(f"<th style='text-align:left;padding:2px 8px'>{h}</th>" for h in head)
    return (f"<table class='ckpt-optimizer-groups' data-facts=\"{facts}\"><tr>{heads}</tr>{''.join(body)}</table>")


__all__ = ["process_group_of_one", "stand_in_model", "load_into_fsdp2", "compare_with_checkpoint", "held_line",
           "optimizer_refused", "optimizer_groups", "optimizer_groups_html"]
