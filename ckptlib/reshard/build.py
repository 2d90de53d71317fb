"""Building the object trees of the target files of a reshard (metadata only; bytes come later).

Each target file is the source file's object tree with the partition-dependent entries replaced:
tensors become :class:`~ckptlib.torchzip.writer.NewTensor` s whose producers stream the source ranges
that :mod:`ckptlib.layout` says make them (:func:`~ckptlib.layout.reslice_flat`,
:func:`~ckptlib.layout.reslice_zero3`), and sizes, paddings and fragment addresses are recomputed for
the new data-parallel size. Everything else (loss scaler, hyper-parameters, step, scheduler, config,
client state) is carried over as it is.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..deepspeed.checkpoint import BF16_OPTIMIZER, Checkpoint, SourceRange
from ..errors import UnsupportedCheckpointError
from ..layout import (FlatGroupLayout, Piece, Zero3Layout, Zeros, chunk_size, reslice_by_params, reslice_flat,
                      reslice_zero3, round_robin_order, zero3_sub_groups)
from ..streaming import ChunkBuffers, copy_ranges, predicted_peak_bytes, slice_ranges
from ..torchzip import FragmentAddress, TensorHandle
from ..torchzip.writer import NewTensor

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size


@dataclass(kw_only=True)
class TargetPlan:
    """What the reshard and universal plans share: the files to write (with read/write bytes), the
    streaming settings and the totals derived from them."""

    checkpoint: Checkpoint
    out: Path
    files: list
    chunk_bytes: int
    overwrite: bool
    notes: list = field(default_factory=list)
    workers: int = 1
    _ctx: Any = field(default=None, repr=False)

    @property
    def read_bytes(self) -> int:
        return sum(f.read_bytes for f in self.files)

    @property
    def write_bytes(self) -> int:
        return sum(f.write_bytes for f in self.files)

    @property
    def predicted_peak_bytes(self) -> int:
        """Each writing thread's streaming buffers plus a fixed allowance."""
        return predicted_peak_bytes(self.chunk_bytes, self.workers)


class StreamContext:
    """What producers need while writing: buffers (one set per writing thread, made on first use),
    progress and cancellation."""

    def __init__(self):
        self.chunk_bytes = 0  # set from the plan when a run starts
        self.progress: Callable[[int], None] = lambda n: None
        self.cancel: Any = None
        self._local = threading.local()
        self._made: list[ChunkBuffers] = []
        self._lock = threading.Lock()

    @property
    def bufs(self) -> ChunkBuffers:
        b = getattr(self._local, "bufs", None)
        if b is None:
            b = self._local.bufs = ChunkBuffers(self.chunk_bytes)
            with self._lock:
                self._made.append(b)
        return b

    def close(self) -> None:
        """Release every thread's buffers (a later run makes new ones)."""
        with self._lock:
            made, self._made = self._made, []
        for b in made:
            b.close()
        self._local = threading.local()


def streamed(dtype: torch.dtype, ranges: list, ctx: StreamContext, requires_grad: bool = False) -> NewTensor:
    """A new 1-D tensor made of ``ranges`` (source ranges and zeros), streamed when written."""
    n = sum(r.count for r in ranges)
    t = NewTensor(dtype, (n,), lambda sink: copy_ranges(ranges, dtype, sink, ctx.bufs, ctx.progress,
                                                         ctx.cancel), requires_grad)
    t.read_bytes = sum(r.count * r.handle.itemsize for r in ranges if not isinstance(r, Zeros))
    t.sources = sorted({r.handle.path for r in ranges if not isinstance(r, Zeros)})
    return t


def copied(h: TensorHandle, ctx: StreamContext) -> NewTensor:
    """A copy of a stored tensor with a storage of its own (so that no two target tensors share one)."""
    t = NewTensor(h.dtype, tuple(h.shape), lambda sink: copy_ranges([SourceRange(h, 0, h.numel)], h.dtype, sink,
                                                                    ctx.bufs, ctx.progress, ctx.cancel),
                  h.requires_grad)
    t.read_bytes = h.nbytes
    return t


def _replace(d: dict, **new) -> dict:
    """A copy of ``d`` (same type, same key order) with some values replaced."""
    out = type(d)()
    for k, v in d.items():
        out[k] = new[k] if k in new else v
    return out


def _to_ranges(ck: Checkpoint, pieces: list, key: Optional[str]) -> list:
    return [p if isinstance(p, Zeros) else SourceRange(ck._rank_tensor(p.rank, p.group, key), p.rank_start, p.count)
            for p in pieces]


# ============================================================================================ ZeRO-1/2
class Zero12Resharder:
    """Target files of a ZeRO-1/2 (or BF16_Optimizer) checkpoint at ``world_size`` ranks."""

    def __init__(self, ck: Checkpoint, world_size: int):
        self.ck, self.m = ck, world_size
        self.bf16 = ck.flavor == BF16_OPTIMIZER
        self.src: list[FlatGroupLayout] = ck.layouts
        self.notes: list[str] = []
        zcfg = ck.ds_config.get("zero_optimization") or {}
        self.round_robin = bool(zcfg.get("round_robin_gradients")) and not self.bf16
        self.dst = [self._target_layout(lay, g) for g, lay in enumerate(self.src)]
        self._check_source()

    def _target_layout(self, src: FlatGroupLayout, g: int) -> FlatGroupLayout:
        slots = list(src.slots)
        if self.round_robin:  # the flat order depends on the world size: undo it for N, redo it for M
            natural = [None] * len(slots)
            for pos, i in enumerate(round_robin_order(len(slots), self.ck.partition_count)):
                natural[i] = slots[pos]
            slots = [natural[i] for i in round_robin_order(len(slots), self.m)]
            if any(s.padding_after for s in src.slots):
                raise UnsupportedCheckpointError(
                    "round_robin_gradients together with parameter_alignment is not supported yet",
                    path=self.ck.location.tag_dir)
        return FlatGroupLayout.build([(s.name, s.shape) for s in slots], self.m,
                                     paddings_after=[s.padding_after for s in slots], group=g)

    def _reslice(self, g: int, rank: int, padded: bool) -> list:
        if [s.name for s in self.src[g].slots] == [s.name for s in self.dst[g].slots]:
            return reslice_flat(self.src[g], self.dst[g], rank, padded)
        return reslice_by_params(self.src[g], self.dst[g], rank, padded)

    def _group_paddings(self, layouts: list[FlatGroupLayout], rank: int, world: int) -> list[int]:
        if self.bf16:  # BF16_Optimizer records all padding on the last rank
            return [(lay.padded_total - lay.total) if rank == world - 1 else 0 for lay in layouts]
        return [lay.tail_padding(rank) for lay in layouts]

    def _check_source(self) -> None:
        """The layout arithmetic must reproduce what DeepSpeed recorded in every source file."""
        ck = self.ck
        mismatched_mappings = False
        for r in range(ck.partition_count):
            osd = ck._optim[r]
            if "base_optimizer_state" in osd and not isinstance(osd["base_optimizer_state"], dict):
                raise UnsupportedCheckpointError(
                    "elastic ZeRO-1/2 optimizer state (saved with elastic_checkpoint: true) cannot be resharded yet "
                    f"(written by {ck.written_by()})",
                    path=ck.location.tag_dir)
            want = self._group_paddings(self.src, r, ck.partition_count)
            if list(osd.get("group_paddings", want)) != want:
                raise UnsupportedCheckpointError(
                    f"rank {r}: group_paddings {list(osd['group_paddings'])} differ from the layout's {want}; "
                    "this partition layout is not one ckptlib knows how to re-slice", path=ck.location.tag_dir)
            for g, mapping in enumerate(osd.get("param_slice_mappings") or []):
                have = {n: (a.start, a.numel) for n, a in mapping.items()}
                if have != self.src[g].slice_mappings(r):
                    mismatched_mappings = True
        if mismatched_mappings:
            self.notes.append("the source's param_slice_mappings disagree with its flat layout (DeepSpeed computes "
                              "them in natural parameter order, which is wrong under round_robin_gradients); the "
                              "target gets mappings that match its layout")

    @property
    def optim_prefix(self) -> str:
        return next((f.prefix for f in self.ck.files if f.kind == "optim_states"), "")

    def model_states(self, ctx: StreamContext) -> dict[str, Any]:
        model = self.ck.model_states_file().obj
        repl = dict(dp_world_size=self.m)
        if self.round_robin:  # param_shapes lists each group in its flat (round-robin) order
            repl["param_shapes"] = [collections.OrderedDict((s.name, torch.Size(s.shape)) for s in lay.slots)
                                    for lay in self.dst]
        return {"mp_rank_00_model_states.pt": _replace(model, **repl)}

    def optim_states(self, rank: int, ctx: StreamContext) -> tuple[str, Any]:
        ck, m = self.ck, self.m
        top = ck.optim_states_file(0).obj
        osd0 = top["optimizer_state_dict"]
        fp32 = []
        for g, (src, dst) in enumerate(zip(self.src, self.dst)):
            pieces = self._reslice(g, rank, padded=self.bf16)
            rg = ck._rank_tensor(0, g).requires_grad
            fp32.append(streamed(torch.float32, _to_ranges(ck, pieces, None), ctx, requires_grad=rg))
        base = osd0["base_optimizer_state"]
        state = type(base["state"])()
        for g, st in base["state"].items():
            new = type(st)()
            for key, v in st.items():
                if isinstance(v, TensorHandle) and v.numel == self.src[g].partition_size and v.numel > 1:
                    pieces = self._reslice(g, rank, padded=True)
                    new[key] = streamed(v.dtype, _to_ranges(ck, pieces, key), ctx, v.requires_grad)
                else:
                    new[key] = v  # step and other scalars: the same on every rank
            state[g] = new
        counts = osd0.get("partition_count")
        mappings = [collections.OrderedDict((n, FragmentAddress(numel=cnt, start=start))
                                            for n, (start, cnt) in dst.slice_mappings(rank).items()) for dst in self.dst]
        repl = dict(
            single_partition_of_fp32_groups=fp32,
            base_optimizer_state=_replace(base, state=state),
            group_paddings=self._group_paddings(self.dst, rank, m),
            partition_count=[m] * len(counts) if isinstance(counts, (list, tuple)) else m,
        )
        if "param_slice_mappings" in osd0:
            repl["param_slice_mappings"] = mappings
        new_top = _replace(top, optimizer_state_dict=_replace(osd0, **repl))
        return f"{self.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", new_top

    def feeds(self, rank: int) -> list[int]:
        ranks = set()
        for g in range(len(self.src)):
            ranks |= {p.rank for p in self._reslice(g, rank, True) if isinstance(p, Piece)}
        return sorted(ranks)


# ============================================================================================ ZeRO-3
class Zero3Resharder:
    """Target files of a ZeRO-3 checkpoint at ``world_size`` ranks (sub-groups re-cut as DeepSpeed would)."""

    def __init__(self, ck: Checkpoint, world_size: int):
        self.ck, self.m = ck, world_size
        self.notes: list[str] = []
        n = ck.partition_count
        self.src: Zero3Layout = ck.layouts[0]
        zcfg = ck.ds_config.get("zero_optimization") or {}
        self.sub_group_size = int(float(zcfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))
        osd0 = ck._optim[0]
        groups = osd0["optimizer_state_dict"]["param_groups"]
        src_subs = [[s for s in self.src.slots if s.sub_group == k] for k in range(len(self.src.sub_group_sizes))]
        self.group_of_sub = {}
        self.group_params: list[list] = []
        for g, group in enumerate(groups):
            params = []
            for k in group["params"]:
                self.group_of_sub[k] = g
                params += src_subs[k]
            self.group_params.append(params)
            # DeepSpeed's rule must reproduce the source's own cut before we trust it for the target
            cut = zero3_sub_groups([s.numel for s in params], n, self.sub_group_size)
            if [[params[i].name for i in c] for c in cut] != [[s.name for s in src_subs[k]] for k in group["params"]]:
                raise UnsupportedCheckpointError(
                    f"the ZeRO-3 sub-groups of parameter group {g} do not follow sub_group_size="
                    f"{self.sub_group_size}; ckptlib cannot tell how DeepSpeed would cut them at {world_size} ranks",
                    path=ck.location.tag_dir)
        dst_subs, self.dst_group_subs = [], []
        for g, params in enumerate(self.group_params):
            cut = zero3_sub_groups([s.numel for s in params], world_size, self.sub_group_size)
            self.dst_group_subs.append(list(range(len(dst_subs), len(dst_subs) + len(cut))))
            dst_subs += [[(params[i].name, params[i].shape) for i in c] for c in cut]
        self.dst = Zero3Layout.build(dst_subs, world_size)
        if len(dst_subs) != len(src_subs):
            self.notes.append(f"sub-groups re-cut for {world_size} ranks: {len(src_subs)} -> {len(dst_subs)}")

    @property
    def optim_prefix(self) -> str:
        return next((f.prefix for f in self.ck.files if f.kind == "optim_states"), "")

    def _param_shapes(self) -> list:
        return [collections.OrderedDict((s.name, torch.Size(s.shape)) for s in self.dst.slots if s.sub_group == k)
                for k in range(len(self.dst.sub_group_sizes))]

    def model_states(self, ctx: StreamContext) -> dict[str, Any]:
        ck, m = self.ck, self.m
        model0 = ck.model_states_file(0).obj
        frozen = [p for p in ck.parameters if not p.trainable and not p.tied_to and p.name in ck._frozen_source]
        out = {}
        for r in range(m):
            frags = collections.OrderedDict()
            for p in frozen:
                c = chunk_size(p.numel, m)
                real = max(0, min(c, p.numel - r * c))
                ranges = (slice_ranges(ck.sources(p.name), r * c, real) if real else []) + \
                    ([Zeros(c - real)] if c - real else [])
                dtype = ck._frozen_source[p.name][0].dtype
                frags[p.name] = streamed(dtype, ranges, ctx)
            repl = dict(dp_world_size=m, param_shapes=self._param_shapes())
            if model0.get("frozen_param_fragments") is not None:
                repl["frozen_param_fragments"] = type(model0["frozen_param_fragments"])(frags)
            if r != 0 and "shared_params" in model0:
                repl["shared_params"] = type(model0["shared_params"])() if isinstance(model0["shared_params"], dict) \
                    else model0["shared_params"]
            out[f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"] = _replace(model0, **repl)
        return out

    def optim_states(self, rank: int, ctx: StreamContext) -> tuple[str, Any]:
        ck, m = self.ck, self.m
        top = ck.optim_states_file(0).obj
        osd0 = top["optimizer_state_dict"]
        inner = osd0["optimizer_state_dict"]
        rg = ck._rank_tensor(0, 0).requires_grad
        flats = [streamed(torch.float32, _to_ranges(ck, reslice_zero3(self.src, self.dst, rank, k), None), ctx, rg)
                 for k in range(len(self.dst.sub_group_sizes))]
        state = type(inner["state"])()
        groups = []
        for g, group in enumerate(inner["param_groups"]):
            first_src = group["params"][0]
            template = inner["state"].get(first_src, {})
            for k in self.dst_group_subs[g]:
                new = type(template)()
                for key, v in template.items():
                    if isinstance(v, TensorHandle) and v.numel == self.src.sub_group_sizes[first_src] and v.numel > 1:
                        pieces = reslice_zero3(self.src, self.dst, rank, k)
                        new[key] = streamed(v.dtype, _to_ranges(ck, pieces, key), ctx, v.requires_grad)
                    else:  # step and other scalars; each sub-group keeps a tensor of its own, as DeepSpeed saves it
                        new[key] = copied(v, ctx) if isinstance(v, TensorHandle) else v
                state[k] = new
            groups.append(_replace(group, params=list(self.dst_group_subs[g])))
        new_inner = _replace(inner, state=state, param_groups=groups)
        new_osd = _replace(osd0, partition_count=m, fp32_flat_groups=flats, optimizer_state_dict=new_inner)
        return f"{self.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", _replace(top, optimizer_state_dict=new_osd)

    def feeds(self, rank: int) -> list[int]:
        ranks = set()
        for k in range(len(self.dst.sub_group_sizes)):
            ranks |= {p.rank for p in reslice_zero3(self.src, self.dst, rank, k) if isinstance(p, Piece)}
        return sorted(ranks)
