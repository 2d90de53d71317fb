"""AutoEP checkpoints (DeepSpeed 0.19.2+: expert parallelism for Hugging Face MoE models).

AutoEP replaces each MoE block of a Hugging Face model (Mixtral, Qwen3-MoE, OLMoE ...) by an ``AutoEPMoELayer``:
a router (``mlp.router.gate.weight`` [E, D], also saved under the alias ``mlp.gate.gate.weight``) and the experts
stacked per expert-parallel rank, ``mlp.experts.w1`` / ``w3`` [E/EP, F, D] (gate and up projections) and ``w2``
[E/EP, D, F] (down). Expert-parallel rank ``e = r % EP`` of data rank ``r`` holds the global experts
``[e·E/EP, (e+1)·E/EP)``; the ZeRO-1/2 optimizer keeps them in their own group (``moe: True``, ``ep_size_EP``)
partitioned over the expert data-parallel ranks ``e, e + EP, ...``, under the same LOCAL names on every ep rank.
``mp_rank_00_model_states.pt`` records the layers in ``ds_autoep_layers`` (module path, expert count, ep size,
``checkpoint_format``); the 16-bit experts are also in ``layer_{L}_expert_{G}_mp_rank_00_model_states.pt``
(``<prefix>.w{1,2,3}.<G>``) at ZeRO-1/2. ZeRO-3 ("zero3_partitioned") keeps the experts in its partitions, whose
sub-groups are partitioned over different rank sets (``ds_zero_partition_groups``).

Here each ep rank's stacked tensor is a parameter of the ZeRO set under an internal name (:func:`ep_name`), and
:func:`autoep_view` stacks them into the full ``[E, ...]`` tensor under AutoEP's name. :func:`hf_view` gives the
same tensors under the names and layout transformers 5 gives the model class (checked against DeepSpeed's own
repacking, ``moe/ep_repack.py``, and transformers' modeling code for the classes in :data:`HF_CLASSES`):

- ``mlp.router.gate.weight`` -> ``mlp.gate.weight``; the alias ``mlp.gate.gate.weight`` is not a tensor of its own;
- ``mlp.experts.w1`` and ``w3`` -> ``mlp.experts.gate_up_proj`` [E, 2F, D] = ``cat([w1, w3], dim=1)``;
- ``mlp.experts.w2`` -> ``mlp.experts.down_proj`` [E, D, F].
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..layout.placement import Block, row_major_strides
from . import files as fnames
from .model import ModelView
from .records import ParameterInfo
from .values import as_int

KEY = "ds_autoep_layers"
#: transformers 5 model types whose MoE blocks AutoEP folds as this module says (gate_up_proj / down_proj / gate)
HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
_EP = re.compile(r"^(?P<local>.+)@ep(?P<e>\d+)$")
_WEIGHTS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class AutoEPLayer:
    """One AutoEP MoE layer as ``ds_autoep_layers`` records it."""

    layer: int
    module_path: str
    num_experts: int
    num_local: int
    ep: int
    prefix: str
    checkpoint_format: str

    def weight(self, w: str) -> str:
        return f"{self.prefix}.{w}"


def layers_of(model: dict) -> list[AutoEPLayer]:
    """The AutoEP layers a model-states file records (none for other checkpoints)."""
    out = []
    for d in model.get(KEY) or []:
        if not isinstance(d, dict):
            continue
        path = str(d.get("module_path", ""))
        out.append(AutoEPLayer(layer=as_int(d.get("moe_layer_id")) or 0, module_path=path,
                               num_experts=as_int(d.get("num_experts")) or 0,
                               num_local=as_int(d.get("num_local_experts")) or 0, ep=as_int(d.get("ep_size")) or 1,
                               prefix=str(d.get("expert_key_prefix") or f"{path}.experts"),
                               checkpoint_format=str(d.get("checkpoint_format", ""))))
    return out


def ep_name(local: str, ep_rank: int) -> str:
    """The internal name of expert-parallel rank ``ep_rank``'s stacked experts of ``local`` (``...experts.w1``)."""
    return f"{local}@ep{ep_rank}"


def split_ep_name(name: str) -> Optional[tuple[str, int]]:
    m = _EP.match(name)
    return (m.group("local"), int(m.group("e"))) if m else None


def alias_names(layers: list[AutoEPLayer]) -> set:
    """The state-dict aliases of the routers (``<module>.gate.gate.weight``)."""
    return {f"{lay.module_path}.gate.gate.weight" for lay in layers}


def router_aliases(layers: list[AutoEPLayer], module: dict, proofs: list) -> dict:
    """``{alias: router}`` for each layer whose module holds both (``AutoEPMoELayer.gate`` is its ``router``: the
    same parameter, saved twice); ``proofs`` gets, per alias, the two saved 16-bit copies to compare before any
    conversion uses the tie (ZeRO-3 saves both as empty placeholders: nothing to compare, the tie is AutoEP's
    structure)."""
    out = {}
    for lay in layers:
        alias, router = f"{lay.module_path}.gate.gate.weight", f"{lay.module_path}.router.gate.weight"
        a, r = module.get(alias), module.get(router)
        if not (isinstance(a, TensorHandle) and isinstance(r, TensorHandle) and a.numel == r.numel):
            continue
        out[alias] = router
        if a.numel:
            proofs.append((f"{alias}: AutoEP's alias of {router} (the same parameter), both saved copies",
                           a.ranges(), r.ranges(), r.dtype_name))
    return out


def zero3_layout(fs, model_files: list, optims: dict, sub_groups: list[dict], n: int, problems: list):
    """The ZeRO-3 layout of an AutoEP checkpoint ("zero3_partitioned"), or None (``problems`` says why):
    ``(layout, trainable, experts, members)``.

    Each sub-group is partitioned over the ranks its ``ds_zero_partition_groups`` entry lists (the dense ones over
    all ``n``, the experts' over an ep rank's expert data-parallel ranks); every rank's model-states file names its
    ep rank. An expert sub-group holds, on each ep rank's members, that ep rank's stacked experts under the same
    local names: they become the parameters :func:`ep_name` ``(local, e)``, at the same offsets. ``trainable``:
    ``{name: (shape, sub-group)}``; ``experts``: ``{name: (sub-group, ep rank, local)}``; ``members``:
    ``{name: [data rank of each partition]}`` for the experts (the dense ones are partitioned over ranks
    ``0 .. n-1`` in order)."""
    from ..layout.flat import Zero3Layout, Zero3Slot, chunk_size

    ep_of: dict = {}
    for f in model_files:
        tf = fs.get(f)
        lays = (tf.obj.get(KEY) or []) if tf is not None and isinstance(tf.obj, dict) else []
        eps = {as_int(d.get("ep_rank")) for d in lays if isinstance(d, dict)}
        if f.dp_rank is not None and len(eps) == 1 and None not in eps:
            ep_of[f.dp_rank] = eps.pop()
    groups = {rank.dp: osd.get("ds_zero_partition_groups") for rank, osd in optims.items()}
    first = groups.get(0)
    if len(ep_of) != n or not isinstance(first, (list, tuple)) or len(first) != len(sub_groups):
        problems.append("AutoEP at ZeRO-3: every rank's model-states file must name its ep rank and every optimizer "
                        "file its ds_zero_partition_groups, one per sub-group of param_shapes: they do not")
        return None
    worlds, slots, sizes = [], [], []
    trainable, experts, members = {}, {}, {}
    for j, params in enumerate(sub_groups):
        entry = first[j] if isinstance(first[j], dict) else {}
        w = as_int(entry.get("partition_count")) or n
        expert = "autoep_expert" in (entry.get("families") or [])
        by_ep: dict = {}
        for r in range(n):
            e = ep_of[r] if expert else 0
            mine = (groups.get(r) or [None] * len(sub_groups))[j]
            ranks = list(mine.get("partition_ranks") or []) if isinstance(mine, dict) else []
            if len(ranks) != w or r not in ranks or (not expert and ranks != list(range(n))) or \
                    by_ep.setdefault(e, ranks) != ranks:
                problems.append(f"AutoEP at ZeRO-3: rank {r}'s partition of sub-group {j} is over ranks {ranks}, "
                                f"which does not fit {w} ranks per {'ep rank' if expert else 'sub-group'}")
                return None
        offset = 0
        for name, shape in params.items():
            shape = tuple(int(s) for s in shape)
            for e in (sorted(by_ep) if expert else [None]):
                full = ep_name(name, e) if expert else name
                slots.append(Zero3Slot(name=full, shape=shape, sub_group=j, offset=offset))
                trainable[full] = (shape, j)
                if expert:
                    experts[full] = (j, e, name)
                    members[full] = by_ep[e]
            numel = 1
            for s in shape:
                numel *= s
            offset += chunk_size(numel, w)
        worlds.append(w)
        sizes.append(offset)
    return (Zero3Layout(slots=tuple(slots), world_size=n, sub_group_sizes=tuple(sizes), sub_group_worlds=tuple(worlds)),
            trainable, experts, members)


def expert_file_problems(fs, layers: list[AutoEPLayer]) -> list[str]:
    """Per-expert files (ZeRO-1/2) that do not hold their expert, and those the layers expect but the folder lacks."""
    out = []
    by_id = {lay.layer: lay for lay in layers}
    for f in (f for f in fs.files if f.kind == fnames.EXPERT_STATES):
        tf = fs.get(f)
        if tf is None:
            continue
        lay = by_id.get(f.layer or 0)
        want = {f"{lay.weight(w)}.{f.expert}" for w in _WEIGHTS} if lay else set()
        keys = {k for k, v in tf.obj.items() if isinstance(v, TensorHandle)} if isinstance(tf.obj, dict) else set()
        if lay is None or f.expert >= lay.num_experts or keys != want:
            out.append(f"{f.relpath}: holds {', '.join(sorted(keys)) or 'no tensor'}, not the w1/w2/w3 of AutoEP "
                       f"expert {f.expert}" + (f" of {lay.prefix}" if lay else f" (no AutoEP layer {f.layer})")
                       + ": left over from another run, or damaged")
    have = {(f.layer or 0, f.expert) for f in fs.files if f.kind == fnames.EXPERT_STATES}
    for lay in layers:
        if lay.checkpoint_format != "per_expert_files":
            continue
        for g in range(lay.num_experts):
            if (lay.layer, g) not in have:
                out.append(f"{fs.location.tag}/{fnames.expert_states_name(lay.layer, g)} is missing (AutoEP layer "
                           f"{lay.module_path} has {lay.num_experts} experts); a rank did not finish saving")
    return out


def autoep_view(zs, layers: list[AutoEPLayer]) -> ModelView:
    """The model of a one-set AutoEP checkpoint under AutoEP's names: each expert weight ``[E, ...]`` stacked from
    its ep ranks' local tensors (dim 0, ep rank order); the router alias is a tied name of the router."""
    ep_parts: dict = {}
    params, blocks = [], {}
    for p in zs.parameters:
        split = split_ep_name(p.name)
        if split is None:
            params.append(p)
            if not p.tied_to:
                blocks[p.name] = [_whole((zs.mp, p.name), tuple(p.shape))]
            continue
        ep_parts.setdefault(split[0], {})[split[1]] = p
    order = zs.state_dict_names()
    full_params = []
    for local, parts in ep_parts.items():
        first = parts[min(parts)]
        if sorted(parts) != list(range(len(parts))):
            raise UnsupportedCheckpointError(f"{local}: expert-parallel ranks {sorted(parts)} found", path=zs.location.tag_dir)
        shape = (first.shape[0] * len(parts), *first.shape[1:])
        full_params.append(ParameterInfo(name=local, shape=shape, trainable=True, group=first.group))
        st = row_major_strides(shape)
        blocks[local] = [Block((zs.mp, ep_name(local, e)), tuple(first.shape), e * first.numel, st, 0, st)
                         for e in sorted(parts)]
    params = _placed(params, full_params, layers)
    order = _placed_names([n for n in order if split_ep_name(n) is None], [p.name for p in full_params], layers)
    known = {p.name for p in params} | {b.name for b in zs.buffers}
    order = [n for n in order if n in known] + [p.name for p in params if p.name not in order]
    return ModelView(parameters=params, buffers=list(zs.buffers), order=order,
                     blocks=blocks | {b.name: [_whole((zs.mp, b.name), tuple(b.shape))] for b in zs.buffers},
                     resolve=lambda source, key: zs.sources(source[1], key), sets={zs.mp: zs}, kind="autoep",
                     notes=[f"AutoEP: {len(layers)} MoE layers of {layers[0].num_experts if layers else 0} experts, "
                            f"expert parallel {layers[0].ep if layers else 1}; each expert weight joined from its "
                            "expert-parallel ranks"])


def _whole(source, shape: tuple) -> Block:
    st = row_major_strides(shape)
    return Block(source, tuple(shape), 0, st, 0, st)


def _anchor(name: str, layers: list[AutoEPLayer]) -> Optional[str]:
    """The module path of the AutoEP layer ``name`` belongs to."""
    return next((lay.module_path for lay in layers if name.startswith(lay.module_path + ".")), None)


def _placed(params: list, experts: list, layers: list[AutoEPLayer]) -> list:
    """``params`` with each of ``experts`` after the last parameter of its MoE layer (its router), in order."""
    out = list(params)
    for p in experts:
        path = _anchor(p.name, layers)
        at = max((i for i, q in enumerate(out) if path and q.name.startswith(path + ".")), default=len(out) - 1)
        out.insert(at + 1, p)
    return out


def _placed_names(order: list, experts: list, layers: list[AutoEPLayer]) -> list:
    out = list(order)
    for n in experts:
        path = _anchor(n, layers)
        at = max((i for i, q in enumerate(out) if path and q.startswith(path + ".")), default=len(out) - 1)
        out.insert(at + 1, n)
    return out


# ============================================================================================ the HF layout
def hf_view(view: ModelView, layers: list[AutoEPLayer], model_type: str) -> ModelView:
    """``view`` (an :func:`autoep_view`) under the names and layout transformers 5 gives ``model_type``'s class:
    the router as ``mlp.gate.weight``, ``gate_up_proj`` = ``cat([w1, w3], dim=1)``, ``down_proj`` = ``w2``; the
    router alias left out. Metadata only.

    Raises:
        UnsupportedCheckpointError: a model type whose layout ckptlib has not checked (:data:`HF_CLASSES`)."""
    if model_type not in HF_CLASSES:
        raise UnsupportedCheckpointError(
            f"the model config's model_type is {model_type!r}: ckptlib knows the transformers layout AutoEP folds into "
            f"for {', '.join(sorted(HF_CLASSES))} only", hint="export with the config of one of those classes, or "
                                                               "report the model type")
    aliases = alias_names(layers)
    params, blocks, order = [], {}, []
    by = {p.name: p for p in view.parameters}
    renamed = {}
    for lay in layers:
        renamed[f"{lay.module_path}.router.gate.weight"] = f"{lay.module_path}.gate.weight"
    fused = {}
    for lay in layers:
        w1, w2, w3 = (by.get(lay.weight(w)) for w in _WEIGHTS)
        if None in (w1, w2, w3):
            raise UnsupportedCheckpointError(f"AutoEP layer {lay.module_path} lacks one of its expert weights w1, w2, w3")
        e, f, d = w1.shape
        shape = (e, 2 * f, d)
        st, local = row_major_strides(shape), row_major_strides(w1.shape)
        gate_up = [Block(b.source, b.shape, b.full_offset // (f * d) * (2 * f * d), st, b.local_offset, local)
                   for b in view.blocks[w1.name]]
        gate_up += [Block(b.source, b.shape, b.full_offset // (f * d) * (2 * f * d) + f * d, st, b.local_offset, local)
                    for b in view.blocks[w3.name]]
        fused[w1.name] = (f"{lay.prefix}.gate_up_proj", shape, gate_up, w1.group)
        fused[w2.name] = (f"{lay.prefix}.down_proj", tuple(w2.shape), list(view.blocks[w2.name]), w2.group)
        fused[w3.name] = None
    for name in view.order:
        if name in aliases:
            continue
        if name in fused:
            if fused[name] is None:
                continue
            new, shape, bl, group = fused[name]
            params.append(ParameterInfo(name=new, shape=shape, trainable=True, group=group))
            blocks[new] = bl
            order.append(new)
            continue
        p = by.get(name)
        new = renamed.get(name, name)
        if p is not None:
            tied = renamed.get(p.tied_to, p.tied_to) if p.tied_to else None
            params.append(ParameterInfo(name=new, shape=p.shape, trainable=p.trainable, tied_to=tied, group=p.group,
                                        stored_dtype=p.stored_dtype))
            if not p.tied_to:
                blocks[new] = view.blocks[name]
        elif name in view.blocks:
            blocks[new] = view.blocks[name]
        order.append(new)
    return ModelView(parameters=params, buffers=list(view.buffers), order=order, blocks=blocks, resolve=view.resolve,
                     kind=view.kind, notes=view.notes + [f"AutoEP experts in the layout of transformers' "
                                                         f"{HF_CLASSES[model_type]}: gate_up_proj = cat(w1, w3), "
                                                         "down_proj = w2, the router as mlp.gate.weight"],
                     sets=view.sets)


__all__ = ["KEY", "HF_CLASSES", "AutoEPLayer", "layers_of", "ep_name", "split_ep_name", "alias_names", "router_aliases",
           "zero3_layout",
           "expert_file_problems", "autoep_view", "hf_view"]
