"""ckptlib's torch zip writer reproduces every fixture file exactly (objects, storages, views, sharing)."""
import glob

import pytest
import torch

from ckptlib.layout.ranges import Zeros
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.writer import NewTensor, save


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


# ---------------------------------------------------------------- the zip container written without zipfile
import collections  # noqa: E402
import os  # noqa: E402
import zipfile  # noqa: E402
import zlib  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ckptlib.io.sinks import WriteBehind  # noqa: E402
from ckptlib.io.torchzip.zipfmt import crc32_combine  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 2**40))
def test_crc32_combine_matches_zlib(a, b, zeros):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    # lengths far beyond memory: combining with a run of zero bytes (crc32 of n zeros, built by doubling)
    if zeros < 2**20:
        z = bytes(zeros)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(z), zeros) == zlib.crc32(a + z)


def test_crc32_combine_of_huge_lengths_is_consistent():
    # (A + Z1) + Z2 == A + (Z1 + Z2) for runs of zeros longer than 2**32 bytes (needs x^(2^k), k >= 32)
    a, n1, n2 = zlib.crc32(b"abc"), 3 * 2**31 + 5, 2**33 + 7
    zero_crc = {}

    def zeros(n):  # crc32 of n zero bytes, by doubling
        if n not in zero_crc:
            if n == 0:
                zero_crc[n] = 0
            elif n == 1:
                zero_crc[n] = zlib.crc32(b"\0")
            else:
                h = n // 2
                zero_crc[n] = crc32_combine(crc32_combine(zeros(h), zeros(h), h), zeros(n - 2 * h), n - 2 * h)
        return zero_crc[n]

    left = crc32_combine(crc32_combine(a, zeros(n1), n1), zeros(n2), n2)
    right = crc32_combine(a, crc32_combine(zeros(n1), zeros(n2), n2), n1 + n2)
    assert left == right
    assert zeros(2**20) == zlib.crc32(bytes(2**20))


def _members_ok(path):
    """Python's zipfile re-reads every member and checks its CRC-32; data offsets are 64-byte aligned."""
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        return {i.filename: (i.file_size, i.CRC) for i in z.infolist()}


@pytest.mark.parametrize("zip64_limit", [0xFFFFFFFF, 1, 300])
def test_zip64_fields_read_by_torch_zipfile_and_ckptlib(tmp_path, zip64_limit):
    ts = collections.OrderedDict(a=torch.randn(100), b=torch.arange(50, dtype=torch.int64), c=torch.randn(7).half())
    obj = {"t": collections.OrderedDict((k, NewTensor.from_tensor(v)) for k, v in ts.items()), "n": [1, "x"]}
    save(obj, tmp_path / "z.pt", zip64_limit=zip64_limit)
    members = _members_ok(tmp_path / "z.pt")
    assert len(members) == 3 + 6  # data.pkl, .format_version, .storage_alignment, byteorder, version, serialization id
    for mmap in (False, True):
        back = torch.load(tmp_path / "z.pt", weights_only=True, mmap=mmap)
        assert back["n"] == [1, "x"] and all(torch.equal(back["t"][k], v) for k, v in ts.items())
    f = open_torch_file(tmp_path / "z.pt")
    for k, v in ts.items():
        h = f.obj["t"][k]
        assert h.storage.data_offset % 64 == 0
        assert torch.equal(h.read_flat(0, h.numel, torch.empty(h.numel, dtype=h.dtype)), v)


def test_storage_copies_keep_the_source_crc_and_equal_the_streamed_copy(ds_fixtures, tmp_path):
    path = sorted(glob.glob(str(ds_fixtures["z2_bf16_w2"]["path"] / "*" / "*" / "*model_states.pt")))[0]
    f = open_torch_file(path)
    save(f.obj, tmp_path / "kernel.pt", archive="a")  # storages copied inside the kernel, CRC from the source
    refs = list(f.storages.values())
    assert refs and all(r.stored_crc is not None for r in refs)
    for r in refs:
        r.stored_crc = None  # no recorded CRC: streamed through the buffers, CRC computed
    save(f.obj, tmp_path / "streamed.pt", archive="a")
    assert (tmp_path / "kernel.pt").read_bytes() == (tmp_path / "streamed.pt").read_bytes()
    src_crcs = {n.split("/", 1)[1]: v for n, v in _members_ok(path).items() if "/data/" in n}
    out_crcs = {n.split("/", 1)[1]: v for n, v in _members_ok(tmp_path / "kernel.pt").items() if "/data/" in n}
    assert sorted(v for v in src_crcs.values()) == sorted(v for v in out_crcs.values())


def test_new_tensor_bytes_must_match_its_shape(tmp_path):
    short = NewTensor(torch.float32, (4,), data=bytes(12))  # inline bytes: 12 where 16 are needed
    with pytest.raises(ValueError, match="came to 12 instead of 16"):
        save({"x": short}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="needs 4 elements; its ranges hold 3"):
        NewTensor("float32", (4,), ranges=(Zeros(3),))


def test_save_reserves_the_members_blocks_before_writing_them(tmp_path, monkeypatch):
    """save() reserves every byte up to the central directory (the members) before the first is written, and
    the file is what torch reads either way."""
    import ckptlib.io.torchzip.writer as writer

    calls = []
    real = writer.preallocate
    monkeypatch.setattr(writer, "preallocate", lambda fd, off, n: calls.append((os.fstat(fd).st_size, off, n))
                        or real(fd, off, n))
    tree = {"w": NewTensor(torch.float32, (1000,), data=torch.arange(1000, dtype=torch.float32).numpy().tobytes()),
            "b": NewTensor(torch.bfloat16, (3,), ranges=(Zeros(3),))}
    path = tmp_path / "t.pt"
    save(tree, path)
    with zipfile.ZipFile(path) as z:
        members_end = max(i.header_offset for i in z.infolist())  # the last member's header ...
        last = max(z.infolist(), key=lambda i: i.header_offset)
    assert len(calls) == 1 and calls[0][:2] == (0, 0)  # an empty file, from its start
    assert calls[0][2] >= members_end + last.file_size and calls[0][2] < path.stat().st_size  # up to the directory
    got = torch.load(path, weights_only=True)
    assert torch.equal(got["w"], torch.arange(1000, dtype=torch.float32)) and not got["b"].any()


@pytest.mark.parametrize("window,lag", [(1, 0), (100, 1), (16 * 2**20, 2)])
def test_write_behind_keeps_every_byte(tmp_path, window, lag):
    data = os.urandom(300_000)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    wb = WriteBehind(fd, window=window, lag=lag)
    pieces = [(0, 1000), (1000, 50_000), (200_000, 100_000), (51_000, 149_000)]  # out of order too
    for off, n in pieces:
        os.pwrite(fd, data[off:off + n], off)
        wb.wrote(off, n)
    wb.close()
    os.close(fd)
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("setting,expect_calls", [("1", True), ("0", False)])
def test_write_behind_hands_windows_to_the_disk_unless_turned_off(tmp_path, monkeypatch, setting, expect_calls):
    import ckptlib.io.sinks as sinks

    calls = []
    monkeypatch.setattr(sinks, "_sync_file_range", lambda fd, off, n, flags: calls.append((off, n, flags)))
    monkeypatch.setenv("CKPTLIB_WRITE_BEHIND", setting)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    wb = WriteBehind(fd, window=1000, lag=2)
    for off in range(0, 10_000, 500):
        os.pwrite(fd, bytes(500), off)
        wb.wrote(off, 500)
    wb.close()
    os.close(fd)
    assert (tmp_path / "f").stat().st_size == 10_000
    if expect_calls:
        started = [(o, n) for o, n, f in calls if f == 2]
        waited = [(o, n) for o, n, f in calls if f == 7]
        assert started == [(o, 1000) for o in range(0, 10_000, 1000)] and sorted(waited) == started
    else:
        assert calls == []
