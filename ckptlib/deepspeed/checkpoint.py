"""The model of one DeepSpeed checkpoint, built from metadata, with reads on demand.

:func:`open_checkpoint` locates the checkpoint, opens the pickles of its model-state and optimizer-state
files (a few KB each; no tensor bytes), and builds a :class:`Checkpoint`: files and their roles, ZeRO
stage, training dtype, sizes, DeepSpeed version, optimizer, parameters, buffers, the partition layout
(:mod:`ckptlib.layout`) and the problems found. Tensor values are read only when asked for, and then only
the bytes of the pieces needed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..errors import (CkptError, IncompleteCheckpointError, NotACheckpointError, UnsafeCheckpointError,
                      UnsupportedCheckpointError)
from ..layout import FlatGroupLayout, Piece, Zero3Layout
from ..streaming import SourceRange
from ..torchzip import ReadStats, TensorHandle, TorchFile, dtype_name
from . import files as fnames
from .discovery import Location, locate

Layout = Union[FlatGroupLayout, Zero3Layout]

ZERO = "zero"                      # DeepSpeedZeroOptimizer (stage 1/2) or stage 3
BF16_OPTIMIZER = "bf16_optimizer"  # BF16_Optimizer: padded fp32 partitions, no zero_stage key
NO_ZERO = "no_zero"                # stage 0: everything in the model-states file


@dataclass
class FileInfo:
    """One file of the tag folder."""

    path: Path
    relpath: str
    bytes: int
    kind: str
    dp_rank: Optional[int] = None
    mp_rank: Optional[int] = None
    prefix: str = ""


@dataclass
class ParameterInfo:
    """One parameter of the model.

    ``group`` is the optimizer parameter group (ZeRO-1/2) or sub-group (ZeRO-3) of a trainable parameter.
    ``tied_to`` names the parameter whose data this one shares (then its values are that parameter's).
    """

    name: str
    shape: tuple
    trainable: bool
    tied_to: Optional[str] = None
    group: Optional[int] = None
    stored_dtype: Optional[str] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class BufferInfo:
    name: str
    shape: tuple
    dtype: str


@dataclass
class OptimizerInfo:
    """What the checkpoint says about the optimizer."""

    wrapper: str
    state_keys: list
    step: Optional[int]
    param_groups: list = field(default_factory=list)  # hyper-parameters per group, without 'params'
    loss_scale: Optional[float] = None


class Checkpoint:
    """A DeepSpeed checkpoint (one tag), known from its metadata.

    Use :func:`open_checkpoint` to make one. Opening reads the pickles only (a few KB per file), so it is
    cheap whatever the model size; values are read by :meth:`read_param`, :meth:`read_buffer` and
    :meth:`read_state`, each reading only the pieces of that tensor.

    Attributes:
        location: where it is (save dir, tag, tags, ``latest``).
        files: the tag folder's files with their roles.
        zero_stage: 0, 1, 2 or 3.
        flavor: ``"zero"``, ``"bf16_optimizer"`` or ``"no_zero"``.
        dtype: the training dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        dp_world_size, mp_world_size: data- and model-parallel sizes.
        deepspeed_version: the ``ds_version`` recorded in the files.
        quirks: how the format differs from what DeepSpeed 0.19.8 writes (older releases), one short phrase
            each, from the keys found; also summed up in one of the ``notes``.
        optimizer: :class:`OptimizerInfo` (None when there is no optimizer state).
        parameters: :class:`ParameterInfo` in model order (tied aliases included).
        buffers: persistent buffers.
        layouts: the partition layout of each ZeRO-1/2 group (:class:`FlatGroupLayout`), or one
            :class:`Zero3Layout`; empty at stage 0.
        problems: what is wrong or suspicious, one readable sentence each.
        stats: bytes read from the checkpoint so far.
    """

    def __init__(self, location: Location):
        self.location = location
        self.stats = ReadStats()
        self.problems: list[str] = []
        self.notes: list[str] = list(location.notes)
        self._open: dict[str, TorchFile] = {}
        self._errors: dict[str, CkptError] = {}
        self.files = self._list_files()
        self.zero_stage: Optional[int] = None
        self.flavor = NO_ZERO
        self.dtype: Optional[str] = None
        self.dp_world_size: Optional[int] = None
        self.mp_world_size: Optional[int] = None
        self.deepspeed_version: Optional[str] = None
        self.optimizer: Optional[OptimizerInfo] = None
        self.parameters: list[ParameterInfo] = []
        self.buffers: list[BufferInfo] = []
        self.layouts: list[Layout] = []
        self.partition_count: Optional[int] = None
        self.quirks: list[str] = []  # how this checkpoint's format differs from what DeepSpeed 0.19.8 writes
        self._ties_from_storage: dict[str, str] = {}
        self._model: dict = {}
        self._optim: dict[int, dict] = {}
        self._frozen_source: dict = {}
        self._stage0_index: dict[str, tuple[int, int]] = {}
        self._build()

    # ================================================================== construction
    def _list_files(self) -> list[FileInfo]:
        tag_dir = self.location.tag_dir
        given = self.location.given.resolve()
        out = []
        for p in tag_dir.iterdir():
            if not p.is_file():
                continue
            role = fnames.classify(p.name)
            out.append((role.sort_key, FileInfo(path=p, relpath=os.path.relpath(p, given), bytes=p.stat().st_size,
                                                kind=role.kind, dp_rank=role.dp_rank, mp_rank=role.mp_rank,
                                                prefix=role.prefix)))
        return [f for _, f in sorted(out, key=lambda t: t[0])]

    def _file(self, info: FileInfo) -> Optional[TorchFile]:
        """Open (once) a file's pickle; on failure record a problem and return None."""
        key = str(info.path)
        if key not in self._open:
            try:
                self._open[key] = TorchFile(info.path, stats=self.stats)
            except UnsafeCheckpointError:
                raise  # never half-open a checkpoint that holds a hostile pickle
            except CkptError as e:
                self.problems.append(f"{info.relpath}: {e.message}")
                self._open[key] = None
                self._errors[key] = e
        return self._open[key]

    def _files_of(self, kind: str, mp_rank: int = 0) -> list[FileInfo]:
        return [f for f in self.files if f.kind == kind and (f.mp_rank or 0) == mp_rank]

    def _build(self) -> None:
        model_files = self._files_of(fnames.MODEL_STATES)
        optim_files = self._files_of(fnames.OPTIM_STATES)
        if not model_files:
            raise NotACheckpointError("no model-states file (*_model_states.pt) in the tag folder",
                                      path=self.location.tag_dir,
                                      hint="the save is incomplete, or this is not a DeepSpeed tag folder")
        kinds = {f.kind for f in self.files}
        if fnames.LAYER_STATES in kinds:
            names = sorted(f.path.name for f in self.files if f.kind == fnames.LAYER_STATES)
            self.problems.append(f"pipeline-parallel layer files found ({names[0]}, ... {len(names)} files): "
                                 "pipeline-parallel checkpoints are not supported yet")
        if fnames.EXPERT_STATES in kinds or fnames.EXPERT_OPTIM_STATES in kinds:
            names = sorted(f.path.name for f in self.files
                           if f.kind in (fnames.EXPERT_STATES, fnames.EXPERT_OPTIM_STATES))
            self.problems.append(f"MoE expert files found ({names[0]}, ... {len(names)} files): "
                                 "mixture-of-experts checkpoints are not supported yet")

        first_model = model_files[0]
        mf = self._file(first_model)
        if mf is None:
            cause = self._errors[str(first_model.path)]
            raise type(cause)(f"the model-states file cannot be read: {cause.message}", path=first_model.path,
                              hint=cause.hint or "restore this file from a copy, or use another tag (--tag)")
        model = mf.obj
        if not isinstance(model, dict) or "module" not in model:
            raise NotACheckpointError("this model-states file has no 'module' entry: not a DeepSpeed checkpoint",
                                      path=first_model.path)
        self._model = model
        self.deepspeed_version = _as_str(model.get("ds_version"))
        self.dp_world_size = _as_int(model.get("dp_world_size"))
        self.mp_world_size = _as_int(model.get("mp_world_size")) or 1
        ds_config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}

        # ---- optimizer files: stage and flavour
        first_optim = None
        for f in optim_files:
            of = self._file(f)
            if of is not None and f.dp_rank is not None:
                osd = _get(of.obj, "optimizer_state_dict")
                if isinstance(osd, dict):
                    self._optim[f.dp_rank] = osd
                    first_optim = first_optim or osd
                else:
                    self.problems.append(f"{f.relpath}: no 'optimizer_state_dict' in the optimizer file")
        if self.deepspeed_version is None:  # DeepSpeed >= 0.4 also writes it at the optimizer files' top level
            for f in optim_files:
                of = self._file(f)
                if of is not None and isinstance(of.obj, dict) and of.obj.get("ds_version") is not None:
                    self.deepspeed_version = _as_str(of.obj.get("ds_version"))
                    break
        self._refuse_old_layouts(model, optim_files, first_optim)
        config_stage = _as_int(_get(ds_config, "zero_optimization", "stage"))
        offload = self.location.tag_dir / "offloaded_tensors"
        if offload.is_dir():
            self.problems.append("offloaded_tensors/ found: checkpoints of NVMe-offloaded optimizer state keep their "
                                 "tensors outside the .pt files and are not supported yet")
        if optim_files:
            if first_optim is None:
                raise IncompleteCheckpointError("none of the optimizer-state files can be read",
                                                path=self.location.tag_dir)
            if "zero_stage" in first_optim:
                self.zero_stage = int(first_optim["zero_stage"])
                self.flavor = ZERO
            elif "single_partition_of_fp32_groups" in first_optim:
                self.flavor = BF16_OPTIMIZER
                self.zero_stage = config_stage if config_stage is not None else 1
            else:
                raise UnsupportedCheckpointError(
                    "the optimizer-state files have neither 'zero_stage' nor 'single_partition_of_fp32_groups'",
                    path=optim_files[0].path, hint="this optimizer layout is not known to ckptlib")
        else:
            self.flavor = NO_ZERO
            self.zero_stage = config_stage or 0
            if self.zero_stage:
                self.problems.append(f"the config says ZeRO stage {self.zero_stage} but there are no "
                                     "*_optim_states.pt files: the save is incomplete")

        self._find_dtype(model, ds_config)
        if self.mp_world_size > 1:
            self.problems.append(f"model parallel size {self.mp_world_size}: only mp rank 0 is described; "
                              "reading tensor/pipeline-parallel checkpoints is not supported yet")
        if self.flavor == NO_ZERO:
            self._build_stage0(model)
        elif self.zero_stage == 3:
            self._build_zero3(model, model_files, optim_files)
        else:
            self._build_zero12(model, optim_files)
        self._find_buffers(model)
        self._find_optimizer(model)
        self._find_quirks(model)

    # ---------------------------------------------------------------- older releases
    def written_by(self) -> str:
        """"DeepSpeed 0.10.3", or what is known when the files record no version."""
        if self.deepspeed_version:
            return f"DeepSpeed {self.deepspeed_version}"
        return "a DeepSpeed release that recorded no ds_version (older than 0.4)"

    def _refuse_old_layouts(self, model: dict, optim_files: list[FileInfo], first_optim: Optional[dict]) -> None:
        """Refuse, naming the version found, the layouts of DeepSpeed before 0.6 that ckptlib cannot read."""
        if isinstance(first_optim, dict) and "local_sub_partitions_of_fp32_groups" in first_optim:
            raise UnsupportedCheckpointError(
                f"written by {self.written_by()}: legacy ZeRO-1 optimizer state ('local_sub_partitions_of_fp32_groups', "
                "the interleaved sub-partitions of zero_optimization.legacy_stage1, removed in DeepSpeed 0.5.9) "
                "is not supported",
                path=optim_files[0].path,
                hint=f"load it with {self.written_by()} at the same world size and save the fp32 weights from there "
                     "(legacy ZeRO-1 checkpoints cannot be loaded by later DeepSpeed releases either)")
        if model.get("param_shapes") is None:
            for f in optim_files:
                of = self._file(f)
                if of is not None and isinstance(of.obj, dict) and "param_shapes" in of.obj:
                    raise UnsupportedCheckpointError(
                        f"written by {self.written_by()}: the parameter shapes are in the optimizer-state files "
                        "('param_shapes' at their top level), the layout of DeepSpeed before 0.6; checkpoints "
                        "from before 0.6 are not supported",
                        path=f.path,
                        hint="use the zero_to_fp32.py saved beside the tag folder, with the DeepSpeed release that "
                             "wrote it, to get the fp32 weights")

    def _find_quirks(self, model: dict) -> None:
        """How this checkpoint differs from what DeepSpeed 0.19.8 writes, from the keys found (metadata only)."""
        q = self.quirks
        version = _version_tuple(self.deepspeed_version)
        if version is not None and version < (0, 10):
            q.append("older than the DeepSpeed releases ckptlib is tested with (0.10.3 to 0.19.8)")
        if self.flavor != NO_ZERO and self._optim:
            osd = self._optim[min(self._optim)]
            if self.flavor == ZERO and self.zero_stage in (1, 2):
                if "param_alignment_paddings" not in osd:
                    q.append("no param_alignment_paddings")
                if "group_paddings" not in osd:
                    q.append("no group_paddings")
                if isinstance(osd.get("base_optimizer_state"), (list, tuple)):
                    q.append("elastic optimizer state (base_optimizer_state is a list of unpadded per-group "
                             "states, saved with elastic_checkpoint: true): read and export only")
                    self._check_elastic()
            step = self.optimizer.step if self.optimizer else None
            gsteps, skipped = _as_int(model.get("global_steps")), _as_int(model.get("skipped_steps")) or 0
            if step is not None and gsteps is not None and step == gsteps - skipped + 1:
                q.append(f"optimizer step {step} = global_steps + 1 (the optimizer's initialising step on zero "
                         "gradients is counted)")
        if "sparse_tensor_module_names" in model:
            q.append("sparse_tensor_module_names present")
        if "checkpoint_parallel_dimensions" not in model and version is not None and version < (0, 19, 5):
            q.append("no checkpoint_parallel_dimensions")
        if self.dtype in ("bf16", "fp16"):
            half = [b.name for b in self.buffers if b.dtype in ("bfloat16", "float16")]
            if half:
                q.append(f"float buffers saved in {self.dtype} ({', '.join(half)}), cast with the module")
        if self._ties_from_storage:
            q.append("shared_params not recorded: ties found from the module's shared storage ("
                     + ", ".join(f"{a} -> {o}" for a, o in self._ties_from_storage.items()) + ")")
        if q:
            self.notes.append(f"written by {self.written_by()}: " + "; ".join(q))

    def _check_elastic(self) -> None:
        """Elastic ZeRO-1/2 state: per rank, one dict per group of tensors as long as the lean fp32 partition."""
        for r, osd in sorted(self._optim.items()):
            base = osd.get("base_optimizer_state")
            if not isinstance(base, (list, tuple)) or len(base) != len(self.layouts):
                self.problems.append(f"rank {r}: the elastic base_optimizer_state has "
                                     f"{len(base) if isinstance(base, (list, tuple)) else 'no'} groups, "
                                     f"param_shapes has {len(self.layouts)}")
                continue
            for g, (st, lay) in enumerate(zip(base, self.layouts)):
                for k, t in (st.items() if isinstance(st, dict) else []):
                    if k != "step" and isinstance(t, TensorHandle) and t.numel != lay.lean_length(r):
                        self.problems.append(f"rank {r} group {g}: elastic state '{k}' holds {t.numel} elements, "
                                             f"{lay.lean_length(r)} are expected")

    def _find_dtype(self, model: dict, ds_config: dict) -> None:
        module = model.get("module") or {}
        counts: dict[torch.dtype, int] = {}
        buffer_names = set(model.get("buffer_names") or [])
        for name, t in module.items():
            if isinstance(t, TensorHandle) and name not in buffer_names and t.dtype.is_floating_point:
                counts[t.dtype] = counts.get(t.dtype, 0) + 1
        by_module = max(counts, key=counts.get) if counts else None
        if _get(ds_config, "bf16", "enabled") or _get(ds_config, "bfloat16", "enabled"):
            self.dtype = "bf16"
        elif _get(ds_config, "fp16", "enabled"):
            self.dtype = "fp16"
        elif by_module is not None:
            self.dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(by_module, "fp32")
        else:
            prefixes = {f.prefix for f in self.files if f.kind == fnames.OPTIM_STATES}
            self.dtype = "bf16" if "bf16_" in prefixes else "fp32"

    # ---------------------------------------------------------------- ZeRO-1/2 and BF16_Optimizer
    def _build_zero12(self, model: dict, optim_files: list[FileInfo]) -> None:
        param_shapes = _param_shape_groups(model.get("param_shapes"))
        if param_shapes is None:
            raise UnsupportedCheckpointError(
                f"the model-states file has no 'param_shapes' (written by {self.written_by()}; DeepSpeed writes it "
                "there since 0.6)",
                path=self._files_of(fnames.MODEL_STATES)[0].path,
                hint="checkpoints from DeepSpeed before 0.6 are not supported")
        first = self._optim[min(self._optim)]
        counts = first.get("partition_count")
        counts = list(counts) if isinstance(counts, (list, tuple)) else [counts] * len(param_shapes)
        self.partition_count = max(int(c) for c in counts) if counts else None
        paddings = first.get("param_alignment_paddings")
        for g, group in enumerate(param_shapes):
            pads = list(paddings[g]) if isinstance(paddings, (list, tuple)) and g < len(paddings) else None
            self.layouts.append(FlatGroupLayout.build(list(group.items()), int(counts[g]),
                                                      paddings_after=pads, group=g))
        self._check_rank_files(optim_files, self.partition_count, "optimizer-state")
        key = "single_partition_of_fp32_groups"
        for r, osd in sorted(self._optim.items()):
            parts = osd.get(key)
            if not isinstance(parts, (list, tuple)) or len(parts) != len(self.layouts):
                self.problems.append(f"rank {r}: '{key}' has {len(parts) if parts is not None else 'no'} groups, "
                                     f"param_shapes has {len(self.layouts)}")
                continue
            for g, (t, lay) in enumerate(zip(parts, self.layouts)):
                want = lay.partition_size if self.flavor == BF16_OPTIMIZER else lay.lean_length(r)
                if not isinstance(t, TensorHandle) or t.numel != want:
                    got = t.numel if isinstance(t, TensorHandle) else type(t).__name__
                    self.problems.append(
                        f"rank {r} group {g}: the fp32 partition holds {got} elements, but {want} are expected "
                        f"from param_shapes at {lay.world_size} ranks (element counts do not add up)")
        trainable = {}
        for g, group in enumerate(param_shapes):
            for name, shape in group.items():
                trainable[name] = (tuple(shape), g)
        frozen_shapes = model.get("frozen_param_shapes") or {}
        frozen_frag = model.get("frozen_param_fragments") or {}
        self._frozen_source = {n: [t] for n, t in frozen_frag.items() if isinstance(t, TensorHandle)}
        if not model.get("shared_params"):
            # DeepSpeed < 0.9 (and 0.9.x's ZeRO-1/2) record no ties; the 16-bit module weights are views of the
            # flat groups, so an alias is a module tensor on the same storage, offset, shape and stride as a
            # trainable parameter that is itself neither trainable nor frozen
            ties = {a: o for a, o in _aliases_by_storage(model.get("module") or {},
                                                         set(model.get("buffer_names") or [])).items()
                    if o in trainable and a not in trainable and a not in frozen_shapes}
            if ties:
                self._ties_from_storage = ties
                model = dict(model, shared_params=ties)
        self._collect_parameters(model, trainable, {n: tuple(s) for n, s in frozen_shapes.items()})

    # ---------------------------------------------------------------- ZeRO-3
    def _build_zero3(self, model: dict, model_files: list[FileInfo], optim_files: list[FileInfo]) -> None:
        sub_groups = _param_shape_groups(model.get("param_shapes"))
        if sub_groups is None:
            raise UnsupportedCheckpointError(f"the ZeRO-3 model-states file has no 'param_shapes' (written by "
                                             f"{self.written_by()})", path=model_files[0].path)
        first = self._optim[min(self._optim)]
        self.partition_count = _as_int(first.get("partition_count"))
        n = self.partition_count or self.dp_world_size or len(optim_files)
        layout = Zero3Layout.build([list(g.items()) for g in sub_groups], n)
        self.layouts = [layout]
        self._check_rank_files(optim_files, n, "optimizer-state")
        self._check_rank_files(model_files, n, "model-states")
        for r, osd in sorted(self._optim.items()):
            flats = osd.get("fp32_flat_groups")
            if not isinstance(flats, (list, tuple)) or len(flats) != len(layout.sub_group_sizes):
                self.problems.append(f"rank {r}: 'fp32_flat_groups' has {len(flats) if flats else 'no'} sub-groups, "
                                     f"param_shapes has {len(layout.sub_group_sizes)}")
                continue
            for k, (t, want) in enumerate(zip(flats, layout.sub_group_sizes)):
                if not isinstance(t, TensorHandle) or t.numel != want:
                    got = t.numel if isinstance(t, TensorHandle) else type(t).__name__
                    if isinstance(t, TensorHandle) and t.numel == 0 and want:
                        self.problems.append(f"rank {r} sub-group {k}: the fp32 partition is empty (NVMe-offloaded "
                                             "optimizer state is not supported yet)")
                    else:
                        self.problems.append(f"rank {r} sub-group {k}: the fp32 partition holds {got} elements, "
                                             f"{want} are expected from param_shapes at {n} ranks")
        trainable = {}
        for k, group in enumerate(sub_groups):
            for name, shape in group.items():
                trainable[name] = (tuple(shape), k)
        frozen_shapes = {nm: tuple(s) for nm, s in (model.get("frozen_param_shapes") or {}).items()}
        # every rank's model file holds its chunk of each frozen parameter
        by_rank: dict[int, dict] = {}
        for f in model_files:
            tf = self._file(f)
            if tf is not None and f.dp_rank is not None and isinstance(tf.obj, dict):
                by_rank[f.dp_rank] = tf.obj.get("frozen_param_fragments") or {}
                if f.dp_rank == 0 or not model.get("shared_params"):
                    model.setdefault("shared_params", tf.obj.get("shared_params"))
        self._frozen_source = {}
        for name in frozen_shapes:
            chunks = [by_rank.get(r, {}).get(name) for r in range(n)]
            if all(isinstance(c, TensorHandle) for c in chunks):
                self._frozen_source[name] = chunks
            else:
                self.problems.append(f"frozen parameter {name}: chunks missing on some ranks")
        self._collect_parameters(model, trainable, frozen_shapes)

    # ---------------------------------------------------------------- stage 0
    def _build_stage0(self, model: dict) -> None:
        module = model.get("module") or {}
        buffers = set(model.get("buffer_names") or [])
        opt = model.get("optimizer")
        aliases = _aliases_by_storage(module, buffers)
        names = [n for n, t in module.items() if isinstance(t, TensorHandle) and n not in buffers and n not in aliases]
        # which parameters does the optimizer hold, in which group? Match shapes in model order.
        groups = _stage0_group_shapes(opt)
        trainable: dict[str, tuple] = {}
        if groups is None:
            for n in names:
                trainable[n] = (tuple(module[n].shape), 0)
        else:
            taken: set = set()
            for g, shapes in enumerate(groups):
                pos = 0
                for i, shape in enumerate(shapes):
                    while pos < len(names) and (names[pos] in taken or tuple(module[names[pos]].shape) != shape):
                        pos += 1
                    if pos == len(names):
                        self.problems.append(f"stage 0: optimizer group {g} entry {i} of shape {list(shape)} "
                                             "matches no parameter of the module")
                        break
                    taken.add(names[pos])
                    trainable[names[pos]] = (shape, g)
                    self._stage0_index[names[pos]] = (g, i)
        model = dict(model)
        model["shared_params"] = aliases
        self._collect_parameters(model, trainable, {}, frozen_from_module=True)

    # ---------------------------------------------------------------- shared
    def _collect_parameters(self, model: dict, trainable: dict, frozen_shapes: dict,
                            frozen_from_module: bool = False) -> None:
        module = model.get("module") or {}
        buffers = set(model.get("buffer_names") or [])
        shared = dict(model.get("shared_params") or {})
        params: list[ParameterInfo] = []
        seen = set()
        names = [n for n in module if n not in buffers] if module else []
        names += [n for n in list(trainable) + list(frozen_shapes) if n not in names]
        for name in names:
            seen.add(name)
            if name in shared and shared[name] != name:
                params.append(ParameterInfo(name=name, shape=(), trainable=False, tied_to=shared[name]))
                continue
            t = module.get(name)
            stored = dtype_name(t.dtype) if isinstance(t, TensorHandle) else None
            if name in trainable:
                shape, g = trainable[name]
                params.append(ParameterInfo(name=name, shape=shape, trainable=True, group=g, stored_dtype=stored))
            elif name in frozen_shapes:
                params.append(ParameterInfo(name=name, shape=frozen_shapes[name], trainable=False, stored_dtype=stored))
            elif isinstance(t, TensorHandle):
                # a frozen parameter that only the 16-bit module weights hold (ZeRO-1, stage 0)
                if self.zero_stage == 3:
                    self.problems.append(f"parameter {name} is in the module but neither trainable nor frozen "
                                         "data for it was saved")
                    continue
                params.append(ParameterInfo(name=name, shape=tuple(t.shape), trainable=False, stored_dtype=stored))
                self._frozen_source[name] = [t]
        by_name = {p.name: p for p in params}
        for p in params:
            if p.tied_to is not None:
                owner = by_name.get(p.tied_to)
                if owner is None:
                    self.problems.append(f"tied parameter {p.name} refers to {p.tied_to}, which is not saved")
                else:
                    p.shape, p.trainable, p.stored_dtype = owner.shape, owner.trainable, owner.stored_dtype
        self.parameters = params

    def _find_buffers(self, model: dict) -> None:
        module = model.get("module") or {}
        for name in model.get("buffer_names") or []:
            t = module.get(name)
            if isinstance(t, TensorHandle):
                self.buffers.append(BufferInfo(name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype)))

    def _find_optimizer(self, model: dict) -> None:
        if self.flavor == NO_ZERO:
            opt = model.get("optimizer")
            if not isinstance(opt, dict):
                return
            inner = opt.get("optimizer_state_dict") if "optimizer_state_dict" in opt else opt
            wrapper = "FP16_Optimizer" if "fp32_groups" in opt else "torch optimizer"
            base = inner if isinstance(inner, dict) else {}
            scale = opt.get("cur_scale")
        else:
            osd = self._optim[min(self._optim)]
            if self.flavor == BF16_OPTIMIZER:
                wrapper, base = "BF16_Optimizer", osd.get("base_optimizer_state")
            elif self.zero_stage == 3:
                wrapper, base = "DeepSpeedZeroOptimizer_Stage3", osd.get("optimizer_state_dict")
            else:
                wrapper, base = "DeepSpeedZeroOptimizer", osd.get("base_optimizer_state")
            scaler = osd.get("loss_scaler")
            scale = getattr(scaler, "cur_scale", None)
        state, groups = {}, []
        if isinstance(base, dict):
            state = base.get("state") or {}
            groups = [{k: v for k, v in g.items() if k != "params"} for g in base.get("param_groups") or []]
        elif isinstance(base, list):  # elastic ZeRO-1/2: one dict of stripped tensors per group
            state = dict(enumerate(base))
        keys, step = [], None
        for s in state.values():
            if isinstance(s, dict):
                keys = [k for k in s if k != "step"]
                step = s.get("step")
                break
        if step is None and self.flavor != NO_ZERO:
            step = self._optim[min(self._optim)].get("base_optimizer_state_step")
        if isinstance(step, TensorHandle):
            step = step.read().item() if step.numel == 1 else None
        self.optimizer = OptimizerInfo(wrapper=wrapper, state_keys=keys,
                                       step=int(step) if step is not None else None,
                                       param_groups=[_plain(g) for g in groups],
                                       loss_scale=float(scale) if isinstance(scale, (int, float)) else None)

    def _check_rank_files(self, files: list[FileInfo], n: Optional[int], what: str) -> None:
        ranks = sorted(f.dp_rank for f in files if f.dp_rank is not None)
        if n is None:
            return
        missing = sorted(set(range(n)) - set(ranks))
        extra = sorted(r for r in set(ranks) if r >= n)
        if missing:
            self.problems.append(f"missing {what} files for dp rank(s) {', '.join(map(str, missing))} "
                                 f"(the checkpoint was saved by {n} ranks); a rank did not finish saving")
        if extra:
            self.problems.append(f"extra {what} files for dp rank(s) {', '.join(map(str, extra))}: the checkpoint "
                                 f"has {n} partitions; these are probably left over from another run")
        if self.dp_world_size is not None and self.dp_world_size != n:
            self.problems.append(f"partition_count {n} differs from the model file's dp_world_size "
                                 f"{self.dp_world_size}")

    # ================================================================== reading values
    def param(self, name: str) -> ParameterInfo:
        for p in self.parameters:
            if p.name == name:
                return p
        raise KeyError(f"no parameter named {name!r} in {self.location.tag_dir}")

    def pieces(self, name: str) -> list[Piece]:
        """Where the fp32 master of a trainable parameter lives (see :mod:`ckptlib.layout`)."""
        p = self.param(name)
        if p.tied_to:
            return self.pieces(p.tied_to)
        if not p.trainable or self.flavor == NO_ZERO:
            return []
        if self.zero_stage == 3:
            return self.layouts[0].pieces(name)
        return self.layouts[p.group].pieces(name)

    def _require_readable(self) -> None:
        if self.problems:
            raise IncompleteCheckpointError(
                "cannot read values from this checkpoint: " + "; ".join(self.problems),
                path=self.location.tag_dir,
                hint="`ckpt inspect` lists the problems; use another tag (--tag) or restore the files named")

    def _rank_tensor(self, rank: int, group: int, key: Optional[str] = None) -> TensorHandle:
        osd = self._optim.get(rank)
        if osd is None:
            raise IncompleteCheckpointError(f"the optimizer-state file of dp rank {rank} is missing",
                                            path=self.location.tag_dir)
        if key is None:
            name = "fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"
            return osd[name][group]
        if self.zero_stage == 3:
            state = osd["optimizer_state_dict"]["state"]
        else:
            base = osd["base_optimizer_state"]
            state = base["state"] if isinstance(base, dict) else dict(enumerate(base))
        try:
            return state[group][key]
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"the optimizer state has no '{key}' for group {group} on rank {rank}") from None

    # ---------------------------------------------------------------- where the bytes are
    def sources(self, name: str, key: Optional[str] = None) -> list[SourceRange]:
        """The stored ranges that, concatenated, give parameter ``name`` flattened (metadata only).

        ``key`` None: the fp32 master (trainable), the stored 16-bit/fp32 value (frozen) or the
        buffer itself; otherwise the optimizer state ``key`` (e.g. ``"exp_avg"``). A tied alias gives
        its owner's ranges. Readers (:meth:`read_param`, the exporters) read exactly these bytes.
        """
        self._require_readable()
        if any(b.name == name for b in self.buffers) and key is None:
            h = self._model["module"][name]
            return [SourceRange(h, 0, h.numel)]
        p = self.param(name)
        if p.tied_to:
            return self.sources(p.tied_to, key)
        if not p.trainable:
            if key is not None:
                raise KeyError(f"parameter {name} is frozen and has no optimizer state")
            return self._frozen_sources(p)
        if self.flavor == NO_ZERO:
            return [SourceRange(self._stage0_handle(p, key), 0, p.numel)]
        return [SourceRange(self._rank_tensor(pc.rank, pc.group, key), pc.rank_start, pc.count)
                for pc in self.pieces(name)]

    def _frozen_sources(self, p: ParameterInfo) -> list[SourceRange]:
        chunks = self._frozen_source.get(p.name)
        if not chunks:
            raise IncompleteCheckpointError(f"no data was saved for frozen parameter {p.name} "
                                            "(saved with exclude_frozen_parameters?)", path=self.location.tag_dir)
        out, pos = [], 0
        for h in chunks:  # ZeRO-3: one ceil(numel/N) chunk per rank, the last ones padded
            n = min(h.numel, p.numel - pos)
            if n > 0:
                out.append(SourceRange(h, 0, n))
            pos += max(n, 0)
        if pos < p.numel:
            raise IncompleteCheckpointError(f"frozen parameter {p.name}: {pos} of {p.numel} elements saved",
                                            path=self.location.tag_dir)
        return out

    def _stage0_handle(self, p: ParameterInfo, key: Optional[str]) -> TensorHandle:
        opt = self._model.get("optimizer") or {}
        g, i = self._stage0_index.get(p.name, (None, None))
        if key is None:
            if "fp32_groups" in opt and g is not None:
                return opt["fp32_groups"][g][i]
            return self._model["module"][p.name]
        if g is None:
            raise KeyError(f"no optimizer state is known for {p.name}")
        inner = opt.get("optimizer_state_dict", opt)
        pid = inner["param_groups"][g]["params"][i]
        try:
            return inner["state"][pid][key]
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"the optimizer state has no '{key}' for {p.name}") from None

    def _assemble(self, shape: tuple, ranges: list[SourceRange], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(sum(r.count for r in ranges), dtype=dtype)
        pos = 0
        for r in ranges:
            dst = out[pos:pos + r.count]
            if r.handle.dtype == dtype:
                r.handle.read_flat(r.start, r.count, out=dst)
            else:
                dst.copy_(r.handle.read_flat(r.start, r.count))
            pos += r.count
        return out.reshape(shape)

    def read_param(self, name: str) -> torch.Tensor:
        """The full fp32 value of parameter ``name``, assembled from its rank pieces.

        Trainable parameters come from the fp32 master partitions; frozen ones from their stored 16-bit
        (or fp32) values, upcast; a tied alias gives its owner's value. Only the bytes of this
        parameter's pieces are read. Memory: the fp32 result (4 bytes per element) plus, for 16-bit
        sources, one piece in the stored dtype.
        """
        return self._assemble(self.param(name).shape, self.sources(name), torch.float32)

    def read_state(self, name: str, key: str) -> torch.Tensor:
        """The full value of optimizer state ``key`` (e.g. ``"exp_avg"``) of a trainable parameter, as fp32.

        Memory: the result plus one piece.
        """
        return self._assemble(self.param(name).shape, self.sources(name, key), torch.float32)

    def read_buffer(self, name: str) -> torch.Tensor:
        """A persistent buffer, exactly as saved (its own dtype). Memory: the buffer."""
        b = self.buffer(name)
        return self._assemble(b.shape, self.sources(name), self._model["module"][name].dtype)

    def buffer(self, name: str) -> BufferInfo:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"no buffer named {name!r} in {self.location.tag_dir}")

    def state_dict_names(self) -> list[str]:
        """Parameter and buffer names in the module's ``state_dict`` order (tied aliases included)."""
        module = self._model.get("module") or {}
        known = {p.name for p in self.parameters} | {b.name for b in self.buffers}
        names = [n for n in module if n in known]
        return names + [n for n in [p.name for p in self.parameters] + [b.name for b in self.buffers]
                        if n not in set(names)]

    # ================================================================== files as objects
    def model_states_file(self, dp_rank: Optional[int] = None) -> TorchFile:
        """The (opened) model-states file: ZeRO-1/2's single one, or ZeRO-3 rank ``dp_rank``'s."""
        for f in self._files_of(fnames.MODEL_STATES):
            if dp_rank is None or f.dp_rank == dp_rank:
                tf = self._file(f)
                if tf is not None:
                    return tf
        raise IncompleteCheckpointError(f"no readable model-states file for dp rank {dp_rank}",
                                        path=self.location.tag_dir)

    def optim_states_file(self, dp_rank: int) -> TorchFile:
        """The (opened) optimizer-states file of ``dp_rank``."""
        for f in self._files_of(fnames.OPTIM_STATES):
            if f.dp_rank == dp_rank:
                tf = self._file(f)
                if tf is not None:
                    return tf
        raise IncompleteCheckpointError(f"no readable optimizer-states file for dp rank {dp_rank}",
                                        path=self.location.tag_dir)

    @property
    def ds_config(self) -> dict:
        cfg = self._model.get("ds_config")
        return cfg if isinstance(cfg, dict) else {}

    # ================================================================== misc
    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def close(self) -> None:
        for f in self._open.values():
            if f is not None:
                f.close()
        self._open.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.location.tag_dir)!r}, stage={self.zero_stage}, dtype={self.dtype}, "
                f"dp={self.dp_world_size}, params={len(self.parameters)})")


def open_checkpoint(path: str | os.PathLike, tag: Optional[str] = None) -> Checkpoint:
    """Open a DeepSpeed checkpoint for inspection and on-demand reads.

    Args:
        path: the save dir (holds ``latest``), a tag folder, an HF ``checkpoint-N`` folder or a training
            output folder with several ``checkpoint-N`` (the newest is used).
        tag: the tag to use (default: the one ``latest`` names).

    Memory: the pickles of the model- and optimizer-state files (kilobytes); no tensor data is read
    except the optimizer's scalar step.

    Raises:
        NotACheckpointError: nothing that looks like a DeepSpeed checkpoint is at ``path``.
        UnsupportedCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError.
    """
    return Checkpoint(locate(path, tag))


# ---------------------------------------------------------------------------------------------------- helpers
def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _as_int(v: Any) -> Optional[int]:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _as_str(v: Any) -> Optional[str]:
    return str(v) if v is not None else None


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


def _version_tuple(v: Optional[str]) -> Optional[tuple]:
    """``"0.10.3"`` -> ``(0, 10, 3)``; ``"0.16.9+abc"`` -> ``(0, 16, 9)``; None if it does not parse."""
    if not v:
        return None
    parts = []
    for piece in str(v).split("+")[0].split(".")[:3]:
        digits = piece[:len(piece) - len(piece.lstrip("0123456789"))]  # leading digits: "0rc1" -> "0"
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


def _param_shape_groups(ps: Any) -> Optional[list[dict]]:
    if ps is None:
        return None
    if isinstance(ps, dict):  # DeepSpeed < 0.5.4: a single OrderedDict
        return [dict(ps)]
    return [dict(g) for g in ps]


def _aliases_by_storage(module: dict, buffers: set) -> dict[str, str]:
    """Parameters sharing storage, offset and shape with an earlier one (stage 0 ties)."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, t in module.items():
        if not isinstance(t, TensorHandle) or name in buffers:
            continue
        key = (t.storage.key, t.storage_offset, tuple(t.shape), tuple(t.stride))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _stage0_group_shapes(opt: Any) -> Optional[list[list[tuple]]]:
    """Shapes of the parameters each optimizer group holds, in order (stage 0)."""
    if not isinstance(opt, dict):
        return None
    if "fp32_groups" in opt:
        return [[tuple(t.shape) for t in g] for g in opt["fp32_groups"]]
    inner = opt.get("optimizer_state_dict", opt)
    state, groups = inner.get("state") or {}, inner.get("param_groups") or []
    out = []
    for g in groups:
        shapes = []
        for pid in g.get("params", []):
            s = state.get(pid) or {}
            t = next((v for k, v in s.items() if k != "step" and isinstance(v, TensorHandle)), None)
            if t is None:
                return None  # no state to learn shapes from
            shapes.append(tuple(t.shape))
        out.append(shapes)
    return out
