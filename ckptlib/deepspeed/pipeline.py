"""Pipeline-parallel checkpoints (DeepSpeed's ``PipelineModule``): which layers each stage holds, under
which names.

A pipeline checkpoint has one ZeRO set per stage (``mp_rank_{stage:02d}_model_states.pt`` with
``module: None``, and the stage's optimizer files) and one file per layer that has state
(``layer_{idx:02d}-model_states.pt``, the layer's own ``state_dict``, written by the stage that owns
it). The model's names are the ``PipelineModule``'s: ``{idx}.{key}`` for a layer's entries and
``tied_modules.{tie}.{key}`` for a tied layer (a ``TiedLayerSpec`` used on several stages, each of
which holds a copy under that name). :func:`stage_modules` gives each stage its ``module``: an ordered
``{name: tensor handle}`` as the stage's own ``state_dict`` would list it (tied modules first, then
its layers), from which the stage's ZeRO set is parsed like any other.

Which layers a stage holds: the names its ``param_shapes`` and ``buffer_names`` list (ZeRO-1); at
ZeRO-0 with BF16_Optimizer the names of its ``param_slice_mappings``; at ZeRO-0 otherwise no file
names a stage's parameters, so the stage's optimizer entries are matched to the layers by shape, in
order, from where the previous stage ended (tied layers first), as for any stage-0 checkpoint.
"""
from __future__ import annotations

import collections
import re
from typing import Optional

from ..errors import IncompleteCheckpointError
from ..io.torchzip import TensorHandle
from . import files as fnames
from .fileset import OpenedFiles
from .values import get

_LITERAL = re.compile(r"^\^?((?:[A-Za-z0-9_]|\\\.)+)\$?$")


def is_pipeline(fs: OpenedFiles) -> bool:
    return any(f.kind == fnames.LAYER_STATES for f in fs.files)


def layer_tp_ranks(fs: OpenedFiles) -> list[int]:
    """The tensor ranks the layer files are written for: ``[0]`` for ``layer_XX-model_states.pt``, the
    ``YY`` of ``layer_XX-model_YY-model_states.pt`` (a pipeline with a tensor axis)."""
    return sorted({f.mp_rank or 0 for f in fs.files if f.kind == fnames.LAYER_STATES} or {0})


def has_tensor_axis(fs: OpenedFiles) -> bool:
    """Whether the layer files name a tensor rank (``-model_YY``): the topology has a model axis."""
    return any(f.mp_rank is not None for f in fs.files if f.kind == fnames.LAYER_STATES)


def _layers(fs: OpenedFiles, tp: int = 0) -> list[tuple[int, dict, object]]:
    out = []
    for f in sorted((f for f in fs.files if f.kind == fnames.LAYER_STATES and (f.mp_rank or 0) == tp),
                    key=lambda f: f.layer):
        tf = fs.get(f)
        if tf is None:
            continue  # the file's problem is recorded; its layer is then missing below
        obj = tf.obj if isinstance(tf.obj, dict) else {}
        out.append((f.layer, {k: v for k, v in obj.items() if isinstance(v, TensorHandle)}, f))
    return out


def _literal(pattern: str) -> Optional[str]:
    """The one name a pattern like ``tied_modules\\.embed\\.weight$`` matches, or None for a real regex."""
    m = _LITERAL.match(pattern)
    return m.group(1).replace("\\.", ".") if m else None


def _stage_names(model: dict, optims: list) -> Optional[list[str]]:
    """The names a stage's files give for its parameters and buffers (None if they give none)."""
    names = []
    for group in model.get("param_shapes") or []:
        names += list(group)
    if not names:
        for osd in optims:
            for mapping in get(osd, "optimizer_state_dict", "param_slice_mappings") or []:
                names += [n for n in mapping if n not in names]
    if not names:
        return None
    return names + [b for b in model.get("buffer_names") or [] if b not in names]


def _tied_names(models: dict, patterns: tuple = ()) -> list[str]:
    """``tied_modules.*`` names: from ``param_shapes``, or the literal pipeline-replicated patterns (of the
    ``universal_checkpoint_info`` saved, or of the rules given: ``patterns``)."""
    out = []
    for model in models.values():
        for group in model.get("param_shapes") or []:
            out += [n for n in group if n.startswith("tied_modules.") and n not in out]
        info = model.get("universal_checkpoint_info") or {}
        for p in list(info.get("pipeline_replicated_parameter_patterns") or []) + list(patterns):
            name = _literal(p)
            if name and name.startswith("tied_modules.") and name not in out:
                out.append(name)
    return out


def stage_modules(fs: OpenedFiles, models: dict, optims: dict, problems: list, tp: int = 0,
                  tensor_axis: bool = False, tied_patterns: tuple = (), refusals: Optional[list] = None
                  ) -> tuple[dict, list[str]]:
    """``({stage: module}, notes)`` of tensor rank ``tp`` (its layer files; ``tensor_axis``: they are named
    ``layer_XX-model_YY``); ``models``: each stage's model-states object, ``optims``: each stage's
    optimizer-state objects; ``tied_patterns``: the pipeline-replicated patterns of the rules given. A layer
    that no stage claims, or a stage without its layers, is a problem; a ZeRO-0 stage whose optimizer holds
    a tied layer's weight that no file names goes to ``refusals`` (nothing is damaged: a name is missing)."""
    layers = _layers(fs, tp)
    where = f"tensor rank {tp}, " if tensor_axis else ""
    tied = _tied_names(models, tied_patterns)
    names_of = {s: _stage_names(models[s], optims.get(s, [])) for s in models}
    notes: list[str] = []
    # a tied layer's file holds the keys of one tie: the layer whose keys are a tie's keys (same shapes)
    # and whose own {idx}.{key} names no stage lists
    listed = {n for names in names_of.values() if names for n in names}
    tie_of: dict[int, str] = {}
    for idx, tensors, _ in layers:
        own = {f"{idx}.{k}" for k in tensors}
        if own & listed:
            continue
        for tie in {n.rsplit(".", 1)[0] for n in tied} - set(tie_of.values()):
            keys = {n[len(tie) + 1:] for n in tied if n.startswith(tie + ".")}
            if keys == set(tensors):
                tie_of[idx] = tie
                break
    entries = {idx: collections.OrderedDict((f"{tie_of[idx]}.{k}" if idx in tie_of else f"{idx}.{k}", h)
                                            for k, h in tensors.items())
               for idx, tensors, _ in layers}
    tied_entries = collections.OrderedDict((n, h) for idx in tie_of for n, h in entries[idx].items())
    modules: dict = {}
    start = 0
    for s in sorted(models):
        names = names_of[s]
        mod = collections.OrderedDict()
        if names is not None:
            for n in names:
                if n in tied_entries:
                    mod[n] = tied_entries[n]
            for idx, ent in entries.items():
                if idx not in tie_of and any(n in names for n in ent):
                    mod.update(ent)
        else:
            first = start
            mod, start, unmatched = _match_by_shapes(models[s], entries, tie_of, tied_entries, start)
            earlier = [idx for idx, ent in entries.items() if idx < first and idx not in tie_of
                       and any(tuple(h.shape) in unmatched for h in ent.values())]
            if unmatched and earlier and refusals is not None:
                why = (f"stage {s}: its optimizer holds tensors of "
                       f"shape {', '.join(str(list(x)) for x in unmatched[:3])} that match no layer of the stage but "
                       f"layer {earlier[0]}'s: a tied layer (TiedLayerSpec), whose key no file of a ZeRO-0 checkpoint "
                       "records")
                if why not in refusals:
                    refusals.append(why)
            note = ("no file names the parameters of a stage (ZeRO-0); its optimizer entries were matched to the "
                    "layer files by shape, in order")
            if note not in notes:
                notes.append(note)
        modules[s] = mod
        if names is not None:
            missing = [n for n in names if n not in mod and n not in (models[s].get("buffer_names") or [])]
            missing += [b for b in models[s].get("buffer_names") or [] if b not in mod]
            if missing:
                layer = _layer_of(missing[0])
                file = (fnames.layer_states_name(layer, tp if tensor_axis else None) if layer is not None
                        else "the tied layer's file")
                problems.append(f"stage {s}, {where}no layer file holds {', '.join(missing[:4])}"
                                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                                + f" ({file} is missing or damaged)")
    claimed = {n for mod in modules.values() for n in mod}
    for idx, _, info in layers:  # an empty one is a layer module without state (an activation), which has a file
        if entries[idx] and not set(entries[idx]) & claimed:
            problems.append(f"{info.relpath}: no stage of this checkpoint holds layer {idx} "
                            "(left over from another run?)")
    return modules, notes


def _layer_of(name: str) -> Optional[int]:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _match_by_shapes(model: dict, entries: dict, tie_of: dict, tied_entries: dict, start: int):
    """ZeRO-0: the stage's module from its optimizer's parameter shapes, matched in order."""
    opt = model.get("optimizer") if isinstance(model.get("optimizer"), dict) else {}
    inner = opt.get("optimizer_state_dict", opt)
    state = inner.get("state") or {}
    shapes = []
    for g in inner.get("param_groups") or []:
        for pid in g.get("params", []):
            t = next((v for k, v in (state.get(pid) or {}).items() if k != "step" and isinstance(v, TensorHandle)),
                     None)
            if t is None:
                raise IncompleteCheckpointError("a ZeRO-0 pipeline stage without optimizer state: its layers "
                                                "cannot be told apart", path=None)
            shapes.append(tuple(t.shape))
    candidates = list(tied_entries.items())
    buffers = set(model.get("buffer_names") or [])
    layer_of = {}
    for idx, ent in entries.items():
        if idx in tie_of or idx < start:
            continue
        for n, h in ent.items():
            if n not in buffers and n.split(".", 1)[0].isdigit():
                candidates.append((n, h))
                layer_of[n] = idx
    taken, end, unmatched = set(), start, []
    for shape in shapes:
        for n, h in candidates:
            if n not in taken and tuple(h.shape) == shape:
                taken.add(n)
                end = max(end, layer_of.get(n, -1) + 1)
                break
        else:
            unmatched.append(shape)
    mod = collections.OrderedDict((n, h) for n, h in tied_entries.items() if n in taken)
    for idx, ent in entries.items():
        if idx in tie_of or not (start <= idx < end):
            continue
        mod.update(ent)
    return mod, end, unmatched


__all__ = ["is_pipeline", "stage_modules", "layer_tp_ranks", "has_tensor_axis"]
