"""Write DeepSpeed's universal checkpoint directly from a ZeRO-1/2/3 (or BF16_Optimizer) checkpoint.

    plan = plan_universal("ckpt", "ckpt_uc")     # metadata only
    print(plan.describe())
    write_universal(plan)
    # DeepSpeed, at ANY data-parallel size: config "checkpoint": {"load_universal": true}, then
    # engine.load_checkpoint("ckpt_uc")

DeepSpeed's own ``ds_to_universal`` loads every rank file whole, writes one temporary file per
(parameter, state, rank) fragment, then loads them again to merge them. Here every output tensor is
streamed from the stored ranges that make it (:meth:`Checkpoint.sources`) through one pair of chunk
buffers: no temporary files, memory independent of the model size.

Output folder ``OUT`` (a new folder; it appears atomically, the source is only read)::

    OUT/latest_universal                    "<tag>_universal" (what load_checkpoint reads when
                                            load_universal is on; no `latest` is written, so a
                                            non-universal load finds nothing instead of misreading)
    OUT/<tag>_universal/
        mp_rank_00_model_states.pt          ZeRO-1/2: the source's model-states file, copied
        zero_pp_rank_<r>_mp_rank_00_model_states.pt
                                            ZeRO-3: the N source model-states files, copied
        zero/optimizer_state.pt             the optimizer's global state (see below)
        zero/<param>/fp32.pt                {'cat_dim': 0, 'param': the master, full shape, as stored:
                                            fp32, or bf16 under bf16_master_weights_and_grads
                                            (as ds_to_universal keeps it)}
        zero/<param>/<key>.pt               the same for every per-element optimizer state its group
                                            keeps (exp_avg, exp_avg_sq; momentum_buffer, sum, ...)
        zero/<param>/step.pt                the optimizer step of the parameter's group (as saved: a
                                            tensor or an int), where the group counts steps
        zero/<frozen>/fp32.pt               {'param': value as fp32} (as ds_to_universal) for frozen
                                            parameters whose data was saved

What DeepSpeed 0.19.8 reads when loading it at M ranks (``load_universal: true``), every rank:

* ``latest_universal`` (unless a tag is passed), then the model-states file(s) matching
  ``<tag>/mp_rank_*_model_states.pt`` (ZeRO-1/2) or ``<tag>/zero_pp_rank_0_mp_rank_*_model_states.pt``
  (ZeRO-3: rank 0's file whatever M is, as tracing the files every rank opens at M = 1..4 shows;
  DeepSpeed #7599 reports earlier versions looking for per-rank files that do not exist when M > N,
  so all N files are copied). From it: global/skipped steps, LR scheduler, client state. Its
  ``module`` is NOT loaded: frozen parameters and buffers keep the values the new engine was built
  with.
* ``zero/optimizer_state.pt``. ZeRO-1/2: ``loss_scaler``, ``dynamic_loss_scale``, ``overflow``,
  ``clip_grad``, ``ds_version`` (required) and ``param_groups`` (group i's hyper-parameters to group i).
  BF16_Optimizer: ``param_groups``. ZeRO-3: ``loss_scaler``, ``dynamic_loss_scale``, ``overflow``,
  ``optimizer_state_dict.state[0].step`` and ``optimizer_state_dict.param_groups[0]``, whose entries
  it copies into EVERY parameter group.
* ``zero/<name>/`` of each trainable parameter (owner names; tied aliases are never looked up).
  ZeRO-1/2 and BF16_Optimizer: every ``*.pt`` in the folder; ``step.pt`` is the step, each other file
  ``<key>.pt`` must be a dict with ``'param'`` (and optional ``'cat_dim'``). ZeRO-3: ``fp32.pt``,
  ``exp_avg.pt``, ``exp_avg_sq.pt`` only (a dict with ``'param'`` or a raw tensor), the step from
  ``optimizer_state.pt``. Each rank takes its own slice of the full tensor.

Mixture-of-experts (ZeRO-1/2): the folder is written for one expert-parallel size, every local expert's
folder stacking the global experts of that local id (:mod:`ckptlib.reshard.moe_universal`).

Choices, where ``ds_to_universal`` (0.19.8) differs:

* every per-element file has the same form ``{'cat_dim': 0, 'param': tensor of the parameter's shape}``
  at every stage (ds_to_universal writes raw flat tensors and no ``step.pt`` for ZeRO-3); the ZeRO-3
  loaders (with and without optimizer states) accept both forms.
* ``zero/optimizer_state.pt`` for ZeRO-3 holds no fp32 partitions and no per-element states (only
  the step tensors remain; ds_to_universal copies rank 0's whole optimizer state, as big as a rank's
  optimizer file).
  And since the ZeRO-3 loader applies ``param_groups[0]`` of ``optimizer_state_dict`` to every group,
  hyper-parameters that differ between groups (e.g. lr, weight_decay) are left out of that entry,
  so each group keeps the value its engine was configured with instead of silently taking group
  0's; the top-level ``param_groups`` list is complete.
* round-robin ZeRO-1/2 checkpoints (``round_robin_gradients``) are read by their real flat layout;
  ds_to_universal trusts ``param_slice_mappings``, which DeepSpeed computes in the wrong order then.
* buffers and tied aliases get no ``zero/`` folder (the loader never reads them; ds_to_universal writes
  their 16-bit or integer values as float32 there, which changes integers above 2**24). Frozen
  parameters get ``fp32.pt`` at every stage whenever their data was saved (never read either; kept so
  that the folder holds every parameter).

Known DeepSpeed 0.19.8 loader limitations no file content can avoid: the ZeRO-3 loader puts ONE step
tensor into every sub-group's Adam state, so each training step advances it once per sub-group
(sub-group 0 steps right, the others with a step count that is too high); frozen parameters and
buffers are not restored by any universal load. What the loaders cannot hold is refused before writing
(:func:`refuse_for_universal`): Muon's whole-matrix momentum at ZeRO-1/2, any ZeRO-3 state but Adam's
``exp_avg`` and ``exp_avg_sq`` (and a ZeRO-3 sub-group 0 without a step). A ZeRO-3 engine asked for ``load_optimizer_states=False`` first runs zero_to_fp32 on the
load folder through ``latest`` (also in universal mode), which fails for a folder holding only the
universal checkpoint (ds_to_universal's output, next to the original, works after reading the whole
original); a ZeRO-1/2 engine with ``round_robin_gradients`` links every parameter to its fp32
fragment at the natural-order offset although its flat groups are in round-robin order, so ANY
universal load into it scatters the values (load with ``round_robin_gradients`` off; ds_to_universal's
files, cut the same wrong way at save, happen to load right at the saving size only).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from ..deepspeed import NO_ZERO, Checkpoint, open_checkpoint
from ..deepspeed import files as fnames
from ..deepspeed.exactness import replica_checks, require_exact
from ..deepspeed.states import state_of
from ..errors import IncompleteCheckpointError, UnsupportedCheckpointError
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..io.torchzip import TensorHandle
from ..kinds.optimizers import WHOLE_PARAMS
from ..mesh import Rank
from ..plan import Plan, TextFile
from ..units import human_bytes
from .moe_universal import (EP_NUM_EXPERTS, EXPORT_HINT, IS_EXPERT_PARAM, expert_folders, moe_notes, renamed_groups,
                            stacked_entries, target_ep)
from .plan import default_workers, optimizer_notes, refuse_unplaced_states, refuse_unsupported, with_crc
from .trees import carried, client_files, copied, replace, stored_dtype, streamed, tree_file

UNIVERSAL_SUFFIX = "_universal"
LATEST_UNIVERSAL = "latest_universal"
# what ds_to_universal leaves out of zero/optimizer_state.pt for ZeRO-1/2 (the partitioned entries)
ZERO12_PARTITIONED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


@dataclass(kw_only=True, repr=False)  # Plan's repr and IPython display (its description)
class UniversalPlan(Plan):
    """What writing the universal checkpoint will do, computed from metadata (plain data). See
    :func:`plan_universal`."""

    action: ClassVar[str] = "universal"
    universal_tag: str
    ep: Optional[int] = None  # MoE: the expert-parallel size the folder is for
    experts: dict = field(default_factory=dict)  # MoE: {global name: [local folder, entry, entries]}

    def to_dict(self) -> dict:
        src = self.source
        return {
            "source": src.tag_dir, "out": str(self.out), "tag": src.tag,
            "universal_tag": self.universal_tag, "zero_stage": src.zero_stage, "flavor": src.flavor,
            "from_world_size": src.partition_count,
            "files": [{"name": f.name, "kind": f.kind, "source_ranks": f.source_ranks, "read_bytes": f.read_bytes,
                       "write_bytes": f.write_bytes, "bytes": f.size} for f in self.files],
            "read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "file_bytes": self.file_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes, "sync": self.sync, "notes": list(self.notes),
            **({"ep": self.ep, "experts": self.experts} if self.ep else {}),
        }

    def describe(self) -> str:
        src = self.source
        params = sum(1 for f in self.files if f.kind == "param_state" and f.name.endswith("/fp32.pt"))
        lines = [f"universal checkpoint of {src.tag_dir}",
                 f"     -> {self.out}/{self.universal_tag}  (+ {LATEST_UNIVERSAL})",
                 f"ZeRO {src.zero_stage} ({src.flavor}), {src.dtype}, saved by {src.partition_count} ranks; "
                 "DeepSpeed loads it at any data-parallel size" + (f" (expert-parallel size {self.ep})" if self.ep else "")
                 + " with \"checkpoint\": {\"load_universal\": true}",
                 *self.summary_lines(), f"{params} parameters; no temporary files"]
        width = max([len(f.name) for f in self.files if f.kind != "param_state"] + [10])
        for f in self.files:
            if f.kind != "param_state":
                lines.append(f"  {f.name:<{width}} {human_bytes(f.size):>10}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- planning
def check_name(name: str, ck: Checkpoint) -> None:
    """A parameter name becomes a folder name: refuse anything that could leave zero/ or clash."""
    bad = (not name or name in (".", "..", "optimizer_state.pt") or "/" in name or "\\" in name or "\0" in name
           or name != name.strip())
    if bad:
        raise UnsupportedCheckpointError(f"parameter name {name!r} cannot be a folder name of a universal checkpoint",
                                         path=ck.location.tag_dir)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, TensorHandle) or isinstance(b, TensorHandle):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are treated as different
        return False


class _Source:
    """Stage-specific facts: per-element state keys, steps and the optimizer_state.pt tree."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.osd0 = ck.optimizer_state_dict(Rank())
        self.notes: list[str] = []
        if ck.zero_stage == 3:
            self.state = self.osd0["optimizer_state_dict"]["state"]
            sizes = ck.layouts[0].sub_group_sizes
            self.group_numel = {k: sizes[k] for k in range(len(sizes))}
        else:
            base = self.osd0.get("base_optimizer_state")
            if not isinstance(base, dict):
                raise UnsupportedCheckpointError(
                    "elastic ZeRO-1/2 optimizer state (saved with elastic_checkpoint: true) is not supported yet",
                    path=ck.location.tag_dir)
            self.state = base["state"]
            self.group_numel = {g: lay.partition_size for g, lay in enumerate(ck.layouts)}
        refuse_for_universal(ck)
        self.keys: dict[int, list[str]] = {g.group: list(g.key_names) for g in ck.optimizer.groups}

    def step(self, group: int) -> Any:
        return (self.state.get(group) or {}).get("step")

    def optimizer_state(self) -> Any:
        """The tree of zero/optimizer_state.pt."""
        osd0 = self.osd0
        if self.ck.zero_stage != 3:
            out = type(osd0)((k, v) for k, v in osd0.items() if k not in ZERO12_PARTITIONED)
            out["param_groups"] = osd0["base_optimizer_state"]["param_groups"]
            return out
        inner = osd0["optimizer_state_dict"]
        state = type(inner["state"])()
        for k, st in inner["state"].items():
            keep = type(st)()
            for key, v in st.items():
                if key in self.keys.get(k, ()):
                    continue  # per-element: lives in zero/<param>/<key>.pt
                keep[key] = copied(v) if isinstance(v, TensorHandle) else v
            state[k] = keep
        groups = list(inner["param_groups"])
        if len(groups) > 1:
            g0 = groups[0]
            differ = [k for k in g0 if k != "params" and not all(k in g and _equal(g[k], g0[k]) for g in groups[1:])]
            if differ:
                groups[0] = type(g0)((k, v) for k, v in g0.items() if k not in differ)
                self.notes.append(
                    "DeepSpeed's ZeRO-3 universal loader copies the first parameter group's hyper-parameters into "
                    f"every group; {', '.join(differ)} differ between the groups, so they are left out of that entry "
                    "and every group keeps the value its engine is configured with")
        out = type(osd0)((k, v) for k, v in osd0.items() if k != "fp32_flat_groups")
        out["optimizer_state_dict"] = replace(inner, state=state, param_groups=groups)
        out["param_groups"] = inner["param_groups"]
        return out


#: the per-element keys DeepSpeed 0.19.8's ZeRO-3 universal loader restores (``load_hp_checkpoint_state_from_
#: checkpoint_dir_stage3``: fp32, exp_avg, exp_avg_sq), with the step of sub-group 0's state
ZERO3_LOADER_KEYS = ("exp_avg", "exp_avg_sq")


def refuse_for_universal(ck: Checkpoint) -> None:
    """Refuse, before anything is written, an optimizer state that DeepSpeed 0.19.8's universal loaders cannot
    restore exactly, naming the group, the key and why (:mod:`ckptlib.kinds.optimizers` says what each group
    keeps):

    - a state entry no layout places (it would be dropped; unknown optimizers and unplaceable keys are refused
      by :func:`~ckptlib.reshard.plan.refuse_unplaced_states` first);
    - ZeRO-1/2: a key kept per whole parameter (Muon's momentum). The loader (``load_hp_checkpoint_state`` then
      ``map_to_flat_opt_states``) gives every state key the layout of the fp32 partition, each parameter's
      partition-local slice, where Muon keeps the whole momentum of every matrix its partition touches;
    - ZeRO-3: any key but ``exp_avg`` and ``exp_avg_sq``, or a sub-group 0 without a step: that loader restores
      those two keys only, and takes the step from sub-group 0's state (``KeyError: 'step'`` without one).
    """
    where = ck.location.tag_dir
    hint = ("`ckpt reshard CKPT OUT --world-size N` writes native files for another size, which DeepSpeed loads "
            "without universal mode, every state exact")
    for zs in ck.sets.values():
        opt = zs.optimizer
        for gs in opt.groups if opt else []:
            for key in gs.keys:
                if ck.zero_stage in (1, 2) and key.layout == WHOLE_PARAMS:
                    raise UnsupportedCheckpointError(
                        f"{gs.label} keeps '{key.name}' whole for every matrix a rank's partition touches (Muon at "
                        f"ZeRO-{ck.zero_stage}); DeepSpeed 0.19.8's universal loader gives every state key the layout "
                        "of the fp32 partition (each parameter's partition-local slice, map_to_flat_opt_states), so "
                        "it cannot hold this momentum: a universal folder would resume Muon from a buffer of the "
                        "wrong layout", path=where, hint=hint)
            if ck.zero_stage == 3 and gs.key_names and set(gs.key_names) != set(ZERO3_LOADER_KEYS):
                raise UnsupportedCheckpointError(
                    f"{gs.label} keeps {', '.join(gs.key_names)}; DeepSpeed 0.19.8's ZeRO-3 universal loader restores "
                    "only exp_avg and exp_avg_sq (and the fp32 masters), so this state would not be loaded",
                    path=where, hint=hint)
        if ck.zero_stage == 3 and opt and opt.groups and opt.groups[0].step is None:
            raise UnsupportedCheckpointError(
                f"{opt.groups[0].label} counts no step; DeepSpeed 0.19.8's ZeRO-3 universal loader takes the step "
                "from sub-group 0's state and fails without one (KeyError: 'step')", path=where, hint=hint)
        for rank, osd in zs.records.index.optim.items():
            for gs in opt.groups if opt else []:
                extra = [k for k in (state_of(zs.records, osd, gs.group) or {}) if k != "step" and k not in gs.key_names]
                if extra:
                    raise UnsupportedCheckpointError(
                        f"{gs.label} holds {', '.join(map(repr, extra))} on {rank}, which a universal checkpoint has "
                        "no place for: it would be dropped", path=where, hint=hint)


def autoep_expert_entries(ck: Checkpoint) -> dict:
    """``{AutoEP expert weight: the entries its universal files carry}``: the full ``[E, ...]`` tensor marked
    ``is_expert_param`` with ``ep_num_experts`` E, from which DeepSpeed 0.19.8's loader takes each ep rank's rows by
    the live layer's placement (``_resolve_autoep_partition``), at any expert-parallel size."""
    layers = ck.records.autoep_layers
    if not layers or ck.view is None:
        return {}
    out = {}
    for lay in layers:
        for w in ("w1", "w2", "w3"):
            out[lay.weight(w)] = {IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: lay.num_experts}
    return out


def _notes(ck: Checkpoint, tied: list, skipped_frozen: list) -> list[str]:
    notes = []
    if tied:
        notes.append(f"tied aliases ({', '.join(tied)}) get no folder: DeepSpeed loads them through their owners")
    if skipped_frozen:
        notes.append(f"frozen parameters without saved data ({', '.join(skipped_frozen)}) are left out")
    if ck.buffers:
        notes.append("buffers are only in the copied model-states file(s); DeepSpeed's universal load restores "
                     "neither buffers nor frozen parameters (they keep the engine's values)")
    if ck.zero_stage == 3:
        notes.append("load it with optimizer states (the default): with load_optimizer_states=False a DeepSpeed "
                     "0.19.8 ZeRO-3 engine first runs zero_to_fp32 on the load folder through `latest`, even for a "
                     "universal checkpoint, and fails here")
    if ck.zero_stage == 3 and len(ck.layouts[0].sub_group_sizes) > 1:
        notes.append("DeepSpeed 0.19.8's ZeRO-3 universal loader gives all sub-groups ONE step tensor: after "
                     "loading, each training step advances it once per sub-group (a DeepSpeed bug; the files hold "
                     "the right step)")
    if (ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        notes.append("saved with round_robin_gradients: load it with round_robin_gradients off, since DeepSpeed "
                     "0.19.8 engines with it on put every universal fragment at its natural-order offset")
    skipped = [f.path.name for f in ck.files if f.kind not in (fnames.MODEL_STATES, fnames.OPTIM_STATES, fnames.SWAP)]
    if any(f.kind == fnames.SWAP for f in ck.files):
        notes.append("NVMe offload: the partitions kept in offloaded_tensors/ are written into the universal files")
    if skipped:
        notes.append(f"not carried over (the universal loader does not read them): {', '.join(skipped)}")
    return notes


def _joined(ck: Checkpoint, names: list, key: Optional[str]) -> list:
    """The source ranges of state ``key`` of the tensors ``names``, one after the other."""
    return [r for n in names for r in ck.sources(n, key)]


def _model_state_files(ck: Checkpoint, utag: str) -> list:
    """Every model-states file (each stage's or tensor rank's) and every layer file, copied; a model-states
    file of a pipeline or tensor-parallel run without ``universal_checkpoint_info`` gets one (the loader
    needs it): the rules it was read with, or the bare version, as ``ds_to_universal --inject_missing_state``."""
    out = []
    for f in ck.files:
        if f.kind not in (fnames.MODEL_STATES, fnames.LAYER_STATES):
            continue
        where = [f.dp_rank] if f.dp_rank is not None else []
        if f.kind == fnames.MODEL_STATES and len(ck.sets) > 1:
            zs = ck.sets[f.mp_rank or 0]
            obj = zs.model_states_file(zs.rank(f.dp_rank or 0)).obj
            if "universal_checkpoint_info" not in obj:
                info = {"universal_checkpoint_version": 0.2}
                rules = ck.tp_rules
                if rules is not None:
                    info.update({"tp_replicated_parameter_patterns": list(rules.replicated),
                                 "parameter_with_row_parallelism_patterns": list(rules.row),
                                 "vocabulary_parameter_patterns": list(rules.vocabulary),
                                 "pipeline_replicated_parameter_patterns": list(rules.pipeline_replicated),
                                 **({"original_vocab_size": rules.original_vocab_size}
                                    if rules.original_vocab_size is not None else {})})
                out.append(tree_file(f"{utag}/{f.path.name}", "model_states",
                                     dict(obj, universal_checkpoint_info=info), f.dp_rank, where))
                continue
        out.append(carried(f"{utag}/{f.path.name}", os.fspath(f.path), f.bytes, rank=f.dp_rank, source_ranks=where))
    return out


def plan_universal(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike], *,
                   tag: Optional[str] = None, overwrite: bool = False,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, workers: Optional[int] = None,
                   tp_rules=None, hf_files: bool = True, sync: bool = True, verify_crc: bool = True,
                   ep: Optional[int] = None) -> UniversalPlan:
    """Plan writing the universal checkpoint of a ZeRO-1/2/3 (or BF16_Optimizer) checkpoint (metadata only).

    ``out`` is a new folder that DeepSpeed loads with ``engine.load_checkpoint(out)`` and
    ``"checkpoint": {"load_universal": true}`` at any data-parallel size (see the module docstring for
    the layout and what the loader reads). ``hf_files``: carry over the HF Trainer / Accelerate files
    beside the checkpoint as :func:`~ckptlib.reshard.plan_reshard` does (the RNG states as saved).
    ``sync``, ``verify_crc``: as for :func:`~ckptlib.reshard.plan_reshard`.
    ``ep``: for a mixture-of-experts checkpoint, the expert-parallel size the folder is for (default: the
    source's; DeepSpeed's universal loader finds experts by their local ids, so a folder serves one size, see
    :mod:`ckptlib.reshard.moe_universal`).
    Memory: the plan (object trees whose tensors are range lists, not read yet).
    """
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag, tp_rules=tp_rules)
    if ck.universal is not None:
        raise UnsupportedCheckpointError("this is already a universal checkpoint: DeepSpeed loads it at any size",
                                         path=ck.location.tag_dir,
                                         hint="`ckpt reshard THIS OUT --world-size N` writes native files of N ranks")
    require_exact(ck)  # the validation export and reshard run too
    refuse_unplaced_states(ck)
    if ck.flavor == NO_ZERO:
        raise UnsupportedCheckpointError(
            "this checkpoint has no ZeRO partitioning (stage 0): DeepSpeed's universal loader only works with "
            "ZeRO stages 1-3", path=ck.location.tag_dir,
            hint=EXPORT_HINT if ck.num_experts else "DeepSpeed loads a stage-0 checkpoint at any size as it is")
    refuse_unsupported(ck)
    if ep is not None and not ck.num_experts:
        raise UnsupportedCheckpointError("this checkpoint has no experts: there is no expert-parallel size to choose",
                                         path=ck.location.tag_dir)
    autoep_experts = autoep_expert_entries(ck)
    moe_ep = target_ep(ck, ep) if ck.num_experts and not autoep_experts else None
    folders = expert_folders(ck, moe_ep) if moe_ep else {}
    folder_of = {n: local for local, names in folders.items() for n in names}
    src = _Source(ck)
    utag = f"{ck.location.tag}{UNIVERSAL_SUFFIX}"
    optimizer_state = src.optimizer_state()
    if moe_ep:
        optimizer_state["param_groups"] = renamed_groups(optimizer_state["param_groups"], moe_ep)
    files: list = []

    def add(name: str, obj: Any, kind: str = "param_state", ranks: Optional[list] = None) -> None:
        files.append(tree_file(f"{utag}/zero/{name}", kind, obj, None, ranks))

    skipped_frozen, tied = [], []
    for p in ck.parameters:
        if p.tied_to:
            tied.append(p.name)
            continue
        folder, names, stacked = p.name, [p.name], {}
        if p.name in folder_of:  # an expert: its folder is its local name, holding the experts of that id
            folder = folder_of[p.name]
            if folders[folder][0] != p.name:
                continue  # written with the first
            names, stacked = folders[folder], stacked_entries(moe_ep)
        check_name(folder, ck)
        if not p.trainable:
            try:
                ranges = ck.sources(p.name)
            except IncompleteCheckpointError:
                skipped_frozen.append(p.name)  # saved with exclude_frozen_parameters
                continue
            add(f"{p.name}/fp32.pt", {"param": streamed("float32", ranges, shape=tuple(p.shape))})  # as ds_to_universal
            continue
        single = len(ck.sets) == 1 and p.name not in autoep_experts
        ranks = sorted({pc.rank for n in names for pc in ck.pieces(n)}) if single else []
        rg = ck.partition_tensor(Rank(dp=ranks[0]), p.group).requires_grad if ranks else False
        role = ck.view.roles.get(p.name)
        extra = {"cat_dim": 1 if role == "row" else 0, **({"vocab_tensor": True} if role == "vocabulary" else {}),
                 **stacked, **autoep_experts.get(p.name, {})}
        shape = (len(names), *p.shape) if stacked else tuple(p.shape)
        ranges = _joined(ck, names, None)
        add(f"{folder}/fp32.pt", {**extra, "param": streamed(stored_dtype(ranges) or "float32", ranges, rg, shape)},
            ranks=ranks)
        for key in src.keys.get(p.group, []):
            ranges = _joined(ck, names, key)
            h = ck.partition_tensor(Rank(dp=ranks[0]), p.group, key) if ranks else None
            dtype = ranges[0].dtype if ranges else "float32"
            add(f"{folder}/{key}.pt", {**extra, "param": streamed(dtype, ranges, bool(h and h.requires_grad), shape)},
                ranks=ranks)
        step = src.step(p.group)
        if step is not None:
            add(f"{folder}/step.pt", copied(step) if isinstance(step, TensorHandle) else step)
    add("optimizer_state.pt", optimizer_state, kind="optimizer_state")
    files += _model_state_files(ck, utag)
    carried, carried_notes = client_files(ck, None) if hf_files else ([], [])
    files += carried
    load = ['load it with "checkpoint": {"load_universal": true} in the DeepSpeed config'
            + (" (the dict or JSON file given to TrainingArguments(deepspeed=...) or to Accelerate's "
               "DeepSpeedPlugin)" if carried else "")]
    return with_crc(ck, verify_crc, UniversalPlan(
                         source=ck.source_ref(), out=Path(out).expanduser().resolve(), universal_tag=utag,
                         files=files, finals=[TextFile(LATEST_UNIVERSAL, utag, kind="latest")],
                         folders=[f"{utag}/zero"], chunk_bytes=chunk_bytes, ep=moe_ep,
                         experts={n: [local, names.index(n), len(names)] for local, names in folders.items()
                                  for n in names}, overwrite=overwrite, sync=sync,
                         checks=replica_checks(ck),
                         notes=src.notes + _notes(ck, tied, skipped_frozen) + moe_notes(ck, moe_ep) + carried_notes
                         + ([f"AutoEP experts: each folder holds the full [{ck.records.autoep_layers[0].num_experts}, ...] "
                             "weight (is_expert_param, ep_num_experts): DeepSpeed's loader takes each expert-parallel "
                             "rank's rows, at any expert-parallel size"] if autoep_experts else [])
                         + optimizer_notes(ck)
                         + load,
                         workers=workers or default_workers()))


__all__ = ["plan_universal", "UniversalPlan", "LATEST_UNIVERSAL", "UNIVERSAL_SUFFIX", "check_name"]
