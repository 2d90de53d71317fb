"""Checking a run's output against its source, and a plan against the machine, before and after a run.

- :func:`verify` re-opens what a run wrote and compares every tensor with the source checkpoint, bit
  for bit, streaming both in chunks (an export's tensors in their output dtype; a reshard's masters,
  optimizer states, frozen parameters and buffers by re-reading the output as a checkpoint; a universal
  checkpoint's fragment files). The source is opened afresh, so the comparison does not trust the plan.
- :func:`preflight` says whether a plan's predicted memory and its bytes to write fit what this machine
  has (memory, cgroup limit, free disk).

No widgets, no plots: the CLI (``--verify``), the wizards and the notebooks all call this. The
comparison engine (:class:`ckptlib.analysis.compare.Comparer`) is the one ``ckpt diff`` uses. Several processes
can share one verification (:class:`Share`: each compares every n-th tensor; :func:`merge_verifications`
joins their results), as ``--verify --distributed`` does.
Memory: the comparer's buffers (1.5 ``chunk_bytes``), whatever the tensor sizes.
"""
from __future__ import annotations

import filecmp
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..deepspeed import Checkpoint, open_checkpoint
from ..errors import CkptError
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..io.torchzip import Standin, TensorHandle, open_torch_file
from ..plan import CopyFile, Plan, TextFile, TreeFile
from ..system.memory import MemoryVerdict, memory_verdict
from ..units import human_bytes
from .compare import Comparer
from .tensorsets import file_tensors

MAX_LISTED = 5  # mismatches named in a check's detail


@dataclass
class Check:
    """One verification check: what was checked, whether it held, and details; a check over many items
    (a tally) also has their ``total`` and the ``bad`` ones."""

    what: str
    ok: bool
    detail: str = ""
    total: Optional[int] = None
    bad: tuple = ()


class Share:
    """Which of a verification's tensor comparisons this process makes: every ``world``-th one, starting
    at the ``rank``-th (all of them by default). Every process must walk the same plan in the same order."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world, self.seen = rank, world, 0

    def mine(self) -> bool:
        """Whether the next comparison is this process's (call once per comparison, on every process)."""
        self.seen += 1
        return (self.seen - 1) % self.world == self.rank


@dataclass
class Verification:
    """The checks of one output and the bytes compared."""

    out: Path
    checks: list = field(default_factory=list)
    bytes_compared: int = 0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def describe(self) -> str:
        lines = [f"{'ok  ' if c.ok else 'FAIL'} {c.what}" + (f" ({c.detail})" if c.detail else "") for c in self.checks]
        lines.append(f"{'verified' if self.ok else 'verification FAILED'}: {self.out} "
                     f"({human_bytes(self.bytes_compared)} compared bit for bit)")
        return "\n".join(lines)


def _tally(what: str, total: int, bad: list[str]) -> Check:
    listed = ", ".join(bad[:MAX_LISTED]) + (f" and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else "")
    return Check(what, not bad, f"{total - len(bad)} of {total}" + (f"; differ: {listed}" if bad else ""),
                 total=total, bad=tuple(bad))


def merge_verifications(parts: list) -> Verification:
    """One verification from those of processes that shared it (:class:`Share`): a tally's bad items
    joined, any other check held where it held on every process; the bytes compared summed."""
    lengths = {len(p.checks) for p in parts}
    if len(lengths) != 1:  # a process could not run its share: what failed, and that they disagree
        failed = list(dict.fromkeys((c.what, c.detail) for p in parts for c in p.checks if not c.ok))
        return Verification(out=parts[0].out, checks=[Check(w, False, d) for w, d in failed] + [
            Check("the processes' verifications agree", False, f"{sorted(lengths)} checks")])
    checks = []
    for same in zip(*(p.checks for p in parts)):
        c = same[0]
        if c.total is None:
            checks.append(Check(c.what, all(x.ok for x in same), c.detail))
        else:
            checks.append(_tally(c.what, c.total, list(dict.fromkeys(b for x in same for b in x.bad))))
    return Verification(out=parts[0].out, checks=checks, bytes_compared=sum(p.bytes_compared for p in parts))


def _handle_ranges(obj, what: str) -> list:
    if not isinstance(obj, TensorHandle):
        raise CkptError(f"{what} is not a tensor")
    return obj.ranges()


def _same_file(source: str, written: Path, cmp: Comparer) -> bool:
    """Whether torch file ``written`` holds the object tree of ``source``: the same containers, keys and values,
    every tensor of the same dtype, shape and bits (read from both files)."""
    def same(a, b) -> bool:
        if isinstance(a, TensorHandle) or isinstance(b, TensorHandle):
            return (isinstance(a, TensorHandle) and isinstance(b, TensorHandle) and a.dtype_name == b.dtype_name
                    and tuple(a.shape) == tuple(b.shape) and a.requires_grad == b.requires_grad
                    and cmp.equal(a.ranges(), b.ranges(), a.dtype_name))
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, Standin):
            return same(a.__dict__, b.__dict__)
        return a == b or (a != a and b != b)  # NaN equals NaN here

    try:
        with open_torch_file(source) as a, open_torch_file(written) as b:
            return same(a.obj, b.obj)
    except CkptError:
        return False


def _copies(plan: Plan, out: Path, cmp: Optional[Comparer] = None) -> list[Check]:
    """The files copied as they are (converter scripts, the client's files) equal their sources, those written
    again in the zip format hold their sources' trees, and the written text files (``config.json`` with the
    exported dtype, ``latest``, indexes) say what was planned."""
    copies = [f for f in plan.files if isinstance(f, CopyFile)]
    checks = []
    if copies:
        bad = [f.name for f in copies if not (out / f.name).is_file() or not filecmp.cmp(f.source, out / f.name,
                                                                                           shallow=False)]
        checks.append(_tally("every copied file equals its source, byte for byte", len(copies), bad))
    rewritten = [f for f in plan.files if isinstance(f, TreeFile) and f.rewrites]
    if rewritten and cmp is not None:
        bad = [f.name for f in rewritten if not _same_file(f.rewrites, out / f.name, cmp)]
        checks.append(_tally("every file rewritten in the zip format (from torch's legacy serialization) holds its "
                             "source's objects and tensors, bit for bit", len(rewritten), bad))
    texts = [f for f in plan.finals if isinstance(f, TextFile)]
    bad = [f.name for f in texts if not (out / f.name).is_file() or (out / f.name).read_text() != f.text]
    checks.append(_tally("every written text file (latest, index, config) holds the planned text", len(texts), bad))
    return checks


# ============================================================================================ export
def _output_tensors(path: Path) -> dict:
    """``{name: (dtype, shape, ranges)}`` of an exported file, from its header or pickle (no tensor data)."""
    return {t.key: (t.dtype, tuple(t.shape), list(t.ranges)) for t in file_tensors(path)}


def _verify_export(plan, src: Checkpoint, out: Path, cmp: Comparer, share: Share) -> list[Check]:
    checks = []
    missing = [f.name for f in list(plan.files) + list(plan.finals) if not (out / f.name).is_file()]
    checks.append(Check("every planned file is there", not missing,
                        f"{len(plan.files) + len(plan.finals)} file(s)" + (f"; missing {', '.join(missing)}"
                                                                          if missing else "")))
    if missing:
        return checks
    found, bad_names = {}, []
    for f in plan.weights:
        try:
            tensors = _output_tensors(out / f.name)
        except (CkptError, ValueError) as e:
            bad_names.append(f"{f.name}: {e}")
            continue
        want = {t.name: (t.dtype, tuple(t.shape)) for t in f.tensors}
        if {k: v[:2] for k, v in tensors.items()} != want:
            bad_names.append(f.name)
        found.update({(f.name, k): v for k, v in tensors.items()})
    checks.append(_tally("each file holds exactly the planned tensors (names, dtypes, shapes)", len(plan.weights),
                         bad_names))
    for index, names in plan.index_files.items():
        with open(out / index) as fh:
            weight_map = json.load(fh).get("weight_map", {})
        want = {t.name: Path(f.name).name for f in plan.weights if f.name in names for t in f.tensors}
        checks.append(Check(f"{index} maps every tensor to its shard", weight_map == want, f"{len(want)} tensors"))
    bad = []
    for f in plan.weights:
        for t in f.tensors:
            got, mine = found.get((f.name, t.name)), share.mine()
            if got is None or (mine and not cmp.equal(src.sources(t.source, t.key), got[2], t.dtype)):
                bad.append(t.name if not t.key else f"{t.key}/{t.name}")
    checks.append(_tally("every tensor equals the checkpoint's value, bit for bit", len(plan.tensors), bad))
    return checks


# ============================================================================================ DCP
def _verify_dcp(plan, src: Checkpoint, out: Path, cmp: Comparer, share: Share) -> list[Check]:
    """A DCP export: the files, each folder's ``.metadata`` read back (keys, dtypes, shapes), every tensor
    against the checkpoint bit for bit (the steps against the plan's step), every value unpickled."""
    from ..dcp import open_dcp
    from ..io.dcp.reader import read_value

    missing = [f.name for f in plan.files if not (out / f.name).is_file()]
    checks = [Check("every planned file is there", not missing, f"{len(plan.files)} file(s)"
                    + (f"; missing {', '.join(missing[:MAX_LISTED])}" if missing else ""))]
    if missing:
        return checks
    bad_keys, bad, bad_values, total, n_values = [], [], [], 0, 0
    for folder, values in plan.values.items():
        try:
            d = open_dcp(out / folder)
        except CkptError as e:
            checks.append(Check(f"{folder or '.'}: the .metadata reads back", False, str(e)))
            return checks
        want = {v.fqn: (v.tensor.dtype, tuple(v.tensor.shape)) if v.tensor is not None else None for v in values}
        have = {k: (t.dtype, t.shape) for k, t in d.tensors.items()}
        have.update({k: None for k in d.values})
        bad_keys += [k for k in sorted(set(want) | set(have)) if want.get(k, 0) != have.get(k, 0)]
        for v in values:
            if v.tensor is None:
                n_values += 1
                got = read_value(out / folder, d.values[v.fqn][1]) if v.fqn in d.values else None
                if got != v.value or type(got) is not type(v.value):
                    bad_values.append(v.fqn)
                continue
            total += 1
            t = d.tensors.get(v.fqn)
            if t is None or not share.mine():
                bad += [v.fqn] if t is None else []
                continue
            theirs = d.sources(t)
            if v.key == "step":
                ok = _step_equal(theirs, plan.step)
            else:
                ok = cmp.equal(src.sources(v.source, v.key), theirs, v.tensor.dtype)
            if not ok:
                bad.append(v.fqn)
    checks.append(_tally("each .metadata names exactly the planned keys (dtypes, shapes)", len(bad_keys) or 1,
                         bad_keys) if bad_keys else Check("each .metadata names exactly the planned keys (dtypes, "
                                                          "shapes)", True))
    checks.append(_tally("every tensor equals the checkpoint's value (steps: the optimizer's), bit for bit",
                         total, bad))
    checks.append(_tally("every value (hyper-parameters, parameter lists) reads back as planned", n_values,
                         bad_values))
    return checks


def _step_equal(ranges: list, step) -> bool:
    import struct

    if len(ranges) != 1 or ranges[0].count != 1 or ranges[0].dtype != "float32":
        return False
    with open(ranges[0].path, "rb") as f:
        f.seek(ranges[0].offset)
        return struct.unpack("<f", f.read(4))[0] == float(step)


# ============================================================================================ reshard
def _verify_reshard(plan, src: Checkpoint, out: Path, cmp: Comparer, share: Share) -> list[Check]:
    try:
        new = open_checkpoint(out)
    except CkptError as e:
        return [Check("the output opens as a checkpoint", False, str(e))]
    with new:
        checks = [Check("the output opens as a checkpoint, no problems found", not new.problems,
                        "; ".join(new.problems) or f"tag {new.location.tag}, ZeRO-{new.zero_stage}")]
        ranks = {f.dp_rank for f in new.files if f.kind == "optim_states"}
        checks.append(Check(f"partitioned for {plan.world_size} ranks",
                            (new.partition_count or new.mesh.dp) == plan.world_size and len(ranks) in (0, plan.world_size),
                            f"partition count {new.partition_count}, {len(ranks)} optimizer-state file(s) per set"))
        want = getattr(plan, "to_mesh", None)
        if want is not None:
            checks.append(Check(f"the mesh is pp={want.pp} tp={want.tp} dp={want.dp}",
                                (new.mesh.pp, new.mesh.tp, new.mesh.dp) == (want.pp, want.tp, want.dp),
                                f"pp={new.mesh.pp} tp={new.mesh.tp} dp={new.mesh.dp}"))
        if new.view is None or src.view is None:
            checks.append(Check("the output's model joins", False, "; ".join(new.refusals) or "no model view"))
            return checks
        same = {p.name: (new.view.full_shape(p.name, padded=True), p.trainable, p.tied_to) for p in new.parameters} == \
            {p.name: (src.view.full_shape(p.name, padded=True), p.trainable, p.tied_to) for p in src.parameters} \
            and len(new.parameters) == len(src.parameters)  # the same names (the order is each model view's)
        checks.append(Check("same parameters, shapes, frozen and tied ones", same, f"{len(new.parameters)} parameters"))
        if new.problems or not same:
            return checks
        keys = list(src.optimizer.state_keys) if src.optimizer else []
        trainable = [p for p in src.parameters if p.trainable and not p.tied_to]

        def differ(name: str, dtype: str, key: Optional[str] = None) -> bool:  # compared here if it is ours
            if not share.mine():
                return False  # the full tensors (a padded vocabulary with its padding rows), whatever the meshes
            ranges = src.view.sources(name, key, padded=True)
            return not cmp.equal(ranges, new.view.sources(name, key, padded=True), dtype) or \
                (key is not None and any(not cmp.equal(ranges, copy, dtype)  # every further copy of a whole state
                                         for _, _, copy in new.replica_checks(name, key)))

        bad = [p.name for p in trainable if differ(p.name, "float32")]
        checks.append(_tally("every fp32 master equals the source's, bit for bit", len(trainable), bad))
        for key in keys:
            holders = [p for p in trainable if key in src.state_keys(p.name)]
            bad = [p.name for p in holders if key not in new.state_keys(p.name) or differ(p.name, "float32", key)]
            checks.append(_tally(f"every {key} (and every further copy of it) equals the source's, bit for bit",
                                 len(holders), bad))
        others = [p for p in src.parameters if not p.trainable and not p.tied_to and p.name in src.records.index.frozen]
        bad = [p.name for p in others if differ(p.name, src.frozen_chunks(p.name)[0].dtype_name)]
        bad += [b.name for b in src.buffers if differ(b.name, b.dtype)]
        checks.append(_tally("frozen parameters and buffers equal the source's", len(others) + len(src.buffers), bad))
        def per_parameter(ck: Checkpoint) -> dict:  # whatever groups or sub-groups each side's layout has
            out = {}
            for p in trainable:
                gs = ck.state_group(p.name)
                out[p.name] = (gs.family.name if gs is not None else None, ck.step_of(p.name))
            return out

        step_a, step_b = per_parameter(src), per_parameter(new)
        said = sorted({f"{f} step {s:g}" if s is not None else f"{f} no step" for f, s in step_b.values()})
        checks.append(Check("every parameter's optimizer and step are the source's", step_a == step_b,
                            ", ".join(said) or "no optimizer state"))
    return checks


# ============================================================================================ universal
def _verify_universal(plan, src: Checkpoint, out: Path, cmp: Comparer, share: Share) -> list[Check]:
    latest = out / plan.finals[0].name
    checks = [Check(f"{latest.name} names {plan.universal_tag}",
                    latest.is_file() and latest.read_text().strip() == plan.universal_tag)]
    missing = [f.name for f in plan.files if not (out / f.name).is_file()]
    checks.append(Check("every planned file is there", not missing,
                        f"{len(plan.files)} file(s)" + (f"; missing {', '.join(missing[:MAX_LISTED])}" if missing else "")))
    if missing:
        return checks
    bad, total = [], 0
    keys = list(src.optimizer.state_keys) if src.optimizer else []
    experts = getattr(plan, "experts", None) or {}  # MoE: global name -> [local folder, entry, entries]
    for p in src.parameters:
        if p.tied_to or not p.trainable:
            continue
        folder, entry, entries = experts.get(p.name) or (p.name, None, None)
        shape = tuple(p.shape) if entry is None else (entries, *p.shape)
        for key in [None] + [k for k in keys if k in src.state_keys(p.name)]:  # every key its group keeps
            path = out / plan.universal_tag / "zero" / folder / f"{key or 'fp32'}.pt"
            total += 1
            if not share.mine():
                continue
            if not path.is_file():
                bad.append(f"{p.name}/{key or 'fp32'}")
                continue
            with open_torch_file(path) as tf:
                obj = tf.obj["param"] if isinstance(tf.obj, dict) else tf.obj
                ok = isinstance(obj, TensorHandle) and tuple(obj.shape) == shape and cmp.equal(
                    src.sources(p.name, key), obj.ranges() if entry is None else obj.ranges(entry * p.numel, p.numel),
                    "float32")
            if not ok:
                bad.append(f"{p.name}/{key or 'fp32'}")
    checks.append(_tally("every fp32 master and optimizer state equals the source's, bit for bit", total, bad))
    return checks


def _verify_merge(plan, src: Checkpoint, out: Path, cmp: Comparer, share: Share) -> list[Check]:
    """A peft adapter merged into its base: :func:`ckptlib.analysis.merge_check.merge_tallies`."""
    from .merge_check import merge_tallies  # torch, only for a merge

    return [_tally(what, total, bad) for what, total, bad in merge_tallies(plan, src, out, cmp, share)]


def _verify_average(plan, src: Checkpoint, out: Path, cmp: Comparer, share: Share) -> list[Check]:
    """An average of checkpoints: :func:`ckptlib.analysis.average_check.average_tallies` (every averaged tensor
    recomputed from the sources opened afresh)."""
    from .average_check import average_tallies

    return [_tally(what, total, bad) for what, total, bad in average_tallies(plan, src, out, cmp, share)]


# ============================================================================================ entry points
def verify(plan: Plan, out: Optional[os.PathLike] = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
           progress: Callable[[int], None] = lambda n: None, cancel=None, share: Optional[Share] = None) -> Verification:
    """Re-open the output of ``plan`` (at ``out``, default ``plan.out``) and compare every tensor with the
    source, bit for bit. Returns the checks; :attr:`Verification.ok` says whether all held. With a
    ``share``, only that share of the tensors is compared (join the processes' results with
    :func:`merge_verifications`).

    Memory: two chunks of ``chunk_bytes``, whatever the model size. Reads the whole output and the
    source ranges it was made from.
    """
    out = Path(out if out is not None else plan.out)
    result = Verification(out=out)
    do = {"export": _verify_export, "reshard": _verify_reshard, "universal": _verify_universal,
          "merge": _verify_merge, "average": _verify_average}.get(plan.action)
    if getattr(plan, "format", None) == "dcp":
        do = _verify_dcp
    if do is None:
        raise CkptError(f"cannot verify the output of a {plan.action!r} plan")
    if not out.is_dir():
        result.checks.append(Check("the output folder exists", False, str(out)))
        return result
    cmp = Comparer(chunk_bytes, progress, cancel)
    try:
        with _open_source(plan) as src:
            result.checks = do(plan, src, out, cmp, share or Share()) + _copies(plan, out, cmp)
    finally:
        result.bytes_compared = cmp.compared
        cmp.close()
    return result


class _DcpSource:
    """A DCP checkpoint answering ``sources(name, key)`` as a :class:`Checkpoint` does (an export's source)."""

    def __init__(self, path: str):
        from ..dcp import open_dcp

        self.d = open_dcp(path)

    def sources(self, name: str, key: Optional[str] = None) -> list:
        t = self.d.states[(name, key)] if key else self.d.model[name]
        return self.d.sources(t)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _open_source(plan: Plan):
    if plan.source.flavor == "dcp":
        return _DcpSource(plan.source.save_dir)
    ck = open_checkpoint(plan.source.save_dir, tag=plan.source.tag, tp_rules=plan.source.tp_rules)
    model_type = getattr(plan.source, "model_type", None)
    return ck.in_layout(model_type) if model_type else ck


def free_disk(path: os.PathLike) -> Optional[int]:
    """Free bytes on the file system that would hold ``path`` (its nearest existing ancestor)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


@dataclass(frozen=True)
class Preflight:
    """Whether a plan fits this machine: the memory verdict and the disk (bytes to write vs free)."""

    memory: MemoryVerdict
    disk_needed: int
    disk_free: Optional[int]

    @property
    def disk_ok(self) -> bool:
        return self.disk_free is None or self.disk_needed <= self.disk_free

    @property
    def ok(self) -> bool:
        return self.memory.fits and self.disk_ok

    @property
    def disk_message(self) -> str:
        free = "unknown" if self.disk_free is None else human_bytes(self.disk_free)
        verdict = "fits" if self.disk_ok else "does NOT fit"
        return f"{verdict}: writes {human_bytes(self.disk_needed)}, {free} free"

    def describe(self) -> str:
        return f"memory: {self.memory}\ndisk  : {self.disk_message}"

    def __str__(self) -> str:
        return self.describe()


def preflight(plan: Plan) -> Preflight:
    """The memory and disk verdicts of ``plan`` on this machine (before running it)."""
    return Preflight(memory=memory_verdict(plan.predicted_peak_bytes), disk_needed=plan.file_bytes,
                     disk_free=free_disk(plan.out))


__all__ = ["Check", "Verification", "verify", "Share", "merge_verifications", "Preflight", "preflight", "free_disk"]
