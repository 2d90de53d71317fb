"""What one rank of a mesh holds while it trains (model states only), to pick a mesh before a job is queued.

Per rank, for ``n`` parameter elements of its stage and tensor rank, ``dp`` data-parallel ranks, the
training dtype's ``b`` bytes per element (2 for bf16 and fp16, 4 for fp32), Adam's fp32 master and two
moments (12 bytes per element, 8 when fp32 training keeps no separate master), by ZeRO stage:

=========  ============  ================================  =================================
stage      weights       gradients                         optimizer state (master + moments)
=========  ============  ================================  =================================
0          n·b           n·b                               (12 or 8)·n
1          n·b           n·b (fp32 with BF16_Optimizer)    (12 or 8)·n / dp
2          n·b           n·b / dp                          (12 or 8)·n / dp
3          n·b / dp      n·b / dp                          (12 or 8)·n / dp
=========  ============  ================================  =================================

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


def footprint(numel: int, dtype: str, zero_stage: int, dp: int, *, bf16_optimizer: bool = False, stage: int = 0,
              tp: int = 0) -> RankFootprint:
    """The model-state bytes of a rank holding ``numel`` elements (see the module docstring)."""
    b = 4 if dtype == "fp32" else 2
    opt = (8 if b == 4 else 12) * numel
    weights = numel * b
    grads = numel * (4 if bf16_optimizer else b)
    if zero_stage >= 1:
        opt = -(-opt // dp)
    if zero_stage >= 2:
        grads = -(-grads // dp)
    if zero_stage >= 3:
        weights = -(-weights // dp)
    return RankFootprint(stage=stage, tp=tp, numel=numel, weights=weights, gradients=grads, optimizer=opt)


__all__ = ["RankFootprint", "footprint"]
