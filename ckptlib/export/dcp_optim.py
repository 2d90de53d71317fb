"""The optimizer state of a DCP export: each DeepSpeed group's state under the keys and hyper-parameters of the
torch optimizer that keeps the same state (:mod:`ckptlib.kinds.optimizers`), so that FSDP2 with that optimizer
loads it exactly.

- Adam/AdamW groups (also the Adam half of a Muon run) -> ``torch.optim.AdamW`` (``exp_avg``, ``exp_avg_sq``,
  ``step``); SGD -> ``SGD`` (``momentum_buffer``); Adagrad -> ``Adagrad`` (``sum``, ``step``), DeepSpeed's CPU
  Adagrad too (its ``exp_avg_sq`` is torch's ``sum``); RMSprop -> ``RMSprop``; Muon's matrix groups ->
  ``torch.optim.Muon`` (``momentum_buffer``).
- Refused, before anything is written, with the reason the vocabulary gives: Adafactor (torch keeps a matrix's
  second moment factored), Lion (torch has none), an optimizer ckptlib does not know.

Every per-element state is written in fp32 under the parameter's FQN (``optimizer.state.<fqn>.<key>``); the
step, where the optimizer counts one, as the 0-dim float32 tensor torch keeps. Each group carries the
hyper-parameters torch's class keeps (a DCP load needs every key its optimizer's state dict has): DeepSpeed's own
values, and for those a DeepSpeed-built group does not record (Muon's Newton-Schulz settings, AdamW's switches)
the values DeepSpeed's implementation fixes. Groups are ordered by torch class in the order the classes first
appear, then in DeepSpeed's order: a script with several optimizers (``torch.optim.Muon`` for the matrices,
``AdamW`` for the rest) loads them with ``get_state_dict(model, [muon, adamw])`` in that order.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Optional

from ..deepspeed import Checkpoint
from ..deepspeed.records import NO_ZERO
from ..errors import UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..io.torchzip.specs import NewTensor
from ..kinds.optimizers import UNKNOWN
from ..mesh import Rank

#: the DeepSpeed config's optimizer types whose Adam weight decay is decoupled unless ``adam_w_mode`` says not
#: (DeepSpeed's ADAM_W_MODE_DEFAULT is True; "AdamW" always is)
_ADAM_W_TYPES = {"adamw": None, "adam": True, "muon": True}
HINT = "export the model only (without --optimizer)"


@dataclass
class Value:
    """One flattened entry of a DCP folder: its key, the nested path it came from, and a planned
    tensor (``source``/``key``: what it holds in the checkpoint) or a plain Python ``value``."""

    fqn: str
    path: tuple
    tensor: Optional[NewTensor] = None
    value: Any = None
    source: Optional[str] = None
    key: Optional[str] = None


def hyper_value(v: Any, what: str) -> Any:
    """A hyper-parameter as a plain value (a 0-dim tensor is read; betas as the tuple torch keeps)."""
    if isinstance(v, TensorHandle):
        if v.numel != 1:
            raise UnsupportedCheckpointError(f"{what} is a tensor of {v.numel} elements")
        return v.item()
    if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
        return tuple(v)
    if v is None or isinstance(v, (bool, int, float, str, tuple)):
        return v
    raise UnsupportedCheckpointError(f"{what} is a {type(v).__name__}, which DCP cannot carry as a plain value")


def _base_groups(ck: Checkpoint, mp: int) -> list[dict]:
    """The base optimizer's parameter groups of model-parallel rank ``mp``'s set, with ``params``."""
    zs = ck.sets[mp]
    if ck.universal is not None:  # one optimizer group per parameter group (its hyper-parameters, as saved)
        return [dict(h, params=[g]) for g, h in enumerate(ck.universal.param_groups)]
    if ck.flavor == NO_ZERO:
        opt = zs.records.index.stage0_optimizer or {}
        inner = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else {}
    else:
        osd = ck.optimizer_state_dict(Rank(dp=0, pp=mp // ck.mesh.tp, tp=mp % ck.mesh.tp))  # mp = stage * tp + tp rank
        inner = osd.get("optimizer_state_dict") if "optimizer_state_dict" in osd else osd.get("base_optimizer_state")
    groups = (inner or {}).get("param_groups") or []
    return [dict(g) for g in groups]


def _owner_set(ck: Checkpoint, name: str) -> int:
    if ck.view is None:
        return min(ck.sets)
    src = ck.view.blocks[name][0].source
    return src[0] if isinstance(src, tuple) else min(ck.sets)


def _group_of(ck: Checkpoint, p, groups: list[dict]) -> int:
    """The index (in ``groups``) of the base optimizer group that steps parameter ``p``."""
    if ck.flavor == NO_ZERO:
        g = ck.sets[_owner_set(ck, p.name)].records.index.stage0.get(p.name)
        if g is None:
            raise UnsupportedCheckpointError(f"{p.name}: not found in the optimizer's parameter groups")
        return g[0]
    found = [i for i, grp in enumerate(groups) if p.group in (grp.get("params") or [])]
    if len(found) != 1:
        raise UnsupportedCheckpointError(f"{p.name}: its flat group {p.group} is in {len(found)} parameter groups")
    return found[0]


def _family(ck: Checkpoint, p):
    """The optimizer family of ``p``'s group, refused where torch has no optimizer keeping the same state."""
    gs = ck.state_group(p.name)
    fam = gs.family if gs is not None else UNKNOWN
    if fam.torch is None or fam is UNKNOWN:
        what = gs.label if gs is not None else f"the optimizer group of {p.name}"
        raise UnsupportedCheckpointError(f"{what} cannot be carried to a torch optimizer: {fam.not_torch}",
                                         path=ck.location.tag_dir, hint=HINT)
    return fam


def _decoupled(ck: Checkpoint) -> Optional[bool]:
    """Whether a DeepSpeed-built Adam group decays weights AdamW's way (from the config's optimizer type)."""
    opt = ck.ds_config.get("optimizer") if isinstance(ck.ds_config.get("optimizer"), dict) else {}
    kind = str(opt.get("type", "")).lower()
    if kind not in _ADAM_W_TYPES:
        return None
    if _ADAM_W_TYPES[kind] is None:
        return True
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    return bool(params.get("adam_w_mode", _ADAM_W_TYPES[kind]))


def _torch_group(ck: Checkpoint, fam, hps: dict, name: str) -> dict:
    """DeepSpeed's hyper-parameters ``hps`` of a group of ``fam`` completed to what torch's class keeps."""
    out = dict(hps)
    for k, v in fam.torch_fills:
        out.setdefault(k, v)
    if fam.torch == "AdamW" and "decoupled_weight_decay" not in out:
        mode = out.pop("adam_w_mode", None)
        mode = _decoupled(ck) if mode is None else bool(mode)
        if mode is not None:
            out["decoupled_weight_decay"] = mode
    missing = [k for k in fam.torch_hyper if k not in out]
    if missing:
        raise UnsupportedCheckpointError(
            f"the optimizer group of {name} ({fam.label}) does not record {', '.join(missing)}, which torch's "
            f"{fam.torch} keeps: ckptlib cannot say how the run set them (it holds {', '.join(sorted(hps))})",
            path=ck.location.tag_dir, hint=HINT)
    return out


def optimizer_groups(ck: Checkpoint, trainable: list) -> tuple[list[dict], dict, list]:
    """``(groups, group of each trainable parameter, torch family of each group)``: DeepSpeed's groups with their
    hyper-parameters in torch's terms (without ``params``), equal groups of several stages or tensor ranks as one,
    ordered by torch class (in the order the classes first appear), then in DeepSpeed's order."""
    per_set = {mp: _base_groups(ck, mp) for mp in sorted(ck.sets)}
    found = {}
    for p in trainable:
        mp = _owner_set(ck, p.name)
        g = _group_of(ck, p, per_set[mp])
        fam = _family(ck, p)
        hps = {k: hyper_value(v, f"{p.name}: hyper-parameter {k!r}") for k, v in per_set[mp][g].items()
               if k != "params"}
        hps = _torch_group(ck, fam, hps, p.name)
        found[p.name] = ((g, fam.torch, repr(sorted(hps.items()))), hps, fam)
    idents = sorted({ident for ident, _, _ in found.values()})  # DeepSpeed's group order
    classes = list(dict.fromkeys(ident[1] for ident in idents))
    idents.sort(key=lambda ident: classes.index(ident[1]))  # stable: DeepSpeed's order within each class
    out = [next(h for i, h, _ in found.values() if i == ident) for ident in idents]
    member = {name: idents.index(ident) for name, (ident, _, _) in found.items()}
    return out, member, [next(f for i, _, f in found.values() if i == ident) for ident in idents]


def torch_settings(groups: list[dict], families: list) -> tuple[list[dict], list[str]]:
    """Per group, the hyper-parameters that decide which state keys its torch optimizer keeps (SGD's ``momentum``,
    RMSprop's ``momentum`` and ``centered``, AdamW's ``amsgrad``), and the notes that tell a loading script to build
    its optimizers with them: a DCP load fills only the state an optimizer already keeps."""
    settings = [{k: g[k] for k in fam.torch_state_hyper if k in g} for g, fam in zip(groups, families)]
    notes = []
    for cls in dict.fromkeys(f.torch for f in families):
        mine = [s for s, f in zip(settings, families) if f.torch == cls]
        if any(mine):
            said = ", ".join(dict.fromkeys(", ".join(f"{k}={v!r}" for k, v in s.items()) for s in mine))
            notes.append(f"build torch's {cls} with {said} as the run's groups have them: a DCP load fills only the "
                         f"state an optimizer already keeps, and {cls} keeps "
                         + ("momentum_buffer only with momentum above zero" if cls == "SGD" else
                            "momentum_buffer only with momentum above zero and grad_avg only when centered"
                            if cls == "RMSprop" else "max_exp_avg_sq only with amsgrad"))
    return settings, notes


def initial_lr(groups: list[dict], run: dict) -> list[str]:
    """torch's LR schedulers keep each group's base lr as ``initial_lr``, and a loader whose optimizer has a
    scheduler (torchtitan always builds one) expects it in the checkpoint. DeepSpeed's groups have it when
    the run used a torch scheduler; a run without any scheduler never changed its lr, so the base lr is
    the lr. With a DeepSpeed scheduler and no ``initial_lr`` it is not known: left out, said in a note."""
    if all("initial_lr" in g for g in groups):
        return []
    if run.get("lr_scheduler") is not None:
        return ["the parameter groups have no initial_lr (DeepSpeed's own scheduler ran): an optimizer with a torch "
                "LR scheduler will not find it; build the scheduler after loading"]
    for g in groups:
        g.setdefault("initial_lr", g["lr"])
    return ["initial_lr (what torch LR schedulers keep) is each group's lr: the run had no LR scheduler"]


def steps(ck: Checkpoint) -> Optional[int]:
    """The optimizer step of every group and rank that counts one (they must agree), read from the files; None
    when no group counts steps (SGD, Muon's matrices)."""
    from ..analysis.health import read_steps
    from ..analysis.healthrules import step_items
    from ..io.sources import SourceFiles

    step = ck.optimizer.step if ck.optimizer else None
    with SourceFiles() as files:
        values = read_steps(step_items(ck), files)
    found = set(values.values()) | ({float(step)} if step is not None else set())
    counting = [g for zs in ck.sets.values() if zs.optimizer for g in zs.optimizer.groups if g.family.steps]
    if not found:
        if not counting and any(zs.optimizer and zs.optimizer.groups for zs in ck.sets.values()):
            return None
        raise UnsupportedCheckpointError("the optimizer state holds no step", path=ck.location.tag_dir, hint=HINT)
    if len(found) != 1:
        raise UnsupportedCheckpointError(
            f"the optimizer steps differ between ranks or groups ({', '.join(str(int(s)) for s in sorted(found))}): "
            "FSDP2 keeps one per parameter, and ckptlib does not pick one", path=ck.location.tag_dir,
            hint="`ckpt check` names the ranks and groups")
    return int(found.pop())


def state_values(ck: Checkpoint, trainable: list, step: Optional[int], prefix: tuple) -> list[Value]:
    """Each trainable parameter's per-element states (fp32, under torch's key names) and, where its optimizer
    counts steps, its step."""
    out = []
    raw = struct.pack("<f", float(step)) if step is not None else None
    for p in trainable:
        gs = ck.state_group(p.name)
        fam = _family(ck, p)
        for key in gs.key_names:
            path = prefix + ("state", p.name, fam.torch_key(key))
            out.append(Value(".".join(map(str, path)), path,
                             NewTensor("float32", tuple(p.shape), tuple(ck.sources(p.name, key))), source=p.name, key=key))
        if fam.steps:
            if raw is None:
                raise UnsupportedCheckpointError(f"{gs.label} counts steps, but the checkpoint holds none",
                                                 path=ck.location.tag_dir, hint=HINT)
            path = prefix + ("state", p.name, "step")
            out.append(Value(".".join(map(str, path)), path, NewTensor("float32", (), data=raw), source=p.name,
                             key="step"))
    return out


def group_values(groups: list[dict], members: dict, per_parameter: bool, prefix: tuple) -> list[Value]:
    out = []
    if per_parameter:  # torchtitan: param_groups.<fqn>.<hp>
        for name, g in members.items():
            for k, v in groups[g].items():
                out.append(Value(".".join(prefix + ("param_groups", name, k)), prefix + (f"param_groups.{name}.{k}",),
                                 value=v))
        return out
    for i, hps in enumerate(groups):
        for k, v in list(hps.items()) + [("params", [n for n, g in members.items() if g == i])]:
            path = prefix + ("param_groups", i, k)
            out.append(Value(".".join(map(str, path)), path, value=v))
    return out


__all__ = ["Value", "hyper_value", "optimizer_groups", "torch_settings", "initial_lr", "steps", "state_values",
           "group_values"]
