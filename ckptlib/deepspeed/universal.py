"""A universal checkpoint folder read as a source, like a tag folder (metadata only).

The folder is what DeepSpeed's ``ds_to_universal`` writes, or ``ckpt reshard --universal``::

    <tag>_universal/
        mp_rank_XX_model_states.pt          copied from the source (ZeRO-3: every zero_pp_rank_<r>_mp_rank_XX file)
        zero/optimizer_state.pt             the optimizer's global state (param_groups; ZeRO-3: rank 0's state)
        zero/<parameter>/fp32.pt            the full fp32 master ({'cat_dim': 0, 'param': t} or, ZeRO-3 by
                                            ds_to_universal, a flat tensor)
        zero/<parameter>/<key>.pt           each optimizer state (exp_avg, exp_avg_sq, momentum_buffer, ...)
        zero/<parameter>/step.pt            the step (not written by ds_to_universal at ZeRO-3)

:func:`join_universal` gives the same model a native checkpoint gives (:class:`~ckptlib.deepspeed.Checkpoint`'s
``parameters``, ``buffers``, ``sources``, ``state_keys``, optimizer groups and steps), one
:class:`UniversalSet` whose tensors are the whole tensors of these files. Every value is taken from where it is
exact: masters and states from ``zero/``; frozen parameters and buffers from the copied model-states files (their
stored dtype; ds_to_universal's ``zero/<buffer>/fp32.pt`` casts integers to float32, 16777217 becomes 16777216,
and is never read); a ZeRO-3 step from ``optimizer_state.pt`` (rank 0's sub-groups, which every rank shares).
What a folder cannot give is named (:attr:`UniversalSet.absent`): a pipeline's buffers and frozen weights live in
layer files, which ds_to_universal does not copy.

A universal folder has no rank partitions: the partition API refuses (:meth:`UniversalSet.partition_tensor`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ..errors import CkptError, IncompleteCheckpointError, UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..kinds.optimizers import GroupStates, StateKey, identify
from ..layout.placement import Block, row_major_strides
from ..layout.ranges import Zeros
from ..mesh import Mesh, Rank
from . import autoep
from . import files as fnames
from .files import UNIVERSAL_OPTIMIZER
from .fileset import OpenedFiles
from .model import ModelView, whole
from .moe import expert_id, with_expert_id
from .records import BF16_OPTIMIZER, ZERO, BufferInfo, FileInfo, OptimizerInfo, ParameterInfo, Records, TensorIndex
from . import universal_parts as parts
from .universal_parts import MASTER, STEP, Fragment, layer_buffer, layer_keys, obj_of, param_groups, zero3_frozen
from .tensor_parallel import REPLICATED_KEY, ROW_KEY, VOCAB_KEY, SplitRules
from .zeroset import MODULE, ZeroSet

UNIVERSAL = "universal"                       # the flavor of a universal folder (Records.flavor)
PAD = "\0padding of "                          # the block source of a padded vocabulary's zero rows


@dataclass
class UniversalInfo:
    """What the folder says of where it came from and what it cannot give.

    ``source_mesh``: the sizes its model-states files record; ``source_stage``: the ZeRO stage of the source;
    ``source_flavor``: ``zero`` or ``bf16_optimizer``; ``written_by``: ``ds_to_universal`` or ``ckptlib``
    (ZeRO-3 folders differ); ``absent``: what it cannot give, one sentence each; ``steps``: each trainable
    parameter's step; ``step_conflicts``: groups whose parameters' steps disagree, one sentence each;
    ``info``: the ``universal_checkpoint_info`` it records."""

    source_mesh: Mesh
    source_stage: Optional[int]
    source_flavor: str
    written_by: str
    absent: list = field(default_factory=list)
    steps: dict = field(default_factory=dict)
    step_conflicts: list = field(default_factory=list)
    info: Optional[dict] = None
    step_objects: dict = field(default_factory=dict, repr=False)   # name -> the step as stored (a tensor handle)
    optimizer_state: Any = field(default=None, repr=False)        # zero/optimizer_state.pt as unpickled
    param_groups: list = field(default_factory=list, repr=False)  # each group's hyper-parameters, as saved
    rules: Optional[SplitRules] = field(default=None, repr=False)  # how its tensors split over tensor ranks
    pipeline: bool = False  # a pipeline's: its model-states files hold no module (its layer files do)
    experts: Optional[str] = None  # "AutoEP" or "DeepSpeed-MoE": a mixture-of-experts model's
    # a pipeline's: {source stage: the parameters and buffers its model-states file lists, in its order}
    stage_names: dict = field(default_factory=dict, repr=False)
    layer_files: dict = field(default_factory=dict, repr=False)  # {layer: keys} of the layer files it copied


class UniversalSet(ZeroSet):
    """The one set of a universal folder: every tensor whole, in its own file (see the module docstring)."""

    def __init__(self, records: Records, files: OpenedFiles, fragments: dict, frozen: dict, buffers: dict,
                 universal: UniversalInfo):
        super().__init__(records, 0, files, Rank())
        self.opened = files               # the folder's opened files
        self.fragments = fragments        # name -> {key (None: the master) -> Fragment}
        self._frozen = frozen             # name -> ranges
        self._buffer_ranges = buffers     # name -> ranges
        self.universal = universal
        self.pads: dict = {}              # PAD + vocabulary name -> its padding elements (zeros)

    @property
    def files(self) -> list:
        return list(self.records.files)

    def pieces(self, name: str, key: Optional[str] = None) -> list:
        return []

    def _no_partitions(self, what: str):
        raise UnsupportedCheckpointError(f"a universal checkpoint has no rank partitions ({what})",
                                         path=self.location.tag_dir,
                                         hint="`ckpt reshard UNIVERSAL OUT --world-size N` writes rank files")

    def optimizer_state_dict(self, rank: Rank) -> dict:
        self._no_partitions("optimizer_state_dict")

    def partition_tensor(self, rank: Rank, group: int, state: Optional[str] = None) -> TensorHandle:
        self._no_partitions(f"group {group}'s partition")

    def optim_states_file(self, rank: Rank):
        self._no_partitions("optimizer-states files")

    def state_replicas(self, name: str, key: Optional[str]) -> list:
        return []

    def copied_model_states(self, mp: int) -> Optional[dict]:
        """The model-states file of model-parallel rank ``mp`` (data rank 0's) that the folder copied, or None."""
        for f in self.opened.of(fnames.MODEL_STATES, mp_rank=mp):
            if (f.dp_rank or 0) == 0:
                tf = self.opened.get(f)
                return tf.obj if tf is not None and isinstance(tf.obj, dict) else None
        return None

    def value_file(self, name: str) -> Optional[str]:
        """The file that holds the value of frozen parameter or buffer ``name`` (a copied model-states or layer file,
        or its ``zero/<name>/fp32.pt``), or None where the folder holds none (:attr:`UniversalInfo.absent` says why)."""
        ranges = self._buffer_ranges.get(name) or self._frozen.get(name)
        return next((r.path for r in ranges if hasattr(r, "path")), None) if ranges else None

    def step_of(self, name: str) -> Optional[float]:
        """The step recorded for trainable parameter ``name`` (its own ``step.pt``, or its ZeRO-3 sub-group's)."""
        p = self.param(name)
        return self.universal.steps.get(p.tied_to or p.name)

    def sources(self, name: str, key: Optional[str] = None) -> list:
        if name in self.pads:  # a vocabulary's padding rows (see _padded_vocabulary): zeros
            return [Zeros(self.pads[name])]
        if key is None and name in self._buffer_ranges:
            return list(self._buffer_ranges[name])
        p = self.param(name)
        if p.tied_to:
            return self.sources(p.tied_to, key)
        if not p.trainable:
            if key not in (None, MODULE):
                raise KeyError(f"parameter {name} is frozen and has no optimizer state")
            got = self._frozen.get(name)
            if got is None:
                raise IncompleteCheckpointError(f"this universal checkpoint holds no value of frozen parameter {name}",
                                                path=self.location.tag_dir)
            return list(got)
        if key == MODULE:  # the stored 16-bit weight where a copied model-states file holds it whole, else the master
            t = self.records.index.module.get(name)
            if isinstance(t, TensorHandle) and t.numel == p.numel:
                return t.ranges()
            key = None
        frag = self.fragments.get(name, {}).get(key)
        if frag is None:
            raise IncompleteCheckpointError(f"zero/{name}/{key or MASTER}.pt is missing", path=self.location.tag_dir)
        return frag.ranges()

    def __repr__(self) -> str:
        return f"UniversalSet(from ZeRO-{self.universal.source_stage}, params={len(self.parameters)})"


# ================================================================================================ parsing

def _model_files(fs: OpenedFiles) -> list[FileInfo]:
    return [f for f in fs.files if f.kind == fnames.MODEL_STATES]


def join_universal(fs: OpenedFiles, notes: list, problems: list):
    """The model of a universal folder (a :class:`~ckptlib.deepspeed.join.Joined` with one :class:`UniversalSet`)."""
    from .join import Joined  # the joins of native layouts live there; this one is a sibling
    loc = fs.location
    models = _model_files(fs)
    if not models:
        raise IncompleteCheckpointError("this universal checkpoint has no model-states file (mp_rank_00_model_states.pt "
                                        "or zero_pp_rank_0_mp_rank_00_model_states.pt), which holds its parameter list",
                                        path=loc.tag_dir, hint="copy it from the checkpoint the folder was made from")
    zero3 = any(f.dp_rank is not None for f in models)
    first = next((f for f in models if (f.mp_rank or 0) == 0 and (f.dp_rank or 0) == 0), models[0])
    model = obj_of(fs, first)
    if not isinstance(model, dict):
        raise IncompleteCheckpointError(f"{first.relpath} cannot be read: " + "; ".join(problems), path=first.path)
    opt_file = next((f for f in fs.files if f.kind == UNIVERSAL_OPTIMIZER), None)
    osd = obj_of(fs, opt_file) if opt_file is not None else None
    if opt_file is None:
        problems.append("zero/optimizer_state.pt is missing (the optimizer's param_groups and, at ZeRO-3, its step)")
    osd = osd if isinstance(osd, dict) else {}
    cfg = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
    zcfg = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    stage = 3 if zero3 else zcfg.get("stage")
    stage = stage if isinstance(stage, int) else None
    bf16 = bool((cfg.get("bf16") or {}).get("enabled") or (cfg.get("bfloat16") or {}).get("enabled"))
    fp16 = bool((cfg.get("fp16") or {}).get("enabled"))
    # BF16_Optimizer's state_dict (kept in optimizer_state.pt) has no zero_stage, DeepSpeedZeroOptimizer's has
    source_flavor = BF16_OPTIMIZER if osd and "zero_stage" not in osd and not zero3 else ZERO
    dims = model.get("checkpoint_parallel_dimensions") or {}
    mp = model.get("mp_world_size") if isinstance(model.get("mp_world_size"), int) else 1
    tp = dims.get("tp_degree") if isinstance(dims.get("tp_degree"), int) else mp
    pp = dims.get("pp_degree") if isinstance(dims.get("pp_degree"), int) else max(1, mp // max(tp, 1))
    dp = model.get("dp_world_size") if isinstance(model.get("dp_world_size"), int) else None
    fragments, master_shapes, locals_of, whole_experts = parts.fragments(fs, model, problems)
    module = model.get("module") if isinstance(model.get("module"), dict) else None
    # ds_to_universal gives buffers and tied aliases a zero/ folder and ZeRO-3 parameters flat tensors without a
    # step.pt; ckptlib does neither
    extra = set(model.get("buffer_names") or []) | set((model.get("shared_params") or {}) if isinstance(
        model.get("shared_params"), dict) else ())
    flat3 = zero3 and not any(STEP in v for v in fragments.values())
    written = "ds_to_universal" if flat3 or extra & set(fragments) else \
        "ckptlib" if (extra and module is not None) or zero3 else "ds_to_universal or ckptlib"
    uinfo = UniversalInfo(source_mesh=Mesh(dp=dp or 1, tp=tp or 1, pp=pp or 1), source_stage=stage,
                          source_flavor=source_flavor, written_by=written, pipeline=module is None and not zero3,
                          info=model.get("universal_checkpoint_info") if isinstance(
                              model.get("universal_checkpoint_info"), dict) else None)
    index = TensorIndex()

    # ------------------------------------------------------------------ parameters
    # every model-parallel rank's file (a pipeline's stages list their own parameters; tensor ranks repeat names)
    mp_files = [(f.mp_rank or 0, obj_of(fs, f)) for f in sorted(models, key=lambda f: f.mp_rank or 0)
                if (f.dp_rank or 0) == 0]
    mp_models = [m for _, m in mp_files if isinstance(m, dict)]
    uinfo.layer_files = layer_keys(fs) if uinfo.pipeline else {}
    for mp_rank, m in mp_files:  # mp rank = stage * tp + tensor rank
        if isinstance(m, dict):
            listed = uinfo.stage_names.setdefault(mp_rank // max(tp or 1, 1), [])
            listed += [n for g in m.get("param_shapes") or [] for n in dict(g) if n not in listed]
            listed += [n for n in m.get("buffer_names") or [] if n not in listed]
    params: list[ParameterInfo] = []
    seen: set = set()
    buffer_names: list = []
    shared: dict = {}
    for m in mp_models:
        buffer_names += [n for n in m.get("buffer_names") or [] if n not in buffer_names]
        shared.update(m.get("shared_params") if isinstance(m.get("shared_params"), dict) else {})
        for name, t in (m.get("module") or {}).items() if isinstance(m.get("module"), dict) else ():
            index.module.setdefault(name, t)
    # AutoEP's router alias (the gate is the router: one parameter, saved twice), its two saved copies compared
    # before a conversion relies on it; ds_to_universal's zero/ folder for it holds the 16-bit copy and is not read
    layers = autoep.layers_of(model)
    shared.update(autoep.router_aliases(layers, index.module, index.alias_proofs))
    uinfo.experts = "AutoEP" if layers else "DeepSpeed-MoE" if model.get("num_experts") else None
    if layers:  # the expert-parallel size it ran at
        uinfo.source_mesh = Mesh(dp=uinfo.source_mesh.dp, tp=uinfo.source_mesh.tp, pp=uinfo.source_mesh.pp,
                                 ep=layers[0].ep)
    if uinfo.experts == "DeepSpeed-MoE":  # the expert-parallel size its files were written for
        counts = model.get("num_experts") or []
        local = {expert_id(str(n)) for g in model.get("param_shapes") or [] for n in dict(g)} - {None}
        if counts and local and isinstance(counts[0], int) and counts[0] % len(local) == 0:
            uinfo.source_mesh = Mesh(dp=uinfo.source_mesh.dp, tp=uinfo.source_mesh.tp, pp=uinfo.source_mesh.pp,
                                     ep=counts[0] // len(local))
    hypers = param_groups(osd, zero3)
    # ZeRO-3's param_shapes list sub-groups: each belongs to the parameter group whose recorded 'params' name it
    group_of_sub = {k: g for g, h in enumerate(hypers) for k in (h.get("params") or []) if isinstance(k, int)}
    sub_groups: dict = {}  # ZeRO-3: parameter -> its sub-group (where its step is recorded)
    for m in mp_models:
        local_shapes = {}
        for k, group in enumerate(m.get("param_shapes") or []):
            g = k
            if zero3:
                g = group_of_sub.get(k)
                if g is None:
                    problems.append(f"zero/optimizer_state.pt does not say which parameter group holds sub-group {k} "
                                    f"({', '.join(list(dict(group))[:3])}...)")
            for name, shape in dict(group).items():
                local_shapes[name] = tuple(shape)
                if name not in seen:
                    seen.add(name)
                    params.append(ParameterInfo(name=name, shape=tuple(shape), trainable=True, group=g))
                    if zero3:
                        sub_groups[name] = k
        frozen_shapes = dict(m.get("frozen_param_shapes") or {})
        mod = m.get("module") if isinstance(m.get("module"), dict) else None
        if not frozen_shapes and mod:  # ZeRO-1 records none: the module's other weights are the frozen ones
            others = set(local_shapes) | set(buffer_names) | set(shared)
            frozen_shapes = {n: tuple(t.shape) for n, t in mod.items() if n not in others and isinstance(t, TensorHandle)}
        for name, shape in frozen_shapes.items():
            if name not in seen:
                seen.add(name)
                params.append(ParameterInfo(name=name, shape=tuple(shape), trainable=False))
    for p in params:  # a tensor-parallel source records its rank's shapes: the full one is the master file's
        full = master_shapes.get(p.name)
        if full is not None and len(full) == len(p.shape) and math.prod(full) != p.numel and \
                (tp > 1 or p.name in whole_experts):  # AutoEP's experts: ep rank 0's [local experts, ...] listed
            p.shape = full
    known = {p.name: p for p in params}
    for name in sorted((n for n in locals_of if n not in known), key=fnames.natural_key):
        # MoE (ckptlib's universal): the model-states file lists expert-parallel rank 0's local experts; each
        # local expert's folder stacks the global experts of that local id
        local = known.get(locals_of[name])
        if local is None:  # a folder written for another expert-parallel size than the file lists: the listed
            listed = {expert_id(n) for n in known} - {None}  # local ids: 0 .. L-1
            if listed == set(range(len(listed))) and listed and expert_id(name) is not None:
                local = known.get(with_expert_id(name, expert_id(name) % len(listed)))
        params.append(ParameterInfo(name=name, shape=master_shapes.get(name, ()), trainable=True,
                                    group=local.group if local is not None else None))
    by_name = {p.name: p for p in params}
    for alias, owner in shared.items():
        o = by_name.get(owner)
        if o is not None and alias not in by_name:
            params.append(ParameterInfo(name=alias, shape=o.shape, trainable=o.trainable, tied_to=owner))
    by_name = {p.name: p for p in params}

    # ------------------------------------------------------------------ the masters and states
    trainable = [p for p in params if p.trainable and not p.tied_to]
    for p in trainable:
        frag = fragments.get(p.name, {}).get(None)
        if frag is None:
            problems.append(f"zero/{p.name}/{MASTER}.pt is missing: the fp32 master of trainable parameter {p.name}")
        elif frag.numel != p.numel:
            problems.append(f"{frag.info.relpath}: {frag.numel} elements, but {p.name} has {p.numel} "
                            f"({list(p.shape)})")
        for key, fr in fragments.get(p.name, {}).items():
            if key not in (None, STEP) and fr.numel != p.numel:
                problems.append(f"{fr.info.relpath}: {fr.numel} elements, but {p.name} has {p.numel}")
    for name in fragments:
        if name not in by_name and name not in buffer_names:
            problems.append(f"zero/{name}/ belongs to no parameter the model-states file lists: it cannot be placed")

    # ------------------------------------------------------------------ frozen parameters and buffers
    frozen: dict = {}
    for p in params:
        if p.trainable or p.tied_to:
            continue
        t = index.module.get(p.name)
        if isinstance(t, TensorHandle) and t.numel == p.numel and tp == 1:
            frozen[p.name], index.frozen[p.name] = t.ranges(), [t]
            p.stored_dtype = t.dtype_name
            continue
        got = zero3_frozen(fs, models, p) if zero3 else None
        if got is not None:
            frozen[p.name], index.frozen[p.name] = got
            continue
        frag = fragments.get(p.name, {}).get(None)
        if frag is not None and frag.numel == p.numel:  # the value upcast to fp32 (16-bit values are exact in fp32)
            frozen[p.name], index.frozen[p.name] = frag.ranges(), [frag.handle]
            p.stored_dtype = frag.handle.dtype_name
            continue
        uinfo.absent.append(f"frozen parameter {p.name}: no value (neither a model-states module entry nor "
                            f"zero/{p.name}/fp32.pt)")
    buffers: list[BufferInfo] = []
    buffer_ranges: dict = {}
    for name in buffer_names:
        t = index.module.get(name)
        if isinstance(t, TensorHandle):
            buffers.append(BufferInfo(name=name, shape=tuple(t.shape), dtype=t.dtype_name))
            buffer_ranges[name] = t.ranges()
            continue
        layer = layer_buffer(fs, name, index.alias_proofs)
        if layer is not None:
            buffers.append(BufferInfo(name=name, shape=tuple(layer.shape), dtype=layer.dtype_name))
            buffer_ranges[name] = layer.ranges()
            continue
        uinfo.absent.append(f"buffer {name}: a pipeline keeps it in its layer files, which ds_to_universal does not "
                            "copy" if uinfo.pipeline else f"buffer {name}: not in the model-states module")
        if name in fragments:
            uinfo.absent[-1] += f" (zero/{name}/fp32.pt is ds_to_universal's float32 cast of it, not read)"

    # ------------------------------------------------------------------ the optimizer
    steps = parts.steps(osd, fragments, trainable, sub_groups, problems, uinfo.step_objects)
    uinfo.steps, uinfo.optimizer_state = steps, osd
    uinfo.param_groups = [{k: v for k, v in h.items() if k != "params"} for h in hypers]
    groups: list[GroupStates] = []
    all_keys: list = []
    for g in sorted({p.group for p in trainable if p.group is not None}):
        members = [p for p in trainable if p.group == g]
        keys: list = []
        for p in members:
            keys += [k for k in fragments.get(p.name, {}) if k not in (None, STEP) and k not in keys]
        for p in members:
            lacking = [k for k in keys if k not in fragments.get(p.name, {})]
            if lacking:
                problems.append(f"zero/{p.name}/ lacks {', '.join(k + '.pt' for k in lacking)}, which the other "
                                f"parameters of group {g} have")
        hyper = {k: v for k, v in (hypers[g] if g < len(hypers) else {}).items() if k != "params"}
        values = {steps[p.name] for p in members if p.name in steps}
        if len(values) > 1:  # readable, but no native layout holds it: one step per group
            uinfo.step_conflicts.append(f"the steps of group {g}'s parameters disagree: " + ", ".join(
                f"{p.name} {steps[p.name]:g}" for p in members if p.name in steps))
        step = next(iter(values)) if len(values) == 1 else None
        stored = {k: next((f.handle.dtype_name for f in (fragments.get(p.name, {}).get(k) for p in members)
                           if hasattr(f, "handle")), "float32") for k in keys}  # bf16 under bf16_optimizer_states
        groups.append(GroupStates(group=g, family=identify(keys, hyper),
                                  keys=tuple(StateKey(k, dtype=stored[k]) for k in keys),
                                  step=int(step) if step is not None else None, name=hyper.get("name")))
        all_keys += [k for k in keys if k not in all_keys]
    optimizer = OptimizerInfo(
        wrapper=f"universal checkpoint (from {'BF16_Optimizer' if source_flavor == BF16_OPTIMIZER else f'ZeRO-{stage}'})",
        state_keys=all_keys, step=next((gs.step for gs in groups if gs.step is not None), None),
        param_groups=[{k: v for k, v in h.items() if k != "params"} for h in hypers], groups=groups)
    dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    rec = Records(files=fs.files, zero_stage=stage, flavor=UNIVERSAL, dtype=dtype, dp_world_size=dp,
                  mp_world_size=mp, partition_count=dp, deepspeed_version=model.get("ds_version"), ds_config=cfg,
                  optimizer=optimizer, parameters=params, buffers=buffers, index=index,
                  autoep_layers=layers)  # AutoEP: the export's model-class layout reads them
    uset = UniversalSet(rec, fs, fragments, frozen, buffer_ranges, uinfo)
    notes.append(f"a universal checkpoint written by {written} from a ZeRO-{stage} checkpoint of "
                 f"{uinfo.source_mesh.dp * uinfo.source_mesh.tp * uinfo.source_mesh.pp} ranks (dp={uinfo.source_mesh.dp} "
                 f"tp={uinfo.source_mesh.tp} pp={uinfo.source_mesh.pp}): every tensor whole, one file each")
    notes += [f"not in this universal checkpoint: {a}" for a in uinfo.absent]
    notes += [f"{c} (a native checkpoint keeps one step per group: a reshard refuses this)" for c in uinfo.step_conflicts]
    names = [n for n in index.module if n in by_name or n in buffer_ranges]
    order = names + [n for n in [p.name for p in params] + [b.name for b in buffers] if n not in set(names)]
    at = {n: i for i, n in enumerate(order)}
    params.sort(key=lambda p: at.get(p.name, len(at)))  # the state_dict's order, as a native checkpoint lists them
    blocks = {p.name: [whole((0, p.name), tuple(p.shape))] for p in params if not p.tied_to}
    blocks.update({b.name: [whole((0, b.name), tuple(b.shape))] for b in buffers})
    uinfo.rules = _rules(uinfo.info, first.path, problems)
    view = ModelView(parameters=params, buffers=buffers, order=order, blocks=blocks,
                     resolve=lambda source, key: uset.sources(source[1], key), sets={0: uset},
                     padded=_padded_vocabulary(uinfo, params, uset))
    return Joined(sets={0: uset}, view=view, kind="data_parallel", mesh=Mesh(dp=dp or 1))


def _rules(info: Optional[dict], path, problems: list) -> Optional[SplitRules]:
    """How the folder's whole tensors split over tensor ranks: its ``universal_checkpoint_info``, where it holds the
    split patterns (a tensor-parallel source's)."""
    if not info or not any(k in info for k in (REPLICATED_KEY, ROW_KEY, VOCAB_KEY)):
        return None
    try:
        return SplitRules.from_info(info, origin=str(path))
    except CkptError as e:
        problems.append(f"universal_checkpoint_info: {e.message}")
        return None


def _padded_vocabulary(u: UniversalInfo, params: list, uset: UniversalSet) -> dict:
    """``{name: (padded shape, blocks)}`` of each vocabulary tensor the folder holds cut to ``original_vocab_size``
    rows (ds_to_universal cuts a tensor-parallel vocabulary's padding), padded back to the recorded
    ``padded_vocab_size`` with zero rows, as DeepSpeed's universal loader pads them (what the ranks store)."""
    info, rules = u.info or {}, u.rules
    padded_rows = info.get("padded_vocab_size")
    if rules is None or not isinstance(padded_rows, int) or not rules.vocabulary:
        return {}
    out = {}
    for p in params:
        if p.tied_to or not p.shape or padded_rows <= p.shape[0] or \
                not any(re.match(pat, p.name) for pat in rules.vocabulary):
            continue
        full = (padded_rows, *p.shape[1:])
        st = row_major_strides(full)
        rest = math.prod(p.shape[1:])
        pad = (padded_rows - p.shape[0], *p.shape[1:])
        uset.pads[PAD + p.name] = math.prod(pad)
        out[p.name] = (full, [Block((0, p.name), tuple(p.shape), 0, st, 0, row_major_strides(p.shape)),
                              Block((0, PAD + p.name), pad, p.shape[0] * rest, st, 0, row_major_strides(pad))])
    return out


__all__ = ["UNIVERSAL", "UniversalSet", "UniversalInfo", "Fragment",
           "join_universal"]
