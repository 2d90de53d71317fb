"""Open a torch checkpoint file (``torch.save``'s zip format, or its legacy format) without running code or
reading tensors.

:func:`open_torch_file` reads the zip's central directory (in one read, parsed by :mod:`.zipfmt`), the
local headers of the pickle and the storages (those close together in one read: a ZeRO-3 model file's
hundreds of empty storages cost one) and the pickle (``data.pkl``, a few KB even for a multi-GB file),
and returns a :class:`TorchFile` whose ``.obj`` is the unpickled object tree, with
every tensor replaced by a :class:`~ckptlib.io.torchzip.handles.TensorHandle`. Tensor bytes are read
later, on demand, with ``pread``. Every byte read goes through the file's :class:`ReadStats`, so
callers can show how little was read.

:func:`zip_entries_of` lists a zip file's members (offsets, sizes, CRC-32s) without unpickling anything: the
files a run copies whole, whose CRC-32s it checks as it copies them (:mod:`ckptlib.io.crc`).

A file in torch's legacy (non-zip) serialization is read by :mod:`.legacy` instead (the file kind decides:
:func:`classify_file_start`): the same object tree and storages with file offsets, so that everything that
reads a :class:`TorchFile` reads it unchanged.

Memory: the pickle plus the zip directory (dropped once the pickle is loaded; a file opened through a
:class:`PickleMemo` holds the pickle it shares with others until its tree is built); never the tensors.
"""
from __future__ import annotations

import io
import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Optional

from ...dtypes import BY_NAME, itemsize
from ...errors import CkptError, IncompleteCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError, printable
from ...layout.ranges import StoredRange
from . import zipfmt
from .handles import StorageRef
from .legacy import MAGIC as _LEGACY_MAGIC
from .legacy import read_legacy
from .unpickler import SafeUnpickler
from .zipfmt import ZipFormatError

_ZIP_MAGIC = b"PK\x03\x04"
_NEAR = 8192  # local headers at most this far apart are read in one pread


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


def classify_file_start(head: bytes) -> str:
    """``"zip"``, ``"legacy"`` (torch's non-zip serialization: ``_use_new_zipfile_serialization=False``),
    ``"empty"`` or ``"unknown"``."""
    if not head:
        return "empty"
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if head.startswith(_LEGACY_MAGIC):
        return "legacy"
    return "unknown"


class PickleMemo:
    """The pickles a set of files (a tag folder's) have shown so far, so that a file whose ``data.pkl`` is
    byte for byte one seen before is opened without unpickling it again: every storage that pickle refers to
    is checked against the file's own zip directory, as unpickling would, and the file's object tree is
    built when it is first used. ZeRO-3 writes one model-states file per rank with the same pickle on
    ranks 1..N-1 (rank 0's also records the tied parameters), and the same optimizer pickle on every rank:
    at 512 ranks, 511 of the model files' pickles (723 tensors each for a Llama-2-70B) need not be unpickled
    (and are not, unless their trees are used: for frozen parameters' chunks).

    Memory: the distinct pickles remembered, at most ``limit`` bytes of them (the first ones seen).
    """

    def __init__(self, limit: int = 16 * 2**20):
        self.limit, self.held = limit, 0
        self._known: dict[tuple, list] = {}  # (length, CRC-32) -> [(pickle, [(key, dtype, numel), ...]), ...]

    def find(self, data: bytes) -> Optional[tuple[bytes, list]]:
        """``(the remembered copy of data, the storages it resolves in order)``, or None."""
        for known, storages in self._known.get((len(data), zlib.crc32(data)), ()):
            if known == data:
                return known, storages
        return None

    def remember(self, data: bytes, storages: list) -> None:
        if self.held + len(data) <= self.limit:
            self._known.setdefault((len(data), zlib.crc32(data)), []).append((data, storages))
            self.held += len(data)


_UNREAD = object()  # a TorchFile's object tree that is not built yet (see PickleMemo)


@dataclass(frozen=True, order=True)
class ZipEntry:
    """One member of a torch zip file, as plain data: its ``size`` bytes start at ``offset`` of ``path``, and
    the zip directory records their CRC-32 ``crc`` (what :mod:`ckptlib.io.crc` verifies)."""

    path: str
    name: str
    offset: int
    size: int
    crc: int


class TorchFile:
    """One torch file, opened for metadata and ranged reads.

    Attributes:
        path: the file.
        size: its size in bytes.
        format: ``"zip"``, or ``"legacy"`` (torch's non-zip serialization: no zip entries, no CRC-32, no
            archive name).
        obj: the unpickled object tree (tensors are :class:`TensorHandle`); built on first use when the
            file was opened with a :class:`PickleMemo` that knew its pickle.
        stats: bytes read from this file so far.
    """

    def __init__(self, path: str | os.PathLike, stats: Optional[ReadStats] = None, memo: Optional[PickleMemo] = None):
        self.path = os.fspath(path)
        self.stats = stats or ReadStats()
        self._fd: Optional[int] = None
        self._storages: dict[str, StorageRef] = {}
        self._memo = memo
        self.entries: tuple = ()  # every zip member as a ZipEntry, by offset
        self._pickle: Optional[bytes] = None  # kept until the object tree is built (shared with the memo)
        self._lock = threading.Lock()
        self._prefix: Optional[str] = None
        self.format = "zip"
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise IncompleteCheckpointError("file not found", path=self.path) from e
        except OSError as e:
            raise IncompleteCheckpointError(f"cannot open the file ({e.strerror})", path=self.path,
                                            hint="check the permissions of the file") from e
        try:
            self.size = os.fstat(self._fd).st_size
            self._obj = self._load_metadata()
        except BaseException:
            self.close()
            raise
        finally:
            self._memo = None

    @property
    def obj(self) -> Any:
        if self._obj is _UNREAD:
            with self._lock:
                if self._obj is _UNREAD:  # the same bytes as a pickle unpickled before: it unpickles the same way
                    self._obj = self._unpickle(self._pickle)
                    self._pickle = None
        return self._obj

    # ------------------------------------------------------------------ opening
    def _load_metadata(self) -> Any:
        head = self._pread(len(_LEGACY_MAGIC), 0)
        kind = classify_file_start(head)
        if kind == "empty":
            raise IncompleteCheckpointError(
                "the file is empty (0 bytes)", path=self.path,
                hint="the save was probably interrupted; use another tag or re-save the checkpoint")
        if kind == "legacy":  # storages located by walking their headers (see .legacy)
            self.format = "legacy"
            obj, self._storages = read_legacy(self, self.path, self.size, self._pread)
            return obj
        if kind != "zip":
            raise IncompleteCheckpointError(
                "not a torch checkpoint (the file does not start with a zip header)", path=self.path,
                hint="the file is corrupt or not written by torch.save; re-copy it or use another tag")
        try:
            members = self._read_directory()
        except (ZipFormatError, OSError) as e:
            raise IncompleteCheckpointError(
                f"the zip archive is damaged or truncated ({e}); {self.size} bytes on disk", path=self.path,
                hint="the save or copy was probably interrupted; copy the file again or use another tag") from e
        pkl = [n for n in members if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise IncompleteCheckpointError("zip archive without a torch data.pkl: not a torch checkpoint",
                                            path=self.path)
        self._prefix = pkl[0][: -len("data.pkl")]
        self._members = members
        try:
            self._offsets = self._data_offsets(members, pkl[0])
            self.entries = tuple(sorted((ZipEntry(self.path, name, self._offsets[name], v[2], v[3])
                                         for name, v in members.items() if name in self._offsets),
                                        key=lambda e: e.offset))
            self._check_byteorder()
            data = self._read_member(pkl[0])
            if zlib.crc32(data) != members[pkl[0]][3]:
                raise IncompleteCheckpointError(
                    f"the pickle ({pkl[0]}) does not match the CRC-32 its zip directory records: the file's bytes "
                    "changed after it was saved (a bad copy, bit rot), so its metadata cannot be trusted",
                    path=self.path, hint="copy the file again from the original, or use another tag")
        except CkptError:
            raise
        except Exception as e:
            raise IncompleteCheckpointError(f"cannot read the pickle of the checkpoint ({e})", path=self.path,
                                            hint="the file is damaged; copy it again or use another tag") from e
        try:
            known = self._memo.find(data) if self._memo is not None else None
            if known is not None:  # check what unpickling would check; build the tree on first use
                self._pickle, storages = known
                for key, dtype, numel in storages:
                    self._resolve_storage(key, dtype, numel)
                return _UNREAD
            obj = self._unpickle(data)
            if self._memo is not None:
                self._memo.remember(data, [(r.key, r.dtype_name, r.numel) for r in self._storages.values()])
            return obj
        finally:  # the directory is not needed once the storages are known
            self._members = self._offsets = None

    def _unpickle(self, data: bytes) -> Any:
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

    def _read_directory(self) -> dict[str, tuple]:
        """The zip's central directory, ``{name: (header offset, stored size, size, CRC-32, method)}``
        (:func:`read_directory`)."""
        members, self._directory_at = read_directory(self._pread, self.size)
        return members

    def _data_offsets(self, members: dict[str, tuple], pkl: str) -> dict[str, int]:
        """Where the data of every member starts, each proven against the central directory
        (:func:`data_offsets`); a damaged local header is refused naming the file."""
        try:
            return data_offsets(self._pread, members, self._directory_at)
        except ZipFormatError as e:
            raise IncompleteCheckpointError(str(e), path=self.path,
                                            hint="the file is damaged: copy it again from the original, or use another "
                                                 "tag") from None

    def _check_byteorder(self) -> None:
        """torch records the byte order of the tensor bytes in ``<archive>/byteorder`` (``little`` on every
        machine it runs on today; files without the record are little-endian too). Anything else is refused:
        ckptlib copies and casts the bytes as little-endian, where torch would swap them."""
        name = self._prefix + "byteorder"
        if name not in self._members:
            return
        if self._members[name][2] > 16:
            raise IncompleteCheckpointError(f"its {name} record holds {self._members[name][2]} bytes, not a byte order",
                                            path=self.path, hint="the file is damaged; copy it again or use another tag")
        order = self._read_member(name).decode("ascii", "replace").strip()
        if order != "little":
            raise UnsupportedCheckpointError(
                f"its tensors are stored {printable(order, 16)!r}-endian (the {name} record); ckptlib reads "
                "little-endian tensor bytes only", path=self.path,
                hint="load and re-save it with torch on a little-endian machine (torch swaps the bytes when it loads)")

    def _read_member(self, name: str) -> bytes:
        _, _, size, _, method = self._members[name]
        if method != zipfmt.STORED:
            raise UnsupportedCheckpointError(f"zip member {name} is compressed", path=self.path)
        data = self._pread(size, self._offsets[name])
        if len(data) != size:
            raise IncompleteCheckpointError(f"zip member {name} is truncated", path=self.path)
        return data

    def _resolve_storage(self, key: str, dtype: str, numel: int) -> StorageRef:
        ref = self._storages.get(key)
        if ref is not None:
            return ref
        name = self._prefix + "data/" + key
        info = self._members.get(name)
        if info is None:
            raise IncompleteCheckpointError(f"storage {key} is missing from the zip archive", path=self.path)
        size, crc, method = info[2], info[3], info[4]
        if method != zipfmt.STORED:
            raise UnsupportedCheckpointError(f"storage {key} is compressed", path=self.path)
        known = BY_NAME.get(dtype)
        if size < numel * (known.itemsize if known is not None else itemsize(dtype)):
            raise IncompleteCheckpointError(
                f"storage {key} holds {size} bytes, fewer than its {numel} elements need",
                path=self.path)
        offset = self._offsets[name]
        if offset + size > self.size:
            raise IncompleteCheckpointError(
                f"the file is truncated: storage {key} ends at byte {offset + size}, "
                f"the file has {self.size}", path=self.path, hint="copy the file again or use another tag")
        ref = self._storages[key] = StorageRef(file=self, key=key, dtype_name=dtype, numel=numel, data_offset=offset,
                                               stored_bytes=size, stored_crc=crc)
        return ref

    @property
    def archive_name(self) -> Optional[str]:
        """The name of the zip archive's top folder (``<name>/data.pkl``): torch names it after the file it
        writes (its name without the extension), ``archive`` when it wrote to a file object. A file renamed
        or copied over another keeps the name it was saved under. None for a legacy file (it records none)."""
        return None if self._prefix is None else self._prefix.rstrip("/")

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
        from ...dtypes import TORCH_TENSORS, import_torch, torch_dtype

        torch = import_torch(TORCH_TENSORS)

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


def read_directory(pread, size: int) -> tuple[dict[str, tuple], int]:
    """The central directory of the zip file of ``size`` bytes read by ``pread(n, offset)``, ``{name: (header
    offset, stored size, size, CRC-32, method)}``, and where it starts: the end records from the file's last bytes,
    then the directory in one read (see :mod:`.zipfmt`)."""
    n = min(size, zipfmt.END_SEARCH)
    found = zipfmt.find_directory(pread(n, size - n), size - n)
    if found is None and n < size:  # a zip comment longer than END_SEARCH allows for
        n = min(size, zipfmt.END_SEARCH_MAX)
        found = zipfmt.find_directory(pread(n, size - n), size - n)
    if found is None:
        raise ZipFormatError("no end of central directory record: the file is truncated or not a zip archive")
    at = found.offset + found.shift
    return zipfmt.parse_directory(pread(found.size, at), found), at


def data_offsets(pread, members: dict[str, tuple], directory_at: int) -> dict[str, int]:
    """Where the data of every member starts, from their local headers, each proven against the central
    directory (:func:`~.zipfmt.data_offsets`, :func:`~.zipfmt.prove_extents`: the name, method, sizes, and the
    data ending where the next member begins), so that a damaged local header is refused (:class:`ZipFormatError`)
    instead of moving a tensor's bytes. Headers at most :data:`_NEAR` bytes apart (the empty or tiny storages of
    ZeRO-3 model files) are read together, one ``pread`` per run."""
    wanted = sorted((v[0], name) for name, v in members.items())  # every member: its CRC can be checked
    out: dict[str, int] = {}
    flags: dict[str, int] = {}
    bufs: list = []
    for start, length, headers in zipfmt.header_runs(wanted, _NEAR):
        buf = pread(length, start)
        bufs.append((start, buf))
        zipfmt.data_offsets(buf, start, headers, out, members, flags)

    def read(offset: int, n: int) -> bytes:
        for start, buf in bufs:
            if start <= offset and offset + n <= start + len(buf):
                return buf[offset - start:offset - start + n]
        return pread(n, offset)

    zipfmt.prove_extents(members, out, flags, directory_at, read)
    return out


def zip_entries_of(path: str | os.PathLike) -> tuple:
    """Every member of the zip file ``path`` as a :class:`ZipEntry`, by offset (its directory and local headers
    read and proven as when a torch file is opened; nothing unpickled); ``()`` for a file that is not a zip
    archive (a legacy torch file, text, safetensors).

    Raises:
        IncompleteCheckpointError: a zip file whose directory or headers are damaged, naming it.

    Memory: the directory."""
    path = os.fspath(path)
    with open(path, "rb") as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size

        def pread(n: int, offset: int) -> bytes:
            return os.pread(fd, n, offset)

        if classify_file_start(pread(len(_ZIP_MAGIC), 0)) != "zip":
            return ()
        try:
            members, at = read_directory(pread, size)
            offsets = data_offsets(pread, members, at)
        except (ZipFormatError, OSError) as e:
            raise IncompleteCheckpointError(f"the zip archive is damaged or truncated ({e})", path=path,
                                            hint="copy the file again from the original") from None
    return tuple(sorted((ZipEntry(path, name, offsets[name], v[2], v[3]) for name, v in members.items()
                         if name in offsets), key=lambda e: e.offset))


def open_torch_file(path: str | os.PathLike, stats: Optional[ReadStats] = None) -> TorchFile:
    """Open a torch checkpoint file (zip or legacy format) for metadata and ranged reads; see :class:`TorchFile`."""
    return TorchFile(path, stats=stats)
