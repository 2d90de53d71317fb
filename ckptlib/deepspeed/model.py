"""The full model of a checkpoint, joined from its ZeRO sets: names, shapes, and where every element is.

A :class:`ModelView` lists the model's parameters and buffers as the un-parallelised model names them
(full shapes) and, for each, the blocks (:mod:`ckptlib.layout.placement`) that the stored tensors supply:
one block from the set that holds it (data parallel, pipeline stages), shards joined by split rules
(tensor parallel), experts under their global ids (MoE). :meth:`ModelView.sources` turns that into
the stored byte ranges of the full tensor (metadata only); tensors stored more than once (replicated
across tensor ranks) also give :meth:`ModelView.replica_checks`, ranges that must be equal and are
compared when a plan runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from ..layout.placement import Block, row_interleave, row_major_strides, runs
from ..layout.ranges import StoredRange, range_starts, slice_ranges
from .records import BufferInfo, NameIndex, ParameterInfo

#: resolves a block's source (and an optimizer state key, None for the weight) to its local range list
Resolver = Callable[[Hashable, Optional[str]], list]


@dataclass
class ModelView:
    """The model as its un-parallelised form names it (see the module docstring).

    Attributes:
        parameters, buffers: full names and shapes, in ``order``'s order.
        order: the ``state_dict`` order of the model (tied aliases included).
        blocks: per parameter or buffer owner, the blocks that make it.
        resolve: local ranges of a block's source.
        kind: ``"data_parallel"``, ``"pipeline"``, ``"tensor_parallel"``, ``"moe"``, ...
        notes: how the model was joined, for the user.
    """

    parameters: list
    buffers: list
    order: list
    blocks: dict
    resolve: Resolver = field(repr=False, default=None)
    kind: str = "data_parallel"
    notes: list = field(default_factory=list)
    roles: dict = field(default_factory=dict)  # tensor parallel: name -> "replicated"/"column"/"row"/"vocabulary"/"affine"
    set_labels: dict = field(default_factory=dict)  # mp rank -> how the user knows that set ("stage 1, tensor rank 0")
    padded: dict = field(default_factory=dict)  # vocabulary tensors: name -> (shape, blocks) with the padding rows
    sets: dict = field(default_factory=dict)  # mp rank -> its ZeroSet (a block's source is (mp, name in that set))

    _params: NameIndex = field(default_factory=NameIndex, init=False, repr=False, compare=False)
    _buffers: NameIndex = field(default_factory=NameIndex, init=False, repr=False, compare=False)

    def param(self, name: str) -> ParameterInfo:
        p = self._params.get(self.parameters, name)
        if p is None:
            raise KeyError(name)
        return p

    def buffer(self, name: str) -> BufferInfo:
        b = self._buffers.get(self.buffers, name)
        if b is None:
            raise KeyError(name)
        return b

    def _owner(self, name: str) -> tuple[str, tuple]:
        b = self._buffers.get(self.buffers, name)
        if b is not None:
            return name, tuple(b.shape)
        p = self.param(name)
        if p.tied_to:
            return self._owner(p.tied_to)
        return p.name, tuple(p.shape)

    def full_shape(self, name: str, padded: bool = False) -> tuple:
        """The full tensor's shape; ``padded``: with a padded vocabulary's padding rows (see :meth:`sources`)."""
        owner, shape = self._owner(name)
        return tuple(self.padded[owner][0]) if padded and owner in self.padded else shape

    def sources(self, name: str, key: Optional[str] = None, padded: bool = False) -> list:
        """The stored ranges that, concatenated, give the full tensor ``name`` flattened (``key``: an
        optimizer state, :data:`~ckptlib.deepspeed.zeroset.MODULE` for the stored 16-bit module weight, None
        for the fp32 master or the buffer). A tensor-parallel vocabulary comes without its padding rows
        (what the model's vocabulary is); ``padded``: with them (what the ranks store). Metadata only."""
        owner, shape = self._owner(name)
        blocks = self.blocks[owner]
        if padded and owner in self.padded:
            shape, blocks = self.padded[owner]
            shape = tuple(shape)
        numel = 1
        for s in shape:
            numel *= s
        if len(blocks) == 1 and _whole(blocks[0], shape):
            return list(self.resolve(blocks[0].source, key))
        side_by_side = row_interleave(blocks, numel)
        if side_by_side is not None:
            out = self._interleaved(*side_by_side, key)
            if out is not None:
                return out
        local: dict = {}  # source -> (its ranges, where each starts): each run is found by binary search
        out: list = []
        for _, count, source, at in runs(blocks, numel, owner):
            got = local.get(source)
            if got is None:
                ranges = self.resolve(source, key)
                one = _one_stored(ranges)
                got = local[source] = (ranges, range_starts(ranges), one, one.itemsize if one else 0)
            one = got[2]
            if one is not None and at + count <= one.count:  # the source is one stored range: no search
                out.append(StoredRange(one.path, one.offset + at * got[3], one.dtype, count))
            else:
                out += slice_ranges(got[0], at, count, got[1])
        return out

    def _interleaved(self, rows: int, columns: list, key: Optional[str]) -> Optional[list]:
        """The ranges of a tensor whose blocks lie side by side (:func:`row_interleave`), row by row, when each
        block's source is one stored range that holds it; else None."""
        cols = []
        for source, at, width, stride in columns:
            one = _one_stored(self.resolve(source, key))
            if one is None or at + (rows - 1) * stride + width > one.count:
                return None
            size = one.itemsize
            cols.append((one.path, one.offset + at * size, one.dtype, width, stride * size))
        return [StoredRange(path, base + i * step, dtype, width)
                for i in range(rows) for path, base, dtype, width, step in cols]

    def state_group(self, name: str):
        """What the optimizer group of parameter ``name`` keeps (see
        :meth:`~ckptlib.deepspeed.zeroset.ZeroSet.state_group`), or None."""
        owner, _ = self._owner(name)
        if self._buffers.get(self.buffers, owner) is not None:
            return None
        source = self.blocks[owner][0].source
        return self.sets[source[0]].state_group(source[1])

    def state_keys(self, name: str) -> tuple:
        """The per-element optimizer state keys of parameter ``name`` (those of the group that holds it)."""
        owner, _ = self._owner(name)
        if self._buffers.get(self.buffers, owner) is not None:
            return ()
        source = self.blocks[owner][0].source
        return self.sets[source[0]].state_keys(source[1])

    def replica_checks(self, name: str, key: Optional[str] = None) -> list[tuple[str, list, list]]:
        """``(what, ranges, replica ranges)`` for every block of ``name`` stored more than once (replicated
        across tensor ranks or stages, or a whole-parameter state held by several data ranks of a set): the
        replicas must hold the same bytes (a plan compares them before writing)."""
        owner, _ = self._owner(name)
        out = []
        for b in self.blocks[owner]:
            zs = self.sets.get(b.source[0]) if isinstance(b.source, tuple) else None
            if zs is not None:
                for what, first, rep in zs.state_replicas(b.source[1], key):
                    label = self.label(b.source)
                    out.append((f"{what} ({label})" if label and label != f"mp rank {b.source[0]}" else what,
                                first, rep))
            if not b.replicas:
                continue
            first = self.resolve(b.source, key)
            n = 1
            for s in b.shape:
                n *= s
            for rep in b.replicas:
                what = f"{owner}{'/' + key if key else ''}: {self.label(b.source)} and {self.label(rep)}"
                out.append((what, slice_ranges(first, b.local_offset, n) if _dense(b) else first,
                            slice_ranges(self.resolve(rep, key), b.local_offset, n) if _dense(b)
                            else self.resolve(rep, key)))
        return out


    def label(self, source: Hashable) -> str:
        """The set a block's source lies in, as the user knows it."""
        if isinstance(source, tuple) and len(source) == 2:
            return self.set_labels.get(source[0]) or f"mp rank {source[0]}"
        return str(source)


def _one_stored(ranges: list):
    """The one stored range ``ranges`` is made of, or None."""
    return ranges[0] if len(ranges) == 1 and isinstance(ranges[0], StoredRange) else None


def _whole(b: Block, shape: tuple) -> bool:
    st = row_major_strides(shape)
    return b.full_offset == 0 and b.local_offset == 0 and tuple(b.shape) == shape and \
        tuple(b.full_strides) == st and tuple(b.local_strides) == st


def _dense(b: Block) -> bool:
    return tuple(b.local_strides) == row_major_strides(b.shape)


def whole(source: Hashable, shape: tuple, replicas: tuple = ()) -> Block:
    """A block that is all of a tensor of ``shape``."""
    st = row_major_strides(shape)
    return Block(source, tuple(shape), 0, st, 0, st, tuple(replicas))


def single_set_view(zs) -> ModelView:
    """The model of a checkpoint with one ZeRO set: its own names and shapes."""
    blocks = {p.name: [whole((zs.mp, p.name), tuple(p.shape))] for p in zs.parameters if not p.tied_to}
    blocks.update({b.name: [whole((zs.mp, b.name), tuple(b.shape))] for b in zs.buffers})
    return ModelView(parameters=list(zs.parameters), buffers=list(zs.buffers), order=zs.state_dict_names(),
                     blocks=blocks, resolve=lambda source, key: zs.sources(source[1], key), sets={zs.mp: zs})


__all__ = ["ModelView", "Resolver", "whole", "single_set_view"]
