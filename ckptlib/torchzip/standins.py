"""Inert stand-ins for the classes DeepSpeed (and a few others) pickle into checkpoints.

A stand-in only holds the pickled attributes and remembers which class it replaces (``qualname``),
so the restricted unpickler can build it without importing anything and the writer can pickle it back
under the original name. No torch, no DeepSpeed.
"""
from __future__ import annotations


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


__all__ = ["Standin", "standin_class", "LossScaler", "DynamicLossScaler", "Namespace", "FragmentAddress", "ZeroStage"]
