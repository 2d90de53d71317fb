"""Safe, metadata-first access to torch zip files (no DeepSpeed knowledge here)."""
from .handles import StorageRef, TensorHandle, dtype_name, itemsize
from .reader import GLOBAL_STATS, ReadStats, TorchFile, classify_file_start, open_torch_file
from .unpickler import FragmentAddress, SafeUnpickler, Standin, ZeroStage

__all__ = [
    "StorageRef", "TensorHandle", "dtype_name", "itemsize", "GLOBAL_STATS", "ReadStats", "TorchFile",
    "classify_file_start", "open_torch_file", "FragmentAddress", "SafeUnpickler", "Standin", "ZeroStage",
]
