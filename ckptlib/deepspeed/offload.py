"""ZeRO-Infinity (``offload_optimizer`` on ``nvme``) checkpoints: the swap files beside the ``.pt`` files.

With NVMe offload, DeepSpeed keeps the fp32 partition and the per-element optimizer states of every
ZeRO-3 sub-group whose per-rank partition reaches the async I/O block (1 MiB by default) in swap files,
and ``save_checkpoint`` copies its swap folder into the tag folder::

    <tag>/offloaded_tensors/rank{NN}/{a}_{b}.tensor.swp             the fp32 partition
    <tag>/offloaded_tensors/rank{NN}/exp_avg-{a}_{b}.tensor.swp     each per-element state, by its key
    <tag>/offloaded_tensors/rank{NN}/exp_avg_sq-{a}_{b}.tensor.swp

Each is raw little-endian data with no header: the rank's partition of the sub-group (ZeRO-3's layout, the
same as a flat tensor in a ``.pt`` file), then zeros up to a multiple of the I/O alignment (1024 bytes
times ``aio.intra_op_parallelism``). In the optimizer file that sub-group's flat tensor and states are
``(0,)`` placeholders; its ``step`` is kept there. ``a`` and ``b`` are DeepSpeed's ids (``ds_id``) of the
sub-group's first and last parameter, recorded in no ``.pt`` file: ZeRO-3 numbers the parameters of the
model in order (``module.parameters()``: the model-states ``module`` without buffers and tied aliases,
frozen ones included) from a process-wide counter that does not restart for a second engine. So the files
are matched to the sub-groups by one unknown offset: :func:`resolve` accepts the single offset that
names a master file for every swapped sub-group of every rank, and refuses (a problem naming the folder)
when there is none or more than one, or a file has not exactly the size the layout needs.

Pure metadata: file names and sizes, never their bytes.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..io.rawfile import RawTensor
from ..io.torchzip import TensorHandle
from ..layout.flat import Zero3Layout
from .values import as_int, get

SWAP_DIR = "offloaded_tensors"
AIO_ALIGNED_BYTES = 1024  # DeepSpeed's swap files are padded to this times aio.intra_op_parallelism
#: why an NVMe checkpoint is worth resharding (inspect's note; measured with DeepSpeed 0.19.8, see docs/resume.md)
WHY = ("the .pt files hold empty placeholders for these partitions, so DeepSpeed's zero_to_fp32 fails on them, "
       "and its load_checkpoint with NVMe offload restores at most the swapped masters (no Adam moments, nor the "
       "other sub-groups) and fails at another world size; `ckpt reshard CKPT OUT --world-size N` writes an "
       "ordinary ZeRO-3 checkpoint (every partition in the .pt files) that DeepSpeed loads exactly with "
       "offload_optimizer on cpu or none")
_NAME = re.compile(r"^(?:(?P<state>[A-Za-z_][A-Za-z0-9_]*)-)?(?P<first>\d+)_(?P<last>\d+)\.tensor\.swp$")
_RANK_DIR = re.compile(r"^rank(?P<rank>\d+)$")


@dataclass(frozen=True)
class SwapName:
    """What a swap file's name says: its rank folder, state key (None: the fp32 partition), first and last
    parameter id."""

    rank: int
    state: Optional[str]
    first: int
    last: int


def swap_name(tag_dir: Path, path: Path) -> Optional[SwapName]:
    """The parsed name of a file under ``<tag_dir>/offloaded_tensors/rank{NN}/``, or None for another file."""
    try:
        rel = path.relative_to(tag_dir / SWAP_DIR).parts
    except ValueError:
        return None
    m_rank = _RANK_DIR.match(rel[0]) if len(rel) == 2 else None
    m = _NAME.match(rel[-1]) if m_rank else None
    if m is None:
        return None
    return SwapName(int(m_rank["rank"]), m["state"], int(m["first"]), int(m["last"]))


def swap_paths(tag_dir: Path) -> list[Path]:
    """Every file under ``<tag_dir>/offloaded_tensors/`` (sorted; none when the folder is absent)."""
    root = tag_dir / SWAP_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file())


def aio_alignment(ds_config: dict) -> int:
    """Bytes a swap file is padded to: 1024 times the ``aio`` section's ``intra_op_parallelism`` (called
    ``thread_count`` before DeepSpeed 0.15), 1 when not set."""
    aio = get(ds_config, "aio")
    par = as_int(get(aio, "intra_op_parallelism")) or as_int(get(aio, "thread_count")) or 1
    return AIO_ALIGNED_BYTES * max(1, par)


def parameter_order(model: dict) -> dict[str, int]:
    """Each parameter's place in ``module.parameters()``: the model-states ``module`` entries without the
    buffers and the tied aliases (``shared_params``)."""
    buffers = set(model.get("buffer_names") or [])
    shared = model.get("shared_params") or {}
    module = model.get("module") or {}
    names = [n for n, t in module.items() if isinstance(t, TensorHandle) and n not in buffers and n not in shared]
    return {n: i for i, n in enumerate(names)}


@dataclass
class Swapped:
    """The swapped partitions found: ``tensors[(dp, sub-group)][state]`` (None: the fp32 master) as
    :class:`~ckptlib.io.rawfile.RawTensor` s; ``offset``: DeepSpeed's id of the model's first parameter."""

    tensors: dict
    offset: Optional[int] = None


def resolve(tag_dir: Path, layout: Zero3Layout, model: dict, empties: dict, states: dict, ds_config: dict,
            problems: list) -> Swapped:
    """Match the swap files to the sub-groups whose partitions are empty placeholders.

    ``empties``: ``{dp rank: {sub-group: its (0,) fp32 flat tensor}}``; ``states``: ``{dp rank: {sub-group:
    {state key: its (0,) placeholder}}}`` (the per-element states saved empty). Every problem found (no or several matching
    offsets, a missing file, a wrong size) is appended to ``problems`` naming the folder or file; the
    partitions of a rank with problems are left out.
    """
    out = Swapped({})
    if not empties:
        return out
    order = parameter_order(model)
    by_rank: dict[int, dict] = {}
    for p in swap_paths(tag_dir):
        name = swap_name(tag_dir, p)
        if name is not None:
            by_rank.setdefault(name.rank, {})[(name.state, name.first, name.last)] = p
    slots = [layout.sub_group_slots(k) for k in range(len(layout.sub_group_sizes))]
    unknown = sorted({s.name for k in {k for e in empties.values() for k in e} for s in (slots[k][0], slots[k][-1])
                      if s.name not in order})
    if unknown:
        problems.append(f"{tag_dir / SWAP_DIR}: cannot name the swap files of the swapped sub-groups: parameters "
                        f"{', '.join(unknown[:4])} are not in the model-states module, so DeepSpeed's parameter ids "
                        "are not known (saved with exclude_frozen_parameters?)")
        return out
    align = aio_alignment(ds_config)
    offsets: dict[int, int] = {}  # dp rank -> its offset
    for dp, subs in sorted(empties.items()):
        folder = tag_dir / SWAP_DIR / f"rank{dp:02d}"
        files = by_rank.get(dp, {})
        masters = [(a, b) for (s, a, b) in files if s is None]
        candidates = None
        for k in subs:
            first, last = order[slots[k][0].name], order[slots[k][-1].name]
            fits = {a - first for a, b in masters if b - a == last - first}
            candidates = fits if candidates is None else candidates & fits
        if len(candidates) != 1:
            problems.append(
                f"{folder}: {len(subs)} sub-group(s) ({', '.join(map(str, sorted(subs)))}) are swapped to NVMe, but "
                + ("no" if not candidates else f"{len(candidates)}") + " offset of DeepSpeed's parameter ids names "
                f"a swap file for each of them (found {len(masters)} partition file(s): "
                f"{', '.join(f'{a}_{b}.tensor.swp' for a, b in sorted(masters)[:6]) or 'none'}); "
                + ("the swap folder is incomplete or from another model" if not candidates else
                   "which file belongs to which sub-group is ambiguous"))
            continue
        base = candidates.pop()
        offsets[dp] = base
        found, ok = {}, True
        for k, empty in sorted(subs.items()):
            a, b = base + order[slots[k][0].name], base + order[slots[k][-1].name]
            numel = layout.sub_group_sizes[k]
            found[(dp, k)] = {}
            for key, placeholder in [(None, empty), *states.get(dp, {}).get(k, {}).items()]:
                path = files.get((key, a, b))
                shown = f"{key + '-' if key else ''}{a}_{b}.tensor.swp"
                if path is None:
                    problems.append(f"{folder / shown}: missing; sub-group {k}'s "
                                    f"{'fp32 partition' if key is None else key} is swapped to NVMe and kept nowhere else")
                    ok = False
                    continue
                size = path.stat().st_size
                want = -(-numel * placeholder.itemsize // align) * align
                if size != want:
                    problems.append(f"{path}: {size} bytes, but sub-group {k}'s partition of {numel} "
                                    f"{placeholder.dtype_name} elements padded to {align} bytes needs {want}")
                    ok = False
                    continue
                found[(dp, k)][key] = RawTensor(os.fspath(path), placeholder.dtype_name, numel, 0, size,
                                                placeholder.requires_grad)
        if ok:
            out.tensors.update(found)
    if len(set(offsets.values())) > 1:
        seen = ", ".join(f"rank{dp:02d}: {o}" for dp, o in sorted(offsets.items()))
        problems.append(f"{tag_dir / SWAP_DIR}: the ranks' swap files disagree on DeepSpeed's parameter ids "
                        f"(the first parameter's id by {seen}): they do not come from one run")
        out.tensors.clear()
    out.offset = next(iter(offsets.values())) if len(set(offsets.values())) == 1 else None
    return out


__all__ = ["SWAP_DIR", "SwapName", "swap_name", "swap_paths", "aio_alignment", "parameter_order", "Swapped",
           "resolve"]
