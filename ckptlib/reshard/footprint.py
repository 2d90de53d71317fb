"""What one rank of a mesh holds while it trains (model states only), to pick a mesh before a job is queued.

Per rank, for ``n`` parameter elements of its stage and tensor rank, ``dp`` data-parallel ranks, the
training dtype's ``b`` bytes per element (2 for bf16 and fp16, 4 for fp32), and ``s`` bytes per element of the
optimizer's own copy: its master and every per-element state key it keeps, in the dtypes the checkpoint stores them
(:func:`state_bytes`: Adam's fp32 master and two fp32 moments are 12; SGD's or Muon's one momentum 8; bf16 masters
and moments 6), by ZeRO stage:

=========  ============  ================================  =================================
stage      weights       gradients                         optimizer state (master + states)
=========  ============  ================================  =================================
0          n·b           n·b                               s·n
1          n·b           n·b (fp32 with BF16_Optimizer)    s·n / dp
2          n·b           n·b / dp                          s·n / dp
3          n·b / dp      n·b / dp                          s·n / dp
=========  ============  ================================  =================================

Without ``s`` (no optimizer state to read), Adam's 12 bytes, or 8 where fp32 training keeps no separate master.
Muon's momentum at ZeRO-1/2 is kept per whole matrix: a matrix that straddles two partitions counts on both, which
the estimate leaves out.

Activations, buffers, communication buckets, the allocator's caching and the framework come on top: the
estimate is a floor, not a forecast. Pure arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankFootprint:
    """Model-state bytes of one rank: ``weights``, ``gradients``, ``optimizer`` (fp32 master and moments)."""

    stage: int
    tp: int
    numel: int
    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def state_bytes(ck) -> tuple:
    """``(s, keys)``: the bytes per element of ``ck``'s optimizer copy (its master and the per-element state keys of
    its largest group, in their stored dtypes) and those keys, from its metadata; ``(None, ())`` where it records no
    optimizer state."""
    from ..dtypes import itemsize

    opt = getattr(ck, "optimizer", None)
    groups = list(opt.groups) if opt is not None else []
    if not groups:
        return None, ()
    master = 4
    for p in ck.parameters:
        if p.trainable and not p.tied_to:
            ranges = ck.sources(p.name)
            master = itemsize(ranges[0].dtype) if ranges and hasattr(ranges[0], "dtype") else 4
            break
    best = max(groups, key=lambda g: sum(itemsize(k.dtype) for k in g.keys))
    keys = tuple(dict.fromkeys(k.name for g in groups for k in g.keys))
    return master + sum(itemsize(k.dtype) for k in best.keys), keys


def footprint(numel: int, dtype: str, zero_stage: int, dp: int, *, bf16_optimizer: bool = False, stage: int = 0,
              tp: int = 0, per_element: int | None = None) -> RankFootprint:
    """The model-state bytes of a rank holding ``numel`` elements (see the module docstring); ``per_element``: ``s``,
    the optimizer copy's bytes per element (:func:`state_bytes`)."""
    b = 4 if dtype == "fp32" else 2
    opt = (per_element if per_element is not None else (8 if b == 4 else 12)) * numel
    weights = numel * b
    grads = numel * (4 if bf16_optimizer else b)
    if zero_stage >= 1:
        opt = -(-opt // dp)
    if zero_stage >= 2:
        grads = -(-grads // dp)
    if zero_stage >= 3:
        weights = -(-weights // dp)
    return RankFootprint(stage=stage, tp=tp, numel=numel, weights=weights, gradients=grads, optimizer=opt)


__all__ = ["RankFootprint", "footprint", "state_bytes"]
