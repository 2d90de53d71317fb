"""The model of one DeepSpeed checkpoint (a tag folder): its ZeRO sets, the full model, reads on demand.

:func:`open_checkpoint` locates the checkpoint, opens the pickles of its files (a few KB each; no tensor
bytes), parses each model-parallel rank's ZeRO set (:mod:`ckptlib.deepspeed.zeroset`) and joins them
into the full model (:mod:`ckptlib.deepspeed.join`): one set for data parallelism, one per stage for a
pipeline, one per tensor rank for tensor parallelism. :class:`Checkpoint` gives the model under the
names the un-parallelised model uses (:attr:`parameters`, :meth:`sources`, :meth:`read_param`), and the
partition API of its sets, where a rank is a coordinate of the mesh (:class:`~ckptlib.mesh.Rank`).
Tensor values are read only when asked for, and then only the bytes of the pieces needed.
"""
from __future__ import annotations

import copy
import os
from typing import Optional, Union

from ..errors import IncompleteCheckpointError, UnsupportedCheckpointError
from ..io.sources import SourceFiles, stamp
from ..io.streaming import read_ranges
from ..io.torchzip import TensorHandle, TorchFile
from ..layout.flat import Piece
from ..layout.ranges import StoredRange
from ..mesh import Rank
from ..plan import SourceRef
from ..system.gcpause import gc_paused
from .autoep import hf_view
from . import files as fnames
from .discovery import Location, locate, repair_hint
from .fileset import OpenedFiles
from .join import PIPELINE, RULES_HINT, join
from .model import ModelView
from .records import BufferInfo, NameIndex, ParameterInfo
from .releases import written_by
from .tensor_parallel import SplitRules, load_rules
from .universal import UniversalSet, join_universal
from .zeroset import ZeroSet


class Checkpoint:
    """A DeepSpeed checkpoint (one tag), known from its metadata.

    Use :func:`open_checkpoint` to make one. Opening reads the pickles only (a few KB per file), so it is
    cheap whatever the model size; values are read by :meth:`read_param`, :meth:`read_buffer` and
    :meth:`read_state`, each reading only the pieces of that tensor.

    Attributes:
        location: where it is (save dir, tag, tags, ``latest``).
        files: the tag folder's files with their roles.
        kind: ``"data_parallel"``, ``"pipeline"`` or ``"tensor_parallel"``; ``mesh``: the sizes of its
            parallel dimensions (``mesh.dp`` is always the data-parallel size); ``sequence_parallel``:
            the Ulysses size (1 without); ``num_experts``: per MoE layer, or None.
        sets: each model-parallel rank's :class:`~ckptlib.deepspeed.zeroset.ZeroSet` (one for data
            parallelism); ``main``: the first. Its records are also attributes of the checkpoint:
            ``zero_stage``, ``flavor``, ``dtype``, ``dp_world_size``, ``mp_world_size``,
            ``partition_count``, ``deepspeed_version``, ``quirks``, ``optimizer``, ``layouts``,
            ``ds_config``.
        parameters, buffers: the full model's (names and shapes as the un-parallelised model has them;
            tied aliases included).
        problems: what is wrong or suspicious, one readable sentence each.
        notes: how the checkpoint was found, read and joined, for the user.
        stats: bytes read from the checkpoint so far.
    """

    def __init__(self, location: Location, tp_rules: Optional[SplitRules] = None):
        self.location = location
        self._params, self._buffers = NameIndex(), NameIndex()
        self.notes: list[str] = list(location.notes)
        self.problems: list[str] = []
        self._files = OpenedFiles(location, self.problems)
        self._reader = SourceFiles(self._files.stats)
        try:
            joined = (join_universal(self._files, self.notes, self.problems) if location.universal else
                      join(self._files, self.notes, self.problems, tp_rules))
            self._files.forget_pickles()
        except IncompleteCheckpointError as e:
            self.close()
            e.hint = repair_hint(location)
            raise
        except BaseException:
            self.close()
            raise
        self.sets: dict[int, ZeroSet] = joined.sets
        self.main: ZeroSet = joined.sets[min(joined.sets)]
        self.kind, self.mesh = joined.kind, joined.mesh
        self.sequence_parallel, self.num_experts = joined.sequence_parallel, joined.num_experts
        self.refusals: list[str] = joined.refusals
        self.tp_rules = tp_rules
        if tp_rules is None and isinstance(self.main, UniversalSet):  # the split rules its info records
            self.tp_rules = self.main.universal.rules
        self.model_type: Optional[str] = None  # see in_layout
        self.layer_stages: dict = {}  # layer file path -> the stage that holds its layer
        for zs in self.sets.values():
            for h in zs.records.index.module.values():
                path = getattr(getattr(getattr(h, "storage", None), "file", None), "path", None)
                if path is not None and fnames.classify(os.path.basename(path)).kind == fnames.LAYER_STATES:
                    self.layer_stages.setdefault(path, zs.coordinate.pp)
        self.view: Optional[ModelView] = joined.view
        if self.view is not None:
            self.view.set_labels = {mp: self.set_label(mp) for mp in self.sets}
            self.notes += [n for n in self.view.notes if n not in self.notes]
        legacy = [f for f, tf in self._files.opened() if tf.format == "legacy"]
        if legacy:
            self.notes.append(f"{len(legacy)} file(s) in torch's legacy serialization "
                              "(\"checkpoint_serialization\": false), read like zip files; they record no CRC-32 "
                              "(nothing for --verify-crc or check to verify) and no archive name (docs/safety.md)")

    # ================================================================== what it is
    records = property(lambda self: self.main.records)
    files = property(lambda self: self._files.files)
    zero_stage = property(lambda self: self.main.zero_stage)
    flavor = property(lambda self: self.main.flavor)
    dtype = property(lambda self: self.main.dtype)
    dp_world_size = property(lambda self: self.main.dp_world_size)
    mp_world_size = property(lambda self: self.main.mp_world_size)
    partition_count = property(lambda self: self.main.partition_count)
    deepspeed_version = property(lambda self: self.main.deepspeed_version)
    optimizer = property(lambda self: self.main.optimizer)
    layouts = property(lambda self: self.main.layouts)
    quirks = property(lambda self: self.main.quirks)
    ds_config = property(lambda self: self.main.ds_config)
    stats = property(lambda self: self._files.stats)

    @property
    def parameters(self) -> list[ParameterInfo]:
        return self.view.parameters if self.view is not None else self.main.parameters

    @property
    def buffers(self) -> list[BufferInfo]:
        return self.view.buffers if self.view is not None else self.main.buffers

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def written_by(self) -> str:
        """"DeepSpeed 0.10.3", or what is known when the files record no version."""
        return written_by(self.deepspeed_version)

    def source_ref(self) -> SourceRef:
        """This checkpoint as a plan's source: folders, a summary, and a stamp of every file (plain data)."""
        return SourceRef(save_dir=os.fspath(self.location.save_dir), tag=self.location.tag,
                         tag_dir=os.fspath(self.location.tag_dir), zero_stage=self.zero_stage, flavor=self.flavor,
                         dtype=self.dtype, dp_world_size=self.mesh.dp, partition_count=self.partition_count,
                         total_bytes=self.total_bytes, stamps=tuple(stamp(os.fspath(f.path)) for f in self.files),
                         tp_rules=self.tp_rules, model_type=self.model_type)

    def param(self, name: str) -> ParameterInfo:
        p = self._params.get(self.parameters, name)
        if p is None:
            raise KeyError(f"no parameter named {name!r} in {self.location.tag_dir}")
        return p

    def buffer(self, name: str) -> BufferInfo:
        b = self._buffers.get(self.buffers, name)
        if b is None:
            raise KeyError(f"no buffer named {name!r} in {self.location.tag_dir}")
        return b

    def state_dict_names(self) -> list[str]:
        """Parameter and buffer names in the model's ``state_dict`` order (tied aliases included)."""
        if self.view is None:
            return self.main.state_dict_names()
        known = {p.name for p in self.parameters} | {b.name for b in self.buffers}
        names = [n for n in self.view.order if n in known]
        seen = set(names)
        return names + [n for n in [p.name for p in self.parameters] + [b.name for b in self.buffers]
                        if n not in seen]

    def in_layout(self, model_type: str) -> "Checkpoint":
        """This checkpoint (the same opened files, sets and reader) with an AutoEP model's experts in the layout of
        transformers' ``model_type`` class (:func:`~ckptlib.deepspeed.autoep.hf_view`); ``model_type`` is recorded
        (:meth:`source_ref`) so that a plan's source opens the same way again. Metadata only.

        Raises:
            UnsupportedCheckpointError: not an AutoEP checkpoint, or a model type whose layout is not known."""
        if not self.records.autoep_layers or self.view is None:
            raise UnsupportedCheckpointError("only an AutoEP checkpoint has a model class's layout to take",
                                             path=self.location.tag_dir)
        other = copy.copy(self)
        other.view = hf_view(self.view, self.records.autoep_layers, model_type)
        other.model_type = model_type
        other._params, other._buffers = NameIndex(), NameIndex()
        return other

    def replicated(self) -> list[str]:
        """Names of the tensors stored whole on more than one tensor rank (compared when read)."""
        if self.view is None:
            return []
        return [n for n, blocks in self.view.blocks.items() if any(b.replicas for b in blocks)]

    def zip_entries(self, every: bool = False) -> dict[str, tuple]:
        """``{path: its zip members as ZipEntry, by offset}`` of the files opened so far; with ``every``, of
        every torch file of the tag folder (those not opened yet are opened: their pickles are read)."""
        if every:
            for f in self.files:
                if f.kind != "other":
                    self._files.get(f)
        return {os.fspath(tf.path): tf.entries for _, tf in self._files.opened()}

    def opened_files(self) -> list:
        """``(FileInfo, TorchFile)`` of every file of the tag folder opened so far (the readable ones)."""
        return self._files.opened()

    def coordinates(self, f) -> dict:
        """Where file ``f`` sits in the mesh: ``stage``, ``tp_rank``, ``dp_rank``, ``ep_rank``, ``layer``,
        ``expert`` (None where the dimension does not apply). A layer file's stage is the stage that holds
        its layer; its tensor rank is the ``-model_YY`` of its name."""
        stage = tp_rank = None
        if f.kind in ("model_states", "optim_states") and f.mp_rank is not None:
            zs = self.sets.get(f.mp_rank)
            if zs is not None:
                stage, tp_rank = zs.coordinate.pp, zs.coordinate.tp
            else:
                stage, tp_rank = divmod(f.mp_rank, self.mesh.tp)
        elif f.kind == "layer_states":
            stage, tp_rank = self.layer_stages.get(os.fspath(f.path)), f.mp_rank
        moe = self.num_experts is not None and f.kind in ("optim_states", "expert_optim_states")
        ep_rank = (f.dp_rank % self.mesh.ep if f.kind == "optim_states" else f.dp_rank) if moe else None
        if f.kind == "expert_states" and f.expert is not None:  # an expert's file: the ep rank holding the expert
            local = self._local_experts(f.layer or 0)
            ep_rank = f.expert // local if local else None
        return {"stage": stage if self.mesh.pp > 1 or self.kind == PIPELINE else None,
                "tp_rank": tp_rank if self.mesh.tp > 1 else None,
                "dp_rank": f.dp_rank if f.kind != "expert_optim_states" else None,
                "ep_rank": ep_rank, "expert": f.expert, "layer": f.layer}

    def _local_experts(self, layer: int) -> Optional[int]:
        """Experts per expert-parallel rank in MoE layer ``layer`` (AutoEP records it; DeepSpeed-MoE: the layer's
        experts over the ep size), or None where not known."""
        for lay in self.records.autoep_layers:
            if lay.layer == layer:
                return lay.num_local
        counts = self.num_experts
        if counts and layer < len(counts) and self.mesh.ep and counts[layer] % self.mesh.ep == 0:
            return counts[layer] // self.mesh.ep
        return None

    def set_label(self, mp: int) -> str:
        """How a ZeRO set is named for the user: ``"stage 1, tensor rank 0"``, ``"stage 1"``, ``"tensor rank 1"``
        or ``""`` (a checkpoint with one set)."""
        if len(self.sets) == 1:
            return ""
        c = self.sets[mp].coordinate
        parts = ([f"stage {c.pp}"] if self.mesh.pp > 1 or self.kind == PIPELINE else []) + \
            ([f"tensor rank {c.tp}"] if self.mesh.tp > 1 else [])
        return ", ".join(parts)

    def check_readable(self) -> None:
        """Raise if values cannot be read: :class:`UnsupportedCheckpointError` for a layout ckptlib does not
        read (or cannot join without rules), else :class:`IncompleteCheckpointError` when problems were
        found (values of a checkpoint with problems could be wrong); both list every reason."""
        unsupported = [u for zs in self.sets.values() for u in zs.records.unsupported]
        if unsupported or self.refusals:
            hint = (RULES_HINT if self.refusals else
                    "`ckpt inspect` shows what was found; please report this kind of checkpoint")
            raise UnsupportedCheckpointError("this kind of checkpoint cannot be read yet: "
                                             + "; ".join(self.refusals + self.problems), path=self.location.tag_dir,
                                             hint=hint)
        if self.problems:
            raise IncompleteCheckpointError(
                "cannot read values from this checkpoint: " + "; ".join(self.problems), path=self.location.tag_dir,
                hint=repair_hint(self.location))

    # ================================================================== the full model
    def sources(self, name: str, key: Optional[str] = None) -> list[StoredRange]:
        """The stored ranges that, concatenated, give tensor ``name`` of the full model flattened (metadata
        only). ``key`` None: the fp32 master (trainable), the stored 16-bit/fp32 value (frozen) or the
        buffer; otherwise the optimizer state ``key`` (e.g. ``"exp_avg"``). A tied alias gives its owner's
        ranges; tensor-parallel shards are joined, a pipeline's stages each give their layers."""
        self.check_readable()
        return self.view.sources(name, key)

    def state_group(self, name: str):
        """What the optimizer group of parameter ``name`` keeps (a :class:`~ckptlib.kinds.optimizers.GroupStates`:
        its optimizer family, keys, step), or None for a frozen parameter or where the groups are not known."""
        return self.view.state_group(name)

    def state_keys(self, name: str) -> tuple:
        """The per-element optimizer state keys parameter ``name`` has: those its group keeps (a Muon matrix
        ``momentum_buffer``, an Adam-stepped parameter of the same run ``exp_avg`` and ``exp_avg_sq``); none for a
        frozen parameter or a buffer."""
        return self.view.state_keys(name)

    def step_of(self, name: str) -> Optional[float]:
        """The optimizer step of trainable parameter ``name``: its group's (a universal checkpoint records one per
        parameter); None where its group counts none."""
        if isinstance(self.main, UniversalSet):
            return self.main.step_of(name)
        gs = self.state_group(name)
        return float(gs.step) if gs is not None and gs.step is not None else None

    @property
    def universal(self):
        """What a universal checkpoint says of its source and what it cannot give
        (:class:`~ckptlib.deepspeed.universal.UniversalInfo`); None for a native one."""
        return self.main.universal if isinstance(self.main, UniversalSet) else None

    def replica_checks(self, name: str, key: Optional[str] = None) -> list[tuple[str, list, list]]:
        """``(what, ranges, replica ranges)`` for each copy of ``name`` that another rank also stores
        (replicated across tensor ranks, or a whole-parameter state held by several data ranks): they must be
        equal, and plans compare them."""
        self.check_readable()
        return self.view.replica_checks(name, key)

    def read_ranges(self, ranges: list, dtype: str):
        """The concatenation of ``ranges`` as a 1-D torch tensor of ``dtype`` (bytes counted in ``stats``).

        Memory: the result, plus one range in its stored dtype when it must be cast."""
        return read_ranges(ranges, dtype, self._reader)

    def read_param(self, name: str):
        """The full fp32 value of parameter ``name``, assembled from its rank pieces.

        Trainable parameters come from the fp32 master partitions; frozen ones from their stored 16-bit
        (or fp32) values, upcast; a tied alias gives its owner's value. Only the bytes of this
        parameter's pieces are read. Memory: the fp32 result (4 bytes per element) plus, for 16-bit
        sources, one piece in the stored dtype.
        """
        return self.read_ranges(self.sources(name), "float32").reshape(self.param(name).shape)

    def read_state(self, name: str, key: str):
        """The full value of optimizer state ``key`` (e.g. ``"exp_avg"``) of a trainable parameter, as fp32.

        Memory: the result plus one piece.
        """
        return self.read_ranges(self.sources(name, key), "float32").reshape(self.param(name).shape)

    def read_buffer(self, name: str):
        """A persistent buffer, exactly as saved (its own dtype). Memory: the buffer."""
        b = self.buffer(name)
        return self.read_ranges(self.sources(name), b.dtype).reshape(b.shape)

    # ================================================================== the partition API (of the sets)
    def mp_of(self, rank: Rank) -> int:
        """The model-parallel rank (``mp_rank_XX`` in file names) of ``rank``'s ZeRO set: ``stage * tp +
        tensor rank`` (DeepSpeed's pipeline grid; the stage alone without a tensor axis, the tensor rank alone
        without stages)."""
        return rank.pp * self.mesh.tp + rank.tp

    def set_of(self, rank: Rank) -> ZeroSet:
        """The ZeRO set that holds ``rank``'s files (its stage and tensor rank)."""
        zs = self.sets.get(self.mp_of(rank))
        if zs is None:
            raise IncompleteCheckpointError(f"no files of {rank} in this checkpoint", path=self.location.tag_dir)
        return zs

    def pieces(self, name: str) -> list[Piece]:
        """Where the fp32 master of a trainable parameter lives in the first set (see :mod:`ckptlib.layout.flat`)."""
        return self.main.pieces(name)

    def partition_tensor(self, rank: Rank, group: int, state: Optional[str] = None) -> TensorHandle:
        """The flat tensor of ``rank``'s partition of ``group``: the fp32 master, or optimizer state ``state``."""
        return self.set_of(rank).partition_tensor(rank, group, state)

    def optimizer_state_dict(self, rank: Rank) -> dict:
        return self.set_of(rank).optimizer_state_dict(rank)

    def frozen_chunks(self, name: str) -> list[TensorHandle]:
        return self.main.frozen_chunks(name)

    def module_tensor(self, name: str) -> TensorHandle:
        return self.main.module_tensor(name)

    def model_states_file(self, rank: Optional[Rank] = None) -> TorchFile:
        return (self.set_of(rank) if rank is not None else self.main).model_states_file(rank)

    def optim_states_file(self, rank: Rank) -> TorchFile:
        return self.set_of(rank).optim_states_file(rank)

    # ================================================================== misc
    def close(self) -> None:
        self._files.close()
        self._reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        mesh = "" if self.kind == "data_parallel" else f", {self.kind} pp={self.mesh.pp} tp={self.mesh.tp}"
        return (f"Checkpoint({str(self.location.tag_dir)!r}, stage={self.zero_stage}, dtype={self.dtype}, "
                f"dp={self.mesh.dp}{mesh}, params={len(self.parameters)})")


@gc_paused
def open_checkpoint(path: str | os.PathLike, tag: Optional[str] = None,
                    tp_rules: Union[str, os.PathLike, SplitRules, None] = None) -> Checkpoint:
    """Open a DeepSpeed checkpoint for inspection and on-demand reads.

    Args:
        path: the save dir (holds ``latest``), a tag folder, an HF ``checkpoint-N`` folder or a training
            output folder with several ``checkpoint-N`` (the newest is used).
        tag: the tag to use (default: the one ``latest`` names).
        tp_rules: for a tensor-parallel checkpoint saved without ``universal_checkpoint_info``: how its
            shards join (a JSON file with the same keys, or :class:`SplitRules`).

    Memory: the pickles of the model- and optimizer-state files (kilobytes); no tensor data is read
    except the optimizer's scalar step.

    Raises:
        NotACheckpointError: nothing that looks like a DeepSpeed checkpoint is at ``path``.
        UnsupportedCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError.
    """
    rules = tp_rules if isinstance(tp_rules, SplitRules) or tp_rules is None else load_rules(tp_rules)
    return Checkpoint(locate(path, tag), rules)


__all__ = ["Checkpoint", "open_checkpoint"]
