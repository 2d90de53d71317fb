"""What ``ckpt inspect`` shows: a JSON-ready dict and a readable text form of a :class:`Checkpoint`.

Both are built from metadata only (no tensor bytes beyond what opening the checkpoint read).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..deepspeed import Checkpoint, exactness
from ..deepspeed import files as fnames
from ..deepspeed.discovery import repair_hint
from ..dtypes import BY_NAME
from ..kinds.optimizers import PARTITIONED, WHOLE_PARAMS
from ..kinds.optimizers import describe as describe_families
from ..units import human_bytes
from .adapter import adapter_lines, describe_adapter


def all_problems(ckpt: Checkpoint) -> list[str]:
    """What opening found wrong, and every rank file that does not hold what its name says
    (:mod:`ckptlib.deepspeed.exactness`: what export, reshard and universal would refuse)."""
    found = [str(f) for f in exactness.findings(ckpt)] if not ckpt.refusals else []
    found += [str(p) for zs in ckpt.sets.values() if zs.optimizer for p in zs.optimizer.state_problems]
    return list(ckpt.problems) + [f for f in dict.fromkeys(found) if f not in ckpt.problems]


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    """The JSON form of ``ckpt inspect``."""
    loc = ckpt.location
    opt = ckpt.optimizer
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
        "problems": all_problems(ckpt),
        "cannot_read": list(ckpt.refusals),
        "notes": list(ckpt.notes),
        "universal": None if ckpt.universal is None else {
            "written_by": ckpt.universal.written_by, "source_zero_stage": ckpt.universal.source_stage,
            "source_flavor": ckpt.universal.source_flavor, "source_mesh": dataclasses.asdict(ckpt.universal.source_mesh),
            "steps": dict(ckpt.universal.steps), "absent": list(ckpt.universal.absent),
            "experts": ckpt.universal.experts},
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


def format_text(ckpt: Checkpoint) -> str:
    """The readable summary of ``ckpt inspect``."""
    d = describe(ckpt)
    loc = ckpt.location
    lines = [f"checkpoint  {loc.save_dir}",
             f"tag         {loc.tag}" + (f"   (latest: {loc.latest})" if loc.latest else "   (no 'latest' file)")]
    if len(loc.tags) > 1:
        lines.append(f"tags        {', '.join(loc.tags)}")
    if loc.checkpoints:
        lines.append(f"checkpoints {len(loc.checkpoints)} checkpoint folders; using {loc.save_dir.name}"
                     + (" (the newest)" if os.fspath(loc.save_dir) == loc.checkpoints[-1] else ""))
    flavor = {"zero": "", "bf16_optimizer": " (BF16_Optimizer)", "no_zero": " (no ZeRO partitioning)",
              "universal": ""}[ckpt.flavor]
    u = ckpt.universal
    if u is not None:
        m = u.source_mesh
        lines.append(f"universal   every tensor whole, one file each (zero/<parameter>/), written by {u.written_by} "
                     f"from a {'BF16_Optimizer' if u.source_flavor == 'bf16_optimizer' else f'ZeRO-{u.source_stage}'}"
                     f" checkpoint of dp={m.dp} tp={m.tp} pp={m.pp}" + (f", {u.experts} experts" if u.experts else ""))
    lines += [
        f"ZeRO stage  {ckpt.zero_stage}{flavor}" + (" (of the source)" if u is not None else ""),
        f"dtype       {ckpt.dtype}",
        (f"world size  dp={ckpt.mesh.dp} pp={ckpt.mesh.pp} tp={ckpt.mesh.tp} ep={ckpt.mesh.ep} sp={ckpt.sequence_parallel}"
         if u is None else f"world size  dp={u.source_mesh.dp} pp={u.source_mesh.pp} tp={u.source_mesh.tp} "
                           f"ep={u.source_mesh.ep} (the source's; the folder's tensors are whole)"),
        f"parallel    {parallel_line(ckpt)}",
        f"DeepSpeed   {ckpt.deepspeed_version}",
    ]
    if ckpt.optimizer:
        o = ckpt.optimizer
        lines.append(f"optimizer   {o.wrapper}" + (f" stepping {describe_families(o.groups)}" if o.groups else "")
                     + f"; state {', '.join(o.state_keys) or '-'}; step {o.step}"
                     + (f"; loss scale {o.loss_scale:g}" if o.loss_scale is not None else ""))
        mixed = len({(g.family, g.key_names, g.step) for g in o.groups}) > 1
        if mixed or any(k.layout != PARTITIONED for g in o.groups for k in g.keys):
            for g in d["optimizer"]["groups"]:
                keys = ", ".join(f"{k['key']} ({BY_NAME[k['dtype']].short or k['dtype']}"
                                 + (", whole matrices per rank" if k["layout"] == WHOLE_PARAMS else "") + ")"
                                 for k in g["keys"]) or "no per-element state"
                lines.append(f"  group {g['group']}{' ' + g['name'] if g['name'] else ''}: {g['label']}; {keys}; "
                             + (f"step {g['step']}" if g["step"] is not None else "no step")
                             + f"; {g['parameters']} parameter{'s' if g['parameters'] != 1 else ''}")
    n_tied = sum(1 for p in ckpt.parameters if p.tied_to)
    n_frozen = sum(1 for p in ckpt.parameters if not p.trainable and not p.tied_to)
    lines.append(f"parameters  {len(ckpt.parameters)} tensors, {d['parameter_count']:,} elements "
                 f"({d['trainable_count']:,} trainable; {n_frozen} frozen tensors, {n_tied} tied aliases)")
    lines.append(f"buffers     {len(ckpt.buffers)}")
    lines += adapter_lines(d["adapter"])
    lines.append("")
    lines.append(f"files in {loc.tag}/ ({len(ckpt.files)} files, {human_bytes(ckpt.total_bytes)}):")
    shown = [f for f in ckpt.files if f.kind != fnames.FRAGMENT]
    width = max((len(f.relpath) for f in shown), default=10)
    for f in shown:
        where = ckpt.coordinates(f)
        rank = " ".join(f"{label} {where[key]}" for key, label in (("stage", "stage"), ("tp_rank", "tp"),
                                                                    ("dp_rank", "dp"), ("ep_rank", "ep"), ("layer", "layer"),
                                                                    ("expert", "expert")) if where[key] is not None)
        lines.append(f"  {f.relpath:<{width}}  {human_bytes(f.bytes):>9}  {f.kind:<14} {rank}")
    fragments = [f for f in ckpt.files if f.kind == fnames.FRAGMENT]
    if fragments:  # a universal checkpoint: one folder per parameter, a file per state
        per_key: dict = {}
        for f in fragments:
            per_key[f.path.stem] = per_key.get(f.path.stem, 0) + 1
        lines.append(f"  zero/<parameter>/ ({len({f.path.parent for f in fragments})} folders)  "
                     f"{human_bytes(sum(f.bytes for f in fragments)):>9}  "
                     + ", ".join(f"{n} {k}.pt" for k, n in per_key.items()))
    lines.append("")
    names = [p.name for p in ckpt.parameters] + [b.name for b in ckpt.buffers]
    nw = max([len(n) for n in names] + [len("parameter")])
    sw = max([len(str(list(t.shape))) for t in list(ckpt.parameters) + list(ckpt.buffers)] + [len("shape")])
    lines.append(f"{'parameter':<{nw}}  {'shape':<{sw}}  {'elements':>12}  kind")
    replicated = set(d["replicated"])
    for p in ckpt.parameters:
        kind = f"tied to {p.tied_to}" if p.tied_to else ("trainable" if p.trainable else "frozen")
        if p.trainable and p.group is not None and not p.tied_to:
            kind += f" (group {p.group})"
        if p.name in replicated:
            kind += ", replicated"
        lines.append(f"{p.name:<{nw}}  {str(list(p.shape)):<{sw}}  {p.numel:>12,}  {kind}")
    for b in ckpt.buffers:
        lines.append(f"{b.name:<{nw}}  {str(list(b.shape)):<{sw}}  {'':>12}  buffer {b.dtype}"
                     + (", replicated" if b.name in replicated else ""))
    lines.append("")
    for n in ckpt.notes:
        lines.append(f"note: {n}")
    for r in ckpt.refusals:
        lines.append(f"cannot read values: {r}")
    if ckpt.refusals:
        lines.append("hint: pass --tp-rules FILE (see `ckpt export --help`)")
    unsupported = [u for zs in ckpt.sets.values() for u in zs.records.unsupported]
    for u in unsupported:  # a layout ckptlib does not read yet: not damage, no file to restore
        lines.append(f"cannot read values: {u}")
    problems = [p for p in d["problems"] if not any(p.endswith(u) for u in unsupported)]
    if problems:
        lines.append(f"PROBLEMS ({len(problems)}):")
        lines += [f"  - {p}" for p in problems]
        lines.append(f"hint: {repair_hint(ckpt.location)}")
    else:
        lines.append("problems: none found")
    lines.append(f"(read {human_bytes(ckpt.stats.bytes_read)} of {human_bytes(ckpt.total_bytes)} to learn this)")
    return "\n".join(lines)
