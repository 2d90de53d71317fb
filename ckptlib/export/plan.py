"""Planning an export from metadata alone: which files, which tensors in each, where their bytes are.

:func:`plan_export` reads nothing beyond what opening the checkpoint read. The plan is plain data the
notebook shows before the user runs it; :func:`ckptlib.run` executes it.
"""
from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional, Sequence, Union

from ..dcp import is_dcp
from ..deepspeed import Checkpoint, hf, open_checkpoint
from ..dtypes import BY_SHORT, OUTPUT_DTYPES, is_floating
from ..errors import CkptError
from ..io.stformat import SafetensorsLayout, TensorSpec
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..io.torchzip.specs import NewTensor
from ..io.torchzip.writer import file_size
from ..plan import PROCESSES, CopyFile, Plan, PlannedTensor, RangeCheck, TextFile, WeightsFile
from ..system.gcpause import gc_paused
from ..units import human_bytes, parse_size

FORMATS = ("safetensors", "torch", "dcp")


@dataclass(kw_only=True)
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


def _shard(tensors: list, max_size: int) -> list[list]:
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


def _file_names(fmt: str, n: int) -> tuple[list[str], Optional[str]]:
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    if n == 1:
        return [f"{stem}.{ext}"], None
    return [f"{stem}-{i:05d}-of-{n:05d}.{ext}" for i in range(1, n + 1)], f"{stem}.{ext}.index.json"


def _weights(ck: Checkpoint, out_dtype: str, exclude_frozen: bool) -> list[PlannedTensor]:
    params = {p.name: p for p in ck.parameters}
    buffers = {b.name: b for b in ck.buffers}
    out = []
    for name in ck.state_dict_names():
        if name in buffers:
            b = buffers[name]
            dt = out_dtype if is_floating(b.dtype) else b.dtype
            out.append(PlannedTensor(name, name, None, "buffer", tuple(b.shape), dt, tuple(ck.sources(name))))
            continue
        p = params[name]
        owner = params[p.tied_to] if p.tied_to else p
        if exclude_frozen and not owner.trainable:
            continue
        kind = "tied" if p.tied_to else ("trainable" if p.trainable else "frozen")
        out.append(PlannedTensor(name, owner.name, None, kind, tuple(owner.shape), out_dtype,
                                 tuple(ck.sources(owner.name))))
    return out


@gc_paused
def plan_export(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike], *,
                tag: Optional[str] = None, format: str = "safetensors", dtype: str = "fp32",
                max_shard_size: Union[int, str] = "5GB", exclude_frozen: bool = False,
                states: Sequence[str] = (), workers: int = 1, overwrite: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, tp_rules=None, hf_files: bool = True,
                sync: bool = True, dcp: Optional[dict] = None) -> ExportPlan:
    """Plan the export of consolidated weights (and optionally optimizer states); reads no tensor data.

    Args:
        checkpoint: an opened :class:`Checkpoint` or a path for :func:`open_checkpoint`.
        out: the output folder (must be empty or absent unless ``overwrite``).
        tag: tag to export when ``checkpoint`` is a path.
        format: ``"safetensors"`` (default) or ``"torch"`` (``pytorch_model*.bin``).
        dtype: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` for parameters and floating buffers;
            integer and bool buffers keep their dtype.
        max_shard_size: shard limit, e.g. ``"5GB"`` (decimal units) or bytes.
        exclude_frozen: leave out frozen parameters (and aliases of them).
        states: optimizer state keys to export too, e.g. ``("exp_avg", "exp_avg_sq")``; each goes
            to its own sub-folder ``out/<key>/`` in the same layout (fp32, trainable parameters).
        workers: processes to write with (each receives the pickled plan).
        chunk_bytes: streaming chunk size; the memory bound follows from it.
        tp_rules: how a tensor-parallel checkpoint saved without ``universal_checkpoint_info`` joins its
            shards (a JSON file; see :func:`ckptlib.open_checkpoint`).
        hf_files: copy the Hugging Face files found beside the checkpoint (``config.json`` with its dtype
            set to ``dtype``, ``generation_config.json``, tokenizer files, chat templates, remote code named
            by ``auto_map``; :func:`ckptlib.deepspeed.hf.model_files`), so that ``from_pretrained(out)`` loads it as
            it is. The plan's notes say which were copied, or how to add a config when there is none.
        dcp: with ``format="dcp"``: ``layout`` (``"torch"``, ``"torchtitan"``, ``"accelerate"``) and
            ``optimizer`` (True: the optimizer state too; ``states`` naming any state does the same); see
            :mod:`ckptlib.export.dcp`. The result is a :class:`~ckptlib.export.dcp.DcpPlan`.
        sync: put the output on disk before it appears under its name (default; see :class:`~ckptlib.plan.Plan`).
            False leaves the writing to the kernel after the run, as ``torch.save`` and DeepSpeed do:
            faster, still atomic against a killed or failing run, but not against a power cut.

    Tensor-parallel shards are joined into full tensors; tensors replicated on several tensor ranks
    are compared when the plan runs, before anything is written (``plan.checks``).

    Memory: the plan itself (one small record per tensor and stored range).
    """
    if not isinstance(checkpoint, Checkpoint) and format != "dcp" and is_dcp(checkpoint):
        from .from_dcp import plan_from_dcp  # a DCP checkpoint as the source

        return plan_from_dcp(checkpoint, out, format=format, dtype=dtype, limit=_limit(max_shard_size), states=states,
                             workers=workers, overwrite=overwrite, chunk_bytes=chunk_bytes, sync=sync)
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag, tp_rules=tp_rules)
    if format not in FORMATS:
        raise CkptError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if format == "dcp":
        return _plan_dcp(ck, out, dtype=dtype, max_shard_size=max_shard_size, states=states, workers=workers,
                         overwrite=overwrite, chunk_bytes=chunk_bytes, sync=sync, exclude_frozen=exclude_frozen,
                         **(dcp or {}))
    if dcp:
        raise CkptError("layout and optimizer options are for --format dcp")
    if dtype not in OUTPUT_DTYPES:
        raise CkptError(f"unknown dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    if workers < 1:
        raise CkptError("workers must be at least 1")
    limit = _limit(max_shard_size)
    ck.check_readable()
    warnings = []
    if ck.flavor != "no_zero" and ck.zero_stage == 1 and any(not p.trainable and not p.tied_to for p in ck.parameters):
        warnings.append("ZeRO-1 does not save fp32 copies of frozen parameters: they are exported from the "
                        f"{ck.dtype} module weights (DeepSpeed's converter drops them)")
    out_dtype = BY_SHORT[dtype].name
    sets = [("", _weights(ck, out_dtype, exclude_frozen))]
    known = set(ck.optimizer.state_keys) if ck.optimizer else set()
    step = ck.optimizer.step if ck.optimizer else None
    for key in states:
        if key not in known:
            raise CkptError(f"the optimizer state has no '{key}' (it has: {', '.join(sorted(known)) or 'none'})",
                            path=ck.location.tag_dir)
        sets.append((key + "/", [PlannedTensor(p.name, p.name, key, "state", tuple(p.shape), "float32",
                                               tuple(ck.sources(p.name, key)))
                                 for p in ck.parameters if p.trainable and not p.tied_to]))
    files, finals, index_files = [], [], {}
    for prefix, tensors in sets:
        shards = _shard(tensors, limit)
        names, index = _file_names(format, max(len(shards), 1))
        meta = {"format": "pt"}
        key = tensors[0].key if tensors else None
        if key:
            meta["optimizer_state"] = key
            if step is not None:
                meta["step"] = str(step)
        group = [WeightsFile(prefix + name, format, shard, dict(meta) if format == "safetensors" else {},
                             kind="state" if key else "weights")
                 for name, shard in zip(names, shards or [[]])]
        for f in group:
            f.size = weights_file_size(f)
        files += group
        if index:
            index_files[prefix + index] = [f.name for f in group]
            finals.append(TextFile(prefix + index, _index_json(group, key), kind="index"))
    checks = [RangeCheck(what, tuple(a), tuple(b), a[0].dtype if a else "float32")  # compared as stored
              for f in files for t in f.tensors for what, a, b in ck.replica_checks(t.source, t.key)
              if t.kind != "tied"]
    side, side_notes = _side_files(ck, out_dtype) if hf_files else ([], [])
    files += [f for f in side if isinstance(f, CopyFile)]
    finals = [f for f in side if isinstance(f, TextFile)] + finals
    return ExportPlan(source=ck.source_ref(), out=Path(out).expanduser().resolve(), files=files, finals=finals,
                      format=format, dtype=dtype, max_shard_size=limit, exclude_frozen=exclude_frozen,
                      states=tuple(states), index_files=index_files, side_files=[f.name for f in side],
                      chunk_bytes=chunk_bytes, workers=workers,
                      overwrite=overwrite, sync=sync,
                      notes=warnings + [n for n in ck.view.notes if ck.kind != "data_parallel"] + side_notes,
                      checks=checks)


def _limit(max_shard_size: Union[int, str]) -> int:
    try:
        limit = parse_size(max_shard_size)
    except ValueError as e:
        raise CkptError(str(e), hint="write sizes like 5GB, 500MB or 2GiB") from None
    if limit <= 0:
        raise CkptError("max_shard_size must be positive")
    return limit


def _plan_dcp(ck: Checkpoint, out, *, dtype: str, max_shard_size, states: Sequence[str], layout: str = "torch",
              optimizer: bool = False, **options):
    from .dcp import plan_dcp  # the DCP planner, loaded only for DCP exports

    return plan_dcp(ck, Path(out), layout=layout, optimizer=optimizer or bool(states), dtype=dtype,
                    max_shard_size=_limit(max_shard_size), **options)


def _side_files(ck: Checkpoint, out_dtype: str) -> tuple[list, list[str]]:
    """The Hugging Face files to copy beside the weights (``config.json`` as text with ``out_dtype``), and
    the note saying what was copied from where, or how to add a config."""
    found, folder = hf.model_files(ck.location.save_dir)
    if folder is None:
        return [], [f"no config.json beside the checkpoint ({ck.location.save_dir}): from_pretrained(OUT) needs "
                    "one; write it with model.config.save_pretrained(OUT), or copy the config.json of the model "
                    "you trained into OUT (--no-hf-files silences this)"]
    out: list = []
    for f in found:
        if f.name == hf.CONFIG:
            try:
                text = hf.config_with_dtype(Path(f.source).read_text(), out_dtype)
            except (OSError, ValueError) as e:
                raise CkptError(f"this config.json cannot be read as JSON ({e})", path=f.source,
                                hint="repair it, or export without it (--no-hf-files)") from None
            out.append(TextFile(f.name, text, kind="hf"))
        else:
            out.append(CopyFile(f.name, f.source, f.bytes, kind="hf"))
    where = "" if folder == ck.location.save_dir else f" (from {folder})"
    names = [f"{f.name} (dtype {out_dtype})" if f.name == hf.CONFIG else f.name for f in found]
    return out, [f"copied for from_pretrained{where}: {', '.join(names)}"]


def weights_file_size(f: WeightsFile) -> int:
    """The exact size of the file a run writes for ``f``: the safetensors header and data, or the torch
    zip with its pickle (computed, nothing written)."""
    if f.format == "safetensors":
        return SafetensorsLayout([TensorSpec(t.name, t.dtype, t.shape) for t in f.tensors], f.metadata).file_size
    tree = collections.OrderedDict((t.name, NewTensor(t.dtype, t.shape, t.ranges)) for t in f.tensors)
    return file_size(tree, f.name, archive=Path(f.name).name.split(".")[0])


def _index_json(group: list[WeightsFile], key: Optional[str]) -> str:
    meta = {"total_size": sum(f.nbytes for f in group)}
    if key:
        meta["optimizer_state"] = key
    weight_map = {t.name: Path(f.name).name for f in group for t in f.tensors}
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"


__all__ = ["ExportPlan", "plan_export", "FORMATS"]
