"""A restricted unpickler for the ``data.pkl`` of torch zip checkpoints.

Nothing in a checkpoint is ever *run*. :class:`SafeUnpickler` resolves the globals a pickle names
against a fixed allow-list:

- containers and values torch uses (``collections.OrderedDict``, ``builtins.set``, numpy scalars), and
  torch's value types (``torch.Size``, ``torch.device``, the dtypes and legacy storage classes such as
  ``torch.FloatStorage``), which resolve to ckptlib's stand-ins (:mod:`~ckptlib.io.torchzip.standins`):
  torch is never imported to read a pickle;
- torch's tensor rebuild functions, which are replaced by functions that build a
  :class:`~ckptlib.io.torchzip.handles.TensorHandle` (metadata only, no tensor bytes are read);
- the DeepSpeed classes found in checkpoints (``LossScaler``, ``DynamicLossScaler``, ``ZeroStageEnum``,
  ``fragment_address``, ...), which are mapped to inert stand-ins defined here. DeepSpeed is never
  imported.

Every other global (``os.system``, ``builtins.eval``, any class) makes unpickling stop with
:class:`~ckptlib.errors.UnsafeCheckpointError` naming the file and the global. Because every callable a
pickle can reach comes from this list, ``REDUCE``, ``NEWOBJ`` and ``BUILD`` can only ever call these
functions or build these stand-ins.
"""
from __future__ import annotations

import collections
import io
import pickle
from typing import Any, Callable

from ...dtypes import BY_NAME, BY_STORAGE_CLASS
from ...errors import UnsafeCheckpointError
from .handles import StorageRef, TensorHandle
from .standins import (
    DynamicLossScaler,
    FragmentAddress,
    LossScaler,
    Namespace,
    Standin,
    TorchDevice,
    TorchDType,
    TorchSize,
    ZeroStage,
    torch_dtype_standin,
)


# --------------------------------------------------------------------------------------------------
# Replacements for torch's rebuild functions: they build TensorHandles instead of tensors.
def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    try:
        shape, strides = tuple(int(s) for s in size), tuple(int(s) for s in stride)
        offset = int(storage_offset)
    except (TypeError, ValueError):
        raise pickle.UnpicklingError("a tensor's shape, stride or offset is not made of numbers") from None
    if len(shape) != len(strides) or any(s < 0 for s in shape) or any(s < 0 for s in strides) or offset < 0:
        raise pickle.UnpicklingError(f"a tensor of shape {list(shape)}, stride {list(strides)} and offset {offset} "
                                     "is impossible")
    if all(shape):  # a tensor with elements must lie inside its storage (torch would read past it)
        last = offset + sum((n - 1) * st for n, st in zip(shape, strides))
        if last >= storage.numel:
            raise pickle.UnpicklingError(
                f"a tensor of shape {list(shape)} at offset {offset} reaches element {last} of storage "
                f"{storage.key}, which holds {storage.numel}")
    return TensorHandle(storage=storage, storage_offset=offset, shape=shape, stride=strides,
                        requires_grad=bool(requires_grad))


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks, *state):
    if isinstance(data, TensorHandle):
        data.is_parameter = True
        data.requires_grad = bool(requires_grad)
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # func is one of the allowed rebuild functions; new_type is a _TensorType stand-in. Python attributes
    # set on the tensor (DeepSpeed's ``ds_id`` on ZeRO-3 flat groups) are kept so a rewrite keeps them.
    out = func(*args)
    if isinstance(out, TensorHandle) and isinstance(state, dict) and state:
        out.py_state = dict(state)
    return out


class _TensorType:
    """Stand-in for ``torch.Tensor`` / ``torch.nn.Parameter`` as the ``new_type`` of a rebuild."""


def _ordered_dict(*args):
    return collections.OrderedDict(*args)


def _numpy_scalar(dtype, data=None):
    import numpy as np

    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise pickle.UnpicklingError("numpy scalar of a non-plain dtype")
    return np.frombuffer(data, dtype=dtype, count=1)[0] if data is not None else dtype.type()


def _numpy_dtype(name, align=False, copy=False):
    import numpy as np

    dt = np.dtype(name)
    if dt.hasobject:
        raise pickle.UnpicklingError("numpy object dtype")
    return dt


def _set(items=()):
    return set(items)


def _frozenset(items=()):
    return frozenset(items)


def _reconstructor(cls, base, state):
    # copyreg._reconstructor(cls, object, None): only for our stand-ins
    if isinstance(cls, type) and issubclass(cls, Standin) and base is object:
        return cls.__new__(cls)
    raise pickle.UnpicklingError(f"copyreg._reconstructor of {cls!r}")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "set"): _set,
    ("builtins", "frozenset"): _frozenset,
    ("__builtin__", "set"): _set,
    ("__builtin__", "frozenset"): _frozenset,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("copy_reg", "_reconstructor"): _reconstructor,
    ("torch", "Size"): TorchSize,
    ("torch", "device"): TorchDevice,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("numpy", "dtype"): _numpy_dtype,
    ("argparse", "Namespace"): Namespace,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): LossScaler,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): DynamicLossScaler,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): ZeroStage,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): FragmentAddress,
}

class StorageClass(str):
    """What a pickle's ``torch.FloatStorage`` (a legacy typed storage class) resolves to: the dtype name."""


_STORAGE_CLASSES = {cls: StorageClass(d.name) for cls, d in BY_STORAGE_CLASS.items()}


def allowed_global(module: str, name: str) -> bool:
    """Whether :class:`SafeUnpickler` resolves the global ``module.name`` (to an inert stand-in or a tensor
    rebuild); every other global is refused."""
    if (module, name) in _ALLOWED:
        return True
    return module == "torch" and (name in _STORAGE_CLASSES or name in BY_NAME)


class SafeUnpickler(pickle.Unpickler):
    """Unpickles a torch ``data.pkl`` without running code from it.

    Args:
        file: a binary file object positioned at the pickle.
        storage_resolver: called with ``(key, dtype name, numel)`` for each storage the pickle refers to;
            returns the :class:`StorageRef` that tensor handles will point at.
        source: the file name used in error messages.
    """

    def __init__(self, file: io.BufferedIOBase, storage_resolver: Callable[[str, str, int], StorageRef],
                 source: str):
        super().__init__(file)
        self._resolve = storage_resolver
        self._source = source

    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch":
            if name in _STORAGE_CLASSES:  # legacy typed storage classes, e.g. torch.FloatStorage
                return _STORAGE_CLASSES[name]
            if name in BY_NAME:  # dtypes (torch pickles newer dtypes as storage types)
                return torch_dtype_standin(name)
        raise UnsafeCheckpointError(
            f"the pickle refers to the global '{module}.{name}', which ckptlib does not load "
            "(it only allows torch tensors, plain containers and the DeepSpeed classes of checkpoints)",
            path=self._source,
            hint="nothing from the file was run. If you trust this file and it is a DeepSpeed checkpoint, "
                 "please report the global so it can be added as an inert stand-in.")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, dtype, key, _location, numel = pid[:5]
        if isinstance(dtype, StorageClass):
            name = str(dtype)
        elif isinstance(dtype, TorchDType):
            name = dtype.name
        else:
            raise pickle.UnpicklingError(f"storage of unknown type {dtype!r}")
        return self._resolve(str(key), name, int(numel))
