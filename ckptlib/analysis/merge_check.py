"""Checking a merge's output (:func:`ckptlib.plan_merge`) against its sources, as :func:`ckptlib.verify` does for a
merge plan: every planned file there; each file holds exactly the planned tensors; every tensor the adapter leaves
alone equals the base's (cast to the output dtype), every ``modules_to_save`` weight the checkpoint's master, bit for
bit (streamed, as any export's); every merged weight and bias equals a recomputation (peft's arithmetic,
:mod:`ckptlib.io.lora_merge`) from the base and the masters read afresh: the base's safetensors headers read again,
the factors' ranges from the checkpoint opened anew, so the comparison does not trust the plan's ranges.

Memory: the comparer's buffers for the streamed tensors; for a merged one, what merging it holds
(:func:`ckptlib.io.lora_merge.arithmetic_bytes`) plus the output's value read back.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..dtypes import import_torch
from ..io.lora_merge import WHY_TORCH, base_files, base_headers, merged_value, stored_ranges
from ..io.streaming import read_ranges
from ..plan import Factor, MergedTensor
from .tensorsets import output_file_tallies


def merge_tallies(plan, src, out: Path, cmp, share) -> list[tuple[str, int, list]]:
    """``[(what was checked, how many, the names of those that failed)]`` of a merge's output at ``out``; ``src``
    the checkpoint opened anew, ``cmp`` a :class:`~ckptlib.analysis.compare.Comparer`, ``share`` which comparisons
    are this process's (:class:`ckptlib.analysis.verify.Share`)."""
    tallies, found = output_file_tallies(plan, plan.weights, out)
    if tallies[0][2]:  # a planned file is missing
        return tallies
    base = {t.name: stored_ranges(f, t) for f, ts in base_headers(base_files(Path(plan.base))[0]).items() for t in ts}
    kept = [t for t in plan.tensors if not isinstance(t, MergedTensor) and t.kind == "base"]
    saved = [t for t in plan.tensors if not isinstance(t, MergedTensor) and t.kind == "modules_to_save"]
    merged = [t for t in plan.tensors if isinstance(t, MergedTensor)]
    bad = [t.name for t in kept if _differ(t, base.get(t.name), found, cmp, share)]
    tallies.append((f"every tensor the adapter leaves alone equals the base's (as {plan.dtype}), bit for bit",
                    len(kept), bad))
    if saved:
        bad = [t.name for t in saved if _differ(t, tuple(src.sources(t.source)), found, cmp, share)]
        tallies.append((f"every modules_to_save weight equals the checkpoint's fp32 master (as {plan.dtype}), bit for "
                        "bit", len(saved), bad))
    bad = [t.name for t in merged if _merge_differs(t, base.get(t.name), src, found, cmp, share)]
    tallies.append((f"every merged weight and bias equals its recomputation from the base and the fp32 masters "
                    f"(peft's arithmetic, --merge-on {plan.merge_on}), bit for bit", len(merged), bad))
    return tallies


def _differ(t, ranges, found: dict, cmp, share) -> bool:
    got, mine = found.get(t.name), share.mine()
    if got is None or ranges is None:
        return True
    return mine and not cmp.equal(ranges, got.ranges, t.dtype)


def _merge_differs(t: MergedTensor, ranges, src, found: dict, cmp, share) -> bool:
    """Whether the output's ``t`` differs from ``t`` merged again, its base read from ``ranges`` (the base's header
    read afresh) and its factors from ``src`` (the checkpoint opened anew)."""
    got, mine = found.get(t.name), share.mine()
    if got is None or ranges is None:
        return True
    if not mine:
        return False
    torch = import_torch(WHY_TORCH)
    fresh = dataclasses.replace(t, ranges=ranges, factors=tuple(
        Factor(f.role, f.source, f.shape, tuple(src.sources(f.source))) for f in t.factors))
    want = merged_value(fresh, cmp.files).contiguous().view(-1)
    have = read_ranges(got.ranges, t.dtype, cmp.files) if t.numel else want
    cmp.compared += 2 * t.nbytes
    cmp.progress(t.nbytes)
    return have.dtype != want.dtype or not torch.equal(have.view(torch.uint8), want.view(torch.uint8))


__all__ = ["merge_tallies"]
