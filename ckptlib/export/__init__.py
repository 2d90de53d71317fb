"""Export consolidated weights (and optimizer states): plan from metadata, then stream.

May import: :mod:`ckptlib.execute` and every layer below it; not :mod:`ckptlib.reshard` (same layer).
"""
from __future__ import annotations

import os
import threading
from typing import Optional, Union

from ..deepspeed import Checkpoint
from ..execute import RunResult, run
from ..plan import Plan, PlannedTensor, WeightsFile
from ..progress import Observer
from ..units import parse_size
from .plan import ExportPlan, plan_export

ExportResult = RunResult
PlannedFile = WeightsFile


def export(checkpoint: Union[Checkpoint, str, os.PathLike, ExportPlan], out: Union[str, os.PathLike, None] = None,
           *, observer: Optional[Observer] = None, cancel: Optional[threading.Event] = None, **options) -> RunResult:
    """Export consolidated fp32 (or bf16/fp16) weights in the Hugging Face layout.

    Args:
        checkpoint: a path, an opened :class:`Checkpoint`, or a plan from :func:`plan_export`.
        out: output folder (not needed with a plan).
        observer: receives progress (see :class:`ckptlib.progress.Observer`).
        cancel: set this event to stop; nothing is left behind.
        **options: as for :func:`plan_export` (``format``, ``dtype``, ``max_shard_size``, ``states``, ...).

    Memory: bounded by ``plan.predicted_peak_bytes`` per process (three streaming buffers of
    ``chunk_bytes`` plus a small fixed allowance), whatever the size of the model or of its largest
    tensor. The source is only read; the output appears atomically. The result carries ``memory``.
    """
    plan = checkpoint if isinstance(checkpoint, Plan) else plan_export(checkpoint, out, **options)
    return run(plan, observer=observer, cancel=cancel)


__all__ = ["export", "plan_export", "ExportPlan", "ExportResult", "PlannedFile", "PlannedTensor", "parse_size"]
