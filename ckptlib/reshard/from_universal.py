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
from ..errors import UnsupportedCheckpointError
from ..mesh import Rank

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
    if u.source_mesh.tp > 1 or mesh.tp > 1:
        out.append(f"16-bit weights the folder holds only as fp32 masters (tensor-parallel shards) are the masters "
                   f"rounded to {ck.dtype}, which the engine's 16-bit copies are after a step")
    return out


def refuse_for_native(ck: Checkpoint, mesh=None) -> None:
    """What no native checkpoint made from universal folder ``ck`` (at ``mesh``) could hold exactly, or ckptlib does
    not write yet, refused with the reason."""
    u = ck.universal
    src = u.source_mesh
    if u.pipeline or src.pp > 1 or (mesh is not None and mesh.pp > 1):
        raise UnsupportedCheckpointError(
            f"native pipeline files from a universal checkpoint (its source: pp={src.pp}) are not written yet: the "
            "layer files that say how layers make stages, and hold the buffers, are not in the folder",
            path=ck.location.tag_dir,
            hint="DeepSpeed resumes from it with \"load_universal\": true; `ckpt export` writes its full model")
    if ((u.info or {}).get("affine_map") or {}).get("params"):
        raise UnsupportedCheckpointError(
            "native AutoTP files from a universal checkpoint are not written yet", path=ck.location.tag_dir,
            hint="DeepSpeed resumes from it with \"load_universal\": true; `ckpt export` writes its full model")
    if u.step_conflicts:
        raise UnsupportedCheckpointError(
            "; ".join(u.step_conflicts) + ": a native checkpoint keeps one step per optimizer group",
            path=ck.location.tag_dir, hint="`ckpt diff ORIGINAL THIS --states` shows which step.pt was changed")
    if u.experts and (u.experts != "AutoEP" or (mesh is not None and (mesh.tp, mesh.pp) != (1, 1))):
        raise UnsupportedCheckpointError(f"a universal checkpoint of a mixture-of-experts model ({u.experts}"
                                         + (", at a tensor or pipeline size" if u.experts == "AutoEP" else "")
                                         + ") back to native files is not supported yet", path=ck.location.tag_dir,
                                         hint="DeepSpeed resumes from it with \"load_universal\": true; `ckpt export` "
                                              "writes its full model")
    if (ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        raise UnsupportedCheckpointError(
            "its run had round_robin_gradients, whose flat groups are not in the order the universal folder lists "
            "them: native files for such an engine are not written yet", path=ck.location.tag_dir,
            hint="load it with \"load_universal\": true in an engine with round_robin_gradients off")


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


__all__ = ["UniversalTemplate", "native_tag", "refuse_for_native", "derived_notes", "UNIVERSAL_SUFFIX"]
