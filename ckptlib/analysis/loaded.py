"""Did ``engine.load_checkpoint`` restore what the files hold? :func:`verify_loaded` compares a live
DeepSpeed engine's fp32 masters, optimizer moments and step (and the persistent buffers) with a
checkpoint, bit for bit, in the training process right after the load.

It catches the silent failures users report: a run that "resumed" from freshly initialised weights or
moments (DeepSpeed #6691: a load that found nothing and returned quietly; LlamaFactory #8295: moments
not restored), a stale tag, and DeepSpeed 0.19.8's own NVMe-offload load, which restores the swapped
masters only. Each rank compares its own partitions with the checkpoint's values for the same elements,
found by the live engine's own layout (so the engine may run at another world size than the one that
saved, e.g. after ``ckpt reshard``); nothing is gathered. The checkpoint is read through ckptlib (never
``torch.load``), one piece at a time.

Memory: one chunk of ``chunk_elements`` fp32 elements read from the checkpoint (16 MiB by default), plus,
for a sub-group the engine keeps on NVMe, DeepSpeed's own swap-in buffers while it is compared.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..deepspeed import Checkpoint, open_checkpoint
from ..errors import UnsupportedCheckpointError
from ..kinds.optimizers import WHOLE_PARAMS
from ..layout.ranges import range_starts, slice_ranges
from ..units import human_bytes

CHUNK_ELEMENTS = 4 << 20
MAX_LISTED = 8


@dataclass
class Mismatch:
    """A tensor whose live value differs from the checkpoint's (``what``: ``fp32``, a state key, ``step``,
    ``buffer`` or ``missing``); ``elements``: how many of those compared differ; ``first``: the first
    differing element of the parameter (flattened)."""

    name: str
    what: str
    detail: str
    elements: int = 0
    first: Optional[int] = None


@dataclass
class LoadVerification:
    """What :func:`verify_loaded` found on this rank (``rank``) and, with ``torch.distributed`` initialised,
    on every rank (``mismatches`` lists all of them, each detail naming its rank)."""

    checkpoint: str
    rank: int
    world_size: int
    tensors: int = 0
    elements: int = 0
    bytes_compared: int = 0
    step: Optional[tuple] = None  # (live, saved)
    mismatches: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def describe(self) -> str:
        lines = [f"{'ok' if self.ok else 'MISMATCH'}: the live engine against {self.checkpoint} "
                 f"({self.tensors} tensors, {self.elements:,} elements, {human_bytes(self.bytes_compared)} compared "
                 f"bit for bit on rank {self.rank} of {self.world_size})"]
        if self.step is not None:
            lines.append(f"step: live {self.step[0]}, saved {self.step[1]}")
        for m in self.mismatches[:MAX_LISTED]:
            lines.append(f"  {m.what:<10} {m.name}: {m.detail}")
        if len(self.mismatches) > MAX_LISTED:
            lines.append(f"  ... and {len(self.mismatches) - MAX_LISTED} more")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ============================================================================================ live layouts
@dataclass
class _Run:
    """Elements ``[param_start, param_start+count)`` of parameter ``name`` at ``offset`` of the rank's flat
    partition ``flat`` (index into the engine's list of flat fp32 partitions)."""

    name: str
    flat: int
    offset: int
    param_start: int
    count: int


def _rank_of(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group=group) if dist.is_available() and dist.is_initialized() else 0


def _world_of(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group=group) if dist.is_available() and dist.is_initialized() else 1


def _intersect(name: str, flat: int, param_offset: int, numel: int, lo: int, hi: int) -> Optional[_Run]:
    """The part of a parameter at ``[param_offset, param_offset+numel)`` of a flat group that lies in the
    rank's partition ``[lo, hi)``."""
    a, b = max(lo, param_offset), min(hi, param_offset + numel)
    return _Run(name, flat, a - lo, a - param_offset, b - a) if a < b else None


def _live_layout(opt, names: dict) -> tuple[list, list]:
    """``(flat fp32 partitions, runs)`` of this rank for the optimizer wrappers ckptlib knows."""
    cls = type(opt).__name__
    runs: list[_Run] = []
    if cls == "DeepSpeedZeroOptimizer_Stage3":
        for j, group in enumerate(opt.fp16_groups):
            off = 0
            for p in group:
                c, numel = p.ds_tensor.ds_numel, p.ds_numel
                r = _rank_of(opt.dp_process_group)
                real = max(0, min(c, numel - r * c))
                if real:
                    runs.append(_Run(names[p], j, off, r * c, real))
                off += c
        return list(opt.fp32_partitioned_groups_flat), runs
    if cls == "DeepSpeedZeroOptimizer":
        for i, group in enumerate(opt.round_robin_bit16_groups):
            size, r = opt.partition_size[i], _rank_of(opt.real_dp_process_group[i])
            for p, off in zip(group, opt.round_robin_bit16_offsets[i]):
                run = _intersect(names[p], i, off, p.numel(), r * size, (r + 1) * size)
                if run:
                    runs.append(run)
        return list(opt.single_partition_of_fp32_groups), runs
    if cls == "BF16_Optimizer":
        for i, group in enumerate(opt.bf16_groups):
            size = opt.fp32_groups_flat_partition[i].numel()
            r, off = _rank_of(opt.real_dp_process_group[i]), 0
            for p in group:
                run = _intersect(names[p], i, off, p.numel(), r * size, (r + 1) * size)
                if run:
                    runs.append(run)
                off += p.numel()
        return list(opt.fp32_groups_flat_partition), runs
    raise UnsupportedCheckpointError(f"verify_loaded knows the ZeRO-1/2/3 and BF16_Optimizer engines, not {cls}",
                                     hint="compare the state yourself, e.g. with ckptlib.open_checkpoint(...)"
                                          ".read_param(name)")


def _whole_runs(ck: Checkpoint, opt, names: dict, j: int) -> dict:
    """``{key: {name: run}}`` for the state keys of flat group ``j`` that the checkpoint keeps per whole
    parameter (Muon's momentum at ZeRO-1/2): the live engine keeps, for its partition, the whole state of every
    parameter the partition touches (``params_in_partition``), one after the other."""
    if type(opt).__name__ != "DeepSpeedZeroOptimizer":
        return {}
    pin = opt.params_in_partition[j]
    first = next((names[p] for p in pin if names.get(p) is not None), None)
    gs = ck.state_group(first) if first is not None and first in {p.name for p in ck.parameters} else None
    keys = [k.name for k in gs.keys if k.layout == WHOLE_PARAMS] if gs is not None else []
    out: dict = {}
    for key in keys:
        runs, off = {}, 0
        for p in pin:
            runs[names[p]] = _Run(names[p], j, off, 0, p.numel())
            off += p.numel()
        out[key] = runs
    return out


class _Swapped:
    """A sub-group the live engine keeps on NVMe (ZeRO-Infinity), swapped in with DeepSpeed's own swapper
    (``optimizer_swapper``) while it is read, and released afterwards."""

    def __init__(self, opt, j: int):
        swapper = getattr(opt, "optimizer_swapper", None)
        numel = getattr(opt, "fp16_partitioned_groups_flat_numel", None)
        self.flat = opt.fp32_partitioned_groups_flat[j] if swapper is not None else None
        self.swapper = swapper if (swapper is not None and getattr(opt, "swap_optimizer", False) and numel
                                   and swapper.is_swappable_tensor(numel=numel[j])) else None

    def __enter__(self):
        if self.swapper is not None:
            self.swapper.swap_in_optimizer_state(parameter=self.flat, async_parameter=None)
        return self

    def __exit__(self, *exc):
        if self.swapper is not None:
            self.swapper.release_swap_buffers(parameter=self.flat)


# ============================================================================================ comparing
def _bits(t):
    import torch

    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}.get(t.dtype)
    return t.contiguous().view(view) if view is not None else t


def _compare_run(ck: Checkpoint, run: _Run, live_flat, key: Optional[str], src: tuple, out: LoadVerification
                 ) -> Optional[Mismatch]:
    """Compare one run of the live partition (or its state ``key``) with the checkpoint's elements."""
    import torch

    ranges, starts = src
    bad, first = 0, None
    for done in range(0, run.count, CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, run.count - done)
        saved = ck.read_ranges(slice_ranges(ranges, run.param_start + done, n, starts), "float32")
        live = live_flat.detach().narrow(0, run.offset + done, n).to("cpu", torch.float32)
        diff = _bits(live) != _bits(saved)
        out.elements += n
        out.bytes_compared += 2 * n * 4
        if bool(diff.any()):
            where = diff.nonzero()
            bad += int(where.numel())
            first = first if first is not None else run.param_start + done + int(where[0])
    if bad:
        return Mismatch(run.name, key or "fp32", f"{bad} of {run.count} elements held by rank {out.rank} differ "
                        f"(first: element {first})", bad, first)
    return None


def _live_step(opt, flat) -> Optional[int]:
    st = opt.optimizer.state.get(flat) if hasattr(opt, "optimizer") else None
    step = (st or {}).get("step")
    return None if step is None else int(step.item() if hasattr(step, "item") else step)


def verify_loaded(engine: Any, checkpoint: Union[Checkpoint, str, os.PathLike], *, tag: Optional[str] = None,
                  states: bool = True, buffers: bool = True, gather: bool = True) -> LoadVerification:
    """Compare ``engine``'s fp32 masters, optimizer states (``states``: every per-element key each parameter's
    group keeps, Muon's whole-matrix momentum included), step and persistent buffers (``buffers``) with
    ``checkpoint``, bit for bit. Call it on every rank after ``engine.load_checkpoint``. ``checkpoint`` may be a
    universal folder (after a ``load_universal`` load: what the engine holds against the folder's values).

    Each rank compares the elements its own partitions hold (the engine's layout at its world size), read
    from the checkpoint piece by piece; with ``gather`` and ``torch.distributed`` initialised the ranks'
    findings are joined (a collective: every rank must call), so every rank returns the same verdict.
    Frozen parameters are not compared (ZeRO-3 keeps them partitioned outside the optimizer).

    Memory: one chunk of 4 Mi fp32 elements from the checkpoint and its live counterpart; no gathering.

    Raises:
        UnsupportedCheckpointError: the engine's optimizer is not a ZeRO-1/2/3 or BF16_Optimizer one, or the
            checkpoint is not data parallel (pipeline and tensor-parallel engines are not compared yet).
    """
    import torch

    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag)
    ck.check_readable()
    if ck.kind != "data_parallel":
        raise UnsupportedCheckpointError("verify_loaded compares data-parallel checkpoints only",
                                         path=ck.location.tag_dir)
    opt = engine.optimizer
    model = engine.module
    names = {p: n for n, p in model.named_parameters()}
    flats, runs = _live_layout(opt, names)
    out = LoadVerification(str(ck.location.tag_dir), _rank_of(None), _world_of(None))
    if ck.universal is not None:
        out.notes.append("a universal checkpoint: DeepSpeed's universal load (\"load_universal\": true) restores the "
                         "masters, optimizer states and step; it restores no buffers and no frozen parameters, so "
                         "a buffer the engine was built with differently is reported here")
    known = {p.name for p in ck.parameters}
    sources: dict = {}

    def src(name: str, key: Optional[str]) -> tuple:
        if (name, key) not in sources:
            ranges = ck.sources(name, key)
            sources.clear()  # one parameter's ranges at a time
            sources[(name, key)] = (ranges, range_starts(ranges))
        return sources[(name, key)]

    by_flat: dict[int, list] = {}
    for run in runs:
        by_flat.setdefault(run.flat, []).append(run)
    missing = sorted({r.name for r in runs if r.name not in known})
    out.mismatches += [Mismatch(n, "missing", "the engine trains it; the checkpoint has no such parameter")
                       for n in missing]
    saved_step = ck.optimizer.step if ck.optimizer else None
    live_steps = set()
    for j, flat_runs in sorted(by_flat.items()):
        with _Swapped(opt, j):
            flat = flats[j]
            state = opt.optimizer.state.get(flat, {}) if hasattr(opt, "optimizer") else {}
            live_steps.add(_live_step(opt, flat))
            whole = _whole_runs(ck, opt, names, j) if states else {}
            for run in flat_runs:
                if run.name in missing:
                    continue
                out.tensors += 1
                for key in (None, *(ck.state_keys(run.name) if states else ())):
                    live = flat if key is None else state.get(key)
                    if key in whole:  # kept per whole parameter (Muon at ZeRO-1/2): its place in the live buffer
                        if live is None or run.name not in whole[key]:
                            continue  # the rank that holds it compares it
                        m = _compare_run(ck, whole[key][run.name], live, key, src(run.name, key), out)
                        if m is not None:
                            out.mismatches.append(m)
                        continue
                    if live is None:
                        out.mismatches.append(Mismatch(run.name, key, f"the engine has no {key} for it on rank "
                                                       f"{out.rank} (optimizer state not loaded?)"))
                        continue
                    m = _compare_run(ck, run, live, key, src(run.name, key), out)
                    if m is not None:
                        out.mismatches.append(m)
    live_steps.discard(None)
    live_step = live_steps.pop() if len(live_steps) == 1 else (sorted(live_steps) if live_steps else None)
    out.step = (live_step, saved_step)
    if live_step != saved_step:
        out.mismatches.append(Mismatch("optimizer", "step", f"live step {live_step}, saved {saved_step}"))
    if buffers:
        persistent = _persistent_buffers(model)
        saved_buffers = {b.name for b in ck.buffers}
        for name, b in persistent.items():
            if name not in saved_buffers:
                out.mismatches.append(Mismatch(name, "buffer", "not in the checkpoint"))
                continue
            saved = ck.read_buffer(name)
            live = b.detach().to("cpu")
            out.bytes_compared += 2 * saved.numel() * saved.element_size()
            if live.dtype != saved.dtype or live.shape != saved.shape or not torch.equal(_bits(live), _bits(saved)):
                out.mismatches.append(Mismatch(name, "buffer", f"live {tuple(live.shape)} {live.dtype} differs from "
                                               f"the saved {tuple(saved.shape)} {saved.dtype}"))
    if gather:
        _join(out)
    return out


def _persistent_buffers(model) -> dict:
    """The buffers that are in the module's ``state_dict`` (the persistent ones), by name."""
    saved = model.state_dict(keep_vars=True)
    return {name: b for name, b in model.named_buffers() if name in saved}


def _join(out: LoadVerification) -> None:
    """Every rank's mismatches and counts, on every rank (a collective when torch.distributed runs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (out.rank, out.mismatches, out.tensors, out.elements, out.bytes_compared))
    seen = set()
    joined = []
    for rank, mismatches, *_ in every:
        for m in mismatches:
            key = (m.name, m.what, m.detail)
            if key not in seen:
                seen.add(key)
                joined.append(m)
    out.mismatches = joined
    out.notes.append("counts are rank " + str(out.rank) + "'s; mismatches are every rank's (" +
                     ", ".join(f"rank {r}: {len(ms)}" for r, ms, *_ in every) + ")")


__all__ = ["verify_loaded", "LoadVerification", "Mismatch"]
