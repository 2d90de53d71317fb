"""One DCP checkpoint (a folder, or Accelerate's pair of folders) known from its ``.metadata`` files.

Memory: the metadata (a few hundred bytes per entry); chunk archives are parsed (a few hundred bytes
each) only when a tensor's ranges are asked for.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from ..errors import CkptError, IncompleteCheckpointError, NotACheckpointError
from ..io.dcp import BytesEntry, DcpMetadata, TensorEntry
from ..io.dcp.hfstorage import MODEL_FILE, SHARD_FILE, read_hf_storage, storage_files
from ..io.dcp.reader import METADATA, chunk_ranges, read_folder_metadata, read_value
from ..io.dcp.sharding import has_sharding_info
from ..io.sources import SourceFiles, stamp
from ..io.streaming import first_difference
from ..layout.ranges import range_starts, slice_ranges
from .tiling import TilingError, tile

ACCELERATE_FOLDERS = ("pytorch_model_fsdp_0", "optimizer_0")
HF_LAYOUT = "hf"  # HuggingFaceStorageWriter's folders: the keys as written, each a model tensor
STORAGE_WORDS = {"torch": "torch.save items (FileSystemWriter's default)",
                 "safetensors": "safetensors data in the .distcp files (FileSystemWriter(serialization_format="
                                "SAFETENSORS)), read from their headers",
                 "hf": "HuggingFaceStorageWriter's consolidated safetensors files (model-*-of-*.safetensors)",
                 "hf-sharded": "HuggingFaceStorageWriter's per-rank safetensors files (save_distributed=True: "
                               "shard-*-model-*-of-*.safetensors), pieces joined by their saved_offsets"}


@dataclass
class DcpTensor:
    """A tensor of the checkpoint: its flattened ``key``, the DCP folder it is in (``folder``, relative),
    dtype, full shape, and the parameter it belongs to: ``name`` (its FQN) and ``state`` (None for the
    model's own tensor, else the optimizer state key)."""

    key: str
    folder: str
    dtype: str
    shape: tuple
    name: str
    state: Optional[str] = None
    entry: Any = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def is_dcp(path: os.PathLike) -> bool:
    """Whether ``path`` is a DCP folder (a ``.metadata`` in it), an Accelerate FSDP save dir, or a folder
    ``HuggingFaceStorageWriter`` wrote (safetensors files carrying DCP's sharding info, no DeepSpeed ``latest``;
    reads one file's header). A Hugging Face folder ``save_pretrained`` wrote has no sharding info: it is an
    export, not this."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / METADATA).is_file() or (p / ACCELERATE_FOLDERS[0] / METADATA).is_file():
        return True
    return is_hf_storage(p)


def is_hf_storage(p: Path) -> bool:
    """Whether the folder ``p`` holds ``HuggingFaceStorageWriter`` files (see :func:`is_dcp`)."""
    if (p / "latest").is_file():
        return False
    try:
        files = storage_files(p)
    except OSError:
        return False
    if any(SHARD_FILE.match(f.name) for f in files):  # only DCP names files so
        return True
    named = [f for f in files if MODEL_FILE.match(f.name)] or files
    return bool(named) and has_sharding_info(os.fspath(named[0]))


def _split(md: DcpMetadata, e, layout: str) -> tuple[str, Optional[str]]:
    """``(parameter name, state key or None)`` of a flattened key, from the path it was flattened from."""
    if layout == HF_LAYOUT:  # no nesting recorded: every key a tensor of the model, as written
        return e.fqn, None
    path = md.planner_data.get(e.fqn)
    if path and path[0] == "model" and len(path) == 2:
        return str(path[1]), None
    if path and path[0] == "optimizer" and len(path) == 4 and path[1] == "state":
        return str(path[2]), str(path[3])
    if path and path[0] == "optimizer" and len(path) == 2 and str(path[1]).startswith("state."):
        name, _, key = str(path[1])[len("state."):].rpartition(".")
        return name, key
    key = e.fqn
    if key.startswith("optimizer.state."):
        name, _, state = key[len("optimizer.state."):].rpartition(".")
        return name, state
    if layout != "torchtitan" and key.startswith("model."):
        return key[len("model."):], None
    return key, None


class DcpFolder:
    """A DCP checkpoint: ``path``, ``layout`` (``torch``, ``torchtitan``, ``accelerate``, ``hf`` for a folder
    ``HuggingFaceStorageWriter`` wrote, whose keys are the model's, or ``dcp`` for other key layouts), ``storage``
    (:data:`~ckptlib.io.dcp.metadata.STORAGES`), ``metadata`` per DCP folder (``""`` for ``path`` itself), its
    tensors and values."""

    def __init__(self, path: Path):
        self.path = path
        if (path / ACCELERATE_FOLDERS[0] / METADATA).is_file():
            self.layout = "accelerate"
            folders = [f for f in ACCELERATE_FOLDERS if (path / f / METADATA).is_file()]
        else:
            folders = [""]
            self.layout = "dcp"
        if self.layout == "dcp" and not (path / METADATA).is_file():  # HuggingFaceStorageWriter's: keys as written
            self.metadata = {"": read_hf_storage(path)}
            self.layout = HF_LAYOUT
        else:
            self.metadata = {f: read_folder_metadata(path / f) for f in folders}
        self.storage = next(iter(self.metadata.values())).storage
        if self.layout == "dcp":
            keys = [e.fqn for e in self.metadata[""].entries]
            if any(k.startswith("model.") for k in keys):
                self.layout = "torch"
            elif any(k.startswith("optimizer.param_groups.") and not k.split(".")[2].isdigit() for k in keys):
                self.layout = "torchtitan"
        self.tensors: dict[str, DcpTensor] = {}
        self.values: dict[str, tuple] = {}
        for folder, md in self.metadata.items():
            for e in md.entries:
                if e.fqn in self.tensors or e.fqn in self.values:
                    raise CkptError(f"the key {e.fqn} is in two DCP folders", path=os.fspath(path))
                if isinstance(e, TensorEntry):
                    name, state = _split(md, e, self.layout)
                    self.tensors[e.fqn] = DcpTensor(e.fqn, folder, e.dtype, tuple(e.shape), name, state, e)
                else:
                    self.values[e.fqn] = (folder, e)

    # ------------------------------------------------------------------ what it holds
    @cached_property
    def model(self) -> dict:
        """``{parameter or buffer name: DcpTensor}`` of the model's own tensors."""
        return {t.name: t for t in self.tensors.values() if t.state is None}

    @cached_property
    def states(self) -> dict:
        """``{(parameter name, state key): DcpTensor}`` of the optimizer's per-parameter tensors."""
        return {(t.name, t.state): t for t in self.tensors.values() if t.state is not None}

    @property
    def files(self) -> list[Path]:
        out = []
        for folder, md in self.metadata.items():
            out += [self.path / folder / n for n in md.described_by]
            if self.layout == HF_LAYOUT:
                out += storage_files(self.path)
                continue
            names = {c.file for e in md.tensors for c in e.chunks} | {e.file for e in md.values}
            out += [self.path / folder / n for n in sorted(names)]
        return out

    @property
    def notes(self) -> list[str]:
        """What a reader should know of how the folder was read (the storage, how sizes were found)."""
        out = [] if self.storage == "torch" else [f"storage: {STORAGE_WORDS[self.storage]}"]
        return out + [n for md in self.metadata.values() for n in md.notes]

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files if p.is_file())

    def stamps(self) -> tuple:
        return tuple(stamp(os.fspath(p)) for p in self.files)

    def value(self, key: str) -> Any:
        """The Python value stored under ``key`` (unpickled safely)."""
        folder, e = self.values[key]
        return read_value(self.path / folder, e)

    # ------------------------------------------------------------------ bytes
    def sources(self, t: DcpTensor) -> list:
        """The stored ranges that, concatenated, give ``t``'s full value flattened in row-major order. Where pieces
        overlap (a replicated piece stored twice), the overlapping bytes are read and must be equal.

        Memory: the ranges; comparing overlaps, two streaming chunks (1 MiB).

        Raises:
            IncompleteCheckpointError: the pieces leave a hole, reach outside the tensor, or overlap with different
                bytes (naming the files), or an archive is damaged.
        """
        ranges, overlaps = self.pieces(t)
        prove_overlaps(t.key, t.dtype, overlaps, os.fspath(self.path / t.folder))
        return ranges

    def pieces(self, t: DcpTensor) -> tuple[list, list]:
        """``(ranges, overlaps)``: the stored ranges of ``t``'s full value (each element from the first piece
        holding it), and per further piece over elements already given, ``(what, first ranges, its ranges)``, which
        must hold the same bytes (not read here: :meth:`sources` compares them; ``ckpt check`` reports them).

        Raises:
            IncompleteCheckpointError: the pieces leave a hole or reach outside the tensor (naming the files), or an
                archive is damaged.
        """
        folder = self.path / t.folder
        e: TensorEntry = t.entry
        if len(e.chunks) == 1 and tuple(e.chunks[0].sizes) == tuple(e.shape):
            return chunk_ranges(folder, e, e.chunks[0]), []
        try:
            order, again = tile(e.shape, [(c.offsets, c.sizes) for c in e.chunks], t.key)
        except TilingError as err:
            files = sorted({e.chunks[i].file for i in err.chunks}) or sorted({c.file for c in e.chunks})
            raise IncompleteCheckpointError(f"{err}; pieces in {', '.join(files)}", path=os.fspath(folder),
                                            hint="the save is incomplete or its files are of different saves: copy "
                                                 "it again, or save it again") from None
        local: dict = {}

        def of(chunk: int, start: int, count: int) -> list:
            if chunk not in local:
                ranges = chunk_ranges(folder, e, e.chunks[chunk])
                local[chunk] = (ranges, range_starts(ranges))
            ranges, starts = local[chunk]
            return slice_ranges(ranges, start, count, starts)

        out: list = []
        for r in order:
            out += of(r.chunk, r.local, r.count)
        overlaps = []
        if again:
            starts = range_starts(out)
            for r in again:
                first = slice_ranges(out, r.start, r.count, starts)
                what = f"elements {r.start}-{r.start + r.count - 1} of the piece in {e.chunks[r.chunk].file}"
                overlaps.append((what, first, of(r.chunk, r.local, r.count)))
        return out, overlaps

    def __repr__(self) -> str:
        return f"DcpFolder({os.fspath(self.path)!r}, {self.layout}, {len(self.model)} model tensors, " \
               f"{len(self.states)} optimizer tensors)"


def prove_overlaps(key: str, dtype: str, overlaps: list, where: str) -> None:
    """Read and compare each overlap of :meth:`DcpFolder.pieces` (two streaming chunks at a time).

    Raises:
        IncompleteCheckpointError: two pieces hold different bytes for the same elements, naming their files.
    """
    if not overlaps:
        return
    with SourceFiles() as files:
        for what, first, again in overlaps:
            at = first_difference(first, again, dtype, files, chunk_bytes=1 << 20)
            if at is not None:
                names = sorted({os.path.basename(r.path) for r in list(first) + list(again) if hasattr(r, "path")})
                raise IncompleteCheckpointError(
                    f"{key}: two pieces hold different values for the same elements ({what} differs from the piece "
                    f"read first at its element {at}); pieces in {', '.join(names)}", path=where,
                    hint="the files are of different saves, or one is damaged: copy the folder again, or save it "
                         "again")


def open_dcp(path: os.PathLike) -> DcpFolder:
    """Open the DCP checkpoint at ``path`` (metadata only).

    Raises:
        NotACheckpointError: no ``.metadata`` there. UnsafeCheckpointError, IncompleteCheckpointError.
    """
    p = Path(path).expanduser().resolve()
    if not is_dcp(p):
        raise NotACheckpointError("not a torch.distributed.checkpoint folder (no .metadata, no safetensors files with "
                                  "DCP's sharding info)", path=os.fspath(p))
    return DcpFolder(p)


__all__ = ["DcpFolder", "DcpTensor", "is_dcp", "is_hf_storage", "open_dcp", "prove_overlaps", "BytesEntry",
           "HF_LAYOUT", "STORAGE_WORDS"]
