"""A universal checkpoint checked against the native checkpoint it was made from: ``ckpt check UNIVERSAL --against
ORIGINAL`` (:func:`check_universal`).

What users of universal folders report: a resume that trains as if from scratch (DeepSpeed #6691, LlamaFactory
#8295: moments lost), stale expert momentum (#8147), their own before/after scripts (#5475, #5822). The check runs
``ckpt diff ORIGINAL UNIVERSAL --states`` (every master, per-element optimizer state and each parameter's step,
streamed piece by piece) and names, per parameter, what a resume from the universal folder would lose:

- ``zeroed``: a state that is all zero in the universal folder where the original's is not (the "from scratch"
  resume: Adam's first steps then take full-size updates);
- ``step``: a parameter's step that differs from the original's (bias correction restarts);
- ``changed``: any other master or state that differs, with its largest difference (expert states included);
- ``missing``: a master, state or step the original has and the folder lacks (buffers and frozen weights a
  pipeline's folder cannot hold, which no universal load restores either, are notes).

Memory: the diff's (its chunk buffers); each changed state is read once more, in chunks, to tell whether it is zero.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..errors import CkptError
from ..layout.ranges import Zeros, numel
from .compare import Comparer
from .tensordiff import CHANGED, ONLY_IN_A, SHAPE_CHANGED, diff, plan_diff
from .tensorsets import UNIVERSAL, open_tensor_set

ZEROED, STEP, CHANGED_VALUE, MISSING = "zeroed", "step", "changed", "missing"
_ABSENT = "not in this universal checkpoint: "  # how the folder's notes name what it cannot give


@dataclass
class UniversalFinding:
    """One thing a resume from the universal folder would not get from the original: ``parameter``, ``what``
    (``fp32`` for the master, a state key, or ``step``), ``kind`` (``zeroed``, ``step``, ``changed``, ``missing``)
    and a sentence."""

    parameter: str
    what: str
    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class UniversalCheck:
    """The findings of :func:`check_universal` (empty: the folder holds exactly what the original holds)."""

    universal: str
    original: str
    findings: list = field(default_factory=list)
    compared: int = 0
    bytes_read: int = 0
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict:
        return {"universal": self.universal, "original": self.original, "ok": self.ok, "compared": self.compared,
                "bytes_read": self.bytes_read, "notes": list(self.notes),
                "findings": [dict(vars(f)) for f in self.findings]}

    def describe(self) -> str:
        lines = [f"universal {self.universal}", f"original  {self.original}"]
        lines += [f"  {f.kind:<8} {f.message}" for f in self.findings]
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"{len(self.findings)} finding(s) in {self.compared} masters, states and steps compared"
                     if self.findings else f"ok: the universal checkpoint holds the original's {self.compared} masters, "
                                           "states and steps exactly")
        return "\n".join(lines)


def _split(key: str) -> tuple[str, str]:
    """``(parameter, what)`` of a diff key: ``exp_avg/fc1.weight`` -> ``(fc1.weight, exp_avg)``; a weight ``fp32``."""
    head, sep, rest = key.partition("/")
    return (rest, head) if sep else (key, "fp32")


def check_universal(universal: Union[str, os.PathLike], original: Union[str, os.PathLike, Any], *,
                    tag: Optional[str] = None, original_tag: Optional[str] = None, observer=None,
                    tp_rules=None) -> UniversalCheck:
    """Check universal checkpoint ``universal`` against the native checkpoint ``original`` it was made from (see the
    module docstring).

    Raises:
        CkptError: ``universal`` is not a universal checkpoint; either cannot be read."""
    b = open_tensor_set(universal, tag=tag, states=True)
    if b.kind != UNIVERSAL:
        raise CkptError("this is not a universal checkpoint (no zero/ folder with one folder per parameter)",
                        path=universal, hint="give the <tag>_universal folder ds_to_universal or `ckpt reshard "
                                             "--universal` wrote, then the checkpoint it was made from")
    a = open_tensor_set(original, tag=original_tag, states=True, tp_rules=tp_rules)
    plan = plan_diff(a, b, states=True)
    result = diff(plan, observer=observer)
    out = UniversalCheck(universal=b.path, original=a.path, compared=len(result.tensors),
                         bytes_read=result.bytes_read, notes=list(plan.notes))
    weights = {k for k, t in a.tensors.items() if t.state is None}
    cmp = Comparer()
    try:
        for t in result.tensors:
            param, what = _split(t.key)
            if t.key in weights and t.status == ONLY_IN_A and any(
                    n.startswith(_ABSENT) and f" {param}:" in n for n in b.notes):
                continue  # a buffer or frozen weight the folder cannot give (a pipeline's): its notes name it
            if t.status == ONLY_IN_A:
                out.findings.append(UniversalFinding(param, what, MISSING, f"{param}: its {what} is not in the "
                                                                           "universal checkpoint"))
            elif t.status == SHAPE_CHANGED:
                out.findings.append(UniversalFinding(param, what, CHANGED_VALUE, f"{param}: its {what} has shape "
                                                     f"{list(t.shape_b)} there, {list(t.shape_a)} in the original"))
            elif t.status == CHANGED and what == "step":
                sa, sb = a.steps[param], b.steps[param]
                out.findings.append(UniversalFinding(param, STEP, STEP, f"{param}: step {sb:g} in the universal "
                                                     f"checkpoint, {sa:g} in the original (Adam's bias correction "
                                                     "restarts from the wrong step)"))
            elif t.status == CHANGED:
                zeroed = what != "fp32" and _all_zero(cmp, b.tensors[t.key].ranges)
                if zeroed:
                    out.findings.append(UniversalFinding(
                        param, what, ZEROED, f"{param}: its {what} is all zero in the universal checkpoint where "
                                             "the original's is not: a resume from it trains as if from scratch"))
                else:
                    out.findings.append(UniversalFinding(
                        param, what, CHANGED_VALUE, f"{param}: its {what} differs from the original's in "
                                                    f"{t.changed:,} of {t.numel:,} elements (largest |difference| "
                                                    f"{t.max_abs_diff:.3g})"))
        if a.steps and not b.steps:
            out.findings.append(UniversalFinding("*", STEP, MISSING, "the universal checkpoint records no optimizer "
                                                                     "step: a resume restarts Adam's bias correction"))
    finally:
        cmp.close()
    return out


def _all_zero(cmp: Comparer, ranges) -> bool:
    """Whether the stored ``ranges`` are all zero (compared, in chunks, with zeros)."""
    return cmp.difference(ranges, [Zeros(numel(ranges))], 0.0, 0.0).changed == 0


__all__ = ["check_universal", "UniversalCheck", "UniversalFinding", "ZEROED", "STEP", "CHANGED_VALUE", "MISSING"]
