"""Reshard a ZeRO-1/2/3 checkpoint for another data-parallel size, or write DeepSpeed's universal layout:
plan from metadata (plain data), then stream with the one runner (:mod:`ckptlib.execute`).

    plan = plan_reshard("ckpt", "ckpt_dp2", world_size=2)   # metadata only
    print(plan.describe())
    reshard(plan)                                          # DeepSpeed then loads "ckpt_dp2" at 2 ranks

May import: :mod:`ckptlib.execute` and every layer below it; not :mod:`ckptlib.export` (same layer).
"""
from __future__ import annotations

import os
import threading
from typing import Optional, Union

from ..deepspeed import Checkpoint
from ..errors import CkptError
from ..execute import RunResult, run
from ..plan import CopyFile, TreeFile
from ..progress import Observer
from .plan import ReshardPlan, default_workers, plan_reshard
from .universal import LATEST_UNIVERSAL, UniversalPlan, plan_universal

ReshardResult = UniversalResult = RunResult
TargetFile = TreeFile


def reshard(checkpoint: Union[Checkpoint, str, os.PathLike, ReshardPlan], out: Union[str, os.PathLike, None] = None,
            world_size: Optional[int] = None, *, observer: Optional[Observer] = None,
            cancel: Optional[threading.Event] = None, **options) -> RunResult:
    """Write the resharded checkpoint (``latest``, the tag folder, the converter scripts) into ``out``.

    Every target file is made by reading only the source byte ranges it needs, streamed through
    buffers of ``chunk_bytes`` (three per writing thread, ``plan.workers`` threads); there are no
    temporary files. Memory: ``plan.predicted_peak_bytes`` (about 104 MiB with the defaults) whatever
    the model size. The output appears atomically; the source is only read. ``options`` go to
    :func:`plan_reshard` when a checkpoint (or path) is given.
    """
    if isinstance(checkpoint, ReshardPlan):
        plan = checkpoint
    else:
        if out is None or world_size is None:
            raise CkptError("reshard needs an output folder and the new world size (or a plan)")
        plan = plan_reshard(checkpoint, out, world_size, **options)
    return run(plan, observer=observer, cancel=cancel)


def write_universal(plan_or_checkpoint: Union[UniversalPlan, Checkpoint, str, os.PathLike],
                    out: Union[str, os.PathLike, None] = None, observer: Optional[Observer] = None,
                    cancel: Optional[threading.Event] = None, **options) -> RunResult:
    """Write the universal checkpoint (``latest_universal`` and ``<tag>_universal/``) into ``out``.

    Every tensor is streamed from the source ranges that make it through buffers of ``chunk_bytes``
    (three per writing thread, ``plan.workers`` threads); nothing is written but the final files.
    Memory: ``plan.predicted_peak_bytes`` (about 104 MiB with the defaults) whatever the model size.
    The output appears atomically; the source is only read. ``options`` go to :func:`plan_universal`
    when a checkpoint (or path) is given.
    """
    if isinstance(plan_or_checkpoint, UniversalPlan):
        plan = plan_or_checkpoint
    else:
        if out is None:
            raise CkptError("write_universal needs an output folder")
        plan = plan_universal(plan_or_checkpoint, out, **options)
    return run(plan, observer=observer, cancel=cancel)


__all__ = ["plan_reshard", "reshard", "ReshardPlan", "ReshardResult", "TargetFile", "CopyFile", "plan_universal",
           "write_universal", "UniversalPlan", "UniversalResult", "LATEST_UNIVERSAL", "default_workers"]
