"""Trying a DCP export in the notebook's own kernel: an FSDP2 model on a process group of one loads it.

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
    ``(model, optimizers)``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    process_group_of_one()
    fully_shard(model)
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

    optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    params = dict(model.named_parameters())
    out: dict = {"masters": [0, 0], "step": set()}
    for p in ckpt.parameters:
        if not p.trainable or p.tied_to:
            continue
        live = params[p.name]
        full = live.full_tensor() if hasattr(live, "full_tensor") else live
        out["masters"][0] += bool(torch.equal(full.detach(), ckpt.read_param(p.name)))
        out["masters"][1] += 1
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


__all__ = ["process_group_of_one", "stand_in_model", "load_into_fsdp2", "compare_with_checkpoint"]
