"""Mixture-of-experts (DeepSpeed-MoE, ZeRO-1/2) checkpoints at another expert-parallel and data-parallel size
(metadata only).

At expert-parallel size ``E'`` and world ``W'`` (the data-parallel size of the dense weights), rank ``r`` is
expert-parallel rank ``e = r mod E'`` and holds the experts ``e * L' .. e * L' + L' - 1`` of every MoE layer
(``L' = experts / E'``), which its files name by their local ids. Its optimizer file holds:

- every dense group re-cut for ``W'`` ranks (partition ``r``), as a data-parallel reshard does;
- every expert group re-made from its own experts (local names, in the module's order: layer by layer, expert
  by expert, each expert's tensors in the order the source lists them), partitioned over the ``W' / E'`` ranks
  holding the same experts (partition ``r // E'``), the group renamed ``ep_size_{E'}`` as DeepSpeed names it;
  each expert's master and moments are its global expert's, read under its global id.

``mp_rank_00_model_states.pt`` gets rank 0's ``param_shapes`` (local names) and the new world size; the
16-bit expert files ``layer_{L}_expert_{G}_*`` name global ids and are copied as they are.
"""
from __future__ import annotations

import collections
import os
import re
from pathlib import Path

from ..deepspeed import ZERO, Checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.moe import expert_id, global_name
from ..errors import UnsupportedCheckpointError
from ..io.torchzip.standins import TorchSize
from ..layout.flat import FlatGroupLayout
from ..layout.ranges import Zeros, slice_ranges
from ..mesh import Mesh
from ..plan import CopyFile
from .footprint import RankFootprint, footprint, state_bytes
from .trees import TreeFiles, carried, carried_client, converter_scripts, replace
from .zero12 import Zero12Writer

LOCAL_EXPERT = re.compile(r"^(.*deepspeed_experts\.)(\d+)(\..*)$")


def _refuse(ck: Checkpoint, why: str, hint=None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


def local_pattern(names: list) -> list:
    """``[(prefix, [suffixes])]`` of an expert group's local names: each MoE layer (its prefix) with the
    tensors of one expert (suffixes, in order), checked to repeat identically for every local expert."""
    layers: "collections.OrderedDict[str, collections.OrderedDict]" = collections.OrderedDict()
    for n in names:
        m = LOCAL_EXPERT.match(n)
        if m is None:
            raise ValueError(f"{n} in an expert group is not an expert's tensor")
        layers.setdefault(m.group(1), collections.OrderedDict()).setdefault(int(m.group(2)), []).append(m.group(3))
    out = []
    for prefix, experts in layers.items():
        ids = list(experts)
        suffixes = experts[ids[0]]
        if ids != list(range(len(ids))) or any(experts[i] != suffixes for i in ids):
            raise ValueError(f"the experts of {prefix} are not listed alike in their group")
        out.append((prefix, suffixes))
    return out


def expert_mesh(ck: Checkpoint, counts, mesh: Mesh, what: str = "MoE") -> tuple[int, int, int]:
    """``(experts per layer, world, ep)`` of a checkpoint whose ``what`` layers hold ``counts`` experts, at ``mesh``;
    refused where the layers' counts differ or the expert-parallel size divides the experts or the world not."""
    counts = set(counts)
    if len(counts) != 1:
        _refuse(ck, f"{what} layers with different expert counts ({sorted(counts)}) are not supported yet")
    experts, world, ep = counts.pop(), mesh.dp, mesh.ep
    if experts % ep or world % ep:
        _refuse(ck, f"{ep} expert-parallel ranks must divide the {experts} experts and the world of {world} ranks",
                hint="pick an expert-parallel size that divides both (--ep)")
    return experts, world, ep


class ExpertWriter(Zero12Writer):
    """What writers of checkpoints with expert groups share (DeepSpeed-MoE's, AutoEP's): an expert group is
    partitioned over the ``m / ep`` ranks holding the same experts (target rank ``r``: partition ``r // ep``) and named
    ``ep_size_{ep}``; each stretch of a target partition comes from a full tensor of the source (:meth:`source_of`).
    Subclasses set ``ck``, ``ep``, ``expert_groups`` and call :meth:`Zero12Writer.__init__`."""

    def placement(self, g: int, rank: int):
        if g in self.expert_groups:
            return self.dst[g], rank // self.ep, self.m // self.ep
        return self.dst[g], rank, self.m

    def group_overrides(self, g: int) -> dict:
        return {"name": f"ep_size_{self.ep}"} if g in self.expert_groups else {}

    def source_of(self, g: int, rank: int, name: str) -> tuple[str, int]:
        """``(full tensor, element where target tensor name of group g on rank starts in it)``."""
        raise NotImplementedError

    def partition_ranges(self, g: int, rank: int, padded: bool, key) -> list:
        lay, idx, _ = self.placement(g, rank)
        segs = lay.segments(idx)
        if not padded:
            while segs and segs[-1].is_padding:
                segs.pop()
        full = self.__dict__.setdefault("_full", {})
        out: list = []
        for seg in segs:
            if seg.is_padding:
                out.append(Zeros(seg.count))
                continue
            name, at = self.source_of(g, rank, seg.name)
            if (name, key) not in full:
                full[(name, key)] = self.ck.sources(name, key)
            out += slice_ranges(full[(name, key)], at + seg.param_start, seg.count)
        return out

    def feeds(self, rank: int) -> list:
        return []

    def param_shapes(self) -> list:
        return [collections.OrderedDict((s.name, TorchSize(s.shape)) for s in lay.slots) for lay in self.dst]


class MoEWriter(ExpertWriter):
    """The optimizer-states files of an MoE checkpoint at ``world`` ranks and ``ep`` expert-parallel ranks."""

    def __init__(self, ck: Checkpoint, world: int, ep: int, num_experts: int):
        zs = ck.main
        self.ck, self.ep, self.num_local = ck, ep, num_experts // ep
        self.expert_groups = dict(zs.records.expert_groups)
        self.shapes = {p.name: tuple(p.shape) for p in ck.parameters}
        dst = []
        for g, lay in enumerate(zs.layouts):
            if g in self.expert_groups:
                pattern = local_pattern([s.name for s in lay.slots])
                names = [f"{prefix}{i}{sfx}" for prefix, sfxs in pattern for i in range(self.num_local) for sfx in sfxs]
                dst.append(FlatGroupLayout.build([(n, self.shapes[global_name(n, 0, self.num_local)]) for n in names],
                                                 world // ep, group=g))
            else:
                dst.append(FlatGroupLayout.build([(s.name, s.shape) for s in lay.slots], world, group=g))
        super().__init__(zs, dst, world, zs.mp)

    def source_of(self, g: int, rank: int, name: str) -> tuple[str, int]:
        return (global_name(name, rank % self.ep, self.num_local) if g in self.expert_groups else name), 0

    def param_ranges(self, g: int, rank: int, name: str, key: str) -> list:
        return self.ck.sources(global_name(name, rank % self.ep, self.num_local) if g in self.expert_groups
                               else name, key)


def expert_files(ck: Checkpoint, writer: ExpertWriter, model_entries: dict) -> list:
    """The files of a checkpoint with experts at ``writer``'s mesh: ``mp_rank_00_model_states.pt`` (the source's with
    the new world size, the writer's ``param_shapes`` and ``model_entries``), each rank's optimizer states, the 16-bit
    expert files copied as they are (they name global ids) and DeepSpeed's converter scripts."""
    tag, trees = ck.location.tag, TreeFiles()
    model = ck.main.model_states_file().obj
    tree = replace(model, dp_world_size=writer.m, param_shapes=writer.param_shapes(), **model_entries)
    files = [trees.make(f"{tag}/{fnames.model_states_name(0)}", "model_states", tree)]
    for r in range(writer.m):
        name, obj = writer.optim_states(r)
        files.append(trees.make(f"{tag}/{name}", "optim_states", obj, r))
    files += [carried(f"{tag}/{f.path.name}", os.fspath(f.path), f.bytes) for f in ck.files
              if f.kind == fnames.EXPERT_STATES]
    return files + [CopyFile(Path(s).name, s, os.path.getsize(s)) for s in converter_scripts(ck)]


def plan_moe_files(ck: Checkpoint, mesh: Mesh, hf_files: bool = True) -> tuple[list, list, list]:
    """``(files, notes, footprints)`` of MoE checkpoint ``ck`` at ``mesh.dp`` ranks and ``mesh.ep`` expert ranks."""
    if ck.flavor != ZERO or ck.zero_stage not in (1, 2):
        _refuse(ck, f"resharding a mixture-of-experts checkpoint at ZeRO-{ck.zero_stage} ({ck.flavor}) is not supported "
                    "yet", hint="`ckpt export` writes its full model (every expert under its global id)")
    if len(ck.sets) > 1:
        _refuse(ck, "resharding a mixture-of-experts checkpoint with pipeline stages or tensor ranks is not supported yet")
    experts, world, ep = expert_mesh(ck, ck.num_experts or [], mesh)
    if (ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        _refuse(ck, "round_robin_gradients: resharding a mixture-of-experts checkpoint with it is not supported yet")
    writer = MoEWriter(ck, world, ep, experts)
    files = expert_files(ck, writer, {})
    notes = [f"experts: {experts} per MoE layer, {experts // ep} on each of {ep} expert-parallel rank(s), each "
             f"expert group partitioned over {world // ep} rank(s); expert files copied (they name global ids)"]
    client, client_notes = carried_client(ck, world, hf_files)
    files, notes = files + client, notes + client_notes
    dense = sum(p.numel for p in ck.parameters if p.trainable and not p.tied_to and expert_id(p.name) is None)
    local = sum(p.numel for p in ck.parameters if p.trainable and not p.tied_to and expert_id(p.name) is not None) // ep
    per = state_bytes(ck)[0]
    a = footprint(dense, ck.dtype, ck.zero_stage, world, per_element=per)
    b = footprint(local, ck.dtype, ck.zero_stage, world // ep, per_element=per)  # experts: over world / ep ranks
    prints = [RankFootprint(stage=0, tp=0, numel=dense + local, weights=a.weights + b.weights,
                            gradients=a.gradients + b.gradients, optimizer=a.optimizer + b.optimizer)]
    return files, notes, prints


__all__ = ["plan_moe_files", "MoEWriter", "ExpertWriter", "expert_files", "local_pattern", "LOCAL_EXPERT", "expert_mesh"]
