"""torch's legacy (non-zip) serialization, read for metadata and ranged reads like a zip file.

``torch.save(..., _use_new_zipfile_serialization=False)`` (what DeepSpeed's torch and fast checkpoint engines
call when the config says ``"checkpoint": {"checkpoint_serialization": false}``) writes one stream:

1. a pickle of torch's magic number (a long), 2. a pickle of the protocol version (1001), 3. a pickle of
   the writer's ``sys_info`` (``little_endian``, type sizes);
4. the main pickle: the object tree, each storage a persistent id
   ``('storage', storage type, key, location, numel, view metadata)``;
5. a pickle of the list of storage keys;
6. for each key in that list's order: the storage's element count (8 bytes, little-endian) and then its
   ``count * itemsize`` bytes.

:func:`read_legacy` unpickles the four small pickles with the same restricted unpickler as a zip file's
``data.pkl`` (:class:`~.unpickler.SafeUnpickler`: nothing is run, no global outside its allow-list), then walks
the storage headers once (one 8-byte count per storage, read through a window so that a run of small storages
costs one ``pread``; the bytes themselves are skipped, never read) and proves the extents: every count equals
the numel the pickle gives, each storage fits, and the storages end exactly where the file ends. Each storage
is then a :class:`~.handles.StorageRef` with a file offset, read range by range like a zip member (there is no
CRC-32 in this format: ``stored_crc`` is None). Anything else is one :class:`IncompleteCheckpointError` (or
:class:`UnsupportedCheckpointError`, :class:`UnsafeCheckpointError`) naming the file.

Memory: the pickles (read through a 64 KiB buffer) and one small record per storage; never the tensors.
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
from typing import Any, Callable

from ...dtypes import BY_NAME, itemsize
from ...errors import CkptError, IncompleteCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from .handles import StorageRef
from .unpickler import SafeUnpickler

#: the first pickle of a legacy file: torch's magic number 0x1950a86a20f9469cfc6c as a protocol-2 long
MAGIC_PICKLE = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."
MAGIC = MAGIC_PICKLE[:-1]  # what identifies the format (reader.classify_file_start)
PROTOCOL_VERSION = 1001
_BUFFER = 64 * 1024  # read-ahead of the pickles
_WINDOW = 8 * 1024  # storage headers at most this far apart are read in one pread
_DAMAGED = "the file is damaged or truncated; copy it again from the original, or use another tag"


class _PreadFile(io.RawIOBase):
    """A read-only, seekable raw stream over ``pread`` (every byte counted by the caller's ``pread``)."""

    def __init__(self, pread: Callable[[int, int], bytes], size: int):
        self._pread, self._size, self._pos = pread, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), max(0, self._size - self._pos))
        if n == 0:
            return 0
        data = self._pread(n, self._pos)
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class _LegacyUnpickler(SafeUnpickler):
    """:class:`SafeUnpickler` for a legacy file's pickles: persistent ids carry a sixth element (view
    metadata, ``None`` since torch 1.x saves whole storages); one that is not None is refused."""

    def __init__(self, file, storage_resolver, source: str):
        super().__init__(file, storage_resolver, source)
        self._path = source

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and pid[5] is not None:
            raise UnsupportedCheckpointError(
                "a storage is saved as a view of another (a format torch stopped writing before 1.0)", path=self._path,
                hint="load it with an old torch in a trusted environment and save it again")
        return super().persistent_load(pid)


def _no_storage(key, dtype, numel):
    raise pickle.UnpicklingError("a storage where only plain values belong")


def read_legacy(owner: Any, path: str, size: int, pread: Callable[[int, int], bytes]) -> tuple[Any, dict]:
    """``(object tree, {key: StorageRef})`` of the legacy torch file ``path`` of ``size`` bytes, read with
    ``pread(n, offset)``; the storages' ``file`` is ``owner`` (the :class:`~.reader.TorchFile`)."""
    raw = _PreadFile(pread, size)
    f = io.BufferedReader(raw, _BUFFER)
    refs: dict[str, StorageRef] = {}

    def resolve(key: str, dtype: str, numel: int) -> StorageRef:
        ref = refs.get(key)
        if ref is None:
            if numel < 0:
                raise pickle.UnpicklingError(f"storage {key} has {numel} elements")
            ref = refs[key] = StorageRef(file=owner, key=key, dtype_name=dtype, numel=numel, data_offset=-1,
                                         stored_bytes=0, stored_crc=None)
        elif (ref.dtype_name, ref.numel) != (dtype, numel):
            raise pickle.UnpicklingError(f"storage {key} is named as {ref.numel} {ref.dtype_name} and as {numel} "
                                         f"{dtype}")
        return ref

    def load(what: str, resolver=_no_storage) -> Any:
        try:
            return _LegacyUnpickler(f, resolver, path).load()
        except CkptError:
            raise
        except RecursionError as e:
            raise UnsafeCheckpointError(f"the {what} nests too deeply", path=path) from e
        except Exception as e:  # malformed or truncated pickle
            raise IncompleteCheckpointError(
                f"torch's legacy serialization: the {what} is malformed or truncated ({type(e).__name__}: {e})",
                path=path, hint=_DAMAGED) from None

    if f.read(len(MAGIC_PICKLE)) != MAGIC_PICKLE:
        raise IncompleteCheckpointError("torch's legacy serialization: the magic number is damaged", path=path,
                                        hint=_DAMAGED)
    version = load("protocol version")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise UnsupportedCheckpointError(f"torch's legacy serialization, protocol version {str(version)[:40]!r} "
                                         f"(ckptlib reads {PROTOCOL_VERSION})", path=path, hint=_DAMAGED)
    info = load("sys_info record")
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        order = info.get("little_endian") if isinstance(info, dict) else None
        if order is False:
            raise UnsupportedCheckpointError(
                "its tensors are stored big-endian (sys_info.little_endian is False); ckptlib reads little-endian "
                "tensor bytes only", path=path,
                hint="load and re-save it with torch on a little-endian machine (torch swaps the bytes when it loads)")
        raise IncompleteCheckpointError("torch's legacy serialization: the sys_info record is damaged", path=path,
                                        hint=_DAMAGED)
    obj = load("pickle", resolve)
    keys = load("list of storage keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise IncompleteCheckpointError("torch's legacy serialization: the list of storage keys is damaged",
                                        path=path, hint=_DAMAGED)
    if set(keys) != set(refs):
        missing, extra = sorted(set(refs) - set(keys)), sorted(set(keys) - set(refs))
        raise IncompleteCheckpointError(
            "torch's legacy serialization: the list of storage keys does not match the storages of the pickle "
            f"(missing {missing[:3]}, extra {extra[:3]})", path=path, hint=_DAMAGED)
    offset = f.tell()
    walk_storages(path, size, pread, offset, [refs[k] for k in keys], f.peek(8) if offset < size else b"")
    return obj, refs


def walk_storages(path: str, size: int, pread: Callable[[int, int], bytes], offset: int, refs: list,
                  window: bytes = b"") -> None:
    """Locate each storage of ``refs`` (in file order, from byte ``offset``): its 8-byte element count, proven
    equal to its numel, then its bytes, which must fit; the last must end at byte ``size``. Sets each
    ref's ``data_offset`` and ``stored_bytes``. Reads the counts only (``window``: the file's bytes from
    ``offset`` already read)."""
    start = offset
    for ref in refs:
        if offset + 8 > size:
            raise IncompleteCheckpointError(
                f"the file is truncated: storage {ref.key}'s element count would be at byte {offset}, the file has "
                f"{size} (torch's legacy serialization)", path=path, hint=_DAMAGED)
        if not (start <= offset and offset + 8 <= start + len(window)):
            start, window = offset, pread(min(_WINDOW, size - offset), offset)
            if len(window) < 8:
                raise IncompleteCheckpointError("unexpected end of file (the file shrank or is truncated)", path=path,
                                                hint=_DAMAGED)
        count = int.from_bytes(window[offset - start:offset - start + 8], "little", signed=True)
        if count != ref.numel:
            raise IncompleteCheckpointError(
                f"storage {ref.key} records {count} elements before its bytes at byte {offset}, its pickle says "
                f"{ref.numel} (torch's legacy serialization)", path=path, hint=_DAMAGED)
        known = BY_NAME.get(ref.dtype_name)
        nbytes = count * (known.itemsize if known is not None else itemsize(ref.dtype_name))
        ref.data_offset, ref.stored_bytes = offset + 8, nbytes
        offset += 8 + nbytes
        if offset > size:
            raise IncompleteCheckpointError(
                f"the file is truncated: storage {ref.key} ends at byte {offset}, the file has {size} "
                "(torch's legacy serialization)", path=path, hint=_DAMAGED)
    if offset != size:
        raise IncompleteCheckpointError(
            f"{size - offset} bytes follow the last storage (which ends at byte {offset}): the file is damaged, or "
            "not one torch.save wrote (torch's legacy serialization)", path=path, hint=_DAMAGED)


def legacy_pickle(path: str | os.PathLike) -> bytes:
    """The main pickle of legacy file ``path`` (its bytes, for ``inspect --globals``): the three header pickles
    and the main one are walked with :func:`pickletools.genops`, which decodes opcodes without running anything."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            for _ in range(3):
                for _op in pickletools.genops(f):
                    pass
            start = f.tell()
            for _op in pickletools.genops(f):
                pass
            end = f.tell()
        except Exception as e:  # noqa: BLE001 - a malformed pickle
            raise IncompleteCheckpointError(f"torch's legacy serialization: a pickle does not decode ({e})", path=path,
                                            hint=_DAMAGED) from None
        f.seek(start)
        return f.read(end - start)


__all__ = ["MAGIC", "MAGIC_PICKLE", "read_legacy", "walk_storages", "legacy_pickle"]
