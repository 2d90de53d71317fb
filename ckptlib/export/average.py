"""Averaging checkpoints of one run (``ckpt average``, :func:`plan_average`), streamed and exact.

The sources are two or more tags of one run: the same parameters (names, shapes, which are trainable, which are
tied) and buffers, each at any mesh or ZeRO stage ckptlib reads (:func:`ckptlib.open_checkpoint`;
``Checkpoint.sources(name)`` gives each tensor's stored ranges). Anything else is refused, naming the first
difference. Only the trainable parameters' masters are averaged; buffers and frozen parameters are the last
source's (the notes say so).

The weights ``w_i`` are float64 numbers, one per source in the order given:

- ``weights=(w1, w2, ...)``: as given; their sum must be 1 (to within 1e-9) unless ``normalize``, which uses
  ``w_i / Σ w`` (``Σ w`` with :func:`math.fsum`, each quotient rounded to float64);
- default, uniform: ``w_i = 1/N`` (``1.0 / N`` in float64), so the result is ``Σ (1/N)·x_i``, which is not
  ``(Σ x_i)/N``: the two round differently in a few elements;
- ``ema=DECAY`` (``d``): the exponential moving average ``e = x_1``, then ``e = d·e + (1−d)·x_i`` for each further
  source in the order given, expressed as explicit per-source weights ``w_1 = d^(N−1)`` and ``w_i = (1−d)·d^(N−i)``
  for ``i ≥ 2``; ``1−d`` is ``1.0 - d`` and ``d^k`` is ``k`` multiplications by ``d`` starting from ``1.0``, each
  rounded to float64. The average is then the weighted sum below, not the recurrence evaluated step by step.

Each output element is then the float32 rounding of ``Σ w_i·x_i`` accumulated in float64 in the order given (``acc =
w_1·x_1``, then ``acc = acc + w_i·x_i``, each product and sum rounded to float64: :mod:`ckptlib.io.averaging`),
deterministic and checkable against torch; a bf16 or fp16 output is that float32 value cast as torch casts it.

Outputs:

- ``format="safetensors"`` or ``"torch"``: as ``ckpt export`` writes (the Hugging Face layout, ``dtype``, shards up
  to ``max_shard_size`` with their index, the ``config.json`` found beside the last source with the written dtype);
- ``format="deepspeed"``: a DeepSpeed checkpoint at the last source's mesh (:mod:`.average_ds`): the last source's
  files with the averaged masters, its 16-bit module weights rounded from them, and its optimizer state and step.

The plan is plain data: each averaged tensor an :class:`~ckptlib.plan.AveragedTensor` (each source's ranges and
weight), each other one the last source's ranges; :func:`ckptlib.run` writes it (the writer computes each chunk),
:func:`ckptlib.verify` recomputes every averaged tensor from the sources opened afresh and compares it bit for bit.
Memory: the run's streaming buffers (three of ``chunk_bytes`` per writing thread), whatever the number of sources
and the model size: each output chunk reads the same chunk of every source in turn into one buffer and accumulates
it in a float64 buffer of the chunk's size.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional, Sequence, Union

from ..deepspeed import Checkpoint, hf, open_checkpoint
from ..deepspeed.exactness import require_exact, value_proofs
from ..dtypes import BY_SHORT, OUTPUT_DTYPES
from ..errors import CkptError, UnsupportedCheckpointError
from ..io.averaging import SOURCE_DTYPES, averaged_spec
from ..io.crc import attach_crc
from ..io.output import check_destination
from ..io.stformat import SafetensorsLayout, TensorSpec
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..io.torchzip.specs import NewTensor
from ..io.torchzip.writer import file_size
from ..layout.ranges import Zeros, coalesce, range_starts, slice_ranges
from ..plan import THREADS, AveragedTensor, CopyFile, Plan, RangeCheck, TextFile, WeightsFile
from ..system.gcpause import gc_paused
from ..units import human_bytes
from .plan import shard_limit
from .weights import file_names, index_json, model_tensors, shard_tensors

FORMATS = ("safetensors", "torch", "deepspeed")
#: how far given weights may sum from 1 without --normalize (decimal fractions such as 0.1 are not exact in binary)
SUM_TOLERANCE = 1e-9


# ============================================================================================ weights
def average_weights(n: int, weights: Optional[Sequence[float]] = None, ema: Optional[float] = None,
                    normalize: bool = False) -> tuple[tuple, str]:
    """``(the n float64 weights, how they were chosen)`` (see the module docstring for each rule).

    Raises:
        CkptError: fewer than two sources, weights and ``ema`` both given, a count that is not ``n``, a weight that is
            negative or not finite, a sum that is not 1 without ``normalize`` (the sum stated), a decay outside
            [0, 1]."""
    if n < 2:
        raise CkptError(f"an average needs two or more checkpoints ({n} given)",
                        hint="ckpt average SRC1 SRC2 [...] OUT")
    if weights is not None and ema is not None:
        raise CkptError("give --weights or --ema, not both")
    if ema is not None:
        d = float(ema)
        if not 0.0 <= d <= 1.0:
            raise CkptError(f"the EMA decay must lie in [0, 1] ({ema} given)", hint="e.g. --ema 0.9")
        powers = [1.0]
        for _ in range(n - 1):
            powers.append(powers[-1] * d)
        out = (powers[n - 1],) + tuple((1.0 - d) * powers[n - 1 - i] for i in range(1, n))
        return out, f"ema {d!r}"
    if weights is None:
        return tuple(1.0 / n for _ in range(n)), "uniform"
    w = tuple(float(x) for x in weights)
    if len(w) != n:
        raise CkptError(f"{len(w)} weights for {n} checkpoints", hint="give one weight per checkpoint, in their order")
    bad = [x for x in w if not math.isfinite(x) or x < 0]
    if bad:
        raise CkptError(f"a weight must be a finite number of 0 or more ({bad[0]!r} given)")
    total = math.fsum(w)
    if normalize:
        if total <= 0:
            raise CkptError("the weights sum to 0: there is nothing to normalize")
        return tuple(x / total for x in w), f"given, normalized (they summed to {total!r})"
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise CkptError(f"the weights sum to {total!r}, not 1", hint="give weights that sum to 1, or add --normalize "
                                                                     "to divide each by their sum")
    return w, f"given (sum {total!r})"


# ============================================================================================ the sources
def _label(i: int, ck: Checkpoint) -> str:
    return f"source {i + 1} ({ck.location.tag_dir})"


def check_same_run(cks: list) -> None:
    """Refuse checkpoints that do not hold the same model: the same parameters (names, shapes, trainable or frozen,
    tied to the same owner) and buffers (names, shapes) as the first, naming the first difference. Metadata only."""
    first = cks[0]
    for i, ck in enumerate(cks[1:], 1):
        a, b = _label(0, first), _label(i, ck)
        what = _first_difference(first, ck, a, b)
        if what:
            raise CkptError(f"not checkpoints of one run: {what}", path=ck.location.tag_dir,
                            hint="average tags of one run (the same model)")


def _first_difference(first: Checkpoint, ck: Checkpoint, a: str, b: str) -> Optional[str]:
    theirs = {p.name: p for p in ck.parameters}
    for p in first.parameters:
        q = theirs.get(p.name)
        if q is None:
            return f"{b} has no parameter {p.name}, which {a} has"
        if tuple(q.shape) != tuple(p.shape):
            return f"{p.name} is {list(p.shape)} in {a} and {list(q.shape)} in {b}"
        if q.trainable != p.trainable:
            return (f"{p.name} is {'trainable' if p.trainable else 'frozen'} in {a} and "
                    f"{'trainable' if q.trainable else 'frozen'} in {b}")
        if q.tied_to != p.tied_to:
            return f"{p.name} is tied to {p.tied_to or 'nothing'} in {a} and to {q.tied_to or 'nothing'} in {b}"
    mine = {p.name for p in first.parameters}
    extra = [n for n in theirs if n not in mine]
    if extra:
        return f"{b} has a parameter {extra[0]}, which {a} has not"
    theirs = {x.name: x for x in ck.buffers}
    for x in first.buffers:
        y = theirs.get(x.name)
        if y is None:
            return f"{b} has no buffer {x.name}, which {a} has"
        if tuple(y.shape) != tuple(x.shape):
            return f"the buffer {x.name} is {list(x.shape)} in {a} and {list(y.shape)} in {b}"
    mine = {x.name for x in first.buffers}
    extra = [n for n in theirs if n not in mine]
    return f"{b} has a buffer {extra[0]}, which {a} has not" if extra else None


def open_sources(sources: Sequence, tp_rules=None) -> list:
    """Each source opened (metadata only), validated for reading values (:func:`require_exact`), refused where
    ckptlib cannot average it (AutoEP's experts, which need their model class's layout), and no tag twice."""
    cks, seen = [], {}
    try:
        for s in sources:
            ck = s if isinstance(s, Checkpoint) else open_checkpoint(s, tp_rules=tp_rules)
            cks.append(ck)
            where = os.path.realpath(ck.location.tag_dir)
            if where in seen:
                raise CkptError(f"the tag {ck.location.tag} is given twice (sources {seen[where] + 1} and "
                                f"{len(cks)})", path=ck.location.tag_dir,
                                hint="give each tag once; --weights says how much each counts")
            seen[where] = len(cks) - 1
            require_exact(ck)
            if ck.records.autoep_layers:
                raise UnsupportedCheckpointError("averaging AutoEP checkpoints is not supported yet (their experts "
                                                 "are written in a model class's layout)", path=ck.location.tag_dir,
                                                 hint="`ckpt export --model-config` each tag, then average the exports")
    except BaseException:
        for s, ck in zip(sources, cks):
            if not isinstance(s, Checkpoint):
                ck.close()
        raise
    return cks


class Terms:
    """Each source's ranges of a parameter's master with its weight: the terms of an
    :class:`~ckptlib.plan.AveragedTensor` (each source's ranges found once, then sliced by binary search)."""

    def __init__(self, cks: list, weights: tuple):
        self.cks, self.weights = cks, weights
        self.stored: dict = {}  # (source, name) -> (ranges, their starts)

    def ranges(self, i: int, name: str) -> tuple:
        got = self.stored.get((i, name))
        if got is None:
            ck = self.cks[i]
            ranges = list(ck.sources(name))
            bad = next((r.dtype for r in ranges if not isinstance(r, Zeros) and r.dtype not in SOURCE_DTYPES), None)
            if bad is not None:
                raise UnsupportedCheckpointError(f"the master of {name} is stored as {bad}; ckptlib averages float32, "
                                                 "bfloat16 and float16 values", path=ck.location.tag_dir)
            got = self.stored[(i, name)] = (ranges, range_starts(ranges))
        return got

    def of(self, name: str) -> tuple:
        """``((w_i, the whole master of name in source i), ...)``."""
        return tuple((w, tuple(self.ranges(i, name)[0])) for i, w in enumerate(self.weights))

    def of_segments(self, segments) -> tuple:
        """The terms of a flat run of ``segments`` (:class:`~ckptlib.layout.flat.Segment`: a parameter's elements
        ``[param_start, param_start + count)``, or padding, zeros in every source)."""
        out = []
        for i, w in enumerate(self.weights):
            parts: list = []
            for s in segments:
                if s.is_padding:
                    parts.append(Zeros(s.count))
                else:
                    ranges, starts = self.ranges(i, s.name)
                    parts += slice_ranges(ranges, s.param_start, s.count, starts)
            out.append((w, tuple(coalesce(parts))))
        return tuple(out)


def source_checks(cks: list, averaged: Sequence, from_last: Sequence = ()) -> list:
    """Every copy the sources say must be equal (a tensor replicated on tensor ranks, a whole-parameter state on
    several data ranks) of the tensors read: the ``averaged`` masters of every source and, of the last one, the
    tensors taken ``from_last``; and ZeRO-0's value proofs: compared before anything is written."""
    checks = []
    for i, ck in enumerate(cks):
        for name in list(averaged) + (list(from_last) if i == len(cks) - 1 else []):
            checks += [RangeCheck(what, tuple(a), tuple(b), a[0].dtype if a else "float32")
                       for what, a, b in ck.replica_checks(name, None)]
        checks += value_proofs(ck)
    return checks


# ============================================================================================ the plan
@dataclass(kw_only=True, repr=False)
class AveragePlan(Plan):
    """Everything an average will do, from metadata (plain data; see :class:`ckptlib.plan.Plan`).

    Attributes:
        sources: each source (:class:`~ckptlib.plan.SourceRef`) in the order given; ``source`` is the last, with the
            stamps of every source's files (a run checks that none changed).
        weights: the float64 weight of each source; how: how they were chosen (``"uniform"``, ``"given ..."``,
            ``"ema 0.9"``).
        format: ``"safetensors"``, ``"torch"`` or ``"deepspeed"``; dtype: the written dtype of the weights (HF
            formats; ``fp32``, ``bf16``, ``fp16``).
        averaged: the parameters averaged; from_last: the tensors taken from the last source (buffers, frozen
            parameters; with ``deepspeed`` the optimizer state and step too).
        predicted_peak_bytes: the streaming buffers of each writing thread (the arithmetic works in them) plus a fixed
            allowance, whatever the number of sources and the model size.
    """

    action: ClassVar[str] = "average"
    sources: list
    weights: tuple
    how: str
    format: str
    dtype: str = "fp32"
    max_shard_size: int = 0
    averaged: list = field(default_factory=list)
    from_last: list = field(default_factory=list)
    index_files: dict = field(default_factory=dict)
    side_files: list = field(default_factory=list)
    parallel: str = THREADS

    @property
    def weight_files(self) -> list:
        """The weight files of an HF-layout output (none for ``deepspeed``)."""
        return [f for f in self.files if isinstance(f, WeightsFile)]

    @property
    def tensors(self) -> list:
        return [t for f in self.weight_files for t in f.tensors]

    def to_dict(self) -> dict:
        return {
            "sources": [s.tag_dir for s in self.sources], "weights": list(self.weights), "how": self.how,
            "out": str(self.out), "format": self.format, "dtype": self.dtype,
            "files": [{"name": f.name, "kind": f.kind, "bytes": f.size if f.size is not None else f.write_bytes}
                      for f in self.files],
            "averaged": list(self.averaged), "from_last": list(self.from_last), "index_files": self.index_files,
            "side_files": list(self.side_files), "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
            "file_bytes": self.file_bytes, "predicted_peak_bytes": self.predicted_peak_bytes, "notes": list(self.notes),
        }

    def describe(self) -> str:
        what = (f"{self.format}, {self.dtype}" if self.format != "deepspeed" else
                f"a DeepSpeed checkpoint at the last source's mesh (ZeRO-{self.source.zero_stage}, "
                f"dp {self.source.ranks})")
        lines = [f"average of {len(self.sources)} checkpoints -> {self.out}  ({what})"]
        for i, (s, w) in enumerate(zip(self.sources, self.weights)):
            lines.append(f"  {i + 1}. {s.tag_dir}  (ZeRO-{s.zero_stage}, {s.dtype}, dp {s.ranks})  weight {w!r}")
        lines += [f"weights: {self.how}; each element the float32 rounding of Σ w_i·x_i accumulated in float64 in this "
                  "order" + (f" (uniform: Σ (1/{len(self.sources)})·x_i, not (Σ x_i)/{len(self.sources)})"
                             if self.how == "uniform" else ""),
                  f"{len(self.averaged)} parameters averaged; {len(self.from_last)} tensors from the last source",
                  f"reads {human_bytes(self.read_bytes)} of {len(self.sources)} checkpoints; {self.writes_text()}",
                  f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} ({self.workers} writing "
                  f"thread(s), 3 streaming buffers of {human_bytes(self.chunk_bytes)} each, the float64 sums in them; "
                  "independent of the number of checkpoints and of the model size)"] + self.summary_lines()[2:]
        width = max([len(f.name) for f in self.files] + [30])
        lines += [f"  {f.name:<{width}} {human_bytes(f.size if f.size is not None else f.write_bytes):>10}"
                  for f in self.files]
        lines += [f"  {name}" for name in self.index_files]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@gc_paused
def plan_average(sources: Sequence[Union[Checkpoint, str, os.PathLike]], out: Union[str, os.PathLike], *,
                 weights: Optional[Sequence[float]] = None, ema: Optional[float] = None, normalize: bool = False,
                 format: str = "safetensors", dtype: str = "fp32", max_shard_size: Union[int, str] = "5GB",
                 exclude_frozen: bool = False, hf_files: bool = True, overwrite: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: int = 1, sync: bool = True,
                 tp_rules=None, verify_crc: bool = True) -> AveragePlan:
    """Plan the average of ``sources`` (paths or opened checkpoints, in order) into ``out`` (see the module
    docstring for the sources, the weights, the arithmetic and the outputs); reads metadata only.

    Args:
        weights / ema / normalize: the weights (default uniform).
        format: ``"safetensors"`` (default), ``"torch"`` or ``"deepspeed"``; dtype, max_shard_size, exclude_frozen,
            hf_files: as for :func:`ckptlib.plan_export` (HF formats).
        workers: writing threads; chunk_bytes: the streaming chunk (the memory bound follows from it).
        verify_crc: check the CRC-32 of every zip member of the sources the run reads (default; as for
            :func:`ckptlib.plan_export`: a mismatch is refused, naming the file and member, and nothing is written).

    Memory: the plan (each source's ranges of every averaged tensor); the run's is ``plan.predicted_peak_bytes``.

    Raises:
        CkptError: fewer than two sources, a tag given twice, bad weights, checkpoints of different models (the first
            difference named), a source ckptlib cannot read exactly or average, an output folder that holds or is
            inside a source, or is not empty."""
    if format not in FORMATS:
        raise CkptError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in OUTPUT_DTYPES:
        raise CkptError(f"unknown dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    if workers < 1:
        raise CkptError("workers must be at least 1")
    w, how = average_weights(len(sources), weights, ema, normalize)
    cks = open_sources(sources, tp_rules)
    try:
        return _planned(cks, Path(out).expanduser().resolve(), w, how, format=format, dtype=dtype,
                        max_shard_size=max_shard_size, exclude_frozen=exclude_frozen, hf_files=hf_files,
                        overwrite=overwrite, chunk_bytes=chunk_bytes, workers=workers, sync=sync,
                        verify_crc=verify_crc)
    finally:  # the plan holds plain data only: the files opened here are closed
        for s, ck in zip(sources, cks):
            if not isinstance(s, Checkpoint):
                ck.close()


def _planned(cks: list, out: Path, w: tuple, how: str, *, format: str, dtype: str, max_shard_size, exclude_frozen: bool,
             hf_files: bool, overwrite: bool, chunk_bytes: int, workers: int, sync: bool,
             verify_crc: bool = True) -> AveragePlan:
    """:func:`plan_average` once the sources are open."""
    for ck in cks:
        check_destination(out, Path(ck.location.save_dir), overwrite)
    check_same_run(cks)
    last, terms = cks[-1], Terms(cks, w)
    averaged = [p.name for p in last.parameters if p.trainable and not p.tied_to]
    if format == "deepspeed":
        if dtype != "fp32" or exclude_frozen or max_shard_size not in ("5GB", None):
            raise CkptError("--format deepspeed writes the last source's files in their own dtypes: leave out --dtype, "
                            "--exclude-frozen and --max-shard-size")
        from .average_ds import deepspeed_files  # the DeepSpeed output, loaded only for it

        files, finals, folders, from_last, notes = deepspeed_files(last, terms)
        index_files, side, limit = {}, [], 0
    else:
        limit = shard_limit(max_shard_size)
        tensors, from_last = _hf_tensors(last, terms, BY_SHORT[dtype].name, exclude_frozen)
        files, finals, index_files = _weights_files(tensors, format, limit)
        side, side_notes = _side_files(last, BY_SHORT[dtype].name) if hf_files else ([], [])
        files += [f for f in side if isinstance(f, CopyFile)]
        finals = [f for f in side if isinstance(f, TextFile)] + finals
        folders = []
        notes = _notes(last, from_last) + side_notes
    last_names = {p.name for p in last.parameters if not p.tied_to} | {b.name for b in last.buffers}
    refs = [ck.source_ref() for ck in cks]
    stamps = tuple(s for r in refs for s in r.stamps)
    source = dataclasses.replace(refs[-1], stamps=stamps, total_bytes=sum(r.total_bytes for r in refs))
    plan = AveragePlan(source=source, sources=refs, out=out, files=files, finals=finals, folders=folders,
                       weights=w, how=how, format=format, dtype=dtype if format != "deepspeed" else last.dtype,
                       max_shard_size=limit, averaged=averaged, from_last=from_last, index_files=index_files,
                       side_files=[f.name for f in side], chunk_bytes=chunk_bytes, workers=workers,
                       overwrite=overwrite, sync=sync, notes=notes,
                       checks=source_checks(cks, averaged, [n for n in from_last if n in last_names]))
    entries: dict = {}
    for ck in cks:
        entries.update(ck.zip_entries())
    return attach_crc(plan, entries if verify_crc else None)


def _hf_tensors(last: Checkpoint, terms: Terms, out_dtype: str, exclude_frozen: bool) -> tuple[list, list]:
    """The model's state dict as the export of ``last`` writes it, each trainable parameter (and tied alias) an
    :class:`~ckptlib.plan.AveragedTensor` of its owner's masters, the rest the last source's; and the names of those
    taken from the last source."""
    out, from_last = [], []
    for t in model_tensors(last, out_dtype, exclude_frozen):
        if t.kind in ("trainable", "tied") and last.param(t.source).trainable:
            out.append(AveragedTensor(t.name, t.shape, out_dtype, terms.of(t.source), source=t.source))
        else:
            out.append(t)
            from_last.append(t.name)
    return out, from_last


def _file_size(f: WeightsFile) -> int:
    if f.format == "safetensors":
        return SafetensorsLayout([TensorSpec(t.name, t.dtype, t.shape) for t in f.tensors], f.metadata).file_size
    tree = collections.OrderedDict((t.name, averaged_spec(t) if isinstance(t, AveragedTensor) else
                                    NewTensor(t.dtype, t.shape, t.ranges)) for t in f.tensors)
    return file_size(tree, f.name, archive=Path(f.name).name.split(".")[0])


def _weights_files(tensors: list, format: str, limit: int) -> tuple[list, list, dict]:
    """The shards of ``tensors`` (at most ``limit`` bytes each, as an export shards them) with their exact sizes, and
    the index file when there are several."""
    shards = shard_tensors(tensors, limit)
    names, index = file_names(format, max(len(shards), 1))
    meta = {"format": "pt"} if format == "safetensors" else {}
    files = [WeightsFile(name, format, shard, dict(meta)) for name, shard in zip(names, shards or [[]])]
    for f in files:
        f.size = _file_size(f)
    if not index:
        return files, [], {}
    return files, [TextFile(index, index_json(files, None), kind="index")], {index: [f.name for f in files]}


def _side_files(last: Checkpoint, out_dtype: str) -> tuple[list, list]:
    """The Hugging Face files beside the last source (``config.json`` with the written dtype, the rest copied), and
    the note saying so, or how to add a config."""
    found, folder = hf.model_files(last.location.save_dir)
    if folder is None:
        return [], [f"no config.json beside the last source ({last.location.save_dir}): from_pretrained(OUT) needs "
                    "one; copy the config.json of the model you trained into OUT (--no-hf-files silences this)"]
    out: list = []
    for f in found:
        if f.name == hf.CONFIG:
            try:
                out.append(TextFile(f.name, hf.config_with_dtype(Path(f.source).read_text(), out_dtype), kind="hf"))
            except (OSError, ValueError) as e:
                raise CkptError(f"this config.json cannot be read as JSON ({e})", path=f.source,
                                hint="repair it, or average without it (--no-hf-files)") from None
        else:
            out.append(CopyFile(f.name, f.source, f.bytes, kind="hf"))
    return out, [f"copied for from_pretrained from beside the last source ({folder}): "
                 + ", ".join(f"{f.name} (dtype {out_dtype})" if f.name == hf.CONFIG else f.name for f in found)]


def _notes(last: Checkpoint, from_last: list) -> list[str]:
    buffers = {b.name for b in last.buffers}
    kinds = [(what, [n for n in from_last if (n in buffers) == (what == "buffers")]) for what in
             ("buffers", "frozen parameters")]
    notes = [f"not averaged, the last source's ({last.location.tag}): "
             + "; ".join(f"{what} {', '.join(names)}" for what, names in kinds if names)] if from_last else []
    if last.flavor != "no_zero" and last.zero_stage == 1 and any(not p.trainable and not p.tied_to
                                                                 for p in last.parameters):
        notes.append("ZeRO-1 does not save fp32 copies of frozen parameters: they are the last source's "
                     f"{last.dtype} module weights")
    return notes


__all__ = ["AveragePlan", "plan_average", "average_weights", "check_same_run", "open_sources", "Terms",
           "source_checks", "FORMATS", "SUM_TOLERANCE"]
