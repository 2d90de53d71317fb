"""What ``ckpt inspect`` shows: a JSON-ready dict and a readable text form of a :class:`Checkpoint`.

Both are built from metadata only (no tensor bytes beyond what opening the checkpoint read).
"""
from __future__ import annotations

from typing import Any

from .deepspeed import Checkpoint
from .units import human_bytes


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
        "dp_world_size": ckpt.dp_world_size,
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
        },
        "parameters": [
            {"name": p.name, "shape": list(p.shape), "numel": p.numel, "trainable": p.trainable,
             "tied_to": p.tied_to, "group": p.group, "stored_dtype": p.stored_dtype}
            for p in ckpt.parameters
        ],
        "parameter_count": sum(p.numel for p in ckpt.parameters if p.tied_to is None),
        "trainable_count": sum(p.numel for p in ckpt.parameters if p.tied_to is None and p.trainable),
        "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype} for b in ckpt.buffers],
        "files": [
            {"path": f.relpath, "bytes": f.bytes, "kind": f.kind, "dp_rank": f.dp_rank, "mp_rank": f.mp_rank}
            for f in ckpt.files
        ],
        "total_bytes": ckpt.total_bytes,
        "bytes_read": ckpt.stats.bytes_read,
        "problems": list(ckpt.problems),
        "notes": list(ckpt.notes),
    }


def format_text(ckpt: Checkpoint) -> str:
    """The readable summary of ``ckpt inspect``."""
    d = describe(ckpt)
    loc = ckpt.location
    lines = [f"checkpoint  {loc.save_dir}",
             f"tag         {loc.tag}" + (f"   (latest: {loc.latest})" if loc.latest else "   (no 'latest' file)")]
    if len(loc.tags) > 1:
        lines.append(f"tags        {', '.join(loc.tags)}")
    if loc.checkpoints:
        lines.append(f"checkpoints {len(loc.checkpoints)} checkpoint-N folders, newest used")
    flavor = {"zero": "", "bf16_optimizer": " (BF16_Optimizer)", "no_zero": " (no ZeRO partitioning)"}[ckpt.flavor]
    lines += [
        f"ZeRO stage  {ckpt.zero_stage}{flavor}",
        f"dtype       {ckpt.dtype}",
        f"world size  dp={ckpt.dp_world_size} mp={ckpt.mp_world_size}",
        f"DeepSpeed   {ckpt.deepspeed_version}",
    ]
    if ckpt.optimizer:
        o = ckpt.optimizer
        lines.append(f"optimizer   {o.wrapper}; state {', '.join(o.state_keys) or '-'}; step {o.step}"
                     + (f"; loss scale {o.loss_scale:g}" if o.loss_scale is not None else ""))
    n_tied = sum(1 for p in ckpt.parameters if p.tied_to)
    n_frozen = sum(1 for p in ckpt.parameters if not p.trainable and not p.tied_to)
    lines.append(f"parameters  {len(ckpt.parameters)} tensors, {d['parameter_count']:,} elements "
                 f"({d['trainable_count']:,} trainable; {n_frozen} frozen tensors, {n_tied} tied aliases)")
    lines.append(f"buffers     {len(ckpt.buffers)}")
    lines.append("")
    lines.append(f"files in {loc.tag}/ ({len(ckpt.files)} files, {human_bytes(ckpt.total_bytes)}):")
    width = max((len(f.relpath) for f in ckpt.files), default=10)
    for f in ckpt.files:
        rank = "" if f.dp_rank is None else f"dp {f.dp_rank}"
        lines.append(f"  {f.relpath:<{width}}  {human_bytes(f.bytes):>9}  {f.kind:<14} {rank}")
    lines.append("")
    lines.append(f"{'parameter':<40} {'shape':<16} {'elements':>10}  kind")
    for p in ckpt.parameters:
        kind = f"tied to {p.tied_to}" if p.tied_to else ("trainable" if p.trainable else "frozen")
        if p.trainable and p.group is not None and not p.tied_to:
            kind += f" (group {p.group})"
        lines.append(f"{p.name:<40} {str(list(p.shape)):<16} {p.numel:>10,}  {kind}")
    for b in ckpt.buffers:
        lines.append(f"{b.name:<40} {str(list(b.shape)):<16} {'':>10}  buffer {b.dtype}")
    lines.append("")
    for n in ckpt.notes:
        lines.append(f"note: {n}")
    if ckpt.problems:
        lines.append(f"PROBLEMS ({len(ckpt.problems)}):")
        lines += [f"  - {p}" for p in ckpt.problems]
    else:
        lines.append("problems: none found")
    lines.append(f"(read {human_bytes(ckpt.stats.bytes_read)} of {human_bytes(ckpt.total_bytes)} to learn this)")
    return "\n".join(lines)
