"""The ``.metadata`` file of a torch.distributed.checkpoint (DCP) folder, as plain data, and its pickle.

A DCP folder is a ``.metadata`` pickle and ``.distcp`` files. The pickle is a
``torch.distributed.checkpoint.metadata.Metadata``: per flattened key (``model.fc1.weight``,
``optimizer.state.fc1.weight.exp_avg``, ``optimizer.param_groups.0.lr``) either a
``TensorStorageMetadata`` (dtype, full size, the chunks stored: offsets and sizes in the tensor) or a
``BytesStorageMetadata`` (a pickled Python value); ``planner_data``: per key the path of the nested
state dict it was flattened from (the default planners use it to rebuild the nesting); ``storage_data``:
per chunk (a ``MetadataIndex``: key, chunk offsets, chunk index) the ``_StorageInfo`` of the bytes (file,
offset, length). Each chunk or value is a complete ``torch.save`` archive at that offset of its file
(:mod:`ckptlib.io.dcp.layout`).

:func:`metadata_pickle` writes the pickle torch 2.x reads (``pickle.load`` in ``FileSystemReader``),
naming only these classes, ``torch.Size``, the dtype, ``torch.serialization._get_layout`` and the
memory-format enum, without importing torch. :class:`DcpMetadata` is what ckptlib knows of a folder
either way (:func:`ckptlib.io.dcp.reader.read_metadata` reads one written by anyone).

Pure data and arithmetic: no I/O here.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

from ...dtypes import Shaped
from ..torchzip.opcodes import emit_container, emit_scalar
from ..torchzip.standins import TorchSize

VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION in torch 2.4 to 2.13
#: how a DCP folder stores its bytes (:attr:`DcpMetadata.storage`); ``ckpt export --dcp-storage`` writes all but
#: ``safetensors`` (torch 2.13's own ``FileSystemReader`` cannot load that one: docs/dcp.md)
STORAGES = ("torch", "safetensors", "hf", "hf-sharded")
MODULE = "torch.distributed.checkpoint.metadata"
STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


@dataclass(frozen=True)
class Chunk:
    """One stored chunk of a tensor: ``sizes`` elements from ``offsets`` (per dimension) of the full
    tensor, whose ``torch.save`` archive is ``length`` bytes at ``offset`` of ``file`` (relative path);
    ``raw``: the chunk's elements themselves, row-major, are those bytes (a safetensors file's data:
    :mod:`ckptlib.io.dcp.sharding`)."""

    offsets: tuple
    sizes: tuple
    file: str
    offset: int
    length: int
    raw: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorEntry(Shaped):
    """A tensor of the checkpoint under its flattened key ``fqn``: dtype name, full shape, stored chunks."""

    fqn: str
    dtype: str
    shape: tuple
    chunks: list = field(default_factory=list)


@dataclass
class BytesEntry:
    """A pickled Python value under the flattened key ``fqn``, ``length`` bytes at ``offset`` of ``file``."""

    fqn: str
    file: str
    offset: int
    length: int


@dataclass
class DcpMetadata:
    """What a ``.metadata`` says: the entries in order, the nesting each key was flattened from
    (``planner_data``: key -> tuple of str/int), and where the checkpoint says it was saved.

    ``storage``: how the bytes are stored (:data:`STORAGES`): ``torch`` (each item a ``torch.save`` archive),
    ``safetensors`` (``FileSystemWriter(serialization_format=SAFETENSORS)``: a ``.metadata`` and ``.distcp``
    files whose tensors are a safetensors file's data), ``hf`` / ``hf-sharded`` (``HuggingFaceStorageWriter``:
    safetensors files and no ``.metadata``; the entries are made from their headers). ``described_by``: the
    files besides the chunks' that say what the folder holds (``.metadata``, the HF index); ``notes``: what a
    reader should know (how the sizes were found)."""

    entries: list
    planner_data: dict = field(default_factory=dict)
    checkpoint_id: Optional[str] = None
    save_id: Optional[str] = None
    version: Optional[str] = VERSION
    storage: str = "torch"
    described_by: list = field(default_factory=lambda: [".metadata"])
    notes: list = field(default_factory=list)

    @property
    def tensors(self) -> list:
        return [e for e in self.entries if isinstance(e, TensorEntry)]

    @property
    def values(self) -> list:
        return [e for e in self.entries if isinstance(e, BytesEntry)]

    def entry(self, fqn: str):
        for e in self.entries:
            if e.fqn == fqn:
                return e
        raise KeyError(fqn)


# ============================================================================================ the pickle
class _Emitter:
    """Pickle protocol 2, written opcode by opcode (what ``pickle.load`` reads back as torch's classes)."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.memo: dict = {}

    def glob(self, module: str, name: str) -> None:
        """A global, memoized (``BINPUT`` once, ``BINGET`` after), as ``pickle`` does."""
        at = self.memo.get((module, name))
        if at is not None:
            self.out += (b"h" + bytes([at])) if at < 256 else (b"j" + struct.pack("<I", at))
            return
        at = self.memo[(module, name)] = len(self.memo)
        self.out += b"c" + f"{module}\n{name}\n".encode()
        self.out += (b"q" + bytes([at])) if at < 256 else (b"r" + struct.pack("<I", at))

    def emit(self, obj: Any) -> None:  # noqa: C901 - one branch per kind of value
        o = self.out
        if isinstance(obj, _Dtype):
            self.glob("torch", str(obj))
        elif isinstance(obj, _Key):
            self.emit(_Obj(MODULE, "MetadataIndex", {"fqn": obj.fqn, "index": obj.index,
                                                     "offset": None if obj.offsets is None else TorchSize(obj.offsets)}))
        elif emit_scalar(o, obj):
            pass
        elif isinstance(obj, TorchSize):
            self.glob("torch", "Size")
            self.emit((tuple(obj),))
            o += b"R"
        elif emit_container(o, obj, self.emit):
            pass
        elif isinstance(obj, _Obj):
            self.glob(obj.module, obj.name)
            o += b")\x81"  # cls.__new__(cls), then BUILD with the state
            self.emit(obj.state)
            o += b"b"
        elif isinstance(obj, _Call):
            self.glob(obj.module, obj.name)
            self.emit(tuple(obj.args))
            o += b"R"
        else:
            raise TypeError(f"cannot pickle a {type(obj).__name__} into DCP metadata")


@dataclass
class _Obj:
    """An instance of ``module.name`` made by ``__new__`` and given ``state`` (``__setstate__`` or ``__dict__``)."""

    module: str
    name: str
    state: Any


@dataclass
class _Call:
    """The result of calling ``module.name(*args)`` while unpickling."""

    module: str
    name: str
    args: tuple


def _properties(dtype: str) -> _Obj:
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory-format encoding, pin_memory)
    return _Obj(MODULE, "TensorProperties", (
        _Dtype(dtype),
        _Call("torch.serialization", "_get_layout", ("torch.strided",)),
        False, _Call(MODULE, "_MEM_FORMAT_ENCODING", (0,)), False))


class _Dtype(str):
    """A torch dtype by name, pickled as the global ``torch.<name>``."""


def metadata_pickle(md: DcpMetadata) -> bytes:
    """The bytes of the ``.metadata`` file describing ``md`` (see the module docstring).

    Memory: the pickle (a few hundred bytes per entry).
    """
    sd_meta, storage = {}, {}
    for e in md.entries:
        if isinstance(e, TensorEntry):
            chunks = [_Obj(MODULE, "ChunkStorageMetadata", {"offsets": TorchSize(c.offsets), "sizes": TorchSize(c.sizes)})
                      for c in e.chunks]
            sd_meta[e.fqn] = _Obj(MODULE, "TensorStorageMetadata", {
                "properties": _properties(e.dtype), "size": TorchSize(e.shape), "chunks": chunks})
            for i, c in enumerate(e.chunks):
                storage[_Key(e.fqn, tuple(c.offsets), i)] = _Obj(*STORAGE_INFO, {
                    "relative_path": c.file, "offset": c.offset, "length": c.length})
        else:
            sd_meta[e.fqn] = _Obj(MODULE, "BytesStorageMetadata", {})
            storage[_Key(e.fqn, None, None)] = _Obj(*STORAGE_INFO, {
                "relative_path": e.file, "offset": e.offset, "length": e.length})
    meta = _Obj(MODULE, "StorageMeta", {"checkpoint_id": md.checkpoint_id, "save_id": md.save_id, "load_id": None,
                                        "modules": []})
    top = _Obj(MODULE, "Metadata", {
        "state_dict_metadata": sd_meta, "planner_data": dict(md.planner_data), "storage_data": storage,
        "storage_meta": meta, "version": md.version})
    p = _Emitter()
    p.emit(top)
    return bytes(p.out + b".")


@dataclass(frozen=True)
class _Key:
    """A ``MetadataIndex`` used as a dict key (hashable here; pickled as the object)."""

    fqn: str
    offsets: Optional[tuple]
    index: Optional[int]


__all__ = ["VERSION", "STORAGES", "Chunk", "TensorEntry", "BytesEntry", "DcpMetadata", "metadata_pickle"]
