"""ckptlib: understand and convert DeepSpeed ZeRO checkpoints, safely and with bounded memory.

Public API::

    import ckptlib
    ckpt = ckptlib.open_checkpoint("output/checkpoint-500")   # metadata only
    print(ckpt.zero_stage, ckpt.dp_world_size, ckpt.dtype)
    w = ckpt.read_param("model.embed.weight")                 # fp32, bit-exact master weights

    plan = ckptlib.plan_export(ckpt, "out")                   # plain data: files, tensors, byte ranges
    result = ckptlib.run(plan)                                # (or ckptlib.export(plan)); result.memory
    assert ckptlib.verify(plan).ok                            # every tensor re-read and compared

    health = ckptlib.check("output/checkpoint-500")           # statistics and problems, streamed
    d = ckptlib.diff("output/checkpoint-500", "out")          # any two checkpoints / exports, tensor by tensor
"""
from .deepspeed import Checkpoint, open_checkpoint
from .errors import (Cancelled, CkptError, IncompleteCheckpointError, NotACheckpointError, OutOfMemoryError,
                     OutputError, UnsafeCheckpointError, UnsupportedCheckpointError)
from .export import ExportPlan, ExportResult, export, plan_export
from .mesh import Rank
from .plan import Plan
from .progress import Observer
from .reshard import (ReshardPlan, ReshardResult, UniversalPlan, UniversalResult, plan_reshard, plan_universal, reshard,
                      write_universal)
from .execute import RunResult, run, run_distributed
from .summary import describe
from .verify import Preflight, Verification, preflight, verify
from .health import CheckPlan, CheckResult, check, plan_check
from .tensordiff import DiffPlan, DiffResult, diff, plan_diff
from .tensorsets import TensorSet, open_tensor_set

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "open_checkpoint", "describe", "Rank", "plan_export", "export", "ExportPlan", "ExportResult",
    "Observer", "Cancelled", "plan_reshard", "reshard", "ReshardPlan", "ReshardResult",
    "plan_universal", "write_universal", "UniversalPlan", "UniversalResult", "Plan", "run", "run_distributed",
    "RunResult", "verify", "Verification", "preflight", "Preflight",
    "plan_check", "check", "CheckPlan", "CheckResult", "plan_diff", "diff", "DiffPlan", "DiffResult",
    "open_tensor_set", "TensorSet",
    "CkptError", "IncompleteCheckpointError", "NotACheckpointError", "OutputError", "UnsafeCheckpointError",
    "UnsupportedCheckpointError", "OutOfMemoryError",
]
