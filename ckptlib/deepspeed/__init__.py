"""DeepSpeed knowledge: file names, finding checkpoints, the checkpoint model (reading only), and the files
the clients (HF Trainer, Accelerate) keep beside a checkpoint (:mod:`.hf`).

May import: :mod:`ckptlib.io` and every layer below it (system, plan, layout, the vocabulary).
"""
from .checkpoint import Checkpoint, open_checkpoint
from .discovery import Location, locate
from .records import BF16_OPTIMIZER, NO_ZERO, ZERO, BufferInfo, FileInfo, OptimizerInfo, ParameterInfo, Records
from .tensor_parallel import SplitRules, load_rules
from .zeroset import ZeroSet

__all__ = ["BufferInfo", "Checkpoint", "FileInfo", "OptimizerInfo", "ParameterInfo", "Records", "open_checkpoint", "ZeroSet", "SplitRules", "load_rules",
           "Location", "locate", "ZERO", "BF16_OPTIMIZER", "NO_ZERO"]
