"""Safe, metadata-first access to torch zip files (no DeepSpeed knowledge here): the zip directory, the
restricted unpickler and its stand-ins, tensor handles, and the writer; files in torch's legacy (non-zip)
serialization are read through the same interface (:mod:`.legacy`).

May import: the rest of :mod:`ckptlib.io` and the layers below it.
"""
from .handles import StorageRef, TensorHandle
from .reader import GLOBAL_STATS, PickleMemo, ReadStats, TorchFile, ZipEntry, classify_file_start, open_torch_file
from .specs import NewTensor, StorageAddress, StoredTensor
from .standins import FragmentAddress, Standin, ZeroStage
from .unpickler import SafeUnpickler

__all__ = [
    "StorageRef", "TensorHandle", "GLOBAL_STATS", "PickleMemo", "ReadStats", "TorchFile", "ZipEntry",
    "classify_file_start", "open_torch_file", "FragmentAddress", "SafeUnpickler", "Standin", "ZeroStage",
    "NewTensor", "StorageAddress", "StoredTensor",
]
