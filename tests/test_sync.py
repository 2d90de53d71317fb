"""Durability: by default an output is on disk before it appears under its name; ``sync=False``
(``--no-sync``) leaves the writing to the kernel after the run, with the same bytes and the same atomicity
against a killed or failing run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptlib
import ckptlib.execute.writers as writers
import ckptlib.io.sinks as sinks
from ckptlib.io.output import AtomicOutputDir
from ckptlib.execute.writers import kernel_writeback_threshold
from ckptlib.system.memory import cgroup_memory
from ckptlib.io.sinks import UnsyncedBudget, WriteBehind


def files_under(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def assert_same_tree(a, b):
    names = files_under(a)
    assert names and names == files_under(b)
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.fixture
def fsyncs(monkeypatch):
    """Every os.fsync made in this process, as the paths of the descriptors synced."""
    calls, real = [], os.fsync

    def recording(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls


@pytest.mark.parametrize("sync", [True, False])
def test_atomic_output_syncs_files_and_folders_only_when_asked(tmp_path, fsyncs, sync):
    out = tmp_path / "out"
    with AtomicOutputDir(out, sync=sync) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "a.bin").write_bytes(b"a" * 1000)
        (tmp / "sub" / "b.bin").write_bytes(b"b")
        assert not out.exists()
    assert (out / "a.bin").read_bytes() == b"a" * 1000 and (out / "sub" / "b.bin").read_bytes() == b"b"
    if sync:  # both files, both temporary folders, and the parent after the rename
        assert sum(p.endswith("a.bin") for p in fsyncs) == 1 and sum(p.endswith("b.bin") for p in fsyncs) == 1
        assert str(tmp_path) in fsyncs and len(fsyncs) == 5
    else:
        assert fsyncs == []


def test_a_failing_unsynced_run_still_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with AtomicOutputDir(out, sync=False) as tmp:
            (tmp / "a.bin").write_bytes(b"a")
            raise RuntimeError("boom")
    assert not out.exists() and os.listdir(tmp_path) == []


def test_the_budget_is_spent_once_and_then_refuses():
    b = UnsyncedBudget(1000)
    assert b.take(600) and b.left == 400
    assert not b.take(500) and b.left == 0  # refused, and from then on nothing is left to the kernel
    assert not b.take(1) and UnsyncedBudget(-5).left == 0


@pytest.mark.parametrize("budget,first_started", [(None, 0), (10_000, None), (4_000, 4_000)])
def test_write_behind_leaves_bytes_to_the_kernel_while_the_budget_lasts(tmp_path, monkeypatch, budget, first_started):
    calls = []
    monkeypatch.setattr(sinks, "_sync_file_range", lambda fd, off, n, flags: calls.append((off, n, flags)))
    monkeypatch.setenv("CKPTLIB_WRITE_BEHIND", "1")
    data = os.urandom(10_000)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    wb = WriteBehind(fd, window=1000, lag=2, unsynced=UnsyncedBudget(budget) if budget is not None else None)
    for off in range(0, 10_000, 500):
        os.pwrite(fd, data[off:off + 500], off)
        wb.wrote(off, 500)
    wb.close()
    os.close(fd)
    assert (tmp_path / "f").read_bytes() == data
    started = [(o, n) for o, n, f in calls if f == 2]
    if first_started is None:  # the whole file within the budget: the disk is never waited for
        assert calls == []
    else:  # once spent, every later byte is handed to the disk and waited for, as in a synced run
        assert started == [(o, 1000) for o in range(first_started, 10_000, 1000)]
        assert sorted((o, n) for o, n, f in calls if f == 7) == started


def test_preallocate_reserves_the_blocks_or_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """fallocate(2) mode 0: the range's blocks are reserved (it reads as zeros); where the file system cannot
    (EOPNOTSUPP, ...) nothing happens; a full disk is an OSError at once."""
    import ctypes
    import errno

    path = tmp_path / "f"
    with open(path, "wb") as fh:
        fh.write(b"head")
        fh.flush()
        done = sinks.preallocate(fh.fileno(), 4, 8 * 2**20)
    if sinks._fallocate is None:
        assert done is False
        pytest.skip("no fallocate here")
    if done:
        st = path.stat()
        assert st.st_size == 4 + 8 * 2**20 and st.st_blocks * 512 >= 8 * 2**20  # reserved, not sparse
        with open(path, "rb") as fh:
            assert fh.read(4) == b"head" and fh.read() == bytes(8 * 2**20)

    def failing(err):
        def call(fd, mode, offset, n):
            ctypes.set_errno(err)
            return -1
        return call

    other = tmp_path / "g"
    with open(other, "wb") as fh:
        monkeypatch.setattr(sinks, "_fallocate", failing(errno.EOPNOTSUPP))
        assert sinks.preallocate(fh.fileno(), 0, 4096) is False
        assert other.stat().st_size == 0
        monkeypatch.setattr(sinks, "_fallocate", failing(errno.ENOSPC))
        with pytest.raises(OSError) as e:
            sinks.preallocate(fh.fileno(), 0, 4096)
        assert e.value.errno == errno.ENOSPC


def test_a_run_reserves_its_files_blocks_first_and_a_full_disk_leaves_nothing(fixture_by_name, tmp_path, monkeypatch):
    """prepare() reserves each safetensors file's data blocks before any byte is written; when the disk is
    full then, the run stops there with one message and leaves nothing."""
    import ctypes
    import errno

    src = fixture_by_name("large_w2")["checkpoint_path"]
    plan = ckptlib.plan_export(src, tmp_path / "out", max_shard_size="10MB")
    reserved = []
    real = sinks.preallocate

    def recording(fd, offset, n):
        reserved.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
        return real(fd, offset, n)

    monkeypatch.setattr(writers, "preallocate", recording)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    writers.prepare(plan, tmp)
    files = [f for f in plan.files if f.name.endswith(".safetensors")]
    assert len(files) > 1 and sorted(Path(p).name for p, _, _ in reserved) == sorted(f.name for f in files)
    for f in files:
        layout = writers.safetensors_layout(f)
        assert (str(tmp / f.name), layout.data_start, layout.file_size - layout.data_start) in reserved

    def full(fd, mode, offset, n):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(writers, "preallocate", real)
    monkeypatch.setattr(sinks, "_fallocate", full)
    with pytest.raises(ckptlib.errors.OutputError, match="No space left on device.*nothing was created"):
        ckptlib.run(plan)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_full_window_waits_for_catch_up_or_the_next_window(tmp_path, monkeypatch):
    """A full window is handed to the disk at the writer's next catch_up (cast_pieces calls it once the cast
    helper is busy), or when the window after it fills: never more than one waits, in file order."""
    calls = []
    monkeypatch.setattr(sinks, "_sync_file_range", lambda fd, off, n, flags: calls.append((off, n, flags)))
    monkeypatch.setenv("CKPTLIB_WRITE_BEHIND", "1")
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        wb = WriteBehind(fd, window=1000, lag=8)
        wb.wrote(0, 1000)
        assert calls == []  # full, waiting
        wb.catch_up()
        assert calls == [(0, 1000, 2)]
        wb.catch_up()
        assert calls == [(0, 1000, 2)]  # nothing more waits
        wb.wrote(1000, 1000)
        wb.wrote(2000, 1000)  # the second full window starts the first
        assert calls == [(0, 1000, 2), (1000, 1000, 2)]
        wb.wrote(3000, 500)
        wb.close()  # the waiting window, then the partial one, then every one in flight waited for
        assert [c for c in calls if c[2] == 2] == [(o, n, 2) for o, n in ((0, 1000), (1000, 1000), (2000, 1000),
                                                                         (3000, 500))]
        assert sorted(c[:2] for c in calls if c[2] == 7) == [(0, 1000), (1000, 1000), (2000, 1000), (3000, 500)]
    finally:
        os.close(fd)


@pytest.mark.parametrize("fail", [False, True])
def test_a_synced_write_behind_flushes_in_the_background_and_raises_a_failed_flush(tmp_path, monkeypatch, fail):
    """Every FLUSH_EVERY released windows a synced run's file is fdatasync'ed in a thread of its own (on a
    duplicate descriptor); an unsynced run never is; a flush that fails is raised by close(), not lost."""
    flushed, real = [], os.fdatasync

    def recording(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        if fail:
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    monkeypatch.setenv("CKPTLIB_WRITE_BEHIND", "1")
    data = os.urandom(40_000)
    for budget in (None, 100_000):
        flushed.clear()
        path = tmp_path / f"f{budget}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        wb = WriteBehind(fd, window=1000, lag=2, unsynced=UnsyncedBudget(budget) if budget is not None else None)
        for off in range(0, 40_000, 1000):
            os.pwrite(fd, data[off:off + 1000], off)
            wb.wrote(off, 1000)
        if fail and budget is None:
            with pytest.raises(OSError, match="Input/output error"):
                wb.close()
        else:
            wb.close()
        os.close(fd)
        assert path.read_bytes() == data
        if budget is None:  # 40 windows released: a flush after the 8th at least, one at a time
            assert 1 <= len(flushed) <= 40 // sinks.FLUSH_EVERY and set(flushed) == {str(path)}
        else:
            assert flushed == []


def test_kernel_writeback_threshold_follows_the_vm_settings():
    fixed = int(open("/proc/sys/vm/dirty_background_bytes").read())
    ratio = int(open("/proc/sys/vm/dirty_background_ratio").read())
    room = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    limit, usage = cgroup_memory()
    if limit is not None:
        room = min(room, limit - (usage or 0))
    want = min(fixed, room) if fixed else room * ratio // 100
    got = kernel_writeback_threshold()
    assert got > 0 and abs(got - want) <= want // 10 + 2**20  # available memory moves a little in between


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_unsynced_export_writes_the_same_bytes_and_never_waits_for_the_disk(fixture_by_name, tmp_path, fsyncs, fmt):
    src = fixture_by_name("large_w2")["checkpoint_path"]
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "synced", format=fmt, max_shard_size="10MB"))
    synced_fsyncs = len(fsyncs)
    assert synced_fsyncs >= len(files_under(tmp_path / "synced")) + 2
    del fsyncs[:]
    plan = ckptlib.plan_export(src, tmp_path / "unsynced", format=fmt, max_shard_size="10MB", sync=False)
    assert plan.to_dict()["sync"] is False and "not synced" in plan.describe()
    assert ckptlib.plan_export(src, tmp_path / "x").to_dict()["sync"] is True
    ckptlib.run(plan)
    assert fsyncs == []
    assert_same_tree(tmp_path / "synced", tmp_path / "unsynced")


def test_unsynced_output_beyond_the_budget_goes_write_behind(fixture_by_name, tmp_path, monkeypatch):
    """A budget smaller than the output: the rest is handed to the disk as it is written."""
    calls = []
    real = sinks._sync_file_range
    monkeypatch.setenv("CKPTLIB_WRITE_BEHIND", "1")
    monkeypatch.setattr(sinks, "_sync_file_range", lambda fd, off, n, flags: calls.append(n) or real(fd, off, n, flags))
    monkeypatch.setattr(writers, "kernel_writeback_threshold", lambda: 2**20)
    src = fixture_by_name("large_w2")["checkpoint_path"]
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "a", sync=False))
    assert calls and sum(n for n in calls) > 0
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "b"))
    assert_same_tree(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize("universal", [False, True])
def test_unsynced_reshard_from_the_command_line_writes_the_same_bytes(fixture_by_name, tmp_path, universal):
    src = fixture_by_name("z2_bf16_w4")["checkpoint_path"]
    target = ["--universal"] if universal else ["--world-size", "3"]
    outs = {}
    for label, extra in (("synced", []), ("unsynced", ["--no-sync"])):
        outs[label] = tmp_path / label
        r = subprocess.run([sys.executable, "-m", "ckptlib", "reshard", str(src), str(outs[label]), *target, "-q",
                            *extra], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert_same_tree(outs["synced"], outs["unsynced"])
    r = subprocess.run([sys.executable, "-m", "ckptlib", "reshard", str(src), str(tmp_path / "p"), *target, "--plan",
                        "--json", "--no-sync"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["sync"] is False and not (tmp_path / "p").exists()


def test_unsynced_export_in_worker_processes(fixture_by_name, tmp_path):
    src = fixture_by_name("large_w2")["checkpoint_path"]
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "one", max_shard_size="10MB"))
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "two", max_shard_size="10MB", workers=2, sync=False))
    assert_same_tree(tmp_path / "one", tmp_path / "two")


@pytest.fixture
def source_drops(monkeypatch):
    """The (path, offset, length) of every POSIX_FADV_DONTNEED on a checkpoint file (not on the output)."""
    calls, real = [], os.posix_fadvise

    def recording(fd, off, n, advice):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if advice == os.POSIX_FADV_DONTNEED and "ckptlib-tmp" not in path:
            calls.append((path, off, n))
        return real(fd, off, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    return calls


@pytest.mark.parametrize("fmt,dtype", [("safetensors", "fp32"), ("safetensors", "bf16"), ("torch", "fp32")])
def test_a_run_drops_source_pages_only_when_its_reads_would_crowd_the_page_cache(fixture_by_name, tmp_path,
                                                                                  monkeypatch, source_drops, fmt, dtype):
    """Reading less than a quarter of the memory available to the page cache, the source pages stay for the
    kernel to evict (no POSIX_FADV_DONTNEED on a source file); with the room made small, every byte read is
    dropped once copied. The output is the same either way."""
    src = fixture_by_name("large_w2")["checkpoint_path"]
    plan = ckptlib.plan_export(src, tmp_path / "kept", format=fmt, dtype=dtype)
    assert 0 < plan.read_bytes * writers.DROP_SHARE < writers.page_cache_room()
    assert not writers.drops_source_pages(plan)
    ckptlib.run(plan)
    assert source_drops == []
    monkeypatch.setattr(writers, "page_cache_room", lambda: plan.read_bytes)  # reads 4x a quarter of the room
    assert writers.drops_source_pages(plan)
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "dropped", format=fmt, dtype=dtype))
    assert sum(n for _, _, n in source_drops) >= plan.read_bytes * 9 // 10  # every stored range, a header aside
    assert {p for p, _, _ in source_drops} <= {str(f) for f in Path(src).rglob("*") if f.is_file()}
    assert_same_tree(tmp_path / "kept", tmp_path / "dropped")


@pytest.fixture
def output_drops(monkeypatch):
    """The bytes of every POSIX_FADV_DONTNEED on a file of the output being written (ckptlib's temporary
    folder), and the calls of sync_file_range that wait for the disk (flags 7)."""
    calls = {"dropped": 0, "waited": 0}
    real_fadvise, real_sfr = os.posix_fadvise, sinks._sync_file_range

    def fadvise(fd, off, n, advice):
        if advice == os.POSIX_FADV_DONTNEED and "ckptlib-tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            calls["dropped"] += n
        return real_fadvise(fd, off, n, advice)

    def sfr(fd, off, n, flags):
        calls["waited"] += n if flags == 7 else 0
        return real_sfr(fd, off, n, flags)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(sinks, "_sync_file_range", sfr)
    monkeypatch.setenv("CKPTLIB_WRITE_BEHIND", "1")
    return calls


@pytest.mark.parametrize("fmt,dtype", [("safetensors", "bf16"), ("torch", "fp32")])
def test_a_run_drops_its_output_pages_only_when_its_writes_would_crowd_the_page_cache(fixture_by_name, tmp_path,
                                                                                      monkeypatch, output_drops,
                                                                                      fmt, dtype):
    """The write-behind hands the output to the disk and waits for it either way; the written (clean) pages
    are dropped only when the run writes more than a quarter of the memory available to the page cache, else
    left to the kernel as cp leaves them. The output is the same either way."""
    if sinks._sync_file_range is None:
        pytest.skip("no sync_file_range here")
    src = fixture_by_name("large_w2")["checkpoint_path"]
    plan = ckptlib.plan_export(src, tmp_path / "kept", format=fmt, dtype=dtype)
    assert 0 < plan.write_bytes * writers.DROP_SHARE < writers.page_cache_room()
    assert not writers.drops_written_pages(plan)
    ckptlib.run(plan)
    assert output_drops["dropped"] == 0 and output_drops["waited"] > 0
    monkeypatch.setattr(writers, "page_cache_room", lambda: plan.write_bytes)  # writes 4x a quarter of the room
    assert writers.drops_written_pages(plan)
    output_drops["waited"] = 0
    ckptlib.run(ckptlib.plan_export(src, tmp_path / "dropped", format=fmt, dtype=dtype))
    assert output_drops["dropped"] == output_drops["waited"] > 0  # every window waited for is dropped
    assert_same_tree(tmp_path / "kept", tmp_path / "dropped")


def test_the_share_of_the_page_cache_a_run_may_leave_behind(monkeypatch):
    """A quarter of the room: at it the pages stay, past it they are dropped (the whole plan's reads, also
    when several writing processes share them)."""
    monkeypatch.setattr(writers, "page_cache_room", lambda: 1000)
    assert not writers.drops_source_pages(type("P", (), {"read_bytes": 250})())
    assert writers.drops_source_pages(type("P", (), {"read_bytes": 251})())
    assert not writers.drops_written_pages(type("P", (), {"write_bytes": 250})())
    assert writers.drops_written_pages(type("P", (), {"write_bytes": 251})())
