"""Diff two sets of named tensors: checkpoints (any stage, world size or layout), exports, universal ones.

    plan = ckptlib.plan_diff("ckpt", "ckpt-export")   # metadata only: which tensors pair up, byte ranges
    result = ckptlib.diff(plan)                       # streams both sides window by window
    print(result.summary()); result.ok                # every tensor the same?

Each side is anything :func:`ckptlib.analysis.tensorsets.open_tensor_set` reads. Tensors are matched by name
(optimizer states, with ``states``, as ``<key>/<name>``) and compared chunk by chunk: floating ones in
fp32, integer and bool ones exactly (:meth:`ckptlib.analysis.compare.Comparer.difference`). Per tensor: ``status``
(``same``, ``changed``, ``only_in_a``, ``only_in_b``, ``shape_changed``), ``max_abs_diff`` (over the
elements finite on both sides) and ``rel_diff`` (``||a - b|| / ||a||``, float64). A tensor is ``same``
when no element differs by more than ``atol + rtol * |b|`` (exact by default; NaN equals NaN).

Memory: ``plan.predicted_peak_bytes``, whatever the tensor sizes. Neither side is written.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from ..errors import CkptError
from ..io.sources import SourceFiles, check_unchanged
from ..io.streaming import DEFAULT_CHUNK_BYTES, load_cast_kernels
from ..layout.ranges import stored_bytes
from ..progress import Observer
from ..system.memory import MemoryReport, watch_memory
from ..units import human_bytes
from .adapter import pair_adapter_names
from .compare import Comparer
from .scan import json_ready, num, progress_to, scan_peak_bytes
from .tensorsets import DCP, NamedTensor, TensorSet, open_tensor_set

SAME, CHANGED, ONLY_IN_A, ONLY_IN_B, SHAPE_CHANGED = "same", "changed", "only_in_a", "only_in_b", "shape_changed"
STATUSES = (SAME, CHANGED, ONLY_IN_A, ONLY_IN_B, SHAPE_CHANGED)


@dataclass(frozen=True)
class DiffItem:
    """One name and its tensor on each side (None where it is missing)."""

    key: str
    a: Optional[NamedTensor]
    b: Optional[NamedTensor]

    @property
    def comparable(self) -> bool:
        return self.a is not None and self.b is not None and tuple(self.a.shape) == tuple(self.b.shape)


@dataclass(kw_only=True)
class DiffPlan:
    """What a diff compares, decided from metadata (plain data): both sets (``a``, ``b``: kind, where, the
    stamps of their files) and one :class:`DiffItem` per name."""

    action: ClassVar[str] = "diff"
    a: TensorSet = field(repr=False)
    b: TensorSet = field(repr=False)
    items: list
    atol: float = 0.0
    rtol: float = 0.0
    states: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: with states: ``(parameter, step in A, step in B)`` for each parameter whose step both sides record
    steps: list = field(default_factory=list)
    step_notes: list = field(default_factory=list)

    @property
    def notes(self) -> list:
        return [f"A: {n}" for n in self.a.notes] + [f"B: {n}" for n in self.b.notes] + self.step_notes

    @property
    def read_bytes(self) -> int:
        return sum(stored_bytes(i.a.ranges) + stored_bytes(i.b.ranges) for i in self.items if i.comparable)

    @property
    def predicted_peak_bytes(self) -> int:
        return scan_peak_bytes(self.chunk_bytes)

    def describe(self) -> str:
        both = sum(1 for i in self.items if i.comparable)
        lines = [f"diff A: {self.a.label}", f"     B: {self.b.label}",
                 f"{len(self.items)} names: {both} compared, {sum(1 for i in self.items if i.b is None)} only in A, "
                 f"{sum(1 for i in self.items if i.a is None)} only in B"
                 + (f"; and the optimizer steps of {len(self.steps)} parameters" if self.steps else "")
                 + ("" if self.states else "; optimizer states left out (--states compares them too)"),
                 "same when " + ("bit-for-bit equal in fp32 (integers exactly)" if not (self.atol or self.rtol)
                                 else f"|a - b| <= {self.atol:g} + {self.rtol:g} * |b| everywhere"),
                 f"reads {human_bytes(self.read_bytes)}; writes nothing",
                 f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} "
                 f"({human_bytes(self.chunk_bytes)} chunks; independent of the model size)"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict:
        return {"action": "diff", "a": self.a.path, "b": self.b.path, "a_kind": self.a.kind, "b_kind": self.b.kind,
                "names": [i.key for i in self.items], "atol": self.atol, "rtol": self.rtol, "states": self.states,
                "read_bytes": self.read_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
                "notes": self.notes}

    def _repr_pretty_(self, p, cycle):
        p.text(self.describe())


@dataclass
class TensorDiff:
    """How one tensor differs between A and B (``changed``: elements outside the tolerance, ``nonfinite``
    of them NaN/Inf on one side only; ``norm_a``, ``norm_diff``: ``||a||`` and ``||a - b||``)."""

    key: str
    status: str
    dtype_a: Optional[str] = None
    dtype_b: Optional[str] = None
    shape_a: Optional[tuple] = None
    shape_b: Optional[tuple] = None
    numel: int = 0
    changed: int = 0
    nonfinite: int = 0
    max_abs_diff: Optional[float] = None
    rel_diff: Optional[float] = None
    norm_a: Optional[float] = None
    norm_diff: Optional[float] = None
    alias_of: Optional[str] = None  # a tied alias (on either side): the parameter whose values it shares

    def to_dict(self) -> dict:
        return {"name": self.key, "status": self.status, "max_abs_diff": self.max_abs_diff, "rel_diff": self.rel_diff,
                "changed_elements": self.changed, "nonfinite_mismatches": self.nonfinite, "numel": self.numel,
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b,
                "shape_a": list(self.shape_a) if self.shape_a is not None else None,
                "shape_b": list(self.shape_b) if self.shape_b is not None else None,
                "norm_a": self.norm_a, "norm_diff": self.norm_diff, "alias_of": self.alias_of}


@dataclass
class DiffResult:
    """The diff of two tensor sets: one :class:`TensorDiff` per name, the bytes read, time and memory."""

    a: str
    b: str
    tensors: list
    bytes_read: int
    seconds: float
    atol: float = 0.0
    rtol: float = 0.0
    memory: Optional[MemoryReport] = None
    plan: Optional[DiffPlan] = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """Every tensor is ``same`` (within the tolerances)."""
        return all(t.status == SAME for t in self.tensors)

    @property
    def counts(self) -> dict:
        return {s: sum(1 for t in self.tensors if t.status == s) for s in STATUSES}

    @property
    def largest(self) -> Optional[TensorDiff]:
        """The compared tensor with the largest relative change (None if none changed at all)."""
        moved = [t for t in self.tensors if t.rel_diff is not None and (t.rel_diff > 0 or t.changed)]
        return max(moved, key=lambda t: (t.rel_diff if not math.isnan(t.rel_diff) else math.inf, t.changed),
                   default=None)

    def tensor(self, key: str) -> TensorDiff:
        for t in self.tensors:
            if t.key == key:
                return t
        raise KeyError(key)

    def summary(self) -> str:
        c = self.counts
        text = (f"{len(self.tensors)} tensors: {c[SAME]} same, {c[CHANGED]} changed, {c[ONLY_IN_A]} only in A, "
                f"{c[ONLY_IN_B]} only in B, {c[SHAPE_CHANGED]} shape changed; ")
        big = self.largest
        if big is None:
            return text + "no value differs"
        return text + f"largest relative change {big.rel_diff:.3g} in {big.key}" + \
            (f" ({big.nonfinite} NaN/Inf on one side only)" if big.nonfinite else "")

    def describe(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}"]
        shown = [t for t in self.tensors if t.status != SAME]
        w = max([len(t.key) for t in shown] + [6])
        for t in shown:
            if t.status in (ONLY_IN_A, ONLY_IN_B):
                lines.append(f"{t.status:<13} {t.key}")
            elif t.status == SHAPE_CHANGED:
                lines.append(f"{t.status:<13} {t.key:<{w}}  {list(t.shape_a)} -> {list(t.shape_b)}")
            else:
                extra = f", {t.nonfinite} NaN/Inf on one side only" if t.nonfinite else ""
                alias = f"; tied alias of {t.alias_of}, which changes with it" if t.alias_of else ""
                lines.append(f"{t.status:<13} {t.key:<{w}}  max|a-b| {num(t.max_abs_diff)}  rel {num(t.rel_diff)}  "
                             f"({t.changed:,} of {t.numel:,} elements{extra}{alias})")
        lines.append(self.summary() + f" ({human_bytes(self.bytes_read)} read in {self.seconds:.1f} s)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The JSON of ``ckpt diff --json`` (undefined and infinite values as null)."""
        big = self.largest
        return json_ready({"a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol,
                           "tensors": [t.to_dict() for t in self.tensors],
                           "summary": {**self.counts, "largest_rel_diff": big.rel_diff if big else None,
                                       "largest_in": big.key if big else None, "text": self.summary()},
                           "bytes_read": self.bytes_read, "seconds": self.seconds})

    def _repr_pretty_(self, p, cycle):
        p.text(self.describe())


# ============================================================================================ planning
def plan_diff(a: Union[TensorSet, str, os.PathLike, Any], b: Union[TensorSet, str, os.PathLike, Any], *,
              tag_a: Optional[str] = None, tag_b: Optional[str] = None, states: bool = False, atol: float = 0.0,
              rtol: float = 0.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              tp_rules: Union[str, os.PathLike, None] = None) -> DiffPlan:
    """Plan the diff of ``a`` and ``b`` (each a path, an opened Checkpoint or a TensorSet; metadata only).

    Args:
        tag_a, tag_b: the tag of each side, when it is a checkpoint with several.
        states: compare optimizer states too.
        atol, rtol: an element is the same when ``|a - b| <= atol + rtol * |b|`` (default: exactly equal).
        tp_rules: for tensor-parallel checkpoints saved without ``universal_checkpoint_info`` (either
            side): how their shards join (a JSON file with its keys, as for ``open_checkpoint``).
    """
    for what, v in (("atol", atol), ("rtol", rtol)):
        if not isinstance(v, (int, float)) or not v >= 0:
            raise CkptError(f"{what} must be a number >= 0, not {v!r}")
    sa = open_tensor_set(a, tag=tag_a, states=states, tp_rules=tp_rules)
    sb = open_tensor_set(b, tag=tag_b, states=states, tp_rules=tp_rules)
    sa, sb, pair_notes = pair_adapter_names(sa, sb)  # a peft adapter's DeepSpeed names beside peft's
    sa, sb, torch_notes = _pair_torch_keys(sa, sb)    # a checkpoint's state keys beside a DCP folder's torch keys
    pair_notes += torch_notes
    items = [DiffItem(k, t, sb.tensors.get(k)) for k, t in sa.tensors.items()]
    items += [DiffItem(k, None, t) for k, t in sb.tensors.items() if k not in sa.tensors]
    steps, step_notes = _step_pairs(sa, sb) if states else ([], [])
    return DiffPlan(a=sa, b=sb, items=items, atol=float(atol), rtol=float(rtol), states=states,
                    chunk_bytes=chunk_bytes, steps=steps, step_notes=pair_notes + step_notes)


def _pair_torch_keys(sa: TensorSet, sb: TensorSet) -> tuple:
    """``(sa, sb, notes)``: beside a DCP folder (which holds each state under torch's key), a checkpoint's states that
    torch keeps under another key renamed to it (CPU Adagrad's ``exp_avg_sq/<name>`` as ``sum/<name>``), so that they
    pair; else both as given."""
    import dataclasses

    for x, y, label in ((sa, sb, "A"), (sb, sa, "B")):
        if not x.torch_keys or y.kind != DCP:
            continue
        renamed = {k: f"{key}/{x.tensors[k].name}" for k, key in x.torch_keys.items() if k in x.tensors}
        tensors = {renamed.get(k, k): (dataclasses.replace(t, key=renamed[k], state=x.torch_keys[k])
                                       if k in renamed else t) for k, t in x.tensors.items()}
        new = dataclasses.replace(x, tensors=tensors, torch_keys={})
        pairs = sorted({f"{k.split('/', 1)[0]} as {v}" for k, v in x.torch_keys.items()})
        notes = [f"{label}'s optimizer states named as torch's optimizer keeps them, as in the DCP folder: "
                 f"{', '.join(pairs)} ({len(renamed)} tensors)"]
        return (new, y, notes) if label == "A" else (y, new, notes)
    return sa, sb, []


def _step_pairs(sa: TensorSet, sb: TensorSet) -> tuple[list, list]:
    """The optimizer steps both sides record, by parameter, and notes on those only one side records."""
    a, b = sa.steps or {}, sb.steps or {}
    pairs = [(name, a[name], b[name]) for name in a if name in b]
    notes = []
    for side, mine, other, label in (("A", a, b, sa.label), ("B", b, a, sb.label)):
        if not mine and other:
            notes.append(f"{side} ({label}) records no optimizer step: steps are not compared")
        elif mine and other:
            alone = [n for n in mine if n not in other]
            if alone:
                notes.append(f"only {side} records the step of {', '.join(alone[:3])}"
                             + (f" and {len(alone) - 3} more" if len(alone) > 3 else "") + ": not compared")
    return pairs, notes


# ============================================================================================ running
def _compare(item: DiffItem, cmp: Comparer, atol: float, rtol: float) -> TensorDiff:
    a, b = item.a, item.b
    alias = getattr(a, "alias_of", None) or getattr(b, "alias_of", None)
    if b is None:
        return TensorDiff(item.key, ONLY_IN_A, dtype_a=a.dtype, shape_a=a.shape, numel=a.numel, alias_of=alias)
    if a is None:
        return TensorDiff(item.key, ONLY_IN_B, dtype_b=b.dtype, shape_b=b.shape, numel=b.numel, alias_of=alias)
    out = TensorDiff(item.key, SHAPE_CHANGED, dtype_a=a.dtype, dtype_b=b.dtype, shape_a=a.shape, shape_b=b.shape,
                     numel=a.numel, alias_of=alias)
    if not item.comparable:
        return out
    d = cmp.difference(a.ranges, b.ranges, atol, rtol)
    out.status = CHANGED if d.changed else SAME
    out.changed, out.nonfinite, out.max_abs_diff, out.rel_diff = d.changed, d.nonfinite, d.max_abs_diff, d.rel_diff
    # identical bytes are passed over without summing ||a||: its norm is then not known (null), not 0.0
    out.norm_a, out.norm_diff = (None if d.skipped else math.sqrt(d.sumsq_a)), math.sqrt(d.sumsq_diff)
    return out


def _compare_step(name: str, a: float, b: float) -> TensorDiff:
    """The optimizer step of ``name`` on both sides, as a one-element ``step/<name>`` entry: equal or not
    (a step is a count: no tolerance applies)."""
    same = a == b or (math.isnan(a) and math.isnan(b))
    gap = 0.0 if same else abs(a - b)
    return TensorDiff(f"step/{name}", SAME if same else CHANGED, dtype_a="step", dtype_b="step", shape_a=(),
                      shape_b=(), numel=1, changed=0 if same else 1, max_abs_diff=gap,
                      rel_diff=(gap / abs(a)) if a else (0.0 if same else math.inf), norm_a=abs(a), norm_diff=gap)


def diff(a: Union[DiffPlan, TensorSet, str, os.PathLike, Any], b: Union[TensorSet, str, os.PathLike, Any, None] = None,
         *, observer: Optional[Observer] = None, cancel: Any = None, **options) -> DiffResult:
    """Diff ``a`` and ``b`` (see the module docstring): ``a`` is a plan from :func:`plan_diff`, or ``a`` and
    ``b`` are what it takes (with its ``options``: ``tag_a``, ``tag_b``, ``states``, ``atol``, ``rtol``).

    Args:
        observer: receives progress over the bytes read.
        cancel: a ``threading.Event``; setting it stops the diff (:class:`~ckptlib.errors.Cancelled`).

    Memory: ``plan.predicted_peak_bytes``. Neither side is written; they must not change meanwhile.
    """
    if isinstance(a, DiffPlan):
        plan = a
    elif b is None:
        raise CkptError("diff needs two sides: diff(a, b) or diff(plan_diff(a, b))")
    else:
        plan = plan_diff(a, b, **options)
    load_cast_kernels()  # before the clock and the memory watch start (see its docstring)

    observer = observer or Observer()
    t0 = time.perf_counter()
    try:
        with watch_memory() as watch:
            observer.on_start(plan)
            check_unchanged(plan.a.stamps + plan.b.stamps)
            with SourceFiles() as files:
                cmp = Comparer(plan.chunk_bytes, progress_to(observer, plan.read_bytes), cancel, files)
                try:
                    tensors = []
                    for item in plan.items:
                        observer.on_tensor(item.key)
                        tensors.append(_compare(item, cmp, plan.atol, plan.rtol))
                    tensors += [_compare_step(*pair) for pair in plan.steps]
                finally:
                    cmp.close()
                read = files.stats.bytes_read
    except BaseException as e:
        observer.on_error(e)
        raise
    result = DiffResult(a=plan.a.label, b=plan.b.label, tensors=tensors, bytes_read=read,
                        seconds=time.perf_counter() - t0, atol=plan.atol, rtol=plan.rtol, memory=watch.report,
                        plan=plan)
    observer.on_finish(result)
    return result


__all__ = ["DiffPlan", "DiffItem", "DiffResult", "TensorDiff", "plan_diff", "diff", "STATUSES", "SAME", "CHANGED",
           "ONLY_IN_A", "ONLY_IN_B", "SHAPE_CHANGED"]
