"""How a DCP tensor's stored chunks tile it: pure arithmetic on their boxes (offsets and sizes per dimension).

A chunk is a box of the full tensor (FSDP2's ``Shard(0)`` rows, a 2-D shard, the whole tensor). Row-major,
a box is a list of runs, each consecutive in the full tensor and in the chunk. :func:`tile` sweeps the runs of
every chunk in full-tensor order: the first chunk to reach an element gives it; an element a later chunk
holds again is an *overlap* (replicated pieces, as a sharded HF save may hold; they must hold the same
bytes, which the caller compares); an element no chunk holds is a *hole* (refused: nothing says what it is).

No I/O.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple, Sequence

from ..layout.placement import row_major_strides


class Run(NamedTuple):
    """``count`` consecutive elements of the full tensor from ``start`` are those of chunk ``chunk`` (flattened)
    from ``local``."""

    start: int
    count: int
    chunk: int
    local: int


class TilingError(ValueError):
    """The chunks leave a hole or reach outside the tensor; ``element`` is the first element concerned (its
    index in each dimension) and ``chunks`` the chunks next to it."""

    def __init__(self, message: str, chunks: tuple = ()):
        super().__init__(message)
        self.chunks = chunks


def box_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], chunk: int = 0) -> list[Run]:
    """The runs of the box ``sizes`` at ``offsets`` of a tensor of ``shape``, in order."""
    n = len(shape)
    if n == 0:
        return [Run(0, 1, chunk, 0)]
    if any(s == 0 for s in sizes):
        return []
    k = n - 1  # dims after k are whole in the box: a run spans them and the box's extent in dim k
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    run = math.prod(sizes[k:])
    full, local = row_major_strides(shape), row_major_strides(sizes)
    base = sum(o * f for o, f in zip(offsets, full))
    out = []
    for idx in itertools.product(*(range(s) for s in sizes[:k])):
        start = base + sum(i * f for i, f in zip(idx, full))
        out.append(Run(start, run, chunk, sum(i * s for i, s in zip(idx, local))))
    return out


def _where(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for s in reversed(tuple(shape)):
        flat, i = divmod(flat, s) if s else (flat, 0)
        out.append(i)
    return list(reversed(out))


def tile(shape: Sequence[int], boxes: Sequence[tuple], what: str = "the tensor") -> tuple[list[Run], list[Run]]:
    """``(runs, overlaps)`` of the chunk ``boxes`` (``(offsets, sizes)`` each) of a tensor of ``shape``: the runs
    covering it once, in order, merged where consecutive in one chunk; and each run of a chunk over elements an
    earlier one gave (``start`` and ``count`` in the full tensor, from ``local`` of chunk ``chunk``).

    Raises:
        TilingError: a box outside the tensor, or an element no box holds (naming where).
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    every = []
    for i, (offsets, sizes) in enumerate(boxes):
        if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise TilingError(f"{what}: a piece of shape {list(sizes)} at {list(offsets)} lies outside its size "
                              f"{list(shape)}", (i,))
        every += box_runs(shape, offsets, sizes, i)
    every.sort(key=lambda r: (r.start, r.chunk))
    out: list[Run] = []
    overlaps: list[Run] = []
    pos = 0
    last_chunk = None
    for start, count, chunk, local in every:
        if start > pos:
            raise TilingError(f"{what}: no piece holds element {_where(pos, shape)} (a hole of "
                              f"{start - pos} elements in its size {list(shape)})",
                              tuple(c for c in (last_chunk, chunk) if c is not None))
        end = start + count
        if start < pos:
            overlaps.append(Run(start, min(end, pos) - start, chunk, local))
            if end <= pos:
                continue
            local += pos - start
            count, start = end - pos, pos
        if out and out[-1].chunk == chunk and out[-1].local + out[-1].count == local and out[-1].start + \
                out[-1].count == start:
            out[-1] = Run(out[-1].start, out[-1].count + count, chunk, out[-1].local)
        else:
            out.append(Run(start, count, chunk, local))
        pos, last_chunk = end, chunk
    if pos < numel:
        raise TilingError(f"{what}: no piece holds element {_where(pos, shape)} onwards (its last "
                          f"{numel - pos} elements, of its size {list(shape)})",
                          (last_chunk,) if last_chunk is not None else ())
    return out, overlaps


__all__ = ["Run", "TilingError", "box_runs", "tile"]
