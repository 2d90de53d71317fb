"""What ``ckpt check`` looks at, decided from a checkpoint's metadata (plain data for the plan).

- :func:`stats_items`: every fp32 master (and frozen parameter as stored), with ``states`` every
  per-element optimizer state, as range lists; beside each master, where the saved 16-bit weight is
  when the checkpoint holds both (ZeRO-0/1/2, BF16_Optimizer), to compare it with the master cast to
  the training dtype while the master streams.
- :func:`step_items`: the optimizer step of every rank and (sub-)group: a number, or where its tensor is.
- :func:`layout_problems`: what the files record about padding (``group_paddings``,
  ``param_slice_mappings``, the lengths of the optimizer states) against the layout arithmetic of
  :mod:`ckptlib.layout.flat`, so that no padding region covers parameter elements.

Steps and padding are looked at in every ZeRO set (each pipeline stage, each tensor rank); an MoE
expert group is partitioned over its expert data-parallel group (``partition_count`` of that group),
so a data rank ``r`` holds partition ``r // ep`` of its experts. Nothing here reads tensor data.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from ..deepspeed import NO_ZERO, Checkpoint
from ..deepspeed import exactness
from ..deepspeed.moe import global_name
from ..dtypes import is_floating
from ..errors import IncompleteCheckpointError, UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..kinds.optimizers import MEANINGS
from .scan import Problem


@dataclass(frozen=True)
class StatsItem:
    """One tensor to stream: ``key`` (name, or ``<state>/<name>``), ``kind`` (``trainable``, ``frozen``,
    ``state``, ``buffer``: floating buffers), stored dtype, shape, ranges; ``lowp``: the ranges of the saved 16-bit (training dtype)
    weight of a master, compared with the master cast to ``lowp_dtype``; ``replicas``: ``(what, ranges,
    replica ranges)`` for each further copy another stage or tensor rank stores (a tied layer on several
    stages, a tensor replicated across tensor ranks), which must hold the same bytes; ``never_negative``:
    for a state its optimizer keeps at or above zero (a second moment, a sum of squares), why (a value below
    zero is then a problem), else empty."""

    key: str
    kind: str
    dtype: str
    shape: tuple
    ranges: tuple
    state: Optional[str] = None
    lowp: tuple = ()
    lowp_dtype: Optional[str] = None
    replicas: tuple = ()
    never_negative: str = ""


@dataclass(frozen=True)
class StepItem:
    """The optimizer step of ``group`` on data rank ``rank`` of model-parallel rank ``mp`` (its stage or
    tensor rank; ``where`` says which, e.g. ``pp 1, dp rank 0``), in file ``file``: ``value`` when it is
    a number, else the range of its one-element tensor."""

    rank: int
    group: int
    file: str
    value: Optional[float] = None
    ranges: tuple = ()
    mp: int = 0
    where: str = ""

    @property
    def key(self) -> tuple:
        return self.mp, self.rank, self.group


def file_labels(ck: Checkpoint) -> dict:
    """``{absolute path: path relative to what the user gave}`` for every file of the checkpoint."""
    return {os.fspath(f.path): f.relpath for f in ck.files}


def saved_weights_view(ck: Checkpoint):
    """The checkpoint's model view with the saved module weights in place of the fp32 masters: its
    ``sources(name)`` gives the 16-bit (training dtype) weights of every stage, tensor rank or expert
    file, in the element order of the master. None where the module holds no separate copies (ZeRO-3
    placeholders) or no view could be made."""
    view = getattr(ck, "view", None)
    if ck.zero_stage == 3 or view is None:
        return None
    sets = ck.sets

    def resolve(source, key):
        mp, name = source
        return sets[mp].module_tensor(name).ranges()

    return dataclasses.replace(view, resolve=resolve)


def _saved_weight(saved, name: str, numel: int, master: tuple) -> tuple[tuple, Optional[str]]:
    """The saved module weight of a trainable parameter when it is a separate copy of the master."""
    if saved is None:
        return (), None
    try:
        ranges = tuple(saved.sources(name))
    except (KeyError, ValueError, IndexError):  # no such module entry, or it has another shape
        return (), None
    dtypes = {r.dtype for r in ranges if hasattr(r, "path")}
    if len(dtypes) != 1 or sum(r.count for r in ranges) != numel or not is_floating(next(iter(dtypes))):
        return (), None
    return ((), None) if ranges == master else (ranges, dtypes.pop())


def replica_pairs(ck: Checkpoint, name: str, key: Optional[str] = None) -> tuple:
    """``(what, ranges, replica ranges)`` for every further copy of tensor ``name`` (``key``: an optimizer
    state): tensor-parallel replicas and the copies of a pipeline's tied layer in the later stages that hold
    it (:meth:`Checkpoint.replica_checks`; the model reads the first)."""
    try:
        return tuple((what, tuple(a), tuple(b)) for what, a, b in ck.replica_checks(name, key))
    except KeyError:  # a replica without this optimizer state: nothing to compare
        return ()


def stats_items(ck: Checkpoint, states: bool = False, notes: Optional[list] = None) -> list[StatsItem]:
    out: list[StatsItem] = []
    skipped = []
    saved = saved_weights_view(ck)
    for p in ck.parameters:
        if p.tied_to:
            continue
        try:
            ranges = tuple(ck.sources(p.name))
        except IncompleteCheckpointError:  # a frozen parameter saved with exclude_frozen_parameters
            skipped.append(p.name)
            continue
        dtype = ranges[0].dtype if ranges else "float32"
        lowp, lowp_dtype = _saved_weight(saved, p.name, p.numel, ranges) if p.trainable else ((), None)
        out.append(StatsItem(p.name, "trainable" if p.trainable else "frozen", dtype, tuple(p.shape), ranges,
                             lowp=lowp, lowp_dtype=lowp_dtype, replicas=replica_pairs(ck, p.name)))
    if skipped and notes is not None:
        notes.append(f"no data saved for {', '.join(skipped)} (exclude_frozen_parameters): not checked")
    for b in ck.buffers:  # a NaN in a running variance is a health problem too (integer buffers hold no NaN)
        if not is_floating(b.dtype):
            continue
        ranges = tuple(ck.sources(b.name))
        out.append(StatsItem(b.name, "buffer", b.dtype, tuple(b.shape), ranges, replicas=replica_pairs(ck, b.name)))
    if states and ck.optimizer:
        for key in ck.optimizer.state_keys:
            for p in ck.parameters:
                if not p.trainable or p.tied_to or key not in ck.state_keys(p.name):
                    continue
                try:
                    ranges = tuple(ck.sources(p.name, key))
                except KeyError:  # stage 0: an optimizer entry without this key
                    continue
                except UnsupportedCheckpointError as e:  # ZeRO-0: which parameter's state it is is not known
                    if notes is not None and e.message not in notes:
                        notes.append(f"{key}/{p.name} not checked: {e.message}")
                    continue
                if ranges and is_floating(ranges[0].dtype):
                    out.append(StatsItem(f"{key}/{p.name}", "state", ranges[0].dtype, tuple(p.shape), ranges, key,
                                         replicas=replica_pairs(ck, p.name, key),
                                         never_negative=never_negative(ck.state_group(p.name), key)))
    return out


def never_negative(group, key: str) -> str:
    """Why state ``key`` of an optimizer group (a :class:`~ckptlib.kinds.optimizers.GroupStates`) cannot be below
    zero ("Adam/AdamW's exp_avg_sq (a running mean of squared gradients) is never negative"), or "" where it
    can (momentum is signed) or the group is not known."""
    if group is None or key not in group.family.nonnegative:
        return ""
    return f"{group.family.label}'s {key} ({MEANINGS.get(key, 'a sum of squares')}) is never negative"


def groups_of(zs) -> int:
    """Flat groups (ZeRO-1/2) or sub-groups (ZeRO-3) per rank of a checkpoint or ZeRO set."""
    return len(zs.layouts[0].sub_group_sizes) if zs.zero_stage == 3 else len(zs.layouts)


def zero_sets(ck: Checkpoint) -> list:
    """``(mp, set)`` for each ZeRO set (one for data parallelism; one per stage or tensor rank)."""
    return sorted(ck.sets.items())


def step_items(ck: Checkpoint, notes: Optional[list] = None) -> list[StepItem]:
    if ck.flavor == NO_ZERO or not ck.layouts:
        if notes is not None:
            notes.append("stage 0: one optimizer, no ranks or sub-groups whose steps could differ")
        return []
    out = []
    for mp, zs in zero_sets(ck):
        for rank in sorted(zs.records.index.optim):
            path = os.fspath(zs.optim_states_file(rank).path)
            for g in range(groups_of(zs)):
                try:
                    step = zs.partition_tensor(rank, g, "step")
                except KeyError:
                    continue
                if isinstance(step, TensorHandle) and step.numel == 1:
                    out.append(StepItem(rank.dp, g, path, ranges=tuple(step.ranges()), mp=mp, where=str(rank)))
                elif isinstance(step, (int, float)):
                    out.append(StepItem(rank.dp, g, path, value=float(step), mp=mp, where=str(rank)))
    return out


# ============================================================================================ padding
def _overlaps(lay, lo: int, hi: int) -> list[tuple[str, int, int]]:
    """Parameter elements in ``[lo, hi)`` of a flat group: ``(name, first, end)`` in the parameter."""
    out = []
    for s in lay.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            out.append((s.name, a - s.offset, b - s.offset))
    return out


def _flat_problems(ck: Checkpoint, label: dict, notes: Optional[list]) -> list[Problem]:
    out: list[Problem] = []
    round_robin = bool((ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"))
    if round_robin and notes is not None:
        notes.append("saved with round_robin_gradients: param_slice_mappings are not compared with the layout "
                     "(DeepSpeed computes them in the natural order, not the round-robin order of the flat groups)")
    for _, zs in zero_sets(ck):
        experts = zs.records.expert_groups
        for rank in sorted(zs.records.index.optim):
            r, osd = rank.dp, zs.optimizer_state_dict(rank)
            file = label.get(os.fspath(zs.optim_states_file(rank).path), "")
            pads = osd.get("group_paddings")
            maps = osd.get("param_slice_mappings")
            for g, lay in enumerate(zs.layouts):
                eg = experts.get(g)
                k = r // eg.ep if eg else r  # the partition this rank holds (experts: of its expert data group)
                who = f"{rank}" + (f" (partition {k} of its {eg.edp} expert data-parallel ranks)" if eg else "")
                named = (lambda n, e=r % eg.ep, m=eg.num_local: global_name(str(n), e, m)) if eg else str
                part = lay.partition_size
                if isinstance(pads, (list, tuple)) and g < len(pads) and isinstance(pads[g], int) and pads[g] > 0:
                    end = (k + 1) * part
                    for name, a, b in _overlaps(lay, end - pads[g], end):
                        name = named(name)  # an expert: by its global id
                        out.append(Problem(name, file, f"group {g}: the file records {pads[g]} padding elements at "
                                           f"the end of {who}'s partition, but elements {a}..{b} of {name} lie "
                                           f"there by the layout of param_shapes at {lay.world_size} ranks "
                                           f"({lay.tail_padding(k)} padding elements)"))
                if not round_robin and isinstance(maps, (list, tuple)) and g < len(maps) and isinstance(maps[g], dict):
                    out += _mapping_problems(lay, k, g, maps[g], file, who, named)
    return out


def state_problems(ck: Checkpoint) -> list[Problem]:
    """Optimizer states whose stored sizes fit no layout of their optimizer (:mod:`ckptlib.deepspeed.states`:
    partition-sized per-element keys, Muon's whole matrices per rank at ZeRO-1/2)."""
    return [Problem(f"{p.key}/group {p.group}", p.file, p.what)
            for _, zs in zero_sets(ck) if zs.optimizer for p in zs.optimizer.state_problems]


def _mapping_problems(lay, k: int, g: int, recorded: dict, file: str, who: str, named=str) -> list[Problem]:
    """``param_slice_mappings`` of group ``g`` recorded in partition ``k`` (held by ``who``) against the
    layout; ``named`` gives a problem's tensor name (an expert's global one) from the recorded name."""
    out = []
    want = lay.slice_mappings(k)
    padding = [(s.rank_start, s.rank_start + s.count) for s in lay.segments(k) if s.is_padding]
    for name, addr in recorded.items():
        start, count = getattr(addr, "start", None), getattr(addr, "numel", None)
        if not isinstance(start, int) or not isinstance(count, int):
            out.append(Problem(named(name), file, f"group {g}: its param_slice_mappings entry is not a fragment "
                               f"address ({type(addr).__name__}): the file is damaged"))
            continue
        if want.get(name) == (start, count):
            continue
        covered = sum(max(0, min(b, start + count) - max(a, start)) for a, b in padding)
        where = want.get(name)
        out.append(Problem(named(name), file, f"group {g}: param_slice_mappings puts it at {start}..{start + count} of "
                           f"{who}'s partition, the layout at "
                           + (f"{where[0]}..{where[0] + where[1]}" if where else "no place on this rank")
                           + (f"; {covered} of those elements are padding" if covered else "")))
    return out


def identity_problems(ck: Checkpoint) -> list[Problem]:
    """Rank files that were saved as another file, or hold another rank's partition byte for byte
    (:mod:`ckptlib.deepspeed.exactness`; the paddings and mappings are :func:`layout_problems`)."""
    out = []
    for f in exactness.saved_as(ck) + exactness.duplicates(ck):
        out += [Problem("file", file, f.what) for file in f.files]
    return out


def layout_problems(ck: Checkpoint, label: dict, notes: Optional[list] = None) -> list[Problem]:
    """Padding the files record that covers parameter elements, by the layout arithmetic."""
    if ck.flavor == NO_ZERO or not ck.layouts:
        return []
    return state_problems(ck) + ([] if ck.zero_stage == 3 else _flat_problems(ck, label, notes))


__all__ = ["StatsItem", "StepItem", "file_labels", "stats_items", "step_items", "layout_problems", "identity_problems",
           "groups_of",
           "zero_sets", "saved_weights_view", "replica_pairs"]
