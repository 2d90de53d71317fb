"""ZeRO-0 (no partitioning): which module parameter each optimizer entry is, when the files name none.

Each ``build_*`` of :mod:`.partitions` fills the records of its kind; :func:`build_stage0` is stage 0's.
"""
from __future__ import annotations

import re
from typing import Any, Optional

from ..io.torchzip import TensorHandle
from .moe import expert_id
from .partitions import aliases_by_storage, collect_parameters
from .records import Records


def build_stage0(rec: Records, model: dict, expert_optimizers: Optional[dict] = None) -> None:
    """ZeRO-0 names nothing: each optimizer group lists its tensors by position only. DeepSpeed builds the
    groups from the module's parameters in module order, dense and expert groups apart (MoE: each
    expert-parallel rank's ``expp_rank_{e}`` optimizer holds the dense groups and its own experts'), so each
    group's entries are matched, in order and by shape, to the parameters of its kind (:func:`_match`).
    Every entry must find its parameter, and only one way: a match that is not unique, or an entry that
    fits none, is a problem (the checkpoint is refused), never a guess. Parameters in no group are frozen."""
    module = rec.index.module
    buffers = set(model.get("buffer_names") or [])
    opt = model.get("optimizer")
    rec.index.stage0_optimizer = opt if isinstance(opt, dict) else {}
    aliases = aliases_by_storage(module, buffers)
    names = [n for n, t in module.items() if isinstance(t, TensorHandle) and n not in buffers and n not in aliases]
    shapes = {n: tuple(module[n].shape) for n in names}
    trainable: dict[str, tuple] = {}
    groups = _stage0_groups(opt)
    if groups is None:
        for n in names:
            trainable[n] = (shapes[n], 0)
    else:
        dense = [n for n in names if expert_id(n) is None]
        mine = [(g, entries) for g, (entries, moe) in enumerate(groups) if not moe]
        if any(moe for _, moe in groups) and not expert_optimizers:
            rec.problems.append("ZeRO-0: the optimizer has expert groups but there is no expp_rank_* optimizer file")
        found = _match(mine, dense, shapes, "the module's dense parameters", rec.problems, rec.index.stage0_ambiguous)
        for name, (g, i) in found.items():
            trainable[name] = (shapes[name], g)
            rec.index.stage0[name] = (g, i)
    if expert_optimizers:
        _stage0_experts(rec, model, names, shapes, expert_optimizers, trainable)
    frozen = [n for n in names if n not in trainable]
    if frozen and groups is not None:
        rec.notes.append(f"ZeRO-0: {', '.join(frozen)} in no optimizer group: frozen (its values are the module's "
                         "as saved)")
    collect_parameters(rec, model, trainable, {}, aliases)


def _match(groups: list, names: list, shapes: dict, what: str, problems: list,
           ambiguous: Optional[dict] = None) -> dict:
    """``{name: (group, index)}`` for the entries of ``groups`` (``[(group, [shape, ...]), ...]``), each group
    matched in order to a subsequence of ``names`` (module order). Every shape's entries must lie in one
    group (groups are then filled independently), else a problem and nothing. Within a group the leftmost
    match is taken; where the rightmost one differs, another match exists (a parameter in no group with
    the shape of one in the group: frozen, or trainable?), and ``ambiguous`` gets ``{taken: other}``: the
    caller proves the choice from the values or refuses."""
    owner: dict = {}
    for g, entries in groups:
        for shape in entries:
            if owner.setdefault(shape, g) != g:
                problems.append(f"ZeRO-0 records no names and optimizer groups {owner[shape]} and {g} both hold "
                                f"tensors of shape {list(shape)}: which of {what} each one is cannot be told "
                                "from the files")
                return {}
    out: dict = {}
    for g, entries in groups:
        wanted = set(entries)
        pool = [n for n in names if shapes[n] in wanted]
        left = _subsequence(entries, pool, shapes)
        if left is None:
            i = _first_unmatched(entries, pool, shapes)
            problems.append(f"ZeRO-0: optimizer group {g} entry {i} of shape {list(entries[i])} matches none of "
                            f"{what} (in module order)")
            return {}
        right = _subsequence(entries[::-1], pool[::-1], shapes)[::-1]
        out.update((n, (g, i)) for i, n in enumerate(left))
        if ambiguous is not None:  # another match exists: the leftmost is kept, and proven or refused later
            ambiguous.update((a, b) for a, b in zip(left, right) if a != b)
    return out


def _subsequence(entries: list, pool: list, shapes: dict) -> Optional[list]:
    """The leftmost names of ``pool`` whose shapes are ``entries`` in order, or None."""
    out, pos = [], 0
    for shape in entries:
        while pos < len(pool) and shapes[pool[pos]] != shape:
            pos += 1
        if pos == len(pool):
            return None
        out.append(pool[pos])
        pos += 1
    return out


def _first_unmatched(entries: list, pool: list, shapes: dict) -> int:
    pos = 0
    for i, shape in enumerate(entries):
        while pos < len(pool) and shapes[pool[pos]] != shape:
            pos += 1
        if pos == len(pool):
            return i
        pos += 1
    return len(entries) - 1


def _stage0_experts(rec: Records, model: dict, names: list, shapes: dict, optimizers: dict, trainable: dict) -> None:
    """ZeRO-0 MoE: expert-parallel rank ``e``'s optimizer (``expp_rank_{e}``) holds the dense groups and its own
    experts' groups (``'moe': True``, named ``ep_size_E``); each expert group is matched to rank ``e``'s
    experts (global ids ``e*L .. e*L+L-1`` of every MoE layer, ``L`` = experts per layer / E) in module
    order, and every expert of every rank must be matched."""
    rec.index.stage0_optimizers = dict(optimizers)
    counts = model.get("num_experts")
    counts = [int(c) for c in counts] if isinstance(counts, (list, tuple)) else []
    layer_of: dict = {}
    for n in names:
        if expert_id(n) is not None:
            layer_of.setdefault(n[:n.index("experts.deepspeed_experts.")], len(layer_of))
    experts = [n for n in names if expert_id(n) is not None]
    for e in sorted(optimizers):
        groups = _stage0_groups(optimizers[e]) or []
        sizes = [re.match(r"ep_size_(\d+)$", str(nm)) for nm in _group_names(optimizers[e])]
        ep = next((int(m.group(1)) for m in sizes if m), len(optimizers))
        mine = []
        for n in experts:
            layer = layer_of[n[:n.index("experts.deepspeed_experts.")]]
            per = (counts[layer] if layer < len(counts) else 0) // max(ep, 1)
            if per and expert_id(n) // per == e:
                mine.append(n)
        entries = [(g, shapes_) for g, (shapes_, moe) in enumerate(groups) if moe]
        found = _match(entries, mine, shapes, f"the experts of expert-parallel rank {e}", rec.problems,
                       rec.index.stage0_ambiguous)
        for name, (g, i) in found.items():
            trainable[name] = (shapes[name], g)
            rec.index.stage0[name] = (g, i, e)
        if found and len(found) != len(mine):
            rec.problems.append(f"expp_rank_{e}: its optimizer holds {len(found)} of the {len(mine)} expert tensors "
                                f"of expert-parallel rank {e}")
    missing = [n for n in experts if n not in trainable]
    if missing and not any("ZeRO-0" in p or "expp_rank" in p for p in rec.problems):
        rec.problems.append(f"ZeRO-0: no expp_rank_* optimizer holds {', '.join(missing[:3])}"
                            + (f" and {len(missing) - 3} more expert tensors" if len(missing) > 3 else ""))


def _group_names(opt: Any) -> list:
    inner = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else {}
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    return [g.get("name") for g in groups if isinstance(g, dict)] if isinstance(groups, (list, tuple)) else []


def _stage0_groups(opt: Any) -> Optional[list[tuple[list[tuple], bool]]]:
    """``[(shapes of the tensors the group holds, in order; whether it is an expert group), ...]`` of a
    stage-0 optimizer, or None when its shapes cannot be learnt (no state saved yet)."""
    if not isinstance(opt, dict):
        return None
    inner = opt.get("optimizer_state_dict", opt)
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    groups = [g for g in groups if isinstance(g, dict)] if isinstance(groups, (list, tuple)) else []
    moe = [bool(g.get("moe")) for g in groups]
    if "fp32_groups" in opt:
        fp32 = opt["fp32_groups"] if isinstance(opt["fp32_groups"], (list, tuple)) else []
        return [([tuple(t.shape) for t in g if isinstance(t, TensorHandle)], moe[k] if k < len(moe) else False)
                for k, g in enumerate(fp32)]
    state = inner.get("state") or {}
    out = []
    for k, g in enumerate(groups):
        shapes = []
        for pid in g.get("params", []):
            s = state.get(pid) or {}
            t = next((v for key, v in s.items() if key != "step" and isinstance(v, TensorHandle)), None)
            if t is None:
                return None  # no state to learn shapes from
            shapes.append(tuple(t.shape))
        out.append((shapes, moe[k]))
    return out


__all__ = ["build_stage0"]
