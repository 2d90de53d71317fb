"""What an export of consolidated weights writes: the plan (:class:`ExportPlan`), its shards, file names,
index files and exact file sizes. Shared by the planners of a DeepSpeed source (:mod:`.plan`) and of a
DCP source (:mod:`.from_dcp`). Pure data and arithmetic.
"""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from ..dtypes import BY_NAME, is_floating
from ..io.stformat import SafetensorsLayout, TensorSpec
from ..io.torchzip.specs import NewTensor
from ..io.torchzip.writer import file_size
from ..plan import PROCESSES, PlannedTensor, Plan, TextFile, WeightsFile
from ..units import human_bytes


@dataclass(kw_only=True, repr=False)  # Plan's repr and IPython display (its description), not every field
class ExportPlan(Plan):
    """Everything an export will do, computed from metadata (plain data; see :class:`ckptlib.plan.Plan`).

    Attributes:
        files: every output file (:class:`~ckptlib.plan.WeightsFile`) with its tensors (weights first, then
            one set per optimizer state).
        finals: the index files of sharded sets, and the model's ``config.json`` with the exported dtype.
        side_files: the Hugging Face files copied beside the weights (config, tokenizer, ...; names).
        format, dtype: output format (``"safetensors"``/``"torch"``) and weight dtype (``fp32``/``bf16``/``fp16``).
        index_files: ``{index file name: [file names]}`` for sharded sets.
        read_bytes / write_bytes: bytes read from the checkpoint / written to ``out``.
        predicted_peak_bytes: anonymous memory the export adds to a process (per worker), whatever the
            model size: the streaming buffers plus a fixed allowance.
    """

    action: ClassVar[str] = "export"
    format: str
    dtype: str
    max_shard_size: int
    exclude_frozen: bool = False
    states: tuple = ()
    index_files: dict = field(default_factory=dict)
    side_files: list = field(default_factory=list)
    parallel: str = PROCESSES

    @property
    def warnings(self) -> list:
        return self.notes

    @property
    def weights(self) -> list:
        """The weight (and optimizer-state) files, without the copied Hugging Face files."""
        return [f for f in self.files if isinstance(f, WeightsFile)]

    @property
    def tensors(self) -> list:
        return [t for f in self.weights for t in f.tensors]

    @property
    def largest_tensor_bytes(self) -> int:
        return max((t.nbytes for t in self.tensors), default=0)

    def to_dict(self) -> dict:
        return {
            "source": self.source.tag_dir, "out": str(self.out), "format": self.format, "dtype": self.dtype,
            "max_shard_size": self.max_shard_size, "exclude_frozen": self.exclude_frozen,
            "states": list(self.states), "workers": self.workers, "sync": self.sync,
            "files": [{"name": f.name, "bytes": f.size, "tensor_bytes": f.nbytes, "tensors": [t.name for t in f.tensors]}
                      for f in self.weights],
            "index_files": self.index_files, "side_files": list(self.side_files), "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
            "file_bytes": self.file_bytes, "largest_tensor_bytes": self.largest_tensor_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
            "warnings": list(self.notes),
        }

    def describe(self) -> str:
        src = self.source
        lines = [
            f"export {src.tag_dir}",
            f"    -> {self.out}  ({self.format}, {self.dtype}"
            + (f", shards up to {human_bytes(self.max_shard_size)}" if len(self.weights) > 1 else "") + ")",
            (f"ZeRO {src.zero_stage}, {src.dtype}, {src.dp_world_size} ranks" if src.flavor != "dcp" else
             "a DCP checkpoint") + f"; {len(self.tensors)} tensors "
            f"in {len(self.weights)} file{'s' if len(self.weights) != 1 else ''}",
            f"{self.reads_text()}; {self.writes_text()}",
            f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} per process "
            f"(largest tensor {human_bytes(self.largest_tensor_bytes)}; streamed in "
            f"{human_bytes(self.chunk_bytes)} chunks)",
        ] + self.summary_lines()[2:]
        width = max([len(f.name) for f in self.weights] + [44])
        for f in self.weights:
            lines.append(f"  {f.name:<{width}} {human_bytes(f.size):>10}  {len(f.tensors)} tensors")
        for idx in self.index_files:
            lines.append(f"  {idx}")
        if self.side_files:
            lines.append(f"  + {', '.join(self.side_files)}")
        lines += [f"note: {w}" for w in self.notes]
        return "\n".join(lines)


def shard_tensors(tensors: list, max_size: int) -> list[list]:
    """Group tensors into shards in order, like huggingface_hub: a tensor larger than the limit gets
    a shard of its own; otherwise a shard is closed when the next tensor would not fit."""
    shards, current, size = [], [], 0
    for t in tensors:
        if t.nbytes > max_size:
            shards.append([t])
            continue
        if current and size + t.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def file_names(fmt: str, n: int) -> tuple[list[str], Optional[str]]:
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if n == 1:
        return [f"{stem}.{ext}"], None
    return [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)], f"{stem}.{ext}.index.json"


def weights_file_size(f: WeightsFile) -> int:
    """The exact size of the file a run writes for ``f``: the safetensors header and data, or the torch
    zip with its pickle (computed, nothing written)."""
    if f.format == "safetensors":
        return SafetensorsLayout([TensorSpec(t.name, t.dtype, t.shape) for t in f.tensors], f.metadata).file_size
    tree = collections.OrderedDict((t.name, NewTensor(t.dtype, t.shape, t.ranges)) for t in f.tensors)
    return file_size(tree, f.name, archive=Path(f.name).name.split(".")[0])


def index_json(group: list[WeightsFile], key: Optional[str]) -> str:
    meta = {"total_size": sum(f.nbytes for f in group)}
    if key:
        meta["optimizer_state"] = key
    weight_map = {t.name: Path(f.name).name for f in group for t in f.tensors}
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"


def model_tensors(ck, out_dtype: str, exclude_frozen: bool = False, sources=None) -> list[PlannedTensor]:
    """The tensors of the model's state dict (a DeepSpeed :class:`~ckptlib.deepspeed.Checkpoint` ``ck``), in its
    order: each parameter (a tied one from its owner's ranges) as ``out_dtype``, each buffer as ``out_dtype``
    when it is floating point, else as stored; ``exclude_frozen`` leaves out the frozen parameters.
    ``sources(name)`` gives a tensor's ranges (default ``ck.sources``). Metadata only."""
    sources = sources or ck.sources
    params = {p.name: p for p in ck.parameters}
    buffers = {b.name: b for b in ck.buffers}
    out = []
    for name in ck.state_dict_names():
        if name in buffers:
            b = buffers[name]
            dt = out_dtype if is_floating(b.dtype) else b.dtype
            out.append(PlannedTensor(name, name, None, "buffer", tuple(b.shape), dt, tuple(sources(name))))
            continue
        p = params[name]
        owner = params[p.tied_to] if p.tied_to else p
        if exclude_frozen and not owner.trainable:
            continue
        kind = "tied" if p.tied_to else ("trainable" if p.trainable else "frozen")
        out.append(PlannedTensor(name, owner.name, None, kind, tuple(owner.shape), out_dtype,
                                 tuple(sources(owner.name))))
    return out


def masters_notes(masters: Optional[dict], dtype: str, why: str = "", states: Optional[dict] = None,
                  rounded_buffers=(), optimizer: bool = False) -> list[str]:
    """What an export writes of masters the optimizer keeps in 16 bits (DeepSpeed's ``bf16_master_weights_and_grads``;
    ``masters``: :func:`ckptlib.analysis.placement.masters`) at output ``dtype`` (``fp32``/``bf16``/``fp16``): the
    masters widened exactly, as stored, or converted. ``why``: the config key that says so (or ""); ``states``:
    ``{state key written: its stored dtype}``, each 16-bit one said to be widened to the fp32 it is written in;
    ``rounded_buffers``: floating buffers stored wider than ``dtype``, which ``dtype`` rounds; ``optimizer``: a DCP
    export's optimizer state, and the dtype torch's optimizer then holds it in. [] for fp32 masters."""
    stored = (masters or {}).get("dtype")
    if stored not in ("bfloat16", "float16"):
        return []
    short = BY_NAME[stored].short
    head = f"the optimizer keeps its masters in {short}{f' ({why})' if why else ''}: the weights written are "
    if dtype == "fp32":
        notes = [head + f"the {short} masters widened to fp32, exactly (--dtype {short} writes the same values in "
                        "half the bytes)"]
    elif dtype == short:
        notes = [head + "the masters as stored: nothing rounded"
                 + (f" (the floating buffer{'s' if len(rounded_buffers) > 1 else ''} {', '.join(rounded_buffers)}, "
                    f"stored in another dtype, {'are' if len(rounded_buffers) > 1 else 'is'} rounded to {dtype} as "
                    f"--dtype {dtype} asks)" if rounded_buffers else "")]
    else:
        notes = [head + f"the {short} masters converted to {dtype}, as torch's .to() converts them"
                 + (": exact for magnitudes from 2**-17 to 65504, possibly rounded below, inf above" if dtype == "fp16" else "")
                 + f"; --dtype {short} writes them as stored"]
    half = [k for k, dt in (states or {}).items() if dt in ("bfloat16", "float16")]
    if half:
        names = ", ".join(half)
        notes.append(f"the optimizer states {names} are stored in {short} and written in fp32 (as every state"
                     + (" of a DCP export" if optimizer else " of an export") + "), widened exactly"
                     + ("; torch's optimizer holds its state in its parameters' dtype (Optimizer.load_state_dict "
                        f"casts floating state to it): fp32 parameters keep the widened values, {short} parameters "
                        f"(--dtype {short}) get back the {short} values stored, exactly" if optimizer else ""))
    return notes


def weights_files(sets: list, format: str, limit: int, step: Optional[int] = None) -> tuple[list, list, dict]:
    """The files of an export: for each ``(prefix, tensors)`` of ``sets`` (the weights under ``""``, then an
    optimizer state's tensors under its ``key/``), its shards of at most ``limit`` bytes as
    :class:`~ckptlib.plan.WeightsFile` s with their exact sizes, and an index file when there are several.
    Safetensors metadata records the format, the optimizer state and (with one) its ``step``. Returns
    ``(files, index files as TextFile s, {index file name: [file names]})``."""
    files, finals, index_files = [], [], {}
    for prefix, tensors in sets:
        shards = shard_tensors(tensors, limit)
        names, index = file_names(format, max(len(shards), 1))
        key = tensors[0].key if tensors else None
        meta = {"format": "pt", **({"optimizer_state": key} if key else {})}
        if key and step is not None:
            meta["step"] = str(step)
        group = [WeightsFile(prefix + name, format, shard, dict(meta) if format == "safetensors" else {},
                             kind="state" if key else "weights") for name, shard in zip(names, shards or [[]])]
        for f in group:
            f.size = weights_file_size(f)
        files += group
        if index:
            index_files[prefix + index] = [f.name for f in group]
            finals.append(TextFile(prefix + index, index_json(group, key), kind="index"))
    return files, finals, index_files


__all__ = ["ExportPlan", "shard_tensors", "file_names", "index_json", "weights_file_size", "model_tensors",
           "weights_files", "masters_notes"]
