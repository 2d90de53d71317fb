"""Which layers a pipeline stage holds: DeepSpeed's ``PipelineModule`` partition methods, as pure arithmetic.

A ``PipelineModule`` of ``L`` layer specs on ``P`` stages gives stage ``s`` the layers ``[parts[s],
parts[s+1])``. ``partition_method="uniform"`` spreads the layer count evenly (the first ``L mod P`` stages
get one more); ``"parameters"`` (DeepSpeed's default) balances the trainable parameters each layer spec
builds (a tied layer's every use counts its parameters) by solving the linear partition problem: the
split that minimises the spread between the heaviest and the lightest stage, ties resolved towards later
cuts, as DeepSpeed 0.19.8 does; ``"type:REGEX"`` balances the count of layers whose class matches (the
same solver on 0/1 weights). The solver here is this module's own, checked against DeepSpeed's on random
weights in tests/test_layout.py.

A checkpoint does not record the method, the layer count or the layers without state (activations,
lambdas) and a tied layer's later uses (a ``TiedLayerSpec`` with ``forward_fn`` writes no file); what it
does record (which stage holds which layer file, which stages hold a tied module) narrows them down:
:func:`consistent` keeps the descriptions that reproduce the saved placement, and a target placement is
trusted only when every one of them gives the same (:mod:`ckptlib.reshard.pipeline`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

UNIFORM, PARAMETERS = "uniform", "parameters"


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``parts`` of ``num_items`` layers on ``num_parts`` stages, evenly: the first ``num_items mod
    num_parts`` stages get one layer more; with fewer layers than stages, one layer per stage and empty
    stages at the end."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """``parts`` that split ``weights`` into ``num_parts`` consecutive runs with the smallest spread between
    the heaviest and the lightest run (the linear partition problem, by dynamic programming over prefix
    sums; among equally good cuts the latest one is taken, as DeepSpeed does). With no more weights than
    parts: :func:`partition_uniform`."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    best_max = [[inf] * (m + 1) for _ in range(n + 1)]
    best_min = [[inf] * (m + 1) for _ in range(n + 1)]
    best_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    best_max[0][0] = 0.0
    best_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            bm, bn, bc, bk = best_max[i][j], best_min[i][j], best_cost[i][j], cut[i][j]
            for k in range(i):
                run = prefix[i] - prefix[k]
                hi = max(best_max[k][j - 1], run)
                lo = min(best_min[k][j - 1], run)
                cost = hi - lo
                if bc >= cost:  # later cuts win ties
                    bm, bn, bc, bk = hi, lo, cost, k
            best_max[i][j], best_min[i][j], best_cost[i][j], cut[i][j] = bm, bn, bc, bk
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


@dataclass(frozen=True)
class LayerPlan:
    """One description of a pipeline's layer specs: ``weights[i]`` the trainable parameters layer ``i``
    builds (at the tensor size the partition is computed for), ``ties[i]`` the tie key of a tied layer's
    use (None otherwise), and the partition ``method`` (``"uniform"``, ``"parameters"``, or explicit
    ``parts`` given by the user)."""

    weights: tuple
    ties: tuple
    method: str
    parts: Optional[tuple] = None

    @property
    def num_layers(self) -> int:
        return len(self.weights)

    def partition(self, num_stages: int, weights: Optional[Sequence[float]] = None) -> list[int]:
        """``parts`` at ``num_stages`` (``weights``: the layer weights at that mesh's tensor size)."""
        if self.parts is not None:
            if len(self.parts) != num_stages + 1:
                raise ValueError(f"{len(self.parts) - 1} stages given, {num_stages} wanted")
            return list(self.parts)
        if self.method == UNIFORM:
            return partition_uniform(self.num_layers, num_stages)
        return partition_balanced(list(weights if weights is not None else self.weights), num_stages)


def stage_of(parts: Sequence[int], layer: int) -> int:
    """The stage whose ``[parts[s], parts[s+1])`` holds ``layer``."""
    for s in range(len(parts) - 1):
        if parts[s] <= layer < parts[s + 1]:
            return s
    raise ValueError(f"layer {layer} is outside the partition {list(parts)}")


def placement(parts: Sequence[int], layers: Sequence[int], ties: dict) -> tuple:
    """What a partition decides for a checkpoint: the stage of each layer with state (``layers``), and the
    stages holding each tied module (``ties``: key -> the layer indices using it)."""
    by_layer = tuple(stage_of(parts, i) for i in layers)
    by_tie = tuple(sorted((key, tuple(sorted({stage_of(parts, i) for i in uses}))) for key, uses in ties.items()))
    return by_layer, by_tie


def validate_parts(parts: Sequence[int], num_stages: int, num_layers_min: int) -> Optional[str]:
    """Why explicit stage boundaries cannot be used (None if they can)."""
    parts = list(parts)
    if len(parts) != num_stages + 1:
        return f"{len(parts)} boundaries give {len(parts) - 1} stages, not {num_stages}"
    if parts[0] != 0 or any(b < a for a, b in zip(parts, parts[1:])):
        return f"boundaries {parts} must start at 0 and never decrease"
    if parts[-1] < num_layers_min:
        return f"boundaries end at {parts[-1]}, but the checkpoint has layers up to {num_layers_min - 1}"
    return None


__all__ = ["UNIFORM", "PARAMETERS", "partition_uniform", "partition_balanced", "LayerPlan", "stage_of", "placement",
           "validate_parts"]
