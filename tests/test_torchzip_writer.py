"""ckptlib's torch zip writer reproduces every fixture file exactly (objects, storages, views, sharing)."""
import glob

import pytest
import torch

from ckptlib.torchzip import open_torch_file
from ckptlib.torchzip.writer import NewTensor, save


def _raw(t):
    """The whole storage of ``t`` as bytes (a uint8 tensor), padding and foreign views included."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def same(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and type(a) is type(b), path
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == \
            (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad), path
        assert torch.equal(_raw(a), _raw(b)) and a.__dict__ == b.__dict__, path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), path
        same(vars(a), vars(b), path)
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def test_rewrite_of_every_fixture_file_is_identical_for_torch(ds_fixtures, tmp_path):
    pytest.importorskip("deepspeed")  # torch.load of the originals needs DeepSpeed's classes
    # every kind of file: all stages and dtypes at 3 ranks, and each special configuration
    names = [n for n in ds_fixtures if n.endswith("_w3") or n == "large_w2"]
    files = sorted({f for n in names for f in glob.glob(str(ds_fixtures[n]["path"] / "*" / "*" / "*.pt"))})
    assert len(files) > 60
    for f in files:
        save(open_torch_file(f).obj, tmp_path / "rt.pt")
        a = torch.load(f, weights_only=False)
        b = torch.load(tmp_path / "rt.pt", weights_only=False)
        same(a, b, f)
        a_shared = {id(t.untyped_storage()) for t in _tensors(a)}
        b_shared = {id(t.untyped_storage()) for t in _tensors(b)}
        assert len(a_shared) == len(b_shared), f"storage sharing changed in {f}"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_new_tensors_load_with_weights_only_and_mmap(tmp_path):
    ts = {"a.w": torch.randn(3, 5), "big": torch.arange(7, dtype=torch.int64) * 2**40,
          "c": torch.randn(4).bfloat16(), "m": torch.tensor([True, False]), "e": torch.empty(0, 3)}
    import collections
    save(collections.OrderedDict((k, NewTensor.from_tensor(v)) for k, v in ts.items()), tmp_path / "o.bin")
    for mmap in (False, True):
        sd = torch.load(tmp_path / "o.bin", weights_only=True, mmap=mmap)
        assert list(sd) == list(ts) and all(torch.equal(sd[k], v) for k, v in ts.items())
