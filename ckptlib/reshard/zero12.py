"""Target files of a ZeRO-1/2 (or BF16_Optimizer) checkpoint at another data-parallel size."""
from __future__ import annotations

import collections
from typing import Any, Optional

from ..deepspeed import BF16_OPTIMIZER, ZeroSet
from ..deepspeed import files as fnames
from ..errors import UnsupportedCheckpointError
from ..io.torchzip import FragmentAddress, TensorHandle
from ..io.torchzip.standins import TorchSize
from ..kinds.optimizers import WHOLE_PARAMS
from ..layout.flat import FlatGroupLayout, Piece, reslice_by_params, reslice_flat, round_robin_order
from .trees import optim_prefix, replace, stored_dtype, streamed, to_ranges


class Zero12Writer:
    """The optimizer-states files of one ZeRO-1/2 (or BF16_Optimizer) set at ``world_size`` data-parallel
    ranks, whose flat groups are ``dst``, made from the file tree of ``template``'s data rank 0 (a source
    set: its keys, hyper-parameters and scalars carried over). Subclasses say where each target partition's
    bytes come from (:meth:`partition_ranges`, :meth:`feeds`); ``mp`` is the target's model-parallel rank
    (its file names)."""

    def __init__(self, template: ZeroSet, dst: list, world_size: int, mp: int):
        self.template, self.dst, self.m, self.mp = template, dst, world_size, mp
        self.bf16 = template.flavor == BF16_OPTIMIZER
        self._optim0 = template.optim_states_file(template.rank(0)).obj  # every target optimizer file is made from it
        self._prefix = optim_prefix(template)

    def partition_ranges(self, g: int, rank: int, padded: bool, key) -> list:
        """The stored ranges (and zeros) of target ``rank``'s partition of group ``g`` for state ``key``
        (None: the fp32 master); ``padded``: to the full partition size (else lean, as DeepSpeedZeroOptimizer
        saves the last rank's fp32 partition)."""
        raise NotImplementedError

    def feeds(self, rank: int) -> list:
        """What target ``rank`` reads (source ranks, for the plan's table)."""
        raise NotImplementedError

    def group_paddings(self, layouts: list[FlatGroupLayout], rank: int, world: int) -> list[int]:
        if self.bf16:  # BF16_Optimizer records all padding on the last rank
            return [(lay.padded_total - lay.total) if rank == world - 1 else 0 for lay in layouts]
        return [lay.tail_padding(rank) for lay in layouts]

    def placement(self, g: int, rank: int) -> tuple[FlatGroupLayout, int, int]:
        """``(layout, partition, ranks)`` of group ``g`` on target ``rank``: which flat group it holds a
        partition of, which one, and over how many ranks the group is partitioned (every group over all
        ranks here; an expert group over its expert-data-parallel ranks for MoE)."""
        return self.dst[g], rank, self.m

    def group_overrides(self, g: int) -> dict:
        """Entries of parameter group ``g``'s hyper-parameters that the target changes (none here)."""
        return {}

    def param_ranges(self, g: int, rank: int, name: str, key: str) -> list:
        """The stored ranges of the whole state ``key`` of parameter ``name`` of group ``g`` as target ``rank`` holds
        it (for a key kept per whole parameter, :data:`~ckptlib.kinds.optimizers.WHOLE_PARAMS`)."""
        raise NotImplementedError

    def group_state(self, g: int, rank: int, saved: Optional[dict]) -> Optional[dict]:
        """Target ``rank``'s state of group ``g``, made from the template's (``saved``, rank 0's; None where that
        rank keeps none): every per-element key the group keeps (:mod:`ckptlib.kinds.optimizers`) re-cut for the
        target partition, PARTITIONED keys padded to it, WHOLE_PARAMS keys (Muon's momentum) as the whole state of
        each parameter the target partition touches; the step and other scalars as they are.

        Raises:
            UnsupportedCheckpointError: a tensor in the state that no key of the group places."""
        gs = self.template.optimizer.group(g)
        keys = {k.name: k for k in gs.keys} if gs is not None else {}
        new = type(saved)() if saved is not None else {}
        for key, v in (saved or {}).items():
            if key in keys:
                continue
            if isinstance(v, TensorHandle) and v.numel > 1:
                raise UnsupportedCheckpointError(
                    f"group {g}'s optimizer state holds '{key}' ({v.numel} elements), which no layout places: it "
                    "cannot be re-cut for another size", path=self.template.location.tag_dir)
            new[key] = v  # step and other scalars: the same on every rank
        for key, sk in keys.items():
            rg = bool(getattr((saved or {}).get(key), "requires_grad", False))
            if sk.layout == WHOLE_PARAMS:
                ranges = [r for slot in self.dst[g].partition_params(self.placement(g, rank)[1])
                          for r in self.param_ranges(g, rank, slot.name, key)]
                if not ranges:
                    continue  # a partition that touches none of the group's parameters keeps no such state
            else:
                ranges = self.partition_ranges(g, rank, True, key)
            new[key] = streamed(sk.dtype, ranges, requires_grad=rg)
        if saved is None and not new:
            return None
        return new

    def master_dtype(self, g: int) -> str:
        """The dtype of group ``g``'s masters as the source stores them (that of the first stored range of any target
        partition; fp32 where none holds one): fp32, or bf16 under DeepSpeed's ``bf16_master_weights_and_grads``."""
        return next((d for r in range(self.m) for d in [stored_dtype(self.partition_ranges(g, r, True, None))] if d),
                    "float32")

    def optim_states(self, rank: int) -> tuple[str, Any]:
        """``(file name, object tree)`` of target ``rank``'s optimizer-states file: the masters in the dtype the
        source stores them in (:meth:`master_dtype`), each state key in its own."""
        m = self.m
        top = self._optim0
        osd0 = top["optimizer_state_dict"]
        fp32 = []
        for g in range(len(self.dst)):
            rg = self.template.partition_tensor(self.template.rank(0), g).requires_grad
            ranges = self.partition_ranges(g, rank, self.bf16, None)
            fp32.append(streamed(stored_dtype(ranges) or self.master_dtype(g), ranges, requires_grad=rg))
        base = osd0["base_optimizer_state"]
        state = type(base["state"])()
        for g in range(len(self.dst)):
            new = self.group_state(g, rank, base["state"].get(g))
            if new is not None:
                state[g] = new
        counts = osd0.get("partition_count")
        places = [self.placement(g, rank) for g in range(len(self.dst))]
        mappings = [collections.OrderedDict((n, FragmentAddress(numel=cnt, start=start))
                                            for n, (start, cnt) in lay.slice_mappings(idx).items())
                    for lay, idx, _ in places]
        if all(world == m and idx == rank for _, idx, world in places):
            paddings = self.group_paddings(self.dst, rank, m)
        else:
            paddings = [self.group_paddings([lay], idx, world)[0] for lay, idx, world in places]
        groups = [replace(pg, **self.group_overrides(g)) if self.group_overrides(g) else pg
                  for g, pg in enumerate(base["param_groups"])]
        repl = dict(
            single_partition_of_fp32_groups=fp32,
            base_optimizer_state=replace(base, state=state, param_groups=groups),
            group_paddings=paddings,
            partition_count=[world for _, _, world in places] if isinstance(counts, (list, tuple)) else m,
        )
        if "param_slice_mappings" in osd0:
            repl["param_slice_mappings"] = mappings
        if isinstance(osd0.get("param_alignment_paddings"), (list, tuple)):  # one entry per parameter of each group
            repl["param_alignment_paddings"] = [[s.padding_after for s in lay.slots] for lay in self.dst]
        new_top = replace(top, optimizer_state_dict=replace(osd0, **repl))
        return fnames.optim_states_name(rank, self.mp, prefix=self._prefix), new_top


class Zero12Resharder(Zero12Writer):
    """Target files of one ZeRO-1/2 (or BF16_Optimizer) set (a checkpoint's, or one stage's or tensor
    rank's) at ``world_size`` data-parallel ranks."""

    def __init__(self, ck: ZeroSet, world_size: int):
        self.ck, self.m = ck, world_size
        self.bf16 = ck.flavor == BF16_OPTIMIZER
        self.src: list[FlatGroupLayout] = ck.layouts
        self.notes: list[str] = []
        zcfg = ck.ds_config.get("zero_optimization") or {}
        self.round_robin = bool(zcfg.get("round_robin_gradients")) and not self.bf16
        super().__init__(ck, [self._target_layout(lay, g) for g, lay in enumerate(self.src)], world_size, ck.mp)
        self._same_order = [[s.name for s in a.slots] == [s.name for s in b.slots] for a, b in zip(self.src, self.dst)]
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
        if self._same_order[g]:
            return reslice_flat(self.src[g], self.dst[g], rank, padded)
        return reslice_by_params(self.src[g], self.dst[g], rank, padded)

    def partition_ranges(self, g: int, rank: int, padded: bool, key) -> list:
        return to_ranges(self.ck, self._reslice(g, rank, padded), key)

    def param_ranges(self, g: int, rank: int, name: str, key: str) -> list:
        return self.ck.sources(name, key)

    def _check_source(self) -> None:
        """What only a reshard needs of the source (the identity of every rank file, its paddings and, without
        round_robin_gradients, its param_slice_mappings were checked by
        :func:`~ckptlib.deepspeed.exactness.require_exact`)."""
        ck = self.ck
        mismatched_mappings = False
        for r in range(ck.partition_count):
            osd = ck.optimizer_state_dict(ck.rank(r))
            if "base_optimizer_state" in osd and not isinstance(osd["base_optimizer_state"], dict):
                raise UnsupportedCheckpointError(
                    "elastic ZeRO-1/2 optimizer state (saved with elastic_checkpoint: true) cannot be resharded yet "
                    f"(written by {ck.written_by()})", path=ck.optim_states_file(ck.rank(r)).path)
            for g, mapping in enumerate(osd.get("param_slice_mappings") or []):
                have = {n: (getattr(a, "start", None), getattr(a, "numel", None))
                        for n, a in (mapping.items() if isinstance(mapping, dict) else [])}
                if g < len(self.src) and have != self.src[g].slice_mappings(r):
                    mismatched_mappings = True
        if mismatched_mappings and self.round_robin:
            self.notes.append("the source's param_slice_mappings disagree with its flat layout (DeepSpeed computes "
                              "them in natural parameter order, which is wrong under round_robin_gradients); the "
                              "target gets mappings that match its layout")

    def model_states(self) -> dict[str, Any]:
        """``{file name: object tree}`` of the target's model-states file."""
        model = self.ck.model_states_file().obj
        repl: dict = dict(dp_world_size=self.m)
        if self.round_robin:  # param_shapes lists each group in its flat (round-robin) order
            repl["param_shapes"] = [collections.OrderedDict((s.name, TorchSize(s.shape)) for s in lay.slots)
                                    for lay in self.dst]
        return {fnames.model_states_name(self.ck.mp): replace(model, **repl)}

    def feeds(self, rank: int) -> list[int]:
        """The source ranks whose bytes target ``rank`` reads."""
        ranks = set()
        for g in range(len(self.src)):
            ranks |= {p.rank for p in self._reslice(g, rank, True) if isinstance(p, Piece)}
        return sorted(ranks)


__all__ = ["Zero12Resharder", "Zero12Writer"]
