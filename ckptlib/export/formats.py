"""Streaming writers for safetensors and torch zip files.

Both writers take the list of tensors (name, dtype, shape) up front and then receive each tensor's
bytes in order, in chunks of any size; neither ever holds a whole tensor.

- :class:`SafetensorsLayout`: the header is computed from the plan, so every tensor's byte range in
  the file is known before any data is written; writers (also several processes at once) ``pwrite``
  the chunks at their offsets.
- :class:`TorchZipWriter`: writes what ``torch.save`` of a ``{name: tensor}`` dict writes (zip,
  ``data.pkl`` + one record per tensor, 64-byte aligned), record by record; loads with
  ``torch.load(weights_only=True)`` and ``mmap=True``. Each tensor has its own storage, so a shard
  holds only its own tensors' bytes.
"""
from __future__ import annotations

import json
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


# ---------------------------------------------------------------------------------------------- safetensors
class SafetensorsLayout:
    """The byte layout of a safetensors file holding ``tensors`` in the given order."""

    def __init__(self, tensors: Sequence[TensorSpec], metadata: Optional[dict] = None):
        self.tensors = list(tensors)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for t in self.tensors:
            if t.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors cannot hold dtype {t.dtype}")
            header[t.name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [pos, pos + t.nbytes]}
            self.offsets[t.name] = (pos, pos + t.nbytes)
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(self.header)
        self.file_size = self.data_start + pos

    def create(self, path: str | os.PathLike) -> None:
        """Create the file with its header and its final size (data filled in by :meth:`open_for_data`)."""
        with open(path, "wb") as f:
            f.write(self.header)
            f.truncate(self.file_size)

    def tensor_offset(self, name: str) -> int:
        return self.data_start + self.offsets[name][0]


class PwriteSink:
    """Writes consecutive chunks at a moving offset of an open file (``os.pwrite``).

    :meth:`copy_from` copies bytes straight from another file inside the kernel
    (``copy_file_range``: no user-space buffer at all), falling back to ``pread``/``pwrite``.
    """

    COPY_STEP = 64 * 2**20

    def __init__(self, fd: int, offset: int):
        self.fd, self.offset = fd, offset

    def write(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.offset + done)
        self.offset += len(data)

    def copy_from(self, src_fd: int, src_offset: int, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            n = min(self.COPY_STEP, nbytes - done)
            try:
                k = os.copy_file_range(src_fd, self.fd, n, src_offset + done, self.offset + done)
            except OSError:  # not supported between these files: copy through a small buffer
                k = 0
            if k <= 0:
                data = os.pread(src_fd, min(n, 2**20), src_offset + done)
                if not data:
                    raise OSError(f"unexpected end of file copying {nbytes} bytes")
                k = os.pwrite(self.fd, data, self.offset + done)
            done += k
        self.offset += nbytes


# ---------------------------------------------------------------------------------------------- torch zip
_STORAGE_CLASS_NAME = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
}


class _PickleEmitter:
    """Writes the few pickle opcodes (protocol 2) that a torch ``data.pkl`` of a tensor dict needs."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + f"{module}\n{name}\n".encode()

    def string(self, s: str) -> None:
        raw = s.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def integer(self, v: int) -> None:
        if 0 <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw

    def int_tuple(self, values) -> None:
        self.out += b"("
        for v in values:
            self.integer(int(v))
        self.out += b"t"

    def raw(self, opcodes: bytes) -> None:
        self.out += opcodes


def pickle_tensor_dict(specs: Sequence[TensorSpec]) -> bytes:
    """``data.pkl`` of a torch zip file holding ``OrderedDict{spec.name: tensor}``, storage keys ``"0"``, ``"1"``, ...

    Each tensor is contiguous with its own storage; only torch's own rebuild function and storage
    classes are named, so the file loads with ``torch.load(weights_only=True)``.
    """
    e = _PickleEmitter()
    e.glob("collections", "OrderedDict")
    e.raw(b")R")
    for i, spec in enumerate(specs):
        shape = tuple(int(x) for x in spec.shape)
        stride, acc = [], 1
        for size in reversed(shape):
            stride.append(acc)
            acc *= size
        numel = acc
        e.string(spec.name)
        e.glob("torch._utils", "_rebuild_tensor_v2")
        e.raw(b"((")                      # args tuple, persistent id tuple
        e.string("storage")
        e.glob("torch", _STORAGE_CLASS_NAME[spec.dtype])
        e.string(str(i))
        e.string("cpu")
        e.integer(numel)
        e.raw(b"tQ")                      # end pid tuple, BINPERSID
        e.integer(0)                      # storage offset
        e.int_tuple(shape)
        e.int_tuple(reversed(stride))
        e.raw(b"\x89")                    # requires_grad False
        e.glob("collections", "OrderedDict")
        e.raw(b")R")                      # backward hooks
        e.raw(b"tRs")                     # end args, REDUCE, SETITEM
    e.raw(b".")
    return bytes(e.out)


class TorchZipWriter:
    """Streams a torch zip file: ``begin_tensor(i)``, ``write(chunk)``... for each tensor in order, ``close()``."""

    ALIGN = 64

    def __init__(self, path: str | os.PathLike, specs: Sequence[TensorSpec], archive: str = "archive"):
        self.specs = list(specs)
        self.archive = archive
        self._zip = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._writer = None
        self._write_record("data.pkl", pickle_tensor_dict(self.specs))
        self._write_record(".format_version", b"1")
        self._write_record(".storage_alignment", str(self.ALIGN).encode())
        self._write_record("byteorder", b"little")
        self._next = 0

    def _open_record(self, name: str, size: int):
        info = zipfile.ZipInfo(f"{self.archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size > zipfile.ZIP64_LIMIT
        fixed = 30 + len(info.filename.encode()) + (20 if zip64 else 0) + 4
        start = self._zip.fp.tell()
        pad = -(start + fixed) % self.ALIGN
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding block, as torch writes
        return self._zip.open(info, "w", force_zip64=zip64)

    def _write_record(self, name: str, data: bytes) -> None:
        with self._open_record(name, len(data)) as w:
            w.write(data)

    def begin_tensor(self, index: int) -> None:
        if index != self._next:
            raise ValueError("tensors must be written in order")
        self._end_tensor()
        self._writer = self._open_record(f"data/{index}", self.specs[index].nbytes)
        self._next += 1

    def write(self, data) -> None:
        self._writer.write(data)

    def _end_tensor(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        self._end_tensor()
        if self._next != len(self.specs):
            raise ValueError("not every tensor was written")
        self._write_record("version", b"3\n")
        self._write_record(".data/serialization_id", b"0" * 40)
        self._zip.close()
