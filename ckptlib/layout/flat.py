"""Pure layout arithmetic of DeepSpeed ZeRO partitions: no I/O, no torch.

Given parameter sizes, the data-parallel size and the flavour of ZeRO, these classes say which element
range of which parameter each rank holds, at which offset of that rank's flat tensor, and where the
padding lies. Everything else in ckptlib (reading, export, reshard, the layout view) is built on them.

ZeRO-1/2 (and BF16_Optimizer), :class:`FlatGroupLayout`
    Each optimizer parameter group is one flat vector: the trainable parameters in the order of the
    checkpoint's ``param_shapes`` (round-robin order when ``round_robin_gradients`` was on), each
    optionally followed by alignment padding (``param_alignment_paddings``, DeepSpeed >= 0.19.6), then
    zero padding up to a multiple of ``alignment`` (``2·N`` since DeepSpeed 0.5.3). The padded vector is
    cut into N equal partitions; rank ``r`` holds ``[r·P, (r+1)·P)``. ZeRO-1/2 save each rank's fp32
    partition with the tail padding removed ("lean"); BF16_Optimizer saves it padded.

ZeRO-3, :class:`Zero3Layout`
    Every parameter is split on its own into N chunks of ``ceil(numel/N)`` elements; rank ``r`` holds
    elements ``[r·c, (r+1)·c)`` (zero padded past ``numel``). A rank's flat tensor for a sub-group is
    the concatenation of its chunks of that sub-group's parameters, so every rank has the same length.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

from .ranges import Zeros  # runs of padding in re-sliced partitions


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, unsafe_hash=True)
class Piece:
    """A contiguous run of one parameter's elements stored on one rank.

    ``count`` elements of the parameter, starting at element ``param_start`` of its flattened value,
    live on ``rank`` at offset ``rank_start`` of tensor ``group`` (ZeRO-1/2: the param group's flat
    partition; ZeRO-3: the sub-group's flat partition). Hashable and compared by value, but not frozen
    (a frozen dataclass takes four times as long to make; planning a large reshard makes millions of
    pieces): treat it as immutable.
    """

    rank: int
    group: int
    rank_start: int
    param_start: int
    count: int


@dataclass(frozen=True)
class Segment:
    """One stretch of a rank's flat tensor: a parameter's elements, or padding (``name`` is None)."""

    rank_start: int
    count: int
    name: Optional[str] = None
    param_start: int = 0

    @property
    def is_padding(self) -> bool:
        return self.name is None


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter sits in a flat group."""

    name: str
    shape: tuple
    offset: int  # first element in the (unpartitioned) flat group
    padding_after: int = 0

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlatGroupLayout:
    """One ZeRO-1/2 (or BF16_Optimizer) parameter group partitioned over ``world_size`` ranks.

    Args:
        params: ``(name, shape)`` in flat order (the order of ``param_shapes`` for this group).
        world_size: N, the data-parallel size.
        alignment: the padded total is a multiple of this (default ``2·N``).
        paddings_after: optional alignment padding after each parameter (``param_alignment_paddings``).
        group: the group's index (carried into :class:`Piece`).
    """

    slots: tuple
    world_size: int
    alignment: int
    group: int = 0

    @classmethod
    def build(cls, params: Sequence[tuple], world_size: int, alignment: Optional[int] = None,
              paddings_after: Optional[Sequence[int]] = None, group: int = 0) -> "FlatGroupLayout":
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        alignment = 2 * world_size if alignment is None else alignment
        paddings_after = list(paddings_after) if paddings_after is not None else [0] * len(params)
        if len(paddings_after) != len(params):
            raise ValueError("paddings_after must have one entry per parameter")
        slots, offset = [], 0
        for (name, shape), pad in zip(params, paddings_after):
            slot = ParamSlot(name=name, shape=tuple(int(s) for s in shape), offset=offset, padding_after=int(pad))
            slots.append(slot)
            offset += slot.numel + slot.padding_after
        return cls(slots=tuple(slots), world_size=world_size, alignment=alignment, group=group)

    # ---------------------------------------------------------------- sizes
    @property
    def total(self) -> int:
        """Elements before the tail padding (parameters plus alignment gaps)."""
        if not self.slots:
            return 0
        last = self.slots[-1]
        return last.offset + last.numel + last.padding_after

    @property
    def numel(self) -> int:
        """Elements that belong to parameters."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_total(self) -> int:
        return ceil_div(self.total, self.alignment) * self.alignment if self.total else 0

    @property
    def partition_size(self) -> int:
        return self.padded_total // self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the padded flat group held by ``rank``."""
        p = self.partition_size
        return rank * p, (rank + 1) * p

    def lean_length(self, rank: int) -> int:
        """Length of the rank's saved fp32 partition with the tail padding removed (ZeRO-1/2)."""
        start, end = self.rank_range(rank)
        return max(0, min(end, self.total) - start)

    def tail_padding(self, rank: int) -> int:
        """Padding elements at the end of the rank's partition (DeepSpeed's ``group_paddings``)."""
        return self.partition_size - self.lean_length(rank)

    @cached_property
    def _by_name(self) -> dict:
        return {s.name: s for s in self.slots}

    @cached_property
    def _slot_ends(self) -> list:
        return [s.offset + s.numel + s.padding_after for s in self.slots]

    def slot(self, name: str) -> ParamSlot:
        """The slot of parameter ``name`` (a dict lookup; the index is built on first use)."""
        return self._by_name[name]

    # ---------------------------------------------------------------- where things are
    def pieces(self, name: str) -> list[Piece]:
        """The pieces of parameter ``name``, in element order (and so in rank order)."""
        s = self.slot(name)
        return self.range_pieces(s.offset, s.numel)

    def range_pieces(self, flat_start: int, count: int) -> list[Piece]:
        """Pieces covering elements ``[flat_start, flat_start+count)`` of the flat group."""
        out: list[Piece] = []
        p = self.partition_size
        pos, end = flat_start, flat_start + count
        while pos < end:
            rank = pos // p
            rank_end = (rank + 1) * p
            n = min(end, rank_end) - pos
            out.append(Piece(rank=rank, group=self.group, rank_start=pos - rank * p,
                             param_start=pos - flat_start, count=n))
            pos += n
        return out

    def segments(self, rank: int) -> list[Segment]:
        """What lies in ``rank``'s partition, in order: parameter pieces and padding."""
        start, end = self.rank_range(rank)
        segs: list[Segment] = []
        pos = start
        first = bisect.bisect_right(self._slot_ends, start)  # the slots before it end before the partition
        for i in range(first, len(self.slots)):
            s = self.slots[i]
            if s.offset >= end:
                break
            for lo, hi, name in ((s.offset, s.offset + s.numel, s.name),
                                 (s.offset + s.numel, s.offset + s.numel + s.padding_after, None)):
                a, b = max(lo, start), min(hi, end)
                if a < b:
                    if a > pos:
                        segs.append(Segment(rank_start=pos - start, count=a - pos))
                    segs.append(Segment(rank_start=a - start, count=b - a, name=name,
                                        param_start=a - lo if name else 0))
                    pos = b
        if pos < end:
            segs.append(Segment(rank_start=pos - start, count=end - pos))
        return segs

    def slice_mappings(self, rank: int) -> dict[str, tuple[int, int]]:
        """``name -> (rank_start, numel)`` for parameters overlapping ``rank``'s partition
        (DeepSpeed's ``param_slice_mappings``)."""
        return {s.name: (s.rank_start, s.count) for s in self.segments(rank) if not s.is_padding}

    # ---------------------------------------------------------------- whole parameters per partition
    @cached_property
    def _offsets(self) -> list:
        return [s.offset for s in self.slots]

    @cached_property
    def _numel_before(self) -> list:
        out, n = [0], 0
        for s in self.slots:
            n += s.numel
            out.append(n)
        return out

    def _partition_slot_range(self, rank: int) -> tuple[int, int]:
        """``[first, end)`` slot indices of the parameters DeepSpeed counts as in ``rank``'s partition
        (``get_partition_info``): those that start in it, and the one that runs into it from before."""
        start, end = self.rank_range(rank)
        lo = bisect.bisect_left(self._offsets, start)
        hi = bisect.bisect_left(self._offsets, end, lo)
        if lo > 0:
            s = self.slots[lo - 1]
            if s.offset < start < s.offset + s.numel:
                lo -= 1
        return lo, hi

    def partition_params(self, rank: int) -> list[ParamSlot]:
        """The parameters DeepSpeed counts as in ``rank``'s partition, in flat order: those that start in it,
        and the one that runs into it from the partition before (``get_partition_info``)."""
        lo, hi = self._partition_slot_range(rank)
        return list(self.slots[lo:hi])

    def whole_params_length(self, rank: int) -> int:
        """Elements of the whole parameters of :meth:`partition_params` (the length of a state kept per whole
        parameter, such as Muon's momentum at ZeRO-1/2)."""
        lo, hi = self._partition_slot_range(rank)
        return self._numel_before[hi] - self._numel_before[lo]

    def whole_param_places(self, name: str) -> list[tuple[int, int]]:
        """``(rank, offset)`` of every partition whose whole-parameter state holds parameter ``name``, and where
        (elements before it in that rank's state), in rank order: the partition it starts in, then those it
        runs into."""
        s = self.slot(name)
        p = self.partition_size
        if p == 0:
            return []
        first = s.offset // p
        last = (s.offset + s.numel - 1) // p if s.numel else first
        index = self._by_index[name]
        out = []
        for rank in range(first, min(last, self.world_size - 1) + 1):
            lo, _ = self._partition_slot_range(rank)
            out.append((rank, self._numel_before[index] - self._numel_before[lo]))
        return out

    @cached_property
    def _by_index(self) -> dict:
        return {s.name: i for i, s in enumerate(self.slots)}


# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Zero3Slot:
    name: str
    shape: tuple
    sub_group: int
    offset: int  # offset of this parameter's chunk within each rank's sub-group flat tensor

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Zero3Layout:
    """ZeRO-3 per-parameter partitioning over ``world_size`` ranks.

    Args (to :meth:`build`):
        sub_groups: for each sub-group (one flat fp32 tensor per rank), ``(name, shape)`` in order.
        world_size: N.
    """

    slots: tuple
    world_size: int
    sub_group_sizes: tuple  # per-rank flat length of each sub-group
    sub_group_worlds: tuple = ()  # ranks each sub-group is partitioned over, where not all (AutoEP's experts)

    def world_of(self, sub_group: int) -> int:
        """Over how many ranks ``sub_group`` is partitioned (``world_size`` unless ``sub_group_worlds`` says)."""
        return self.sub_group_worlds[sub_group] if sub_group < len(self.sub_group_worlds) else self.world_size

    @classmethod
    def build(cls, sub_groups: Sequence[Sequence[tuple]], world_size: int) -> "Zero3Layout":
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        slots, sizes = [], []
        for g, params in enumerate(sub_groups):
            offset = 0
            for name, shape in params:
                shape = tuple(int(s) for s in shape)
                slots.append(Zero3Slot(name=name, shape=shape, sub_group=g, offset=offset))
                offset += chunk_size(math.prod(shape), world_size)
            sizes.append(offset)
        return cls(slots=tuple(slots), world_size=world_size, sub_group_sizes=tuple(sizes))

    @cached_property
    def _by_name(self) -> dict:
        return {s.name: s for s in self.slots}

    @cached_property
    def _by_sub_group(self) -> dict:
        out: dict = {}
        for s in self.slots:
            out.setdefault(s.sub_group, []).append(s)
        return out

    def slot(self, name: str) -> Zero3Slot:
        """The slot of parameter ``name`` (a dict lookup; the index is built on first use)."""
        return self._by_name[name]

    def sub_group_slots(self, sub_group: int) -> list:
        """The slots of ``sub_group``, in order."""
        return self._by_sub_group.get(sub_group, [])

    def chunk(self, name: str) -> int:
        s = self.slot(name)
        return chunk_size(s.numel, self.world_of(s.sub_group))

    def pieces(self, name: str) -> list[Piece]:
        """Pieces of ``name``, one per rank that holds real (non-padding) elements, in rank order (the ranks of
        its sub-group's partition: ``0 .. world_of(sub_group) - 1``)."""
        s = self.slot(name)
        w = self.world_of(s.sub_group)
        c = chunk_size(s.numel, w)
        return [Piece(rank=r, group=s.sub_group, rank_start=s.offset, param_start=r * c, count=n)
                for r, n in enumerate(zero3_real_counts(s.numel, w)) if n > 0]

    def param_range_pieces(self, name: str, start: int, count: int) -> list[Piece]:
        """Pieces holding elements ``[start, start+count)`` of parameter ``name`` (``param_start`` absolute)."""
        s = self.slot(name)
        c = chunk_size(s.numel, self.world_of(s.sub_group))
        out, i, end = [], start, start + count
        if end > s.numel:
            raise IndexError(f"{name} has {s.numel} elements; [{start}, {end}) is out of bounds")
        group, base = s.sub_group, s.offset
        while i < end:
            rank, off = divmod(i, c)
            n = min(c - off, end - i)
            out.append(Piece(rank, group, base + off, i, n))  # rank, group, rank_start, param_start, count
            i += n
        return out

    def segments(self, rank: int, sub_group: int) -> list[Segment]:
        """Parameter chunks and padding in ``rank``'s flat tensor of ``sub_group``."""
        segs: list[Segment] = []
        w = self.world_of(sub_group)
        for s in self.sub_group_slots(sub_group):
            c = chunk_size(s.numel, w)
            real = zero3_real_count(s.numel, w, rank)
            if real:
                segs.append(Segment(rank_start=s.offset, count=real, name=s.name, param_start=rank * c))
            if c - real:
                segs.append(Segment(rank_start=s.offset + real, count=c - real))
        return segs


def chunk_size(numel: int, world_size: int) -> int:
    """ZeRO-3 partition size of a parameter: ``ceil(numel / N)``."""
    return ceil_div(numel, world_size)


def zero3_real_counts(numel: int, world_size: int) -> list[int]:
    """How many real (non-padding) elements of a ZeRO-3 parameter each rank holds."""
    c = chunk_size(numel, world_size)
    return [max(0, min(c, numel - r * c)) for r in range(world_size)]


def zero3_real_count(numel: int, world_size: int, rank: int) -> int:
    """How many real (non-padding) elements of a ZeRO-3 parameter ``rank`` holds (one entry of
    :func:`zero3_real_counts`, without building the list)."""
    c = chunk_size(numel, world_size)
    return max(0, min(c, numel - rank * c))


DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size


def configured_sub_group_size(ds_config: dict) -> int:
    """The ``zero_optimization.sub_group_size`` a DeepSpeed config sets (DeepSpeed's default where it sets none)."""
    zcfg = (ds_config or {}).get("zero_optimization") or {}
    return int(float(zcfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)))


def zero3_sub_groups(numels: Sequence[int], world_size: int, sub_group_size: int) -> list[list[int]]:
    """Indices of one optimizer group's parameters cut into ZeRO-3 sub-groups, as DeepSpeed cuts them.

    Parameters are taken in order; a sub-group closes once the sum of its parameters' partition sizes
    (``ceil(numel/N)``) reaches ``sub_group_size``, and at the last parameter. A group whose total
    partition size does not exceed ``sub_group_size`` is one sub-group.
    """
    if not numels:
        return []
    sizes = [chunk_size(n, world_size) for n in numels]
    if sub_group_size is None or sub_group_size >= sum(sizes):
        return [list(range(len(numels)))]
    groups, current, acc = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        acc += size
        if acc >= sub_group_size or i == len(sizes) - 1:
            groups.append(current)
            current, acc = [], 0
    return groups


def reslice_flat(src: FlatGroupLayout, dst: FlatGroupLayout, rank: int, padded: bool = True) -> list:
    """What target ``rank``'s partition of ``dst`` is made of: pieces of ``src`` partitions, then zeros.

    ``src`` and ``dst`` are the same flat group at two world sizes. With ``padded`` the list covers the
    whole target partition (Adam moments, BF16_Optimizer fp32); without, only its real elements (the
    lean fp32 partition ZeRO-1/2 save).
    """
    if src.total != dst.total:
        raise ValueError("source and target layouts hold different flat groups")
    start, end = dst.rank_range(rank)
    real_end = max(start, min(end, dst.total))
    out: list = src.range_pieces(start, real_end - start) if real_end > start else []
    if padded and end > real_end:
        out.append(Zeros(end - real_end))
    return out


def reslice_zero3(src: Zero3Layout, dst: Zero3Layout, rank: int, sub_group: int) -> list:
    """What target ``rank``'s flat tensor of ``dst`` sub-group ``sub_group`` is made of: for each of its
    parameters, the source pieces of the chunk ``[rank·c, (rank+1)·c)`` (``c = ceil(numel/M)``), then
    zeros where the chunk runs past the parameter."""
    out: list = []
    m = dst.world_size
    for s in dst.sub_group_slots(sub_group):
        numel = s.numel
        c = -(-numel // m)  # chunk_size
        lo = rank * c
        real = max(0, min(c, numel - lo))
        if real:
            out += src.param_range_pieces(s.name, lo, real)
        if c - real:
            out.append(Zeros(c - real))
    return out


def round_robin_order(count: int, world_size: int) -> list[int]:
    """Natural indices of a group's parameters in the order DeepSpeed's ``round_robin_gradients`` puts
    them in the flat group at ``world_size`` ranks: every ``world_size``-th parameter, starting at 0, 1, ..."""
    return [i for j in range(min(world_size, count)) for i in range(j, count, world_size)]


def reslice_by_params(src: FlatGroupLayout, dst: FlatGroupLayout, rank: int, padded: bool = True) -> list:
    """Like :func:`reslice_flat` for flat groups that hold the same parameters in a different order (e.g.
    ``round_robin_gradients`` at two world sizes): each parameter stretch of the target partition comes
    from that parameter's place in the source; padding and alignment gaps are zeros."""
    out: list = []
    segs = dst.segments(rank)
    if not padded:
        while segs and segs[-1].is_padding:
            segs.pop()
    for seg in segs:
        if seg.is_padding:
            out.append(Zeros(seg.count))
        else:
            out += src.range_pieces(src.slot(seg.name).offset + seg.param_start, seg.count)
    return out
