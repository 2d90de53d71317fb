"""The DeepSpeed output of an average (``ckpt average --format deepspeed``): a checkpoint at the last source's mesh.

It is the last source's tag folder written again, file for file, as a reshard to the same mesh writes it: each file's
object tree as stored (every tensor copied from its storage, every value kept), except that

- each rank's flat fp32 partitions of the masters (``single_partition_of_fp32_groups`` at ZeRO-1/2 and under
  BF16_Optimizer, ``fp32_flat_groups`` at ZeRO-3; in the dtype the source stores them) are the average: each
  partition is laid out as the last source's (:mod:`ckptlib.layout.flat`: its parameters' element runs and its
  padding, zeros), each run averaged from every source's ranges of the same elements
  (:class:`ckptlib.io.averaging.AveragedNewTensor`, computed as the file is written);
- the model states' 16-bit module weights of the averaged parameters (ZeRO-1/2 save them whole) are the averaged
  masters rounded to their dtype, as DeepSpeed itself rounds them from the masters when it loads (a tied alias is
  the same tensor as its owner); ZeRO-3 saves placeholders there, which stay.

Everything else is the last source's: the optimizer state (moments, step), the buffers, the frozen parameters, the
learning-rate scheduler and the engine's counters. ``latest`` names the last source's tag; DeepSpeed's converter
scripts are copied. The client's files beside the checkpoint (HF Trainer, Accelerate) are not: they hold the last
source's own weights and trainer state. Metadata only; the trees are small (no tensor is read).
"""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from ..deepspeed import NO_ZERO, Checkpoint
from ..deepspeed import files as fnames
from ..errors import UnsupportedCheckpointError
from ..io.averaging import AveragedNewTensor
from ..io.torchzip.specs import StoredTensor
from ..io.torchzip.trees import as_specs, tree_bytes
from ..io.torchzip.writer import file_size
from ..plan import CopyFile, TextFile, TreeFile

CONVERTERS = ("zero_to_fp32.py", "zero_to_torch.py")


def refuse_for_deepspeed(ck: Checkpoint) -> None:
    """The last sources a DeepSpeed output cannot be written at, each with the reason: only a data-parallel
    ZeRO-1/2/3 (or BF16_Optimizer) checkpoint of native files is rewritten so far."""
    where = ck.location.tag_dir
    why = None
    if ck.universal is not None:
        why = "the last source is a universal checkpoint, which DeepSpeed loads with load_universal"
    elif ck.kind != "data_parallel" or len(ck.sets) != 1:
        why = f"the last source is a {ck.kind.replace('_', '-')} checkpoint (mesh pp={ck.mesh.pp} tp={ck.mesh.tp})"
    elif ck.num_experts or ck.records.autoep_layers:
        why = "the last source has experts (MoE)"
    elif ck.flavor == NO_ZERO or not ck.zero_stage:
        why = "the last source has no ZeRO partitions (stage 0)"
    elif any(f.kind == fnames.SWAP for f in ck.files):
        why = "the last source keeps its optimizer partitions in NVMe swap files"
    elif any(f.kind not in (fnames.MODEL_STATES, fnames.OPTIM_STATES, fnames.OTHER) for f in ck.files):
        why = "the last source's tag folder holds layer or expert files"
    if why:
        raise UnsupportedCheckpointError(f"--format deepspeed writes data-parallel ZeRO-1/2/3 checkpoints: {why}",
                                         path=where, hint="write the average in the Hugging Face layout (leave out "
                                                          "--format), or put a data-parallel ZeRO tag last")


def _numel(t) -> int:
    return math.prod(int(s) for s in t.shape)


def _trimmed(segments: list, count: int, where: str) -> list:
    """The first ``count`` elements of a partition's ``segments`` (ZeRO-1/2 save the last rank's masters without
    their tail padding); only padding may be cut."""
    out, pos = [], 0
    for s in segments:
        take = min(s.count, count - pos)
        if take < s.count and not s.is_padding:
            raise UnsupportedCheckpointError(f"a saved fp32 partition ends inside {s.name}, not in padding",
                                             path=where)
        if take > 0:
            out.append(s if take == s.count else dataclasses.replace(s, count=take))
        pos += take
    if pos != count:
        raise UnsupportedCheckpointError(f"a saved fp32 partition holds {count} elements; its layout {pos}", path=where)
    return out


def _average_masters(zs, dp: int, tree: dict, terms) -> int:
    """Replace rank ``dp``'s flat master partitions in its optimizer-states ``tree`` by their averages; returns how
    many."""
    osd = tree["optimizer_state_dict"]
    key = "fp32_flat_groups" if zs.zero_stage == 3 else "single_partition_of_fp32_groups"
    flats = osd[key] = list(osd[key])
    rank, where = zs.rank(dp), str(zs.location.tag_dir)
    for g in range(len(flats)):
        h = zs.partition_tensor(rank, g)
        segments = zs.layouts[0].segments(dp, g) if zs.zero_stage == 3 else zs.layouts[g].segments(dp)
        segments = _trimmed(segments, h.numel, where)
        flats[g] = AveragedNewTensor(h.dtype_name, tuple(h.shape), terms=terms.of_segments(segments),
                                     requires_grad=h.requires_grad)
    return len(flats)


def _average_module(ck: Checkpoint, tree: dict, terms) -> list[str]:
    """Replace the 16-bit module weights of the averaged parameters in a model-states ``tree`` by the averaged
    masters rounded to their dtype (a tied alias: the same tensor as its owner); returns their names."""
    module = tree.get("module")
    if not isinstance(module, dict):
        return []
    done, made = [], {}
    for p in ck.parameters:
        owner = p.tied_to or p.name
        m = module.get(p.name)
        if not ck.param(owner).trainable or not isinstance(m, StoredTensor) or _numel(m) != p.numel:
            continue  # frozen; ZeRO-3's placeholders; a name the module does not hold
        spec = made.get((owner, m.storage.dtype, tuple(m.shape)))
        if spec is None:
            spec = made[(owner, m.storage.dtype, tuple(m.shape))] = AveragedNewTensor(
                m.storage.dtype, tuple(m.shape), terms=terms.of(owner), requires_grad=m.requires_grad,
                py_state=m.py_state)
        module[p.name] = spec
        done.append(p.name)
    return done


def _tree_file(name: str, kind: str, obj, rank=None) -> TreeFile:
    read, written = tree_bytes(obj)
    return TreeFile(name, kind, obj, read, written, rank, [rank] if rank is not None else [],
                    size=file_size(obj, name))


def deepspeed_files(last: Checkpoint, terms) -> tuple[list, list, list, list, list]:
    """``(files, finals, folders, what is the last source's, notes)`` of the DeepSpeed output (see the module
    docstring); ``terms``: the sources and weights (:class:`ckptlib.export.average.Terms`). Metadata only.

    Raises:
        UnsupportedCheckpointError: a last source it cannot be written for (:func:`refuse_for_deepspeed`)."""
    refuse_for_deepspeed(last)
    zs, tag = last.main, last.location.tag
    files, module_done, flats = [], set(), 0
    for f in sorted(last.files, key=lambda f: f.path.name):
        name = f"{tag}/{f.path.name}"
        if f.kind == fnames.OTHER:
            files.append(CopyFile(name, os.fspath(f.path), f.bytes))
            continue
        rank = zs.rank(f.dp_rank) if f.dp_rank is not None else None
        if f.kind == fnames.MODEL_STATES:
            tree = as_specs(zs.model_states_file(rank).obj)
            module_done.update(_average_module(last, tree, terms))
            files.append(_tree_file(name, "model_states", tree, f.dp_rank))
        else:
            tree = as_specs(zs.optim_states_file(rank).obj)
            flats += _average_masters(zs, f.dp_rank, tree, terms)
            files.append(_tree_file(name, "optim_states", tree, f.dp_rank))
    for script in CONVERTERS:
        p = Path(last.location.save_dir) / script
        if p.is_file():
            files.append(CopyFile(script, os.fspath(p), p.stat().st_size))
    keys = list(last.optimizer.state_keys) if last.optimizer else []
    steps = sorted({s for s in (last.step_of(p.name) for p in last.parameters if p.trainable and not p.tied_to)
                    if s is not None})
    frozen = [p.name for p in last.parameters if not p.trainable and not p.tied_to]
    buffers = [b.name for b in last.buffers]
    from_last = buffers + frozen + [f"optimizer state {', '.join(keys) or '(none)'}"] + \
        [f"step {', '.join(f'{s:g}' for s in steps) or '(none)'}"]
    lowp = "the 16-bit module weights" if last.dtype in ("bf16", "fp16") else "the module weights"
    notes = [f"the masters ({flats} flat partitions, in the dtype the last source stores them) are the average; "
             + (f"{lowp} of the {len(module_done)} averaged parameters are the averaged masters rounded to "
                f"{last.dtype} (as DeepSpeed rounds them from the masters when it loads)" if module_done else
                "ZeRO-3 saves no module weights: DeepSpeed rounds them from the averaged masters when it loads"),
             f"the last source's ({tag}): the optimizer state ({', '.join(keys) or 'none'}) and step "
             f"({', '.join(f'{s:g}' for s in steps) or 'none'}), the learning-rate scheduler and the engine's counters"
             + (f", the buffers ({', '.join(buffers)})" if buffers else "")
             + (f", the frozen parameters ({', '.join(frozen)})" if frozen else ""),
             "the client files beside the checkpoint (HF Trainer, Accelerate) are not carried: they hold the last "
             "source's own weights; copy trainer_state.json, the scheduler and the RNG states by hand to resume "
             "through the client"]
    return files, [TextFile("latest", tag, kind="latest")], [tag], from_last, notes


__all__ = ["deepspeed_files", "refuse_for_deepspeed", "CONVERTERS"]
