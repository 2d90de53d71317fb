"""Range lists, handles' byte ranges and the streaming copy, on hand-made torch files (no DeepSpeed)."""
from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlib.errors import IncompleteCheckpointError
from ckptlib.layout.ranges import StoredRange, Zeros, numel, paths, slice_ranges, stored_bytes
from ckptlib.io.sinks import PwriteSink
from ckptlib.io.sources import SourceFiles, check_unchanged, stamp
from ckptlib.io.streaming import ChunkBuffers, copy_ranges, read_ranges
from ckptlib.io.torchzip import open_torch_file


def test_slice_ranges_cuts_stored_ranges_and_zeros():
    a = StoredRange("/f", 100, "float32", 10)
    b = StoredRange("/g", 0, "bfloat16", 4)
    rs = [a, Zeros(3), b]
    assert numel(rs) == 17 and stored_bytes(rs) == 48 and paths(rs) == ["/f", "/g"]
    assert slice_ranges(rs, 8, 7) == [StoredRange("/f", 132, "float32", 2), Zeros(3), StoredRange("/g", 0, "bfloat16", 2)]
    assert slice_ranges(rs, 0, 0) == []
    with pytest.raises(IndexError):
        slice_ranges(rs, 10, 8)
    with pytest.raises(IndexError):
        a.sub(5, 6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 4), st.sampled_from(["t", "slice", "perm", "plain"]),
       st.data())
def test_handle_ranges_cover_any_view_in_order(tmp_path_factory, a, b, c, how, data):
    base = torch.arange(a * b * c * 2, dtype=torch.float32).reshape(a, b, c * 2)
    view = {"t": base.transpose(0, 1), "slice": base[:, :, ::2], "perm": base.permute(2, 0, 1),
            "plain": base[1:] if a > 1 else base}[how]
    f = tmp_path_factory.mktemp("h") / "x.pt"
    torch.save({"v": view, "keep": base}, f)
    with open_torch_file(f) as tf, SourceFiles() as files:
        h = tf.obj["v"]
        flat = view.reshape(-1)
        start = data.draw(st.integers(0, flat.numel()))
        count = data.draw(st.integers(0, flat.numel() - start))
        ranges = h.ranges(start, count)
        assert numel(ranges) == count
        assert torch.equal(read_ranges(ranges, "float32", files), flat[start:start + count])
        assert torch.equal(h.read_flat(start, count), flat[start:start + count])
        assert torch.equal(h.read(), view)


class _Sink:
    """Collects what it is given; can copy inside the kernel (like PwriteSink) when ``can_copy``."""

    def __init__(self, can_copy=False, takes_crc=False):
        self.data, self.can_copy, self.takes_crc, self.crcs = bytearray(), can_copy, takes_crc, []

    def write(self, mv, crc=None):
        self.data += bytes(mv)
        self.crcs.append(crc)

    def copy_from(self, fd, offset, n):
        self.data += os.pread(fd, n, offset)


@pytest.mark.parametrize("chunk", [16, 40, 4096])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
def test_copy_ranges_casts_pads_and_copies_like_torch(tmp_path, chunk, out_dtype):
    x = torch.randn(1000) * 100
    y = torch.randn(77).to(torch.bfloat16)
    torch.save({"x": x, "y": y}, tmp_path / "s.pt")
    want_dtype = getattr(torch, out_dtype)
    want = torch.cat([x[5:505].to(want_dtype), torch.zeros(9, dtype=want_dtype), y.to(want_dtype)])
    with open_torch_file(tmp_path / "s.pt") as tf:
        ranges = tf.obj["x"].ranges(5, 500) + [Zeros(9)] + tf.obj["y"].ranges()
    for can_copy in (False, True):
        sink = _Sink(can_copy=can_copy)
        with SourceFiles() as files:
            n = copy_ranges(ranges, out_dtype, sink, ChunkBuffers(chunk), files)
            assert files.stats.bytes_read == 500 * 4 + 77 * 2
        assert n == len(sink.data) == want.numel() * want.element_size()
        assert bytes(sink.data) == want.view(torch.uint8).numpy().tobytes()


def test_a_crc_keeping_sink_gets_crcs_computed_beside_the_read(tmp_path):
    x = torch.arange(300, dtype=torch.float32)
    torch.save({"x": x}, tmp_path / "s.pt")
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        sink = PwriteSink(fd, 0, crc=True)
        with open_torch_file(tmp_path / "s.pt") as tf, SourceFiles() as files:
            copy_ranges(tf.obj["x"].ranges(), "float32", sink, ChunkBuffers(64), files)
    finally:
        os.close(fd)
    raw = (tmp_path / "out").read_bytes()
    assert raw == x.numpy().tobytes() and sink.crc == zlib.crc32(raw) and sink.written == 1200


def test_copy_ranges_stops_when_cancelled(tmp_path):
    import threading

    from ckptlib.errors import Cancelled

    torch.save({"x": torch.zeros(1000)}, tmp_path / "s.pt")
    stop = threading.Event()
    sink = _Sink()
    with open_torch_file(tmp_path / "s.pt") as tf, SourceFiles() as files:
        with pytest.raises(Cancelled):
            copy_ranges(tf.obj["x"].ranges(), "float32", sink, ChunkBuffers(400), files,
                        progress=lambda n: stop.set(), cancel=stop)
    assert len(sink.data) == 400  # one chunk, then the cancel was seen


def test_source_files_name_the_file_that_is_missing_or_short(tmp_path):
    with SourceFiles() as files:
        with pytest.raises(IncompleteCheckpointError, match="gone.pt"):
            files.read_into(str(tmp_path / "gone.pt"), 0, memoryview(bytearray(4)))
        (tmp_path / "short").write_bytes(b"abc")
        with pytest.raises(IncompleteCheckpointError, match="truncated"):
            files.read_into(str(tmp_path / "short"), 0, memoryview(bytearray(8)))


def test_check_unchanged_notices_a_changed_or_vanished_file(tmp_path):
    f = tmp_path / "a"
    f.write_bytes(b"1234")
    stamps = [stamp(str(f))]
    check_unchanged(stamps)
    f.write_bytes(b"12345")
    with pytest.raises(IncompleteCheckpointError, match="changed since the plan"):
        check_unchanged(stamps)
    f.unlink()
    with pytest.raises(IncompleteCheckpointError, match="gone since the plan"):
        check_unchanged(stamps)


def test_first_differences_reads_the_first_copy_once_for_all_the_others(tmp_path):
    """A tensor stored on several ranks is compared with its first copy in one pass: each other copy gets
    the first element where it differs (0 for another length), None where it is equal, across chunks,
    stored ranges split anywhere and zeros."""
    from ckptlib.io.streaming import first_differences

    n = 1000
    base = torch.arange(n, dtype=torch.float32)
    changed = base.clone()
    changed[777] = -1.0
    path = tmp_path / "copies.bin"
    blobs = [base, base, changed, base[:400]]
    offsets, data = [], b""
    for t in blobs:
        offsets.append(len(data))
        data += t.numpy().tobytes()
    path.write_bytes(data)

    def stored(i, count, split=None):
        if split is None:
            return [StoredRange(str(path), offsets[i], "float32", count)]
        return [StoredRange(str(path), offsets[i], "float32", split),
                StoredRange(str(path), offsets[i] + 4 * split, "float32", count - split)]

    a = stored(0, n, split=333)
    others = [stored(1, n), stored(2, n, split=500), stored(3, 400), stored(1, n, split=7)]
    zeros_a, zeros_b = [Zeros(10)], [Zeros(4), Zeros(6)]
    reads_before = None
    with SourceFiles() as files:
        got = first_differences(a, others, "float32", files, chunk_bytes=256)
        reads_before = files.stats.bytes_read
        assert first_differences(zeros_a, [zeros_b], "float32", files) == [None]
    assert got == [None, 777, 0, None]
    # ``a`` once; the equal copies whole; the changed one up to the end of the chunk of 64 holding element 777
    # (832 elements); the short one not at all
    assert reads_before == 4 * (n + n + 832 + n)


def test_a_reader_that_does_not_drop_leaves_every_page(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096 * 4))
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append((off, n)))
    for drop, expect in ((False, []), (True, [(0, 4096)])):
        dropped.clear()
        with SourceFiles(drop=drop) as files:
            files.read_gather([StoredRange(str(path), 0, "float32", 1024)], memoryview(bytearray(4096)), drop=True)
            assert files.drops is drop
        assert dropped == expect


def test_kept_spans_keep_their_pages_when_the_rest_is_dropped(tmp_path, monkeypatch):
    """SourceFiles.keep_cached: drop_cache leaves every span that touches a kept one (the copies a run
    compares beside its writing) and drops the others."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(4096 * 8))
    dropped = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append((off, n)) or real(fd, off, n, advice))
    with SourceFiles() as files:
        files.read_into(str(path), 0, memoryview(bytearray(16)))  # opens it
        files.keep_cached([(str(path), 4096, 100), (str(path), 0, 10)])
        for off, n in [(10, 4086), (10, 4087), (4196, 4000), (8192, 100), (0, 1)]:
            files.drop_cache(str(path), off, n)
    assert dropped == [(10, 4086), (4196, 4000), (8192, 100)]
