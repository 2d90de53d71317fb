"""Open a torch zip checkpoint (``torch.save`` since torch 1.6) without running code or reading tensors.

:func:`open_torch_file` reads the zip's central directory and the pickle (``data.pkl``, a few KB even
for a multi-GB file) and returns a :class:`TorchFile` whose ``.obj`` is the unpickled object tree, with
every tensor replaced by a :class:`~ckptlib.torchzip.handles.TensorHandle`. Tensor bytes are read
later, on demand, with ``pread``. Every byte read goes through the file's :class:`ReadStats`, so
callers can show how little was read.

Memory: the pickle plus the zip directory; never the tensors.
"""
from __future__ import annotations

import io
import os
import struct
import threading
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

from ..dtypes import itemsize
from ..errors import CkptError, IncompleteCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from ..ranges import StoredRange
from .handles import StorageRef
from .unpickler import SafeUnpickler

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # 30 bytes


@dataclass
class ReadStats:
    """Bytes and read calls made through ckptlib's readers (thread-safe counters)."""

    bytes_read: int = 0
    reads: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1


#: process-wide totals, handy for tests and benchmarks
GLOBAL_STATS = ReadStats()


class _CountingFile(io.RawIOBase):
    """A read-only file object over a descriptor that counts what zipfile reads."""

    def __init__(self, fd: int, stats: ReadStats):
        self._fd = fd
        self._pos = 0
        self._stats = stats
        self._size = os.fstat(fd).st_size

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self._size + pos)
        return self._pos

    def tell(self):
        return self._pos

    def readinto(self, b):
        n = len(b)
        data = os.pread(self._fd, n, self._pos)
        b[:len(data)] = data
        self._pos += len(data)
        self._stats.add(len(data))
        GLOBAL_STATS.add(len(data))
        return len(data)


def classify_file_start(head: bytes) -> str:
    """``"zip"``, ``"legacy"`` (pre-1.6 torch serialization), ``"empty"`` or ``"unknown"``."""
    if not head:
        return "empty"
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if head.startswith(_LEGACY_MAGIC):
        return "legacy"
    return "unknown"


class TorchFile:
    """One torch zip file, opened for metadata and ranged reads.

    Attributes:
        path: the file.
        size: its size in bytes.
        obj: the unpickled object tree (tensors are :class:`TensorHandle`).
        stats: bytes read from this file so far.
    """

    def __init__(self, path: str | os.PathLike, stats: Optional[ReadStats] = None):
        self.path = os.fspath(path)
        self.stats = stats or ReadStats()
        self._fd: Optional[int] = None
        self._storages: dict[str, StorageRef] = {}
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise IncompleteCheckpointError("file not found", path=self.path) from e
        except OSError as e:
            raise IncompleteCheckpointError(f"cannot open the file ({e.strerror})", path=self.path,
                                            hint="check the permissions of the file") from e
        try:
            self.size = os.fstat(self._fd).st_size
            self.obj = self._load_metadata()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ opening
    def _load_metadata(self) -> Any:
        head = self._pread(len(_LEGACY_MAGIC), 0)
        kind = classify_file_start(head)
        if kind == "empty":
            raise IncompleteCheckpointError(
                "the file is empty (0 bytes)", path=self.path,
                hint="the save was probably interrupted; use another tag or re-save the checkpoint")
        if kind == "legacy":
            raise UnsupportedCheckpointError(
                "the file uses torch's legacy (pre-zip) serialization, whose tensor bytes are interleaved "
                "with the pickle and cannot be read piece by piece",
                path=self.path,
                hint="re-save it once in the zip format in a trusted environment: "
                     "torch.save(torch.load(f, weights_only=False), f2) (DeepSpeed writes legacy files only when "
                     "\"checkpoint\": {\"checkpoint_serialization\": false} was set)")
        if kind != "zip":
            raise IncompleteCheckpointError(
                "not a torch checkpoint (the file does not start with a zip header)", path=self.path,
                hint="the file is corrupt or not written by torch.save; re-copy it or use another tag")
        try:
            self._zip = zipfile.ZipFile(_CountingFile(self._fd, self.stats))
            infos = self._zip.infolist()
        except (zipfile.BadZipFile, OSError, EOFError, struct.error) as e:
            raise IncompleteCheckpointError(
                f"the zip archive is damaged or truncated ({e}); {self.size} bytes on disk", path=self.path,
                hint="the save or copy was probably interrupted; copy the file again or use another tag") from e
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pkl) != 1:
            raise IncompleteCheckpointError("zip archive without a torch data.pkl: not a torch checkpoint",
                                            path=self.path)
        self._prefix = pkl[0].filename[: -len("data.pkl")]
        self._members = {i.filename: i for i in infos}
        try:
            data = self._read_member(pkl[0])
        except CkptError:
            raise
        except Exception as e:
            raise IncompleteCheckpointError(f"cannot read the pickle of the checkpoint ({e})", path=self.path,
                                            hint="the file is damaged; copy it again or use another tag") from e
        try:
            return SafeUnpickler(io.BytesIO(data), self._resolve_storage, self.path).load()
        except CkptError:
            raise
        except RecursionError as e:
            raise UnsafeCheckpointError("the pickle nests too deeply", path=self.path) from e
        except Exception as e:  # malformed pickle opcodes, bad arguments to allowed functions
            raise IncompleteCheckpointError(f"the pickle inside the file is malformed ({type(e).__name__}: {e})",
                                            path=self.path,
                                            hint="the file is damaged or not a DeepSpeed/torch checkpoint") from e

    def _read_member(self, info: zipfile.ZipInfo) -> bytes:
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsupportedCheckpointError(f"zip member {info.filename} is compressed", path=self.path)
        off = self._member_data_offset(info)
        data = self._pread(info.file_size, off)
        if len(data) != info.file_size:
            raise IncompleteCheckpointError(f"zip member {info.filename} is truncated", path=self.path)
        return data

    def _member_data_offset(self, info: zipfile.ZipInfo) -> int:
        raw = self._pread(_LOCAL_HEADER.size, info.header_offset)
        if len(raw) != _LOCAL_HEADER.size:
            raise IncompleteCheckpointError("truncated zip local header", path=self.path)
        fields = _LOCAL_HEADER.unpack(raw)
        if fields[0] != _ZIP_MAGIC:
            raise IncompleteCheckpointError(f"bad zip local header for {info.filename}", path=self.path)
        name_len, extra_len = fields[-2], fields[-1]
        return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def _resolve_storage(self, key: str, dtype: str, numel: int) -> StorageRef:
        ref = self._storages.get(key)
        if ref is not None:
            return ref
        info = self._members.get(f"{self._prefix}data/{key}")
        if info is None:
            raise IncompleteCheckpointError(f"storage {key} is missing from the zip archive", path=self.path)
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsupportedCheckpointError(f"storage {key} is compressed", path=self.path)
        if info.file_size < numel * itemsize(dtype):
            raise IncompleteCheckpointError(
                f"storage {key} holds {info.file_size} bytes, fewer than its {numel} elements need",
                path=self.path)
        offset = self._member_data_offset(info)
        if offset + info.file_size > self.size:
            raise IncompleteCheckpointError(
                f"the file is truncated: storage {key} ends at byte {offset + info.file_size}, "
                f"the file has {self.size}", path=self.path, hint="copy the file again or use another tag")
        ref = StorageRef(file=self, key=key, dtype_name=dtype, numel=numel, data_offset=offset,
                         stored_bytes=info.file_size, stored_crc=info.CRC)
        self._storages[key] = ref
        return ref

    # ------------------------------------------------------------------ reading
    @property
    def storages(self) -> dict[str, StorageRef]:
        return dict(self._storages)

    def _pread(self, n: int, offset: int) -> bytes:
        if self._fd is None:
            raise CkptError("file is closed", path=self.path)
        data = os.pread(self._fd, n, offset)
        self.stats.add(len(data))
        GLOBAL_STATS.add(len(data))
        return data

    def read_range(self, r: StoredRange, out=None):
        """Read the elements of range ``r`` (which must lie in this file) as a 1-D torch tensor.

        Memory: the range's bytes (none extra when ``out`` is given: a contiguous 1-D tensor of the
        range's dtype and length, which is then returned).
        """
        import torch

        from ..dtypes import torch_dtype

        if r.path != self.path:
            raise ValueError(f"the range lies in {r.path}, not in {self.path}")
        dtype = torch_dtype(r.dtype)
        nbytes = r.nbytes
        if out is None:
            buf = bytearray(nbytes)
            target = memoryview(buf)
        else:
            if out.dtype != dtype or out.numel() != r.count or not out.is_contiguous():
                raise ValueError("out must be a contiguous tensor of the range's dtype and length")
            buf = None
            target = memoryview(out.view(torch.uint8).numpy()) if r.count else memoryview(b"")
        self.read_into(r.offset, target)
        if out is not None:
            return out
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype)

    def read_into(self, offset: int, target: memoryview) -> None:
        """Fill ``target`` with the file's bytes from ``offset``; a short file is an
        :class:`IncompleteCheckpointError` naming it."""
        done, nbytes = 0, target.nbytes
        while done < nbytes:
            n = os.preadv(self.fileno(), [target[done:]], offset + done)
            if n <= 0:
                raise IncompleteCheckpointError(
                    "unexpected end of file (the file shrank or is truncated)", path=self.path,
                    hint="copy the file again or use another tag")
            done += n
        self.stats.add(nbytes)
        GLOBAL_STATS.add(nbytes)

    def fileno(self) -> int:
        if self._fd is None:
            raise CkptError("file is closed", path=self.path)
        return self._fd

    def count_read(self, nbytes: int) -> None:
        """Account for bytes read outside :meth:`read_elements` (kernel-side copies)."""
        self.stats.add(nbytes)
        GLOBAL_STATS.add(nbytes)

    def drop_cache(self, offset: int = 0, length: int = 0) -> None:
        """Tell the kernel these bytes (default: the whole file) are no longer needed in the page cache."""
        if self._fd is not None and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"TorchFile({self.path!r}, {self.size} bytes)"


def open_torch_file(path: str | os.PathLike, stats: Optional[ReadStats] = None) -> TorchFile:
    """Open a torch zip checkpoint for metadata and ranged reads; see :class:`TorchFile`."""
    return TorchFile(path, stats=stats)
