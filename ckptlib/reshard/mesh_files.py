"""The files of a checkpoint at another mesh, as object trees whose tensors are range lists (metadata only).

Every tensor of a target set is cut from the source's full tensor (:class:`ShardRanges`): the fp32 masters and
the optimizer's per-element states into the ZeRO-1/2 flat partitions of the new data-parallel size
(:class:`MeshZero12Writer`, on :class:`~ckptlib.reshard.zero12.Zero12Writer`'s trees), the stored 16-bit
weights and the buffers into the pipeline's layer files (:func:`layer_file_tree`) or the model-states
``module`` (:func:`model_states_tree`); at ZeRO-0 the torch optimizer's state goes into the model-states
file (:func:`stage0_optimizer`). The carried-over rest of each tree comes from the source's own files.
"""
from __future__ import annotations

import collections
from typing import Any, Optional

from ..deepspeed import Checkpoint, ZeroSet
from ..deepspeed import files as fnames
from ..deepspeed.zeroset import MODULE
from ..dtypes import BY_SHORT
from ..io.torchzip import TensorHandle
from ..io.torchzip.standins import TorchSize
from ..layout.flat import FlatGroupLayout, Zero3Layout, zero3_sub_groups
from ..layout.ranges import Zeros, coalesce, numel, range_starts, slice_ranges
from .target import TargetModel, TargetSet, TargetTensor
from .trees import copied, replace, streamed
from .zero3 import Zero3Writer
from .zero12 import Zero12Writer


class ShardRanges:
    """The stored ranges of a target tensor's shard: the source's full tensor (padding rows of a vocabulary
    included) cut by the shard's runs; each full tensor's ranges are computed once."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self._full: dict = {}
        self._recent: dict = {}  # (name, key, shard) -> (ranges, starts), the last few

    def full(self, name: str, key: Optional[str]) -> tuple:
        k = (name, key)
        got = self._full.get(k)
        if got is None:
            ranges = self.ck.view.sources(name, key, padded=True)
            got = self._full[k] = (ranges, range_starts(ranges))
        return got

    def of(self, t: TargetTensor, key: Optional[str] = None) -> list:
        """The shard's ranges of state ``key`` (None: the fp32 master or the buffer; ``MODULE``: the 16-bit
        weight)."""
        ranges, starts = self.full(t.name, key)
        _, runs = t.shard()
        if len(runs) == 1 and runs[0] == (0, numel(ranges)):
            return list(ranges)
        out: list = []
        for start, count in runs:
            out += slice_ranges(ranges, start, count, starts)
        return coalesce(out)  # a shard whose rows lie one after the other in a source file: one range

    def of_with_starts(self, t: TargetTensor, key: Optional[str] = None) -> tuple:
        """:meth:`of` with its :func:`~ckptlib.layout.ranges.range_starts`, for slicing it many times (the
        last few shards asked for are kept: the partitions of a tensor ask for it one after the other)."""
        k = (t.name, t.full_shape, t.dim, t.sizes, t.index, key)
        got = self._recent.get(k)
        if got is None:
            ranges = self.of(t, key)
            got = (ranges, range_starts(ranges))
            if len(self._recent) >= 8:
                self._recent.pop(next(iter(self._recent)))
            self._recent[k] = got
        return got

    def dtype(self, t: TargetTensor, key: Optional[str]) -> str:
        ranges, _ = self.full(t.name, key)
        stored = next((r.dtype for r in ranges if not isinstance(r, Zeros)), "float32")
        if key == MODULE and self.ck.universal is not None and t.trainable:
            # a universal folder holds a tensor-parallel shard's 16-bit weight only as its master: the module
            # weight is the master rounded to the training dtype (what the engine's 16-bit copy is after a step)
            return BY_SHORT[self.ck.dtype].name if self.ck.dtype in BY_SHORT else stored
        return stored


def target_layouts(ts: TargetSet, world_size: int) -> list[FlatGroupLayout]:
    """The target set's ZeRO-1/2 flat groups at ``world_size`` data-parallel ranks."""
    return [FlatGroupLayout.build([(t.name, t.shape) for t in group], world_size, group=g)
            for g, group in enumerate(ts.groups)]


class MeshZero12Writer(Zero12Writer):
    """The optimizer-states files of target set ``ts``: its flat partitions cut from the source's full tensors."""

    def __init__(self, template: ZeroSet, ts: TargetSet, world_size: int, shards: ShardRanges):
        super().__init__(template, target_layouts(ts, world_size), world_size, ts.mp)
        self.ts, self.shards = ts, shards
        self._by_name = {t.name: t for group in ts.groups for t in group}

    def partition_ranges(self, g: int, rank: int, padded: bool, key) -> list:
        segs = self.dst[g].segments(rank)
        if not padded:
            while segs and segs[-1].is_padding:
                segs.pop()
        out: list = []
        for seg in segs:
            if seg.is_padding:
                out.append(Zeros(seg.count))
                continue
            ranges, starts = self.shards.of_with_starts(self._by_name[seg.name], key)
            out += slice_ranges(ranges, seg.param_start, seg.count, starts)
        return out

    def param_ranges(self, g: int, rank: int, name: str, key: str) -> list:
        return self.shards.of(self._by_name[name], key)

    def feeds(self, rank: int) -> list:
        """The source files this target rank's optimizer file reads (by name, for the plan's table)."""
        return []

    def param_shapes(self) -> list:
        return [collections.OrderedDict((t.name, TorchSize(t.shape)) for t in group) for group in self.ts.groups]


class MeshZero3Writer(Zero3Writer):
    """The ZeRO-3 optimizer-states files of target set ``ts``: each optimizer group's parameters cut into
    sub-groups as DeepSpeed cuts them at ``world_size`` ranks (``sub_group_size``), every parameter's chunk
    ``[r*c, (r+1)*c)`` of its target shard (``c = ceil(numel / world_size)``) cut from the full tensor."""

    def __init__(self, template: ZeroSet, ts: TargetSet, world_size: int, shards: ShardRanges, sub_group_size: int):
        subs, group_subs = [], []
        for group in ts.groups:
            cut = zero3_sub_groups([t.numel for t in group], world_size, sub_group_size)
            group_subs.append(list(range(len(subs), len(subs) + len(cut))))
            subs += [[(group[i].name, group[i].shape) for i in c] for c in cut]
        super().__init__(template, Zero3Layout.build(subs, world_size), group_subs, world_size, ts.mp)
        self.ts, self.shards = ts, shards
        self._by_name = {t.name: t for group in ts.groups for t in group}

    def sub_group_ranges(self, k: int, rank: int, key) -> list:
        out: list = []
        for seg in self.dst.segments(rank, k):
            if seg.is_padding:
                out.append(Zeros(seg.count))
            else:
                out += slice_ranges(self.shards.of(self._by_name[seg.name], key), seg.param_start, seg.count)
        return out


def zero3_model_states(template: dict, ts: TargetSet, model: TargetModel, world_size: int, shards: ShardRanges,
                       param_shapes: list, info: Optional[dict] = None, extra: Optional[dict] = None,
                       frozen: tuple = ()) -> dict:
    """``{file name: tree}`` of target set ``ts``'s ZeRO-3 model-states files, one per data rank: the
    source's tree with the new sizes, ``param_shapes`` and module (parameters as the empty placeholders
    ZeRO-3 saves, buffers cut from the source's), the tied names on rank 0 only, as DeepSpeed saves them; each
    ``frozen`` parameter's fragment of rank ``r``: elements ``[r*c, (r+1)*c)`` of its value, ``c = ceil(numel / world
    size)``, zero padded (tensors of a tensor size of 1 only)."""
    placeholder = next((h for h in (template.get("module") or {}).values()
                        if isinstance(h, TensorHandle) and h.numel == 0), None)
    module = collections.OrderedDict()
    for t in ts.module:
        if t.trainable:
            module[t.name] = copied(placeholder) if placeholder is not None else streamed("bfloat16", [], shape=(0,))
        else:
            module[t.name] = streamed(shards.dtype(t, None), shards.of(t, None), shape=t.shape)
    repl: dict = {"dp_world_size": world_size, "mp_world_size": model.mesh.pp * model.mesh.tp,
                  "param_shapes": param_shapes, "module": module}
    if "checkpoint_parallel_dimensions" in template:
        repl["checkpoint_parallel_dimensions"] = {"pp_degree": model.mesh.pp, "tp_degree": model.mesh.tp}
    if "buffer_names" in template:
        repl["buffer_names"] = ts.buffer_names
    if info is not None:
        repl["universal_checkpoint_info"] = info
    repl.update(extra or {})
    fragments = template.get("frozen_param_fragments")
    if fragments is not None:
        repl["frozen_param_fragments"] = type(fragments)()
    frozen_targets = [t for t in ts.module if t.name in set(frozen)]
    out = {}
    for r in range(world_size):
        tree = dict(repl)
        if fragments is not None and frozen_targets:
            chunks = type(fragments)()
            for t in frozen_targets:
                ranges, starts = shards.full(t.name, None)
                c = -(-t.numel // world_size)
                real = max(0, min(c, t.numel - r * c))
                chunks[t.name] = streamed(shards.dtype(t, None), (slice_ranges(ranges, r * c, real, starts) if real
                                                                  else []) + ([Zeros(c - real)] if c - real else []))
            tree["frozen_param_fragments"] = chunks
        if r != 0 and isinstance(template.get("shared_params"), dict):
            tree["shared_params"] = type(template["shared_params"])()
        out[fnames.model_states_name(ts.mp, dp_rank=r)] = replace(template, **tree)
    return out


def module_tree(ts: TargetSet, shards: ShardRanges, names: Optional[list] = None) -> collections.OrderedDict:
    """``{name or layer key: tensor}`` of the stored 16-bit weights and buffers of ``ts`` (``names``: only
    these tensors, e.g. one layer's; keyed by their layer-file key then)."""
    out = collections.OrderedDict()
    for t in ts.module:
        if names is not None and t.name not in names:
            continue
        key = None if not t.trainable else MODULE
        ranges = shards.of(t, key)
        out[t.key if names is not None else t.name] = streamed(shards.dtype(t, key), ranges, shape=t.shape)
    return out


def layer_file_tree(ts: TargetSet, layer: int, shards: ShardRanges) -> collections.OrderedDict:
    """One layer file of tensor rank ``ts.tp``: the layer's own ``state_dict`` keys."""
    names = [t.name for t in ts.module if t.layer == layer]
    return module_tree(ts, shards, names)


def stage0_optimizer(template: dict, ts: TargetSet, shards: ShardRanges, keys: list) -> dict:
    """A ZeRO-0 torch optimizer ``state_dict`` of target set ``ts`` (``template``: a source set's): one
    state entry per trainable tensor in group order, numbered from 0, its per-element states cut like
    the weights, its ``step`` the source's; the groups' hyper-parameters as saved."""
    state = type(template["state"])()
    groups = []
    pid = 0
    src_state = template["state"]
    any_state = next(iter(src_state.values()), {}) if src_state else {}
    for g, members in enumerate(ts.groups):
        ids = []
        for t in members:
            entry = type(any_state)() if isinstance(any_state, dict) else {}
            for k, v in any_state.items():
                if k in keys:
                    entry[k] = streamed(shards.dtype(t, k), shards.of(t, k), shape=t.shape)
                else:
                    entry[k] = copied(v) if isinstance(v, TensorHandle) else v
            state[pid] = entry
            ids.append(pid)
            pid += 1
        groups.append(replace(template["param_groups"][g], params=ids))
    return replace(template, state=state, param_groups=groups)


def model_states_tree(template: dict, ts: TargetSet, model: TargetModel, *, pipeline: bool, dp: int,
                      shards: ShardRanges, param_shapes: Optional[list], optimizer: Any = None,
                      info: Optional[dict] = None, extra: Optional[dict] = None) -> dict:
    """The model-states file of target set ``ts`` from a source model-states tree ``template``: the sizes
    of the new mesh, this set's ``param_shapes`` and buffers, its module (outside pipelines), and the
    ZeRO-0 ``optimizer`` when given (``extra``: further top-level entries replaced)."""
    mesh = model.mesh
    repl: dict = {"dp_world_size": dp, "mp_world_size": mesh.pp * mesh.tp}
    if "checkpoint_parallel_dimensions" in template:
        repl["checkpoint_parallel_dimensions"] = {"pp_degree": mesh.pp, "tp_degree": mesh.tp}
    if "buffer_names" in template:
        repl["buffer_names"] = ts.buffer_names
    if template.get("param_shapes") is not None and param_shapes is not None:
        repl["param_shapes"] = param_shapes
    if not pipeline:
        repl["module"] = module_tree(ts, shards)
    if optimizer is not None:
        repl["optimizer"] = optimizer
    if info is not None:
        repl["universal_checkpoint_info"] = info
    repl.update(extra or {})
    out = replace(template, **repl)
    if info is not None and "universal_checkpoint_info" not in out:
        out["universal_checkpoint_info"] = info
    return out


__all__ = ["ShardRanges", "MeshZero12Writer", "MeshZero3Writer", "zero3_model_states", "target_layouts", "module_tree", "layer_file_tree", "stage0_optimizer",
           "model_states_tree"]
