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
  members have the same size and CRC-32 (and are not all zeros) are one partition saved twice.

Tensors stored on several ranks (replicated across tensor ranks) must be equal too: :func:`replica_checks`
gives the range checks a run compares before it writes anything.
"""
from __future__ import annotations

import os
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
                                                f"({want} by the layout of param_shapes at {world} ranks)", PADDINGS))
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
                                                f"where {rank}'s partition holds them ({len(wrong)} of "
                                                f"{len(set(have) | set(want))} differ, e.g. {wrong[0]})", MAPPINGS))
                    break
    return out


def _member(h) -> Optional[tuple]:
    """``(size, CRC-32)`` of the zip member holding tensor ``h``, unless unknown or all zeros."""
    if not isinstance(h, TensorHandle) or h.storage.stored_crc is None or not h.storage.stored_bytes:
        return None
    st = h.storage
    if st.stored_crc == crc32_of_zeros(st.stored_bytes):
        return None
    return st.stored_bytes, st.stored_crc


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
        for rank in sorted(zs.records.index.optim):
            for g in range(groups):
                try:
                    ids = [_member(zs.partition_tensor(rank, g))] + [_member(zs.partition_tensor(rank, g, k))
                                                                     for k in keys]
                except KeyError:
                    continue
                if all(ids):
                    seen[(g, tuple(ids))].append(rank)
        for (g, _), ranks in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[1][0].dp)):
            if len(ranks) > 1:
                files = tuple(_label(zs, r) for r in ranks)
                out.append(Finding(files, f"these files hold the same fp32 partition of group {g} and the same "
                                          "optimizer state, byte for byte (the same size and CRC-32): one rank's "
                                          "file saved or copied in place of another's", DUPLICATE))
    return out


def _label(zs, rank) -> str:
    path = zs.optim_states_file(rank).path
    return next((f.relpath for f in zs.records.files if os.fspath(f.path) == os.fspath(path)), os.fspath(path))


def findings(ck) -> list[Finding]:
    """Every rank file of ``ck`` that does not provably hold what its name says (metadata only)."""
    return saved_as(ck) + _flat_findings(ck) + duplicates(ck)


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
