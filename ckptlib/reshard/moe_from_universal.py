"""A DeepSpeed-MoE universal checkpoint (ckptlib's, ZeRO-1/2 source) back to native files at any data- and
expert-parallel size (metadata only).

The optimizer files are cut as :mod:`ckptlib.reshard.moe` cuts a native source's: the dense groups over every rank,
each expert group re-made from the experts its ranks hold (local names), their masters and moments read under their
global ids from the folder (which holds every expert whole); the groups as the copied model-states file's
``param_shapes`` lists them (an expert group: the experts of the expert-parallel size the folder was written for,
local names), their structure from ``zero/optimizer_state.pt``
(:class:`~ckptlib.reshard.from_universal.UniversalTemplate`). The 16-bit expert files
(``layer_<L>_expert_<G>_mp_rank_00_model_states.pt``, global ids), which the folder does not hold, are made from the
masters rounded to the training dtype: what the engine's 16-bit copies are after a step.
"""
from __future__ import annotations

import collections
import os
from pathlib import Path

from ..deepspeed import Checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.moe import global_name
from ..dtypes import BY_SHORT
from ..errors import UnsupportedCheckpointError
from ..layout.flat import FlatGroupLayout
from ..mesh import Mesh
from ..plan import CopyFile
from .from_universal import UniversalTemplate, native_tag
from .moe import LOCAL_EXPERT, MoEWriter, expert_mesh, local_pattern
from .trees import TreeFiles, carried_client, converter_scripts, replace, streamed
from .zero12 import Zero12Writer


class UniversalMoEWriter(MoEWriter):
    """:class:`~ckptlib.reshard.moe.MoEWriter` on a universal folder: the groups from the copied model-states file's
    ``param_shapes``, an expert group being one whose every name is an expert's (``deepspeed_experts.<i>``)."""

    def __init__(self, ck: Checkpoint, world: int, ep: int, num_experts: int):
        self.ck, self.ep, self.num_local = ck, ep, num_experts // ep
        self.shapes = {p.name: tuple(p.shape) for p in ck.parameters}
        self.expert_groups, self.patterns, dst = {}, {}, []
        for g, group in enumerate(ck.main.model_states_file().obj.get("param_shapes") or []):
            names = list(dict(group))
            experts = [n for n in names if LOCAL_EXPERT.match(n)]
            if experts and len(experts) != len(names):
                raise UnsupportedCheckpointError(f"parameter group {g} mixes experts and other parameters",
                                                 path=ck.location.tag_dir)
            if not experts:
                dst.append(FlatGroupLayout.build([(n, tuple(s)) for n, s in dict(group).items()], world, group=g))
                continue
            self.expert_groups[g] = True
            self.patterns[g] = local_pattern(names)
            local = [f"{prefix}{i}{sfx}" for prefix, sfxs in self.patterns[g] for i in range(self.num_local)
                     for sfx in sfxs]
            dst.append(FlatGroupLayout.build([(n, self.shapes[global_name(n, 0, self.num_local)]) for n in local],
                                             world // ep, group=g))
        Zero12Writer.__init__(self, UniversalTemplate(ck), dst, world, 0)


def expert_weight_files(ck: Checkpoint, writer: UniversalMoEWriter, tag: str, trees: TreeFiles, experts: int) -> list:
    """The 16-bit file of every MoE layer's every expert (``layer_<L>_expert_<G>``, MoE layers numbered in the
    module's order): the expert's tensors under their global names, rounded from the fp32 masters."""
    dtype = BY_SHORT[ck.dtype].name if ck.dtype in BY_SHORT else "float32"
    layers = [entry for g in sorted(writer.patterns) for entry in writer.patterns[g]]
    out = []
    for layer, (prefix, suffixes) in enumerate(layers):
        for e in range(experts):
            tree = collections.OrderedDict()
            for sfx in suffixes:
                name = f"{prefix}{e}{sfx}"
                tree[name] = streamed(dtype, ck.sources(name), shape=ck.param(name).shape)
            out.append(trees.make(f"{tag}/layer_{layer}_expert_{e}_mp_rank_00_model_states.pt", "expert_states", tree))
    return out


def plan_moe_from_universal(ck: Checkpoint, mesh: Mesh, hf_files: bool = True) -> tuple[list, list, str]:
    """``(files, notes, tag)`` of DeepSpeed-MoE universal folder ``ck`` at ``mesh.dp`` ranks and ``mesh.ep``
    expert-parallel ranks."""
    where = ck.location.tag_dir
    if ck.zero_stage not in (1, 2):
        raise UnsupportedCheckpointError(f"native files of a ZeRO-{ck.zero_stage} mixture-of-experts run from a "
                                         "universal checkpoint are not written yet", path=where)
    experts, world, ep = expert_mesh(ck, [int(n) for n in ck.main.model_states_file().obj.get("num_experts") or []],
                                     mesh)
    writer = UniversalMoEWriter(ck, world, ep, experts)
    tag, trees = native_tag(ck), TreeFiles()
    model = ck.main.model_states_file().obj
    tree = replace(model, dp_world_size=world, param_shapes=writer.param_shapes())
    files = [trees.make(f"{tag}/{fnames.model_states_name(0)}", "model_states", tree)]
    for r in range(world):
        name, obj = writer.optim_states(r)
        files.append(trees.make(f"{tag}/{name}", "optim_states", obj, r))
    files += expert_weight_files(ck, writer, tag, trees, experts)
    files += [CopyFile(Path(s).name, s, os.path.getsize(s)) for s in converter_scripts(ck)]
    notes = [f"experts: {experts} per MoE layer, {experts // ep} on each of {ep} expert-parallel rank(s), each "
             f"expert group partitioned over {world // ep} rank(s); the 16-bit expert files made from the masters"]
    client, client_notes = carried_client(ck, world, hf_files)
    return files + client, notes + client_notes, tag


__all__ = ["plan_moe_from_universal", "UniversalMoEWriter", "expert_weight_files"]
