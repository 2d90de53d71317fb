"""One model-parallel rank's ZeRO set: its records, and the partition API over it (reading only).

A data-parallel run has one ZeRO set; a pipeline run one per stage, a tensor-parallel run one per
tensor rank (files ``*_mp_rank_{mp:02d}_*``). :class:`ZeroSet` reads one of them in its own terms: its
parameters under the names and shapes its files use (a tensor rank's shards, a stage's layers),
where their fp32 masters and optimizer states lie in the rank files, and the bytes of each
(:meth:`ZeroSet.sources`). Ranks are coordinates of the mesh (:class:`~ckptlib.mesh.Rank`): the set
fills in its own stage or tensor rank. :class:`~ckptlib.deepspeed.Checkpoint` joins the sets into the
full model.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..errors import IncompleteCheckpointError, MissingEntryError, UnsupportedCheckpointError
from ..io.torchzip import TensorHandle, TorchFile
from ..kinds.optimizers import WHOLE_PARAMS, StateKey
from .states import placed_key
from ..layout.flat import Piece
from ..layout.ranges import StoredRange, Zeros
from ..mesh import Rank
from . import files as fnames
from .fileset import OpenedFiles
from .records import NO_ZERO, BufferInfo, NameIndex, ParameterInfo, Records
from .releases import written_by


#: the ``key`` of :meth:`ZeroSet.sources` that asks for a parameter's stored 16-bit (module) value
MODULE = "<module>"


class ZeroSet:
    """The ZeRO set of model-parallel rank ``mp`` (see the module docstring).

    Attributes:
        mp: the model-parallel rank (file names' ``mp_rank``); ``coordinate`` is the mesh point of its
            data rank 0 (``Rank(pp=mp)`` for a pipeline stage, ``Rank(tp=mp)`` otherwise).
        records: what parsing its files found; its fields are also attributes: ``zero_stage``,
            ``flavor``, ``dtype``, ``dp_world_size``, ``partition_count``, ``optimizer``,
            ``parameters``, ``buffers``, ``layouts``, ``ds_config``, ``files`` (this set's files).
    """

    def __init__(self, records: Records, mp: int, files: OpenedFiles, coordinate: Rank):
        self.records, self.mp, self.coordinate = records, mp, coordinate
        self.location = files.location
        self._files = files
        self._ranks: dict[int, Rank] = {}
        self._flats: dict[tuple, tuple] = {}  # (dp, group, state) -> (partition tensor, its flat_base())
        self._params, self._buffers = NameIndex(), NameIndex()

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

    @property
    def files(self) -> list:
        """This set's files (model states, optimizer states) in the tag folder."""
        return [f for f in self.records.files if (f.mp_rank or 0) == self.mp and
                f.kind in (fnames.MODEL_STATES, fnames.OPTIM_STATES)]

    def rank(self, dp: int) -> Rank:
        """The mesh coordinate of this set's data rank ``dp``."""
        r = self._ranks.get(dp)
        if r is None:
            r = self._ranks[dp] = dataclasses.replace(self.coordinate, dp=dp)
        return r

    def written_by(self) -> str:
        return written_by(self.deepspeed_version)

    def param(self, name: str) -> ParameterInfo:
        p = self._params.get(self.parameters, name)
        if p is None:
            raise KeyError(f"no parameter named {name!r} in {self.location.tag_dir} (mp rank {self.mp})")
        return p

    def buffer(self, name: str) -> BufferInfo:
        b = self._buffers.get(self.buffers, name)
        if b is None:
            raise KeyError(f"no buffer named {name!r} in {self.location.tag_dir} (mp rank {self.mp})")
        return b

    def state_dict_names(self) -> list[str]:
        """Parameter and buffer names in the module's ``state_dict`` order (tied aliases included)."""
        known = {p.name for p in self.parameters} | {b.name for b in self.buffers}
        names = [n for n in self.records.index.module if n in known]
        seen = set(names)
        return names + [n for n in [p.name for p in self.parameters] + [b.name for b in self.buffers]
                        if n not in seen]

    # ================================================================== the partition API
    def pieces(self, name: str, key: Optional[str] = None) -> list[Piece]:
        """Where the fp32 master of a trainable parameter lives (see :mod:`ckptlib.layout.flat`), or its optimizer
        state ``key`` (the same pieces, but for a key kept per whole parameter: Muon's momentum at ZeRO-1/2,
        which lies whole on the first rank that holds it); ``Piece.rank`` is the data rank in this set."""
        p = self.param(name)
        if p.tied_to:
            return self.pieces(p.tied_to, key)
        if not p.trainable or self.flavor == NO_ZERO:
            return []
        whole = key not in (None, MODULE) and self.state_key(p, key).layout == WHOLE_PARAMS
        if self.zero_stage == 3:
            members = self.records.index.zero3_members.get(name)  # AutoEP's experts: an ep rank's partitions
            pieces = self.layouts[0].pieces(name)
            return [dataclasses.replace(pc, rank=members[pc.rank]) for pc in pieces] if members else pieces
        return self._placed(p, whole)[:1] if whole else self._placed(p, False)

    def _placed(self, p: ParameterInfo, whole: bool) -> list[Piece]:
        """``p``'s pieces in its flat group (``whole``: one piece per rank whose whole-parameter state holds it),
        ranks as this set numbers them (an expert's partitions lie on its ep rank's expert data group)."""
        expert = self.records.index.experts.get(p.name)
        g, local = (expert[0], expert[2]) if expert is not None else (p.group, p.name)
        lay = self.layouts[g]
        pieces = ([Piece(rank=k, group=g, rank_start=at, param_start=0, count=p.numel)
                   for k, at in lay.whole_param_places(local)] if whole else lay.pieces(local))
        if expert is None:
            return pieces
        eg = self.records.expert_groups[g]
        return [dataclasses.replace(pc, rank=eg.data_rank(expert[1], pc.rank)) for pc in pieces]

    def state_group(self, name: str):
        """What the optimizer group of trainable parameter ``name`` keeps (a
        :class:`~ckptlib.kinds.optimizers.GroupStates`), or None (frozen, no optimizer, groups not known)."""
        p = self.param(name)
        if p.tied_to:
            return self.state_group(p.tied_to)
        if not p.trainable or self.optimizer is None:
            return None
        if self.flavor == NO_ZERO:
            where = self.records.index.stage0.get(p.name)
            return self.optimizer.group(where[0]) if where else None
        return self.optimizer.group(p.group)

    def state_keys(self, name: str) -> tuple:
        """The per-element optimizer state keys parameter ``name`` has (those of its group); none for a frozen one."""
        p = self.param(name)
        if p.tied_to:
            return self.state_keys(p.tied_to)
        if not p.trainable or self.optimizer is None:
            return ()
        gs = self.state_group(name)
        if gs is not None:
            return gs.key_names
        return () if self.optimizer.groups else tuple(self.optimizer.state_keys)

    def state_key(self, p: ParameterInfo, key: str) -> StateKey:
        """How state ``key`` of trainable parameter ``p`` is kept (:func:`~ckptlib.deepspeed.states.placed_key`)."""
        return placed_key(self.optimizer, p.group, p.name, key, self.location.tag_dir)

    def state_replicas(self, name: str, key: Optional[str]) -> list[tuple[str, list, list]]:
        """``(what, ranges, replica ranges)`` for each further rank that holds the whole state ``key`` of
        ``name`` (Muon's momentum of a matrix that straddles partitions, at ZeRO-1/2): the copies must be equal."""
        if key in (None, MODULE) or self._params.get(self.parameters, name) is None:
            return []
        p = self.param(name)
        if p.tied_to or not p.trainable or self.flavor == NO_ZERO or self.zero_stage == 3:
            return []
        try:
            if self.state_key(p, key).layout != WHOLE_PARAMS:
                return []
        except (KeyError, UnsupportedCheckpointError):
            return []
        places = self._placed(p, True)
        first = self.piece_ranges(places[:1], key)
        return [(f"{name}/{key}: dp rank {places[0].rank} and dp rank {pc.rank}", first,
                 self.piece_ranges([pc], key)) for pc in places[1:]]

    def optimizer_state_dict(self, rank: Rank) -> dict:
        """``rank``'s ``optimizer_state_dict`` as unpickled (tensors are handles)."""
        osd = self.records.index.optim.get(rank)
        if osd is None:
            raise IncompleteCheckpointError(f"the optimizer-state file of {rank} is missing or unreadable",
                                            path=self._optim_path(rank))
        return osd

    def partition_tensor(self, rank: Rank, group: int, state: Optional[str] = None) -> TensorHandle:
        """The flat tensor of ``rank``'s partition of ``group`` (ZeRO-1/2: the parameter group; ZeRO-3: the
        sub-group): the fp32 master when ``state`` is None, else the optimizer state ``state``
        (e.g. ``"exp_avg"``). Metadata only. A partition swapped to NVMe is a
        :class:`~ckptlib.io.rawfile.RawTensor` in its swap file (see :mod:`ckptlib.deepspeed.offload`)."""
        swapped = self.records.index.swapped.get((rank.dp, group)) if self.zero_stage == 3 else None
        if swapped is not None and state in swapped:
            return swapped[state]
        osd = self.optimizer_state_dict(rank)
        try:
            if state is None:
                t = osd["fp32_flat_groups" if self.zero_stage == 3 else "single_partition_of_fp32_groups"][group]
            else:
                if self.zero_stage == 3:
                    states = osd["optimizer_state_dict"]["state"]
                else:
                    base = osd["base_optimizer_state"]
                    states = base["state"] if isinstance(base, dict) else dict(enumerate(base))
                t = states[group][state]
        except (KeyError, IndexError, TypeError):
            what = "fp32 partition" if state is None else f"optimizer state '{state}'"
            raise MissingEntryError(f"the file has no {what} of group {group} ({rank})",
                                    path=self._optim_path(rank)) from None
        if state is None and not isinstance(t, TensorHandle):
            raise MissingEntryError(f"the fp32 partition of group {group} ({rank}) is not a tensor",
                                    path=self._optim_path(rank))
        return t

    def _optim_path(self, rank: Rank) -> str:
        """The optimizer-states file of ``rank`` (for messages), or the tag folder."""
        for f in self._files.of(fnames.OPTIM_STATES, mp_rank=self.mp):
            if f.dp_rank == rank.dp:
                return str(f.path)
        return str(self.location.tag_dir)

    def frozen_chunks(self, name: str) -> list[TensorHandle]:
        """The stored chunks of frozen parameter ``name`` in rank order (one tensor, except at ZeRO-3 where
        each rank holds ``ceil(numel/N)`` elements, the last ones padded)."""
        chunks = self.records.index.frozen.get(name)
        if not chunks:
            raise IncompleteCheckpointError(f"no data was saved for frozen parameter {name} "
                                            "(saved with exclude_frozen_parameters?)", path=self.location.tag_dir)
        return list(chunks)

    def module_tensor(self, name: str) -> TensorHandle:
        """Entry ``name`` of the model-states ``module`` (a buffer, or a 16-bit weight)."""
        t = self.records.index.module.get(name)
        if not isinstance(t, TensorHandle):
            raise KeyError(f"the module has no tensor named {name!r} in {self.location.tag_dir}")
        return t

    def sources(self, name: str, key: Optional[str] = None) -> list[StoredRange]:
        """The stored ranges that, concatenated, give parameter ``name`` flattened, in this set's terms
        (metadata only). ``key`` None: the fp32 master (trainable), the stored 16-bit/fp32 value (frozen)
        or the buffer; otherwise the optimizer state ``key``. A tied alias gives its owner's ranges."""
        if key is None and self._buffers.get(self.buffers, name) is not None:
            return self.module_tensor(name).ranges()
        p = self.param(name)
        if p.tied_to:
            return self.sources(p.tied_to, key)
        if key == MODULE:
            t = self.module_tensor(name)
            if t.numel != p.numel:
                raise KeyError(f"the module holds no value of {name} (a {tuple(t.shape)} placeholder: ZeRO-3)")
            return t.ranges()
        if not p.trainable:
            if key is not None:
                raise KeyError(f"parameter {name} is frozen and has no optimizer state")
            return self._frozen_ranges(p)
        if self.flavor == NO_ZERO:
            return self._stage0_handle(p, key).ranges(0, p.numel)
        return self.piece_ranges(self.pieces(name, key), key)

    def piece_ranges(self, pieces: list, key: Optional[str] = None) -> list:
        """The stored ranges of layout ``pieces`` in the partition tensors of state ``key`` (None: the fp32
        master); :class:`~ckptlib.layout.ranges.Zeros` among them are kept as they are. Metadata only.

        Each rank's partition tensor is looked up once per set (a ZeRO-3 plan at 512 ranks asks for
        millions of pieces); the ranges of the (contiguous, 1-D) flat partitions are made directly from
        :meth:`~ckptlib.io.torchzip.TensorHandle.flat_base`."""
        out: list = []
        append, flats, make = out.append, self._flats, StoredRange
        for p in pieces:
            if isinstance(p, Zeros):
                append(p)
                continue
            t = flats.get((p.rank, p.group, key))
            if t is None:
                h = self.partition_tensor(self.rank(p.rank), p.group, key)
                t = flats[(p.rank, p.group, key)] = (h, h.flat_base())
            flat = t[1]
            if flat is None:
                out += t[0].ranges(p.rank_start, p.count)
                continue
            start, count = p.rank_start, p.count
            if start < 0 or count < 0 or start + count > flat[4]:
                raise IndexError(f"element range [{start}, {start + count}) outside a tensor of {flat[4]} elements")
            if count:
                append(make(flat[0], flat[1] + start * flat[3], flat[2], count))
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

    def _stage0_optimizer(self, name: str) -> dict:
        where = self.records.index.stage0.get(name, (None, None))
        return self.records.index.stage0_optimizers[where[2]] if len(where) > 2 else \
            (self.records.index.stage0_optimizer or {})

    def stage0_proofs(self) -> list[tuple[str, list, list, str]]:
        """ZeRO-0 names nothing; where another parameter of the same shape could have been an optimizer
        entry (``records.index.stage0_ambiguous``), the choice is proven by the values: ``(what, fp32 master
        ranges, saved weight ranges, saved dtype)`` that must be equal once the master is cast to the saved
        weight's dtype (16-bit training keeps the module weights the masters rounded). Plans compare them
        before writing; where the module holds the fp32 values themselves there is nothing to compare (the
        weights are exact either way, the optimizer states are refused: :meth:`sources`)."""
        out = []
        for name, other in self.records.index.stage0_ambiguous.items():
            g, i = self.records.index.stage0[name][:2]
            if "fp32_groups" not in self._stage0_optimizer(name):
                continue
            saved = self.module_tensor(name)
            out.append((f"{name}: its fp32 master (optimizer group {g} entry {i}; ZeRO-0 records no names, and "
                        f"{other} has the same shape) cast to {saved.dtype_name} and its saved {saved.dtype_name} "
                        "weight", self._stage0_handle(self.param(name), None).ranges(), saved.ranges(),
                        saved.dtype_name))
        return out

    def _stage0_handle(self, p: ParameterInfo, key: Optional[str]) -> TensorHandle:
        where = self.records.index.stage0.get(p.name, (None, None))
        g, i = where[:2]
        opt = self._stage0_optimizer(p.name)
        other = self.records.index.stage0_ambiguous.get(p.name)
        if key is None:
            if "fp32_groups" in opt and g is not None:
                return opt["fp32_groups"][g][i]
            return self.module_tensor(p.name)
        if other is not None and "fp32_groups" not in opt:
            raise UnsupportedCheckpointError(
                f"ZeRO-0 records no names: optimizer group {g} entry {i} is {p.name} or {other} (the same shape, one "
                f"of them in no group), and its '{key}' cannot be told to be either's", path=self.location.tag_dir,
                hint="the weights export exactly without --states; states need a checkpoint saved with ZeRO-1 or "
                     "later, which records names")
        if g is None:
            raise KeyError(f"no optimizer state is known for {p.name}")
        inner = opt.get("optimizer_state_dict", opt)
        pid = inner["param_groups"][g]["params"][i]
        try:
            return inner["state"][pid][key]
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"the optimizer state has no '{key}' for {p.name}") from None

    # ================================================================== files as objects
    def model_states_file(self, rank: Optional[Rank] = None) -> TorchFile:
        """The (opened) model-states file: ZeRO-1/2's single one, or ZeRO-3 ``rank``'s; the first one when
        ``rank`` is None."""
        for f in self._files.of(fnames.MODEL_STATES, mp_rank=self.mp):
            if rank is None or f.dp_rank is None or f.dp_rank == rank.dp:
                tf = self._files.get(f)
                if tf is not None:
                    return tf
        raise IncompleteCheckpointError(f"no readable model-states file for {rank or self.coordinate}",
                                        path=self.location.tag_dir)

    def optim_states_file(self, rank: Rank) -> TorchFile:
        """The (opened) optimizer-states file of ``rank``."""
        for f in self._files.of(fnames.OPTIM_STATES, mp_rank=self.mp):
            if f.dp_rank == rank.dp:
                tf = self._files.get(f)
                if tf is not None:
                    return tf
        raise IncompleteCheckpointError(f"no readable optimizer-states file for {rank}", path=self.location.tag_dir)

    def __repr__(self) -> str:
        return (f"ZeroSet(mp={self.mp}, stage={self.zero_stage}, dtype={self.dtype}, dp={self.partition_count}, "
                f"params={len(self.parameters)})")


__all__ = ["ZeroSet", "MODULE"]
