"""What ``ckpt inspect`` shows: one JSON-ready dict of a :class:`Checkpoint`, and every readable form of it.

:func:`describe` is the one source: the text of ``ckpt inspect`` (:func:`format_text`), ``ckpt inspect --json`` and
the notebooks' Summary, Files and Parameters tabs (:mod:`ckptlib.ui.figures`) are all made from its dict and
nothing else, through :func:`summary_rows`, :func:`file_lines`, :func:`parameter_lines` and :func:`closing`, so
that no face can state less than another. Built from metadata only (no tensor bytes beyond what opening the
checkpoint read; an adapter's own ``adapter_model.safetensors`` is read to judge it).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Union

from ..deepspeed import Checkpoint, exactness
from ..deepspeed import files as fnames
from ..deepspeed.discovery import repair_hint
from ..dtypes import BY_NAME
from ..kinds.optimizers import PARTITIONED, WHOLE_PARAMS
from ..kinds.optimizers import describe as describe_families
from ..units import human_bytes
from . import placement
from .adapter import adapter_rows, describe_adapter

FLAVORS = {"zero": "", "bf16_optimizer": " (BF16_Optimizer)", "no_zero": " (no ZeRO partitioning)", "universal": ""}
#: the coordinates of a file, in the order and words the file lists use
COORDINATES = (("stage", "stage"), ("tp_rank", "tp"), ("dp_rank", "dp"), ("ep_rank", "ep"), ("layer", "layer"),
               ("expert", "expert"))


def all_problems(ckpt: Checkpoint) -> list[str]:
    """What opening found wrong, and every rank file that does not hold what its name says
    (:mod:`ckptlib.deepspeed.exactness`: what export, reshard and universal would refuse)."""
    found = [str(f) for f in exactness.findings(ckpt)] if not ckpt.refusals else []
    found += [str(p) for zs in ckpt.sets.values() if zs.optimizer for p in zs.optimizer.state_problems]
    return list(ckpt.problems) + [f for f in dict.fromkeys(found) if f not in ckpt.problems]


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    """The JSON form of ``ckpt inspect``: every fact any face of ckptlib states about the checkpoint."""
    loc = ckpt.location
    opt = ckpt.optimizer
    unsupported = [u for zs in ckpt.sets.values() for u in zs.records.unsupported]
    problems = all_problems(ckpt)
    return {
        "path": str(loc.given),
        "save_dir": str(loc.save_dir),
        "tag": loc.tag,
        "tags": list(loc.tags),
        "latest": loc.latest,
        "checkpoints": list(loc.checkpoints),
        "zero_stage": ckpt.zero_stage,
        "optimizer_flavor": ckpt.flavor,
        "parallelism": ckpt.kind,
        "parallel": parallel_line(ckpt),
        "dp_world_size": ckpt.mesh.dp,
        "pp_world_size": ckpt.mesh.pp,
        "tp_world_size": ckpt.mesh.tp,
        "ep_world_size": ckpt.mesh.ep,
        "sp_world_size": ckpt.sequence_parallel,
        "num_experts": ckpt.num_experts,
        "autoep_layers": [dataclasses.asdict(lay) for lay in ckpt.records.autoep_layers],
        "mp_world_size": ckpt.mp_world_size,
        "partition_count": ckpt.partition_count,
        "dtype": ckpt.dtype,
        "masters": placement.masters(ckpt),
        "deepspeed_version": ckpt.deepspeed_version,
        "quirks": list(ckpt.quirks),
        "optimizer": None if opt is None else {
            "wrapper": opt.wrapper,
            "state_keys": list(opt.state_keys),
            "step": opt.step,
            "loss_scale": opt.loss_scale,
            "param_groups": opt.param_groups,
            "optimizers": describe_families(opt.groups),
            "groups": [{"group": g.group, "name": g.name, "optimizer": g.family.name, "label": g.family.label,
                        "keys": [{"key": k.name, "layout": k.layout, "dtype": k.dtype} for k in g.keys],
                        "step": g.step, "parameters": sum(1 for p in ckpt.main.parameters
                                                          if p.trainable and not p.tied_to and p.group == g.group)}
                       for g in opt.groups],
            "state_problems": [str(p) for p in opt.state_problems],
        },
        "parameters": [
            {"name": p.name, "shape": list(p.shape), "numel": p.numel, "trainable": p.trainable,
             "tied_to": p.tied_to, "group": p.group, "stored_dtype": p.stored_dtype}
            for p in ckpt.parameters
        ],
        "parameter_count": sum(p.numel for p in ckpt.parameters if p.tied_to is None),
        "trainable_count": sum(p.numel for p in ckpt.parameters if p.tied_to is None and p.trainable),
        "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype} for b in ckpt.buffers],
        "replicated": ckpt.replicated(),
        "files": [dict({"path": f.relpath, "bytes": f.bytes, "kind": f.kind, "dp_rank": f.dp_rank,
                        "mp_rank": f.mp_rank}, **ckpt.coordinates(f)) for f in ckpt.files],
        "total_bytes": ckpt.total_bytes,
        "bytes_read": ckpt.stats.bytes_read,
        "adapter": describe_adapter(ckpt) if not ckpt.refusals else None,
        "problems": problems,
        "repair_hint": repair_hint(loc) if problems else None,
        "cannot_read": list(ckpt.refusals),
        "unsupported": unsupported,
        "notes": list(ckpt.notes),
        "universal": None if ckpt.universal is None else {
            "written_by": ckpt.universal.written_by, "source_zero_stage": ckpt.universal.source_stage,
            "source_flavor": ckpt.universal.source_flavor, "source_mesh": dataclasses.asdict(ckpt.universal.source_mesh),
            "steps": dict(ckpt.universal.steps), "absent": list(ckpt.universal.absent),
            "experts": ckpt.universal.experts},
        "placement": placement.describe(ckpt),
    }


def parallel_line(ckpt: Checkpoint) -> str:
    """What parallelism the run had, in words."""
    u = ckpt.universal
    if u is not None and not ckpt.records.autoep_layers:  # a universal folder: its source's, which it records
        m = u.source_mesh
        said = ([f"pipeline, {m.pp} stages"] if m.pp > 1 else []) + ([f"tensor parallel, {m.tp} tensor ranks"]
                                                                     if m.tp > 1 else [])
        return "; ".join(said + [f"data parallel, {m.dp} ranks"]) + " (the source's)"
    parts = []
    if ckpt.kind == "pipeline":
        parts.append(f"pipeline, {ckpt.mesh.pp} stages" + (
            f" x {ckpt.mesh.tp} tensor ranks (pipeline x tensor x data parallel: mp_rank = stage x {ckpt.mesh.tp} + "
            "tensor rank" + (f"; {len(ckpt.replicated())} tensors replicated)" if ckpt.view is not None else
                             "; how the shards join is unknown: --tp-rules)") if ckpt.mesh.tp > 1 else ""))
    elif ckpt.kind == "tensor_parallel":
        parts.append(f"tensor parallel, {ckpt.mesh.tp} tensor ranks"
                     + (f" ({len(ckpt.replicated())} tensors replicated)" if ckpt.view is not None else
                        " (how the shards join is unknown: --tp-rules)"))
    if ckpt.sequence_parallel > 1:
        parts.append(f"sequence parallel (Ulysses) {ckpt.sequence_parallel}: the weights are not split; ZeRO "
                     f"partitions over sp x dp = {ckpt.partition_count} ranks")
    layers = ckpt.records.autoep_layers
    if layers:
        first = layers[0]
        where = "; ".join(f"ep rank {e}: experts {e * first.num_local}-{(e + 1) * first.num_local - 1}"
                          for e in range(first.ep))
        preset = (ckpt.ds_config.get("expert_parallel") or {}).get("preset_model")
        parts.append(f"AutoEP mixture of experts ({first.checkpoint_format}): {len(layers)} MoE layers of "
                     f"{first.num_experts} experts, expert parallel {first.ep} ({where}), expert data parallel "
                     f"{max(1, ckpt.mesh.dp // first.ep)}; "
                     + (f"preset {preset}" if preset else "preset detected from the model (not recorded)")
                     + "; model class not recorded (export takes --model-config)")
    elif ckpt.num_experts:
        parts.append(f"mixture of experts, {', '.join(map(str, ckpt.num_experts))} experts per MoE layer, "
                     f"expert parallel {ckpt.mesh.ep}")
    return "; ".join(parts) or f"data parallel, {ckpt.mesh.dp} ranks"


# ================================================================================================ the text
def _dtype(name: str) -> str:
    return BY_NAME[name].short or name if name in BY_NAME else name


def summary_rows(d: dict) -> list[tuple[str, str]]:
    """``(label, text)`` of every fact of the summary, in order; a row that goes on from the one before has the label
    ``""``. ``ckpt inspect`` prints them as ``label  text``, the notebooks' Summary tab as a table."""
    rows = [("checkpoint", d["save_dir"]),
            ("tag", d["tag"] + (f"   (latest: {d['latest']})" if d["latest"] else "   (no 'latest' file)"))]
    if len(d["tags"]) > 1:
        rows.append(("tags", ", ".join(d["tags"])))
    if d["checkpoints"]:
        name = os.path.basename(d["save_dir"].rstrip("/"))
        newest = os.path.basename(d["checkpoints"][-1].rstrip("/")) == name
        rows.append(("checkpoints", f"{len(d['checkpoints'])} checkpoint folders; using {name}"
                     + (" (the newest)" if newest else "")))
    u = d["universal"]
    if u is not None:
        m = u["source_mesh"]
        src = "BF16_Optimizer" if u["source_flavor"] == "bf16_optimizer" else f"ZeRO-{u['source_zero_stage']}"
        rows.append(("universal", f"every tensor whole, one file each (zero/<parameter>/), written by {u['written_by']} "
                                  f"from a {src} checkpoint of dp={m['dp']} tp={m['tp']} pp={m['pp']}"
                                  + (f", {u['experts']} experts" if u["experts"] else "")))
    rows += [("ZeRO stage", f"{d['zero_stage']}{FLAVORS[d['optimizer_flavor']]}" + (" (of the source)" if u else "")),
             ("dtype", str(d["dtype"]))]
    masters = d["masters"]
    if masters is not None and masters["dtype"] != "float32":
        rows.append(("masters", masters["text"]))
    if u is None:
        rows.append(("world size", f"dp={d['dp_world_size']} pp={d['pp_world_size']} tp={d['tp_world_size']} "
                                   f"ep={d['ep_world_size']} sp={d['sp_world_size']}"))
    else:
        m = u["source_mesh"]
        rows.append(("world size", f"dp={m['dp']} pp={m['pp']} tp={m['tp']} ep={m['ep']} (the source's; the "
                                   "folder's tensors are whole)"))
    rows += [("parallel", d["parallel"]), ("DeepSpeed", str(d["deepspeed_version"]))]
    o = d["optimizer"]
    if o is not None:
        groups = o["groups"]
        rows.append(("optimizer", o["wrapper"] + (f" stepping {o['optimizers']}" if groups else "")
                     + f"; state {', '.join(o['state_keys']) or '-'}; step {o['step']}"
                     + (f"; loss scale {o['loss_scale']:g}" if o["loss_scale"] is not None else "")))
        mixed = len({(g["optimizer"], tuple(k["key"] for k in g["keys"]), g["step"]) for g in groups}) > 1
        if mixed or any(k["layout"] != PARTITIONED for g in groups for k in g["keys"]):
            for g in groups:
                keys = ", ".join(f"{k['key']} ({_dtype(k['dtype'])}"
                                 + (", whole matrices per rank" if k["layout"] == WHOLE_PARAMS else "") + ")"
                                 for k in g["keys"]) or "no per-element state"
                rows.append(("", f"group {g['group']}{' ' + g['name'] if g['name'] else ''}: {g['label']}; {keys}; "
                                 + (f"step {g['step']}" if g["step"] is not None else "no step")
                                 + f"; {g['parameters']} parameter{'s' if g['parameters'] != 1 else ''}"))
    params = d["parameters"]
    n_tied = sum(1 for p in params if p["tied_to"])
    n_frozen = sum(1 for p in params if not p["trainable"] and not p["tied_to"])
    rows.append(("parameters", f"{len(params)} tensors, {d['parameter_count']:,} elements ({d['trainable_count']:,} "
                               f"trainable; {n_frozen} frozen tensors, {n_tied} tied aliases)"))
    rows.append(("buffers", str(len(d["buffers"]))))
    return rows + adapter_rows(d["adapter"])


def file_lines(d: dict) -> list[str]:
    """The files of the tag folder, one line each (a universal folder's fragments summed in one)."""
    files = d["files"]
    lines = [f"files in {d['tag']}/ ({len(files)} files, {human_bytes(d['total_bytes'])}):"]
    shown = [f for f in files if f["kind"] != fnames.FRAGMENT]
    width = max((len(f["path"]) for f in shown), default=10)
    for f in shown:
        lines.append(f"  {f['path']:<{width}}  {human_bytes(f['bytes']):>9}  {f['kind']:<14} {where(f)}")
    fragments = [f for f in files if f["kind"] == fnames.FRAGMENT]
    if fragments:  # a universal checkpoint: one folder per parameter, a file per state
        per_key: dict = {}
        for f in fragments:
            key = os.path.splitext(os.path.basename(f["path"]))[0]
            per_key[key] = per_key.get(key, 0) + 1
        lines.append(f"  zero/<parameter>/ ({len({os.path.dirname(f['path']) for f in fragments})} folders)  "
                     f"{human_bytes(sum(f['bytes'] for f in fragments)):>9}  "
                     + ", ".join(f"{n} {k}.pt" for k, n in per_key.items()))
    return lines


def where(f: dict) -> str:
    """``"stage 1 tp 0 dp 1"``: where a file of :func:`describe`'s ``files`` sits in the mesh."""
    return " ".join(f"{label} {f[key]}" for key, label in COORDINATES if f.get(key) is not None)


def parameter_kind(p: dict, replicated) -> str:
    kind = f"tied to {p['tied_to']}" if p["tied_to"] else ("trainable" if p["trainable"] else "frozen")
    if p["trainable"] and p["group"] is not None and not p["tied_to"]:
        kind += f" (group {p['group']})"
    return kind + (", replicated" if p["name"] in replicated else "")


def parameter_lines(d: dict) -> list[str]:
    """The parameters and buffers, one line each: name, shape, elements, kind."""
    rows = [(p["name"], str(p["shape"]), f"{p['numel']:,}", parameter_kind(p, set(d["replicated"])))
            for p in d["parameters"]]
    rows += [(b["name"], str(b["shape"]), "", f"buffer {b['dtype']}" + (", replicated" if b["name"] in d["replicated"]
                                                                         else "")) for b in d["buffers"]]
    nw = max([len(r[0]) for r in rows] + [len("parameter")])
    sw = max([len(r[1]) for r in rows] + [len("shape")])
    return [f"{'parameter':<{nw}}  {'shape':<{sw}}  {'elements':>12}  kind"] + \
        [f"{n:<{nw}}  {s:<{sw}}  {e:>12}  {k}" for n, s, e, k in rows]


def closing(d: dict) -> list[tuple[str, str]]:
    """``(kind, text)`` of what ends the summary: ``note``, ``cannot read values``, ``hint``, ``problem`` (none:
    one ``ok``) and ``read``."""
    out = [("note", n) for n in d["notes"]]
    out += [("cannot read values", r) for r in d["cannot_read"]]
    if d["cannot_read"]:
        out.append(("hint", "pass --tp-rules FILE (see `ckpt export --help`)"))
    out += [("cannot read values", u) for u in d["unsupported"]]  # a layout ckptlib does not read yet: no repair
    problems = [p for p in d["problems"] if not any(p.endswith(u) for u in d["unsupported"])]
    out += [("problem", p) for p in problems]
    if problems:
        out.append(("hint", d["repair_hint"]))
    else:
        out.append(("ok", "problems: none found"))
    out.append(("read", f"(read {human_bytes(d['bytes_read'])} of {human_bytes(d['total_bytes'])} to learn this)"))
    return out


def format_text(ckpt: Union[Checkpoint, dict]) -> str:
    """The readable summary of ``ckpt inspect``: of a checkpoint, or of its :func:`describe` dict."""
    d = describe(ckpt) if isinstance(ckpt, Checkpoint) else ckpt
    lines = [f"{label:<11} {text}" if label else f"{'':<11} {text}" for label, text in summary_rows(d)]
    lines += [""] + file_lines(d) + [""] + parameter_lines(d) + [""]
    ends = closing(d)
    problems = [text for kind, text in ends if kind == "problem"]
    for kind, text in ends:
        if kind == "problem":
            if text == problems[0]:
                lines.append(f"PROBLEMS ({len(problems)}):")
            lines.append(f"  - {text}")
        elif kind in ("ok", "read"):
            lines.append(text)
        else:
            lines.append(f"{kind}: {text}")
    return "\n".join(lines)


__all__ = ["describe", "format_text", "summary_rows", "file_lines", "parameter_lines", "closing", "where",
           "parameter_kind", "parallel_line", "all_problems", "COORDINATES"]
