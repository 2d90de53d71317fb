"""AutoEP checkpoints (ZeRO-1/2, per-expert files) at another expert-parallel and data-parallel size (metadata only).

At expert-parallel size ``E'`` and world ``W'``, rank ``r`` is ep rank ``e = r mod E'`` and holds the global experts
``[e·L', (e+1)·L')`` (``L' = E / E'``) of every AutoEP layer, stacked as ``experts.w1/w2/w3`` [L', ...]
(:mod:`ckptlib.deepspeed.autoep`). Its optimizer file holds every dense group re-cut for ``W'`` ranks (partition
``r``) and the expert group made of its ep rank's stacked experts (rows ``[e·L', (e+1)·L')`` of each full
``[E, ...]`` weight, in the source's parameter order), partitioned over the ``W' / E'`` ranks that hold the same
experts (partition ``r // E'``) and named ``ep_size_{E'}`` as DeepSpeed names it.

``mp_rank_00_model_states.pt`` gets the expert group's local shapes, the new world size and ``ds_autoep_layers``
(also in ``universal_checkpoint_info``) as data-parallel rank 0 of the new mesh records it: ``ep_size``,
``num_local_experts``, the placement of every ep rank's experts and the affine maps of its stacked weights, ep
rank 0's ``global_expert_start/end``. The 16-bit per-expert files name global ids: they are copied as they are
(DeepSpeed's AutoEP load stacks each rank's experts from them).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional


from ..deepspeed import ZERO, Checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.autoep import KEY, split_ep_name
from ..errors import UnsupportedCheckpointError
from ..kinds.optimizers import WHOLE_PARAMS
from ..layout.flat import FlatGroupLayout, Zero3Layout, Zero3Slot, chunk_size
from ..layout.ranges import Zeros, slice_ranges
from ..layout.placement import row_major_strides
from ..mesh import Mesh
from ..plan import CopyFile
from .moe import ExpertWriter, expert_files, expert_mesh
from .trees import TreeFiles, carried_client, converter_scripts, replace
from .zero3 import Zero3Writer


def _refuse(ck: Checkpoint, why: str, hint=None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


class AutoEPWriter(ExpertWriter):
    """The optimizer-states files of an AutoEP checkpoint at ``world`` ranks and ``ep`` expert-parallel ranks."""

    def __init__(self, ck: Checkpoint, world: int, ep: int):
        zs = ck.main
        self.ck, self.ep = ck, ep
        self.num_local = zs.records.autoep_layers[0].num_experts // ep
        self.expert_groups = dict(zs.records.expert_groups)
        dst = []
        for g, lay in enumerate(zs.layouts):
            if g in self.expert_groups:  # the slots are the local names; their full [E, ...] weights cut by rows
                names = [(split_ep_name(s.name) or (s.name, 0))[0] for s in lay.slots]
                dst.append(FlatGroupLayout.build([(n, (self.num_local, *ck.view.full_shape(n)[1:])) for n in names],
                                                 world // ep, group=g))
            else:
                dst.append(FlatGroupLayout.build([(s.name, s.shape) for s in lay.slots], world, group=g))
        super().__init__(zs, dst, world, zs.mp)

    def source_of(self, g: int, rank: int, name: str) -> tuple[str, int]:
        if g not in self.expert_groups:
            return name, 0
        return name, (rank % self.ep) * self.placement(g, rank)[0].slot(name).numel  # this ep rank's rows

    def param_ranges(self, g: int, rank: int, name: str, key: str) -> list:
        if g in self.expert_groups:
            _refuse(self.ck, "a state kept per whole parameter (Muon) in an AutoEP expert group cannot be resharded yet")
        return self.ck.sources(name, key)


def target_layers(recorded: list, world: int, ep: int, rank: int = 0) -> list:
    """``ds_autoep_layers`` as data rank ``rank`` of a run at ``world`` ranks and ``ep`` expert-parallel ranks
    records it (ZeRO-1/2 save rank 0's, ZeRO-3 each rank its own): each recorded entry with its ep size, local
    experts, placement, the affine maps of its stacked weights and the rank's place changed (everything else as
    recorded)."""
    out = []
    for d in recorded:
        n = int(d["num_experts"])
        local = n // ep
        maps = {}
        for name, m in ((d.get("affine_maps") or {}).get("params") or {}).items():
            shape = [int(s) for s in m["logical_shape"]]
            strides = list(row_major_strides(shape))
            shard = [local, *shape[1:]]
            maps[name] = dict(m, ranks={e: {"shard_shape": list(shard), "pieces": [
                {"shape": list(shard), "source": [e * local * strides[0], strides], "dest": [0, strides],
                 "locations": [e]}]} for e in range(ep)})
        e = rank % ep
        entry = dict(d, num_local_experts=local, ep_size=ep, ep_group_name=f"ep_size_{ep}", ep_rank=e,
                     expert_data_parallel_rank=rank // ep, expert_data_parallel_world_size=world // ep,
                     global_expert_start=e * local, global_expert_end=(e + 1) * local,
                     expert_placement=dict(d.get("expert_placement") or {}, num_experts=n, ep_size=ep, ranks=[
                         {"rank": e, "experts": list(range(e * local, (e + 1) * local))} for e in range(ep)]))
        if "affine_maps" in d:
            entry["affine_maps"] = dict(d["affine_maps"], params=maps)
        out.append(entry)
    return out


def plan_autoep_files(ck: Checkpoint, mesh: Mesh, hf_files: bool = True) -> tuple[list, list]:
    """``(files, notes)`` of AutoEP checkpoint ``ck`` at ``mesh.dp`` ranks and ``mesh.ep`` expert-parallel ranks."""
    if ck.flavor != ZERO or ck.zero_stage not in (1, 2, 3):
        _refuse(ck, f"resharding an AutoEP checkpoint at ZeRO-{ck.zero_stage} ({ck.flavor}) is not supported yet")
    if (mesh.tp, mesh.pp) != (1, 1):
        _refuse(ck, "an AutoEP checkpoint has no tensor or pipeline axis to change")
    layers = ck.records.autoep_layers
    n, world, ep = expert_mesh(ck, [lay.num_experts for lay in layers], mesh, "AutoEP")
    if any(k.layout == WHOLE_PARAMS for g in (ck.optimizer.groups if ck.optimizer else []) for k in g.keys):
        _refuse(ck, "Muon with AutoEP cannot be resharded yet")
    if (ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        _refuse(ck, "round_robin_gradients: resharding an AutoEP checkpoint with it is not supported yet")
    if ck.zero_stage == 3:
        return zero3_files(ck, world, ep, hf_files)
    writer = AutoEPWriter(ck, world, ep)
    model = ck.main.model_states_file().obj
    recorded = model.get(KEY) or []
    new_layers = target_layers(recorded, world, ep)
    files = expert_files(ck, writer, _model_entries(model, new_layers, ep))
    notes = [f"AutoEP experts: {n} per layer, {n // ep} on each of {ep} expert-parallel rank(s), each expert group "
             f"partitioned over {world // ep} rank(s); the per-expert files are copied (they name global ids); load it "
             f"with \"expert_parallel\": {{\"autoep_size\": {ep}}}"]
    carried, more = carried_client(ck, world, hf_files)
    return files + carried, notes + more


def _model_entries(model: dict, layers: list, ep: int) -> dict:
    """The entries of a model-states file that name the AutoEP layers: ``ds_autoep_layers``, its copy in
    ``universal_checkpoint_info``, the config's ``autoep_size``."""
    info = model.get("universal_checkpoint_info")
    cfg = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else None
    repl = {KEY: layers}
    if isinstance(info, dict) and KEY in info:
        repl["universal_checkpoint_info"] = dict(info, **{KEY: layers})
    if cfg is not None and isinstance(cfg.get("expert_parallel"), dict):
        repl["ds_config"] = dict(cfg, expert_parallel=dict(cfg["expert_parallel"], autoep_size=ep))
    return repl


class AutoEPZero3Writer(Zero3Writer):
    """The files of a ZeRO-3 AutoEP checkpoint at ``world`` ranks and ``ep`` expert-parallel ranks: every sub-group
    as the source cuts them (one per param group), the dense ones partitioned over all ranks, the experts' over
    each ep rank's ``world / ep`` members (rank ``r``: ep rank ``r % ep``, member ``r // ep``), its flat tensor
    holding that ep rank's rows of each full expert weight; ``ds_zero_partition_groups`` and every rank's
    ``ds_autoep_layers`` as DeepSpeed records them at that mesh."""

    def __init__(self, ck: Checkpoint, world: int, ep: int):
        zs = ck.main
        self.ck, self.ep, self.world = ck, ep, world
        self.num_local = zs.records.autoep_layers[0].num_experts // ep
        src = zs.layouts[0]
        parts = zs.optimizer_state_dict(zs.rank(0)).get("ds_zero_partition_groups") or []
        self.expert_subs = {j for j, e in enumerate(parts) if "autoep_expert" in (e.get("families") or [])}
        subs, worlds = [], []
        for j in range(len(src.sub_group_sizes)):
            slots = []
            for s in src.sub_group_slots(j):
                local = (split_ep_name(s.name) or (s.name, 0))[0]
                if j in self.expert_subs:
                    if local in [n for n, _ in slots]:
                        continue  # one slot per local name: every ep rank's flat has the same layout
                    slots.append((local, (self.num_local, *ck.view.full_shape(local)[1:])))
                else:
                    slots.append((s.name, s.shape))
            subs.append(slots)
            worlds.append(world // ep if j in self.expert_subs else world)
        groups = zs.optimizer_state_dict(zs.rank(0))["optimizer_state_dict"]["param_groups"]
        if any(len(g["params"]) != 1 for g in groups):
            _refuse(ck, "a ZeRO-3 AutoEP checkpoint whose parameter groups are cut into several sub-groups "
                        "(sub_group_size) cannot be resharded yet")
        super().__init__(zs, rebuilt_layout(subs, world, worlds), [list(g["params"]) for g in groups], world, zs.mp)
        self.parts = parts

    def sub_group_ranges(self, k: int, rank: int, key) -> list:
        w = self.dst.world_of(k)
        member = rank // self.ep if k in self.expert_subs else rank
        out: list = []
        for s in self.dst.sub_group_slots(k):
            full = self.ck.sources(s.name, key)
            base = (rank % self.ep) * s.numel if k in self.expert_subs else 0  # this ep rank's rows
            c = chunk_size(s.numel, w)
            real = max(0, min(c, s.numel - member * c))
            out += (slice_ranges(full, base + member * c, real) if real else []) + ([Zeros(c - real)] if c - real else [])
        return out

    def optim_states(self, rank: int) -> tuple:
        name, top = super().optim_states(rank)
        osd = top["optimizer_state_dict"]
        parts = []
        for j, e in enumerate(self.parts):
            ranks = ([r for r in range(self.world) if r % self.ep == rank % self.ep] if j in self.expert_subs
                     else list(range(self.world)))
            parts.append(dict(e, partition_count=len(ranks), partition_rank=ranks.index(rank), partition_ranks=ranks,
                              group_names=[f"ep_size_{self.ep}"] if j in self.expert_subs else e.get("group_names")))
        return name, replace(top, optimizer_state_dict=replace(osd, ds_zero_partition_groups=parts))

    def model_states(self) -> dict:
        model = self.ck.main.model_states_file(self.ck.main.rank(0)).obj
        shapes = self.param_shapes()
        return {fnames.model_states_name(self.mp, dp_rank=r): replace(
            model, dp_world_size=self.world, param_shapes=shapes,
            **_model_entries(model, target_layers(model.get(KEY) or [], self.world, self.ep, r), self.ep))
            for r in range(self.world)}


def rebuilt_layout(subs: list, world: int, worlds: list):
    """A Zero3Layout of ``subs`` whose sub-groups are partitioned over ``worlds`` ranks each."""
    slots, sizes = [], []
    for j, params in enumerate(subs):
        offset = 0
        for name, shape in params:
            slots.append(Zero3Slot(name=name, shape=tuple(shape), sub_group=j, offset=offset))
            offset += chunk_size(math.prod(shape), worlds[j])
        sizes.append(offset)
    return Zero3Layout(slots=tuple(slots), world_size=world, sub_group_sizes=tuple(sizes), sub_group_worlds=tuple(worlds))


def zero3_files(ck: Checkpoint, world: int, ep: int, hf_files: bool, writer_type=None,
                tag: Optional[str] = None) -> tuple[list, list]:
    """``(files, notes)`` of a ZeRO-3 AutoEP checkpoint at ``world`` ranks and ``ep`` expert-parallel ranks
    (``writer_type``: the :class:`AutoEPZero3Writer` to cut them with, a universal folder's; ``tag``: the output's)."""
    if any(not p.trainable and not p.tied_to for p in ck.parameters):
        _refuse(ck, "frozen parameters in a ZeRO-3 AutoEP checkpoint cannot be resharded yet")
    writer = (writer_type or AutoEPZero3Writer)(ck, world, ep)
    tag, trees = tag or ck.location.tag, TreeFiles()
    files = [trees.make(f"{tag}/{name}", "model_states", obj, fnames.classify(name).dp_rank)
             for name, obj in writer.model_states().items()]
    for r in range(world):
        name, obj = writer.optim_states(r)
        files.append(trees.make(f"{tag}/{name}", "optim_states", obj, r))
    files += [CopyFile(Path(s).name, s, os.path.getsize(s)) for s in converter_scripts(ck)]
    carried, notes = carried_client(ck, world, hf_files)
    n = ck.records.autoep_layers[0].num_experts
    return files + carried, [f"AutoEP experts (ZeRO-3): {n} per layer, {n // ep} on each of {ep} expert-parallel "
                             f"rank(s), partitioned over its {world // ep} member rank(s); load it with "
                             f"\"expert_parallel\": {{\"autoep_size\": {ep}}}"] + notes


__all__ = ["plan_autoep_files", "AutoEPWriter", "AutoEPZero3Writer", "target_layers", "zero3_files", "rebuilt_layout"]
