"""The optimizer state of a ZeRO set, group by group: which optimizer (:mod:`ckptlib.kinds.optimizers`), which
keys, how each key lies in the rank files, and the step.

:func:`group_states` reads what parsing unpickled (no tensor bytes but a scalar step's) and proves every key's
layout from the sizes the files record: a per-element key is :data:`~ckptlib.kinds.optimizers.PARTITIONED` when
every rank's tensor is as long as its partition (lean or padded), Muon's ZeRO-1/2 ``momentum_buffer`` is
:data:`~ckptlib.kinds.optimizers.WHOLE_PARAMS` when every rank's is as long as the whole parameters its partition
touches. A key whose sizes fit neither is reported (a :class:`StateProblem` naming the file, the group and the
key), and reading it is refused; nothing is placed by a guess.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..kinds.optimizers import PARTITIONED, UNKNOWN, WHOLE_PARAMS, GroupStates, StateKey, identify
from . import files as fnames
from .records import NO_ZERO, Records
from .values import plain


@dataclass(frozen=True)
class StateProblem:
    """A state key whose stored size fits no layout: ``file`` (relative path), ``group``, ``key``, ``what``."""

    file: str
    group: int
    key: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def state_of(rec: Records, osd: dict, g: int) -> Optional[dict]:
    """Group (ZeRO-3: sub-group) ``g``'s state dict in one rank's ``optimizer_state_dict``, or None."""
    if rec.zero_stage == 3:
        st = ((osd.get("optimizer_state_dict") or {}).get("state") or {}).get(g)
    else:
        base = osd.get("base_optimizer_state")
        if isinstance(base, dict):
            st = (base.get("state") or {}).get(g)
        else:
            st = base[g] if isinstance(base, (list, tuple)) and g < len(base) else None
    return st if isinstance(st, dict) else None


def group_count(rec: Records) -> int:
    """Flat groups (ZeRO-1/2) or sub-groups (ZeRO-3) per rank."""
    if not rec.layouts:
        return 0
    return len(rec.layouts[0].sub_group_sizes) if rec.zero_stage == 3 else len(rec.layouts)


def _hyper(rec: Records, first: dict, g: int) -> dict:
    """The param_groups entry (without ``params``) that group or sub-group ``g`` steps with."""
    if rec.zero_stage == 3:
        inner = first.get("optimizer_state_dict") or {}
        groups = inner.get("param_groups") or []
        owner = _zero3_owner(rec, groups, g)
        pg = groups[owner] if owner is not None else {}
    else:
        base = first.get("base_optimizer_state")
        groups = base.get("param_groups") or [] if isinstance(base, dict) else []
        pg = groups[g] if g < len(groups) else {}
    return {k: v for k, v in pg.items() if k != "params"} if isinstance(pg, dict) else {}


def _zero3_owner(rec: Records, groups: list, k: int) -> Optional[int]:
    """The param group ZeRO-3 sub-group ``k`` belongs to: the one whose ``params`` list holds ``k`` (DeepSpeed
    gives each param group its sub-groups' flat partitions), else the only group."""
    for i, pg in enumerate(groups):
        params = pg.get("params") if isinstance(pg, dict) else None
        if isinstance(params, (list, tuple)) and k in params:
            return i
    return 0 if len(groups) == 1 else None


def _step_value(v: Any) -> Optional[int]:
    if isinstance(v, TensorHandle):
        return int(v.item()) if v.numel == 1 else None
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return int(v)
    return None


def expected_lengths(rec: Records, g: int, dp: int, layout: str) -> tuple:
    """The element counts rank ``dp``'s tensor of a key of group ``g`` laid out as ``layout`` may have."""
    if rec.zero_stage == 3:
        return (rec.layouts[0].sub_group_sizes[g],)
    lay = rec.layouts[g]
    eg = rec.expert_groups.get(g)
    k = dp // eg.ep if eg else dp  # the partition this rank holds (experts: of its expert data group)
    if layout == WHOLE_PARAMS:
        return (lay.whole_params_length(k),)
    return (lay.lean_length(k), lay.partition_size)


def group_states(rec: Records) -> tuple[list[GroupStates], list[StateProblem]]:
    """Every group's :class:`~ckptlib.kinds.optimizers.GroupStates` and the keys whose sizes fit no layout."""
    if rec.flavor == NO_ZERO or not rec.index.optim:
        return [], []
    ranks = sorted(rec.index.optim)
    first = rec.index.optim[ranks[0]]
    names = {f.dp_rank: f.relpath for f in rec.files if f.kind == fnames.OPTIM_STATES}
    swapped = rec.index.swapped
    out, problems = [], []
    for g in range(group_count(rec)):
        states = {r.dp: state_of(rec, rec.index.optim[r], g) for r in ranks}
        sample = next((s for s in states.values() if s), {})
        hyper = _hyper(rec, first, g)
        tensors = [k for k, v in sample.items() if k != "step" and isinstance(v, TensorHandle)]
        for r, s in states.items():  # NVMe offload: the swapped keys are in the swap files
            for (dp, sub), found in swapped.items():
                if dp == r and sub == g:
                    tensors += [k for k in found if isinstance(k, str) and k not in tensors]
        family = identify(tensors, hyper)
        layout = WHOLE_PARAMS if family.whole_params_at_zero12 and rec.zero_stage in (1, 2) else PARTITIONED
        keys = []
        for key in tensors:
            dtype = sample[key].dtype_name if isinstance(sample.get(key), TensorHandle) else "float32"
            keys.append(StateKey(key, layout, dtype))
            for dp, st in states.items():
                t = (st or {}).get(key)
                if (dp, g) in swapped and key in swapped[(dp, g)]:
                    continue
                want = expected_lengths(rec, g, dp, layout)
                if not isinstance(t, TensorHandle):
                    if want == (0,):
                        continue  # a rank whose partition touches none of the group's parameters keeps none
                    continue  # a missing key is check_state_keys' problem
                if t.numel not in want:
                    how = ("the whole parameters its partition touches" if layout == WHOLE_PARAMS else
                           "its partition" + (" (lean or padded)" if rec.zero_stage != 3 else ""))
                    problems.append(StateProblem(
                        names.get(dp, f"dp rank {dp}"), g, key,
                        f"the '{key}' state of group {g} ({family.label}) on dp rank {dp} holds {t.numel} "
                        f"elements; {how} need{'s' if layout != WHOLE_PARAMS else ''} "
                        f"{' or '.join(map(str, dict.fromkeys(want)))}, so its elements cannot be placed"))
        step = None
        if family.steps or family is UNKNOWN:
            step = _step_value(sample.get("step"))
            if step is None and "step" not in sample:
                step = _step_value(first.get("base_optimizer_state_step"))
        name = hyper.get("name")
        out.append(GroupStates(group=g, family=family, keys=tuple(keys), step=step,
                               name=str(name) if isinstance(name, str) else None))
    return out, problems


def placed_key(opt, group: Optional[int], name: str, key: str, where) -> StateKey:
    """How state ``key`` of trainable parameter ``name`` of optimizer group ``group`` is kept (``opt``: an
    :class:`~ckptlib.deepspeed.records.OptimizerInfo`; ``where``: the tag folder, for messages).

    Raises:
        KeyError: the group keeps no ``key``.
        UnsupportedCheckpointError: the key's stored sizes fit no layout (the problems name the files)."""
    gs = opt.group(group) if opt is not None else None
    if gs is None:
        if opt is not None and key in opt.state_keys:
            return StateKey(key)
        raise KeyError(f"the optimizer state has no '{key}' for {name}")
    found = gs.key(key)
    if found is None:
        raise KeyError(f"{name} is in {gs.label}, which keeps no '{key}' (it keeps "
                       f"{', '.join(gs.key_names) or 'no per-element state'})")
    bad = opt.unplaceable(group, key)
    if bad:
        raise UnsupportedCheckpointError(f"the '{key}' state of {gs.label} cannot be placed: "
                                         + "; ".join(map(str, bad)), path=where,
                                         hint="the files are damaged, or this optimizer's layout is not known to "
                                              "ckptlib; the weights export without --states")
    return found


def stage0_states(base: dict) -> list[GroupStates]:
    """Stage 0's groups (a torch optimizer's state_dict ``base``: per parameter, whole): their family and keys."""
    state = base.get("state") or {}
    out = []
    for g, pg in enumerate(base.get("param_groups") or []):
        if not isinstance(pg, dict):
            continue
        keys, step = [], None
        for pid in pg.get("params") or []:
            st = state.get(pid)
            if not isinstance(st, dict):
                continue
            for k, v in st.items():
                if k != "step" and isinstance(v, TensorHandle) and k not in [x.name for x in keys]:
                    keys.append(StateKey(k, PARTITIONED, v.dtype_name))
            if step is None:
                step = _step_value(st.get("step"))
        hyper = {k: plain(v) for k, v in pg.items() if k != "params"}
        family = identify([k.name for k in keys], hyper)
        out.append(GroupStates(group=g, family=family, keys=tuple(keys),
                               step=step if family.steps or family is UNKNOWN else None,
                               name=hyper.get("name") if isinstance(hyper.get("name"), str) else None))
    return out


__all__ = ["StateProblem", "placed_key", "state_of", "group_count", "expected_lengths", "group_states", "stage0_states"]
