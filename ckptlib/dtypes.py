"""The one table of tensor dtypes ckptlib knows: names, sizes and what each file format calls them.

Metadata code works with dtype *names* (``"float32"``, ``"bfloat16"``, ...: torch's names without
``torch.``), so plans stay plain data. torch (an optional dependency: ``pip install 'ckptlib[torch]'``)
is imported only through :func:`import_torch`, when a torch tensor is actually made.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class DType:
    """One dtype: ``name`` (torch's, without ``torch.``), bytes per element, torch's legacy storage
    class, the safetensors code (None if safetensors cannot hold it), whether it is floating point, and
    the short name users type (``fp32``/``bf16``/``fp16``; None for the others)."""

    name: str
    itemsize: int
    storage_class: Optional[str]
    safetensors: Optional[str]
    floating: bool
    short: Optional[str] = None


_ALL = [
    DType("float32", 4, "FloatStorage", "F32", True, "fp32"),
    DType("float64", 8, "DoubleStorage", "F64", True),
    DType("bfloat16", 2, "BFloat16Storage", "BF16", True, "bf16"),
    DType("float16", 2, "HalfStorage", "F16", True, "fp16"),
    DType("int64", 8, "LongStorage", "I64", False),
    DType("int32", 4, "IntStorage", "I32", False),
    DType("int16", 2, "ShortStorage", "I16", False),
    DType("int8", 1, "CharStorage", "I8", False),
    DType("uint8", 1, "ByteStorage", "U8", False),
    DType("bool", 1, "BoolStorage", "BOOL", False),
    DType("complex64", 8, "ComplexFloatStorage", None, False),
    DType("complex128", 16, "ComplexDoubleStorage", None, False),
    DType("uint16", 2, None, "U16", False),
    DType("uint32", 4, None, "U32", False),
    DType("uint64", 8, None, "U64", False),
    DType("float8_e4m3fn", 1, None, "F8_E4M3", True),
    DType("float8_e5m2", 1, None, "F8_E5M2", True),
    DType("float8_e4m3fnuz", 1, None, None, True),
    DType("float8_e5m2fnuz", 1, None, None, True),
]
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_STORAGE_CLASS: dict[str, DType] = {d.storage_class: d for d in _ALL if d.storage_class}
BY_SHORT: dict[str, DType] = {d.short: d for d in _ALL if d.short}
#: the output dtypes users choose from (``--dtype``)
OUTPUT_DTYPES = tuple(BY_SHORT)


def lookup(dtype: Any) -> DType:
    """The table entry of a dtype given as a name (``"float32"``), a short name (``"fp32"``) or a torch dtype."""
    if isinstance(dtype, DType):
        return dtype
    key = str(dtype).replace("torch.", "")
    found = BY_NAME.get(key) or BY_SHORT.get(key)
    if found is None:
        raise KeyError(f"unknown dtype {dtype!r}")
    return found


def name_of(dtype: Any) -> str:
    """The dtype's name (``torch.bfloat16`` -> ``"bfloat16"``, ``"bf16"`` -> ``"bfloat16"``)."""
    return lookup(dtype).name


def itemsize(dtype: Any) -> int:
    return lookup(dtype).itemsize


def is_floating(dtype: Any) -> bool:
    return lookup(dtype).floating


#: ``struct`` codes of the dtypes a single element of which :func:`decode_scalar` reads (bfloat16 via float32)
_STRUCT = {"float32": "f", "float64": "d", "float16": "e", "int64": "q", "int32": "i", "int16": "h", "int8": "b",
           "uint8": "B", "bool": "?", "uint16": "H", "uint32": "I", "uint64": "Q"}


def decode_scalar(raw: bytes, dtype: Any):
    """The Python number held by the little-endian bytes of one element of ``dtype`` (no torch)."""
    name = lookup(dtype).name
    if name == "bfloat16":
        return struct.unpack("<f", b"\0\0" + bytes(raw[:2]))[0]
    code = _STRUCT.get(name)
    if code is None:
        raise ValueError(f"cannot decode a {name} value without torch")
    return struct.unpack("<" + code, bytes(raw[:struct.calcsize(code)]))[0]


class Shaped:
    """``numel`` and ``nbytes`` of anything with a ``shape`` and a ``dtype`` (a name): the tensor records of
    plans, safetensors headers and tensor sets mix it in."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def import_torch(purpose: str):
    """The ``torch`` module, for ``purpose`` (what needs it, e.g. ``"reading a tensor as a torch tensor"``).

    Raises:
        MissingDependencyError: torch is not installed; one line naming ``purpose`` and the install command.
    """
    try:
        import torch
    except ImportError:
        from .errors import MissingDependencyError

        raise MissingDependencyError(f"{purpose} needs torch, which is not installed") from None
    return torch


#: the purpose :func:`import_torch` names where a value is read as a torch tensor (the API's ``read_*``)
TORCH_TENSORS = "reading values as torch tensors (Checkpoint.read_param, read_state, read_buffer)"


def torch_dtype(dtype: Any):
    """The torch dtype (imports torch: :func:`import_torch`)."""
    return getattr(import_torch(TORCH_TENSORS), lookup(dtype).name)


__all__ = ["DType", "BY_NAME", "BY_STORAGE_CLASS", "BY_SHORT", "OUTPUT_DTYPES", "lookup", "name_of", "itemsize",
           "is_floating", "decode_scalar", "import_torch", "TORCH_TENSORS", "torch_dtype", "Shaped"]
