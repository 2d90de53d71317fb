"""DeepSpeed knowledge: file names, finding checkpoints, the checkpoint model (reading only)."""
from .checkpoint import BufferInfo, Checkpoint, FileInfo, OptimizerInfo, ParameterInfo, open_checkpoint
from .discovery import Location, locate

__all__ = ["BufferInfo", "Checkpoint", "FileInfo", "OptimizerInfo", "ParameterInfo", "open_checkpoint",
           "Location", "locate"]
