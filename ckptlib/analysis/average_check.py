"""Checking an average's output (:func:`ckptlib.plan_average`) against its sources, as :func:`ckptlib.verify` does
for an average plan. Every source is opened afresh, so the comparison does not trust the plan's ranges; only the
plan's weights are taken as they are (they are the user's).

- Hugging Face layout: every planned file there; each file holds exactly the planned tensors (names, dtypes,
  shapes); each index maps every tensor to its shard; every averaged tensor equals its recomputation from the
  sources' masters (:func:`ckptlib.io.averaging.first_averaged_difference`: the float64 sum rounded as the plan's
  dtype), every other tensor the last source's (as written), bit for bit.
- DeepSpeed: the output opens as a checkpoint at the last source's stage and mesh, with its parameters; every master
  equals the recomputed average (in the dtype it is stored in), every 16-bit module weight the average rounded to its
  dtype; every optimizer state, frozen parameter, buffer and step equals the last source's.

Memory: the comparer's buffers, and three arrays of the comparer's window for a recomputation.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from ..deepspeed import Checkpoint, open_checkpoint
from ..deepspeed.zeroset import MODULE
from ..errors import CkptError
from ..io.averaging import first_averaged_difference
from ..plan import AveragedTensor
from .tensorsets import output_file_tallies


def average_tallies(plan, src: Checkpoint, out: Path, cmp, share) -> list[tuple[str, int, list]]:
    """``[(what was checked, how many, the names of those that failed)]`` of an average's output at ``out``; ``src``
    the last source opened anew, ``cmp`` a :class:`~ckptlib.analysis.compare.Comparer`, ``share`` which comparisons
    are this process's (:class:`ckptlib.analysis.verify.Share`)."""
    with contextlib.ExitStack() as stack:
        cks = [stack.enter_context(open_checkpoint(s.save_dir, tag=s.tag, tp_rules=s.tp_rules))
               for s in plan.sources[:-1]] + [src]
        recompute = Recompute(cks, plan.weights, cmp)
        if plan.format == "deepspeed":
            return _deepspeed_tallies(plan, src, out, cmp, share, recompute)
        return _hf_tallies(plan, src, out, cmp, share, recompute)


class Recompute:
    """Compares written ranges with an average recomputed from the sources ``cks`` with ``weights``."""

    def __init__(self, cks: list, weights: tuple, cmp):
        self.cks, self.weights, self.cmp = cks, weights, cmp

    def differs(self, name: str, got, dtype: str) -> bool:
        terms = tuple((w, tuple(ck.sources(name))) for w, ck in zip(self.weights, self.cks))

        def counted(nbytes: int) -> None:
            self.cmp.compared += 2 * nbytes
            self.cmp.progress(nbytes)

        return first_averaged_difference(terms, dtype, list(got), self.cmp.files, self.cmp.slot_bytes,
                                         self.cmp.cancel, counted) is not None


def _hf_tallies(plan, src: Checkpoint, out: Path, cmp, share, recompute: Recompute) -> list:
    tallies, found = output_file_tallies(plan, plan.weight_files, out)
    if tallies[0][2]:  # a planned file is missing
        return tallies
    averaged = [t for t in plan.tensors if isinstance(t, AveragedTensor)]
    kept = [t for t in plan.tensors if not isinstance(t, AveragedTensor)]
    bad = []
    for t in averaged:
        got, mine = found.get(t.name), share.mine()
        if got is None or (mine and recompute.differs(t.source, got.ranges, t.dtype)):
            bad.append(t.name)
    tallies.append((f"every averaged tensor equals its recomputation from the {len(plan.sources)} sources (Σ w_i·x_i "
                    f"in float64, as {plan.dtype}), bit for bit", len(averaged), bad))
    bad = []
    for t in kept:
        got, mine = found.get(t.name), share.mine()
        if got is None or (mine and not cmp.equal(src.sources(t.source, t.key), got.ranges, t.dtype)):
            bad.append(t.name)
    tallies.append(("every other tensor (buffers, frozen parameters) equals the last source's, bit for bit",
                    len(kept), bad))
    return tallies


def _deepspeed_tallies(plan, src: Checkpoint, out: Path, cmp, share, recompute: Recompute) -> list:
    try:
        new = open_checkpoint(out)
    except CkptError as e:
        return [(f"the output opens as a checkpoint ({e})", 1, ["the output"])]
    with new:
        same_mesh = (new.zero_stage, new.mesh, new.partition_count) == (src.zero_stage, src.mesh, src.partition_count)
        tallies = [("the output opens as a checkpoint, no problems, at the last source's stage and mesh", 1,
                    [] if not new.problems and same_mesh else ["; ".join(new.problems) or
                                                              f"ZeRO-{new.zero_stage} mesh {new.mesh}"])]
        ours = {p.name: (tuple(p.shape), p.trainable, p.tied_to) for p in new.parameters}
        if ours != {p.name: (tuple(p.shape), p.trainable, p.tied_to) for p in src.parameters} or new.problems:
            return tallies + [("same parameters, shapes, frozen and tied ones", 1, ["the output"])]
        trainable = [p for p in src.parameters if p.trainable and not p.tied_to]
        bad = []
        for p in trainable:
            got = new.sources(p.name)
            if share.mine() and recompute.differs(p.name, got, _stored(got)):
                bad.append(p.name)
        tallies.append(("every master equals its recomputed average, bit for bit", len(trainable), bad))
        module, bad = [], []
        for p in src.parameters:
            owner = p.tied_to or p.name
            if not src.param(owner).trainable:
                continue
            try:
                got = new.sources(p.name, MODULE)
            except KeyError:  # ZeRO-3: a placeholder
                continue
            module.append(p.name)
            if share.mine() and recompute.differs(owner, got, _stored(got)):
                bad.append(p.name)
        if module:
            tallies.append(("every 16-bit module weight equals the average rounded to its dtype, bit for bit",
                            len(module), bad))
        keys = list(src.optimizer.state_keys) if src.optimizer else []
        held = [(p.name, k) for k in keys for p in trainable if k in src.state_keys(p.name)]
        bad = [f"{n}/{k}" for n, k in held if share.mine() and not _equal(cmp, src.sources(n, k), new, n, k)]
        tallies.append(("every optimizer state equals the last source's, bit for bit", len(held), bad))
        others = [p.name for p in src.parameters if not p.trainable and not p.tied_to] + [b.name for b in src.buffers]
        bad = [n for n in others if share.mine() and not _equal(cmp, src.sources(n), new, n, None)]
        tallies.append(("frozen parameters and buffers equal the last source's", len(others), bad))
        bad = [p.name for p in trainable if new.step_of(p.name) != src.step_of(p.name)]
        tallies.append(("every parameter's step is the last source's", len(trainable), bad))
    return tallies


def _stored(ranges) -> str:
    return next((r.dtype for r in ranges if hasattr(r, "dtype")), "float32")


def _equal(cmp, ranges, new: Checkpoint, name: str, key) -> bool:
    try:
        got = new.sources(name, key)
    except (KeyError, CkptError):
        return False
    return cmp.equal(ranges, got, _stored(ranges))


__all__ = ["average_tallies", "Recompute"]
