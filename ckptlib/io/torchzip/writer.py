"""Write torch zip files (what ``torch.save`` writes) from an object tree, streaming tensor bytes.

The object tree may hold plain values and containers, the inert stand-ins of
:mod:`~ckptlib.io.torchzip.standins` and tensors given as plain-data specs (:mod:`~ckptlib.io.torchzip.specs`):
:class:`StoredTensor` s (and :class:`~ckptlib.io.torchzip.handles.TensorHandle` s, the same thing while a
file is open), whose storages are copied byte for byte so views and shared storages stay as they were,
and :class:`NewTensor` s, whose bytes are streamed from their range lists. The pickle is emitted opcode
by opcode, naming only torch's rebuild function, storage classes, ``collections.OrderedDict``,
``torch.Size``/``device``/dtypes and the original names of the stand-ins, so DeepSpeed loads what
ckptlib writes and ckptlib's own reader reads it back. Nothing is imported to write a name.

Memory: the pickle plus the streaming buffers (:class:`~ckptlib.io.streaming.ChunkBuffers`); tensors are
never held whole.
"""
from __future__ import annotations

import collections
import os
import zlib
from typing import Any, Callable, Optional

from ...dtypes import BY_NAME, lookup
from ...layout.ranges import StoredRange
from ..sinks import PwriteSink, WriteBehind, preallocate, pwrite_all
from ..sources import SourceFiles
from ..streaming import ChunkBuffers, copy_ranges
from .handles import TensorHandle
from .specs import NewTensor, StorageAddress, StoredTensor
from .opcodes import emit_container, emit_items, emit_scalar
from .standins import FragmentAddress, Standin, TorchDevice, TorchDType, TorchSize, ZeroStage
from .trees import as_specs, walk_tensors
from .zipfmt import ALIGN, ZIP64_LIMIT, central_directory, layout_records, local_header

COPY_BYTES = 8 * 2**20
#: torch's legacy storage class names, by dtype name (newer dtypes are written as the dtype itself)
STORAGE_CLASS = {d.name: d.storage_class for d in BY_NAME.values() if d.storage_class}


class _Pickle:
    """Protocol-2 pickle emitter for the object kinds found in DeepSpeed checkpoints."""

    def __init__(self, storage_key: Callable[[Any], tuple]):
        self.out = bytearray(b"\x80\x02")
        self.key = storage_key

    # -- primitives
    def glob(self, module: str, name: str):
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def emit(self, obj: Any) -> None:  # noqa: C901 - a dispatch table would hide the opcodes
        o = self.out
        if isinstance(obj, ZeroStage):  # before the ints: an IntEnum
            self.glob("deepspeed.runtime.zero.config", "ZeroStageEnum")
            self.emit((int(obj),))
            o += b"R"
        elif emit_scalar(o, obj):
            pass
        elif isinstance(obj, TorchSize) or _is_torch(obj, "Size"):
            self.glob("torch", "Size")
            self.emit((tuple(obj),))
            o += b"R"
        elif isinstance(obj, collections.OrderedDict):
            self.glob("collections", "OrderedDict")
            o += b")R"
            emit_items(o, obj, self.emit)
        elif emit_container(o, obj, self.emit):
            pass
        elif isinstance(obj, (set, frozenset)):
            self.glob("builtins", "set" if isinstance(obj, set) else "frozenset")
            self.emit((sorted(obj, key=repr),))
            o += b"R"
        elif isinstance(obj, TorchDType) or _is_torch(obj, "dtype"):
            self.glob("torch", str(obj).split(".", 1)[1])
        elif isinstance(obj, TorchDevice) or _is_torch(obj, "device"):
            self.glob("torch", "device")
            self.emit((str(obj),))
            o += b"R"
        elif isinstance(obj, (StoredTensor, NewTensor)):
            self._tensor(obj)
        elif isinstance(obj, TensorHandle):
            self._tensor(obj.stored())
        elif isinstance(obj, (FragmentAddress, Standin)):
            module, name = type(obj).qualname.rsplit(".", 1)
            self.glob(module, name)
            o += b")\x81"  # NEWOBJ with no arguments, then BUILD with the attribute dict
            self.emit({k: v for k, v in obj.__dict__.items() if k != "args"})
            o += b"b"
        else:
            raise TypeError(f"cannot write an object of type {type(obj).__name__} into a checkpoint")

    def _tensor(self, t) -> None:
        key, dtype, numel = self.key(t)
        if isinstance(t, StoredTensor):
            offset, shape, stride, rg = t.storage_offset, tuple(t.shape), tuple(t.stride), t.requires_grad
        else:
            shape, rg, offset = tuple(t.shape), t.requires_grad, 0
            stride, acc = [], 1
            for s in reversed(shape):
                stride.append(acc)
                acc *= s
            stride = tuple(reversed(stride))
        state = t.py_state
        if state:  # torch's form for tensors that carry Python attributes
            self.glob("torch._tensor", "_rebuild_from_type_v2")
            self.out += b"("
        self.glob("torch._utils", "_rebuild_tensor_v2")
        if state:
            self.glob("torch", "Tensor")
        self.out += b"(("
        self.emit("storage")
        if dtype in STORAGE_CLASS:
            self.glob("torch", STORAGE_CLASS[dtype])
        else:
            self.glob("torch", dtype)
        self.emit(key)
        self.emit("cpu")
        self.emit(numel)
        self.out += b"tQ"
        self.emit(offset)
        self.emit(shape)
        self.emit(stride)
        self.emit(bool(rg))
        self.glob("collections", "OrderedDict")
        self.out += b")Rt"
        if state:  # (func, type, args, state) of _rebuild_from_type_v2
            self.emit(state)
            self.out += b"t"
        self.out += b"R"

    def finish(self) -> bytes:
        return bytes(self.out + b".")


def _is_torch(obj: Any, name: str) -> bool:
    """``isinstance(obj, torch.<name>)`` without importing torch (a tree holding torch objects has it loaded)."""
    cls = type(obj)
    return any(c.__module__ == "torch" and c.__name__ == name for c in cls.__mro__)


def _layout(obj: Any, archive: str, zip64_limit: int):
    """The members of the zip file for ``obj`` (pickle, small records, one storage each), their records
    and the central directory's offset."""
    obj = as_specs(obj)
    keys: dict[Any, tuple] = {}
    order: list = []  # (key, source) with source a StorageAddress or a NewTensor
    for t in walk_tensors(obj, []):
        src = t.storage if isinstance(t, StoredTensor) else t
        ident = src if isinstance(src, StorageAddress) else id(src)
        if ident not in keys:
            keys[ident] = (str(len(order)), lookup(src.dtype).name, src.numel)
            order.append((str(len(order)), src))

    def key_of(t):
        return keys[t.storage if isinstance(t, StoredTensor) else id(t)]

    p = _Pickle(key_of)
    p.emit(obj)
    members: list[tuple[str, Any]] = [("data.pkl", p.finish()), (".format_version", b"1"),
                                      (".storage_alignment", str(ALIGN).encode()), ("byteorder", b"little")]
    members += [(f"data/{key}", src) for key, src in order]
    members += [("version", b"3\n"), (".data/serialization_id", b"0" * 40)]

    def size(content) -> int:
        return len(content) if isinstance(content, bytes) else content.nbytes

    records, cd_offset = layout_records([(f"{archive}/{name}", size(c)) for name, c in members], zip64_limit)
    return members, records, cd_offset


def _archive_name(path: str | os.PathLike, archive: Optional[str]) -> str:
    return archive or os.path.splitext(os.path.basename(os.fspath(path)))[0] or "archive"


def file_size(obj: Any, path: str | os.PathLike, archive: Optional[str] = None, zip64_limit: int = ZIP64_LIMIT) -> int:
    """The exact size in bytes of the file :func:`save` writes for ``obj`` at ``path`` (the pickle is
    built, nothing is read or written).

    Memory: the pickle.
    """
    return archive_size(obj, _archive_name(path, archive), zip64_limit)


def save(obj: Any, path: str | os.PathLike, archive: Optional[str] = None,
         progress: Callable[[int], None] = lambda n: None, bufs=None, files=None, cancel: Any = None,
         zip64_limit: int = ZIP64_LIMIT, unsynced=None, drop_written: bool = True) -> int:
    """Write ``obj`` as a torch zip file at ``path``; returns the bytes of tensor data written.

    Stored storages (of :class:`StoredTensor` s and tensor handles) are copied whole and once each,
    keeping views and sharing, with the CRC-32 the source's zip directory records for them (the bytes are
    the same, so is their checksum): inside the kernel (``copy_file_range``), or through the buffers where
    ``files`` checks that CRC-32 as the bytes stream (:class:`~ckptlib.io.crc.CrcSourceFiles`) or the stored
    member is longer than the storage (then computed). Each :class:`NewTensor` gets a storage of its own, written with ``pwrite`` at an offset
    fixed in advance while its CRC-32 is computed chunk by chunk in the read-ahead thread; the zip
    headers are written last. Written bytes go on to disk as the file grows and, with ``drop_written``, leave
    the page cache (:class:`~ckptlib.io.sinks.WriteBehind`; while an ``unsynced`` budget lasts they are left to
    the kernel). ``files`` (a :class:`~ckptlib.io.sources.SourceFiles`) reads the
    sources; ``zip64_limit`` is for tests (sizes and offsets from it on get ZIP64 fields).

    Memory: the pickle and the streaming buffers ``bufs`` (a :class:`~ckptlib.io.streaming.ChunkBuffers`,
    3 x 8 MiB made here if not given).
    """
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    behind = WriteBehind(fd, unsynced=unsynced, drop=drop_written)
    try:
        written = write_archive(obj, fd, 0, _archive_name(path, archive), progress=progress, bufs=bufs,
                                files=files, cancel=cancel, zip64_limit=zip64_limit, behind=behind)
        behind.close()
    finally:
        os.close(fd)
    return written


def write_archive(obj: Any, fd: int, base: int, archive: str, progress: Callable[[int], None] = lambda n: None,
                  bufs=None, files=None, cancel: Any = None, zip64_limit: int = ZIP64_LIMIT,
                  behind: Optional[WriteBehind] = None, reserve: bool = True) -> int:
    """Write ``obj`` as a torch zip archive starting at byte ``base`` of the open file ``fd`` (as
    :func:`save` does for a whole file; the archive's own offsets count from ``base``, as those of
    ``torch.save`` into a stream that already holds bytes do). Takes
    :func:`archive_size` bytes; returns the bytes of tensor data written. With ``reserve`` the members' disk
    blocks are reserved first (:func:`~ckptlib.io.sinks.preallocate`); a caller that reserved the whole file
    already (a DCP file, made by the run's ``prepare``) passes False.

    Memory: the pickle and the streaming buffers.
    """
    members, records, cd_offset = _layout(obj, archive, zip64_limit)
    if reserve:  # the members' disk blocks, before their bytes (a full disk fails here)
        preallocate(fd, base, cd_offset)
    own_files = files is None
    files = files if files is not None else SourceFiles()
    written = 0
    try:
        for rec, (_, content) in zip(records, members):
            at = base + rec.data_offset
            if isinstance(content, bytes):
                pwrite_all(fd, content, at)
                rec.crc = zlib.crc32(content)
                continue
            if isinstance(content, StorageAddress) and content.stored_crc is not None \
                    and content.stored_bytes == rec.size:
                sink = PwriteSink(fd, at, behind=behind)
                if getattr(files, "tracks", lambda path: False)(content.path):  # its CRC-32 checked as it streams
                    bufs = bufs if bufs is not None else ChunkBuffers(COPY_BYTES)
                    copy_ranges([StoredRange(content.path, content.data_offset, "uint8", rec.size)], "uint8", sink,
                                bufs, files, progress, cancel)
                else:
                    src_fd = files.fd(content.path)
                    for done in range(0, rec.size, COPY_BYTES):
                        n = min(COPY_BYTES, rec.size - done)
                        sink.copy_from(src_fd, content.data_offset + done, n)
                        files.count(n)
                        progress(n)
                    files.drop_cache(content.path, content.data_offset, rec.size)
                rec.crc = content.stored_crc
            else:
                sink = PwriteSink(fd, at, crc=True, behind=behind)
                if isinstance(content, StorageAddress):
                    ranges = [StoredRange(content.path, content.data_offset, content.dtype, content.numel)]
                else:
                    ranges = content.ranges
                if isinstance(content, NewTensor) and content.data is not None:
                    sink.write(memoryview(content.data))
                    progress(len(content.data))
                elif hasattr(content, "write_into"):  # computed as written (ckptlib.io.averaging.AveragedNewTensor)
                    content.write_into(sink, bufs if bufs is not None else ChunkBuffers(COPY_BYTES), files, progress,
                                       cancel)
                else:
                    bufs = bufs if bufs is not None else ChunkBuffers(COPY_BYTES)
                    copy_ranges(ranges, content.dtype, sink, bufs, files, progress, cancel)
                if sink.written != rec.size:
                    raise ValueError(f"a new tensor's bytes came to {sink.written} instead of {rec.size}")
                rec.crc = sink.crc
            written += rec.size
        for rec in records:
            pwrite_all(fd, local_header(rec), base + rec.header_offset)
        pwrite_all(fd, central_directory(records, cd_offset, zip64_limit), base + cd_offset)
    finally:
        if own_files:
            files.close()
    return written


def archive_size(obj: Any, archive: str, zip64_limit: int = ZIP64_LIMIT) -> int:
    """The size in bytes of the archive :func:`write_archive` writes for ``obj`` (nothing is read).

    Memory: the pickle."""
    members, records, cd_offset = _layout(obj, archive, zip64_limit)
    return cd_offset + len(central_directory(records, cd_offset, zip64_limit))


__all__ = ["save", "write_archive", "archive_size", "file_size", "NewTensor", "StoredTensor", "StorageAddress", "STORAGE_CLASS"]
