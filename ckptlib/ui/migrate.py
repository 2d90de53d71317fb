"""Trying a DCP export in the notebook's own kernel: an FSDP2 model on a process group of one loads it.

:func:`stand_in_model` builds an ``nn.Module`` with exactly the checkpoint's parameter and buffer names
and shapes (tied aliases tied, frozen parameters frozen): a placeholder for the user's own model class,
which is what a real migration loads into. :func:`load_into_fsdp2` does what a training script does:
``fully_shard``, ``torch.optim.AdamW`` over the groups the export wrote (its hyper-parameters are
replaced by the loaded ones anyway), ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``.
:func:`compare_with_checkpoint` then reads each fp32 master and moment back from the DeepSpeed checkpoint
and compares them with what the model and optimizer hold, bit for bit.

Memory: the model and its optimizer state (this runs the model, unlike the rest of ckptlib).
"""
from __future__ import annotations

import os
from typing import Any


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


def load_into_fsdp2(model, dcp_dir: os.PathLike, groups: list) -> tuple:
    """Shard ``model`` with FSDP2, build AdamW over ``groups`` (lists of parameter names), load the DCP
    folder ``dcp_dir`` (torch layout) into both; returns ``(model, optimizer)``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    process_group_of_one()
    fully_shard(model)
    named = dict(model.named_parameters())
    optim = torch.optim.AdamW([{"params": [named[n] for n in names]} for names in groups])
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=os.fspath(dcp_dir))
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    return model, optim


def compare_with_checkpoint(ckpt, model, optim) -> dict:
    """``{"masters": (equal, total), "exp_avg": ..., "exp_avg_sq": ..., "step": set of steps}``: what the
    FSDP2 model and optimizer hold against the checkpoint's values, read afresh, bit for bit."""
    import torch

    params = dict(model.named_parameters())
    out = {"masters": [0, 0], "exp_avg": [0, 0], "exp_avg_sq": [0, 0], "step": set()}
    for p in ckpt.parameters:
        if not p.trainable or p.tied_to:
            continue
        live = params[p.name]
        full = live.full_tensor() if hasattr(live, "full_tensor") else live
        out["masters"][0] += bool(torch.equal(full.detach(), ckpt.read_param(p.name)))
        out["masters"][1] += 1
        st = optim.state[live]
        for key in ("exp_avg", "exp_avg_sq"):
            v = st[key].full_tensor() if hasattr(st[key], "full_tensor") else st[key]
            out[key][0] += bool(torch.equal(v, ckpt.read_state(p.name, key)))
            out[key][1] += 1
        out["step"].add(float(st["step"]))
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


__all__ = ["process_group_of_one", "stand_in_model", "load_into_fsdp2", "compare_with_checkpoint"]
