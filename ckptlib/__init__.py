"""ckptlib: understand and convert DeepSpeed ZeRO checkpoints, safely and with bounded memory.

Public API::

    import ckptlib
    ckpt = ckptlib.open_checkpoint("output/checkpoint-500")   # metadata only
    print(ckpt.zero_stage, ckpt.dp_world_size, ckpt.dtype)
    w = ckpt.read_param("model.embed.weight")                 # fp32, bit-exact master weights
"""
from .deepspeed import Checkpoint, open_checkpoint
from .export import ExportPlan, ExportResult, export, plan_export
from .progress import Cancelled, Observer
from .reshard import (ReshardPlan, ReshardResult, UniversalPlan, UniversalResult, plan_reshard, plan_universal, reshard,
                      write_universal)
from .errors import (CkptError, IncompleteCheckpointError, NotACheckpointError, OutputError,
                     UnsafeCheckpointError, UnsupportedCheckpointError)
from .summary import describe

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "open_checkpoint", "describe", "plan_export", "export", "ExportPlan", "ExportResult",
    "Observer", "Cancelled", "plan_reshard", "reshard", "ReshardPlan", "ReshardResult",
    "plan_universal", "write_universal", "UniversalPlan", "UniversalResult",
    "CkptError", "IncompleteCheckpointError", "NotACheckpointError", "OutputError", "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
]
