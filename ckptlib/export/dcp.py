"""Planning a DCP export: a DeepSpeed checkpoint as the torch.distributed.checkpoint folder(s) that FSDP2,
torchtitan or Accelerate load, with the optimizer state, from metadata alone.

What goes in (every layout ckptlib reads: ZeRO-0/1/2/3, BF16_Optimizer, pipeline, tensor, expert, 3D;
names as the un-parallelised model has them):

- the model: every parameter (tied aliases under each of their names, frozen ones too) and persistent
  buffer, floating ones in ``dtype`` (fp32: the fp32 masters of trainable parameters, bit for bit);
- with ``optimizer``: per trainable parameter its group's per-element states under the names torch's optimizer
  of the same kind uses (Adam's ``exp_avg``, ``exp_avg_sq``; SGD's and Muon's ``momentum_buffer``; Adagrad's
  ``sum`` ...; fp32) and, where that optimizer counts steps, ``step`` (a 0-dim float32 tensor, as FSDP2 saves
  it), none for frozen parameters and one set per tied parameter (under its first name); DeepSpeed's
  parameter groups as groups, each with its hyper-parameters in torch's terms and the FQNs of its
  parameters (``set_state_dict`` matches groups by membership; merged, the load fails). Groups of pipeline
  stages or tensor ranks with the same index and hyper-parameters are one group. What torch cannot continue
  (Adafactor, Lion, an unknown optimizer) is refused: :mod:`ckptlib.export.dcp_optim`.

Layouts (the keys are those ``dcp.save`` writes for the client's state dict, flattened):

- ``torch``: ``model.<fqn>``, ``optimizer.state.<fqn>.<key>``, ``optimizer.param_groups.<i>.<hp>`` with
  ``params`` a list of FQNs: ``{"model": ..., "optimizer": ...}`` of ``get_state_dict`` / ``set_state_dict``;
- ``torchtitan``: its ``CheckpointManager``'s keys: the model's at the top level,
  ``optimizer.state.<fqn>.<key>`` and ``optimizer.param_groups.<fqn>.<hp>`` (its ``OptimizersContainer``
  keeps hyper-parameters per parameter), ``lr_scheduler.last_epoch`` and ``train_state.step`` (DeepSpeed's
  global step), ``train_state.ntokens_seen`` (not in a DeepSpeed checkpoint: 0, named in a note); the
  data loader's state does not map (load with ``exclude_from_loading=["dataloader"]``);
- ``accelerate``: what ``Accelerator.save_state`` writes for FSDP2 with sharded state dicts:
  ``pytorch_model_fsdp_0/`` (``model.<fqn>``) and ``optimizer_0/`` (``optimizer.state...``,
  ``optimizer.param_groups...``), plus the training files the Trainer or Accelerate keep beside the
  checkpoint (scheduler, sampler, RNG states), copied byte for byte where they are.

Storages (``storage``; how the bytes are held, what ``dcp.load`` is given to read them):

- ``torch`` (default): a ``.metadata`` and ``.distcp`` files of ``torch.save`` items, as ``FileSystemWriter`` writes
  them (any layout, the optimizer too);
- ``hf``: the model's tensors under their keys (``fc1.weight``, at the top level, as ``dcp.save(model_state_dict,
  storage_writer=HuggingFaceStorageWriter(path))`` writes them) in ``model-0000i-of-0000N.safetensors`` files with
  DCP's sharding info, and ``model.safetensors.index.json``; ``HuggingFaceStorageReader`` reads it;
- ``hf-sharded``: the same as ``HuggingFaceStorageWriter(path, save_distributed=True)`` writes at ``ranks`` ranks
  (default: the checkpoint's data-parallel size): ``shard-0000r-model-0000i-of-0000N.safetensors`` per rank, each
  parameter's rows as FSDP2's ``Shard(0)`` gives them to rank r, the buffers whole in rank 1's file
  (:func:`ckptlib.io.dcp.hfstorage.plan_hf_storage`); ``consolidate_safetensors_files`` merges them.

Neither HF storage can hold a value, so the optimizer state (whose param groups are values) is refused there.
FileSystemWriter's safetensors serialization is not written: torch 2.13's own FileSystemReader cannot load it.

What does not map (the loss scaler, DeepSpeed's own scheduler state, ...) is named in the plan's notes.
The plan is plain data; :func:`ckptlib.run` writes it through the same runner as every export.
"""
from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from ..deepspeed import Checkpoint, hf
from ..deepspeed.exactness import value_proofs
from ..dtypes import BY_SHORT, OUTPUT_DTYPES
from ..errors import CkptError, IncompleteCheckpointError, UnsupportedCheckpointError
from ..io.crc import attach_crc
from ..io.dcp import SUFFIX, BytesEntry, Chunk, DcpMetadata, Item, TensorEntry, metadata_pickle, place
from ..io.torchzip.specs import NewTensor
from ..io.dcp.hfstorage import HF_SHARDED, plan_hf_storage
from ..plan import PROCESSES, BlobFile, CopyFile, DistcpFile, Plan, PlannedTensor, RangeCheck, WeightsFile
from ..units import human_bytes
from .dcp_optim import (HINT, Value, group_values, initial_lr, optimizer_groups, state_values, steps,
                        torch_settings)
from .weights import model_tensors

LAYOUTS = ("torch", "torchtitan", "accelerate")
WRITTEN_STORAGES = ("torch", "hf", "hf-sharded")  # not "safetensors": torch 2.13's FileSystemReader cannot load it
STORAGE_HINT = "use --dcp-storage torch (dcp={'storage': 'torch'}), which holds the optimizer state and every layout"
ACCELERATE_MODEL, ACCELERATE_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"
#: training files Accelerate's save_state writes beside the FSDP folders, copied when found
ACCELERATE_FILES = re.compile(r"^(scheduler|sampler|dl_state_dict|custom_checkpoint)(_\d+)?\.(bin|pkl)$|"
                              r"^scaler\.pt$|^random_states_\d+\.pkl$")


@dataclass(kw_only=True, repr=False)
class DcpPlan(Plan):
    """A DCP export (plain data; see :class:`ckptlib.plan.Plan`).

    Attributes:
        layout: ``"torch"``, ``"torchtitan"`` or ``"accelerate"``.
        storage: ``"torch"``, ``"hf"`` or ``"hf-sharded"`` (see the module docstring).
        optimizer: whether the optimizer state is in it.
        folders_written: the DCP folders (``""`` for ``out`` itself) and their :class:`DcpMetadata`.
        values: per folder, the flattened entries in order (:class:`Value`).
        step: the optimizer step written for every parameter (None where no optimizer counts steps).
        torch_optimizers: the ``torch.optim`` class of each parameter group written, in order (``["Muon",
            "AdamW", "AdamW"]`` for a Muon run; see :mod:`ckptlib.export.dcp_optim`); ``torch_settings``: per group,
            the hyper-parameters to build it with so that it keeps the same state keys (``{"momentum": 0.9}``).
    """

    action: ClassVar[str] = "export"
    format: str = "dcp"
    layout: str
    dtype: str
    optimizer: bool
    max_shard_size: int
    storage: str = "torch"
    dcp: dict = field(default_factory=dict)       # folder -> DcpMetadata
    values: dict = field(default_factory=dict)    # folder -> [Value]
    step: Optional[int] = None
    torch_optimizers: list = field(default_factory=list)
    torch_settings: list = field(default_factory=list)
    parallel: str = PROCESSES

    @property
    def tensors(self) -> list:
        return [v for vs in self.values.values() for v in vs if v.tensor is not None]

    @property
    def largest_tensor_bytes(self) -> int:
        return max((v.tensor.nbytes for v in self.tensors), default=0)

    @property
    def param_groups(self) -> list:
        """The parameter groups written, as lists of parameter names (the groups a loader's optimizer needs)."""
        out = {}
        for vs in self.values.values():
            for v in vs:
                if v.path[:2] == ("optimizer", "param_groups") and v.path[-1] == "params":
                    out[v.path[2]] = list(v.value)
                elif v.fqn.startswith("optimizer.param_groups.") and v.fqn.endswith(".lr") and self.layout == "torchtitan":
                    out.setdefault(repr(v.value), []).append(v.fqn[len("optimizer.param_groups."):-len(".lr")])
        return list(out.values())

    def to_dict(self) -> dict:
        return {
            "source": self.source.tag_dir, "out": str(self.out), "format": "dcp", "layout": self.layout,
            "storage": self.storage,
            "dtype": self.dtype, "optimizer": self.optimizer, "max_shard_size": self.max_shard_size,
            "step": self.step, "torch_optimizers": list(self.torch_optimizers),
            "torch_settings": list(self.torch_settings), "workers": self.workers,
            "sync": self.sync,
            "folders": {k or ".": {"tensors": len(md.tensors), "values": len(md.values)} for k, md in self.dcp.items()},
            "files": [{"name": f.name, "bytes": f.size} for f in self.files],
            "read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "file_bytes": self.file_bytes,
            "largest_tensor_bytes": self.largest_tensor_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
            "notes": list(self.notes),
        }

    def describe(self) -> str:
        src = self.source
        what = "model and optimizer state" if self.optimizer else "model"
        lines = [f"export {src.tag_dir}",
                 f"    -> {self.out}  (DCP, {self.layout} layout, {what}, {self.dtype} weights"
                 + (f", {self.storage} storage)" if self.storage != "torch" else ")"),
                 f"ZeRO {src.zero_stage}, {src.dtype}, {src.dp_world_size} ranks; {len(self.tensors)} tensors"
                 + (f", optimizer step {self.step}" if self.optimizer else ""),
                 f"{self.reads_text()}; {self.writes_text()}",
                 f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} per process "
                 f"(largest tensor {human_bytes(self.largest_tensor_bytes)}; streamed in "
                 f"{human_bytes(self.chunk_bytes)} chunks)"] + self.summary_lines()[2:]
        width = max([len(f.name) for f in self.files] + [40])
        for f in self.files:
            count = f"{len(f.items)} items" if isinstance(f, DistcpFile) else \
                f"{len(f.tensors)} tensors" if isinstance(f, WeightsFile) else f.kind
            lines.append(f"  {f.name:<{width}} {human_bytes(f.size):>10}  {count}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ============================================================================================ the content
def _model_values(ck: Checkpoint, out_dtype: str, prefix: tuple) -> list[Value]:
    return [Value(".".join(prefix + (t.name,)), prefix + (t.name,), NewTensor(t.dtype, t.shape, t.ranges),
                  source=t.source) for t in _model_tensors(ck, out_dtype)]


def _model_tensors(ck: Checkpoint, out_dtype: str) -> list[PlannedTensor]:
    def sources(name: str) -> list:
        try:
            return ck.sources(name)
        except IncompleteCheckpointError:
            raise UnsupportedCheckpointError(
                f"no data saved for the frozen parameter {name} (the checkpoint was saved with "
                "exclude_frozen_parameters): a DCP model state holds every parameter, and FSDP2's load fails on a "
                "missing one", path=ck.location.tag_dir,
                hint="export from a checkpoint saved with its frozen parameters, or load them from the base model "
                     "after a load with allow_partial_load") from None

    return model_tensors(ck, out_dtype, sources=sources)


def _titan(values: list[Value]) -> list[Value]:
    """torchtitan's optimizer entries are flat keys under ``optimizer`` (its path has two parts)."""
    for v in values:
        if v.path[0] == "optimizer" and len(v.path) > 2:
            v.path = ("optimizer", ".".join(map(str, v.path[1:])))
    return values


# ============================================================================================ files
def _files(folder: str, values: list[Value], limit: int, checkpoint_id: str) -> tuple[list, DcpMetadata]:
    """The ``.distcp`` files (shards of at most ``limit`` tensor bytes, values in the first) and the
    ``.metadata`` of one DCP folder."""
    shards: list[list[Value]] = [[]]
    size = 0
    for v in [v for v in values if v.tensor is None] + [v for v in values if v.tensor is not None]:
        n = v.tensor.nbytes if v.tensor is not None else 0
        if shards[-1] and size + n > limit and any(x.tensor is not None for x in shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(v)
        size += n
    files, entries = [], {}
    for i, shard in enumerate(shards):
        name = f"__{i}_0{SUFFIX}"
        items = [Item(v.fqn, v.tensor if v.tensor is not None else v.value,
                      chunk_offsets=(0,) * len(v.tensor.shape) if v.tensor is not None else ()) for v in shard]
        end = place(items)
        files.append(DistcpFile(os.path.join(folder, name) if folder else name, items, end, rank=i))
        for v, it in zip(shard, items):
            entries[v.fqn] = (TensorEntry(v.fqn, v.tensor.dtype, tuple(v.tensor.shape),
                                          [Chunk(it.chunk_offsets, tuple(v.tensor.shape), name, it.offset, it.length)])
                              if v.tensor is not None else BytesEntry(v.fqn, name, it.offset, it.length))
    md = DcpMetadata(entries=[entries[v.fqn] for v in values], planner_data={v.fqn: v.path for v in values},
                     checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()))
    return files, md


def _training_state(ck: Checkpoint) -> dict:
    """What the model-states file says about the run beyond the tensors (metadata only)."""
    obj = ck.model_states_file().obj
    return {k: obj.get(k) for k in ("global_steps", "skipped_steps", "global_samples", "lr_scheduler",
                                    "data_sampler", "random_ltd")} if isinstance(obj, dict) else {}


def _unmapped_notes(ck: Checkpoint, layout: str, run: dict, optimizer: bool) -> list[str]:
    notes = []
    if optimizer:
        osd = ck.main.records.index.optim
        first = ck.optimizer_state_dict(next(iter(sorted(osd)))) if osd else {}
        ds_only = [k for k in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad") if k in (first or {})]
        if ds_only:
            notes.append(f"not carried over (DeepSpeed's own, no FSDP2 counterpart): {', '.join(ds_only)}")
    if run.get("lr_scheduler") is not None:
        notes.append("DeepSpeed's lr_scheduler state does not map to a torch scheduler: build the scheduler "
                     "after loading" + (" (lr_scheduler.last_epoch is set to the global step)" if layout == "torchtitan"
                                        else ""))
    if run.get("data_sampler") is not None:
        notes.append("DeepSpeed's data sampler state is not carried over")
    if layout == "torchtitan":
        notes.append("torchtitan's train_state.ntokens_seen (a logging counter) is not in a DeepSpeed checkpoint: "
                     "written as 0; the data loader's position does not map: load with "
                     "exclude_from_loading=[\"dataloader\"]")
    return notes


def _check_storage(storage: str, layout: str, optimizer: bool) -> None:
    if storage not in WRITTEN_STORAGES:
        why = (": torch 2.13's own FileSystemReader cannot load what "
               "FileSystemWriter(serialization_format=SAFETENSORS) writes (docs/dcp.md)") if storage == "safetensors" else ""
        raise CkptError(f"unknown DCP storage {storage!r}; choose one of {', '.join(WRITTEN_STORAGES)}{why}")
    if storage != "torch" and optimizer:
        raise CkptError(f"{storage} storage holds tensors only, not the optimizer state: its param groups are values, "
                        "which HuggingFaceStorageWriter's safetensors files cannot hold", hint=STORAGE_HINT)
    if storage != "torch" and layout != "torch":
        raise CkptError(f"the {layout} layout is for torch storage: {storage} storage holds the model's tensors under "
                        "their own names (as dcp.save(model.state_dict(), "
                        "storage_writer=HuggingFaceStorageWriter(...)) writes them)", hint=STORAGE_HINT)


def plan_dcp(ck: Checkpoint, out: Path, *, layout: str = "torch", optimizer: bool = False, dtype: str = "fp32",
             max_shard_size: int = 5 * 10**9, exclude_frozen: bool = False, workers: int = 1,
             overwrite: bool = False, chunk_bytes: int, sync: bool = True, verify_crc: bool = True,
             storage: str = "torch", ranks: Optional[int] = None) -> DcpPlan:
    """Plan a DCP export of the opened checkpoint ``ck`` into ``out`` (see the module docstring).
    ``storage``: ``torch``, ``hf`` or ``hf-sharded``; ``ranks``: the ranks an ``hf-sharded`` export is written
    for (default: the checkpoint's data-parallel size).

    ``verify_crc``: the CRC-32 of every zip member of the checkpoint the export reads is checked as its bytes
    stream, before the output is put in place (as for every export; False: unchecked).

    Memory: the plan (one small record per tensor) and the metadata pickle; reads the optimizer's
    scalar steps only.

    Raises:
        UnsupportedCheckpointError: the optimizer state cannot be carried exactly (not torch Adam/AdamW
            groups, no exp_avg/exp_avg_sq, steps that differ).
    """
    if layout not in LAYOUTS:
        raise CkptError(f"unknown DCP layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    _check_storage(storage, layout, optimizer)
    if dtype not in OUTPUT_DTYPES:
        raise CkptError(f"unknown dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    ck.check_readable()
    out_dtype = BY_SHORT[dtype].name
    notes = []
    trainable = [p for p in ck.parameters if p.trainable and not p.tied_to]
    if exclude_frozen:
        raise CkptError("a DCP export holds the whole model (FSDP2 loads every parameter): drop --exclude-frozen")
    if storage != "torch":
        return _plan_hf(ck, Path(out).expanduser().resolve(), storage=storage, dtype=dtype, out_dtype=out_dtype,
                        ranks=ranks or ck.source_ref().ranks or 1, max_shard_size=max_shard_size, workers=workers,
                        overwrite=overwrite, chunk_bytes=chunk_bytes, sync=sync, verify_crc=verify_crc)
    model = _model_values(ck, out_dtype, ("model",) if layout != "torchtitan" else ())
    step, classes, settings = None, [], []
    opt: list[Value] = []
    if optimizer:
        if ck.optimizer is None or not ck.optimizer.state_keys:
            raise UnsupportedCheckpointError("the checkpoint holds no per-element optimizer state",
                                             path=ck.location.tag_dir, hint=HINT)
        groups, members, families = optimizer_groups(ck, trainable)  # refuses what torch cannot continue
        classes = [f.torch for f in families]
        settings, setting_notes = torch_settings(groups, families)
        notes += setting_notes
        step = steps(ck)
        notes += initial_lr(groups, _training_state(ck))
        opt = state_values(ck, trainable, step, ("optimizer",))
        opt += group_values(groups, members, layout == "torchtitan", ("optimizer",))
        used = list(dict.fromkeys(classes))
        if len(used) > 1:
            notes.append(f"the optimizer state is that of {len(used)} torch optimizers ({', '.join(used)}): load "
                         f"it with get_state_dict(model, [{', '.join(c.lower() for c in used)}]) / set_state_dict, "
                         "the optimizers in that order, each with its groups in the order of the checkpoint's "
                         "param_groups")
        if dtype != "fp32":
            notes.append(f"the weights are {dtype} while the optimizer state is fp32: FSDP2's optimizers step fp32 "
                         "parameters; load this into a model in that dtype only to run it")
    run = _training_state(ck)
    notes += _unmapped_notes(ck, layout, run, optimizer)
    folders: dict = {}
    if layout == "torch":
        folders[""] = model + opt
    elif layout == "torchtitan":
        extra = []
        if optimizer:
            gs = int(run.get("global_steps") or 0)
            extra = [Value("lr_scheduler.last_epoch", ("lr_scheduler", "last_epoch"), value=gs),
                     Value("train_state.step", ("train_state", "step"), value=gs),
                     Value("train_state.ntokens_seen", ("train_state", "ntokens_seen"), value=0)]
        folders[""] = model + _titan(opt) + extra
    else:
        folders[ACCELERATE_MODEL] = model
        if optimizer:
            folders[ACCELERATE_OPTIMIZER] = opt
    files: list = []
    dcp: dict = {}
    out = Path(out).expanduser().resolve()
    for folder, values in folders.items():
        fs, md = _files(folder, values, max_shard_size, os.fspath(out / folder) if folder else os.fspath(out))
        files += fs
        files.append(BlobFile(os.path.join(folder, ".metadata") if folder else ".metadata", metadata_pickle(md)))
        dcp[folder] = md
    if layout == "accelerate":
        files += _accelerate_files(ck, notes)
    checks = _checks(ck, folders)
    plan = DcpPlan(source=ck.source_ref(), out=out, files=files, folders=[f for f in folders if f],
                   layout=layout, dtype=dtype, optimizer=optimizer, max_shard_size=max_shard_size, dcp=dcp,
                   values=folders, step=step, torch_optimizers=classes, torch_settings=settings,
                   chunk_bytes=chunk_bytes, workers=workers,
                   overwrite=overwrite,
                   sync=sync, notes=notes + [n for n in ck.view.notes if ck.kind != "data_parallel"],
                   checks=checks)
    return attach_crc(plan, ck.zip_entries() if verify_crc else None)


def _checks(ck: Checkpoint, folders: dict) -> list:
    """The plan's range checks: replicas compared, ZeRO-0 matches proven, before writing."""
    checks = [RangeCheck(what, tuple(a), tuple(b), a[0].dtype if a else "float32")
              for vs in folders.values() for v in vs if v.tensor is not None and v.source is not None
              and v.key != "step" for what, a, b in ck.replica_checks(v.source, v.key)]
    return _unique_checks(checks) + value_proofs(ck)


def _plan_hf(ck: Checkpoint, out: Path, *, storage: str, dtype: str, out_dtype: str, ranks: int, max_shard_size: int,
             workers: int, overwrite: bool, chunk_bytes: int, sync: bool, verify_crc: bool) -> DcpPlan:
    """A DCP export of the model alone in HuggingFaceStorageWriter's safetensors files (``hf``, ``hf-sharded``)."""
    tensors = _model_tensors(ck, out_dtype)
    files, finals, md = plan_hf_storage(tensors, sharded=storage == HF_SHARDED, ranks=ranks, limit=max_shard_size)
    values = {"": [Value(t.name, (t.name,), NewTensor(t.dtype, t.shape, t.ranges), source=t.source) for t in tensors]}
    notes = [f"{storage} storage: the model's tensors at the top level under their own names (load them with "
             "dcp.load(model_state_dict, storage_reader=HuggingFaceStorageReader(OUT))); no optimizer state"]
    if storage == HF_SHARDED:
        notes.append(f"written as {ranks} ranks of FSDP2 (fully_shard) save it: each parameter's rows (Shard(0)) in "
                     f"its rank's shard-*-model-*.safetensors, the buffers whole in rank 1's; "
                     "consolidate_safetensors_files merges the floating tensors (torch 2.13's cannot merge integer or "
                     "bool tensors, and writes a 0-dim one as zero; ckpt export OUT merges them all)")
    tied = [t.name for t in tensors if t.kind == "tied"]
    if tied:
        notes.append(f"tied parameters are written under each of their names ({', '.join(tied)}), as "
                     "model.state_dict() has them")
    plan = DcpPlan(source=ck.source_ref(), out=out, files=files, finals=finals, layout="torch", dtype=dtype,
                   optimizer=False, max_shard_size=max_shard_size, storage=storage, dcp={"": md}, values=values,
                   chunk_bytes=chunk_bytes, workers=workers, overwrite=overwrite, sync=sync,
                   notes=notes + [n for n in ck.view.notes if ck.kind != "data_parallel"], checks=_checks(ck, values))
    return attach_crc(plan, ck.zip_entries() if verify_crc else None)


def _unique_checks(checks: list) -> list:
    seen, out = set(), []
    for c in checks:
        if c.what not in seen:
            seen.add(c.what)
            out.append(c)
    return out


def _accelerate_files(ck: Checkpoint, notes: list) -> list:
    """The training files Accelerate's ``save_state`` keeps beside the model (scheduler, sampler, scaler,
    data loader and RNG states), copied byte for byte from the save dir (metadata only)."""
    found = [f for f in hf.training_files(ck.location.save_dir, None).files if ACCELERATE_FILES.match(f.name)]
    if found:
        notes.append(f"copied for Accelerate's load_state: {', '.join(f.name for f in found)}")
    else:
        notes.append("no Accelerate training files (scheduler, sampler, RNG states) beside the checkpoint: "
                     "load_state restores the model and optimizer; make the scheduler and sampler again")
    return [CopyFile(f.name, f.source, f.bytes, kind="hf") for f in found]


__all__ = ["DcpPlan", "plan_dcp", "LAYOUTS", "WRITTEN_STORAGES", "Value"]
