"""What ``check`` and ``diff`` share: plans that only read, their progress, problems, numbers for JSON and text.

Both stream every tensor they look at once, window by window (:mod:`ckptlib.analysis.compare`); their plans are
plain data like export's (they pickle and print) and their results carry the run's memory
(:class:`~ckptlib.system.memory.MemoryReport`) beside ``plan.predicted_peak_bytes``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ..io.streaming import predicted_peak_bytes
from ..progress import TqdmObserver, progress_to


def scan_peak_bytes(chunk_bytes: int) -> int:
    """Anonymous memory a check or diff adds to the process: at most three ``chunk_bytes`` of reusable
    buffers (read-ahead windows and float64 work space) plus the fixed allowance, whatever the model size."""
    return predicted_peak_bytes(chunk_bytes, 1)


@dataclass(frozen=True)
class Problem:
    """Something wrong in a checkpoint: the tensor (``name``, ``<state>/<name>``, or ``step``), the file it
    lives in (relative to the path given), and what is wrong, in one sentence."""

    tensor: str
    file: str
    what: str

    def to_dict(self) -> dict:
        return {"tensor": self.tensor, "file": self.file, "what": self.what}

    def __str__(self) -> str:
        return f"{self.tensor} ({self.file}): {self.what}"


class ReadTqdm(TqdmObserver):
    """A terminal progress bar over the bytes a check or diff reads (``plan.read_bytes``)."""

    def on_start(self, plan):
        self.bar = self.open_bar(plan.read_bytes)


def json_ready(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, Inf: undefined or unbounded) as None, so that the JSON
    is standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def num(value: Optional[float], width: int = 10) -> str:
    """A number for a text table: ``-`` when undefined."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    if isinstance(value, int):
        return f"{value:>{width},}"
    return f"{value:>{width}.4g}"


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name without the last part (``fc1.weight`` -> ``fc1``), and
    without an optimizer state's prefix (``exp_avg/fc1.weight`` -> ``fc1``)."""
    name = name.split("/", 1)[-1]
    return name.rsplit(".", 1)[0] if "." in name else name


__all__ = ["scan_peak_bytes", "Problem", "progress_to", "ReadTqdm", "json_ready", "num", "layer_of"]
