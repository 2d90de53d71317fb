"""What an optimizer keeps: the one table every command reads.

A ZeRO checkpoint holds, per flat parameter group (ZeRO-1/2) or sub-group (ZeRO-3), the state of the
optimizer that stepped that group. The state is a few tensors (``exp_avg``, ``momentum_buffer`` ...) and
perhaps a step count. What they mean depends on the optimizer: a :class:`Family` says which keys it keeps,
which of them cannot be below zero (second moments, sums of squares), whether it counts steps, and what
torch's own optimizer of the same kind calls them (a DCP export writes torch's names). :func:`identify` tells
the family of one group from what its files hold; nothing is guessed: a group that fits no family, or more
than one, is :data:`UNKNOWN`, whose states are read as stored and refused where they would be re-cut.

How each key lies in the rank files is its :class:`StateKey` ``layout``:

- :data:`PARTITIONED`: one value per element of the rank's flat partition, like the fp32 master (Adam's
  moments, SGD's and RMSprop's buffers, Adagrad's sums, Adafactor's ``variance`` on the 1-D partitions).
- :data:`WHOLE_PARAMS`: Muon's ``momentum_buffer`` at ZeRO-1/2. DeepSpeed keeps, on each rank, the whole
  momentum of every matrix that has an element in the rank's partition (``get_partition_info``: a matrix that
  starts in the partition, or runs into it from the one before), concatenated in flat order; a matrix that
  straddles a partition boundary is held whole by every rank it touches.

A :class:`GroupStates` is one group's entry: its family, its keys with their layout and dtype on disk, and
its step (None where the optimizer counts none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PARTITIONED = "partitioned"
WHOLE_PARAMS = "whole parameters"


@dataclass(frozen=True)
class Family:
    """One kind of optimizer, as its state in a ZeRO checkpoint shows it.

    Attributes:
        name: short name (``"adam"``, ``"muon"``, ...); ``label``: how users know it.
        keys: the per-element state keys it always keeps; ``optional``: those it keeps with some settings
            (RMSprop's ``momentum_buffer`` and ``grad_avg``, AMSGrad's ``max_exp_avg_sq``).
        nonnegative: keys whose values cannot be below zero (a negative one is damage).
        steps: whether it counts steps (``step`` in each group's state).
        marks: hyper-parameters only this family's param groups have; a group matches the family only if it
            has one of them (empty: no such test); ``absent``: hyper-parameters its groups never have.
        torch: the ``torch.optim`` class that keeps the same state under the same meaning (None: none);
            ``torch_keys``: ``(key here, torch's key)`` where the names differ; ``torch_hyper``: the
            hyper-parameters torch 2.13's class keeps in each param group (a DCP load needs every one);
            ``torch_fills``: ``(hyper-parameter, value)`` for those a DeepSpeed-built group does not record,
            as DeepSpeed's implementation fixes them (a group's own value always wins); ``torch_state_hyper``: the
            hyper-parameters that decide which state keys torch's class keeps (SGD keeps ``momentum_buffer`` only
            with ``momentum`` above zero): a DCP load fills only the state an optimizer already has, so a loading
            script must build it with the run's values.
        reshard_note: what a reshard to another data-parallel size cannot keep although every value is exact
            (empty where nothing).
        not_torch: why its state cannot be carried to a torch optimizer (where ``torch`` is None, or where
            torch keeps another form).
        whole_params_at_zero12: at ZeRO-1/2 its keys are :data:`WHOLE_PARAMS` (Muon).
    """

    name: str
    label: str
    keys: tuple
    optional: tuple = ()
    nonnegative: frozenset = frozenset()
    steps: bool = True
    marks: tuple = ()
    absent: tuple = ()
    torch: Optional[str] = None
    torch_keys: tuple = ()
    torch_hyper: tuple = ()
    torch_fills: tuple = ()
    torch_state_hyper: tuple = ()
    not_torch: str = ""
    reshard_note: str = ""
    whole_params_at_zero12: bool = False

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    @property
    def all_keys(self) -> tuple:
        return self.keys + self.optional

    def torch_key(self, key: str) -> str:
        """What torch's optimizer of this family calls state ``key``."""
        return dict(self.torch_keys).get(key, key)

    def fits(self, keys: set, group: dict) -> bool:
        """Whether a group whose files hold the per-element ``keys`` and hyper-parameters ``group`` is one of
        this family's."""
        if keys and not set(self.keys) <= keys <= set(self.all_keys):
            return False
        if not keys and not self.marks:  # no state yet: only the hyper-parameters can tell
            return False
        return (not self.marks or any(m in group for m in self.marks)) and not any(a in group for a in self.absent)


#: hyper-parameters every torch 2.13 optimizer below keeps, as a DeepSpeed-built group (whose optimizer has no
#: such switches) runs: no maximize, no foreach/fused/differentiable/capturable kernels
_TORCH_SWITCHES = (("maximize", False), ("foreach", None), ("differentiable", False))

ADAM = Family("adam", "Adam/AdamW", ("exp_avg", "exp_avg_sq"), optional=("max_exp_avg_sq",),
              nonnegative=frozenset({"exp_avg_sq", "max_exp_avg_sq"}), marks=("eps",), torch="AdamW",
              torch_hyper=("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                           "differentiable", "fused", "decoupled_weight_decay"),
              torch_fills=_TORCH_SWITCHES + (("amsgrad", False), ("capturable", False), ("fused", None)),
              torch_state_hyper=("amsgrad",))
MUON = Family("muon", "Muon", ("momentum_buffer",), steps=False, marks=("use_muon",), torch="Muon",
              whole_params_at_zero12=True,
              torch_hyper=("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                           "adjust_lr_fn"),
              # DeepSpeed's muon_update: Nesterov momentum, 5 Newton-Schulz steps with these coefficients and eps,
              # the update scaled by sqrt(max(1, rows / cols)) (torch's "original"); its default ns_method "gram"
              # iterates on the Gram matrix (in fp16 where supported), torch's standard quintic one does not, so
              # the steps agree in their settings, not bit for bit (docs/dcp.md)
              torch_fills=(("nesterov", True), ("ns_coefficients", (3.4445, -4.775, 2.0315)), ("eps", 1e-07),
                           ("ns_steps", 5), ("adjust_lr_fn", "original")))
SGD = Family("sgd", "SGD with momentum", ("momentum_buffer",), steps=False, marks=("dampening", "nesterov"),
             torch="SGD", torch_hyper=("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                                       "foreach", "differentiable", "fused"),
             torch_fills=_TORCH_SWITCHES + (("fused", None),), torch_state_hyper=("momentum",))
ADAGRAD = Family("adagrad", "Adagrad", ("sum",), nonnegative=frozenset({"sum"}),
                 marks=("lr_decay", "initial_accumulator_value"), torch="Adagrad",
                 torch_hyper=("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value", "foreach",
                              "maximize", "differentiable", "fused"),
                 torch_fills=_TORCH_SWITCHES + (("fused", None),))
CPU_ADAGRAD = Family("cpu_adagrad", "DeepSpeed CPU Adagrad", ("exp_avg_sq",), nonnegative=frozenset({"exp_avg_sq"}),
                     marks=("eps",), absent=("betas",), torch="Adagrad", torch_keys=(("exp_avg_sq", "sum"),),
                     torch_hyper=ADAGRAD.torch_hyper,
                     # its sum of squared gradients starts at zero and its lr never decays
                     torch_fills=_TORCH_SWITCHES + (("fused", None), ("lr_decay", 0), ("initial_accumulator_value", 0)))
RMSPROP = Family("rmsprop", "RMSprop", ("square_avg",), optional=("momentum_buffer", "grad_avg"),
                 nonnegative=frozenset({"square_avg"}), marks=("alpha", "centered"), torch="RMSprop",
                 torch_hyper=("lr", "momentum", "alpha", "eps", "centered", "weight_decay", "capturable", "foreach",
                              "maximize", "differentiable"),
                 torch_fills=_TORCH_SWITCHES + (("capturable", False),), torch_state_hyper=("momentum", "centered"))
ADAFACTOR = Family("adafactor", "Adafactor", ("variance",), nonnegative=frozenset({"variance"}),
                   marks=("beta2_decay",),
                   not_torch="torch's Adafactor keeps a matrix's second moment factored (row_var and col_var), "
                             "where the ZeRO partitions hold a full 'variance' per element, which cannot be "
                             "factored back exactly; and torch 2.13's Adafactor cannot step a matrix under "
                             "fully_shard (aten.pow_.Scalar: in-place operations that require placement changes "
                             "are not supported)",
                   reshard_note="DeepSpeed's ZeRO Adafactor scales each update by norms taken over a rank's whole "
                                "flat partition (torch's Adafactor on the 1-D partition: param.norm() and "
                                "update.norm()), so its steps depend on how the parameters are partitioned: at "
                                "another data-parallel size the state is exact but the run takes other steps than "
                                "it would have at the saved size")
LION = Family("lion", "Lion", ("exp_avg",), optional=("exp_avg_sq",),  # CPU Lion's exp_avg_sq stays all zeros
              marks=("betas",), absent=("eps",),
              not_torch="torch has no Lion optimizer, so no torch training script can load its state")

#: what each state that cannot be negative is, for messages
MEANINGS = {"exp_avg_sq": "a running mean of squared gradients", "max_exp_avg_sq": "the largest running mean of "
            "squared gradients", "sum": "a sum of squared gradients", "square_avg": "a running mean of squared "
            "gradients", "variance": "a running mean of squared gradients"}

#: the families :func:`identify` knows, most specific first
FAMILIES = (MUON, ADAM, SGD, ADAGRAD, CPU_ADAGRAD, RMSPROP, ADAFACTOR, LION)
UNKNOWN = Family("unknown", "an optimizer ckptlib does not know", (), steps=True,
                 not_torch="ckptlib does not know this optimizer, so it cannot say which torch optimizer keeps "
                           "the same state")


def identify(keys, group: dict) -> Family:
    """The family of one group whose per-element state keys are ``keys`` and whose hyper-parameters are
    ``group`` (its param_groups entry, without ``params``).

    A group whose keys fit no family, or several, is :data:`UNKNOWN`. A group with no state yet (no step
    taken) is told by its hyper-parameters alone, where they name one family."""
    keys = set(keys)
    if group.get("use_muon") is False:  # the Adam half of a Muon param group
        return ADAM if ADAM.fits(keys, group) else UNKNOWN
    found = [f for f in FAMILIES if f.fits(keys, group)]
    return found[0] if len(found) == 1 else UNKNOWN


@dataclass(frozen=True)
class StateKey:
    """One per-element state key of a group: its name, how it lies in the rank files (:data:`PARTITIONED`,
    :data:`WHOLE_PARAMS`) and its dtype on disk."""

    name: str
    layout: str = PARTITIONED
    dtype: str = "float32"


@dataclass(frozen=True)
class GroupStates:
    """What one flat group (ZeRO-1/2) or sub-group (ZeRO-3) keeps.

    Attributes:
        group: its index; ``name``: the param group's ``name`` where it has one (Muon's halves do).
        family: the :class:`Family` its state shows.
        keys: its per-element keys, in the order the file holds them.
        step: its step count; None where it keeps none.
    """

    group: int
    family: Family
    keys: tuple = ()
    step: Optional[int] = None
    name: Optional[str] = None

    @property
    def key_names(self) -> tuple:
        return tuple(k.name for k in self.keys)

    def key(self, name: str) -> Optional[StateKey]:
        return next((k for k in self.keys if k.name == name), None)

    @property
    def label(self) -> str:
        """``"group 0 (group0-muon-params: Muon ...)"``: how messages name it."""
        return f"group {self.group} ({(self.name + ': ') if self.name else ''}{self.family.label})"


def describe(groups) -> str:
    """One line naming the optimizer(s) of ``groups``: ``"Muon + Adam/AdamW"``."""
    labels = []
    for g in groups:
        if g.family.label not in labels:
            labels.append(g.family.label)
    return " + ".join(labels) if labels else "no optimizer state"


__all__ = ["PARTITIONED", "WHOLE_PARAMS", "MEANINGS", "Family", "FAMILIES", "UNKNOWN", "ADAM", "MUON", "SGD", "ADAGRAD",
           "CPU_ADAGRAD", "RMSPROP", "ADAFACTOR", "LION", "identify", "StateKey", "GroupStates", "describe"]
