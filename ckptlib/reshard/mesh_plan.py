"""Planning a reshard that changes the tensor- or pipeline-parallel size (and, with it, any data-parallel
size): the native DeepSpeed files of the new mesh, named as DeepSpeed names them there, for
``engine.load_checkpoint`` at the new topology (no universal mode). Metadata only.

    plan = plan_reshard("ckpt", "out", world_size=2, tp=1, pp=1)    # ckptlib.reshard.plan_reshard

For every ZeRO set of the new mesh (:mod:`ckptlib.reshard.target`): ``mp_rank_{stage*tp+t:02d}_model_states.pt``
(the sizes of the new mesh, the set's ``param_shapes`` and buffers; outside pipelines its ``module`` of 16-bit
shards; at ZeRO-0 its torch optimizer state), ``(bf16_)zero_pp_rank_{d}_mp_rank_XX_optim_states.pt`` for each
data rank (ZeRO-1/2 and BF16_Optimizer: the flat partitions re-cut), and for a pipeline one
``layer_XX[-model_YY]-model_states.pt`` per layer and tensor rank. Tensors replicated in the source (tensor
ranks, a tied weight's copies on several stages) are read from one copy and compared with the others before
anything is written, as an export does.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..deepspeed import BF16_OPTIMIZER, NO_ZERO, ZERO, Checkpoint, SplitRules
from ..deepspeed import files as fnames
from ..deepspeed.exactness import replica_checks, value_proofs
from ..deepspeed.join import PIPELINE
from ..errors import UnsupportedCheckpointError
from ..mesh import Mesh
from ..plan import CopyFile
from .autotp import autotp_target
from .footprint import footprint, state_bytes
from .from_universal import UniversalTemplate, derived_notes, native_tag, refuse_for_native, universal_layers
from .mesh_files import (MeshZero3Writer, MeshZero12Writer, ShardRanges, layer_file_tree, model_states_tree,
                         stage0_optimizer, zero3_model_states)
from .stages import plan_stages, ties_in
from .target import build_target, pipeline_layers, split_of
from .trees import DROP, TreeFiles, batch_note, carried, client_files, converter_scripts, sub_group_size


def _refuse(ck: Checkpoint, why: str, hint: Optional[str] = None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


def _check_supported(ck: Checkpoint, mesh: Mesh) -> None:
    if ck.universal is not None:
        refuse_for_native(ck, mesh)
        return
    if ck.num_experts:
        _refuse(ck, "changing the tensor or pipeline size of a mixture-of-experts checkpoint is not supported yet")
    if ck.flavor not in (ZERO, BF16_OPTIMIZER, NO_ZERO) or (ck.flavor == ZERO and ck.zero_stage not in (1, 2, 3)):
        _refuse(ck, f"changing the tensor or pipeline size of a ZeRO-{ck.zero_stage} checkpoint is not supported yet",
                hint="`ckpt reshard --world-size N` changes its data-parallel size; `--universal` any size")
    if ck.flavor == NO_ZERO and ck.optimizer is not None and ck.optimizer.wrapper != "torch optimizer":
        _refuse(ck, f"a ZeRO-0 checkpoint with {ck.optimizer.wrapper}: DeepSpeed 0.19.8 cannot reload these even at "
                    "the size they were saved with", hint="`ckpt export` writes its full model")
    if ck.sequence_parallel > 1:
        _refuse(ck, "a sequence-parallel (Ulysses) checkpoint has no tensor or pipeline axis to change",
                hint="`ckpt reshard --world-size N` changes its data-parallel size")
    zcfg = ck.ds_config.get("zero_optimization") or {}
    if zcfg.get("round_robin_gradients") and ck.flavor == ZERO:
        _refuse(ck, "round_robin_gradients: changing the tensor or pipeline size is not supported with it yet")
    for zs in ck.sets.values():
        for lay in (zs.layouts if ck.flavor != NO_ZERO else []):
            if any(getattr(s, "padding_after", 0) for s in lay.slots):
                _refuse(ck, "parameter alignment padding (param_alignment_paddings) is not re-made for another mesh yet")
    if mesh.pp > 1 and ck.kind != PIPELINE:
        _refuse(ck, f"this checkpoint is not a pipeline (no layer files): it cannot be spread over {mesh.pp} stages")


def _stage_plan(ck: Checkpoint, mesh: Mesh, rules: Optional[SplitRules], partition, num_layers, tied):
    layers, facts = universal_layers(ck, tied) if ck.universal is not None else (pipeline_layers(ck), None)
    params = {p.name: p for p in ck.view.parameters if not p.tied_to}

    def weight(names, tp):
        total = 0
        for n in names:
            p = params.get(n)
            if p is None or not p.trainable:
                continue
            dim, sizes = split_of(ck, n, rules, tp, False)
            shape = list(ck.view.full_shape(n, padded=True))
            if dim is not None:
                shape[dim] = sizes[0]
            count = 1
            for x in shape:
                count *= x
            total += count
        return total

    ties = {}
    plain = {}
    for idx, ents in layers.items():
        tie_names = [n for n, _ in ents if n.startswith("tied_modules.")]
        if tie_names:
            ties[tie_names[0].split(".")[1]] = [n for n, _ in ents]
        else:
            plain[idx] = [n for n, _ in ents]
    tie_layer = ties_in(layers)
    src_w = {i: weight(ns, ck.mesh.tp) for i, ns in plain.items()}
    dst_w = {i: weight(ns, mesh.tp) for i, ns in plain.items()}
    tie_src = {k: weight(ns, ck.mesh.tp) for k, ns in ties.items()}
    tie_dst = {k: weight(ns, mesh.tp) for k, ns in ties.items()}
    for key, idx in tie_layer.items():  # the tie's own file layer is a use: its weight is the tie's
        src_w[idx], dst_w[idx] = tie_src[key], tie_dst[key]
    return plan_stages(ck, layers, mesh.pp, src_w, dst_w, tie_src, tie_dst, partition=partition,
                       num_layers=num_layers, tied=tied, facts=facts)


def _rules_info(ck: Checkpoint, rules: Optional[SplitRules]) -> Optional[dict]:
    """The split rules to record in the target's universal_checkpoint_info when the source records none."""
    if rules is None:
        return None
    info = {"universal_checkpoint_version": 0.4,
            "tp_replicated_parameter_patterns": list(rules.replicated),
            "parameter_with_row_parallelism_patterns": list(rules.row),
            "vocabulary_parameter_patterns": list(rules.vocabulary),
            "pipeline_replicated_parameter_patterns": list(rules.pipeline_replicated)}
    if rules.original_vocab_size is not None:
        info["original_vocab_size"] = rules.original_vocab_size
    return info


def plan_mesh_files(ck: Checkpoint, mesh: Mesh, *, tp_rules: Optional[SplitRules] = None,
                    pp_partition: Optional[str] = None, pp_layers: Optional[int] = None,
                    pp_tied: Optional[dict] = None, hf_files: bool = True,
                    model_config=None) -> tuple[list, list, list, list, list]:
    """``(files, notes, checks, folders, footprints)`` of ``ck`` resharded to ``mesh`` (see the module docstring;
    ``footprints``: each target set's training memory per rank, :mod:`ckptlib.reshard.footprint`;
    ``model_config``: the HF model config an AutoTP checkpoint is cut by, :mod:`ckptlib.reshard.autotp`)."""
    _check_supported(ck, mesh)
    rules = tp_rules if tp_rules is not None else ck.tp_rules
    if ck.mesh.tp == 1 and mesh.tp > 1 and rules is None:
        _refuse(ck, f"the checkpoint has no tensor axis, so nothing in it says how its tensors split over {mesh.tp} "
                    "tensor ranks", hint="pass --tp-rules FILE (the keys of DeepSpeed's universal_checkpoint_info: "
                                         "which tensors are replicated, row parallel, vocabularies)")
    pipeline = ck.kind == PIPELINE or (ck.universal is not None and ck.universal.pipeline)
    stages = _stage_plan(ck, mesh, rules, pp_partition, pp_layers, pp_tied) if pipeline else None
    autotp = autotp_target(ck, mesh.tp, model_config) if mesh.tp != ck.mesh.tp else None
    model = build_target(ck, mesh, rules, stages, autotp)
    notes = list(stages.notes if stages else []) + (derived_notes(ck, mesh) if ck.universal is not None else [])
    tag = native_tag(ck) if ck.universal is not None else ck.location.tag
    shards = ShardRanges(ck)
    trees = TreeFiles()
    files: list = []
    template_set = UniversalTemplate(ck) if ck.universal is not None else ck.sets[min(ck.sets)]
    frozen = [p.name for p in ck.view.parameters if not p.trainable and not p.tied_to]
    template_model = template_set.model_states_file().obj
    recorded = template_model.get("universal_checkpoint_info")
    info = _rules_info(ck, rules) if recorded is None and mesh.tp > 1 else None
    extra = None
    if autotp is not None:  # the affine_map and autotp_size AutoTP records at the new size
        info = autotp.info(model, mesh.tp)
        tp_cfg = dict(ck.ds_config.get("tensor_parallel") or {}, autotp_size=mesh.tp)
        extra = {"ds_config": dict(ck.ds_config, tensor_parallel=tp_cfg)}
        notes.append(f"AutoTP cut for {mesh.tp} tensor ranks by {autotp.geometry.kv_heads} key-value heads "
                     f"({autotp.geometry.origin}); affine_map rewritten")
    elif mesh.tp == 1 and isinstance(recorded, dict) and (recorded.get("affine_map") or {}).get("params"):
        # the plain model (no AutoTP): its engine records neither AutoTP's universal_checkpoint_info nor its size
        extra = {"universal_checkpoint_info": DROP,
                 "ds_config": {k: v for k, v in ck.ds_config.items() if k != "tensor_parallel"}}
        notes.append("AutoTP's universal_checkpoint_info and tensor_parallel config left out: the un-split model "
                     "resumes without AutoTP")
    stage0_template = template_model.get("optimizer") if ck.flavor == NO_ZERO else None
    keys = list(ck.optimizer.state_keys) if ck.optimizer else []
    if ck.flavor == NO_ZERO and isinstance(stage0_template, dict):
        steps = {repr(v.get("step").item() if hasattr(v.get("step"), "item") else v.get("step"))
                 for zs in ck.sets.values() for v in (zs.model_states_file().obj["optimizer"]["state"] or {}).values()}
        if len(steps) > 1:
            _refuse(ck, f"the parameters' Adam steps differ ({', '.join(sorted(steps))}): ckptlib cannot tell which "
                        "step a re-cut tensor has")
    src = ck.universal.source_mesh if ck.universal is not None else None
    own = src is not None and (src.tp, src.pp) == (mesh.tp, mesh.pp)  # each set's copied file is its template
    for mp, ts in model.sets.items():
        template_model = (ck.main.copied_model_states(mp) if own else None) or template_set.model_states_file().obj
        if ck.flavor == NO_ZERO:
            opt = stage0_optimizer(stage0_template, ts, shards, keys) if isinstance(stage0_template, dict) else None
            tree = model_states_tree(template_model, ts, model, pipeline=pipeline, dp=mesh.dp, shards=shards,
                                     param_shapes=None, optimizer=opt, info=info, extra=extra)
            files.append(trees.make(f"{tag}/{fnames.model_states_name(mp)}", "model_states", tree))
            continue
        if ck.zero_stage == 3:
            writer = MeshZero3Writer(template_set, ts, mesh.dp, shards, sub_group_size(template_set))
            for name, tree in zero3_model_states(template_model, ts, model, mesh.dp, shards, writer.param_shapes(),
                                                 info, extra, frozen).items():
                files.append(trees.make(f"{tag}/{name}", "model_states", tree, fnames.classify(name).dp_rank))
        else:
            writer = MeshZero12Writer(template_set, ts, mesh.dp, shards)
            tree = model_states_tree(template_model, ts, model, pipeline=pipeline, dp=mesh.dp, shards=shards,
                                     param_shapes=writer.param_shapes(), info=info, extra=extra)
            files.append(trees.make(f"{tag}/{fnames.model_states_name(mp)}", "model_states", tree))
        for r in range(mesh.dp):
            name, obj = writer.optim_states(r)
            files.append(trees.make(f"{tag}/{name}", "optim_states", obj, r))
    if pipeline:
        empty = {f.layer: f for f in ck.files if f.kind == fnames.LAYER_STATES and (f.mp_rank or 0) == 0
                 and not stages.layers.get(f.layer)}  # a layer without state: its file copied as it is
        for mp, ts in model.sets.items():
            for layer in ts.layers:
                name = fnames.layer_states_name(layer, ts.tp if model.tensor_axis else None)
                if layer in empty:
                    files.append(carried(f"{tag}/{name}", os.fspath(empty[layer].path), empty[layer].bytes))
                    continue
                files.append(trees.make(f"{tag}/{name}", "layer_states", layer_file_tree(ts, layer, shards)))
    for script in converter_scripts(ck):
        files.append(CopyFile(Path(script).name, script, os.path.getsize(script)))
    world = mesh.pp * mesh.tp * mesh.dp
    if hf_files:
        client, client_notes = client_files(ck, world)
        files += client
        notes += client_notes
    note = batch_note(ck, mesh.dp)
    notes += [note] if note else []
    checks = replica_checks(ck) + value_proofs(ck)  # replicas and what metadata leaves open, before writing
    if checks:
        notes.append(f"{len(checks)} stored copies (tensor-parallel replicas, tied weights on several stages) are "
                     "compared with the copy read before anything is written")
    per = state_bytes(ck)[0]
    prints = [footprint(sum(t.numel for g in ts.groups for t in g), ck.dtype, ck.zero_stage or 0, mesh.dp,
                        bf16_optimizer=template_set.flavor == BF16_OPTIMIZER, stage=ts.stage, tp=ts.tp,
                        per_element=per) for ts in model.sets.values()]
    return files, notes, checks, [tag], prints


__all__ = ["plan_mesh_files"]
