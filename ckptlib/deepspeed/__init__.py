"""DeepSpeed knowledge: file names, finding checkpoints, the checkpoint model (reading only)."""
from .checkpoint import Checkpoint, open_checkpoint
from .discovery import Location, locate
from .records import BF16_OPTIMIZER, NO_ZERO, ZERO, BufferInfo, FileInfo, OptimizerInfo, ParameterInfo, Records

__all__ = ["BufferInfo", "Checkpoint", "FileInfo", "OptimizerInfo", "ParameterInfo", "Records", "open_checkpoint",
           "Location", "locate", "ZERO", "BF16_OPTIMIZER", "NO_ZERO"]
