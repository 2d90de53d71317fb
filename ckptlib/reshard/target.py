"""The model as a checkpoint at ANOTHER mesh holds it (metadata only): for every target ZeRO set (a stage and
tensor rank of the new mesh), which tensors it holds, cut how, in which optimizer group and order.

The source's full model (:class:`~ckptlib.deepspeed.model.ModelView`: every tensor as stored byte ranges of the
un-parallelised tensor, a padded vocabulary with its padding rows) is cut again:

- tensor parallel: by the split rules (the source's roles, or ``--tp-rules`` when the source records none):
  replicated tensors whole on every tensor rank, column-parallel ones (and vocabularies) along dim 0,
  row-parallel ones along dim 1, each into equal pieces (refused where the new size does not divide); what an
  AutoTP affine_map places, as AutoTP would cut it at the new size (:mod:`ckptlib.reshard.autotp`);
- pipeline: each layer to the stage the new partition gives it (:mod:`ckptlib.reshard.stages`), a tied
  module to every stage that uses it; a stage's tensors in its module's order (tied modules first, then
  its layers), its optimizer groups those of the source (matched by their hyper-parameters, so that a
  group is the same group on every stage).

What cannot be told from the checkpoint is refused, with the reason: stages whose optimizer groups differ,
a new stage that would lack a group, a size the new tensor size does not divide, frozen parameters.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from ..deepspeed import Checkpoint, SplitRules
from ..deepspeed.files import classify
from ..errors import PipelineUnknownError, UnsupportedCheckpointError
from ..layout.placement import COLUMN, REPLICATED, ROW, VOCABULARY, even_sizes, shard_runs
from ..mesh import Mesh
from .stages import TIED_MODULE, PipelinePlan



@dataclass(frozen=True)
class TargetTensor:
    """One tensor of a target set: the model's ``name``, its full (padded) shape, cut along ``dim`` into
    ``sizes`` (``dim`` None: whole), this set's piece ``index``; ``key``: its name inside its pipeline
    layer file (None outside pipelines), ``layer`` that file's layer."""

    name: str
    full_shape: tuple
    dim: Optional[int]
    sizes: tuple
    index: int
    trainable: bool = True
    group: Optional[int] = None
    key: Optional[str] = None
    layer: Optional[int] = None

    def shard(self) -> tuple[tuple, list]:
        """``(local shape, runs of the full tensor)``: see :func:`~ckptlib.layout.placement.shard_runs`."""
        return shard_runs(self.full_shape, self.dim, self.sizes, self.index)

    @property
    def shape(self) -> tuple:
        return self.shard()[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class TargetSet:
    """One ZeRO set of the target mesh: stage ``stage``, tensor rank ``tp``, files ``mp_rank_{mp:02d}``.
    ``groups``: the trainable tensors of each optimizer group in flat order; ``module``: every tensor of the
    set in its module's ``state_dict`` order (buffers and frozen ones included); ``layers``: the pipeline
    layers whose files it writes."""

    stage: int
    tp: int
    mp: int
    groups: list = field(default_factory=list)
    module: list = field(default_factory=list)
    layers: list = field(default_factory=list)

    @property
    def buffer_names(self) -> list:
        return [t.name for t in self.module if t.group is None and not t.trainable]


@dataclass
class TargetModel:
    """The sets of the target ``mesh`` (by mp rank), the pipeline partition (``parts``), and notes."""

    mesh: Mesh
    sets: dict
    parts: Optional[list] = None
    notes: list = field(default_factory=list)
    tensor_axis: bool = False  # layer files named layer_XX-model_YY


def _refuse(ck: Checkpoint, why: str, hint: Optional[str] = None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


def _role(ck: Checkpoint, name: str, rules: Optional[SplitRules]) -> Optional[str]:
    """How the source's view placed ``name`` over tensor ranks; a universal folder's view records none, and what its
    AutoTP affine_map places is "affine" there too."""
    role = ck.view.roles.get(name)
    if role is None and ck.universal is not None and rules is not None and rules.affine_entry(name) is not None:
        role = "affine"
    return role


def split_of(ck: Checkpoint, name: str, rules: Optional[SplitRules], tp: int, buffer: bool, autotp=None) -> tuple:
    """``(dim, sizes)`` of tensor ``name`` at ``tp`` tensor ranks (``dim`` None: replicated; ``autotp``: the
    :class:`~ckptlib.reshard.autotp.AutoTPTarget` that cuts what an AutoTP affine_map places)."""
    shape = ck.view.full_shape(name, padded=True)
    if tp == 1:
        return None, (shape[0],) if shape else ()
    role = _role(ck, name, rules)
    owner = next((p.tied_to for p in ck.view.parameters if p.name == name and p.tied_to), None) if role is None else None
    if owner is not None and _role(ck, owner, rules) == "affine":
        return split_of(ck, owner, rules, tp, buffer, autotp)  # a tied alias (the head of a tied embedding): its owner's cut
    if role is None:
        role = rules.rule(name) if rules is not None else None
        if buffer and role == COLUMN and not any(re.match(p, name) for p in (rules.row + rules.vocabulary)):
            role = REPLICATED  # a buffer no pattern names: one value, on every rank (as when joining)
    if role == "affine":
        if autotp is None:
            _refuse(ck, f"{name} is placed by an AutoTP affine_map, but the checkpoint's universal_checkpoint_info "
                        f"holds none ckptlib can re-cut for {tp} tensor ranks")
        return autotp.split(name, tp)
    if role is None:
        _refuse(ck, f"nothing says how {name} would be split over {tp} tensor ranks: the checkpoint has no tensor "
                    "axis and no rules were given", hint="pass --tp-rules FILE (the keys of DeepSpeed's "
                                                         "universal_checkpoint_info)")
    if role == REPLICATED:
        return None, (shape[0],) if shape else ()
    dim = 1 if role == ROW else 0
    if len(shape) <= dim:
        _refuse(ck, f"{name} of shape {list(shape)} cannot be split along dim {dim} ({role} parallel)")
    sizes = even_sizes(shape[dim], tp)
    if sizes is None:
        what = "its padded vocabulary" if role == VOCABULARY else f"dim {dim}"
        _refuse(ck, f"{name} of shape {list(shape)}: {tp} tensor ranks do not divide {what} ({shape[dim]})",
                hint="pick a tensor size that divides it" + (" (or pad the vocabulary to a multiple of it when "
                                                             "training)" if role == VOCABULARY else ""))
    return dim, tuple(sizes)


def _group_signatures(ck: Checkpoint) -> list:
    """Each set's optimizer groups as hyper-parameter signatures; they must be the same on every set."""
    sigs = {}
    for mp, zs in ck.sets.items():
        groups = (zs.optimizer.param_groups if zs.optimizer else []) or []
        sigs[mp] = [tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "step"))) for g in groups]
    first = sigs[min(sigs)]
    differ = [ck.set_label(mp) for mp, s in sigs.items() if s != first]
    if differ:
        _refuse(ck, f"the optimizer groups differ between {ck.set_label(min(sigs))} and {', '.join(differ)}: ckptlib "
                    "cannot tell which groups a set of the new mesh would have")
    return first


def client_group(ck: Checkpoint, name: str, group: Optional[int]) -> Optional[int]:
    """The optimizer group (as the user's code built it) of parameter ``name``: its group at ZeRO-1/2, the
    group whose sub-groups hold it at ZeRO-3 (``group`` is then its sub-group in the set holding it)."""
    if ck.zero_stage != 3 or group is None or ck.universal is not None:  # a universal folder records the group
        return group
    zs = ck.sets[ck.view.blocks[name][0].source[0]]
    groups = zs.optimizer_state_dict(zs.rank(0))["optimizer_state_dict"]["param_groups"]
    return next((g for g, pg in enumerate(groups) if group in pg["params"]), None)


def pipeline_layers(ck: Checkpoint) -> dict:
    """``{layer: [(model name, key in the layer file)]}`` of the source's layer files (tensor rank 0's), in
    file order; a tied layer's entries under ``tied_modules.<key>.*``; a layer without state: no entries."""
    out: dict = {}
    for mp, zs in sorted(ck.sets.items()):
        if zs.coordinate.tp:
            continue
        for name, h in zs.records.index.module.items():
            path = getattr(getattr(getattr(h, "storage", None), "file", None), "path", "")
            role = classify(path.rsplit("/", 1)[-1])
            if role.layer is None or role.kind != "layer_states":
                continue
            m = TIED_MODULE.match(name)
            key = m.group(2) if m else name.split(".", 1)[1]
            entries = out.setdefault(role.layer, [])
            if all(n != name for n, _ in entries):
                entries.append((name, key))
    for f in ck.files:  # a layer module without state (an activation): DeepSpeed saves, and loads, its empty file
        if f.kind == "layer_states" and f.layer is not None and (f.mp_rank or 0) == 0:
            out.setdefault(f.layer, [])
    return dict(sorted(out.items()))


def build_target(ck: Checkpoint, mesh: Mesh, rules: Optional[SplitRules], stages: Optional[PipelinePlan],
                 autotp=None) -> TargetModel:
    """The target model of ``ck`` at ``mesh`` (``rules``: the split rules when the source records none;
    ``stages``: the pipeline partition at the new size, for a pipeline; ``autotp``: see :func:`split_of`)."""
    view = ck.view
    whole = ck.universal is not None and mesh.tp == 1 and mesh.pp == 1  # frozen tensors stay whole: carried
    if not whole and any(not p.trainable for p in view.parameters if not p.tied_to):
        _refuse(ck, "frozen parameters are not carried through a reshard that changes tensor or pipeline sizes yet",
                hint="`ckpt reshard --world-size N` (data-parallel size only) keeps them")
    sigs = _group_signatures(ck)
    params = {p.name: p for p in view.parameters if not p.tied_to}
    buffers = {b.name for b in view.buffers}
    notes: list = []
    if stages is not None:
        layers = stages.layers
        order_per_stage = stages.stage_names(layers)
        parts = stages.target_parts
    else:
        layers, parts = {}, None
        aliases = {p.name for p in view.parameters if p.tied_to}  # a tied weight's second name (in the module)
        order_per_stage = {0: [n for n in ck.state_dict_names() if n in params or n in buffers or n in aliases]}
    layer_of = {n: (idx, key) for idx, ents in layers.items() for n, key in ents}
    sets: dict = {}
    for s, names in order_per_stage.items():
        for t in range(mesh.tp):
            ts = TargetSet(stage=s, tp=t, mp=s * mesh.tp + t,  # the layer files this stage writes: its own layers'
                           layers=sorted({layer_of[n][0] for n in names if n in layer_of
                                          and stages.layer_stage.get(layer_of[n][0]) == s}
                                         | {i for i, ents in layers.items() if not ents
                                            and stages.layer_stage.get(i) == s}) if stages else [])
            groups: list = [[] for _ in sigs]
            for n in names:
                buffer = n in buffers
                dim, sizes = split_of(ck, n, rules, mesh.tp, buffer, autotp)
                idx, key = layer_of.get(n, (None, None))
                p = params.get(n)
                tt = TargetTensor(n, view.full_shape(n, padded=True), dim, sizes, t, trainable=not buffer,
                                  group=None if buffer or p is None else p.group, key=key, layer=idx)
                ts.module.append(tt)
                if p is None and not buffer or p is not None and not p.trainable:
                    continue  # a tied alias (its owner's value) or a frozen weight: in the module, in no group
                if not buffer:
                    g = client_group(ck, n, p.group)
                    if g is None or not 0 <= g < len(groups):
                        _refuse(ck, f"{n}: its optimizer group is not known")
                    groups[g].append(dataclasses.replace(tt, group=g))
            empty = [g for g, members in enumerate(groups) if not members]
            if empty:  # the user's stage boundaries (or the only placement found) must change
                raise PipelineUnknownError(
                    f"stage {s} of the new mesh would hold no parameter of optimizer group "
                    f"{', '.join(map(str, empty))}: whether its optimizer then has that group depends on how your code "
                    "builds the groups, which the checkpoint does not say", path=ck.location.tag_dir,
                    hint="pick stage boundaries (--pp-partition) that give every stage a parameter of every group")
            ts.groups = groups
            sets[ts.mp] = ts
    tensor_axis = mesh.tp > 1 or any(f.kind == "layer_states" and f.mp_rank is not None for f in ck.files) or \
        (ck.universal is not None and ck.universal.source_mesh.tp > 1)  # its topology had a tensor axis
    return TargetModel(mesh=mesh, sets=sets, parts=parts, notes=notes, tensor_axis=tensor_axis)


__all__ = ["TargetTensor", "TargetSet", "TargetModel", "build_target", "split_of", "pipeline_layers"]
