"""Object trees of torch files: finding their tensors, and turning tensor handles into plain specs."""
from __future__ import annotations

import copy
from typing import Any

from .handles import TensorHandle
from .specs import NewTensor, StoredTensor
from .standins import Standin


def walk_tensors(obj: Any, out: list) -> list:
    """Every tensor (spec or handle) in an object tree, in pickle order; appended to ``out``."""
    if isinstance(obj, (StoredTensor, NewTensor, TensorHandle)):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            walk_tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            walk_tensors(v, out)
    elif isinstance(obj, Standin):
        walk_tensors(obj.__dict__, out)
    return out


def as_specs(obj: Any) -> Any:
    """The same tree with every :class:`TensorHandle` replaced by its :class:`StoredTensor` (plain data,
    picklable); containers keep their types and order. Trees without handles are returned as they are."""
    if not any(isinstance(t, TensorHandle) for t in walk_tensors(obj, [])):
        return obj
    return _convert(obj)


def _convert(obj: Any) -> Any:
    if isinstance(obj, TensorHandle):
        return obj.stored()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # the same dict type (OrderedDict, ...) and key order
        for k, v in obj.items():
            out[k] = _convert(v)
        return out
    if isinstance(obj, list):
        return [_convert(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_convert(v) for v in obj)
    if isinstance(obj, Standin) and walk_tensors(obj.__dict__, []):
        new = copy.copy(obj)
        new.__dict__ = _convert(dict(obj.__dict__))
        return new
    return obj


def tree_bytes(obj: Any) -> tuple[int, int]:
    """``(bytes read from sources, tensor bytes written)`` for an object tree: new tensors read their
    ranges, stored tensors copy their storage (once per storage)."""
    read = written = 0
    seen = set()
    for t in walk_tensors(obj, []):
        if isinstance(t, NewTensor):
            read += t.read_bytes
            written += t.nbytes
            continue
        storage = t.storage.address if isinstance(t, TensorHandle) else t.storage
        if storage not in seen:
            seen.add(storage)
            read += storage.nbytes
            written += storage.nbytes
    return read, written


__all__ = ["walk_tensors", "as_specs", "tree_bytes"]
