"""Inert stand-ins for the classes DeepSpeed (and a few others) pickle into checkpoints.

A stand-in only holds the pickled attributes and remembers which class it replaces (``qualname``),
so the restricted unpickler can build it without importing anything and the writer can pickle it back
under the original name. No torch, no DeepSpeed.

torch's own value types found in pickles (``torch.Size``, ``torch.device``, the dtypes) have stand-ins
too (:class:`TorchSize`, :class:`TorchDevice`, :class:`TorchDType`), so that reading a checkpoint's
metadata never imports torch; they compare equal to the torch objects they stand for.
"""
from __future__ import annotations

import math


class Standin:
    """Base of the inert stand-ins: an attribute bag that remembers which class it replaces."""

    qualname = "object"

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"{self.qualname}({fields})"

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def standin_class(qualname: str) -> type:
    """A stand-in class for the class named ``qualname`` (``module.Class``)."""
    return type(qualname.rsplit(".", 1)[-1], (Standin,), {"qualname": qualname, "__module__": __name__})


LossScaler = standin_class("deepspeed.runtime.fp16.loss_scaler.LossScaler")
DynamicLossScaler = standin_class("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")
Namespace = standin_class("argparse.Namespace")


class FragmentAddress(Standin):
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address(numel, start)``."""

    qualname = "deepspeed.utils.tensor_fragment.fragment_address"

    def __init__(self, numel=None, start=None):
        self.numel = numel
        self.start = start


class ZeroStage(int):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (an int enum)."""

    qualname = "deepspeed.runtime.zero.config.ZeroStageEnum"
    _names = {0: "disabled", 1: "optimizer_states", 2: "gradients", 3: "weights", 4: "max_stage"}

    def __repr__(self) -> str:
        return f"ZeroStageEnum.{self._names.get(int(self), int(self))}"


class TorchSize(tuple):
    """Stand-in for ``torch.Size``: a tuple of ints (``numel()`` as torch's)."""

    qualname = "torch.Size"

    def __new__(cls, sizes=()):
        return super().__new__(cls, (int(s) for s in sizes))

    def numel(self) -> int:
        return math.prod(self)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"

    def __reduce__(self):
        return (TorchSize, (tuple(self),))


class TorchDevice:
    """Stand-in for ``torch.device``: ``type`` and ``index`` (``torch.device("cuda", 0)``, ``"cuda:0"``)."""

    qualname = "torch.device"
    __slots__ = ("type", "index")

    def __init__(self, type: str, index=None):
        text = str(type)
        if index is None and ":" in text:
            text, _, idx = text.partition(":")
            index = int(idx)
        self.type, self.index = text, (None if index is None else int(index))

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"device(type={self.type!r}" + ("" if self.index is None else f", index={self.index}") + ")"

    def __eq__(self, other) -> bool:
        return _torch_kind(other, "device") and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(("device", str(self)))

    def __reduce__(self):
        return (TorchDevice, (self.type, self.index))


class TorchDType:
    """Stand-in for a torch dtype (``torch.bfloat16``): its ``name`` (``"bfloat16"``); ``str`` gives
    ``"torch.bfloat16"`` as torch's does. One instance per name (:func:`torch_dtype_standin`)."""

    qualname = "torch.dtype"
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return _torch_kind(other, "dtype") and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(("dtype", self.name))

    def __reduce__(self):
        return (torch_dtype_standin, (self.name,))


_DTYPES: dict[str, TorchDType] = {}


def torch_dtype_standin(name: str) -> TorchDType:
    """The :class:`TorchDType` of dtype ``name`` (always the same object)."""
    found = _DTYPES.get(name)
    if found is None:
        found = _DTYPES[name] = TorchDType(name)
    return found


def _torch_kind(obj, name: str) -> bool:
    """Whether ``obj`` is a torch ``name`` (``"dtype"``, ``"device"``) or its stand-in; torch is not imported."""
    if isinstance(obj, TorchDType):
        return name == "dtype"
    if isinstance(obj, TorchDevice):
        return name == "device"
    cls = type(obj)
    return cls.__module__ == "torch" and cls.__name__ == name


__all__ = ["Standin", "standin_class", "LossScaler", "DynamicLossScaler", "Namespace", "FragmentAddress", "ZeroStage",
           "TorchSize", "TorchDevice", "TorchDType", "torch_dtype_standin"]
