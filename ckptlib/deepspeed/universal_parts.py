"""Reading the parts of a universal checkpoint folder (:mod:`ckptlib.deepspeed.universal`): its ``zero/`` files (experts
stacked per local id unstacked), the steps, a ZeRO-3 source's frozen fragments and a pipeline's layer buffers.
Metadata only (a step's few bytes)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from ..io.torchzip import TensorHandle
from . import files as fnames
from .files import FRAGMENT
from .fileset import OpenedFiles
from .records import FileInfo, ParameterInfo

MASTER, STEP = "fp32", "step"                 # the file stems of the master and the step
IS_EXPERT_PARAM, EP_NUM_EXPERTS = "is_expert_param", "ep_num_experts"
EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")

@dataclass
class Fragment:
    """One ``zero/<parameter>/<key>.pt``: its tensor (``handle``; a ZeRO-3 folder by ds_to_universal holds it flat),
    or for an expert file stacking ``ep`` experts, the element range of one of them."""

    info: FileInfo
    handle: TensorHandle
    start: int = 0
    count: Optional[int] = None

    @property
    def numel(self) -> int:
        return self.handle.numel if self.count is None else self.count

    def ranges(self) -> list:
        return self.handle.ranges(self.start, self.numel)



def obj_of(fs: OpenedFiles, f: FileInfo) -> Any:
    tf = fs.get(f)
    return None if tf is None else tf.obj



def _scalar(v: Any) -> Optional[float]:
    if isinstance(v, TensorHandle):
        return float(v.item()) if v.numel == 1 else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)



def param_groups(osd: dict, zero3: bool) -> list:
    groups = osd.get("param_groups") if isinstance(osd, dict) else None
    if not groups and zero3 and isinstance(osd.get("optimizer_state_dict"), dict):
        groups = osd["optimizer_state_dict"].get("param_groups")
    return [g for g in groups or [] if isinstance(g, dict)]



def _unstack(local: str, frag: Fragment, ep: Any, model: dict) -> Optional[list]:
    """``[(global name, Fragment)]`` of an expert file stacking the experts of ``ep`` expert-parallel ranks
    (``is_expert_param`` / ``ep_num_experts``): entry ``e`` is global expert ``e * L + i`` (``L`` = experts per
    layer / ``ep``, ``i`` the local id); None when the file's shape and the model's ``num_experts`` disagree."""
    counts = set(model.get("num_experts") or [])
    m = EXPERT.search(local)
    h = frag.handle
    if m is None or len(counts) != 1 or not isinstance(ep, int) or ep < 1 or next(iter(counts)) % ep or \
            not h.shape or h.shape[0] != ep:
        return None
    per, n = next(iter(counts)) // ep, h.numel // ep
    return [(EXPERT.sub(lambda x: f"{x.group(1)}{e * per + int(x.group(2))}{x.group(3)}", local, count=1),
             Fragment(frag.info, h, e * n, n)) for e in range(ep)]



def fragments(fs: OpenedFiles, model: dict, problems: list) -> tuple[dict, dict, dict, set]:
    """``({name: {key: Fragment}}, {name: shape of the master file}, {global expert name: its local folder}, {AutoEP
    expert tensors held whole})`` of every ``zero/<name>/<key>.pt``: DeepSpeed-MoE's expert folders (``...
    deepspeed_experts.<i>...``) stack one expert of each expert-parallel rank, AutoEP's hold all the experts of a
    layer ([experts, ...]) under the name the engine trains."""
    out: dict = {}
    shapes: dict = {}
    locals_of: dict = {}
    whole_experts: set = set()
    for f in fs.files:
        if f.kind != FRAGMENT:
            continue
        folder, key = f.path.parent.name, f.path.stem
        obj = obj_of(fs, f)
        if obj is None:
            continue  # the problem is recorded by OpenedFiles
        if key == STEP:
            out.setdefault(folder, {})[STEP] = obj.get("param") if isinstance(obj, dict) else obj
            continue
        h = obj.get("param") if isinstance(obj, dict) else obj
        if not isinstance(h, TensorHandle):
            problems.append(f"{f.relpath}: holds no tensor")
            continue
        frag = Fragment(f, h)
        state = None if key == MASTER else key
        if isinstance(obj, dict) and obj.get(IS_EXPERT_PARAM) and not EXPERT.search(folder):
            whole_experts.add(folder)  # AutoEP: the [experts, ...] tensor of every expert, under the engine's name
        elif isinstance(obj, dict) and obj.get(IS_EXPERT_PARAM):
            parts = _unstack(folder, frag, obj.get(EP_NUM_EXPERTS), model)
            if parts is None:
                problems.append(f"{f.relpath}: an expert file stacking {obj.get(EP_NUM_EXPERTS)!r} experts that the "
                                f"model's num_experts ({model.get('num_experts')}) and its shape {tuple(h.shape)} do "
                                "not explain")
                continue
            for name, part in parts:
                out.setdefault(name, {})[state] = part
                locals_of[name] = folder
                if state is None:
                    shapes[name] = tuple(h.shape[1:])
            continue
        out.setdefault(folder, {})[state] = frag
        if state is None:
            shapes[folder] = tuple(h.shape)
    for name, folder in locals_of.items():  # an expert folder's one step is the step of each expert it stacks
        step = out.get(folder, {}).get(STEP)
        if step is not None:
            out.setdefault(name, {}).setdefault(STEP, step)
    return out, shapes, locals_of, whole_experts



def zero3_frozen(fs: OpenedFiles, models: list, p: ParameterInfo) -> Optional[tuple[list, list]]:
    """``(ranges, chunks)`` of a frozen parameter of a ZeRO-3 source from the ``frozen_param_fragments`` of every
    copied rank file (each rank holds ``ceil(numel / N)`` elements, the last padded), or None where they do not hold
    it all."""
    out, chunks, pos = [], [], 0
    for f in sorted((f for f in models if (f.mp_rank or 0) == 0), key=lambda f: f.dp_rank or 0):
        obj = obj_of(fs, f)
        h = ((obj or {}).get("frozen_param_fragments") or {}).get(p.name) if isinstance(obj, dict) else None
        if not isinstance(h, TensorHandle):
            return None
        chunks.append(h)
        n = min(h.numel, p.numel - pos)
        if n > 0:
            out += h.ranges(0, n)
            pos += n
    if pos != p.numel:
        return None
    p.stored_dtype = out[0].dtype if out else None
    return out, chunks


def layer_buffer(fs: OpenedFiles, name: str, proofs: list) -> Optional[TensorHandle]:
    """A pipeline buffer ``{idx}.{key}`` in a copied layer file ``layer_{idx:02d}[-model_00]-model_states.pt``, or
    None; the other tensor ranks' copies of it go to ``proofs`` (``(what, ranges, ranges, dtype)``), compared with
    it before anything is written."""
    idx, _, key = str(name).partition(".")
    if not idx.isdigit():
        return None
    found: dict = {}
    for f in fs.files:
        if f.kind == fnames.LAYER_STATES and f.layer == int(idx):
            obj = obj_of(fs, f)
            h = obj.get(key) if isinstance(obj, dict) else None
            if isinstance(h, TensorHandle):
                found[f.mp_rank or 0] = (f, h)
    if 0 not in found:
        return None
    first = found[0][1]
    for mp, (f, h) in sorted(found.items()):
        if mp and h.numel == first.numel and h.dtype_name == first.dtype_name:
            proofs.append((f"buffer {name} in {f.path.name} (tensor rank {mp}'s copy)", first.ranges(), h.ranges(),
                           first.dtype_name))
        elif mp:
            proofs.append((f"buffer {name} in {f.path.name}: {h.numel} {h.dtype_name} elements, tensor rank 0's "
                           f"{first.numel} {first.dtype_name}", first.ranges(), [], first.dtype_name))
    return first


def layer_keys(fs: OpenedFiles) -> dict:
    """``{layer: [its keys, in file order]}`` of the layer files copied into the folder (ckptlib's universal folders
    copy them; ds_to_universal's do not), tensor rank 0's."""
    out = {}
    for f in fs.files:
        if f.kind == fnames.LAYER_STATES and f.layer is not None and (f.mp_rank or 0) == 0:
            obj = obj_of(fs, f)
            if isinstance(obj, dict):
                out[f.layer] = [str(k) for k in obj]
    return dict(sorted(out.items()))


def steps(osd: dict, fragments: dict, trainable: list, sub_groups: dict, problems: list, objects: dict) -> dict:
    """Each trainable parameter's step: its ``step.pt``; a ZeRO-3 folder without them (ds_to_universal's): the step
    of its sub-group (``sub_groups``: parameter -> the index of its ``param_shapes`` entry) in
    ``optimizer_state.pt`` (rank 0's sub-groups; every rank has the same ones)."""
    out = {}
    for p in trainable:
        v = fragments.get(p.name, {}).get(STEP)
        if v is None:
            continue
        value = _scalar(v)
        if value is None:
            problems.append(f"zero/{p.name}/step.pt holds no number")
            continue
        out[p.name], objects[p.name] = value, v
    if out or not sub_groups:
        return out
    inner = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
    state = inner.get("state") if isinstance(inner.get("state"), dict) else {}
    for p in trainable:
        entry = state.get(sub_groups.get(p.name))
        raw = entry.get(STEP) if isinstance(entry, dict) else None
        value = _scalar(raw)
        if value is not None:
            out[p.name], objects[p.name] = value, raw
    return out


__all__ = ["Fragment", "MASTER", "STEP", "EXPERT", "fragments", "steps", "zero3_frozen", "layer_buffer", "layer_keys", "obj_of",
           "param_groups"]
