"""The universal checkpoint of a mixture-of-experts (DeepSpeed-MoE, ZeRO-1/2) checkpoint, for one
expert-parallel size (metadata only).

What DeepSpeed 0.19.8's universal load does with an MoE engine (``load_hp_checkpoint_state``, read in its
source and checked by loading these files, tests/test_mesh_reshard.py): every parameter, dense or expert,
reads the folder ``zero/<its name in the loading engine>``, and an expert's name there holds its LOCAL id
(``...deepspeed_experts.<i>...`` on every expert-parallel rank). A file marked ``'is_expert_param': True``
with ``'ep_num_experts': K`` holds ``K`` tensors stacked on a new first dimension, and an engine at
expert-parallel size ``E > 1`` takes entries ``e * K / E .. (e + 1) * K / E - 1`` on expert-parallel rank
``e`` (at ``E = 1`` it takes the file as it is). So the folder of local expert ``i`` at target size ``E``
(``L = experts / E`` local experts per layer) holds:

* ``E = 1``: global expert ``i`` as it is (local and global ids coincide), the plain form;
* ``E > 1``: global experts ``i, L + i, 2L + i, ...`` (expert-parallel rank ``e`` holds ``e * L + i``)
  stacked, ``'ep_num_experts': E``: each rank takes exactly one, its own.

No one set of files serves two expert-parallel sizes: at another size the loader fails loudly (a folder
missing, or ``full param numel != tensor slice numel``, or ``num_experts not divisible by ep_size``),
so the folder is written for the size the user names (default: the source's). The experts' group keeps
its hyper-parameters, renamed ``ep_size_E`` (DeepSpeed copies every group entry, the name included, into
the loading engine's groups, and names the expert data-parallel group by it when it saves again).
"""
from __future__ import annotations

import re
from typing import Optional

from ..deepspeed import ZERO, Checkpoint
from ..deepspeed.moe import expert_id
from ..errors import UnsupportedCheckpointError

_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")  # as ckptlib.deepspeed.moe finds an expert's id
# the entries of a universal file that DeepSpeed 0.19.8 reads to slice an expert tensor per rank
IS_EXPERT_PARAM, EP_NUM_EXPERTS = "is_expert_param", "ep_num_experts"


def _refuse(ck: Checkpoint, why: str, hint: Optional[str] = None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


EXPORT_HINT = "`ckpt export` writes its full model (every expert under its global id)"


def target_ep(ck: Checkpoint, ep: Optional[int]) -> int:
    """The expert-parallel size a universal checkpoint of MoE checkpoint ``ck`` is written for (``ep``, default
    the source's), after refusing what DeepSpeed's universal loader cannot load exactly."""
    if ck.flavor != ZERO or ck.zero_stage not in (1, 2):
        _refuse(ck, f"a universal checkpoint of a mixture-of-experts checkpoint at ZeRO-{ck.zero_stage} ({ck.flavor}) "
                    "is not supported (checked with DeepSpeed 0.19.8 at ZeRO-1/2 only)", EXPORT_HINT)
    if len(ck.sets) > 1:
        _refuse(ck, "a universal checkpoint of a mixture-of-experts checkpoint with pipeline stages or tensor ranks "
                    "is not supported yet", EXPORT_HINT)
    frozen = [p.name for p in ck.parameters if expert_id(p.name) is not None and not p.trainable]
    if frozen:
        _refuse(ck, f"a universal checkpoint of frozen experts ({frozen[0]}, ...) is not supported yet", EXPORT_HINT)
    counts = set(ck.num_experts or [])
    if len(counts) != 1:
        _refuse(ck, f"MoE layers with different expert counts ({sorted(counts)}) are not supported yet")
    experts = counts.pop()
    ep = ck.mesh.ep if ep is None else ep
    if ep < 1 or experts % ep:
        _refuse(ck, f"{ep} expert-parallel ranks do not divide the {experts} experts of each MoE layer",
                "pick an expert-parallel size that divides the number of experts")
    return ep


def expert_folders(ck: Checkpoint, ep: int) -> dict:
    """``{folder name: [global parameter names]}`` of every expert tensor at expert-parallel size ``ep``: the
    folder is the local name, the list the global experts it holds in expert-parallel rank order."""
    experts = ck.num_experts[0]
    num_local = experts // ep
    out: dict = {}
    for p in ck.parameters:
        g = expert_id(p.name)
        if g is None or p.tied_to:
            continue
        local = _EXPERT.sub(lambda m: f"{m.group(1)}{g % num_local}{m.group(3)}", p.name, count=1)
        out.setdefault(local, [None] * ep)[g // num_local] = p.name
    for local, names in out.items():
        if None in names:
            _refuse(ck, f"the experts of {local} are incomplete: expected {experts} per MoE layer")
    return out


def stacked_entries(ep: int) -> dict:
    """The entries that mark an expert file as stacked for ``ep`` expert-parallel ranks (at ``ep`` 1 too: a plain
    file would load silently wrong at ep 2, every rank taking the experts of rank 0)."""
    return {IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: ep}


def moe_notes(ck: Checkpoint, ep: Optional[int]) -> list:
    """What the plan tells about the experts (none for a checkpoint without experts)."""
    if not ep:
        return []
    experts = ck.num_experts[0]
    how = (f"local expert i's folder holds global experts i, {experts // ep} + i, ... stacked, one for each "
           f"expert-parallel rank" if ep > 1 else "local expert i's folder holds global expert i")
    how += f" (marked '{IS_EXPERT_PARAM}', '{EP_NUM_EXPERTS}': {ep})"
    return [f"experts: written for expert-parallel size {ep} ({experts // ep} of the {experts} experts per MoE "
            f"layer on each expert-parallel rank): load it at ep {ep}, any data-parallel size that {ep} divides; at "
            f"another ep DeepSpeed's universal loader fails (it finds experts by their local ids); {how}"]


def renamed_groups(param_groups: list, ep: int) -> list:
    """``param_groups`` with every expert group named as DeepSpeed names it at expert-parallel size ``ep``."""
    out = []
    for g in param_groups:
        if isinstance(g, dict) and g.get("moe"):
            g = type(g)((k, f"ep_size_{ep}" if k == "name" else v) for k, v in g.items())
        out.append(g)
    return out


__all__ = ["target_ep", "moe_notes", "expert_folders", "stacked_entries", "renamed_groups", "IS_EXPERT_PARAM", "EP_NUM_EXPERTS",
           "EXPORT_HINT"]
