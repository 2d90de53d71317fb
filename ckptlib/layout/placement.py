"""How a full tensor is put together from the tensors that hold its pieces (pure arithmetic, no I/O).

A tensor-parallel checkpoint stores each weight as shards on the tensor ranks; a pipeline stores each
layer on the stage that owns it. A :class:`Block` says that the elements of a strided block of the full
(row-major) tensor are the elements of a strided block of one stored tensor (``source``: a set and a
local name), exactly as ``torch.as_strided(full, shape, full_strides, full_offset)`` ==
``torch.as_strided(local, shape, local_strides, local_offset)``; this is also the form of the
``affine_map`` DeepSpeed's AutoTP records. :func:`runs` turns a tensor's blocks into contiguous runs in
full-tensor order, checking that they tile it exactly once; :func:`blocks_from_rule` makes the blocks
of the Megatron split rules (replicated, split on dim 0, split on dim 1, vocabulary rows cut).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Hashable, NamedTuple, Optional, Sequence


def row_major_strides(shape: Sequence[int]) -> tuple:
    out, acc = [], 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


@dataclass(frozen=True)
class Block:
    """Elements of the full tensor at ``as_strided(shape, full_strides, full_offset)`` are those of stored
    tensor ``source`` at ``as_strided(shape, local_strides, local_offset)``. ``replicas`` are other stored
    tensors holding the same block (checked equal when read)."""

    source: Hashable
    shape: tuple
    full_offset: int
    full_strides: tuple
    local_offset: int
    local_strides: tuple
    replicas: tuple = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Run(NamedTuple):
    """``count`` consecutive elements of the full tensor from ``full_start`` are ``count`` consecutive
    elements of ``source`` (flattened) from ``local_start``. (A named tuple: a row-split tensor has one run
    per row and shard, tens of thousands in a model, and planning makes them all.)"""

    full_start: int
    count: int
    source: Hashable
    local_start: int


def _block_runs(b: Block) -> list[Run]:
    shape, fs, ls = b.shape, b.full_strides, b.local_strides
    if b.numel == 0:
        return []
    # the innermost dimensions that are consecutive in both tensors form one run
    n = len(shape)
    k, run = n, 1
    while k > 0 and (shape[k - 1] == 1 or (fs[k - 1] == run and ls[k - 1] == run)):
        run *= shape[k - 1]
        k -= 1
    if k == n:  # not even the last dimension is consecutive: runs of one element
        run = 1
    outer = shape[:k]
    src, fo0, lo0 = b.source, b.full_offset, b.local_offset
    if k == 1:  # one outer dimension (the rows of a row-split matrix): an arithmetic progression
        f, l = fs[0], ls[0]
        return [Run(fo0 + i * f, run, src, lo0 + i * l) for i in range(outer[0])]
    out = []
    for flat in range(math.prod(outer) if outer else 1):
        fo, lo, rest = fo0, lo0, flat
        for d in range(k - 1, -1, -1):
            rest, i = divmod(rest, outer[d])
            fo += i * fs[d]
            lo += i * ls[d]
        out.append(Run(fo, run, src, lo))
    return out


def runs(blocks: Sequence[Block], numel: int, what: str = "the tensor") -> list[Run]:
    """The runs of ``blocks`` in full-tensor order, merged where consecutive in both tensors.

    Raises:
        ValueError: the blocks leave a gap or overlap (naming ``what`` and the first element concerned).
    """
    all_runs = sorted((r for b in blocks for r in _block_runs(b)), key=itemgetter(0))
    out: list[Run] = []
    pos = 0
    for r in all_runs:
        start, count, source, local = r
        if start != pos:
            kind = "overlap" if start < pos else "gap"
            raise ValueError(f"the placement of {what} has a {kind} at element {min(pos, start)}")
        if out:
            last = out[-1]
            if last[2] == source and last[3] + last[1] == local:
                out[-1] = Run(last[0], last[1] + count, source, last[3])
                pos += count
                continue
        out.append(r)
        pos += count
    if pos != numel:
        raise ValueError(f"the placement of {what} covers {pos} of its {numel} elements")
    return out


def row_interleave(blocks: Sequence[Block], numel: int) -> Optional[tuple[int, list[tuple]]]:
    """``(rows, columns)`` when ``blocks`` tile a matrix side by side (a tensor split on dim 1, a row-parallel
    weight): each block holds all ``rows`` rows of ``width`` consecutive elements of every full row, its own
    rows ``local_stride`` apart in its source, the blocks edge to edge in ``full_offset`` order, neighbours
    (the last and the first included) of different sources. ``columns`` are ``(source, local_offset, width,
    local_stride)`` in that order, and :func:`runs` would give, row after row, each column's ``width``
    elements from ``local_offset + row * local_stride``: nothing merges. None for anything else (then use
    :func:`runs`), so a caller can make the tens of thousands of runs of such a tensor without sorting them."""
    if len(blocks) < 2:
        return None
    rows = row_length = None
    cols = []
    for b in blocks:
        if len(b.shape) != 2 or b.full_strides[1] != 1 or b.local_strides[1] != 1 or min(b.shape) < 1:
            return None
        if rows is None:
            rows, row_length = b.shape[0], b.full_strides[0]
        if b.shape[0] != rows or b.full_strides[0] != row_length:
            return None
        cols.append((b.full_offset, b.source, b.local_offset, b.shape[1], b.local_strides[0]))
    cols.sort(key=itemgetter(0))
    pos = 0
    for off, _, _, width, _ in cols:
        if off != pos:
            return None
        pos += width
    if pos != row_length or rows * row_length != numel:
        return None
    if any(cols[j][1] == cols[j - 1][1] for j in range(len(cols))):  # j - 1 = -1: the last beside the first
        return None
    return rows, [c[1:] for c in cols]


REPLICATED, COLUMN, ROW, VOCABULARY = "replicated", "column", "row", "vocabulary"


def blocks_from_rule(rule: str, shards: Sequence[tuple[Hashable, tuple]],
                     original_rows: Optional[int] = None) -> tuple[tuple, list[Block]]:
    """``(full shape, blocks)`` of a tensor stored as ``shards`` (``(source, local shape)`` in tensor-rank
    order) under a Megatron split rule: ``replicated`` (every shard is the whole tensor; the first one is
    read, the others are replicas), ``column`` (concatenated on dim 0), ``row`` (on dim 1), or
    ``vocabulary`` (on dim 0, then cut to ``original_rows`` rows when given: the padding of a
    vocabulary padded for tensor parallelism).

    Raises:
        ValueError: the shard shapes do not fit the rule.
    """
    shapes = [tuple(s) for _, s in shards]
    if rule == REPLICATED:
        if len(set(shapes)) != 1:
            raise ValueError(f"replicated shards differ in shape: {shapes}")
        shape = shapes[0]
        st = row_major_strides(shape)
        return shape, [Block(shards[0][0], shape, 0, st, 0, st, tuple(s for s, _ in shards[1:]))]
    dim = 1 if rule == ROW else 0
    if any(len(s) <= dim for s in shapes) or len({s[:dim] + s[dim + 1:] for s in shapes}) != 1:
        raise ValueError(f"shards of shapes {shapes} cannot be joined on dim {dim}")
    full = list(shapes[0])
    full[dim] = sum(s[dim] for s in shapes)
    if rule == VOCABULARY and original_rows is not None:
        if original_rows > full[0]:
            raise ValueError(f"the original vocabulary ({original_rows}) is larger than the shards ({full[0]})")
        full[0] = original_rows
    full = tuple(full)
    fst = row_major_strides(full)
    blocks, start = [], 0
    for source, s in shards:
        take = list(s)
        if dim == 0:
            take[0] = max(0, min(s[0], full[0] - start))
        if all(take):
            blocks.append(Block(source, tuple(take), start * fst[dim], fst, 0, row_major_strides(s)))
        start += s[dim]
    return full, blocks


def even_sizes(extent: int, parts: int) -> Optional[list[int]]:
    """``parts`` equal extents that make ``extent`` (None when ``parts`` does not divide it)."""
    if parts < 1 or extent % parts:
        return None
    return [extent // parts] * parts


def shard_runs(full_shape: Sequence[int], dim: Optional[int], sizes: Sequence[int], index: int
               ) -> tuple[tuple, list[tuple[int, int]]]:
    """``(local shape, runs)`` of shard ``index`` of a tensor of ``full_shape`` cut along ``dim`` into
    pieces of ``sizes`` (``dim`` None: the whole tensor, a replica): the runs are ``(start, count)`` of
    consecutive elements of the full tensor, flattened row-major, that make the shard flattened row-major."""
    full = tuple(int(x) for x in full_shape)
    numel = math.prod(full)
    if dim is None:
        return full, [(0, numel)] if numel else []
    if not 0 <= dim < len(full) or sum(sizes) != full[dim] or not 0 <= index < len(sizes):
        raise ValueError(f"cannot cut a {list(full)} tensor along dim {dim} into {list(sizes)}")
    outer, inner = math.prod(full[:dim]), math.prod(full[dim + 1:])
    first, size = sum(sizes[:index]), sizes[index]
    local = full[:dim] + (size,) + full[dim + 1:]
    if size == 0 or inner == 0:
        return local, []
    if outer == 1 or size == full[dim]:
        return local, [(first * inner, outer * size * inner)]
    step = full[dim] * inner
    return local, [(o * step + first * inner, size * inner) for o in range(outer)]


__all__ = ["Block", "Run", "runs", "row_interleave", "blocks_from_rule", "row_major_strides", "REPLICATED", "COLUMN", "ROW",
           "VOCABULARY", "even_sizes", "shard_runs"]
