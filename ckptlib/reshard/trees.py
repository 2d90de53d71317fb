"""Building blocks of the target object trees of a reshard or a universal checkpoint (metadata only).

Each target file is a source file's object tree with the partition-dependent entries replaced:
tensors become :class:`~ckptlib.io.torchzip.specs.NewTensor` s whose bytes are the source ranges that
:mod:`ckptlib.layout.flat` says make them, and sizes, paddings and fragment addresses are recomputed. The
carried-over rest keeps its tensors as :class:`~ckptlib.io.torchzip.specs.StoredTensor` s (copied storage).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..deepspeed import Checkpoint, ZeroSet, hf
from ..io.torchzip import TensorHandle, classify_file_start, open_torch_file
from ..io.torchzip.specs import NewTensor
from ..io.torchzip.trees import as_specs, tree_bytes
from ..io.torchzip.writer import file_size
from ..layout.flat import DEFAULT_SUB_GROUP_SIZE, configured_sub_group_size
from ..layout.ranges import Zeros, numel
from ..plan import CopyFile, TreeFile



#: a value for :func:`replace` that leaves its key out
DROP = object()


def replace(d: dict, **new) -> dict:
    """A copy of ``d`` (same type, same key order) with some values replaced (those given as :data:`DROP`: left out)."""
    out = type(d)()
    for k, v in d.items():
        if k in new and new[k] is DROP:
            continue
        out[k] = new[k] if k in new else v
    return out


def streamed(dtype: str, ranges: list, requires_grad: bool = False, shape: Optional[tuple] = None) -> NewTensor:
    """A new tensor made of ``ranges`` (source ranges and zeros), 1-D unless ``shape`` is given."""
    n = numel(ranges)
    return NewTensor(dtype, shape if shape is not None else (n,), tuple(ranges), requires_grad=requires_grad)


def stored_dtype(ranges: list) -> Optional[str]:
    """The dtype of the first stored range of ``ranges`` (zeros have none), None when all are zeros: a target keeps
    the masters in the dtype the source stores them in (fp32, or bf16 under DeepSpeed's
    ``bf16_master_weights_and_grads``), as DeepSpeed at the target size would."""
    return next((r.dtype for r in ranges if not isinstance(r, Zeros)), None)


def copied(h: TensorHandle) -> NewTensor:
    """A copy of a stored tensor with a storage of its own (so that no two target tensors share one)."""
    return NewTensor(h.dtype_name, tuple(h.shape), tuple(h.ranges()), requires_grad=h.requires_grad)


def to_ranges(ck: ZeroSet, pieces: list, key: Optional[str]) -> list:
    """Layout pieces (and zeros) of a set as stored ranges of state ``key`` (None: the fp32 master); see
    :meth:`~ckptlib.deepspeed.ZeroSet.piece_ranges`."""
    return ck.piece_ranges(pieces, key)


def optim_prefix(ck: ZeroSet) -> str:
    """``"bf16_"``, ``"fp16_"`` or ``""``: how the source names its optimizer-state files."""
    return next((f.prefix for f in ck.files if f.kind == "optim_states"), "")


class TreeFiles:
    """Makes the :class:`TreeFile` s of a plan, doing the work shared by many target files once.

    The target files of a reshard are mostly the same: every ZeRO-3 model-states file carries the same
    module, ``param_shapes`` and config. A top-level entry that is the same object as in an earlier file
    is converted to plain specs once (and the converted entry is shared between the files, which the
    plan's pickle keeps shared too), and a tree whose top-level entries are all the same objects as an
    earlier tree's has that tree's byte counts and, for a name of the same length, its file size (the
    size depends on the archive name only through its length). Nothing is shared between trees that
    differ, so the result is the same as :func:`tree_file` for each.

    Memory: the converted entries and one size per distinct tree.
    """

    def __init__(self):
        self._specs: dict[int, tuple] = {}  # id(entry) -> (entry, converted); the entry is kept alive
        self._sizes: dict[tuple, tuple] = {}

    def _converted(self, v: Any) -> Any:
        known = self._specs.get(id(v))
        if known is None or known[0] is not v:
            known = self._specs[id(v)] = (v, as_specs(v))
        return known[1]

    def make(self, name: str, kind: str, obj: Any, rank: Optional[int] = None,
             source_ranks: Optional[list] = None) -> TreeFile:
        if not isinstance(obj, dict):
            return tree_file(name, kind, obj, rank, source_ranks)
        specs = type(obj)()
        for k, v in obj.items():
            specs[k] = self._converted(v)
        archive = os.path.splitext(os.path.basename(name))[0]  # what file_size names the zip's members after
        key = (type(specs), tuple(specs), tuple(id(v) for v in specs.values()), len(archive.encode()))
        sizes = self._sizes.get(key)
        if sizes is None:
            read, written = tree_bytes(specs)
            sizes = self._sizes[key] = (read, written, file_size(specs, name))
        return TreeFile(name, kind, specs, sizes[0], sizes[1], rank, list(source_ranks or []), size=sizes[2])


def tree_file(name: str, kind: str, obj: Any, rank: Optional[int] = None,
              source_ranks: Optional[list] = None) -> TreeFile:
    """A :class:`TreeFile` for ``obj`` (tensor handles become plain specs; bytes counted, and the exact
    file size computed from the pickle and the zip layout)."""
    obj = as_specs(obj)
    read, written = tree_bytes(obj)
    return TreeFile(name, kind, obj, read, written, rank, list(source_ranks or []), size=file_size(obj, name))


def carried(name: str, path: str, nbytes: int, **where) -> CopyFile | TreeFile:
    """A file of the tag folder that a target holds as the source does (layer files, expert files, model states
    of a universal folder): copied byte for byte, or, when it is in torch's legacy serialization, written again
    in the zip format (the same object tree; the tensor bytes streamed from their ranges), as every torch file
    ckptlib writes. Its plan entry then names the file it ``rewrites`` (what ``--verify`` compares it with).
    ``where``: the entry's ``rank`` and ``source_ranks``."""
    with open(path, "rb") as fh:
        legacy = classify_file_start(fh.read(16)) == "legacy"
    if not legacy:
        return CopyFile(name, path, nbytes, **where)
    with open_torch_file(path) as tf:
        out = tree_file(name, "rewritten in the zip format", tf.obj, **where)
    out.rewrites = path
    return out


def sub_group_size(ck: ZeroSet) -> int:
    return configured_sub_group_size(ck.ds_config)


def converter_scripts(ck: Checkpoint) -> list[str]:
    """The converter scripts DeepSpeed saved beside the tag folders (copied with a reshard)."""
    out = []
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        p = ck.location.save_dir / script
        if p.is_file():
            out.append(os.fspath(p))
    return out


def client_files(ck: Checkpoint, world_size: Optional[int]) -> tuple[list[CopyFile], list[str]]:
    """The HF Trainer / Accelerate files beside the checkpoint, carried over byte for byte so that the client
    resumes from the output (:func:`ckptlib.deepspeed.hf.training_files`; ``world_size`` None: a universal
    checkpoint), and the notes saying what was carried and what the client does for ranks without an RNG state."""
    found = hf.training_files(ck.location.save_dir, world_size, skip_folders=tuple(ck.location.tags))
    files = [CopyFile(f.name, f.source, f.bytes, kind="client") for f in found.files]
    if not files:
        return [], []
    who = {hf.TRAINER: "for the HF Trainer", hf.ACCELERATE: "for Accelerate"}.get(found.client, "for from_pretrained")
    return files, [f"carried over {who}: {', '.join(f.name for f in found.files)}", *found.notes]


def carried_client(ck: Checkpoint, world: int, hf_files: bool = True) -> tuple[list, list[str]]:
    """The client files carried over (``hf_files``: HF Trainer, Accelerate; :func:`client_files`) and the notes on
    them and on the global batch at ``world`` ranks (:func:`batch_note`)."""
    files, notes = client_files(ck, world) if hf_files else ([], [])
    note = batch_note(ck, world)
    return files, notes + ([note] if note else [])


def batch_note(ck: Checkpoint, world_size: int) -> Optional[str]:
    """What per-rank micro-batch keeps the checkpoint's global batch at ``world_size`` data-parallel ranks
    (DeepSpeed checks train_batch_size = micro-batch x accumulation steps x ranks when it starts)."""
    cfg = ck.ds_config or {}
    try:
        total, micro = int(cfg["train_batch_size"]), int(cfg["train_micro_batch_size_per_gpu"])
        accumulation = int(cfg.get("gradient_accumulation_steps") or 1)
    except (KeyError, TypeError, ValueError):
        return None
    before = f"the global batch was {total} = {micro} per rank x {accumulation} accumulation step(s) x {ck.mesh.dp} ranks"
    if total % (world_size * accumulation) == 0:
        new = total // (world_size * accumulation)
        if new == micro:
            return None
        return (f"{before}; to keep it at {world_size} ranks, use a micro-batch of {new} per rank "
                f"(HF: per_device_train_batch_size={new}) with {accumulation} accumulation step(s)")
    return (f"{before}; {total} does not divide among {world_size} ranks x {accumulation} accumulation step(s): "
            f"pick micro-batch x accumulation x {world_size} = the global batch you want (the data order changes)")


__all__ = ["carried_client", "client_files", "batch_note", "DEFAULT_SUB_GROUP_SIZE", "DROP", "replace", "streamed", "copied", "to_ranges",
           "optim_prefix", "tree_file", "carried", "TreeFiles", "sub_group_size", "converter_scripts"]
