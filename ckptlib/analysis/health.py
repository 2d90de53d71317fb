"""Checkpoint health: statistics of every fp32 master (and optimizer state), and what is wrong.

    plan = ckptlib.plan_check("CKPT", states=True)    # metadata only: tensors, byte ranges, steps, padding
    print(plan.describe())
    result = ckptlib.check(plan)                      # streams every tensor once, window by window
    print(result.describe()); result.ok; result.problems; result.to_dict()   # what `ckpt check --json` prints

Per tensor: ``numel``, ``nan``, ``inf``, ``zeros``, ``min``, ``max``, ``mean``, ``std`` (sample, as
torch.std), ``norm`` (L2), accumulated in float64 (:mod:`ckptlib.analysis.tensorstats`). Problems, each naming the
tensor and the file it lives in: NaN or Inf values; a state its optimizer keeps non-negative (Adam's
``exp_avg_sq``, Adagrad's ``sum``: :mod:`ckptlib.kinds.optimizers`) below zero; a saved 16-bit
weight that is not the fp32 master cast to the training dtype (checkpoints holding both: ZeRO-0/1/2,
BF16_Optimizer; compared while the master streams, so it is read once); optimizer steps that differ
between ranks or (sub-)groups; padding the files record over parameter elements
(:mod:`ckptlib.analysis.healthrules`). Pipeline, tensor-parallel and MoE checkpoints are checked in every ZeRO
set (each stage, each tensor rank, experts in their expert data-parallel groups); a tensor stored more
than once (a tied layer on several stages, a tensor replicated across tensor ranks) has its statistics
taken from the copy the model reads, and every further copy is streamed beside it: NaN/Inf in it, or
bytes that differ from the first, are problems too. The checkpoint is only read.

Memory: ``plan.predicted_peak_bytes`` (three chunks of reusable buffers), whatever the tensor sizes.
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union

from ..deepspeed import Checkpoint, open_checkpoint
from ..dtypes import decode_scalar, itemsize
from ..io.crc import describe_mismatch, entries_touching, verify_entries
from ..io.sources import SourceFiles, check_unchanged
from ..io.streaming import DEFAULT_CHUNK_BYTES, load_cast_kernels
from ..layout.ranges import stored_bytes
from ..plan import SourceRef
from ..progress import Observer, check_cancel
from ..system.memory import MemoryReport, watch_memory
from ..units import human_bytes
from .compare import RangeIndex, WindowReader, cast_values, np_type, same_bytes, stored_dtype
from .healthrules import StatsItem, StepItem, file_labels, identity_problems, layout_problems, stats_items, step_items
from .scan import Problem, json_ready, num, progress_to, scan_peak_bytes
from .tensorstats import RunningStats, TensorStats


@dataclass(kw_only=True)
class CheckPlan:
    """What a check reads, decided from metadata (plain data): ``items`` (the tensors to stream),
    ``steps`` (the optimizer steps to compare), ``problems`` found from the metadata already (padding),
    ``labels`` (each file's path as the user sees it)."""

    action: ClassVar[str] = "check"
    source: SourceRef
    items: list
    steps: list
    problems: list
    labels: dict
    states: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    notes: list = field(default_factory=list)
    crc: list = field(default_factory=list)  # the zip entries whose CRC-32 the check verifies

    @property
    def read_bytes(self) -> int:
        return sum(stored_bytes(i.ranges) + stored_bytes(i.lowp) + sum(stored_bytes(a) + stored_bytes(b)
                                                                        for _, a, b in i.replicas)
                   for i in self.items) + sum(stored_bytes(s.ranges) for s in self.steps) + \
            sum(e.size for e in self.crc)

    @property
    def predicted_peak_bytes(self) -> int:
        return scan_peak_bytes(self.chunk_bytes)

    def describe(self) -> str:
        src = self.source
        lowp = sum(1 for i in self.items if i.lowp)
        copies = sum(len(i.replicas) for i in self.items)
        lines = [f"check {src.tag_dir}",
                 f"ZeRO {src.zero_stage} ({src.flavor}), {src.dtype}, {src.ranks} ranks; {len(self.items)} tensors"
                 + (" (fp32 masters and optimizer states)" if self.states else " (fp32 masters)")
                 + (f", {lowp} saved {src.dtype} weights compared with their masters" if lowp else "")
                 + (f", {copies} further copies (tied or replicated) compared with the first" if copies else "")
                 + f", {len(self.steps)} optimizer steps; the CRC-32 of {len(self.crc)} zip entries",
                 f"reads {human_bytes(self.read_bytes)} of {human_bytes(src.total_bytes)}; writes nothing",
                 f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} "
                 f"({human_bytes(self.chunk_bytes)} chunks; independent of the model size)"]
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"action": "check", "source": self.source.tag_dir, "states": self.states,
                "tensors": [{"name": i.key, "kind": i.kind, "dtype": i.dtype, "shape": list(i.shape),
                             "read_bytes": stored_bytes(i.ranges), "compared_with": i.lowp_dtype} for i in self.items],
                "steps": len(self.steps), "problems": [p.to_dict() for p in self.problems],
                "read_bytes": self.read_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
                "notes": list(self.notes)}

    def _repr_pretty_(self, p, cycle):
        p.text(self.describe())


@dataclass
class CheckResult:
    """What a check found: per-tensor statistics, the problems, the bytes read, time and memory."""

    source: str
    tensors: list
    problems: list
    bytes_read: int
    seconds: float
    memory: Optional[MemoryReport] = None
    steps: dict = field(default_factory=dict)  # {(mp rank, dp rank, group): step}
    plan: Optional[CheckPlan] = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def tensor(self, key: str) -> TensorStats:
        for t in self.tensors:
            if t.key == key:
                return t
        raise KeyError(key)

    def to_dict(self) -> dict:
        """The JSON of ``ckpt check --json`` (NaN and Inf, i.e. undefined values, as null)."""
        return json_ready({"source": self.source, "tensors": [t.to_dict() for t in self.tensors],
                           "problems": [p.to_dict() for p in self.problems], "bytes_read": self.bytes_read,
                           "seconds": self.seconds,
                           "steps": [{"mp_rank": m, "rank": r, "group": g, "step": v}
                                     for (m, r, g), v in sorted(self.steps.items())]})

    def describe(self) -> str:
        w = max([len(t.key) for t in self.tensors] + [6])
        head = (f"{'tensor':<{w}} {'numel':>11} {'nan':>6} {'inf':>6} {'zeros':>9} {'min':>10} {'max':>10} "
                f"{'mean':>10} {'std':>10} {'norm':>10}")
        lines = [head]
        for t in self.tensors:
            lines.append(f"{t.key:<{w}} {num(t.numel, 11)} {num(t.nan, 6)} {num(t.inf, 6)} {num(t.zeros, 9)} "
                         f"{num(t.min)} {num(t.max)} {num(t.mean)} {num(t.std)} {num(t.norm)}")
        lines.append("")
        lines += [f"PROBLEM {p}" for p in self.problems]
        verdict = "healthy" if self.ok else f"{len(self.problems)} problem(s) found"
        lines.append(f"{verdict}: {len(self.tensors)} tensors of {self.source} checked "
                     f"({human_bytes(self.bytes_read)} read in {self.seconds:.1f} s)")
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):
        p.text(self.describe())


# ============================================================================================ planning
def plan_check(checkpoint: Union[Checkpoint, str, os.PathLike], *, tag: Optional[str] = None, states: bool = False,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, tp_rules: Union[str, os.PathLike, None] = None) -> CheckPlan:
    """Plan the health check of a checkpoint (metadata only: no tensor data is read).

    Args:
        checkpoint: an opened :class:`Checkpoint` or a path for :func:`open_checkpoint`.
        tag: the tag when ``checkpoint`` is a path.
        states: also every per-element optimizer state (``exp_avg``, ``exp_avg_sq``, ...).
        chunk_bytes: the streaming chunk; the memory bound follows from it.
        tp_rules: for a tensor-parallel checkpoint saved without ``universal_checkpoint_info``: how its
            shards join (as for :func:`open_checkpoint`).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag,
                                                                                tp_rules=tp_rules)
    ck.check_readable()
    notes: list = []
    if len(ck.sets) > 1:
        notes.append(f"{len(ck.sets)} model-parallel ranks ({ck.kind.replace('_', ' ')}): steps, padding and saved "
                     "16-bit weights are compared in every stage / tensor rank's files; a tensor stored on several "
                     "of them is read (and its statistics taken) from the first")
    labels = file_labels(ck)
    items = stats_items(ck, states, notes)
    steps = step_items(ck, notes)
    problems = layout_problems(ck, labels, notes) + identity_problems(ck)
    if states:  # every entry of every file: the pickles, the records, every tensor's storage
        crc = [e for entries in ck.zip_entries(every=True).values() for e in entries]
    else:  # every entry the check reads from
        crc = entries_touching(ck.zip_entries(), [r for i in items for r in i.ranges + i.lowp] +
                               [r for i in items for _, a, b in i.replicas for r in a + b] +
                               [r for s in steps for r in s.ranges])
    return CheckPlan(source=ck.source_ref(), items=items, steps=steps, problems=problems, labels=labels,
                     states=states, chunk_bytes=chunk_bytes, notes=notes, crc=crc)


# ============================================================================================ running
class _Scanner:
    """Streams stats items window by window: statistics, per-file tallies, the saved 16-bit weights, and
    the further copies of replicated tensors.

    Memory: a float64 work window, two readers of two fp32 windows each and a 16-bit cast window: 26
    bytes per window element, with ``chunk_bytes / 9`` elements per window (under ``3 * chunk_bytes``)."""

    def __init__(self, plan: CheckPlan, files: SourceFiles, progress, cancel):
        import numpy as np

        self.plan, self.progress, self.cancel = plan, progress, cancel
        self.step = max(1, plan.chunk_bytes // 9)  # elements per window
        self.work = np.empty(self.step, np.float64)  # pages touched when used
        self.master = WindowReader(files, self.step * 4)
        second = any(i.lowp or i.replicas for i in plan.items)
        self.second = WindowReader(files, self.step * 4) if second else None  # saved weights, replicas
        self.cast = np.empty(self.step * 2, np.uint8) if second else None

    def label(self, path: str) -> str:
        return self.plan.labels.get(path, path)

    def scan(self, item: StatsItem, problems: list) -> TensorStats:
        index, dtype = RangeIndex(item.ranges), stored_dtype(item.ranges)
        lowp_index = RangeIndex(item.lowp) if item.lowp else None
        step = min(self.step, self.master.slot_bytes // itemsize(dtype))
        spans = index.spans(step)  # windows may span files: a window with a finding is split by file after
        stats, tally, mismatched = RunningStats(), {}, {}
        windows = self.master.windows(index, dtype, spans)
        lowp = self.second.windows(lowp_index, item.lowp_dtype, spans) if item.lowp else None
        negative = bool(item.never_negative)
        try:
            for s, x in windows:
                check_cancel(self.cancel)
                nan, inf, neg = stats.add(x, self.work, count_negative=negative, dtype=dtype)
                if nan or inf or neg:
                    for path, a, b in _by_file(index, s, x.size):
                        n, i, g = _bad_counts(x[a:b], dtype, self.work, negative)
                        t = tally.setdefault(path, [0, 0, 0])
                        t[0], t[1], t[2] = t[0] + n, t[1] + i, t[2] + g
                if lowp is not None:
                    _, y = next(lowp)
                    if self._mismatches(x, dtype, y, item.lowp_dtype):
                        for where, a, b in _by_file(lowp_index, s, x.size):  # name both files: either is damaged
                            for master, c, d in _by_file(index, s + a, b - a):
                                bad = self._mismatches(x[a + c:a + d], dtype, y[a + c:a + d], item.lowp_dtype)
                                if bad:
                                    mismatched[where, master] = mismatched.get((where, master), 0) + bad
                self.progress(x.size * x.itemsize + (x.size * itemsize(item.lowp_dtype) if lowp else 0))
        finally:
            windows.close()
            if lowp is not None:
                lowp.close()
        for path, (nan, inf, neg) in tally.items():
            if nan or inf:
                problems.append(Problem(item.key, self.label(path), f"{nan} NaN and {inf} Inf values (of "
                                        f"{stats.total:,}) in this file's part of the tensor"))
            if neg:
                problems.append(Problem(item.key, self.label(path), f"{neg} values below zero: {item.never_negative}"))
        for (path, master), bad in mismatched.items():
            problems.append(Problem(item.key, self.label(path),
                                    f"the saved {item.lowp_dtype} weight differs from the fp32 master (in "
                                    f"{self.label(master)}) cast to {item.lowp_dtype} at {bad:,} of "
                                    f"{stats.total:,} elements: one of the two files is damaged"))
        for what, first, copy in item.replicas:
            problems += self._replica(item.key, what, first, copy)
        return stats.result(item.key, item.kind, item.dtype, item.shape, sorted({self.label(r.path)
                                                                                for r in item.ranges
                                                                                if hasattr(r, "path")}))

    def _replica(self, key: str, what: str, first: tuple, copy: tuple) -> list[Problem]:
        """Problems of one further copy of a tensor: NaN or Inf in it, bytes that differ from the first copy
        (both streamed side by side; windows with identical bytes cost one comparison)."""
        a, b = RangeIndex(first), RangeIndex(copy)
        file = self.label(getattr(next((r for r in copy if hasattr(r, "path")), None), "path", ""))
        if a.numel != b.numel:
            return [Problem(key, file, f"{what}: this copy holds {b.numel:,} elements, the first {a.numel:,}")]
        dtype = stored_dtype(first)
        step = min(self.step, self.master.slot_bytes // itemsize(dtype))
        spans = b.spans(step)  # a window that differs is split by the copy's files after
        differ, bad = {}, {}
        wa, wb = self.master.windows(a, dtype, spans), self.second.windows(b, dtype, spans)
        try:
            for (s, x), (_, y) in zip(wa, wb):
                check_cancel(self.cancel)
                self.progress(2 * x.size * x.itemsize)
                if same_bytes(x, y):
                    continue
                for path, lo, hi in _by_file(b, s, y.size):
                    differ[path] = differ.get(path, 0) + self._mismatches(x[lo:hi], dtype, y[lo:hi], dtype)
                    nan, inf, _ = _bad_counts(y[lo:hi], dtype, self.work, False)
                    if nan or inf:
                        t = bad.setdefault(path, [0, 0])
                        t[0], t[1] = t[0] + nan, t[1] + inf
        finally:
            wa.close()
            wb.close()
        differ = {p: n for p, n in differ.items() if n}
        out = [Problem(key, self.label(p), f"{nan} NaN and {inf} Inf values (of {b.numel:,}) in this file's copy "
                       f"of the tensor ({what})") for p, (nan, inf) in bad.items()]
        origin = self.label(getattr(next((r for r in first if hasattr(r, "path")), None), "path", ""))
        out += [Problem(key, self.label(p), f"this file's copy differs from the first ({what}, in {origin}) at "
                        f"{n:,} of {b.numel:,} elements: those ranks hold different values")
                for p, n in differ.items()]
        return out

    def _mismatches(self, x, x_dtype: str, y, y_dtype: str) -> int:
        """Elements of master window ``x`` that, cast to the saved weight's dtype as torch casts, differ
        (bit for bit) from ``y``."""
        import numpy as np

        if x_dtype != y_dtype:
            cast = self.cast[:x.size * y.itemsize].view(np_type(y_dtype))
            cast_values(x, x_dtype, cast, y_dtype)
            x = cast
        if same_bytes(x, y):
            return 0
        bits = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[y.itemsize]
        return int(np.count_nonzero(x.view(bits) != y.view(bits)))

    def close(self) -> None:
        self.master.close()
        if self.second is not None:
            self.second.close()


def _by_file(index: RangeIndex, start: int, count: int) -> list[tuple[str, int, int]]:
    """``(path, a, b)``: elements ``[a, b)`` of the window ``[start, start+count)`` of ``index`` that lie in
    file ``path`` ("" for zeros), one entry per range, in order (a window with a finding, to name its files)."""
    out, pos = [], 0
    for r in index.slice(start, count):
        out.append((getattr(r, "path", ""), pos, pos + r.count))
        pos += r.count
    return out


def _bad_counts(x, dtype: str, work, count_negative: bool) -> tuple[int, int, int]:
    """``(NaN, Inf, below zero)`` counts of window ``x`` (of ``dtype``; ``work``: a float64 buffer as long)."""
    import numpy as np

    w = work[:x.size]
    cast_values(x, dtype, w, "float64")
    nan, inf = int(np.count_nonzero(np.isnan(w))), int(np.count_nonzero(np.isinf(w)))
    return nan, inf, int(np.count_nonzero(w < 0)) if count_negative else 0


def read_steps(steps: list[StepItem], files: SourceFiles) -> dict:
    """``{(mp rank, dp rank, group): step}`` read from the files."""
    out = {}
    for s in steps:
        if s.ranges:
            r = s.ranges[0]
            raw = bytearray(itemsize(r.dtype))
            files.read_into(r.path, r.offset, memoryview(raw))
            out[s.key] = float(decode_scalar(raw, r.dtype))
        else:
            out[s.key] = s.value
    return out


def step_problems(steps: list[StepItem], values: dict, labels: dict, zero3: bool) -> list[Problem]:
    """A problem for each rank and (sub-)group whose step is not the one most hold (rank 0's on a tie)."""
    if len(set(values.values())) <= 1:
        return []
    counts = Counter(values.values())
    first = values[min(values)]
    common = max(counts, key=lambda v: (counts[v], v == first))
    what = "sub-group" if zero3 else "group"
    out = []
    for s in steps:
        v = values[s.key]
        if v != common and not (math.isnan(v) and math.isnan(common)):
            out.append(Problem("step", labels.get(s.file, s.file), f"the optimizer step of {what} {s.group} on "
                               f"{s.where or f'dp rank {s.rank}'} is {v:g}; the other ranks and {what}s hold "
                               f"{common:g} ({counts[common]} of {len(values)})"))
    return out


def check(checkpoint: Union[CheckPlan, Checkpoint, str, os.PathLike], *, observer: Optional[Observer] = None,
          cancel: Any = None, **options) -> CheckResult:
    """Check a checkpoint's health (see the module docstring); ``checkpoint`` is a plan from
    :func:`plan_check`, or what it takes (with its ``options``: ``tag``, ``states``, ``chunk_bytes``).

    Args:
        observer: receives progress over the bytes read (:class:`~ckptlib.progress.Observer`).
        cancel: a ``threading.Event``; setting it stops the check (:class:`~ckptlib.errors.Cancelled`).

    Memory: ``plan.predicted_peak_bytes``. The checkpoint is only read; it must not change meanwhile.
    """
    plan = checkpoint if isinstance(checkpoint, CheckPlan) else plan_check(checkpoint, **options)
    load_cast_kernels()  # before the clock and the memory watch start (see its docstring)

    observer = observer or Observer()
    t0 = time.perf_counter()
    try:
        with watch_memory() as watch:
            observer.on_start(plan)
            check_unchanged(plan.source.stamps)
            problems = list(plan.problems)
            with SourceFiles() as files:
                progress = progress_to(observer, plan.read_bytes)
                scanner = _Scanner(plan, files, progress, cancel)
                try:
                    tensors = []
                    for item in plan.items:
                        observer.on_tensor(item.key)
                        tensors.append(scanner.scan(item, problems))
                finally:
                    scanner.close()
                problems += [Problem("zip entry", plan.labels.get(e.path, e.path), describe_mismatch(e, got))
                             for e, got in verify_entries(plan.crc, files, plan.chunk_bytes, progress, cancel)]
                values = read_steps(plan.steps, files)
                problems += step_problems(plan.steps, values, plan.labels, plan.source.zero_stage == 3)
                read = files.stats.bytes_read
    except BaseException as e:
        observer.on_error(e)
        raise
    result = CheckResult(source=plan.source.tag_dir, tensors=tensors, problems=problems, bytes_read=read,
                         seconds=time.perf_counter() - t0, memory=watch.report, steps=values, plan=plan)
    observer.on_finish(result)
    return result


__all__ = ["CheckPlan", "CheckResult", "plan_check", "check", "Problem", "TensorStats"]
