"""Target files of a ZeRO-3 checkpoint at another data-parallel size (sub-groups re-cut as DeepSpeed would)."""
from __future__ import annotations

import collections
from typing import Any, Optional

from ..deepspeed import ZeroSet
from ..deepspeed import files as fnames
from ..errors import UnsupportedCheckpointError
from ..io.rawfile import RawTensor
from ..io.torchzip import TensorHandle
from ..io.torchzip.standins import TorchSize
from ..layout.flat import Piece, Zero3Layout, chunk_size, reslice_zero3, zero3_sub_groups
from ..layout.ranges import Zeros, range_starts, slice_ranges
from .trees import copied, optim_prefix, replace, stored_dtype, streamed, sub_group_size, to_ranges


class Zero3Writer:
    """The optimizer-states files of one ZeRO-3 set at ``world_size`` data-parallel ranks whose sub-groups are
    ``dst`` (``dst_group_subs``: each optimizer group's sub-groups), made from the file tree of ``template``'s
    data rank 0 (a source set). Subclasses say where each target flat tensor's bytes come from
    (:meth:`sub_group_ranges`); ``mp``: the target's model-parallel rank (its file names)."""

    def __init__(self, template: ZeroSet, dst: Zero3Layout, dst_group_subs: list, world_size: int, mp: int):
        self.template, self.dst, self.dst_group_subs, self.m, self.mp = template, dst, dst_group_subs, world_size, mp
        self._optim0 = template.optim_states_file(template.rank(0)).obj  # every target optimizer file is made from it
        self._prefix = optim_prefix(template)

    def sub_group_ranges(self, k: int, rank: int, key) -> list:
        """The stored ranges (and zeros) of target ``rank``'s flat tensor of sub-group ``k``, state ``key``
        (None: the fp32 master)."""
        raise NotImplementedError

    def saved_state(self, sub_group: int, key: str, placeholder):
        """The template's rank-0 state ``key`` of ``sub_group``: from its swap file when NVMe offload kept it
        there (the optimizer file then holds an empty placeholder), else as the optimizer file holds it."""
        swapped = self.template.records.index.swapped.get((0, sub_group))
        return swapped[key] if swapped and key in swapped else placeholder

    def param_shapes(self) -> list:
        return [collections.OrderedDict((s.name, TorchSize(s.shape)) for s in self.dst.sub_group_slots(k))
                for k in range(len(self.dst.sub_group_sizes))]

    def master_dtype(self, k: int) -> str:
        """The dtype of sub-group ``k``'s masters as the source stores them (that of the first stored range of any
        target rank's; fp32 where none holds one): fp32, or bf16 under DeepSpeed's ``bf16_master_weights_and_grads``."""
        return next((d for r in range(self.m) for d in [stored_dtype(self.sub_group_ranges(k, r, None))] if d),
                    "float32")

    def optim_states(self, rank: int) -> tuple[str, Any]:
        """``(file name, object tree)`` of target ``rank``'s optimizer-states file: the masters in the dtype the
        source stores them in (:meth:`master_dtype`), each state key in its own."""
        t, m = self.template, self.m
        top = self._optim0
        osd0 = top["optimizer_state_dict"]
        inner = osd0["optimizer_state_dict"]
        rg = t.partition_tensor(t.rank(0), 0).requires_grad
        flats = [streamed(stored_dtype(ranges) or self.master_dtype(k), ranges, requires_grad=rg)
                 for k, ranges in ((k, self.sub_group_ranges(k, rank, None))
                                   for k in range(len(self.dst.sub_group_sizes)))]
        state = type(inner["state"])()
        groups = []
        for g, group in enumerate(inner["param_groups"]):
            first_src = group["params"][0]
            template = inner["state"].get(first_src, {})
            gs = t.optimizer.group(first_src)
            keys = {k.name: k for k in gs.keys} if gs is not None else {}
            for k in self.dst_group_subs[g]:
                new = type(template)()
                for key, v in template.items():
                    v = self.saved_state(first_src, key, v)
                    if key in keys:  # a per-element key of the group's optimizer (ckptlib.kinds.optimizers)
                        new[key] = streamed(keys[key].dtype, self.sub_group_ranges(k, rank, key),
                                            requires_grad=v.requires_grad)
                    elif isinstance(v, (TensorHandle, RawTensor)) and v.numel > 1:
                        raise UnsupportedCheckpointError(
                            f"sub-group {first_src}'s optimizer state holds '{key}' ({v.numel} elements), which no "
                            "layout places: it cannot be re-cut for another size", path=t.location.tag_dir)
                    else:  # step and other scalars; each sub-group keeps a tensor of its own, as DeepSpeed saves it
                        new[key] = copied(v) if isinstance(v, TensorHandle) else v
                state[k] = new
            groups.append(replace(group, params=list(self.dst_group_subs[g])))
        new_inner = replace(inner, state=state, param_groups=groups)
        new_osd = replace(osd0, partition_count=m, fp32_flat_groups=flats, optimizer_state_dict=new_inner)
        return (fnames.optim_states_name(rank, self.mp, prefix=self._prefix),
                replace(top, optimizer_state_dict=new_osd))


class Zero3Resharder(Zero3Writer):
    """Target files of one ZeRO-3 set (a checkpoint's, or one tensor rank's) at ``world_size`` data-parallel
    ranks."""

    def __init__(self, ck: ZeroSet, world_size: int):
        self.ck, self.m = ck, world_size
        self.notes: list[str] = []
        self._cached: Optional[tuple] = None  # (rank, its pieces) of the last rank asked for
        self._frozen_sources: dict = {}  # frozen parameter -> (its source ranges, their starts, its dtype)
        n = ck.partition_count
        self.src: Zero3Layout = ck.layouts[0]
        self.sub_group_size = sub_group_size(ck)
        groups = ck.optimizer_state_dict(ck.rank(0))["optimizer_state_dict"]["param_groups"]
        src_subs = [[s for s in self.src.slots if s.sub_group == k] for k in range(len(self.src.sub_group_sizes))]
        self.group_params: list[list] = []
        for g, group in enumerate(groups):
            params = [s for k in group["params"] for s in src_subs[k]]
            self.group_params.append(params)
            # DeepSpeed's rule must reproduce the source's own cut before we trust it for the target
            cut = zero3_sub_groups([s.numel for s in params], n, self.sub_group_size)
            if [[params[i].name for i in c] for c in cut] != [[s.name for s in src_subs[k]] for k in group["params"]]:
                raise UnsupportedCheckpointError(
                    f"the ZeRO-3 sub-groups of parameter group {g} do not follow sub_group_size="
                    f"{self.sub_group_size}; ckptlib cannot tell how DeepSpeed would cut them at {world_size} ranks",
                    path=ck.location.tag_dir)
        dst_subs, self.dst_group_subs = [], []
        for params in self.group_params:
            cut = zero3_sub_groups([s.numel for s in params], world_size, self.sub_group_size)
            self.dst_group_subs.append(list(range(len(dst_subs), len(dst_subs) + len(cut))))
            dst_subs += [[(params[i].name, params[i].shape) for i in c] for c in cut]
        super().__init__(ck, Zero3Layout.build(dst_subs, world_size), self.dst_group_subs, world_size, ck.mp)
        if len(dst_subs) != len(src_subs):
            self.notes.append(f"sub-groups re-cut for {world_size} ranks: {len(src_subs)} -> {len(dst_subs)}")

    def sub_group_ranges(self, k: int, rank: int, key) -> list:
        return to_ranges(self.ck, self._pieces(rank)[k], key)

    def model_states(self) -> dict[str, Any]:
        """``{file name: object tree}`` of the target's model-states files (one per rank). What is the same
        in every rank's file (the module, ``param_shapes``, the config; the frozen fragments when there are
        no frozen parameters) is the same object in each tree."""
        ck, m = self.ck, self.m
        model0 = ck.model_states_file(ck.rank(0)).obj
        frozen = [p for p in ck.parameters if not p.trainable and not p.tied_to and p.name in ck.records.index.frozen]
        shapes = self.param_shapes()
        fragments = model0.get("frozen_param_fragments")
        no_frozen = type(fragments)() if fragments is not None and not frozen else None
        no_shared = None
        if "shared_params" in model0:
            no_shared = type(model0["shared_params"])() if isinstance(model0["shared_params"], dict) \
                else model0["shared_params"]
        out = {}
        for r in range(m):
            repl = dict(dp_world_size=m, param_shapes=shapes)
            if fragments is not None:
                repl["frozen_param_fragments"] = no_frozen if no_frozen is not None else \
                    type(fragments)(self._frozen_fragments(frozen, r))
            if r != 0 and "shared_params" in model0:
                repl["shared_params"] = no_shared
            out[fnames.model_states_name(ck.mp, dp_rank=r)] = replace(model0, **repl)
        return out

    def _frozen_fragments(self, frozen: list, r: int) -> collections.OrderedDict:
        """Target rank ``r``'s chunk of each frozen parameter: ``ceil(numel/M)`` elements, zero padded (each
        parameter's source ranges are found once, then sliced by binary search for every target rank)."""
        ck, m = self.ck, self.m
        frags = collections.OrderedDict()
        for p in frozen:
            if p.name not in self._frozen_sources:
                ranges = ck.sources(p.name)
                self._frozen_sources[p.name] = (ranges, range_starts(ranges), ck.frozen_chunks(p.name)[0].dtype_name)
            src, starts, dtype = self._frozen_sources[p.name]
            c = chunk_size(p.numel, m)
            real = max(0, min(c, p.numel - r * c))
            ranges = (slice_ranges(src, r * c, real, starts) if real else []) + ([Zeros(c - real)] if c - real else [])
            frags[p.name] = streamed(dtype, ranges)
        return frags

    def _pieces(self, rank: int) -> list[list]:
        """What target ``rank``'s flat tensor of each sub-group is made of (:func:`reslice_zero3`), computed
        once per rank for the fp32 master, every optimizer state and :meth:`feeds`."""
        if self._cached is None or self._cached[0] != rank:
            self._cached = (rank, [reslice_zero3(self.src, self.dst, rank, k)
                                   for k in range(len(self.dst.sub_group_sizes))])
        return self._cached[1]

    def feeds(self, rank: int) -> list[int]:
        """The source ranks whose bytes target ``rank`` reads."""
        return sorted({p.rank for pieces in self._pieces(rank) for p in pieces if isinstance(p, Piece)})


__all__ = ["Zero3Resharder", "Zero3Writer"]
