"""The parsed records of one DeepSpeed checkpoint (plain data, built by :mod:`ckptlib.deepspeed.parse`).

:class:`Records` is everything opening a checkpoint learned: its files and their roles, ZeRO stage and
optimizer flavour, training dtype, sizes, version, optimizer, parameters, buffers, the partition layout,
quirks of older releases and problems found, and where each partitioned tensor is (tensor handles into
the opened files, see :class:`TensorIndex`). Nothing here reads a file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from ..layout.flat import FlatGroupLayout, Zero3Layout

Layout = Union[FlatGroupLayout, Zero3Layout]

ZERO = "zero"                      # DeepSpeedZeroOptimizer (stage 1/2) or stage 3
BF16_OPTIMIZER = "bf16_optimizer"  # BF16_Optimizer: padded fp32 partitions, no zero_stage key
NO_ZERO = "no_zero"                # stage 0: everything in the model-states file


@dataclass
class FileInfo:
    """One file of the tag folder."""

    path: Path
    relpath: str
    bytes: int
    kind: str
    dp_rank: Optional[int] = None
    mp_rank: Optional[int] = None
    prefix: str = ""
    layer: Optional[int] = None     # pipeline layer files, MoE expert files
    expert: Optional[int] = None    # MoE expert files: the global expert id


@dataclass
class ParameterInfo:
    """One parameter of the model.

    ``group`` is the optimizer parameter group (ZeRO-1/2) or sub-group (ZeRO-3) of a trainable parameter.
    ``tied_to`` names the parameter whose data this one shares (then its values are that parameter's).
    """

    name: str
    shape: tuple
    trainable: bool
    tied_to: Optional[str] = None
    group: Optional[int] = None
    stored_dtype: Optional[str] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class BufferInfo:
    name: str
    shape: tuple
    dtype: str


@dataclass
class OptimizerInfo:
    """What the checkpoint says about the optimizer.

    ``groups``: per flat group (ZeRO-1/2), sub-group (ZeRO-3) or torch param group (stage 0), what it keeps
    (:class:`~ckptlib.kinds.optimizers.GroupStates`: its optimizer family, per-element keys with their layout
    and dtype, its step); ``state_keys``: every group's keys, in the order first seen; ``step``: the step of the
    first group that counts steps; ``state_problems``: keys whose stored sizes fit no layout
    (:class:`~ckptlib.deepspeed.states.StateProblem`), which are not read.
    """

    wrapper: str
    state_keys: list
    step: Optional[int]
    param_groups: list = field(default_factory=list)  # hyper-parameters per group, without 'params'
    loss_scale: Optional[float] = None
    groups: list = field(default_factory=list)
    state_problems: list = field(default_factory=list)

    def group(self, g: Optional[int]):
        """Group ``g``'s :class:`~ckptlib.kinds.optimizers.GroupStates`, or None."""
        return self.groups[g] if g is not None and 0 <= g < len(self.groups) else None

    def keys_of(self, g: Optional[int]) -> tuple:
        """The per-element state keys group ``g`` keeps (every group's where the groups are not known)."""
        gs = self.group(g)
        return gs.key_names if gs is not None else (tuple(self.state_keys) if not self.groups else ())

    def unplaceable(self, g: Optional[int], key: str) -> list:
        """The problems that keep state ``key`` of group ``g`` from being read (its sizes fit no layout)."""
        return [p for p in self.state_problems if p.group == g and p.key == key]


@dataclass
class TensorIndex:
    """Where the tensors are, as handles into the opened files.

    ``module``: the model-states file's ``module`` entries (16-bit weights, buffers); ``optim``: each
    rank's ``optimizer_state_dict``; ``frozen``: per frozen parameter, its stored chunks in rank order
    (one tensor except at ZeRO-3); ``stage0``: per trainable parameter at stage 0, its (group, index)
    in the optimizer.
    """

    module: dict = field(default_factory=dict)
    optim: dict = field(default_factory=dict)        # Rank -> optimizer_state_dict
    frozen: dict = field(default_factory=dict)       # name -> [TensorHandle]
    stage0: dict = field(default_factory=dict)       # name -> (group, index[, expert-parallel rank])
    stage0_optimizer: Any = None                     # the model file's 'optimizer' entry (stage 0)
    stage0_optimizers: dict = field(default_factory=dict)  # ZeRO-0 MoE: expert-parallel rank -> its optimizer
    experts: dict = field(default_factory=dict)      # MoE: global name -> (group, expert-parallel rank, local name)
    swapped: dict = field(default_factory=dict)      # NVMe offload: (dp, sub-group) -> {state or None: RawTensor}
    stage0_ambiguous: dict = field(default_factory=dict)  # ZeRO-0: matched name -> the other name it could be
    alias_proofs: list = field(default_factory=list)  # (what, ranges, ranges, dtype): aliases known by name, proven
    zero3_members: dict = field(default_factory=dict)  # AutoEP ZeRO-3: expert name -> data rank of each partition


@dataclass
class Records:
    """Everything parsing a checkpoint found. See :class:`ckptlib.deepspeed.Checkpoint` for the fields."""

    files: list
    zero_stage: Optional[int] = None
    flavor: str = NO_ZERO
    dtype: Optional[str] = None
    dp_world_size: Optional[int] = None
    mp_world_size: Optional[int] = None
    partition_count: Optional[int] = None
    deepspeed_version: Optional[str] = None
    ds_config: dict = field(default_factory=dict)
    optimizer: Optional[OptimizerInfo] = None
    parameters: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    layouts: list = field(default_factory=list)
    quirks: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    unsupported: list = field(default_factory=list)  # the problems that are layouts ckptlib refuses to read
    expert_groups: dict = field(default_factory=dict)  # MoE: group -> ckptlib.deepspeed.moe.ExpertGroup
    autoep_layers: list = field(default_factory=list)  # AutoEP: its MoE layers (ckptlib.deepspeed.autoep.AutoEPLayer)
    ties_from_storage: dict = field(default_factory=dict)
    index: TensorIndex = field(default_factory=TensorIndex)


class NameIndex:
    """Finds items of a list by their ``name`` (the first with that name) in constant time; the index is
    rebuilt when the list is another object or has another length than when it was built."""

    def __init__(self):
        self._of: Optional[tuple] = None  # (the list, its length, {name: item})

    def get(self, items: list, name: str) -> Any:
        """The first item of ``items`` named ``name``, or None."""
        if self._of is None or self._of[0] is not items or self._of[1] != len(items):
            index: dict = {}
            for item in items:
                index.setdefault(item.name, item)
            self._of = (items, len(items), index)
        return self._of[2].get(name)


__all__ = ["ZERO", "BF16_OPTIMIZER", "NO_ZERO", "Layout", "FileInfo", "ParameterInfo", "BufferInfo", "OptimizerInfo",
           "TensorIndex", "Records", "NameIndex"]
