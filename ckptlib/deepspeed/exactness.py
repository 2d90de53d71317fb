"""Exact or refuse: the one validation that export, reshard and the universal checkpoint run on a
checkpoint before they plan a single byte (:func:`require_exact`), and that ``ckpt check`` reports.

A conversion is exact only if every rank file holds the partition its name says, since the layout
arithmetic reads rank ``r``'s partition from rank ``r``'s file. A file copied over another (a duplicate)
or two files swapped hold well-formed partitions of the wrong ranks, so their identity is checked
against every piece of metadata that can reveal it (no tensor data is read):

- **the name it was saved under**: torch names the zip archive inside a file after the file it writes
  (``bf16_zero_pp_rank_1_mp_rank_00_optim_states/data.pkl``); a DeepSpeed file whose archive names
  another DeepSpeed file was copied or renamed over this one (files written to a stream say
  ``archive`` and tell nothing);
- **ZeRO-1/2 and BF16_Optimizer**: ``group_paddings`` and ``param_slice_mappings`` say where the
  parameters lie in the partition the file holds; they must be those of its rank's partition by the
  layout of ``param_shapes`` (mappings are not compared under ``round_robin_gradients``: DeepSpeed
  computes them in the natural order there);
- **partition sizes**: checked when the checkpoint is opened (a lean last partition is shorter);
- **byte-identical partitions**: two ranks' fp32 partitions, and their first optimizer state, whose zip
  members have the same size and CRC-32 (and are not all zeros) are one partition saved twice. A file in
  torch's legacy serialization records no CRC-32 (and no name): there the first and last 4 KiB of each
  are compared, and partitions whose samples agree are compared whole before they are called one.

ZeRO-3 saves the buffers in every rank's model-states file; where those files are in torch's legacy
serialization (no CRC-32 guards their pickles or bytes), rank 0's buffers, the ones every command reads, are
compared with every other rank's: shape, dtype and bytes (:func:`legacy_buffers`).

Tensors stored on several ranks (replicated across tensor ranks) must be equal too: :func:`replica_checks`
gives the range checks a run compares before it writes anything.
"""
from __future__ import annotations

import os
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from ..errors import IncompleteCheckpointError
from ..io.torchzip import TensorHandle
from ..io.torchzip.zipfmt import crc32_of_zeros
from ..plan import RangeCheck
from . import files as fnames
from .records import BF16_OPTIMIZER, NO_ZERO

SAVED_AS, PADDINGS, MAPPINGS, DUPLICATE = "saved_as", "group_paddings", "param_slice_mappings", "duplicate"
BUFFERS = "buffers"


@dataclass(frozen=True)
class Finding:
    """A rank file that does not hold what its name says: ``files`` (as the user gave them), ``what`` (one
    sentence), ``kind`` (:data:`SAVED_AS`, :data:`PADDINGS`, :data:`MAPPINGS`, :data:`DUPLICATE`)."""

    files: tuple
    what: str
    kind: str

    def __str__(self) -> str:
        return f"{', '.join(self.files)}: {self.what}"


def saved_as(ck) -> list[Finding]:
    """Files whose zip archive is named after another DeepSpeed file of the tag folder's kinds."""
    out = []
    for f, tf in ck.opened_files():
        archive = tf.archive_name
        if archive is None or archive == os.path.splitext(f.path.name)[0]:  # None: a legacy file records no name
            continue
        stem = archive[:-3] if archive.endswith(".pt") else archive  # written as NAME.pt.tmp, renamed
        role = fnames.classify(stem + ".pt")
        if role.kind == fnames.OTHER or stem + ".pt" == f.path.name:
            continue
        out.append(Finding((f.relpath,), f"this file was saved as {stem}.pt (torch names the archive inside a file "
                                         "after the file it writes): a file copied or renamed over this one, so it "
                                         "does not hold what its name says", SAVED_AS))
    return out


def _flat_findings(ck) -> list[Finding]:
    out = []
    for _, zs in sorted(ck.sets.items()):
        if zs.flavor == NO_ZERO or zs.zero_stage == 3 or not zs.layouts:
            continue
        round_robin = bool((zs.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"))
        experts = zs.records.expert_groups
        world = zs.partition_count
        for rank, osd in sorted(zs.records.index.optim.items()):
            r = rank.dp
            if world is not None and r >= world:
                continue  # an extra file: a problem of its own
            file = _label(zs, rank)
            pads = osd.get("group_paddings")
            if isinstance(pads, (list, tuple)) and not isinstance(osd.get("base_optimizer_state"), (list, tuple)):
                want = []
                for g, lay in enumerate(zs.layouts):
                    eg = experts.get(g)
                    k = r // eg.ep if eg else r
                    if zs.flavor == BF16_OPTIMIZER:  # all padding on the group's last partition
                        want.append((lay.padded_total - lay.total) if k == lay.world_size - 1 else 0)
                    else:
                        want.append(lay.tail_padding(k))
                if [p if isinstance(p, int) else None for p in pads] != want:
                    out.append(Finding((file,), f"its group_paddings {list(pads)} are not those of {rank}'s partition "
                                                f"({want} by the layout of param_shapes, in {_model_label(zs)}, at {world} "
                                                f"ranks)", PADDINGS))
            maps = osd.get("param_slice_mappings")
            if round_robin or not isinstance(maps, (list, tuple)):
                continue
            for g, (mapping, lay) in enumerate(zip(maps, zs.layouts)):
                eg = experts.get(g)
                k = r // eg.ep if eg else r
                have = {str(n): (getattr(a, "start", None), getattr(a, "numel", None))
                        for n, a in (mapping.items() if isinstance(mapping, dict) else [])}
                want = lay.slice_mappings(k)
                if have != want:
                    wrong = sorted(set(have) ^ set(want) | {n for n in set(have) & set(want) if have[n] != want[n]})
                    out.append(Finding((file,), f"its param_slice_mappings of group {g} do not place the parameters "
                                                f"where {rank}'s partition holds them by param_shapes, in {_model_label(zs)} "
                                                f"({len(wrong)} of "
                                                f"{len(set(have) | set(want))} differ, e.g. {wrong[0]})", MAPPINGS))
                    break
    return out


SAMPLE_BYTES = 4096  # of each end of a legacy file's partition (which records no CRC-32)
COMPARE_BYTES = 1 << 20  # compared at a time when two samples agree


def _member(h) -> Optional[tuple]:
    """``(size, CRC-32)`` of the zip member holding tensor ``h``, unless unknown or all zeros; for a tensor of
    a legacy file (no CRC-32 recorded), ``("sample", size, CRC-32 of its first and of its last 4 KiB)``."""
    if not isinstance(h, TensorHandle) or not h.storage.stored_bytes:
        return None
    st = h.storage
    if st.stored_crc is None:
        return _sample(h)
    if st.stored_crc == crc32_of_zeros(st.stored_bytes):
        return None
    return st.stored_bytes, st.stored_crc


def _sample(h: TensorHandle) -> Optional[tuple]:
    if not h.nbytes or not h.is_contiguous():
        return None
    start, end = h.byte_range()
    n = min(SAMPLE_BYTES, end - start)
    head, tail = bytearray(n), bytearray(n)
    h.storage.file.read_into(start, memoryview(head))
    h.storage.file.read_into(end - n, memoryview(tail))
    if not any(head) and not any(tail):
        return None  # zeros tell nothing
    return "sample", h.nbytes, zlib.crc32(head), zlib.crc32(tail)


def _same_bytes(a: TensorHandle, b: TensorHandle) -> bool:
    """Whether two contiguous tensors hold the same bytes (read :data:`COMPARE_BYTES` at a time)."""
    (a0, a1), (b0, b1) = a.byte_range(), b.byte_range()
    if a1 - a0 != b1 - b0:
        return False
    x, y = bytearray(min(COMPARE_BYTES, a1 - a0)), bytearray(min(COMPARE_BYTES, a1 - a0))
    for done in range(0, a1 - a0, COMPARE_BYTES):
        n = min(COMPARE_BYTES, a1 - a0 - done)
        a.storage.file.read_into(a0 + done, memoryview(x)[:n])
        b.storage.file.read_into(b0 + done, memoryview(y)[:n])
        if x[:n] != y[:n]:
            return False
    return True


def duplicates(ck) -> list[Finding]:
    """Ranks whose fp32 partition of a group, and its first per-element optimizer state, are byte for byte
    another rank's (same zip member size and CRC-32; all-zero members tell nothing)."""
    out = []
    for _, zs in sorted(ck.sets.items()):
        if zs.flavor == NO_ZERO or not zs.layouts:
            continue
        groups = len(zs.layouts[0].sub_group_sizes) if zs.zero_stage == 3 else len(zs.layouts)
        keys = [k for k in (zs.optimizer.state_keys if zs.optimizer else []) if k != "step"][:1]
        seen: dict = defaultdict(list)
        tensors: dict = {}
        for rank in sorted(zs.records.index.optim):
            for g in range(groups):
                try:
                    tensors[rank, g] = [zs.partition_tensor(rank, g)] + [zs.partition_tensor(rank, g, k) for k in keys]
                except KeyError:
                    continue
                ids = [_member(t) for t in tensors[rank, g]]
                if all(ids):
                    seen[(g, tuple(ids))].append(rank)
        for (g, ids), ranks in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[1][0].dp)):
            if any(i[0] == "sample" for i in ids):  # samples agree: the same bytes only if the whole agrees
                ranks = ranks[:1] + [r for r in ranks[1:] if all(
                    _same_bytes(a, b) for a, b in zip(tensors[ranks[0], g], tensors[r, g]))]
            if len(ranks) > 1:
                files = tuple(_label(zs, r) for r in ranks)
                out.append(Finding(files, f"these files hold the same fp32 partition of group {g} and the same "
                                          "optimizer state, byte for byte (the same size and CRC-32): one rank's "
                                          "file saved or copied in place of another's", DUPLICATE))
    return out


def _model_label(zs) -> str:
    """The model-states file whose ``param_shapes`` the layout comes from, as the user sees it."""
    path = os.fspath(zs.model_states_file().path)
    return next((f.relpath for f in zs.records.files if os.fspath(f.path) == path), path)


def _label(zs, rank) -> str:
    path = zs.optim_states_file(rank).path
    return next((f.relpath for f in zs.records.files if os.fspath(f.path) == os.fspath(path)), os.fspath(path))


def legacy_buffers(ck) -> list[Finding]:
    """ZeRO-3 model-states files in torch's legacy serialization whose buffers (the non-empty tensors of
    ``module``: parameters are empty placeholders there) differ from rank 0's in shape, dtype or bytes."""
    out = []
    for _, zs in sorted(ck.sets.items()):
        if zs.zero_stage != 3:
            continue
        ranks = sorted(zs.records.index.optim)
        try:
            first = zs.model_states_file(ranks[0]) if ranks else None
        except IncompleteCheckpointError:
            continue
        if first is None or first.format != "legacy" or not isinstance(first.obj.get("module"), dict):
            continue
        mine = {k: v for k, v in first.obj["module"].items() if isinstance(v, TensorHandle) and v.numel}
        for rank in ranks[1:]:
            try:
                tf = zs.model_states_file(rank)
            except IncompleteCheckpointError:
                continue  # a missing file is a problem of its own
            if tf is first:
                continue
            theirs = tf.obj.get("module") if isinstance(tf.obj, dict) else None
            theirs = theirs if isinstance(theirs, dict) else {}
            bad = [k for k, v in mine.items() if not (
                isinstance(theirs.get(k), TensorHandle) and tuple(theirs[k].shape) == tuple(v.shape)
                and theirs[k].dtype_name == v.dtype_name
                and (not v.is_contiguous() or not theirs[k].is_contiguous() or _same_bytes(v, theirs[k])))]
            if bad:
                out.append(Finding((_model_file_label(zs, first), _model_file_label(zs, tf)),
                                   f"the buffers every rank saves differ between these files ({len(bad)}, e.g. "
                                   f"{bad[0]}): one of them is damaged (files in torch's legacy serialization "
                                   "record no CRC-32 to tell which)", BUFFERS))
    return out


def _model_file_label(zs, tf) -> str:
    path = os.fspath(tf.path)
    return next((f.relpath for f in zs.records.files if os.fspath(f.path) == path), path)


def findings(ck) -> list[Finding]:
    """Every rank file of ``ck`` that does not provably hold what its name says (metadata only; for files in
    torch's legacy serialization, which record no CRC-32, a few sampled and compared bytes)."""
    return saved_as(ck) + _flat_findings(ck) + duplicates(ck) + legacy_buffers(ck)


def require_exact(ck) -> None:
    """Raise unless ``ck`` can be read exactly: :meth:`~ckptlib.deepspeed.Checkpoint.check_readable`, then
    the identity of every rank file (:func:`findings`).

    Raises:
        IncompleteCheckpointError: naming every file that does not hold what its name says.
    """
    from .discovery import repair_hint

    ck.check_readable()
    found = findings(ck)
    if found:
        raise IncompleteCheckpointError(
            "the rank files do not all hold the partitions their names say, so nothing can be converted "
            "exactly: " + "; ".join(str(f) for f in found), path=ck.location.tag_dir,
            hint=repair_hint(ck.location))


def replica_checks(ck, keys: Optional[list] = None) -> list[RangeCheck]:
    """Range checks of every tensor stored more than once (replicated across tensor ranks): the weights,
    buffers and the optimizer states ``keys`` (default: all of the checkpoint's) of every parameter; a run
    compares them before it writes anything and refuses when they differ."""
    keys = list(ck.optimizer.state_keys if ck.optimizer else []) if keys is None else list(keys)
    out = []
    names = [(p.name, p.trainable) for p in ck.parameters if not p.tied_to] + [(b.name, False) for b in ck.buffers]
    for name, trainable in names:
        for key in [None] + (keys if trainable else []):
            try:
                pairs = ck.replica_checks(name, key)
            except KeyError:
                continue
            out += [RangeCheck(what, tuple(a), tuple(b), a[0].dtype if a else "float32") for what, a, b in pairs]
    return out


def value_proofs(ck) -> list[RangeCheck]:
    """Range checks that prove what the metadata leaves open (ZeRO-0's optimizer entries matched by shape where
    another parameter has the same shape: :meth:`~ckptlib.deepspeed.ZeroSet.stage0_proofs`); a run compares
    them before writing and refuses when they differ."""
    return [RangeCheck(what, tuple(a), tuple(b), dtype) for zs in ck.sets.values() for what, a, b, dtype in
            (zs.stage0_proofs() if zs.flavor == NO_ZERO else []) + list(zs.records.index.alias_proofs)]


__all__ = ["value_proofs", "Finding", "findings", "saved_as", "duplicates", "require_exact", "replica_checks",
           "SAVED_AS", "PADDINGS", "MAPPINGS", "DUPLICATE"]
