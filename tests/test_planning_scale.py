"""What makes `inspect` and the plans fast on checkpoints of many ranks keeps them exact.

- ckptlib's own zip directory reader finds what Python's ``zipfile`` finds, on every file of real DeepSpeed
  checkpoints, and its data offsets point at the bytes ``zipfile`` reads;
- a file whose pickle repeats one already read (ZeRO-3's model-states files of ranks 1..N-1, all optimizer
  files) gives the same storages and object tree, and is checked as thoroughly: a storage its own zip
  directory lacks or makes too short is reported as without the memo;
- the local headers of a ZeRO-3 model file's many empty storages cost one read, whatever their number;
- a reshard plan's shared trees and sizes computed once equal what each file alone gives, and the sizes
  are those of the files written, also where the target file names grow a digit;
- slicing a range list by binary search gives what walking it from the start gives.
"""
from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ckptlib
from ckptlib.errors import IncompleteCheckpointError
from ckptlib.layout.ranges import StoredRange, Zeros, numel, range_starts, slice_ranges
from ckptlib.reshard.trees import tree_file
from ckptlib.io.torchzip import NewTensor, PickleMemo, TensorHandle, TorchFile, open_torch_file
from ckptlib.io.torchzip.trees import walk_tensors
from ckptlib.io.torchzip.writer import save

from .test_synthetic_checkpoint import TINY, synth


def tag_files(fx: dict) -> list[Path]:
    root = fx["checkpoint_path"]
    return sorted((root / (root / "latest").read_text().strip()).glob("*.pt"))


def tree(obj):
    """The object tree with tensors as (dtype, shape, storage key, offset): what unpickling made."""
    if isinstance(obj, TensorHandle):
        return ("tensor", obj.dtype_name, tuple(obj.shape), tuple(obj.stride), obj.storage.key, obj.storage_offset)
    if isinstance(obj, dict):
        return (type(obj).__name__, tuple((k, tree(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(tree(v) for v in obj))
    return repr(obj)


def pickle_of(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def storages(tf: TorchFile) -> dict:
    return {k: (r.dtype_name, r.numel, r.data_offset, r.stored_bytes, r.stored_crc) for k, r in tf.storages.items()}


@pytest.mark.parametrize("name", ["z2_bf16_w4", "z3_bf16_w4"])
def test_the_zip_directory_and_data_offsets_are_those_zipfile_reads(fixture_by_name, name):
    paths = tag_files(fixture_by_name(name))
    assert len(paths) >= 5
    for path in paths:
        tf = open_torch_file(path)
        refs = tf.storages
        assert refs
        with zipfile.ZipFile(path) as z:
            infos = {i.filename: i for i in z.infolist()}
            prefix = next(n for n in infos if n.endswith("/data.pkl"))[: -len("data.pkl")]
            data = path.read_bytes()
            for key, r in refs.items():
                info = infos[f"{prefix}data/{key}"]
                assert (r.stored_bytes, r.stored_crc) == (info.file_size, info.CRC)
                assert data[r.data_offset:r.data_offset + r.stored_bytes] == z.read(info)


def test_a_repeated_pickle_gives_the_same_tree_and_storages_built_on_first_use(fixture_by_name):
    paths = tag_files(fixture_by_name("z3_bf16_w4"))  # ranks 1-3 share a model pickle, all ranks an optimizer one
    memo = PickleMemo()
    with_memo = [TorchFile(p, memo=memo) for p in paths]
    alone = [open_torch_file(p) for p in paths]
    pickles = {pickle_of(p) for p in paths}
    assert len(pickles) < len(paths) and memo.held == sum(len(p) for p in pickles)  # each distinct pickle once
    for a, b in zip(with_memo, alone):
        assert storages(a) == storages(b)  # checked and resolved when opened
    for a, b in zip(with_memo, alone):
        assert tree(a.obj) == tree(b.obj)
        handles = [t for t in walk_tensors(a.obj, []) if isinstance(t, TensorHandle)]
        assert handles and all(h.storage.file is a for h in handles)  # its own file's storages
    for f in with_memo + alone:
        f.close()


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    obj = {"a": NewTensor("float32", (10,), data=np.arange(10, dtype=np.float32).tobytes()),
           "b": NewTensor("float32", (3,), data=np.ones(3, dtype=np.float32).tobytes())}
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    save(obj, first, archive="x")
    save(obj, second, archive="x")  # the same pickle
    return first, second


def _patch_directory_entry(path: Path, member: str, *, size: int = None, name: str = None,
                           local: bool = False) -> None:
    """Change the central directory entry of ``member``: its recorded sizes, or its name (same length); with
    ``local`` its local header too, so that the two agree."""
    data = bytearray(path.read_bytes())
    at = data.index(member.encode(), data.index(b"PK\x01\x02")) - 46
    assert data[at:at + 4] == b"PK\x01\x02"
    entries = [(at, 20, 46)]
    if local:
        here = data.index(member.encode()) - 30
        assert data[here:here + 4] == b"PK\x03\x04"
        entries.append((here, 18, 30))
    for start, sizes, names in entries:
        if size is not None:
            data[start + sizes:start + sizes + 8] = struct.pack("<II", size, size)
        if name is not None:
            assert len(name) == len(member)
            data[start + names:start + names + len(name)] = name.encode()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    ({"size": 8}, "local header of zip entry x/data/0 records"),
    ({"name": "x/data/7"}, "local header of zip entry x/data/7 names"),
    ({"size": 8, "local": True}, "x/data/0: its data, where its local header puts it, ends 32 bytes before"),
    ({"name": "x/data/7", "local": True}, "storage 0 is missing")])
def test_a_repeated_pickle_is_checked_against_its_own_zip_directory(tmp_path, damage, message):
    """A file whose pickle the memo already holds is still checked against its own zip: the same refusal, naming
    it, as without the memo (damage to the directory alone, or to the directory and local header alike)."""
    first, second = _pair(tmp_path)
    _patch_directory_entry(second, "x/data/0", **damage)
    with pytest.raises(IncompleteCheckpointError, match=message) as alone:
        open_torch_file(second)  # without the memo
    memo = PickleMemo()
    TorchFile(first, memo=memo).close()
    assert memo.held > 0
    with pytest.raises(IncompleteCheckpointError) as e:
        TorchFile(second, memo=memo)
    assert str(e.value) == str(alone.value) and str(second) in str(e.value)


def test_the_headers_of_many_empty_storages_cost_one_read(tmp_path):
    synth.make(tmp_path / "ckpt", 3, 4, step=2, **dict(TINY, layers=12))
    path = next((tmp_path / "ckpt" / "global_step2").glob("zero_pp_rank_1_*model_states.pt"))
    tf = open_torch_file(path)
    assert len(tf.storages) == 12 * 9 + 3
    # its start, the end records, the directory, two runs of local headers, the byteorder record, the pickle:
    # a constant, whatever the number of storages
    assert tf.stats.reads <= 7


@pytest.mark.parametrize("name", ["z3_bf16_w4", "z2_bf16_w4"])
def test_shared_trees_and_sizes_are_those_of_each_file_and_of_the_output(fixture_by_name, tmp_path, name):
    src = fixture_by_name(name)["checkpoint_path"]
    plan = ckptlib.plan_reshard(src, tmp_path / "out", 12)  # target names zero_pp_rank_9_* and zero_pp_rank_10_*
    trees = [f for f in plan.files if f.kind in ("model_states", "optim_states")]
    assert len(trees) == (24 if "z3" in name else 13)
    for f in trees:
        alone = tree_file(f.name, f.kind, f.obj)
        assert (alone.size, alone.read_bytes, alone.write_bytes) == (f.size, f.read_bytes, f.write_bytes), f.name
    ckptlib.run(plan)
    for f in trees:
        assert (tmp_path / "out" / f.name).stat().st_size == f.size, f.name


def test_slicing_with_range_starts_gives_what_walking_from_the_first_range_gives():
    rng = np.random.default_rng(5)
    ranges = []
    for i in range(300):
        n = int(rng.integers(0, 5))  # zero-length ranges too
        ranges.append(Zeros(n) if i % 7 == 3 else StoredRange("f", 64 * i, "float32", n))
    total, starts = numel(ranges), range_starts(ranges)
    assert total > 400
    for _ in range(2000):
        start = int(rng.integers(0, total))
        count = int(rng.integers(0, total - start + 1))
        assert slice_ranges(ranges, start, count, starts) == slice_ranges(ranges, start, count)
    for start, count in ((total, 1), (total - 1, 2), (0, total + 1)):
        with pytest.raises(IndexError):
            slice_ranges(ranges, start, count, starts)
