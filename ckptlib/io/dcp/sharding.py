"""The safetensors files torch 2.13's DCP writes, read as JSON and byte offsets (no torch, no safetensors package).

Two writers put tensors in safetensors form (seen on files torch 2.13 wrote, FSDP2 at 2 and 3 ranks):

- ``FileSystemWriter(path, serialization_format=SerializationFormat.SAFETENSORS)``: a ``.metadata`` and
  ``__R_0.distcp`` files, as for the default (torch.save) serialization, but each ``.distcp`` file is its value
  items (``torch.save`` archives of param groups and other plain values, first) followed by **one safetensors
  file** holding every tensor chunk of the rank. The ``.metadata``'s ``_StorageInfo`` of every tensor chunk of
  a file gives the same ``offset``, where that safetensors file begins (0 when the rank saved no values), and
  ``length`` the chunk's raw byte count: it locates the safetensors file, not the chunk, whose bytes the
  safetensors header alone gives (:func:`read_blob`);
- ``HuggingFaceStorageWriter``: safetensors files only (``model-0000i-of-0000N.safetensors``, or per rank
  ``shard-XXXXX-model-0000i-of-0000N.safetensors`` with ``save_distributed=True``): :mod:`.hfstorage`.

Each such safetensors file's ``__metadata__`` holds ``DCP_VERSION`` (``"1.0"``), ``format`` (``"pt"``) and
``DCP_SHARDING_INFO``: a JSON string ``{key: {"saved_offsets": [...]}}`` saying where each tensor of the file
sits in the full tensor of that key. pytorch #189945 (open; not in torch 2.13) adds ``"global_shape"`` beside
``saved_offsets``: the full tensor's size, which a reader otherwise rebuilds as the largest ``offset + size``
of the pieces (losing a trailing extent no piece reaches). Where present it is read and checked.

Memory: a file's header (at most :data:`MAX_HEADER` bytes).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Optional

from ...dtypes import BY_NAME, itemsize
from ...errors import IncompleteCheckpointError

SHARDING_INFO, VERSION_KEY, FORMAT_KEY = "DCP_SHARDING_INFO", "DCP_VERSION", "format"
SAVED_OFFSETS, GLOBAL_SHAPE = "saved_offsets", "global_shape"
HF_VERSION = "1.0"  # torch.distributed.checkpoint._hf_utils.HF_DCP_VERSION, written as str(1.0)
MAX_HEADER = 100 * 2**20
_FROM_CODE = {d.safetensors: d.name for d in BY_NAME.values() if d.safetensors}
_HINT = "the file is damaged or was not written by torch.distributed.checkpoint: copy the folder again"


@dataclass(frozen=True)
class Piece:
    """One tensor of a DCP safetensors file: its ``key`` (the flattened state-dict key), ``dtype`` (a name),
    ``shape`` (the piece's), its data at absolute byte ``offset`` of the file (``nbytes``), and from the sharding
    info where it sits in the full tensor (``saved_offsets``, zeros without sharding info) and, where recorded,
    the full tensor's ``global_shape``."""

    key: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    saved_offsets: tuple
    global_shape: Optional[tuple] = None


@dataclass
class Blob:
    """A safetensors file beginning at byte ``start`` of ``path``: its ``__metadata__``, its pieces (in header
    order), whether it carries DCP's sharding info, and its end (``start + 8 + header + data``)."""

    path: str
    start: int
    end: int
    meta: dict
    pieces: list = field(default_factory=list)
    sharded: bool = False

    @property
    def version(self) -> Optional[str]:
        return self.meta.get(VERSION_KEY)


def _bad(path: str, what: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(what, path=path, hint=_HINT)


def _ints(v, n: Optional[int]) -> Optional[tuple]:
    if not isinstance(v, list) or any(type(x) is not int or x < 0 for x in v) or (n is not None and len(v) != n):
        return None
    return tuple(v)


def read_blob(path: str, start: int = 0, end: Optional[int] = None) -> Blob:
    """The safetensors file at byte ``start`` of ``path`` (ending at ``end``, default the file's end), from its
    header: each tensor's dtype, shape and absolute data offset, with its sharding info where the header has it.

    Raises:
        IncompleteCheckpointError: no safetensors header there, a malformed or inconsistent one (a tensor
            outside the data, sharding info that does not match the tensors), naming the file.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise IncompleteCheckpointError(f"cannot open the file ({e.strerror})", path=path) from None
    try:
        size = os.fstat(fd).st_size
        end = size if end is None else end
        head = os.pread(fd, 8, start)
        if len(head) != 8:
            raise _bad(path, f"no safetensors data at byte {start}: the file ends there")
        if head.startswith(b"PK\x03\x04"):
            raise IncompleteCheckpointError(
                f"a torch.save archive at byte {start}, where safetensors data should begin: a value (a param group, "
                "a number) was saved into safetensors storage, whose writer puts its bytes before the safetensors "
                "header; no safetensors reader can read this file", path=path,
                hint="save the optimizer state with FileSystemWriter (torch.save serialization), the model's tensors "
                     "alone into safetensors storage")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or start + 8 + n > end:
            raise _bad(path, f"no safetensors header at byte {start} (a header of {n} bytes does not fit)")
        raw = os.pread(fd, n, start + 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(path, f"the safetensors header at byte {start} is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, f"the safetensors header at byte {start} is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(path, "the safetensors __metadata__ is not a map of strings")
    data = start + 8 + n
    info = _sharding(meta, path)
    blob = Blob(path, start, end, meta, sharded=info is not None)
    top = data
    for key, e in header.items():
        try:
            dtype = _FROM_CODE[e["dtype"]]
            shape = _ints(e["shape"], None)
            a, b = _ints(e["data_offsets"], 2)
        except (KeyError, TypeError, ValueError):
            raise _bad(path, f"{key}: a malformed safetensors header entry") from None
        if shape is None or b - a != math.prod(shape) * itemsize(dtype) or data + b > end:
            raise _bad(path, f"{key}: its data_offsets {[a, b]} do not match its shape {list(shape or ())} and "
                             f"dtype {dtype}, or lie beyond the safetensors data (which ends at byte {end})")
        saved, whole = (0,) * len(shape), None
        if info is not None:
            if key not in info:
                raise _bad(path, f"{key}: not in the file's {SHARDING_INFO}")
            saved, whole = _placement(info[key], key, shape, path)
        blob.pieces.append(Piece(key, dtype, shape, data + a, b - a, saved, whole))
        top = max(top, data + b)
    spans = sorted((p.offset, p.offset + p.nbytes, p.key) for p in blob.pieces)
    for (_, b, k1), (a, _, k2) in zip(spans, spans[1:]):
        if a < b:
            raise _bad(path, f"the data of {k1} and {k2} overlap in the file")
    if info is not None:
        extra = sorted(set(info) - set(header))
        if extra:
            raise _bad(path, f"the file's {SHARDING_INFO} names tensors it does not hold: {', '.join(extra[:5])}")
    blob.end = top
    return blob


def _sharding(meta: dict, path: str) -> Optional[dict]:
    text = meta.get(SHARDING_INFO)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except ValueError as e:
        raise _bad(path, f"{SHARDING_INFO} is not JSON ({e})") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise _bad(path, f"{SHARDING_INFO} is not a map of tensor names to placements")
    return info


def _placement(entry: dict, key: str, shape: tuple, path: str) -> tuple[tuple, Optional[tuple]]:
    """``(saved_offsets, global_shape or None)`` of one sharding entry, checked against the piece's shape."""
    unknown = sorted(set(entry) - {SAVED_OFFSETS, GLOBAL_SHAPE})
    if unknown:  # e.g. a mapping of physical keys to other names: what the piece is would be guessed
        raise IncompleteCheckpointError(
            f"{key}: its {SHARDING_INFO} entry has fields ckptlib does not know ({', '.join(unknown)}), so where the "
            "piece belongs cannot be proven", path=path,
            hint="a newer torch wrote it: load it with that torch, or save it again with torch 2.13's writers")
    saved = _ints(entry.get(SAVED_OFFSETS), len(shape))
    if saved is None:
        raise _bad(path, f"{key}: its saved_offsets {entry.get(SAVED_OFFSETS)!r} are not {len(shape)} "
                         "non-negative integers")
    whole = None
    if GLOBAL_SHAPE in entry:
        whole = _ints(entry[GLOBAL_SHAPE], len(shape))
        if whole is None:
            raise _bad(path, f"{key}: its global_shape {entry[GLOBAL_SHAPE]!r} is not {len(shape)} non-negative "
                             "integers")
        if any(o + s > g for o, s, g in zip(saved, shape, whole)):
            raise _bad(path, f"{key}: the piece of shape {list(shape)} at {list(saved)} reaches beyond its "
                             f"global_shape {list(whole)}")
    return saved, whole


def starts_safetensors(path: str, at: int) -> bool:
    """Whether the bytes at ``at`` of ``path`` look like a safetensors header (an 8-byte length, then ``{``),
    not a zip archive (``PK``): a quick look before :func:`read_blob` reads the header."""
    try:
        with open(path, "rb") as f:
            f.seek(at)
            head = f.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and not head.startswith(b"PK")


def has_sharding_info(path: str) -> bool:
    """Whether the safetensors file at ``path`` carries DCP's ``DCP_SHARDING_INFO`` (reads its header)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return False
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                return False
            meta = json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return False
    return isinstance(meta, dict) and SHARDING_INFO in meta


def sharding_metadata(placements: dict) -> dict:
    """The ``__metadata__`` DCP writes for a safetensors file holding ``placements`` (``{key: saved_offsets}``):
    ``DCP_SHARDING_INFO`` as ``json.dumps`` writes it, ``DCP_VERSION`` and ``format``."""
    info = {k: {SAVED_OFFSETS: list(v)} for k, v in placements.items()}
    return {SHARDING_INFO: json.dumps(info), VERSION_KEY: HF_VERSION, FORMAT_KEY: "pt"}


__all__ = ["Piece", "Blob", "read_blob", "starts_safetensors", "has_sharding_info", "sharding_metadata",
           "SHARDING_INFO", "VERSION_KEY", "SAVED_OFFSETS", "GLOBAL_SHAPE", "HF_VERSION"]
