"""Readable sets of named tensors: what ``ckpt diff`` compares, whatever each side is.

A :class:`TensorSet` is a name -> :class:`NamedTensor` (dtype, shape, and the byte ranges of the
flattened value, :mod:`ckptlib.layout.ranges`) map, found from metadata alone. :func:`open_tensor_set` makes
one from any of:

- a DeepSpeed checkpoint ckptlib reads (any stage, world size or layout; save dir, tag folder, HF
  ``checkpoint-N``): every name of the module's ``state_dict`` (trainable parameters as their fp32
  masters, frozen ones as stored, tied aliases under both names, buffers), through
  :meth:`Checkpoint.sources`;
- an exported folder (``model.safetensors``, ``model-0000k-of-0000n.safetensors`` with its index,
  ``pytorch_model*.bin``), or one such file;
- a torch.distributed.checkpoint (DCP) folder (FSDP2, torchtitan, Accelerate, ``ckpt export --format dcp``;
  :mod:`ckptlib.dcp`), in any of torch 2.13's storages (a folder ``HuggingFaceStorageWriter`` wrote is one: its
  safetensors files carry DCP's sharding info; one ``save_pretrained`` wrote is an export): the model's tensors
  under their FQNs, the optimizer's per-parameter states;
- a universal checkpoint (a folder holding ``latest_universal``, or its ``<tag>_universal`` folder):
  ``zero/<param>/fp32.pt``, buffers and tied aliases from the model-states file copied beside it (a
  pipeline's buffers from the layer files copied beside it).

With ``states``, optimizer states join under ``<key>/<name>`` (e.g. ``exp_avg/fc1.weight``): the
checkpoint's per-element states of trainable parameters, an export's ``<key>/`` sub-folders, a universal
checkpoint's ``zero/<param>/<key>.pt``. Nothing here reads tensor data; the set is plain data.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..dcp import is_dcp, open_dcp
from ..deepspeed import Checkpoint, open_checkpoint
from ..deepspeed.discovery import detect
from ..dtypes import Shaped, decode_scalar, itemsize
from ..errors import CkptError, IncompleteCheckpointError, NotACheckpointError
from ..io.sources import stamp
from ..io.stformat import read_header
from ..io.torchzip import TensorHandle, open_torch_file
from ..layout.ranges import StoredRange

CHECKPOINT, EXPORT, UNIVERSAL, DCP = "checkpoint", "export", "universal", "dcp"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors")  # the last: peft's


@dataclass(frozen=True)
class NamedTensor(Shaped):
    """One tensor of a set: ``key`` (the parameter or buffer name, or ``<state>/<name>`` for an optimizer
    state), stored ``dtype``, ``shape`` and the byte ranges of its flattened value."""

    key: str
    dtype: str
    shape: tuple
    ranges: tuple = field(repr=False)
    state: Optional[str] = None
    alias_of: Optional[str] = None  # a tied alias: the parameter whose values it shares

    @property
    def name(self) -> str:
        """The parameter or buffer name (the key without the state)."""
        return self.key[len(self.state) + 1:] if self.state else self.key


@dataclass
class TensorSet:
    """A readable set of named tensors (plain data): ``kind`` (``checkpoint``, ``export``, ``universal``),
    where it is, the tensors in order, a ``(path, size, mtime_ns)`` stamp of every file read and, opened
    with the optimizer states, the ``steps`` it records per parameter."""

    kind: str
    path: str
    label: str
    tensors: dict
    stamps: tuple = ()
    notes: list = field(default_factory=list)
    #: with states: each trainable parameter's optimizer step, by name (None: the set records no step)
    steps: Optional[dict] = None
    #: a checkpoint's states whose torch optimizer keeps them under another key: ``{"<key>/<name>": torch's key}``
    #: (DeepSpeed's CPU Adagrad ``exp_avg_sq`` is torch Adagrad's ``sum``); a DCP folder holds torch's names
    torch_keys: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __repr__(self) -> str:
        return f"TensorSet({self.kind}, {self.label!r}, {len(self.tensors)} tensors)"


def _add(tensors: dict, t: NamedTensor, where: str) -> None:
    if t.key in tensors:
        raise CkptError(f"tensor {t.key} is stored twice", path=where, hint="a folder should hold one set of weights")
    tensors[t.key] = t


# ============================================================================================ checkpoint
def checkpoint_tensors(ck: Checkpoint, states: bool = False, notes: Optional[list] = None) -> dict:
    """The tensors of an opened checkpoint (metadata only), in ``state_dict`` order, then the states."""
    ck.check_readable()
    params = {p.name: p for p in ck.parameters}
    buffers = {b.name for b in ck.buffers}
    out: dict = {}
    skipped = []
    for name in ck.state_dict_names():
        if name in buffers:  # a pipeline's buffers live in their stage's files: the model's record, not main's
            b = ck.buffer(name)
            out[name] = NamedTensor(name, b.dtype, tuple(b.shape), tuple(ck.sources(name)))
            continue
        p = params[name]
        owner = params[p.tied_to] if p.tied_to else p
        try:
            ranges = tuple(ck.sources(owner.name))
        except IncompleteCheckpointError:  # a frozen parameter saved with exclude_frozen_parameters
            skipped.append(name)
            continue
        dtype = ranges[0].dtype if ranges else "float32"
        out[name] = NamedTensor(name, dtype, tuple(owner.shape), ranges, alias_of=p.tied_to)
    if skipped and notes is not None:
        notes.append(f"no data saved for {', '.join(skipped)} (exclude_frozen_parameters): left out")
    if states and ck.optimizer:
        for key in ck.optimizer.state_keys:
            for p in ck.parameters:
                if p.trainable and not p.tied_to and key in ck.state_keys(p.name):
                    ranges = tuple(ck.sources(p.name, key))
                    out[f"{key}/{p.name}"] = NamedTensor(f"{key}/{p.name}", ranges[0].dtype if ranges else "float32",
                                                         tuple(p.shape), ranges, key)
    return out


def _torch_keys(ck: Checkpoint, tensors: dict) -> dict:
    """``{"<key>/<name>": torch's key}`` of the states in ``tensors`` that torch's optimizer of their group's family
    names otherwise (:meth:`~ckptlib.kinds.optimizers.Family.torch_key`)."""
    out = {}
    for k, t in tensors.items():
        if t.state:
            gs = ck.state_group(t.name)
            theirs = gs.family.torch_key(t.state) if gs is not None else t.state
            if theirs != t.state:
                out[k] = theirs
    return out


def checkpoint_steps(ck: Checkpoint) -> Optional[dict]:
    """``{parameter: step}`` of each trainable parameter whose optimizer group counts steps (None: no optimizer)."""
    if not ck.optimizer:
        return None
    out = {}
    for p in ck.parameters:
        if p.trainable and not p.tied_to:
            step = ck.step_of(p.name)
            if step is not None:
                out[p.name] = step
    return out


def _scalar(ranges) -> Optional[float]:
    """The value of a one-element tensor stored at ``ranges`` (reads its few bytes), or None."""
    stored = [r for r in ranges if hasattr(r, "path")]
    if len(stored) != 1 or stored[0].count != 1 or len(ranges) != 1:
        return None
    r = stored[0]
    with open(r.path, "rb") as f:
        f.seek(r.offset)
        raw = f.read(itemsize(r.dtype))
    try:
        return float(decode_scalar(raw, r.dtype))
    except (ValueError, struct.error):
        return None


# ============================================================================================ export
def weight_files(folder: Path) -> list[Path]:
    """The weight files of an exported folder: those its index names, else the single file, else the
    ``model-*-of-*`` shards (safetensors first, then torch)."""
    for stem in WEIGHT_FILES:
        index = folder / f"{stem}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map") or {}
            except ValueError as e:
                raise CkptError(f"the index is not JSON ({e})", path=index) from None
            names = sorted(set(weight_map.values()))
            missing = [n for n in names if not (folder / n).is_file()]
            if missing:
                raise IncompleteCheckpointError(f"the index names files that are not there: {', '.join(missing)}",
                                                path=index)
            return [folder / n for n in names]
        if (folder / stem).is_file():
            return [folder / stem]
    for pattern in ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin"):
        shards = sorted(folder.glob(pattern))
        if shards:
            return shards
    return []


def file_tensors(path: Path, state: Optional[str] = None) -> list[NamedTensor]:
    """The tensors of one safetensors or torch file, from its header or pickle (no tensor data); with
    ``state``, keyed ``<state>/<name>``."""
    prefix = f"{state}/" if state else ""
    if path.suffix == ".safetensors":
        try:
            _, infos = read_header(path)
        except (OSError, ValueError) as e:
            raise CkptError(f"not a readable safetensors file ({e})", path=path) from None
        return [NamedTensor(prefix + t.name, t.dtype, tuple(t.shape),
                            (StoredRange(os.fspath(path), t.offset, t.dtype, t.nbytes // itemsize(t.dtype)),)
                            if t.nbytes else (), state) for t in infos]
    with open_torch_file(path) as tf:
        obj = tf.obj
    if not isinstance(obj, dict):
        raise CkptError("this torch file does not hold a state dict (a dict of tensors)", path=path)
    return [NamedTensor(prefix + str(k), h.dtype_name, tuple(h.shape), tuple(h.ranges()), state)
            for k, h in obj.items() if isinstance(h, TensorHandle)]


def export_tensors(folder: Path, states: bool = False, steps: Optional[dict] = None) -> tuple[dict, list[Path]]:
    """The tensors of an export folder; with ``states`` its ``<key>/`` sub-folders too, and the step their
    safetensors metadata record put in ``steps`` by parameter name."""
    tensors: dict = {}
    files = weight_files(folder)
    for f in files:
        for t in file_tensors(f):
            _add(tensors, t, os.fspath(f))
    if states:
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            found = weight_files(sub)
            for f in found:
                step = _recorded_step(f)
                for t in file_tensors(f, state=sub.name):
                    _add(tensors, t, os.fspath(f))
                    if step is not None and steps is not None:
                        steps.setdefault(t.name, step)
            files += found
    return tensors, files


def _recorded_step(path: Path) -> Optional[float]:
    """The ``step`` an export's state file records in its safetensors metadata, or None."""
    if path.suffix != ".safetensors":
        return None
    try:
        meta, _ = read_header(path)
        return float(meta["step"]) if meta and "step" in meta else None
    except (OSError, ValueError, KeyError):
        return None


# ============================================================================================ DCP
def dcp_tensors(path: Path, states: bool = False, steps: Optional[dict] = None,
                notes: Optional[list] = None) -> tuple[dict, tuple, str]:
    """The tensors of a DCP checkpoint in any storage (torch.save items, safetensors data, HuggingFaceStorageWriter's
    files: metadata, each chunk's archive or safetensors header; overlapping pieces are compared): the model's
    under their FQNs, with ``states`` each per-element optimizer state as ``<key>/<name>``, and each parameter's
    step (not per element) put in ``steps``; what to know of how it was read added to ``notes``."""
    d = open_dcp(path)
    if notes is not None:
        notes += d.notes
    out: dict = {}
    for name, t in d.model.items():
        out[name] = NamedTensor(name, t.dtype, t.shape, tuple(d.sources(t)))
    if states:
        for (name, key), t in d.states.items():
            if t.shape == () and key == "step":
                value = _scalar(tuple(d.sources(t)))
                if value is not None and steps is not None:
                    steps[name] = value
                continue
            out[f"{key}/{name}"] = NamedTensor(f"{key}/{name}", t.dtype, t.shape, tuple(d.sources(t)), key)
    return out, d.stamps(), d.layout


# ============================================================================================ entry point
def open_tensor_set(source: Union[str, os.PathLike, Checkpoint, TensorSet], tag: Optional[str] = None,
                    states: bool = False, tp_rules: Union[str, os.PathLike, None] = None) -> TensorSet:
    """A readable set of named tensors at ``source`` (see the module docstring for what it may be).
    ``tp_rules``: how the shards of a tensor-parallel checkpoint saved without
    ``universal_checkpoint_info`` join (as for :func:`~ckptlib.deepspeed.open_checkpoint`).

    Raises:
        NotACheckpointError: nothing ckptlib reads is there. CkptError and its subclasses for files
            that are there but cannot be read.
    """
    if isinstance(source, TensorSet):
        return source
    notes: list = []
    if isinstance(source, Checkpoint):
        tensors = checkpoint_tensors(source, states, notes)
        kind = UNIVERSAL if source.universal is not None else CHECKPOINT
        return TensorSet(kind, os.fspath(source.location.tag_dir), f"{kind} checkpoint {source.location.tag_dir}"
                         if kind == UNIVERSAL else f"checkpoint {source.location.tag_dir}",
                         tensors, tuple(stamp(os.fspath(f.path)) for f in source.files), notes,
                         checkpoint_steps(source) if states else None, _torch_keys(source, tensors))
    steps: Optional[dict] = {} if states else None
    path = Path(source).expanduser()
    if not path.exists():
        raise NotACheckpointError("no such file or folder", path=path)
    path = path.resolve()
    if path.is_file() and path.suffix in (".safetensors", ".bin"):
        tensors = {t.key: t for t in file_tensors(path)}
        return TensorSet(EXPORT, os.fspath(path), f"weights file {path}", tensors, (stamp(os.fspath(path)),), notes)
    if is_dcp(path):
        tensors, stamps, layout = dcp_tensors(path, states, steps, notes)
        return TensorSet(DCP, os.fspath(path), f"DCP checkpoint ({layout} layout) {path}", tensors, stamps, notes,
                         steps or None)
    kind = detect(path).kind if path.is_dir() else "file"
    if kind == "folder" and weight_files(path):
        tensors, files = export_tensors(path, states, steps)
        return TensorSet(EXPORT, os.fspath(path), f"export {path}", tensors,
                         tuple(stamp(os.fspath(f)) for f in files), notes, steps or None)
    if path.is_dir() and kind != "folder" and weight_files(path):
        notes.append(f"{path} also holds exported weights; the DeepSpeed checkpoint is used")
    try:
        ck = open_checkpoint(path, tag=tag, tp_rules=tp_rules)
    except NotACheckpointError:
        raise NotACheckpointError(
            "nothing ckptlib reads here: no DeepSpeed checkpoint, no exported weights (model.safetensors, "
            "pytorch_model.bin, shards with an index), no universal checkpoint (latest_universal)", path=path,
            hint="point at a checkpoint (as for `ckpt inspect`), an export folder or a universal checkpoint") from None
    with ck:
        ts = open_tensor_set(ck, states=states)
    ts.notes[:0] = ck.notes + notes
    return ts


def output_file_tallies(plan, weight_files: list, out: Path) -> tuple[list[tuple[str, int, list]], dict]:
    """``(tallies, found)`` for the files a plan wrote at ``out``: every planned file (``plan.files`` and
    ``plan.finals``) there; each of ``weight_files`` holding exactly its planned tensors (names, dtypes, shapes);
    each of ``plan.index_files`` mapping every tensor to its shard. ``found``: ``{name: NamedTensor}`` of the
    weight files (headers only, no tensor data); empty where a planned file is missing (then the first tally
    alone)."""
    files = list(plan.files) + list(plan.finals)
    missing = [f.name for f in files if not (out / f.name).is_file()]
    tallies = [("every planned file is there", len(files), missing)]
    if missing:
        return tallies, {}
    found, bad_files = {}, []
    for f in weight_files:
        try:
            have = {t.key: t for t in file_tensors(out / f.name)}
        except (CkptError, ValueError) as e:
            bad_files.append(f"{f.name}: {e}")
            continue
        if {k: (t.dtype, tuple(t.shape)) for k, t in have.items()} != \
                {t.name: (t.dtype, tuple(t.shape)) for t in f.tensors}:
            bad_files.append(f.name)
        found.update(have)
    tallies.append(("each file holds exactly the planned tensors (names, dtypes, shapes)", len(weight_files),
                    bad_files))
    for index, names in plan.index_files.items():
        weight_map = json.loads((out / index).read_text()).get("weight_map", {})
        want = {t.name: Path(f.name).name for f in weight_files if f.name in names for t in f.tensors}
        tallies.append((f"{index} maps every tensor to its shard", 1, [] if weight_map == want else [index]))
    return tallies, found


__all__ = ["NamedTensor", "TensorSet", "open_tensor_set", "checkpoint_tensors", "checkpoint_steps", "export_tensors",
           "dcp_tensors", "weight_files", "file_tensors", "output_file_tallies", "CHECKPOINT",
           "EXPORT", "UNIVERSAL", "DCP"]
