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
    assert ckptlib.verify_loaded(engine, "output/checkpoint-500").ok  # after engine.load_checkpoint
    d = ckptlib.diff("output/checkpoint-500", "out")          # any two checkpoints / exports, tensor by tensor

The house, lowest layer first (a package imports only its own layer and those below; tests/test_structure.py):

    errors, units, dtypes, mesh, progress   the shared vocabulary (modules here at the top)
    layout/      pure arithmetic: ranges, ZeRO's flat groups and partitions, placement of parallel blocks
    plan         plans as plain data (a module here at the top)
    system/      the machine: memory, allocation failures, the garbage collector
    io/          the bytes path: sources, sinks, streaming, casts, safetensors, torch zip files, atomic output
    deepspeed/   DeepSpeed's files read into one model of a checkpoint (and the HF clients' side files)
    analysis/    inspect's summary, check, diff, verification
    execute/     the one runner (threads, processes, torchrun)
    export/, reshard/   planners of the conversions
    this module  the public API, loaded lazily
    ui/, cli/, __main__   the faces: notebook widgets, the ``ckpt`` command and its launcher
"""
import importlib
import sys
import types

__version__ = "0.1.0"

#: the public names and the module each comes from, imported on first use (PEP 562): ``import ckptlib``
#: costs almost nothing, and a command loads only what it needs (``ckpt export`` never loads check, diff
#: or verification)
_API = {
    ".deepspeed": ("Checkpoint", "open_checkpoint"),
    ".errors": ("Cancelled", "CkptError", "IncompleteCheckpointError", "NotACheckpointError", "OutOfMemoryError",
                "OutputError", "UnsafeCheckpointError", "UnsupportedCheckpointError"),
    ".export": ("ExportPlan", "ExportResult", "export", "plan_export"),
    ".export.merge": ("MergePlan", "MergeResult", "merge_adapter", "plan_merge"),
    ".export.average": ("AveragePlan", "plan_average"),
    ".mesh": ("Rank",),
    ".plan": ("Plan",),
    ".progress": ("Observer",),
    ".reshard": ("ReshardPlan", "ReshardResult", "UniversalPlan", "UniversalResult", "plan_reshard", "plan_universal",
                 "reshard", "write_universal"),
    ".execute": ("RunResult", "run", "run_distributed"),
    ".analysis.summary": ("describe",),
    ".analysis.verify": ("Preflight", "Verification", "preflight", "verify"),
    ".analysis.loaded": ("LoadVerification", "verify_loaded"),
    ".analysis.health": ("CheckPlan", "CheckResult", "check", "plan_check"),
    ".analysis.tensordiff": ("DiffPlan", "DiffResult", "diff", "plan_diff"),
    ".analysis.tensorsets": ("TensorSet", "open_tensor_set"),
    ".analysis.universal_check": ("UniversalCheck", "check_universal"),
}
_SOURCE = {name: module for module, names in _API.items() for name in names}


def __getattr__(name: str):
    module = _SOURCE.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_SOURCE))


class _Package(types.ModuleType):
    """The import system records every imported submodule as an attribute of its package. Three
    submodules share their name with a function of the API (``export``, ``reshard``, ``verify``);
    ``ckptlib.export(...)`` must stay the function, however the submodule got imported."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in _SOURCE:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "Checkpoint", "open_checkpoint", "describe", "Rank", "plan_export", "export", "ExportPlan", "ExportResult",
    "merge_adapter", "MergeResult", "plan_merge", "MergePlan", "plan_average", "AveragePlan",
    "Observer", "Cancelled", "plan_reshard", "reshard", "ReshardPlan", "ReshardResult",
    "plan_universal", "write_universal", "UniversalPlan", "UniversalResult", "Plan", "run", "run_distributed",
    "RunResult", "verify", "Verification", "preflight", "Preflight", "verify_loaded", "LoadVerification",
    "plan_check", "check", "CheckPlan", "CheckResult", "plan_diff", "diff", "DiffPlan", "DiffResult",
    "open_tensor_set", "TensorSet",
    "CkptError", "IncompleteCheckpointError", "NotACheckpointError", "OutputError", "UnsafeCheckpointError",
    "UnsupportedCheckpointError", "OutOfMemoryError",
]
