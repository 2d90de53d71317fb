"""AutoEP checkpoints (ZeRO-1/2, per-expert files) at another expert-parallel and data-parallel size (metadata only).

At expert-parallel size ``E'`` and world ``W'``, rank ``r`` is ep rank ``e = r mod E'`` and holds the global experts
``[e·L', (e+1)·L')`` (``L' = E / E'``) of every AutoEP layer, stacked as ``experts.w1/w2/w3`` [L', ...]
(:mod:`ckptlib.deepspeed.autoep`). Its optimizer file holds every dense group re-cut for ``W'`` ranks (partition
``r``) and the expert group made of its ep rank's stacked experts (rows ``[e·L', (e+1)·L')`` of each full
``[E, ...]`` weight, in the source's parameter order), partitioned over the ``W' / E'`` ranks that hold the same
experts (partition ``r // E'``) and named ``ep_size_{E'}`` as DeepSpeed names it.

``mp_rank_00_model_states.pt`` gets the expert group's local shapes, the new world size and ``ds_autoep_layers``
(also in ``universal_checkpoint_info``) as data-parallel rank 0 of the new mesh records it: ``ep_size``,
``num_local_experts``, the placement of every ep rank's experts and the affine maps of its stacked weights, ep
rank 0's ``global_expert_start/end``. The 16-bit per-expert files name global ids: they are copied as they are
(DeepSpeed's AutoEP load stacks each rank's experts from them).
"""
from __future__ import annotations


from ..deepspeed import ZERO, Checkpoint
from ..deepspeed.autoep import KEY, split_ep_name
from ..errors import UnsupportedCheckpointError
from ..kinds.optimizers import WHOLE_PARAMS
from ..layout.flat import FlatGroupLayout
from ..layout.placement import row_major_strides
from ..mesh import Mesh
from .moe import ExpertWriter, expert_files
from .trees import batch_note, client_files


def _refuse(ck: Checkpoint, why: str, hint=None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


class AutoEPWriter(ExpertWriter):
    """The optimizer-states files of an AutoEP checkpoint at ``world`` ranks and ``ep`` expert-parallel ranks."""

    def __init__(self, ck: Checkpoint, world: int, ep: int):
        zs = ck.main
        self.ck, self.ep = ck, ep
        self.num_local = zs.records.autoep_layers[0].num_experts // ep
        self.expert_groups = dict(zs.records.expert_groups)
        dst = []
        for g, lay in enumerate(zs.layouts):
            if g in self.expert_groups:  # the slots are the local names; their full [E, ...] weights cut by rows
                names = [(split_ep_name(s.name) or (s.name, 0))[0] for s in lay.slots]
                dst.append(FlatGroupLayout.build([(n, (self.num_local, *ck.view.full_shape(n)[1:])) for n in names],
                                                 world // ep, group=g))
            else:
                dst.append(FlatGroupLayout.build([(s.name, s.shape) for s in lay.slots], world, group=g))
        super().__init__(zs, dst, world, zs.mp)

    def source_of(self, g: int, rank: int, name: str) -> tuple[str, int]:
        if g not in self.expert_groups:
            return name, 0
        return name, (rank % self.ep) * self.placement(g, rank)[0].slot(name).numel  # this ep rank's rows

    def param_ranges(self, g: int, rank: int, name: str, key: str) -> list:
        if g in self.expert_groups:
            _refuse(self.ck, "a state kept per whole parameter (Muon) in an AutoEP expert group cannot be resharded yet")
        return self.ck.sources(name, key)


def target_layers(recorded: list, world: int, ep: int) -> list:
    """``ds_autoep_layers`` as data-parallel rank 0 of a run at ``world`` ranks and ``ep`` expert-parallel ranks
    records it: each recorded entry with its ep size, local experts, placement, the affine maps of its stacked
    weights and ep rank 0's place changed (everything else as recorded)."""
    out = []
    for d in recorded:
        n = int(d["num_experts"])
        local = n // ep
        maps = {}
        for name, m in ((d.get("affine_maps") or {}).get("params") or {}).items():
            shape = [int(s) for s in m["logical_shape"]]
            strides = list(row_major_strides(shape))
            shard = [local, *shape[1:]]
            maps[name] = dict(m, ranks={e: {"shard_shape": list(shard), "pieces": [
                {"shape": list(shard), "source": [e * local * strides[0], strides], "dest": [0, strides],
                 "locations": [e]}]} for e in range(ep)})
        entry = dict(d, num_local_experts=local, ep_size=ep, ep_group_name=f"ep_size_{ep}", ep_rank=0,
                     expert_data_parallel_rank=0, expert_data_parallel_world_size=world // ep,
                     global_expert_start=0, global_expert_end=local,
                     expert_placement=dict(d.get("expert_placement") or {}, num_experts=n, ep_size=ep, ranks=[
                         {"rank": e, "experts": list(range(e * local, (e + 1) * local))} for e in range(ep)]))
        if "affine_maps" in d:
            entry["affine_maps"] = dict(d["affine_maps"], params=maps)
        out.append(entry)
    return out


def plan_autoep_files(ck: Checkpoint, mesh: Mesh, hf_files: bool = True) -> tuple[list, list]:
    """``(files, notes)`` of AutoEP checkpoint ``ck`` at ``mesh.dp`` ranks and ``mesh.ep`` expert-parallel ranks."""
    if ck.flavor != ZERO or ck.zero_stage not in (1, 2):
        _refuse(ck, f"resharding an AutoEP checkpoint at ZeRO-{ck.zero_stage} (its experts in the ZeRO-3 partitions) is "
                    "not supported yet", hint="`ckpt export CKPT OUT --model-config CONFIG.json` writes the whole model "
                                              "in its Hugging Face layout (--states all: the optimizer states too)")
    if (mesh.tp, mesh.pp) != (1, 1):
        _refuse(ck, "an AutoEP checkpoint has no tensor or pipeline axis to change")
    layers = ck.records.autoep_layers
    experts = {lay.num_experts for lay in layers}
    if len(experts) != 1:
        _refuse(ck, f"AutoEP layers with different expert counts ({sorted(experts)}) are not supported yet")
    n, world, ep = experts.pop(), mesh.dp, mesh.ep
    if n % ep or world % ep:
        _refuse(ck, f"{ep} expert-parallel ranks must divide the {n} experts and the world of {world} ranks",
                hint="pick an expert-parallel size that divides both")
    if any(k.layout == WHOLE_PARAMS for g in (ck.optimizer.groups if ck.optimizer else []) for k in g.keys):
        _refuse(ck, "Muon with AutoEP cannot be resharded yet")
    if (ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"):
        _refuse(ck, "round_robin_gradients: resharding an AutoEP checkpoint with it is not supported yet")
    writer = AutoEPWriter(ck, world, ep)
    model = ck.main.model_states_file().obj
    recorded = model.get(KEY) or []
    new_layers = target_layers(recorded, world, ep)
    info = model.get("universal_checkpoint_info")
    cfg = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else None
    repl = {KEY: new_layers}
    if isinstance(info, dict) and KEY in info:
        repl["universal_checkpoint_info"] = dict(info, **{KEY: new_layers})
    if cfg is not None and isinstance(cfg.get("expert_parallel"), dict):
        repl["ds_config"] = dict(cfg, expert_parallel=dict(cfg["expert_parallel"], autoep_size=ep))
    files = expert_files(ck, writer, repl)
    notes = [f"AutoEP experts: {n} per layer, {n // ep} on each of {ep} expert-parallel rank(s), each expert group "
             f"partitioned over {world // ep} rank(s); the per-expert files are copied (they name global ids); load it "
             f"with \"expert_parallel\": {{\"autoep_size\": {ep}}}"]
    if hf_files:
        carried, carried_notes = client_files(ck, world)
        files += carried
        notes += carried_notes
    note = batch_note(ck, world)
    notes += [note] if note else []
    return files, notes


__all__ = ["plan_autoep_files", "AutoEPWriter", "target_layers"]
