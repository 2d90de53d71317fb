"""An AutoEP universal checkpoint (ZeRO-1/2/3 source) back to native files at any data- and expert-parallel size
(metadata only).

The optimizer files are cut as :mod:`ckptlib.reshard.autoep` cuts a native source's (dense groups over every rank,
each expert group's ep-rank rows of the folder's whole ``[experts, ...]`` tensors over that ep rank's members), their
structure from ``zero/optimizer_state.pt`` (:class:`~ckptlib.reshard.from_universal.UniversalTemplate`), the groups'
parameters in the copied model-states file's order. The 16-bit per-expert files DeepSpeed's AutoEP load stacks
(``layer_<L>_expert_<e>_mp_rank_00_model_states.pt``, global ids), which a universal folder does not hold, are made
from the masters rounded to the training dtype: what the engine's 16-bit copies are after a step (the native files'
copies, bit for bit: tests/test_universal_source.py).
"""
from __future__ import annotations

import collections
import os
from pathlib import Path

from ..deepspeed import Checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.autoep import KEY
from ..dtypes import BY_SHORT
from ..errors import UnsupportedCheckpointError
from ..layout.flat import FlatGroupLayout
from ..layout.ranges import slice_ranges
from ..mesh import Mesh
from ..plan import CopyFile
from .autoep import AutoEPWriter, AutoEPZero3Writer, _model_entries, rebuilt_layout, target_layers, zero3_files
from .from_universal import UniversalTemplate, native_tag
from .moe import expert_mesh
from .zero3 import Zero3Writer
from .trees import TreeFiles, carried_client, converter_scripts, replace, streamed
from .zero12 import Zero12Writer


class UniversalAutoEPWriter(AutoEPWriter):
    """:class:`~ckptlib.reshard.autoep.AutoEPWriter` on a universal folder: the groups from the copied model-states
    file's ``param_shapes`` (an expert group lists ep rank 0's stacked local weights), the template from
    ``zero/optimizer_state.pt``."""

    def __init__(self, ck: Checkpoint, world: int, ep: int):
        self.ck, self.ep = ck, ep
        layers = ck.records.autoep_layers
        self.num_local = layers[0].num_experts // ep
        prefixes = tuple(f"{lay.prefix}." for lay in layers)
        model = ck.main.model_states_file().obj
        dst, self.expert_groups = [], {}
        for g, group in enumerate(model.get("param_shapes") or []):
            names = list(dict(group))
            if any(n.startswith(prefixes) for n in names):
                if not all(n.startswith(prefixes) for n in names):
                    raise UnsupportedCheckpointError(f"parameter group {g} mixes AutoEP experts and other parameters",
                                                     path=ck.location.tag_dir)
                self.expert_groups[g] = True
                dst.append(FlatGroupLayout.build([(n, (self.num_local, *ck.view.full_shape(n)[1:])) for n in names],
                                                 world // ep, group=g))
            else:
                dst.append(FlatGroupLayout.build([(n, tuple(s)) for n, s in dict(group).items()], world, group=g))
        Zero12Writer.__init__(self, UniversalTemplate(ck), dst, world, 0)


class UniversalAutoEPZero3Writer(AutoEPZero3Writer):
    """:class:`~ckptlib.reshard.autoep.AutoEPZero3Writer` on a ZeRO-3 universal folder: the sub-groups from the copied
    rank-0 model-states file's ``param_shapes`` (an expert sub-group lists ep rank 0's stacked local weights), which
    of them hold experts from the ``ds_zero_partition_groups`` that ``zero/optimizer_state.pt`` keeps (checked against
    the names), each group's sub-groups from its recorded ``params``, the template from ``zero/optimizer_state.pt``."""

    def __init__(self, ck: Checkpoint, world: int, ep: int):
        where = ck.location.tag_dir
        self.ck, self.ep, self.world = ck, ep, world
        layers = ck.records.autoep_layers
        self.num_local = layers[0].num_experts // ep
        prefixes = tuple(f"{lay.prefix}." for lay in layers)
        osd = ck.universal.optimizer_state if isinstance(ck.universal.optimizer_state, dict) else {}
        self.parts = list(osd.get("ds_zero_partition_groups") or [])
        inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
        groups = [list(g.get("params") or []) for g in inner.get("param_groups") or []]
        shapes = ck.main.model_states_file().obj.get("param_shapes") or []
        if not self.parts or len(self.parts) != len(shapes):
            raise UnsupportedCheckpointError(
                f"zero/optimizer_state.pt records {len(self.parts)} ds_zero_partition_groups for the {len(shapes)} "
                "sub-groups the model-states file lists: which of them hold experts is not known", path=where)
        if any(len(g) != 1 for g in groups) or sorted(k for g in groups for k in g) != list(range(len(shapes))):
            raise UnsupportedCheckpointError("a ZeRO-3 AutoEP folder whose parameter groups are not one sub-group each "
                                             "(sub_group_size) cannot be written back to native files yet", path=where)
        self.expert_subs = {j for j, e in enumerate(self.parts) if "autoep_expert" in (e.get("families") or [])}
        subs, worlds = [], []
        for j, group in enumerate(shapes):
            names = list(dict(group))
            if any(n.startswith(prefixes) for n in names) != (j in self.expert_subs) or \
                    (j in self.expert_subs and not all(n.startswith(prefixes) for n in names)):
                raise UnsupportedCheckpointError(f"sub-group {j} ({', '.join(names[:2])}, ...): its names and its "
                                                 "recorded partition group disagree on whether it holds experts",
                                                 path=where)
            if j in self.expert_subs:
                subs.append([(n, (self.num_local, *ck.view.full_shape(n)[1:])) for n in names])
            else:
                subs.append([(n, tuple(s)) for n, s in dict(group).items()])
            worlds.append(world // ep if j in self.expert_subs else world)
        Zero3Writer.__init__(self, UniversalTemplate(ck), rebuilt_layout(subs, world, worlds), groups, world, 0)


def expert_weight_files(ck: Checkpoint, tag: str, trees: TreeFiles) -> list:
    """The 16-bit per-expert files of every AutoEP layer: expert ``e``'s rows of each stacked weight, under
    ``<prefix>.<w>.<e>``, rounded from the fp32 masters to the training dtype."""
    dtype = BY_SHORT[ck.dtype].name if ck.dtype in BY_SHORT else "float32"
    out = []
    for lay in ck.records.autoep_layers:
        weights = [p for p in ck.parameters if p.name.startswith(f"{lay.prefix}.") and not p.tied_to]
        full = {p.name: ck.sources(p.name) for p in weights}
        for e in range(lay.num_experts):
            tree = collections.OrderedDict()
            for p in weights:
                rows = p.numel // p.shape[0]
                tree[f"{p.name}.{e}"] = streamed(dtype, slice_ranges(full[p.name], e * rows, rows), shape=p.shape[1:])
            name = f"layer_{lay.layer}_expert_{e}_mp_rank_00_model_states.pt"
            out.append(trees.make(f"{tag}/{name}", "expert_states", tree))
    return out


def plan_autoep_from_universal(ck: Checkpoint, mesh: Mesh, hf_files: bool = True) -> tuple[list, list, str]:
    """``(files, notes, tag)`` of AutoEP universal folder ``ck`` at ``mesh.dp`` ranks and ``mesh.ep`` expert-parallel
    ranks (its checks are :func:`~ckptlib.reshard.autoep.plan_autoep_files`')."""
    where = ck.location.tag_dir
    if ck.zero_stage not in (1, 2, 3):
        raise UnsupportedCheckpointError(f"native files of a ZeRO-{ck.zero_stage} AutoEP run from a universal "
                                         "checkpoint are not written yet", path=where,
                                         hint="DeepSpeed resumes from it with \"load_universal\": true")
    n, world, ep = expert_mesh(ck, [lay.num_experts for lay in ck.records.autoep_layers], mesh, "AutoEP")
    if ck.zero_stage == 3:
        files, notes = zero3_files(ck, world, ep, hf_files, UniversalAutoEPZero3Writer, native_tag(ck))
        return files, notes, native_tag(ck)
    writer = UniversalAutoEPWriter(ck, world, ep)
    tag, trees = native_tag(ck), TreeFiles()
    model = ck.main.model_states_file().obj
    entries = _model_entries(model, target_layers(model.get(KEY) or [], world, ep), ep)
    tree = replace(model, dp_world_size=world, param_shapes=writer.param_shapes(), **entries)
    files = [trees.make(f"{tag}/{fnames.model_states_name(0)}", "model_states", tree)]
    for r in range(world):
        name, obj = writer.optim_states(r)
        files.append(trees.make(f"{tag}/{name}", "optim_states", obj, r))
    files += expert_weight_files(ck, tag, trees)
    files += [CopyFile(Path(s).name, s, os.path.getsize(s)) for s in converter_scripts(ck)]
    carried, notes = carried_client(ck, world, hf_files)
    return files + carried, [f"AutoEP experts: {n} per layer, {n // ep} on each of {ep} expert-parallel rank(s), "
                             f"each expert group partitioned over {world // ep} rank(s); the per-expert 16-bit files "
                             f"made from the masters; load it with \"expert_parallel\": {{\"autoep_size\": {ep}}}"] \
        + notes, tag


__all__ = ["plan_autoep_from_universal", "UniversalAutoEPWriter", "UniversalAutoEPZero3Writer", "expert_weight_files"]
