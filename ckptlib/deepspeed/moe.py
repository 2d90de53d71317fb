"""Mixture-of-experts checkpoints (DeepSpeed-MoE): experts under their global ids.

With expert parallelism E the world's ranks form expert-parallel groups of E consecutive ranks; rank
``r`` is expert-parallel rank ``e = r % E`` and holds the experts ``e * L .. e * L + L - 1`` (``L``
local experts per MoE layer), which its files name by their LOCAL ids (``deepspeed_experts.0..L-1``).
The ZeRO optimizer keeps the experts in their own parameter group (``'moe': True``, named
``ep_size_E``), partitioned over the ``N / E`` ranks that hold the same experts (the expert
data-parallel group ``e, e + E, e + 2E, ...``, its ``partition_count``). The 16-bit expert weights are in
``layer_{L}_expert_{G}_mp_rank_00_model_states.pt`` files under their global ids.

This module turns local names into global ones and says which data rank holds which partition.
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from typing import Optional

from ..io.torchzip import TensorHandle
from . import files as fnames
from .fileset import OpenedFiles

_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")


def is_moe(fs: OpenedFiles, model: dict) -> bool:
    return bool(model.get("num_experts")) or any(f.kind in (fnames.EXPERT_STATES, fnames.EXPERT_OPTIM_STATES)
                                                 for f in fs.files)


def expert_id(name: str) -> Optional[int]:
    m = _EXPERT.search(name)
    return int(m.group(2)) if m else None


def with_expert_id(name: str, expert: int) -> str:
    """``...deepspeed_experts.{i}...`` -> ``...deepspeed_experts.{expert}...``."""
    return _EXPERT.sub(lambda m: f"{m.group(1)}{expert}{m.group(3)}", name, count=1)


def global_name(local: str, ep_rank: int, num_local: int) -> str:
    """``...deepspeed_experts.{l}...`` of expert-parallel rank ``ep_rank`` -> ``...deepspeed_experts.{G}...``."""
    return _EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}", local, count=1)


@dataclass(frozen=True)
class ExpertGroup:
    """An optimizer group of experts: ``ep`` expert-parallel ranks, each holding ``num_local`` experts
    per layer, partitioned over ``edp`` data ranks (``ep * edp`` = the data-parallel size)."""

    group: int
    ep: int
    edp: int
    num_local: int
    autoep: bool = False

    def global_name(self, local: str, ep_rank: int) -> str:
        """The name of expert-parallel rank ``ep_rank``'s tensor ``local`` in the model: DeepSpeed-MoE's experts
        under their global ids, AutoEP's stacked experts under :func:`~ckptlib.deepspeed.autoep.ep_name`."""
        return f"{local}@ep{ep_rank}" if self.autoep else global_name(local, ep_rank, self.num_local)

    def data_rank(self, ep_rank: int, partition: int) -> int:
        """The data rank holding partition ``partition`` of expert-parallel rank ``ep_rank``'s experts."""
        return ep_rank + partition * self.ep

    def ep_rank_of(self, data_rank: int) -> int:
        return data_rank % self.ep


def expert_groups(param_groups: list, param_shapes: list, counts: list, world: int,
                  autoep_local: Optional[int] = None) -> dict[int, ExpertGroup]:
    """The expert groups among a ZeRO-1/2 optimizer's groups (``param_groups`` of rank 0's base
    optimizer state, the model's ``param_shapes``, the ``partition_count`` of each group); ``autoep_local``: an
    AutoEP checkpoint's local experts per ep rank (its experts are stacked tensors, named the same on every ep
    rank)."""
    out = {}
    for g, pg in enumerate(param_groups):
        if not (isinstance(pg, dict) and pg.get("moe")) or g >= len(param_shapes):
            continue
        edp = int(counts[g])
        ids = {expert_id(n) for n in param_shapes[g]} - {None}
        m = re.match(r"ep_size_(\d+)$", str(pg.get("name", "")))
        ep = int(m.group(1)) if m else max(1, world // max(edp, 1))
        out[g] = ExpertGroup(group=g, ep=ep, edp=edp, num_local=autoep_local or len(ids) or 1,
                             autoep=autoep_local is not None)
    return out


def expert_file_tensors(fs: OpenedFiles) -> "collections.OrderedDict[str, TensorHandle]":
    """The 16-bit expert weights of every ``layer_{L}_expert_{G}`` file, under their global names, in
    (layer, expert) order."""
    out = collections.OrderedDict()
    for f in sorted((f for f in fs.files if f.kind == fnames.EXPERT_STATES), key=lambda f: (f.layer or 0, f.expert)):
        tf = fs.get(f)
        if tf is not None and isinstance(tf.obj, dict):
            out.update((k, v) for k, v in tf.obj.items() if isinstance(v, TensorHandle))
    return out


def expert_file_problems(fs: OpenedFiles, model: dict) -> list[str]:
    """Expert files that do not hold their expert (left over from another run, damaged), and the expert
    files the model's ``num_experts`` expects but the folder lacks, one sentence each naming the file."""
    out = []
    counts = model.get("num_experts")
    counts = list(counts) if isinstance(counts, (list, tuple)) else None
    for f in (f for f in fs.files if f.kind == fnames.EXPERT_STATES):
        tf = fs.get(f)
        if tf is None:
            continue  # unreadable: already a problem
        layer = f.layer or 0
        if counts is not None and (layer >= len(counts) or f.expert >= int(counts[layer])):
            out.append(f"{f.relpath}: the model has {counts[layer] if layer < len(counts) else 0} experts in MoE "
                       f"layer {layer}, this file is for expert {f.expert}: an expert file of another run")
            continue
        keys = [k for k, v in tf.obj.items() if isinstance(v, TensorHandle)] if isinstance(tf.obj, dict) else []
        if not keys or any(expert_id(k) != f.expert for k in keys):
            out.append(f"{f.relpath}: holds no tensors of expert {f.expert} (its keys do not name "
                       f"deepspeed_experts.{f.expert}): left over from another run, or damaged")
    out += _odd_expert_keys(fs)
    if counts is not None:
        have = {(f.layer or 0, f.expert) for f in fs.files if f.kind == fnames.EXPERT_STATES}
        for layer, n in enumerate(counts):
            for g in range(int(n)):
                if (layer, g) not in have:
                    out.append(f"{fs.location.tag}/{fnames.expert_states_name(layer, g)} is missing (the model has "
                               f"{n} experts in MoE layer {layer}); a rank did not finish saving")
    return out


def _odd_expert_keys(fs: OpenedFiles) -> list[str]:
    """Expert files of a MoE layer whose keys, with the expert number left out, are not those of the layer's other
    expert files (every expert of a layer has the same tensors): a damaged name (a file in torch's legacy
    serialization has no CRC-32 to reveal it) or a file of another model. Those that differ from the most common
    set are named (every file, when no set is the most common)."""
    by_layer: dict = collections.defaultdict(dict)
    for f in (f for f in fs.files if f.kind == fnames.EXPERT_STATES):
        tf = fs.get(f)
        if tf is not None and isinstance(tf.obj, dict):
            keys = frozenset(_EXPERT.sub(lambda m: f"{m.group(1)}*{m.group(3)}", str(k), count=1)
                             for k, v in tf.obj.items() if isinstance(v, TensorHandle))
            by_layer[f.layer or 0][f.relpath] = keys
    out = []
    for files in by_layer.values():
        counts = collections.Counter(files.values())
        if len(counts) < 2:
            continue
        (common, n), *rest = counts.most_common()
        tie = any(m == n for _, m in rest)
        for name, keys in files.items():
            if tie or keys != common:
                odd = sorted(keys - common) or sorted(common - keys)
                out.append(f"{name}: its tensors are not those of the layer's other expert files "
                           f"({len(keys ^ common)} names differ, e.g. {odd[0] if odd else '?'}): damaged, or from "
                           "another model")
    return out


def with_experts(module: dict, experts: dict) -> dict:
    """``module`` with the expert tensors placed where the un-distributed model's ``state_dict`` has them:
    after the last entry of the MoE layer they belong to (its gate), or at the end."""
    out = list(module.items())
    by_layer: dict = collections.OrderedDict()
    for name, t in experts.items():  # a name without the marker (damaged) goes last; expert_file_problems names it
        cut = name.find("experts.deepspeed_experts.")
        by_layer.setdefault(name[:cut] if cut >= 0 else "\0", []).append((name, t))
    for prefix, items in by_layer.items():
        anchor = max((i for i, (k, _) in enumerate(out) if k.startswith(prefix)), default=len(out) - 1)
        out[anchor + 1:anchor + 1] = items
    return collections.OrderedDict(out)


__all__ = ["with_expert_id", "with_experts", "expert_file_problems", "is_moe", "expert_id", "global_name", "ExpertGroup", "expert_groups", "expert_file_tensors"]
