"""``HuggingFaceStorageWriter``'s folders (torch 2.13), read and planned as plain data.

What torch 2.13 writes (seen on files it wrote, FSDP2 at 2 and 3 ranks on the CPU):

- consolidated (``HuggingFaceStorageWriter(path)``, a full state dict on rank 0): ``model-0000i-of-0000N.safetensors``
  (which file holds a key: the writer's ``fqn_to_index_mapping``, else one file) and
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": tensor bytes}, "weight_map": {key: file}}``); each
  file's ``__metadata__`` carries DCP's sharding info with zero offsets (:mod:`.sharding`);
- sharded (``save_distributed=True``): per rank ``r`` (1-based) ``shard-0000r-model-0000i-of-0000N.safetensors``
  with the rank's pieces (FSDP2's ``Shard(0)`` rows; a replicated tensor such as a buffer once, on one rank; an
  empty piece where a rank holds no rows, except where another rank wrote one at the same offset), each placed by
  its ``saved_offsets``; no index, no ``.metadata``, no full sizes (torch's reader takes the largest
  ``offset + size``).

No value (a param group, a number) can go in: the writer would put its bytes before the safetensors header. So
these folders hold a model's tensors under their state-dict keys, nothing of an optimizer.

:func:`read_hf_storage` makes a :class:`~.metadata.DcpMetadata` of such a folder from its headers; how the pieces
tile each tensor is proven when the tensor is read (:mod:`ckptlib.dcp.tiling`). :func:`plan_hf_storage` lays out
the files ckptlib writes in either form.

Memory: the headers.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Sequence

from ...errors import IncompleteCheckpointError
from ...layout.ranges import slice_ranges
from ...plan import TextFile, WeightsFile
from ..stformat import SafetensorsLayout, TensorSpec
from .metadata import Chunk, DcpMetadata, TensorEntry
from .sharding import HF_VERSION, read_blob, sharding_metadata

INDEX = "model.safetensors.index.json"
SUFFIX = ".safetensors"
MODEL_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
SHARD_FILE = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
HF, HF_SHARDED = "hf", "hf-sharded"


def file_name(index: int, count: int, shard: Optional[int] = None) -> str:
    """A file's name as the writer gives it (1-based ``index`` of ``count`` files; ``shard``: the 1-based rank)."""
    name = f"model-{index:05d}-of-{count:05d}{SUFFIX}"
    return name if shard is None else f"shard-{shard:05d}-{name}"


def storage_files(folder: os.PathLike) -> list[Path]:
    """The safetensors files of the folder (all of them, as torch's ``HuggingFaceStorageReader`` reads them)."""
    return sorted(p for p in Path(folder).iterdir() if p.name.endswith(SUFFIX) and p.is_file())


def _refuse(folder, what: str, hint: str = "copy the folder again, or save it again") -> IncompleteCheckpointError:
    return IncompleteCheckpointError(what, path=os.fspath(folder), hint=hint)


def _check_names(folder: Path, names: list[str]) -> str:
    """The storage form the file names say (``hf`` or ``hf-sharded``); a missing file of the set is refused."""
    shards = [SHARD_FILE.match(n) for n in names]
    if names and all(shards):
        ranks = {int(m.group(1)) for m in shards}
        counts = {int(m.group(3)) for m in shards}
        missing = [r for r in range(1, max(ranks) + 1) if r not in ranks]
        if missing:
            raise _refuse(folder, f"no file of rank {missing[0]} (shard-{missing[0]:05d}-model-*{SUFFIX}) beside "
                                  f"those of ranks {', '.join(map(str, sorted(ranks)))}: the pieces that rank "
                                  "saved are missing")
        if len(counts) > 1:
            raise _refuse(folder, f"the shard files say {' and '.join(map(str, sorted(counts)))} model files: they "
                                  "are of two saves")
        n, indices = counts.pop(), {int(m.group(2)) for m in shards}
        gone = [i for i in range(1, n + 1) if i not in indices]
        if gone or max(indices) > n:
            raise _refuse(folder, f"no rank wrote file {gone[0] if gone else max(indices)} of {n} "
                                  f"(shard-*-{file_name(gone[0] if gone else max(indices), n)}): its tensors are "
                                  "missing, or the files are of two saves")
        return HF_SHARDED
    models = [MODEL_FILE.match(n) for n in names]
    if names and all(models):
        n = int(models[0].group(2))
        have = {int(m.group(1)) for m in models}
        gone = [i for i in range(1, n + 1) if i not in have]
        if gone or any(int(m.group(2)) != n for m in models):
            raise _refuse(folder, f"{file_name(gone[0], n) if gone else 'a file'} of the {n} files is missing "
                                  "(or the files are of two saves)")
    return HF


def read_hf_storage(folder: os.PathLike) -> DcpMetadata:
    """The tensors of a ``HuggingFaceStorageWriter`` folder, from its safetensors headers (and index).

    Each key becomes a :class:`TensorEntry` whose chunks are its pieces (raw bytes), in the order the index lists
    the keys (else the files'). Its size is the pieces' ``global_shape`` where recorded (all must agree), else the
    largest ``offset + size`` of its pieces, as torch's reader rebuilds it (``notes`` says which).

    Raises:
        IncompleteCheckpointError: a file of the set missing, a header that does not read, pieces of one key
            in two dtypes or ranks, global shapes that disagree, an index that does not match the files.
    """
    folder = Path(folder)
    files = storage_files(folder)
    storage = _check_names(folder, [f.name for f in files])
    pieces: dict = {}
    versions = set()
    for f in files:
        blob = read_blob(os.fspath(f))
        if blob.sharded:
            versions.add(blob.version)
        for p in blob.pieces:
            pieces.setdefault(p.key, []).append((f.name, p))
    index = _read_index(folder, storage, pieces)
    order = list(index) + [k for k in pieces if k not in index]
    entries, extents = [], []
    for key in order:
        found = pieces[key]
        kinds = {(p.dtype, len(p.shape)) for _, p in found}
        if len(kinds) > 1:
            raise _refuse(folder, f"{key}: its pieces are of {len(kinds)} dtypes or ranks "
                                  f"({', '.join(sorted(f'{d} {n}-D' for d, n in kinds))}) in "
                                  f"{', '.join(sorted({n for n, _ in found}))}")
        wholes = {p.global_shape for _, p in found if p.global_shape is not None}
        if len(wholes) > 1:
            raise _refuse(folder, f"{key}: its pieces record {len(wholes)} global shapes "
                                  f"({', '.join(str(list(w)) for w in sorted(wholes))}) in "
                                  f"{', '.join(sorted({n for n, _ in found}))}")
        dtype, ndim = kinds.pop()
        if wholes:
            shape = wholes.pop()
            beyond = [n for n, p in found if any(o + s > g for o, s, g in zip(p.saved_offsets, p.shape, shape))]
            if beyond:
                raise _refuse(folder, f"{key}: a piece in {beyond[0]} reaches beyond the global shape {list(shape)}")
        else:
            shape = tuple(max(p.saved_offsets[d] + p.shape[d] for _, p in found) for d in range(ndim))
            if storage == HF_SHARDED:
                extents.append(key)
        chunks = [Chunk(p.saved_offsets, p.shape, name, p.offset, p.nbytes, raw=True) for name, p in found]
        entries.append(TensorEntry(key, dtype, shape, chunks))
    notes = []
    if extents:
        ranks = len({m.group(1) for m in (SHARD_FILE.match(f.name) for f in files) if m})
        notes.append(f"{len(extents)} tensors' sizes are the largest offset + size of their pieces, in the files of "
                     f"{ranks} ranks (shard-00001 to shard-{ranks:05d}; torch 2.13 records no global_shape): the "
                     "pieces are proven to tile those sizes exactly once, but a missing last rank's files, or rows no rank "
                     "saved at a tensor's end, cannot be told from a smaller tensor")
    return DcpMetadata(entries=entries, version=versions.pop() if len(versions) == 1 else None, storage=storage,
                       described_by=[INDEX] if (folder / INDEX).is_file() else [], notes=notes)


def _read_index(folder: Path, storage: str, pieces: dict) -> dict:
    """The index's ``weight_map`` (``{}`` without one), checked against the files' headers: every key in the file
    the index names, nothing the files do not hold, ``total_size`` their tensor bytes."""
    path = folder / INDEX
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise _refuse(path, f"not an index with a weight_map ({type(e).__name__})") from None
    if storage == HF_SHARDED:
        return {}  # the sharded form has none; one beside it is not this save's
    for key, found in pieces.items():
        names = sorted({n for n, _ in found})
        if weight_map.get(key) not in names or len(names) > 1:
            raise _refuse(path, f"{key} is in {', '.join(names)}; the index says "
                                f"{weight_map.get(key) or 'nothing of it'}")
    gone = [k for k in weight_map if k not in pieces]
    if gone:
        raise _refuse(path, f"the index names {len(gone)} tensors no file holds ({', '.join(gone[:3])})")
    total = (data.get("metadata") or {}).get("total_size")
    held = sum(p.nbytes for found in pieces.values() for _, p in found)
    if total is not None and total != held:
        raise _refuse(path, f"the index's total_size is {total}; the files hold {held} bytes of tensors")
    return weight_map


# ============================================================================================ writing
def _file_indices(tensors: Sequence, limit: int) -> list[int]:
    """The 1-based file of each tensor: in order, a new file when the next tensor would pass ``limit`` bytes."""
    out, size, index = [], 0, 1
    for t in tensors:
        if out and size and size + t.nbytes > limit:
            index, size = index + 1, 0
        out.append(index)
        size += t.nbytes
    return out


def _rows(n: int, ranks: int, rank: int) -> tuple[int, int]:
    """FSDP2's ``Shard(0)`` rows of rank ``rank`` (0-based) of ``ranks``: ``torch.chunk``'s, empty past the end."""
    per = -(-n // ranks)
    return min(rank * per, n), min((rank + 1) * per, n)


def plan_hf_storage(tensors: Sequence, *, sharded: bool, ranks: int, limit: int,
                    sharded_kinds: tuple = ("trainable", "frozen", "tied")) -> tuple[list, list, DcpMetadata]:
    """The files of a ``HuggingFaceStorageWriter`` folder holding ``tensors`` (planned tensors, in state-dict order,
    named by their keys), as torch 2.13 writes it: ``(files, finals, metadata)``.

    Consolidated: ``model-0000i-of-0000N.safetensors`` (at most ``limit`` tensor bytes each, as an
    ``fqn_to_index_mapping`` would put them) and the index. ``sharded``: per rank ``r`` of ``ranks``, the rows FSDP2
    would give it of each tensor of ``sharded_kinds`` (its parameters) and, on rank 1, the other tensors (buffers)
    and 0-dim ones whole, in ``shard-0000r-model-0000i-of-0000N.safetensors``; no index. Every file carries DCP's
    sharding info. Metadata only.
    """
    indices = _file_indices(tensors, limit)
    count = max(indices, default=1)
    layout: dict = {}  # file name -> [(tensor, saved offsets)]
    for t, i in zip(tensors, indices):
        if not sharded:
            layout.setdefault(file_name(i, count), []).append((t, (0,) * len(t.shape)))
            continue
        if t.kind not in sharded_kinds or not t.shape or ranks == 1:
            layout.setdefault(file_name(i, count, 1), []).append((t, (0,) * len(t.shape)))
            continue
        row = t.numel // t.shape[0] if t.shape[0] else 0
        for r in range(ranks):
            a, b = _rows(t.shape[0], ranks, r)
            if b > a:
                piece = type(t)(t.name, t.source, t.key, t.kind, (b - a,) + tuple(t.shape[1:]), t.dtype,
                                tuple(slice_ranges(t.ranges, a * row, (b - a) * row)))
                layout.setdefault(file_name(i, count, r + 1), []).append((piece, (a,) + (0,) * (len(t.shape) - 1)))
    files, chunks = [], {}
    for name in sorted(layout):
        held = layout[name]
        meta = sharding_metadata({t.name: saved for t, saved in held})
        st = SafetensorsLayout([TensorSpec(t.name, t.dtype, t.shape) for t, _ in held], meta)
        files.append(WeightsFile(name, "safetensors", [t for t, _ in held], meta, kind="dcp", size=st.file_size))
        for t, saved in held:
            chunks.setdefault(t.name, []).append(Chunk(saved, tuple(t.shape), name, st.tensor_offset(t.name), t.nbytes,
                                                       raw=True))
    entries = [TensorEntry(t.name, t.dtype, tuple(t.shape), chunks.get(t.name, [])) for t in tensors]
    finals = []
    if not sharded:
        weight_map = {t.name: file_name(i, count) for t, i in zip(tensors, indices)}
        text = json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map},
                          indent=2)
        finals.append(TextFile(INDEX, text, kind="dcp"))
    md = DcpMetadata(entries=entries, version=HF_VERSION, storage=HF_SHARDED if sharded else HF,
                     described_by=[] if sharded else [INDEX])
    return files, finals, md


__all__ = ["INDEX", "MODEL_FILE", "SHARD_FILE", "HF", "HF_SHARDED", "file_name", "storage_files", "read_hf_storage",
           "plan_hf_storage"]
