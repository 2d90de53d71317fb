"""Statistics of a tensor accumulated window by window in float64: what ``ckpt check`` reports.

:class:`RunningStats` takes a tensor's windows one after the other (any floating dtype; each copied
into one float64 work buffer) and keeps counts (elements, NaN, Inf, zeros, below zero), min, max, and
the mean and the sum of squared deviations merged window by window (Chan et al.), plus the sum of squares
for the L2 norm. min, max, mean, std and norm are over the finite elements; on a tensor without NaN or
Inf they are torch's: ``std`` is the *sample* standard deviation (divisor ``n - 1``, torch.std's
default, ``correction=1``), the norm is ``torch.linalg.vector_norm`` (accumulated in float64 here).

Memory: the caller's work buffer (a window in float64), a boolean mask of a window, per-window scalars.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .compare import cast_values

CANCELLATION = 1e-6  # below this share of the sum of squares, a window's deviations are summed directly


@dataclass
class TensorStats:
    """The statistics of one tensor (``key``: name, or ``<state>/<name>``)."""

    key: str
    kind: str
    dtype: str
    shape: tuple
    numel: int
    nan: int
    inf: int
    zeros: int
    min: Optional[float]
    max: Optional[float]
    mean: Optional[float]
    std: Optional[float]
    norm: float
    negative: int = 0
    files: list = field(default_factory=list)

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0

    def to_dict(self) -> dict:
        return {"name": self.key, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                "numel": self.numel, "nan": self.nan, "inf": self.inf, "zeros": self.zeros, "min": self.min,
                "max": self.max, "mean": self.mean, "std": self.std, "norm": self.norm, "negative": self.negative,
                "files": list(self.files)}


class RunningStats:
    """Window-by-window statistics of one tensor (see the module docstring)."""

    def __init__(self):
        self.total = self.n = self.nan = self.inf = self.zeros = self.negative = 0
        self.mean = self.m2 = self.sumsq = 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, x, work, count_negative: bool = False, dtype: Optional[str] = None) -> tuple[int, int, int]:
        """Take window ``x`` (a 1-D floating numpy array; a bfloat16 one as its 16-bit patterns, with
        ``dtype="bfloat16"``); ``work`` is a float64 numpy buffer of at least its length, overwritten.
        Returns this window's ``(nan, inf, below zero)`` counts.

        The arithmetic is numpy's (single-threaded, vectorised): a NaN or Inf shows in min or max, so a
        window without any costs a copy to float64, min, max, a zero count, a sum and a dot product."""
        import numpy as np

        k = x.size
        if not k:
            return 0, 0, 0
        self.total += k
        w = work[:k]
        if dtype == "bfloat16":  # numpy has no bfloat16: widened exactly, through float32
            cast_values(x, dtype, w, "float64")
            raw = w
        else:
            raw = x
            np.copyto(w, raw)
        lo, hi = float(raw.min()), float(raw.max())  # NaN if there is one
        self.zeros += int(np.count_nonzero(raw == 0))
        neg = int(np.count_nonzero(raw < 0)) if count_negative and not lo >= 0 else 0
        nan = inf = 0
        finite = None
        if not (math.isfinite(lo) and math.isfinite(hi)):
            finite = np.isfinite(w)
            nan = int(np.count_nonzero(np.isnan(w)))
            inf = k - int(np.count_nonzero(finite)) - nan
            w[~finite] = 0.0
        self.nan += nan
        self.inf += inf
        kf = k - nan - inf
        if kf == 0:
            return nan, inf, 0
        s, ss = float(w.sum()), float(np.einsum("i,i->", w, w))  # single-threaded, float64
        mean = s / kf
        if finite is not None:
            w[~finite] = mean  # inside [min, max], and no deviation
            lo, hi = float(w.min()), float(w.max())
        m2 = ss - s * s / kf
        if m2 <= CANCELLATION * ss:  # the mean dominates: sum the deviations themselves
            w -= mean
            m2 = float(np.einsum("i,i->", w, w))
        self._merge(kf, mean, max(m2, 0.0))
        self.sumsq += ss
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        self.negative += neg
        return nan, inf, neg

    def _merge(self, nb: int, mean_b: float, m2_b: float) -> None:
        na = self.n
        n = na + nb
        delta = mean_b - self.mean
        self.mean += delta * nb / n
        self.m2 += m2_b + delta * delta * na * nb / n
        self.n = n

    def result(self, key: str, kind: str, dtype: str, shape: tuple, files: list) -> TensorStats:
        n = self.n
        return TensorStats(key=key, kind=kind, dtype=dtype, shape=tuple(shape), numel=self.total, nan=self.nan,
                           inf=self.inf, zeros=self.zeros, min=self.min if n else None, max=self.max if n else None,
                           mean=self.mean if n else None, std=math.sqrt(self.m2 / (n - 1)) if n > 1 else None,
                           norm=math.sqrt(self.sumsq), negative=self.negative, files=files)


__all__ = ["TensorStats", "RunningStats"]
