"""The partition layout of each kind of checkpoint, from its pickles: ZeRO-1/2 (and BF16_Optimizer) flat
groups, ZeRO-3 per-parameter chunks (stage 0's optimizer groups: :mod:`.stage0`); then the parameter list.

Each ``build_*`` fills ``rec.layouts``, ``rec.parameters``, ``rec.partition_count`` and the tensor index
of a :class:`~ckptlib.deepspeed.records.Records`, and appends what does not add up to ``rec.problems``.
The unpickled trees are only read.
"""
from __future__ import annotations

from typing import Any, Optional

from ..errors import IncompleteCheckpointError, UnsupportedCheckpointError
from ..io.torchzip import TensorHandle
from ..layout.flat import FlatGroupLayout, Zero3Layout
from . import files as fnames
from . import offload
from .fileset import OpenedFiles
from . import autoep
from .moe import expert_groups
from .records import BF16_OPTIMIZER, FileInfo, ParameterInfo, Records
from .releases import written_by
from .values import as_int


# ============================================================================================ ZeRO-1/2
def build_zero12(rec: Records, model: dict, model_file: FileInfo, optim_files: list[FileInfo]) -> None:
    param_shapes = _param_shape_groups(model.get("param_shapes"))
    if param_shapes is None:
        param_shapes = shapes_from_mappings(rec)
    if param_shapes is None:
        raise UnsupportedCheckpointError(
            f"the model-states file has no 'param_shapes' (written by {written_by(rec.deepspeed_version)}; "
            "DeepSpeed writes it there since 0.6)", path=model_file.path,
            hint="checkpoints from DeepSpeed before 0.6 are not supported")
    optim = rec.index.optim
    first = optim[min(optim)]
    counts = first.get("partition_count")
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts] * len(param_shapes)
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise IncompleteCheckpointError(f"partition_count {counts!r} is not a list of numbers",
                                        path=optim_files[0].path) from None
    rec.partition_count = max(counts) if counts else None
    base = first.get("base_optimizer_state")
    layers = autoep.layers_of(model)
    rec.expert_groups = expert_groups(base.get("param_groups") or [] if isinstance(base, dict) else [],
                                      [list(g) for g in param_shapes], counts, rec.partition_count or 1,
                                      autoep_local=layers[0].num_local if layers else None)
    paddings = first.get("param_alignment_paddings")
    if len(counts) != len(param_shapes):
        raise IncompleteCheckpointError(
            f"the optimizer-state files have {len(counts)} parameter groups (partition_count), the model-states "
            f"file's param_shapes {len(param_shapes)}: the files are not of one save", path=model_file.path,
            hint="the model-states file or the optimizer files are from another run; restore the files from a copy")
    for g, group in enumerate(param_shapes):
        pads = list(paddings[g]) if isinstance(paddings, (list, tuple)) and g < len(paddings) else None
        if pads is not None and len(pads) != len(group):
            raise IncompleteCheckpointError(
                f"group {g}: param_shapes lists {len(group)} parameters, the optimizer files' "
                f"param_alignment_paddings {len(pads)}: the model-states file and the optimizer files are not of "
                "one save", path=model_file.path,
                hint="the model-states file or the optimizer files are from another run; restore the files from a copy")
        count = counts[g]
        if count < 1:
            raise IncompleteCheckpointError(f"group {g}: partition_count {count} is not a positive number",
                                            path=optim_files[0].path)
        rec.layouts.append(FlatGroupLayout.build(list(group.items()), count, paddings_after=pads, group=g))
    check_rank_files(rec, optim_files, rec.partition_count, "optimizer-state")
    key = "single_partition_of_fp32_groups"
    for rank, osd in sorted(optim.items()):
        r, parts = rank.dp, osd.get(key)
        if rec.partition_count is not None and r >= rec.partition_count:
            continue  # an extra file, reported as such
        if not isinstance(parts, (list, tuple)) or len(parts) != len(rec.layouts):
            rec.problems.append(f"{_who(optim_files, r)}: '{key}' has {len(parts) if parts is not None else 'no'} groups, "
                                f"param_shapes has {len(rec.layouts)}")
            continue
        for g, (t, lay) in enumerate(zip(parts, rec.layouts)):
            k = r // rec.expert_groups[g].ep if g in rec.expert_groups else r  # the partition this rank holds
            want = lay.partition_size if rec.flavor == BF16_OPTIMIZER else lay.lean_length(k)
            if not isinstance(t, TensorHandle) or t.numel != want:
                got = t.numel if isinstance(t, TensorHandle) else type(t).__name__
                rec.problems.append(
                    f"{_who(optim_files, r)} group {g}: the fp32 partition holds {got} elements, but {want} are expected "
                    f"from param_shapes (in {model_file.relpath}) at {lay.world_size} ranks (element counts do not "
                    "add up)")
    trainable = {}
    for g, group in enumerate(param_shapes):
        eg = rec.expert_groups.get(g)
        for e in range(eg.ep if eg else 1):  # an expert group: every expert-parallel rank's experts, by global id
            for name, shape in group.items():
                full = eg.global_name(name, e) if eg else name
                trainable[full] = (tuple(shape), g)
                if eg:
                    rec.index.experts[full] = (g, e, name)
    frozen_shapes = model.get("frozen_param_shapes") or {}
    frozen_frag = model.get("frozen_param_fragments") or {}
    rec.index.frozen = {n: [t] for n, t in frozen_frag.items() if isinstance(t, TensorHandle)}
    shared = model.get("shared_params")
    if not shared:
        # DeepSpeed < 0.9 (and 0.9.x's ZeRO-1/2) record no ties; the 16-bit module weights are views of the
        # flat groups, so an alias is a module tensor on the same storage, offset, shape and stride as a
        # trainable parameter that is itself neither trainable nor frozen
        ties = {a: o for a, o in aliases_by_storage(rec.index.module, set(model.get("buffer_names") or [])).items()
                if o in trainable and a not in trainable and a not in frozen_shapes}
        if ties:
            rec.ties_from_storage = shared = ties
    if layers:  # AutoEP's router alias: the same parameter under a second name, its saved copies compared
        shared = dict(shared or {}, **autoep.router_aliases(layers, rec.index.module, rec.index.alias_proofs))
    check_state_keys(rec)
    collect_parameters(rec, model, trainable, {n: tuple(s) for n, s in frozen_shapes.items()}, shared or {})


def check_state_keys(rec: Records) -> None:
    """Every rank's optimizer state must have the same per-element entries in every group (sub-group) as the
    first rank's: a rank file without one (a damaged or edited file) is a problem naming it."""
    def keys_of(osd, g):
        if rec.zero_stage == 3:
            st = ((osd.get("optimizer_state_dict") or {}).get("state") or {}).get(g)
        else:
            base = osd.get("base_optimizer_state")
            st = (base.get("state") or {}).get(g) if isinstance(base, dict) else \
                (base[g] if isinstance(base, (list, tuple)) and g < len(base) else None)
        return sorted(k for k in st) if isinstance(st, dict) else None

    ranks = sorted(rec.index.optim)
    if not ranks:
        return
    groups = len(rec.layouts[0].sub_group_sizes) if rec.zero_stage == 3 else len(rec.layouts)
    first = rec.index.optim[ranks[0]]
    names = {f.dp_rank: f.relpath for f in rec.files if f.kind == fnames.OPTIM_STATES}
    for g in range(groups):
        want = keys_of(first, g)
        for rank in ranks[1:]:
            have = keys_of(rec.index.optim[rank], g)
            if have != want:
                missing = sorted(set(want or []) - set(have or []))
                extra = sorted(set(have or []) - set(want or []))
                rec.problems.append(
                    f"{names.get(rank.dp, rank)}: the optimizer state of group {g} "
                    + (f"has no {', '.join(repr(k) for k in missing)}" if missing else "")
                    + (" and " if missing and extra else "")
                    + (f"has {', '.join(repr(k) for k in extra)} too" if extra else "")
                    + f" (dp rank {ranks[0].dp}'s has {', '.join(want or []) or 'none'}): the file is damaged or "
                    "from another run")


# ============================================================================================ ZeRO-3
def build_zero3(rec: Records, fs: OpenedFiles, model: dict, model_files: list[FileInfo],
                optim_files: list[FileInfo]) -> None:
    sub_groups = _param_shape_groups(model.get("param_shapes"))
    if sub_groups is None:
        raise UnsupportedCheckpointError(f"the ZeRO-3 model-states file has no 'param_shapes' (written by "
                                         f"{written_by(rec.deepspeed_version)})", path=model_files[0].path)
    optim = rec.index.optim
    rec.partition_count = as_int(optim[min(optim)].get("partition_count"))
    n = rec.partition_count or rec.dp_world_size or len(optim_files)
    layout = Zero3Layout.build([list(g.items()) for g in sub_groups], n)
    autoep_trainable = None
    if autoep.layers_of(model):  # experts per ep rank, sub-groups over different rank sets
        found = autoep.zero3_layout(fs, model_files, optim, sub_groups, n, rec.problems)
        if found is None:
            return
        layout, autoep_trainable, rec.index.experts, rec.index.zero3_members = found
    rec.layouts = [layout]
    check_rank_files(rec, optim_files, n, "optimizer-state")
    check_rank_files(rec, model_files, n, "model-states")
    empties: dict[int, dict] = {}  # NVMe offload: dp -> {sub-group: its (0,) placeholder}
    for rank, osd in sorted(optim.items()):
        r, flats = rank.dp, osd.get("fp32_flat_groups")
        if r >= n:
            continue  # an extra file, reported as such
        if not isinstance(flats, (list, tuple)) or len(flats) != len(layout.sub_group_sizes):
            rec.problems.append(f"{_who(optim_files, r)}: 'fp32_flat_groups' has {len(flats) if flats else 'no'} sub-groups, "
                                f"param_shapes has {len(layout.sub_group_sizes)}")
            continue
        for k, (t, want) in enumerate(zip(flats, layout.sub_group_sizes)):
            if not isinstance(t, TensorHandle) or t.numel != want:
                got = t.numel if isinstance(t, TensorHandle) else type(t).__name__
                if isinstance(t, TensorHandle) and t.numel == 0 and want:
                    empties.setdefault(r, {})[k] = t  # swapped to NVMe: its swap files are matched below
                else:
                    rec.problems.append(f"{_who(optim_files, r)} sub-group {k}: the fp32 partition holds {got} elements, "
                                        f"{want} are expected from param_shapes at {layout.world_of(k)} ranks")
    if empties:
        _swapped_partitions(rec, fs, model, layout, empties)
    elif (fs.location.tag_dir / offload.SWAP_DIR).is_dir():
        rec.notes.append(f"NVMe offload was configured, but no sub-group was swapped ({offload.SWAP_DIR}/ holds "
                         f"{len(offload.swap_paths(fs.location.tag_dir))} files): every tensor is in the .pt files")
    trainable = autoep_trainable or {name: (tuple(shape), k) for k, group in enumerate(sub_groups)
                                     for name, shape in group.items()}
    frozen_shapes = {nm: tuple(s) for nm, s in (model.get("frozen_param_shapes") or {}).items()}
    # every rank's model file holds its chunk of each frozen parameter; ties are those rank 0 records. Each
    # file is opened (and so checked); its object tree is only looked at when there are frozen parameters
    by_rank: dict[int, dict] = {}
    file_of = {f.dp_rank: f for f in model_files if f.dp_rank is not None}
    for f in model_files:
        tf = fs.get(f)
        if frozen_shapes and tf is not None and f.dp_rank is not None and isinstance(tf.obj, dict):
            by_rank[f.dp_rank] = tf.obj.get("frozen_param_fragments") or {}
    shared = model.get("shared_params")
    rec.index.frozen = {}
    for name in frozen_shapes:
        chunks = [by_rank.get(r, {}).get(name) for r in range(n)]
        if all(isinstance(c, TensorHandle) for c in chunks):
            rec.index.frozen[name] = chunks
        else:
            lacking = [r for r, c in enumerate(chunks) if not isinstance(c, TensorHandle)]
            files = [file_of[r].relpath if r in file_of else f"(no model-states file of rank {r})" for r in lacking]
            rec.problems.append(f"frozen parameter {name}: its chunk is missing from {', '.join(files[:4])}"
                                + (f" and {len(files) - 4} more" if len(files) > 4 else ""))
    if autoep_trainable is not None:
        shared = dict(shared or {}, **autoep.router_aliases(autoep.layers_of(model), rec.index.module,
                                                             rec.index.alias_proofs))
    check_state_keys(rec)
    collect_parameters(rec, model, trainable, frozen_shapes, shared or {})


def _swapped_partitions(rec: Records, fs: OpenedFiles, model: dict, layout: Zero3Layout, empties: dict) -> None:
    """Find the swap files of the sub-groups saved as empty placeholders (NVMe offload, see
    :mod:`ckptlib.deepspeed.offload`) and index them (``rec.index.swapped``), or add the problems."""
    where = fs.location.tag_dir
    if not (where / offload.SWAP_DIR).is_dir():
        rec.problems.append(f"{len(empties)} rank(s) saved empty fp32 partitions (NVMe offload), but the tag folder "
                            f"has no {offload.SWAP_DIR}/ folder: the swapped optimizer state was not copied")
        return
    if (rec.mp_world_size or 1) > 1:
        sentence = ("NVMe-offloaded optimizer state with model parallelism: its swap folders are named by global "
                    "rank, which ckptlib does not map to the ZeRO sets yet")
        rec.problems.append(sentence)
        rec.unsupported.append(sentence)
        return
    states: dict[int, dict] = {}
    osds = {rank.dp: osd for rank, osd in rec.index.optim.items()}
    for r, subs in empties.items():
        inner = osds[r].get("optimizer_state_dict") or {}
        for k in subs:
            saved = (inner.get("state") or {}).get(k) or {}
            states.setdefault(r, {})[k] = {key: v for key, v in saved.items()
                                           if isinstance(v, TensorHandle) and v.numel == 0 and key != "step"}
    found = offload.resolve(where, layout, model, empties, states, rec.ds_config, rec.problems)
    rec.index.swapped = found.tensors
    if found.tensors:
        ranks = sorted({dp for dp, _ in found.tensors})
        rec.notes.append(f"NVMe offload: {len(found.tensors)} partition(s) of {len(ranks)} rank(s) are read from "
                         f"{offload.SWAP_DIR}/ (DeepSpeed's parameter ids start at {found.offset}); " + offload.WHY)


# ============================================================================================ shared
def collect_parameters(rec: Records, model: dict, trainable: dict, frozen_shapes: dict, shared: dict) -> None:
    """``rec.parameters`` in the module's order: trainable, frozen, and tied aliases (``shared``: alias ->
    owner); frozen parameters only the 16-bit module holds get their module tensor as source."""
    module = rec.index.module
    buffers = set(model.get("buffer_names") or [])
    params: list[ParameterInfo] = []
    names = [n for n in module if n not in buffers] if module else []
    names += [n for n in list(trainable) + list(frozen_shapes) if n not in names]
    for name in names:
        if name in shared and shared[name] != name:
            params.append(ParameterInfo(name=name, shape=(), trainable=False, tied_to=shared[name]))
            continue
        t = module.get(name)
        stored = t.dtype_name if isinstance(t, TensorHandle) else None
        if name in trainable:
            shape, g = trainable[name]
            params.append(ParameterInfo(name=name, shape=shape, trainable=True, group=g, stored_dtype=stored))
        elif name in frozen_shapes:
            params.append(ParameterInfo(name=name, shape=frozen_shapes[name], trainable=False, stored_dtype=stored))
        elif isinstance(t, TensorHandle):
            # a frozen parameter that only the 16-bit module weights hold (ZeRO-1, stage 0)
            if rec.zero_stage == 3:
                rec.problems.append(f"parameter {name} is in the module but neither trainable nor frozen "
                                    "data for it was saved")
                continue
            params.append(ParameterInfo(name=name, shape=tuple(t.shape), trainable=False, stored_dtype=stored))
            rec.index.frozen[name] = [t]
    by_name = {p.name: p for p in params}
    for p in list(params):
        if p.tied_to is not None:
            owner = by_name.get(p.tied_to)
            if owner is None and not frozen_shapes and p.tied_to not in trainable:
                # a frozen weight and its alias, the save leaving frozen parameters out (exclude_frozen_parameters:
                # the HF Trainer's save of a peft model with GPT-2's tied embeddings): neither is in the checkpoint
                params.remove(p)
                rec.notes.append(f"tied parameter {p.name} shares {p.tied_to}, a frozen parameter the save left out "
                                 "(exclude_frozen_parameters): neither is in the checkpoint")
            elif owner is None:
                rec.problems.append(f"tied parameter {p.name} refers to {p.tied_to}, which is not saved")
            else:
                p.shape, p.trainable, p.stored_dtype = owner.shape, owner.trainable, owner.stored_dtype
    rec.parameters = params


def check_rank_files(rec: Records, files: list[FileInfo], n: Optional[int], what: str) -> None:
    ranks = sorted(f.dp_rank for f in files if f.dp_rank is not None)
    if n is None:
        return
    missing = sorted(set(range(n)) - set(ranks))
    extra = sorted(r for r in set(ranks) if r >= n)
    if missing:
        names = ", ".join(_rank_file_name(files, r) for r in missing)
        rec.problems.append(f"missing {names} ({what} file{'s' if len(missing) > 1 else ''} of dp rank(s) "
                            f"{', '.join(map(str, missing))}; the checkpoint was saved by {n} ranks): a rank did not "
                            "finish saving, or the file was not copied")
    if extra:
        names = ", ".join(f.path.name for f in sorted(files, key=lambda f: f.dp_rank or 0)
                          if f.dp_rank is not None and f.dp_rank >= n)
        rec.problems.append(f"extra {names} ({what} file{'s' if len(extra) > 1 else ''} of dp rank(s) "
                            f"{', '.join(map(str, extra))}): the checkpoint has {n} partitions; probably left over "
                            "from another run: move it out of the tag folder")
    if rec.dp_world_size is not None and rec.dp_world_size != n:
        rec.problems.append(f"partition_count {n} differs from the model file's dp_world_size {rec.dp_world_size}")


def _who(files: list[FileInfo], rank: int) -> str:
    """``"global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt (dp rank 1)"``: the file of ``rank`` as the user
    sees it, for messages (``rank 1`` when there is no such file)."""
    f = next((f for f in files if f.dp_rank == rank), None)
    return f"{f.relpath} (dp rank {rank})" if f is not None else f"rank {rank}"


def _rank_file_name(files: list[FileInfo], rank: int) -> str:
    """The name the file of dp rank ``rank`` would have, like the other files of its kind."""
    like = next((f for f in files if f.dp_rank is not None), None)
    if like is None:
        return f"the file of dp rank {rank}"
    mp = like.mp_rank or 0
    if like.kind == "optim_states":
        return fnames.optim_states_name(rank, mp, like.prefix)
    return fnames.model_states_name(mp, rank)


def shapes_from_mappings(rec: Records) -> Optional[list[dict]]:
    """``param_shapes`` rebuilt from the ranks' ``param_slice_mappings`` (names in flat order) and the
    module's shapes, for checkpoints that record no ``param_shapes`` (BF16_Optimizer at ZeRO-0)."""
    optim = rec.index.optim
    if not optim or not all(osd.get("param_slice_mappings") for osd in optim.values()):
        return None
    groups: list[dict] = []
    for rank in sorted(optim):
        for g, mapping in enumerate(optim[rank]["param_slice_mappings"]):
            while len(groups) <= g:
                groups.append({})
            for name, _ in sorted(mapping.items(), key=lambda kv: kv[1].start):
                t = rec.index.module.get(name)
                if name not in groups[g] and isinstance(t, TensorHandle):
                    groups[g][name] = tuple(t.shape)
    return groups or None


def _param_shape_groups(ps: Any) -> Optional[list[dict]]:
    if ps is None:
        return None
    if isinstance(ps, dict):  # DeepSpeed < 0.5.4: a single OrderedDict
        return [dict(ps)]
    return [dict(g) for g in ps]


def aliases_by_storage(module: dict, buffers: set) -> dict[str, str]:
    """Parameters sharing storage, offset, shape and stride with an earlier one (ties without a record)."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, t in module.items():
        if not isinstance(t, TensorHandle) or name in buffers:
            continue
        key = (t.path, t.storage.key, t.storage_offset, tuple(t.shape), tuple(t.stride))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


__all__ = ["build_zero12", "build_zero3", "collect_parameters", "check_rank_files", "check_state_keys",
           "aliases_by_storage"]
