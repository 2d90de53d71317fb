"""A universal checkpoint back to native DeepSpeed files (metadata only): the planner of
:mod:`ckptlib.reshard.mesh_plan` on the folder's whole tensors, with the optimizer files' structure made from
``zero/optimizer_state.pt``.

The writers of a native reshard take each optimizer file's structure (its scalars, hyper-parameters, the per-group
step) from a source set's data-rank-0 file, which a universal folder does not have. :class:`UniversalTemplate`
stands in for it: ``zero/optimizer_state.pt`` is what ``ds_to_universal`` (and ckptlib) keep of rank 0's
``optimizer_state_dict`` without its partitioned entries, and each group's step is its parameters' ``step.pt`` (at
ZeRO-3 by ds_to_universal, the sub-group's step in that file). What a native checkpoint cannot hold is refused: a
group whose parameters' steps disagree, an optimizer ckptlib does not know. The output's tag is the folder's name
without ``_universal``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from ..deepspeed import Checkpoint
from ..deepspeed import files as fnames
from ..errors import PipelineUnknownError, UnsupportedCheckpointError
from ..mesh import Rank
from .stages import TIED_MODULE, StageFacts

UNIVERSAL_SUFFIX = "_universal"
# a per-element state in the template: the writers replace it by the state cut for each rank (saved without grad)
_STATE_PLACEHOLDER = SimpleNamespace(requires_grad=False)


def native_tag(ck: Checkpoint) -> str:
    """The tag of the native checkpoint made from universal folder ``ck``: its name without ``_universal``."""
    tag = ck.location.tag
    return tag[:-len(UNIVERSAL_SUFFIX)] if tag.endswith(UNIVERSAL_SUFFIX) and len(tag) > len(UNIVERSAL_SUFFIX) else tag


def derived_notes(ck: Checkpoint, mesh) -> list[str]:
    """What native files made from universal folder ``ck`` at ``mesh`` hold that the folder does not hold as such."""
    u, out = ck.universal, []
    for name, (shape, _) in ck.view.padded.items():
        rows = ck.view.full_shape(name)[0]
        out.append(f"{name}: rows {rows}..{shape[0] - 1} are the vocabulary's padding, which the universal folder "
                   "does not hold (ds_to_universal cuts it): written as zeros, as DeepSpeed's universal loader pads it")
    if u.pipeline:
        out += pipeline_notes(ck)
    if u.source_mesh.tp > 1 or mesh.tp > 1:
        out.append(f"16-bit weights the folder holds only as fp32 masters (tensor-parallel shards) are the masters "
                   f"rounded to {ck.dtype}, which the engine's 16-bit copies are after a step")
    return out


def refuse_for_native(ck: Checkpoint, mesh=None) -> None:
    """What no native checkpoint made from universal folder ``ck`` (at ``mesh``) could hold exactly, or ckptlib does
    not write yet, refused with the reason."""
    u = ck.universal
    if mesh is not None and mesh.pp > 1 and not u.pipeline:
        raise UnsupportedCheckpointError(
            f"this universal folder is not a pipeline's (its parameters are not numbered by layer): it cannot be spread "
            f"over {mesh.pp} stages", path=ck.location.tag_dir)
    if u.step_conflicts:
        raise UnsupportedCheckpointError(
            "; ".join(u.step_conflicts) + ": a native checkpoint keeps one step per optimizer group",
            path=ck.location.tag_dir, hint="`ckpt diff ORIGINAL THIS --states` shows which step.pt was changed")
    if u.experts and (u.source_mesh.tp, u.source_mesh.pp) != (1, 1) or \
            u.experts and mesh is not None and (mesh.tp, mesh.pp) != (1, 1):
        raise UnsupportedCheckpointError(f"a universal checkpoint of a mixture-of-experts model ({u.experts}) with "
                                         "tensor or pipeline parallelism back to native files is not supported yet",
                                         path=ck.location.tag_dir,
                                         hint="DeepSpeed resumes from it with \"load_universal\": true; `ckpt export` "
                                              "writes its full model")
    if (ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        raise UnsupportedCheckpointError(
            "its run had round_robin_gradients, whose flat groups are not in the order the universal folder lists "
            "them: native files for such an engine are not written yet", path=ck.location.tag_dir,
            hint="load it with \"load_universal\": true in an engine with round_robin_gradients off")


def universal_layers(ck: Checkpoint, tied: Optional[dict] = None) -> tuple[dict, StageFacts]:
    """``({layer: [(model name, key in its layer file)]}, StageFacts)`` of a pipeline's universal folder ``ck``, from
    the names each stage's model-states file lists: ``{idx}.{key}`` is layer ``idx``'s; a tied module
    (``tied_modules.{tie}.{attr}``) is in the file of the layer that builds it, which the folder records only where it
    holds the layer files (ckptlib's folders; ds_to_universal copies none): else the first layer of ``tied[tie]``
    (``--pp-tied``). What the folder does not hold (a pipeline's buffers in ds_to_universal's folders) has no entry."""
    u = ck.universal
    tied = dict(tied or {})
    held = {p.name for p in ck.view.parameters if not p.tied_to} | {b.name for b in ck.view.buffers}
    plain: dict = {}
    tie_names: dict = {}
    stages_of: dict = {}
    for stage in sorted(u.stage_names):
        for name in u.stage_names[stage]:
            stages_of.setdefault(name, set()).add(stage)
            if name not in held:
                continue
            m = TIED_MODULE.match(name)
            if m:
                names = tie_names.setdefault(m.group(1), [])
                names += [] if name in names else [name]
                continue
            idx, _, key = name.partition(".")
            if not idx.isdigit() or not key:
                raise UnsupportedCheckpointError(f"{name} is no pipeline layer's parameter ({{layer}}.{{name}} or "
                                                 "tied_modules.{key}.{name}): the folder's stages cannot be rebuilt",
                                                 path=ck.location.tag_dir)
            ents = plain.setdefault(int(idx), [])
            ents += [] if any(n == name for n, _ in ents) else [(name, key)]
    unknown = sorted(set(tied) - set(tie_names))
    if unknown:
        raise PipelineUnknownError(f"--pp-tied names {', '.join(unknown)}, but the folder holds no tied module of that "
                                   f"key (it holds: {', '.join(sorted(tie_names)) or 'none'})", path=ck.location.tag_dir)
    file_of_tie = {}
    for tie, names in tie_names.items():
        attrs = [TIED_MODULE.match(n).group(2) for n in names]
        if tie in tied:
            file_of_tie[tie] = tied[tie][0]
            continue
        files = [i for i, keys in u.layer_files.items() if i not in plain and set(keys) == set(attrs)]
        if len(files) != 1:
            raise PipelineUnknownError(
                f"the universal folder does not say which layer builds the tied module {tie!r} (ds_to_universal copies "
                "no layer files)", path=ck.location.tag_dir,
                hint=f"pass --pp-tied {tie}:FILE,USE,... with every layer that uses it, first the one whose "
                     "TiedLayerSpec has no forward_fn (its layer file holds the module), e.g. "
                     f"--pp-tied {tie}:0,{max(plain, default=0) + 1}")
        file_of_tie[tie] = files[0]
    layers = {idx: list(ents) for idx, ents in plain.items()}
    for tie, idx in file_of_tie.items():
        if idx in layers:
            raise PipelineUnknownError(f"--pp-tied {tie}: layer {idx} is a layer of its own ({layers[idx][0][0]}, ...), "
                                       "not the tied module's", path=ck.location.tag_dir)
        layers[idx] = [(n, TIED_MODULE.match(n).group(2)) for n in tie_names[tie]]
    for idx, keys in u.layer_files.items():  # a copied layer file's key order; a layer without state: its file
        if not keys and idx not in layers:
            layers[idx] = []
        if idx in layers:
            at = {k: i for i, k in enumerate(keys)}
            layers[idx].sort(key=lambda e: at.get(e[1], len(at)))
    stage_of_layer = {}
    for idx, ents in plain.items():
        found = set().union(*(stages_of.get(n, set()) for n, _ in ents))
        if len(found) != 1:
            raise UnsupportedCheckpointError(f"layer {idx}'s parameters are listed by the model-states files of stages "
                                             f"{sorted(found)}: the folder's stages disagree", path=ck.location.tag_dir)
        stage_of_layer[idx] = found.pop()
    for idx in list(file_of_tie.values()) + [i for i, ents in layers.items() if not ents]:
        stage_of_layer[idx] = None  # which stage builds a tied module, or holds a layer without state: not recorded
    holders = {tie: set().union(*(stages_of.get(n, set()) for n in names)) for tie, names in tie_names.items()}
    facts = StageFacts(layers=sorted(layers), stage_of_layer=stage_of_layer, file_of_tie=file_of_tie, holders=holders,
                       pp=u.source_mesh.pp)
    return dict(sorted(layers.items())), facts


def pipeline_notes(ck: Checkpoint) -> list[str]:
    """What native pipeline files made from universal folder ``ck`` cannot hold when it holds no layer files
    (ds_to_universal's): the buffers it lacks, and the files of layers without state."""
    if ck.universal.layer_files:
        return []
    out = []
    missing = [a.split(":")[0].split()[-1] for a in ck.universal.absent if a.startswith("buffer ")]
    if missing:
        out.append(f"the layer files hold no value for the buffers {', '.join(missing)}: the universal folder lacks "
                   "them (ds_to_universal copies no layer files). Load with engine.load_checkpoint(..., "
                   "load_module_strict=False); these buffers then keep the values the model is built with, as after "
                   "DeepSpeed's own universal load")
    out.append("a layer module without state (an activation given as a LayerSpec) gets no layer file: the folder does "
               "not say where such layers are, and DeepSpeed's load stops at a layer without a file; save an empty "
               "one for each, torch.save({}, 'layer_XX-model_states.pt') in the tag folder")
    return out


class UniversalTemplate:
    """What the optimizer-file writers (:class:`~ckptlib.reshard.zero12.Zero12Writer`,
    :class:`~ckptlib.reshard.zero3.Zero3Writer`) read of a source set, for a universal folder: its flavour, its
    groups (:attr:`optimizer`), and a data-rank-0 optimizer file tree made from ``zero/optimizer_state.pt`` with one
    state entry per optimizer group (each group's step, placeholders for its per-element keys)."""

    def __init__(self, ck: Checkpoint):
        self.set = ck.main
        u = ck.universal
        self.location, self.records, self.mp = ck.location, ck.main.records, 0
        self.flavor, self.optimizer, self.ds_config = u.source_flavor, ck.optimizer, ck.ds_config
        bf16 = ck.dtype == "bf16"
        self.files = [SimpleNamespace(kind=fnames.OPTIM_STATES, prefix="bf16_" if bf16 else "")]
        saved = u.optimizer_state if isinstance(u.optimizer_state, dict) else {}
        groups = []
        for g, hyper in enumerate(u.param_groups):
            groups.append(dict(hyper, params=[g]))
        state = {}
        for gs in ck.optimizer.groups:
            entry = {}
            members = [p.name for p in ck.parameters if p.trainable and not p.tied_to and p.group == gs.group]
            step = next((u.step_objects[n] for n in members if n in u.step_objects), None)
            if step is not None:
                entry["step"] = step
            entry.update({k: _STATE_PLACEHOLDER for k in gs.key_names})
            state[gs.group] = entry
        if u.source_stage == 3:
            osd = {k: v for k, v in saved.items() if k not in ("param_groups", "optimizer_state_dict",
                                                                 "fp32_flat_groups")}
            osd["optimizer_state_dict"] = {"state": state, "param_groups": groups}
            osd["fp32_flat_groups"] = []
        else:
            osd = {}
            for k, v in saved.items():
                if k == "param_groups":
                    continue
                osd[k] = v
                if k == "clip_grad":  # where DeepSpeed's own state_dict has them
                    osd["base_optimizer_state"], osd["single_partition_of_fp32_groups"] = None, []
            osd.setdefault("base_optimizer_state", None)
            osd.setdefault("single_partition_of_fp32_groups", [])
            osd["base_optimizer_state"] = {"state": state, "param_groups": groups}
            osd["param_slice_mappings"] = []
        self._tree = {"optimizer_state_dict": osd, "ds_config": ck.ds_config, "ds_version": ck.deepspeed_version}

    def rank(self, dp: int) -> Rank:
        return Rank(dp=dp)

    def optim_states_file(self, rank: Rank):
        return SimpleNamespace(obj=self._tree)

    def model_states_file(self, rank: Optional[Rank] = None):
        return self.set.model_states_file(rank)

    def partition_tensor(self, rank: Rank, group: int, state: Optional[str] = None):
        return SimpleNamespace(requires_grad=True)  # DeepSpeed's fp32 partitions are saved with requires_grad


__all__ = ["UniversalTemplate", "native_tag", "refuse_for_native", "derived_notes", "universal_layers",
           "pipeline_notes", "UNIVERSAL_SUFFIX"]
