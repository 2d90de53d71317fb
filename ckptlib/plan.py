"""Plans as plain data: what a run reads and writes, decided from metadata before any byte moves.

A plan names its source (:class:`SourceRef`: folders, a summary, and a stamp of every file, so a run
can tell whether the checkpoint changed since), its output folder and the files to write:

- :class:`WeightsFile` — a safetensors or torch file of named tensors (an export's shards; a merge's
  :class:`MergedTensor` s among them, an average's :class:`AveragedTensor` s);
- :class:`TreeFile` — a torch file written from an object tree whose tensors are plain specs
  (:mod:`ckptlib.io.torchzip.specs`; a reshard's rank files, a universal checkpoint's fragments);
- :class:`CopyFile` — a file copied as it is;
- :class:`DistcpFile`, :class:`BlobFile` — a DCP folder's ``.distcp`` files and its ``.metadata``;
- :class:`TextFile` — small text written after everything else, in order (``latest``, index files).

Every tensor's bytes are a range list (:mod:`ckptlib.layout.ranges`): file paths and byte offsets, read only
when the file is written. There is no open file, lock, closure or live context in a plan: it pickles,
prints, and runs in another process as it is (:mod:`ckptlib.execute`). Nothing here does I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

from .dtypes import Shaped
from .layout.ranges import numel, stored_bytes
from .units import human_bytes

THREADS, PROCESSES = "threads", "processes"
DEFAULT_CHUNK_BYTES = 16 * 2**20
FIXED_OVERHEAD_BYTES = 8 * 2**20  # allowance for the plan's object trees, the cast scratch and bookkeeping


def predicted_peak_bytes(chunk_bytes: int, threads: int = 1) -> int:
    """What a streaming run adds to a process: each writing thread's chunk buffers (two read-ahead, one
    cast; storage copies use the same: :class:`ckptlib.io.streaming.ChunkBuffers`) plus a fixed allowance."""
    return threads * 3 * chunk_bytes + FIXED_OVERHEAD_BYTES


@dataclass(frozen=True)
class SourceRef:
    """The checkpoint a plan reads, as plain data: where it is, what it is, and a ``(path, size, mtime_ns)``
    stamp of each of its files."""

    save_dir: str
    tag: str
    tag_dir: str
    zero_stage: Optional[int]
    flavor: str
    dtype: Optional[str]
    dp_world_size: Optional[int]
    partition_count: Optional[int]
    total_bytes: int
    stamps: tuple = ()
    tp_rules: Any = None  # how a tensor-parallel source without universal_checkpoint_info joins (SplitRules)
    model_type: Optional[str] = None  # an AutoEP source read in the layout of this transformers model type

    @property
    def ranks(self) -> Optional[int]:
        """The data-parallel size it was saved with."""
        return self.partition_count or self.dp_world_size



@dataclass
class PlannedTensor(Shaped):
    """One output tensor of an export and where its bytes come from (``ranges``, see :mod:`ckptlib.layout.ranges`)."""

    name: str                 # key in the output state dict
    source: str               # parameter or buffer name in the checkpoint
    key: Optional[str]        # optimizer state key, or None for weights/buffers
    kind: str                 # "trainable", "frozen", "tied", "buffer" or "state"
    shape: tuple
    dtype: str                # output dtype name
    ranges: tuple = field(default=(), repr=False)

    def __post_init__(self):  # every element written is accounted for by the plan's sources (exact or refuse)
        if numel(self.ranges) != self.numel:
            raise ValueError(f"planned tensor {self.name} of shape {list(self.shape)} has {self.numel} elements; its "
                             f"source ranges hold {numel(self.ranges)}")

    @property
    def read_bytes(self) -> int:
        return stored_bytes(self.ranges)


@dataclass
class Factor:
    """A tensor a merged tensor is computed from, read whole (the checkpoint's fp32 master, ``source`` its name):
    ``role`` ``"A"``, ``"B"`` (a LoRA module's factors, an embedding's too), ``"magnitude"`` (DoRA's),
    ``"bias"`` (a trained bias, taking the base's place) or ``"lora_bias"`` (``lora_B``'s bias, added)."""

    role: str
    source: str
    shape: tuple
    ranges: tuple = field(default=(), repr=False)

    @property
    def read_bytes(self) -> int:
        return stored_bytes(self.ranges)


@dataclass
class MergedTensor(Shaped):
    """One output tensor of a merge (:func:`ckptlib.plan_merge`): a base model's tensor (``ranges``: where the base
    file stores it) with a peft module's change merged into it, as peft's ``merge_and_unload()`` computes it:
    ``how`` is ``"linear"`` (``W + scaling · B @ A``), ``"embedding"`` or ``"conv1d"`` (``W + (scaling · B @ A)ᵀ``, a
    Conv1D's weight being stored ``[in, out]``), ``"dora"`` (rescaled row by row to the magnitude), ``"dora_embedding"``
    or ``"dora_conv1d"`` (column by column) or ``"bias"`` (the trained bias, plus ``scaling · lora_B.bias``); the base
    is rounded to ``merge_dtype`` first (``"float32"``: merged on the fp32 base) and the result is ``dtype``.
    Plain data: the arithmetic runs when the file is written (:mod:`ckptlib.io.lora_merge`)."""

    name: str
    shape: tuple
    dtype: str
    how: str
    merge_dtype: str
    scaling: float
    factors: tuple = ()
    ranges: tuple = field(default=(), repr=False)
    kind: str = "merged"
    key: Optional[str] = None

    def __post_init__(self):
        if numel(self.ranges) != self.numel:
            raise ValueError(f"merged tensor {self.name} of shape {list(self.shape)} has {self.numel} elements; its "
                             f"base ranges hold {numel(self.ranges)}")

    @property
    def read_bytes(self) -> int:
        return stored_bytes(self.ranges) + sum(f.read_bytes for f in self.factors)


@dataclass
class AveragedTensor(Shaped):
    """One output tensor of an average of checkpoints (:func:`ckptlib.plan_average`): ``Σ w_i · x_i`` over the
    ``terms`` ``((w_i, ranges_i), ...)``, in the order given, each ``ranges_i`` one source's value of the same
    elements (stored ranges and zeros, ``numel`` elements each). Every element is accumulated in float64 (``acc =
    w_1·x_1``, then ``acc = acc + w_i·x_i``; each product and sum rounded to float64), rounded to float32, then cast
    to ``dtype`` where that is not float32. Plain data: the arithmetic runs, chunk by chunk, when the file is
    written (:mod:`ckptlib.io.averaging`). ``source``: the parameter it averages."""

    name: str
    shape: tuple
    dtype: str
    terms: tuple = field(default=(), repr=False)
    source: str = ""
    kind: str = "averaged"
    key: Optional[str] = None

    def __post_init__(self):
        for i, (_, ranges) in enumerate(self.terms):
            if numel(ranges) != self.numel:
                raise ValueError(f"averaged tensor {self.name} of shape {list(self.shape)} has {self.numel} "
                                 f"elements; the ranges of source {i + 1} hold {numel(ranges)}")

    @property
    def weights(self) -> tuple:
        return tuple(w for w, _ in self.terms)

    @property
    def ranges(self) -> tuple:
        """None of its own: its bytes are computed from ``terms`` (nothing is copied as stored)."""
        return ()

    @property
    def read_bytes(self) -> int:
        return sum(stored_bytes(r) for _, r in self.terms)


@dataclass
class WeightsFile:
    """A safetensors or torch file holding ``tensors`` in this order (``metadata``: safetensors' header
    ``__metadata__``; ``size``: the file's exact size, header and framing included, when the planner
    computed it)."""

    name: str
    format: str               # "safetensors" or "torch"
    tensors: list
    metadata: dict = field(default_factory=dict)
    kind: str = "weights"
    size: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    write_bytes = nbytes

    @property
    def read_bytes(self) -> int:
        return sum(t.read_bytes for t in self.tensors)


@dataclass
class TreeFile:
    """A torch file written from the object tree ``obj`` (``kind`` says what it is for the user;
    ``rank`` and ``source_ranks``: the target rank it is for, and the source ranks whose bytes it reads;
    ``write_bytes``: the tensor bytes streamed into it; ``size``: the file's exact size, pickle and zip
    framing included; ``rewrites``: the source file whose tree it writes again unchanged, in the zip format, when
    it is a file in torch's legacy serialization carried over, see :func:`ckptlib.reshard.trees.carried`)."""

    name: str
    kind: str
    obj: Any = field(repr=False)
    read_bytes: int = 0
    write_bytes: int = 0
    rank: Optional[int] = None
    source_ranks: list = field(default_factory=list)
    size: Optional[int] = None
    rewrites: Optional[str] = None


@dataclass
class CopyFile:
    """A file copied byte for byte from ``source``."""

    name: str
    source: str
    write_bytes: int
    kind: str = "copy"
    rank: Optional[int] = None
    source_ranks: list = field(default_factory=list)
    obj: Any = None

    @property
    def read_bytes(self) -> int:
        return self.write_bytes

    @property
    def size(self) -> int:
        return self.write_bytes


@dataclass
class DistcpFile:
    """A DCP ``.distcp`` file: ``items`` (:class:`ckptlib.io.dcp.Item`: a key, a tensor spec or a plain value,
    and its offset and length in the file), each written as a whole ``torch.save`` archive at its offset;
    ``size``: the file's exact size."""

    name: str
    items: list
    size: int
    kind: str = "distcp"
    rank: Optional[int] = None

    @property
    def write_bytes(self) -> int:
        return sum(it.nbytes for it in self.items)

    @property
    def read_bytes(self) -> int:
        return sum(it.value.read_bytes for it in self.items if it.is_tensor)


@dataclass
class BlobFile:
    """A small binary file written as it is (a DCP ``.metadata`` pickle)."""

    name: str
    data: bytes = field(repr=False)
    kind: str = "metadata"
    read_bytes: int = 0
    write_bytes: int = 0
    rank: Optional[int] = None

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class TextFile:
    """Small text written once everything else is (in the order of the plan's ``finals``)."""

    name: str
    text: str
    kind: str = "text"

    @property
    def size(self) -> int:
        return len(self.text.encode())


@dataclass
class RangeCheck:
    """Two range lists that must hold the same bytes (as ``dtype``), e.g. a tensor replicated on several
    tensor ranks; a run compares them before it writes anything and stops, naming ``what``, if they differ."""

    what: str
    a: tuple = field(repr=False)
    b: tuple = field(repr=False)
    dtype: str = "float32"

    @property
    def read_bytes(self) -> int:
        return stored_bytes(self.a) + stored_bytes(self.b)


@dataclass(kw_only=True)
class Plan:
    """What every plan has. ``files`` are written first (in parallel units, see :mod:`ckptlib.execute`),
    then ``finals`` in order; ``folders`` are made before anything. ``workers`` writers run as threads
    or processes (``parallel``); each streams through three buffers of ``chunk_bytes``. With ``sync`` (the
    default) the output is on disk before it appears under its name, so even a power cut leaves it whole
    or absent; without, it appears as soon as it is written (complete, still atomically against a killed
    or failing run) and the kernel writes it to disk afterwards, as ``torch.save`` and DeepSpeed's tools do."""

    action: ClassVar[str] = "run"
    source: SourceRef
    out: Path
    files: list
    finals: list = field(default_factory=list)
    folders: list = field(default_factory=list)
    chunk_bytes: int
    workers: int = 1
    parallel: str = THREADS
    overwrite: bool = False
    sync: bool = True
    notes: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    crc: list = field(default_factory=list)  # the source's zip members (ZipEntry) whose CRC-32 the run checks
    crc_unread: int = 0  # bytes of those members the run reads for their CRC-32 alone (members read in part)
    crc_partial: int = 0  # how many members it reads in part
    crc_none: list = field(default_factory=list)  # files it reads tensor bytes from that record no CRC-32
    crc_off: bool = False  # the CRC-32 check is turned off (--no-verify-crc)

    @property
    def read_bytes(self) -> int:
        return sum(f.read_bytes for f in self.files) + sum(c.read_bytes for c in self.checks) + self.crc_unread

    @property
    def write_bytes(self) -> int:
        """Bytes of the files written in units (the text finals are not counted)."""
        return sum(f.write_bytes for f in self.files)

    @property
    def file_bytes(self) -> int:
        """The exact size of everything the run writes, every file's headers and framing and the text
        finals included (a file whose size the planner did not compute counts its tensor bytes)."""
        return sum(f.size if f.size is not None else f.write_bytes for f in self.files) + \
            sum(f.size for f in self.finals)

    @property
    def predicted_peak_bytes(self) -> int:
        """Anonymous memory a run adds to each process that writes: each writing thread's streaming
        buffers plus a fixed allowance (with processes, per process), whatever the model size."""
        return predicted_peak_bytes(self.chunk_bytes, self.workers if self.parallel == THREADS else 1)

    def summary_lines(self) -> list[str]:
        """The lines every plan's description shares: what is read and written, and the memory."""
        who = (f"{self.workers} writing thread(s), 3 streaming buffers each" if self.parallel == THREADS
               else f"per process; {self.workers} process(es), 3 streaming buffers each")
        lines = [f"{self.reads_text()}; {self.writes_text()}",
                 f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} ({who}, "
                 f"{human_bytes(self.chunk_bytes)} chunks; independent of the model size)"]
        lines += self.crc_lines()
        if not self.sync:
            lines.append("not synced: the output appears when written; the kernel puts it on disk after the run")
        return lines

    def crc_lines(self) -> list[str]:
        """What the run checks of the source's CRC-32s, and what it cannot (:mod:`ckptlib.io.crc`)."""
        if self.crc_off:
            return ["does not check the CRC-32 of the source (--no-verify-crc): damaged tensor bytes would be copied"]
        lines = []
        if self.crc:
            text = (f"checks the CRC-32 of the {len(self.crc)} zip entries it reads "
                    f"({human_bytes(sum(e.size for e in self.crc))}) as their bytes stream, before the output is put "
                    "in place")
            if self.crc_partial:
                text += (f"; {self.crc_partial} of them it reads only in part: their other "
                         f"{human_bytes(self.crc_unread)} are read for it, after the writing")
            lines.append(text)
        if self.crc_none:
            names = [Path(p).name for p in self.crc_none]
            lines.append(f"not checked: {len(names)} file{'s' if len(names) != 1 else ''} it reads record no CRC-32 "
                         f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}; torch's legacy format, NVMe "
                         "swap files, safetensors and DCP files have none)")
        return lines

    def reads_text(self) -> str:
        """``"reads 3.1 MB of the 3.1 MB in the tag folder global_step4 (+ 530 KB of other files copied as
        they are)"``: what a run reads, from where."""
        tag_dir = self.source.tag_dir.rstrip("/") + "/"
        outside = sum(f.size for f in self.files if isinstance(f, CopyFile) and not f.source.startswith(tag_dir))
        text = (f"reads {human_bytes(self.read_bytes - outside)} of the {human_bytes(self.source.total_bytes)} in "
                f"the tag folder {self.source.tag}")
        return text + (f" (+ {human_bytes(outside)} of other files copied as they are)" if outside else "")

    def writes_text(self) -> str:
        n = len(self.files) + len(self.finals)
        return f"writes {human_bytes(self.file_bytes)} in {n} file{'s' if n != 1 else ''}"

    def describe(self) -> str:
        return "\n".join([f"{self.action} {self.source.tag_dir} -> {self.out}", *self.summary_lines()])

    def _repr_pretty_(self, p, cycle):  # IPython shows the description
        p.text(self.describe())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.files)} files, {human_bytes(self.write_bytes)} -> "
                f"{str(self.out)!r})")


__all__ = ["THREADS", "PROCESSES", "SourceRef", "RangeCheck", "PlannedTensor", "WeightsFile", "TreeFile", "CopyFile",
           "DistcpFile", "BlobFile", "TextFile", "Factor", "MergedTensor", "AveragedTensor",
           "Plan"]
