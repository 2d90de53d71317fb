"""DeepSpeed's file names: what each file in a tag folder is (no I/O).

Names as DeepSpeed writes them (the dp rank is not zero padded, the mp rank is ``%02d``):

=====================================================  ==========================================
``mp_rank_{mp:02d}_model_states.pt``                   model states, ZeRO 0/1/2 (one per mp rank)
``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt`` model states, ZeRO-3 (one per rank)
``[bf16_|fp16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``  optimizer states, one per dp rank
``layer_{idx:02d}[-model_{tp:02d}]-model_states.pt``   pipeline layer weights
``[layer_{l}_]expert_{e}_mp_rank_{mp:02d}_model_states.pt``  MoE expert weights
``expp_rank_{ep}_mp_rank_{mp:02d}_optim_states.pt``    MoE expert optimizer states
``offloaded_tensors/rank{NN}/[{state}-]{a}_{b}.tensor.swp``  NVMe swap files (see :mod:`.offload`)
=====================================================  ==========================================
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

MODEL_STATES = "model_states"
OPTIM_STATES = "optim_states"
LAYER_STATES = "layer_states"
EXPERT_STATES = "expert_states"
EXPERT_OPTIM_STATES = "expert_optim_states"
OTHER = "other"
SWAP = "swap"  # a file of offloaded_tensors/ (NVMe offload)
FRAGMENT = "universal_fragment"              # a universal checkpoint's zero/<parameter>/<key>.pt
UNIVERSAL_OPTIMIZER = "universal_optimizer"  # a universal checkpoint's zero/optimizer_state.pt
UNIVERSAL_OPTIMIZER_FILE = "optimizer_state.pt"

_PATTERNS = [
    (re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$"), MODEL_STATES),
    (re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$"), MODEL_STATES),
    (re.compile(r"^(?P<prefix>bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states\.pt$"),
     OPTIM_STATES),
    (re.compile(r"^layer_(?P<layer>\d+)(-model_(?P<mp>\d+))?-model_states\.pt$"), LAYER_STATES),
    (re.compile(r"^(layer_(?P<layer>\d+)_)?expert_(?P<expert>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$"),
     EXPERT_STATES),
    (re.compile(r"^expp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$"), EXPERT_OPTIM_STATES),
]


@dataclass(frozen=True)
class FileRole:
    """What a file in a tag folder is."""

    name: str
    kind: str
    dp_rank: Optional[int] = None
    mp_rank: Optional[int] = None
    prefix: str = ""  # "bf16_" / "fp16_" for optimizer files
    layer: Optional[int] = None
    expert: Optional[int] = None

    @property
    def sort_key(self) -> tuple:
        order = [MODEL_STATES, OPTIM_STATES, LAYER_STATES, EXPERT_STATES, EXPERT_OPTIM_STATES, OTHER, SWAP]
        return (order.index(self.kind), self.mp_rank if self.mp_rank is not None else -1,
                self.dp_rank if self.dp_rank is not None else -1, self.layer or 0, self.expert or 0,
                natural_key(self.name))


def classify(name: str) -> FileRole:
    """The role of a file from its name alone."""
    for pattern, kind in _PATTERNS:
        m = pattern.match(name)
        if m:
            g = m.groupdict()
            as_int = lambda k: int(g[k]) if g.get(k) is not None else None  # noqa: E731
            return FileRole(name=name, kind=kind, dp_rank=as_int("dp"), mp_rank=as_int("mp"),
                            prefix=g.get("prefix") or "", layer=as_int("layer"), expert=as_int("expert"))
    return FileRole(name=name, kind=OTHER)


def natural_key(text: str) -> tuple:
    """Sort key that orders embedded numbers by value: ``rank_2`` before ``rank_10``."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def model_states_name(mp_rank: int = 0, dp_rank: Optional[int] = None) -> str:
    if dp_rank is None:
        return f"mp_rank_{mp_rank:02d}_model_states.pt"
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_states_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def layer_states_name(layer: int, tp_rank: Optional[int] = None) -> str:
    return f"layer_{layer:02d}-model_states.pt" if tp_rank is None else f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def optim_states_name(dp_rank: int, mp_rank: int = 0, prefix: str = "") -> str:
    return f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
