"""The model of one DeepSpeed checkpoint: its records, and reads on demand.

:func:`open_checkpoint` locates the checkpoint, opens the pickles of its model-state and optimizer-state
files (a few KB each; no tensor bytes) and parses them into records (:mod:`ckptlib.deepspeed.parse`).
:class:`Checkpoint` holds those records and reads values: the converters use its partition API
(:meth:`Checkpoint.partition_tensor`, :meth:`Checkpoint.frozen_chunks`, :meth:`Checkpoint.sources`), in
which a rank is a coordinate of the run's mesh (:class:`~ckptlib.mesh.Rank`). Tensor values are read
only when asked for, and then only the bytes of the pieces needed.
"""
from __future__ import annotations

import os
from typing import Optional

from ..errors import IncompleteCheckpointError, UnsupportedCheckpointError
from ..layout import Piece
from ..mesh import Rank
from ..plan import SourceRef
from ..ranges import StoredRange
from ..sources import SourceFiles, stamp
from ..streaming import read_ranges
from ..torchzip import TensorHandle, TorchFile
from . import files as fnames
from .discovery import Location, locate
from .fileset import OpenedFiles
from .parse import parse
from .records import NO_ZERO, BufferInfo, ParameterInfo, Records
from .releases import written_by


class Checkpoint:
    """A DeepSpeed checkpoint (one tag), known from its metadata.

    Use :func:`open_checkpoint` to make one. Opening reads the pickles only (a few KB per file), so it is
    cheap whatever the model size; values are read by :meth:`read_param`, :meth:`read_buffer` and
    :meth:`read_state`, each reading only the pieces of that tensor.

    Attributes:
        location: where it is (save dir, tag, tags, ``latest``).
        records: everything parsing found (:class:`~ckptlib.deepspeed.records.Records`); its fields are
            also attributes of the checkpoint: ``files`` (the tag folder's files with their roles),
            ``zero_stage`` (0-3), ``flavor`` (``"zero"``, ``"bf16_optimizer"``, ``"no_zero"``), ``dtype``
            (``"fp32"``, ``"bf16"``, ``"fp16"``), ``dp_world_size``, ``mp_world_size``,
            ``partition_count``, ``deepspeed_version``, ``quirks`` (how the format differs from what
            DeepSpeed 0.19.8 writes), ``optimizer``, ``parameters`` (model order, tied aliases included),
            ``buffers``, ``layouts`` (one :class:`~ckptlib.layout.FlatGroupLayout` per ZeRO-1/2 group, or
            one :class:`~ckptlib.layout.Zero3Layout`; empty at stage 0).
        problems: what is wrong or suspicious, one readable sentence each.
        notes: how the checkpoint was found and read, for the user.
        stats: bytes read from the checkpoint so far.
    """

    def __init__(self, location: Location):
        self.location = location
        self.notes: list[str] = list(location.notes)
        self.problems: list[str] = []
        self._files = OpenedFiles(location, self.problems)
        self._reader = SourceFiles(self._files.stats)
        try:
            self.records: Records = parse(self._files, self.notes, self.problems)
        except BaseException:
            self._files.close()
            raise

    # ================================================================== the records
    files = property(lambda self: self.records.files)
    zero_stage = property(lambda self: self.records.zero_stage)
    flavor = property(lambda self: self.records.flavor)
    dtype = property(lambda self: self.records.dtype)
    dp_world_size = property(lambda self: self.records.dp_world_size)
    mp_world_size = property(lambda self: self.records.mp_world_size)
    partition_count = property(lambda self: self.records.partition_count)
    deepspeed_version = property(lambda self: self.records.deepspeed_version)
    optimizer = property(lambda self: self.records.optimizer)
    parameters = property(lambda self: self.records.parameters)
    buffers = property(lambda self: self.records.buffers)
    layouts = property(lambda self: self.records.layouts)
    quirks = property(lambda self: self.records.quirks)
    ds_config = property(lambda self: self.records.ds_config)
    stats = property(lambda self: self._files.stats)

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
                         dtype=self.dtype, dp_world_size=self.dp_world_size, partition_count=self.partition_count,
                         total_bytes=self.total_bytes, stamps=tuple(stamp(os.fspath(f.path)) for f in self.files))

    def param(self, name: str) -> ParameterInfo:
        for p in self.parameters:
            if p.name == name:
                return p
        raise KeyError(f"no parameter named {name!r} in {self.location.tag_dir}")

    def buffer(self, name: str) -> BufferInfo:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"no buffer named {name!r} in {self.location.tag_dir}")

    def state_dict_names(self) -> list[str]:
        """Parameter and buffer names in the module's ``state_dict`` order (tied aliases included)."""
        known = {p.name for p in self.parameters} | {b.name for b in self.buffers}
        names = [n for n in self.records.index.module if n in known]
        seen = set(names)
        return names + [n for n in [p.name for p in self.parameters] + [b.name for b in self.buffers]
                        if n not in seen]

    def check_readable(self) -> None:
        """Raise if any problem was found: values of a checkpoint with problems are not read (they could be
        wrong). :class:`UnsupportedCheckpointError` when a layout ckptlib does not read is among them
        (pipeline, MoE, NVMe offload), else :class:`IncompleteCheckpointError`; both list every problem."""
        if self.records.unsupported:
            raise UnsupportedCheckpointError(
                "this kind of checkpoint cannot be read yet: " + "; ".join(self.problems), path=self.location.tag_dir,
                hint="`ckpt inspect` shows what was found; please report this kind of checkpoint")
        if self.problems:
            raise IncompleteCheckpointError(
                "cannot read values from this checkpoint: " + "; ".join(self.problems), path=self.location.tag_dir,
                hint="`ckpt inspect` lists the problems; use another tag (--tag) or restore the files named")

    # ================================================================== the partition API
    def pieces(self, name: str) -> list[Piece]:
        """Where the fp32 master of a trainable parameter lives (see :mod:`ckptlib.layout`); ``Piece.rank``
        is the data rank."""
        p = self.param(name)
        if p.tied_to:
            return self.pieces(p.tied_to)
        if not p.trainable or self.flavor == NO_ZERO:
            return []
        if self.zero_stage == 3:
            return self.layouts[0].pieces(name)
        return self.layouts[p.group].pieces(name)

    def partition_tensor(self, rank: Rank, group: int, state: Optional[str] = None) -> TensorHandle:
        """The flat tensor of ``rank``'s partition of ``group`` (ZeRO-1/2: the parameter group; ZeRO-3: the
        sub-group): the fp32 master when ``state`` is None, else the optimizer state ``state``
        (e.g. ``"exp_avg"``). Metadata only."""
        osd = self.records.index.optim.get(rank)
        if osd is None:
            raise IncompleteCheckpointError(f"the optimizer-state file of {rank} is missing",
                                            path=self.location.tag_dir)
        if state is None:
            return osd["fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"][group]
        if self.zero_stage == 3:
            states = osd["optimizer_state_dict"]["state"]
        else:
            base = osd["base_optimizer_state"]
            states = base["state"] if isinstance(base, dict) else dict(enumerate(base))
        try:
            return states[group][state]
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"the optimizer state has no '{state}' for group {group} on {rank}") from None

    def optimizer_state_dict(self, rank: Rank) -> dict:
        """``rank``'s ``optimizer_state_dict`` as unpickled (tensors are handles)."""
        osd = self.records.index.optim.get(rank)
        if osd is None:
            raise IncompleteCheckpointError(f"the optimizer-state file of {rank} is missing or unreadable",
                                            path=self.location.tag_dir)
        return osd

    def frozen_chunks(self, name: str) -> list[TensorHandle]:
        """The stored chunks of frozen parameter ``name`` in rank order (one tensor, except at ZeRO-3 where
        each rank holds ``ceil(numel/N)`` elements, the last ones padded)."""
        chunks = self.records.index.frozen.get(name)
        if not chunks:
            raise IncompleteCheckpointError(f"no data was saved for frozen parameter {name} "
                                            "(saved with exclude_frozen_parameters?)", path=self.location.tag_dir)
        return list(chunks)

    def module_tensor(self, name: str) -> TensorHandle:
        """Entry ``name`` of the model-states file's ``module`` (a buffer, or a 16-bit weight)."""
        t = self.records.index.module.get(name)
        if not isinstance(t, TensorHandle):
            raise KeyError(f"the module has no tensor named {name!r} in {self.location.tag_dir}")
        return t

    def sources(self, name: str, key: Optional[str] = None) -> list[StoredRange]:
        """The stored ranges that, concatenated, give parameter ``name`` flattened (metadata only).

        ``key`` None: the fp32 master (trainable), the stored 16-bit/fp32 value (frozen) or the buffer
        itself; otherwise the optimizer state ``key`` (e.g. ``"exp_avg"``). A tied alias gives its
        owner's ranges. Readers (:meth:`read_param`, the exporters) read exactly these bytes.
        """
        self.check_readable()
        if key is None and any(b.name == name for b in self.buffers):
            return self.module_tensor(name).ranges()
        p = self.param(name)
        if p.tied_to:
            return self.sources(p.tied_to, key)
        if not p.trainable:
            if key is not None:
                raise KeyError(f"parameter {name} is frozen and has no optimizer state")
            return self._frozen_ranges(p)
        if self.flavor == NO_ZERO:
            return self._stage0_handle(p, key).ranges(0, p.numel)
        out: list[StoredRange] = []
        for pc in self.pieces(name):
            out += self.partition_tensor(Rank(dp=pc.rank), pc.group, key).ranges(pc.rank_start, pc.count)
        return out

    def _frozen_ranges(self, p: ParameterInfo) -> list[StoredRange]:
        out, pos = [], 0
        for h in self.frozen_chunks(p.name):  # ZeRO-3: one ceil(numel/N) chunk per rank, the last ones padded
            n = min(h.numel, p.numel - pos)
            if n > 0:
                out += h.ranges(0, n)
            pos += max(n, 0)
        if pos < p.numel:
            raise IncompleteCheckpointError(f"frozen parameter {p.name}: {pos} of {p.numel} elements saved",
                                            path=self.location.tag_dir)
        return out

    def _stage0_handle(self, p: ParameterInfo, key: Optional[str]) -> TensorHandle:
        opt = self.records.index.stage0_optimizer or {}
        g, i = self.records.index.stage0.get(p.name, (None, None))
        if key is None:
            if "fp32_groups" in opt and g is not None:
                return opt["fp32_groups"][g][i]
            return self.module_tensor(p.name)
        if g is None:
            raise KeyError(f"no optimizer state is known for {p.name}")
        inner = opt.get("optimizer_state_dict", opt)
        pid = inner["param_groups"][g]["params"][i]
        try:
            return inner["state"][pid][key]
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"the optimizer state has no '{key}' for {p.name}") from None

    # ================================================================== reading values
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
        return self.read_ranges(self.sources(name), self.module_tensor(name).dtype_name).reshape(b.shape)

    # ================================================================== files as objects
    def model_states_file(self, rank: Optional[Rank] = None) -> TorchFile:
        """The (opened) model-states file: ZeRO-1/2's single one (of ``rank``'s tensor rank), or ZeRO-3
        ``rank``'s; the first one when ``rank`` is None."""
        tp = rank.tp if rank is not None else 0
        for f in self._files.of(fnames.MODEL_STATES, mp_rank=tp):
            if rank is None or f.dp_rank is None or f.dp_rank == rank.dp:
                tf = self._files.get(f)
                if tf is not None:
                    return tf
        raise IncompleteCheckpointError(f"no readable model-states file for {rank or 'rank 0'}",
                                        path=self.location.tag_dir)

    def optim_states_file(self, rank: Rank) -> TorchFile:
        """The (opened) optimizer-states file of ``rank``."""
        for f in self._files.of(fnames.OPTIM_STATES, mp_rank=rank.tp):
            if f.dp_rank == rank.dp:
                tf = self._files.get(f)
                if tf is not None:
                    return tf
        raise IncompleteCheckpointError(f"no readable optimizer-states file for {rank}", path=self.location.tag_dir)

    # ================================================================== misc
    def close(self) -> None:
        self._files.close()
        self._reader.close()

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


__all__ = ["Checkpoint", "open_checkpoint"]
