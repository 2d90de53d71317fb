"""Reading a DCP folder without running anything from it, and without torch.

:func:`read_metadata` unpickles ``.metadata`` with the restricted unpickler
(:class:`~ckptlib.io.torchzip.unpickler.SafeUnpickler`) extended by inert stand-ins for the DCP metadata
classes (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``,
``BytesStorageMetadata``, ``MetadataIndex``, ``StorageMeta``, ``_StorageInfo``); any other global stops
it (:class:`~ckptlib.errors.UnsafeCheckpointError`). :func:`chunk_ranges` finds the stored bytes of one
tensor chunk inside its ``torch.save`` archive (the zip directory at the archive's end, the local
header, the pickle of one tensor), :func:`read_value` unpickles one value item the same safe way.

Memory: the metadata pickle; per chunk, its archive's directory and pickle (a few hundred bytes).
"""
from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from ...dtypes import itemsize
from ...errors import CkptError, IncompleteCheckpointError, UnsafeCheckpointError
from ...layout.ranges import StoredRange
from ..torchzip import zipfmt
from ..torchzip.handles import StorageRef, TensorHandle
from ..torchzip.standins import Standin, TorchSize, standin_class
from ..torchzip.unpickler import SafeUnpickler
from .layout import SUFFIX
from .metadata import BytesEntry, Chunk, DcpMetadata, TensorEntry
from .sharding import read_blob, starts_safetensors

METADATA = ".metadata"
_M = "torch.distributed.checkpoint.metadata"


class _Properties(Standin):
    qualname = f"{_M}.TensorProperties"

    def __setstate__(self, state):
        if isinstance(state, tuple) and state:  # (dtype, layout, requires_grad, memory format, pin_memory)
            self.__dict__["dtype"] = state[0]
        else:
            super().__setstate__(state)


def _layout(name):
    return str(name)


def _mem_format(value):
    return int(value)


def _path(*parts):
    return os.path.join(*(str(p) for p in parts)) if parts else ""


_STANDINS = {(_M, n): standin_class(f"{_M}.{n}") for n in (
    "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata", "StorageMeta")}
_STANDINS[(_M, "TensorProperties")] = _Properties
_STANDINS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = standin_class(
    "torch.distributed.checkpoint.filesystem._StorageInfo")
_STANDINS[("torch.serialization", "_get_layout")] = _layout
_STANDINS[(_M, "_MEM_FORMAT_ENCODING")] = _mem_format
_STANDINS[("pathlib", "PosixPath")] = _path  # StorageMeta.checkpoint_id: torch pickles a Path as its parts
_STANDINS[("pathlib", "WindowsPath")] = _path


class _Index(Standin):
    """Stand-in for ``MetadataIndex`` (a dict key: hashed by key and offsets, as torch's)."""

    qualname = f"{_M}.MetadataIndex"

    def __hash__(self):
        off = self.__dict__.get("offset")
        return hash((self.__dict__.get("fqn"), None if off is None else tuple(off)))

    def __eq__(self, other):
        return isinstance(other, _Index) and hash(self) == hash(other) and \
            self.__dict__.get("fqn") == other.__dict__.get("fqn")


_STANDINS[(_M, "MetadataIndex")] = _Index


class _MetadataUnpickler(SafeUnpickler):
    def find_class(self, module: str, name: str):
        found = _STANDINS.get((module, name))
        return found if found is not None else super().find_class(module, name)


def _refuse_storage(key, dtype, numel):
    raise pickle.UnpicklingError("a DCP .metadata holds no tensor storages")


def is_dcp_folder(path: os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / METADATA).is_file()


def read_metadata(folder: os.PathLike) -> DcpMetadata:
    """What the ``.metadata`` of the DCP folder ``folder`` says (see :class:`DcpMetadata`).

    Raises:
        UnsafeCheckpointError: the pickle names a global that is not a DCP metadata class.
        IncompleteCheckpointError: the file is missing, damaged, or not a DCP metadata pickle.
    """
    path = Path(folder) / METADATA
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IncompleteCheckpointError("no .metadata file: not a torch.distributed.checkpoint folder",
                                        path=str(folder)) from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data), _refuse_storage, str(path)).load()
    except CkptError:
        raise
    except Exception as e:
        raise IncompleteCheckpointError(f"the .metadata pickle is malformed ({type(e).__name__}: {e})",
                                        path=str(path), hint="the save was interrupted or the file is damaged") from e
    if type(md) is not _STANDINS[(_M, "Metadata")]:
        raise IncompleteCheckpointError("the .metadata pickle is not a DCP Metadata object", path=str(path))
    return _plain(md, str(path))


def _plain(md, where: str) -> DcpMetadata:
    storage = {}
    for k, v in (getattr(md, "storage_data", None) or {}).items():
        fqn, off = k.__dict__.get("fqn"), k.__dict__.get("offset")
        storage[(fqn, None if off is None else tuple(off))] = v.__dict__
    entries = []
    for fqn, meta in (getattr(md, "state_dict_metadata", None) or {}).items():
        if "chunks" in meta.__dict__:
            props = meta.__dict__.get("properties")
            dtype = getattr(getattr(props, "dtype", None), "name", None)
            if dtype is None:
                raise IncompleteCheckpointError(f"{fqn}: tensor without a dtype in .metadata", path=where)
            chunks = []
            for c in meta.chunks:
                info = storage.get((fqn, tuple(c.offsets)))
                if info is None:
                    raise IncompleteCheckpointError(f"{fqn}: a chunk at {list(c.offsets)} has no storage entry",
                                                    path=where)
                if info.get("transform_descriptors"):
                    raise CkptError(f"{fqn}: stored with stream transforms ({info['transform_descriptors']}), "
                                    "which ckptlib does not read", path=where)
                chunks.append(Chunk(tuple(c.offsets), tuple(c.sizes), info["relative_path"], int(info["offset"]),
                                    int(info["length"])))
            entries.append(TensorEntry(fqn, dtype, tuple(meta.size), chunks))
        else:
            info = storage.get((fqn, None))
            if info is None:
                raise IncompleteCheckpointError(f"{fqn}: a value without a storage entry", path=where)
            entries.append(BytesEntry(fqn, info["relative_path"], int(info["offset"]), int(info["length"])))
    sm = getattr(md, "storage_meta", None)
    return DcpMetadata(entries=entries, planner_data=dict(getattr(md, "planner_data", None) or {}),
                       checkpoint_id=getattr(sm, "checkpoint_id", None) if sm is not None else None,
                       save_id=getattr(sm, "save_id", None) if sm is not None else None,
                       version=getattr(md, "version", None))


# ============================================================================================ storage
def read_folder_metadata(folder: os.PathLike) -> DcpMetadata:
    """:func:`read_metadata`, with each tensor chunk located: where a ``.distcp`` file holds its tensors as a
    safetensors file (``FileSystemWriter(serialization_format=SAFETENSORS)``: every chunk of the file names the
    same offset, where that safetensors file begins; see :mod:`ckptlib.io.dcp.sharding`), each chunk becomes its
    raw bytes in it, found by its key in the header and checked against it (dtype, sizes, offsets, length);
    the ``storage`` is then ``safetensors``. Reads each ``.distcp`` file's first bytes there and its header.

    Raises:
        IncompleteCheckpointError: a chunk the safetensors header does not hold as the ``.metadata`` says, or a
            folder mixing both serializations.
    """
    md = read_metadata(folder)
    by_file: dict = {}
    for e in md.tensors:
        for c in e.chunks:
            by_file.setdefault(c.file, []).append((e, c))
    kinds = {}
    located: dict = {}
    for name, chunks in by_file.items():
        path = os.fspath(Path(folder) / name)
        at = min(c.offset for _, c in chunks)
        kinds[name] = starts_safetensors(path, at)
        if kinds[name]:
            located.update(_locate(path, at, chunks))
    if len(set(kinds.values())) > 1:
        raise IncompleteCheckpointError(
            "the .distcp files mix torch.save items and safetensors data "
            f"({', '.join(sorted(n for n, k in kinds.items() if k))} hold safetensors): not a folder torch writes",
            path=os.fspath(folder), hint="copy the folder again")
    if not located:
        return md
    for e in md.tensors:
        e.chunks = [located[(e.fqn, tuple(c.offsets))] for c in e.chunks]
    md.storage = "safetensors"
    return md


def _locate(path: str, at: int, chunks: list) -> dict:
    """``{(key, offsets): raw Chunk}`` of the chunks a ``.distcp`` file holds as the safetensors file at ``at``."""
    blob = read_blob(path, at)
    if not blob.sharded:
        raise IncompleteCheckpointError(f"the safetensors data at byte {at} has no DCP_SHARDING_INFO", path=path,
                                        hint="the file is damaged: copy the folder again")
    pieces = {p.key: p for p in blob.pieces}
    out = {}
    for e, c in chunks:
        p = pieces.get(e.fqn)
        want = (e.dtype, tuple(c.sizes), tuple(c.offsets), c.length)
        got = None if p is None else (p.dtype, p.shape, p.saved_offsets, p.nbytes)
        if c.offset != at or got != want:
            raise IncompleteCheckpointError(
                f"{e.fqn}: the .metadata says a {e.dtype} chunk {list(c.sizes)} at {list(c.offsets)} of {c.length} "
                f"bytes from byte {c.offset}; the safetensors data at byte {at} holds "
                + ("no such key" if p is None else f"{p.dtype} {list(p.shape)} at {list(p.saved_offsets)}, "
                                                    f"{p.nbytes} bytes"), path=path,
                hint="the file is damaged or of another save: copy the folder again")
        out[(e.fqn, tuple(c.offsets))] = replace(c, offset=p.offset, length=p.nbytes, raw=True)
    return out


# ============================================================================================ items
class _ItemFile:
    """One item's archive inside a ``.distcp`` file, read with ``pread``."""

    def __init__(self, path: str, offset: int, length: int):
        self.path, self.offset, self.length = path, offset, length
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise IncompleteCheckpointError(f"cannot open the file ({e.strerror})", path=path) from None

    def pread(self, n: int, at: int) -> bytes:
        return os.pread(self.fd, n, at)

    def members(self) -> tuple[dict, dict]:
        end = self.offset + self.length
        if os.fstat(self.fd).st_size < end:
            raise IncompleteCheckpointError(f"the file ends before the item at bytes {self.offset}-{end}",
                                            path=self.path, hint="the save was interrupted; copy the folder again")
        n = min(self.length, zipfmt.END_SEARCH_MAX)
        found = zipfmt.find_directory(self.pread(n, end - n), end - n)
        if found is None or found.shift != self.offset:
            raise IncompleteCheckpointError(f"no torch.save archive at bytes {self.offset}-{end}", path=self.path)
        members = zipfmt.parse_directory(self.pread(found.size, found.offset + found.shift), found)
        offsets: dict = {}
        flags: dict = {}
        try:
            for header, name in sorted((v[0], k) for k, v in members.items()):
                zipfmt.data_offsets(self.pread(zipfmt.LOCAL_HEADER_SIZE + 512, header), header, [(header, name)], offsets,
                                    members, flags)
            zipfmt.prove_extents(members, offsets, flags, found.offset + found.shift, lambda at, n: self.pread(n, at))
        except zipfmt.ZipFormatError as e:
            raise IncompleteCheckpointError(f"the archive at bytes {self.offset}-{end}: {e}", path=self.path,
                                            hint="the file is damaged: copy the folder again") from None
        return members, offsets

    def close(self):
        os.close(self.fd)


def _load_item(path: str, offset: int, length: int) -> tuple[Any, "_ItemFile", dict, dict, str]:
    f = _ItemFile(path, offset, length)
    try:
        members, offsets = f.members()
        pkl = [n for n in members if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise IncompleteCheckpointError(f"the item at byte {offset} is not a torch.save archive", path=path)
        prefix = pkl[0][:-len("data.pkl")]
        data = f.pread(members[pkl[0]][2], offsets[pkl[0]])
        refs: dict = {}

        def resolve(key: str, dtype: str, numel: int) -> StorageRef:
            name = prefix + "data/" + key
            if name not in members:
                raise IncompleteCheckpointError(f"storage {key} missing from the item at byte {offset}", path=path)
            ref = refs.get(key)
            if ref is None:
                ref = refs[key] = StorageRef(file=f, key=key, dtype_name=dtype, numel=numel,
                                             data_offset=offsets[name], stored_bytes=members[name][2],
                                             stored_crc=members[name][3])
            return ref

        obj = SafeUnpickler(io.BytesIO(data), resolve, path).load()
        return obj, f, members, offsets, prefix
    except (zipfmt.ZipFormatError, pickle.UnpicklingError, EOFError) as e:
        f.close()
        raise IncompleteCheckpointError(f"the item at byte {offset} is damaged ({e})", path=path) from None
    except BaseException:
        f.close()
        raise


def chunk_ranges(folder: os.PathLike, entry: TensorEntry, chunk: Chunk) -> list[StoredRange]:
    """The stored ranges of ``chunk`` of ``entry`` (its elements in row-major order of the chunk).

    Raises:
        IncompleteCheckpointError: the archive is not there, damaged, or holds another tensor.
    """
    path = os.fspath(Path(folder) / chunk.file)
    if chunk.raw:  # a safetensors file's data: its header was read and checked when the folder was opened
        count = math.prod(chunk.sizes)
        if count * itemsize(entry.dtype) != chunk.length:
            raise IncompleteCheckpointError(f"{entry.fqn}: {chunk.length} bytes stored for {count} {entry.dtype} "
                                            "elements", path=path)
        return [StoredRange(path, chunk.offset, entry.dtype, count)] if count else []
    obj, f, *_ = _load_item(path, chunk.offset, chunk.length)
    try:
        if not isinstance(obj, TensorHandle):
            raise IncompleteCheckpointError(f"{entry.fqn}: the item at byte {chunk.offset} is not a tensor", path=path)
        if obj.dtype_name != entry.dtype or tuple(obj.shape) != tuple(chunk.sizes):
            raise IncompleteCheckpointError(
                f"{entry.fqn}: the stored chunk is {obj.dtype_name} {list(obj.shape)}, the .metadata says "
                f"{entry.dtype} {list(chunk.sizes)}", path=path)
        return obj.ranges()
    finally:
        f.close()


def read_value(folder: os.PathLike, entry: BytesEntry) -> Any:
    """The Python value of a value item, unpickled by the restricted unpickler (plain values and the
    stand-ins it knows; anything else raises :class:`UnsafeCheckpointError`)."""
    path = os.fspath(Path(folder) / entry.file)
    obj, f, *_ = _load_item(path, entry.offset, entry.length)
    f.close()
    if isinstance(obj, TensorHandle):
        raise UnsafeCheckpointError(f"{entry.fqn}: a value item holds a tensor", path=path)
    return _unstand(obj)


def _unstand(obj):
    if isinstance(obj, TorchSize):
        return tuple(obj)
    if isinstance(obj, list):
        return [_unstand(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_unstand(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _unstand(v) for k, v in obj.items()}
    return obj


def distcp_files(folder: os.PathLike) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.name.endswith(SUFFIX))


def value_or_none(folder: os.PathLike, md: DcpMetadata, fqn: str) -> Optional[Any]:
    try:
        e = md.entry(fqn)
    except KeyError:
        return None
    return read_value(folder, e) if isinstance(e, BytesEntry) else None


__all__ = ["METADATA", "is_dcp_folder", "read_metadata", "read_folder_metadata", "chunk_ranges", "read_value", "distcp_files", "value_or_none"]
