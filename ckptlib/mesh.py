"""Where a rank sits in a training run's parallel mesh (pure data).

A DeepSpeed run is a mesh of pipeline stages × tensor-parallel ranks × data-parallel ranks (× expert
ranks for MoE); each file of a checkpoint belongs to one point of it. :class:`Rank` names that point,
so readers ask for "the fp32 partition of data rank 1 on tensor rank 0, stage 0", never for a bare
number whose meaning depends on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Rank:
    """A coordinate of the mesh: pipeline stage ``pp``, tensor rank ``tp``, data rank ``dp``, expert rank ``ep``."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    ep: int = 0

    def __str__(self) -> str:
        parts = [f"{k} {v}" for k, v in (("pp", self.pp), ("tp", self.tp), ("ep", self.ep)) if v]
        return ", ".join(parts + [f"dp rank {self.dp}"])


@dataclass(frozen=True)
class Mesh:
    """The sizes of a run's parallel dimensions (data-parallel ``dp`` counts the ranks that share one
    ZeRO partitioning)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


__all__ = ["Rank", "Mesh"]
