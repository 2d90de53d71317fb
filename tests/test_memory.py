"""ckptlib.system.memory: process and system memory, the sampler, watch_memory, the verdict, the plot; and
export/reshard results carrying their measured peak."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import ckptlib
from ckptlib.system import memory as mem
from ckptlib.system.memory import (MemoryReport, MemorySampler, ProcessMemory, SystemMemory, cgroup_memory, memory_verdict,
                            process_memory, system_memory)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "zero2_bf16_w2" / "ckpt"
MIB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ snapshots
def test_process_memory_splits_anonymous_and_file_backed():
    m = process_memory()
    assert m.anon > 0 and m.file > 0
    assert m.rss >= m.anon and abs(m.rss - (m.anon + m.file + m.shmem)) < 8 * MIB
    assert m.hwm >= m.rss - 8 * MIB


def test_process_memory_reads_proc_status(tmp_path, monkeypatch):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  900 kB\nVmRSS:\t  800 kB\nRssAnon:\t  500 kB\n"
                      "RssFile:\t  300 kB\nRssShmem:\t 0 kB\nThreads:\t3\n")
    monkeypatch.setattr(mem, "PROC_STATUS", status)
    assert process_memory() == ProcessMemory(rss=800 * 1024, anon=500 * 1024, file=300 * 1024, shmem=0,
                                             hwm=900 * 1024)


def _fresh(code: str) -> None:
    """Run ``code`` in a new interpreter: in a long test session the allocator reuses resident free
    memory, so "RSS grows by what is allocated" only holds in a fresh process."""
    import subprocess
    import sys
    import textwrap

    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_anonymous_memory_grows_with_an_allocation():
    _fresh("""
        import torch
        from ckptlib.system.memory import process_memory
        MIB = 2**20
        before = process_memory().anon
        block = torch.ones(64 * MIB // 4)  # touched: resident
        after = process_memory().anon
        assert after - before > 48 * MIB, (before, after)
    """)


@pytest.mark.parametrize("files, want", [
    ({"memory.max": "max\n"}, (None, None)),
    ({"memory.max": "1073741824\n", "memory.current": "104857600\n"}, (1073741824, 104857600)),
    ({"memory/memory.limit_in_bytes": "536870912", "memory/memory.usage_in_bytes": "1000"}, (536870912, 1000)),
    ({"memory/memory.limit_in_bytes": str(2**63 - 4096)}, (None, None)),  # v1: "no limit"
    ({}, (None, None)),
])
def test_cgroup_limit(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_memory(tmp_path) == want


def test_system_memory_and_headroom(monkeypatch):
    s = system_memory()
    assert 0 < s.available <= s.total
    assert s.headroom <= s.available
    assert SystemMemory(total=16 * MIB, available=10 * MIB).headroom == 10 * MIB
    assert SystemMemory(total=16 * MIB, available=10 * MIB, cgroup_limit=8 * MIB, cgroup_usage=5 * MIB).headroom \
        == 3 * MIB


# ------------------------------------------------------------------------------------------ sampler
class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_sampler_history_and_peak_driven_synchronously():
    values = iter([10, 30, 20, 50, 40])
    clock = FakeClock()
    seen = []
    s = MemorySampler(interval=0.2, maxlen=3, clock=clock, on_sample=seen.append,
                      measure=lambda: (lambda a: ProcessMemory(rss=a * MIB + MIB, anon=a * MIB, file=MIB))(next(values)))
    for _ in range(5):
        clock.t += 0.2
        s.sample()
    assert [x.anon // MIB for x in s.history] == [20, 50, 40]       # bounded history
    assert s.peak_anon == 50 * MIB and s.peak_rss == 51 * MIB        # the peak survives the deque
    assert [round(x.t, 1) for x in s.history] == [0.6, 0.8, 1.0]
    assert len(seen) == 5
    s.reset()
    assert not s.history and s.peak_anon == 0


def test_sampler_survives_a_failing_display_callback():
    def bad(sample):
        raise RuntimeError("display broke")

    s = MemorySampler(on_sample=bad)
    s.sample()
    s.sample()
    assert len(s.history) == 2 and isinstance(s.errors[0], RuntimeError)


def test_sampler_thread_samples_and_stops():
    s = MemorySampler(interval=0.05)
    with s:
        assert s.running
        deadline = time.monotonic() + 20  # 0.2 s on an idle machine; a loaded one may starve the thread
        while len(s.history) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not s.running
    n = len(s.history)
    assert n >= 4
    time.sleep(0.15)
    assert len(s.history) == n  # really stopped


def test_watch_memory_reports_the_peak_of_the_block():
    _fresh("""
        import time, torch
        from ckptlib.system.memory import MemoryReport, watch_memory
        MIB = 2**20
        def samples_after(n):  # the sampler thread's next samples (on a loaded machine it may wait long)
            deadline = time.monotonic() + 20
            while len(w.sampler.history) < n and time.monotonic() < deadline:
                time.sleep(0.01)

        with watch_memory(interval=0.02) as w:
            block = torch.ones(96 * MIB // 4)
            samples_after(len(w.sampler.history) + 2)
            del block
            samples_after(len(w.sampler.history) + 2)
        r = w.report
        assert isinstance(r, MemoryReport)
        assert r.peak_added > 80 * MIB, r          # seen by the sampler thread although freed before the end
        assert r.samples >= 5 and r.seconds >= 0.08
        assert "peak memory" in r.describe()
    """)


def test_watch_memory_catches_a_peak_between_samples_at_the_end():
    _fresh("""
        import torch
        from ckptlib.system.memory import watch_memory
        MIB = 2**20
        with watch_memory(interval=10) as w:  # the thread never gets a second sample: the end sample counts
            block = torch.ones(64 * MIB // 4)
        assert w.report.peak_added > 48 * MIB
    """)


# ------------------------------------------------------------------------------------------ export / reshard
def test_export_and_reshard_results_carry_their_memory(tmp_path):
    res = ckptlib.export(SAMPLE, tmp_path / "exp")
    assert isinstance(res.memory, MemoryReport)
    assert res.memory.samples >= 2 and res.memory.peak >= res.memory.baseline > 0
    assert res.memory.peak_added <= res.plan.predicted_peak_bytes
    rs = ckptlib.reshard(SAMPLE, tmp_path / "rs", 3)
    assert isinstance(rs.memory, MemoryReport) and rs.memory.peak_added <= rs.plan.predicted_peak_bytes


def test_a_failed_run_still_raises_and_stops_its_sampler(tmp_path):
    import threading

    def samplers():
        return {t for t in threading.enumerate() if t.name == "ckptlib-memory-sampler"}

    before = samplers()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("not empty")
    with pytest.raises(ckptlib.OutputError):
        ckptlib.export(SAMPLE, tmp_path / "busy")
    assert samplers() <= before


# ------------------------------------------------------------------------------------------ verdict
def test_memory_verdict_levels():
    sysm = SystemMemory(total=8 * 2**30, available=1000 * MIB)
    assert memory_verdict(100 * MIB, sysm).level == "ok"
    v = memory_verdict(700 * MIB, sysm)
    assert v.level == "tight" and v.fits
    v = memory_verdict(2000 * MIB, sysm)
    assert v.level == "no" and not v.fits and "does NOT fit" in v.message
    # the cgroup limit is what counts when it is tighter
    capped = SystemMemory(total=8 * 2**30, available=1000 * MIB, cgroup_limit=300 * MIB, cgroup_usage=250 * MIB)
    v = memory_verdict(100 * MIB, capped)
    assert not v.fits and v.limit == 300 * MIB and "cgroup limit" in v.message


def test_memory_verdict_takes_a_plan(tmp_path):
    plan = ckptlib.plan_export(SAMPLE, tmp_path / "o")
    v = memory_verdict(plan)
    assert v.predicted == plan.predicted_peak_bytes and v.fits


# ------------------------------------------------------------------------------------------ plot
def test_plot_memory_png():
    pytest.importorskip("matplotlib")
    from ckptlib.ui.plots import memory_figure, plot_memory

    s = MemorySampler()
    for _ in range(5):
        s.sample()
    png = plot_memory(s.snapshot(), predicted=48 * MIB, available=2**30)
    assert png.startswith(PNG) and len(png) > 5000
    assert plot_memory([]).startswith(PNG)
    fig = memory_figure(s.snapshot())
    assert fig._repr_png_().startswith(PNG)  # shows itself as a PNG in a notebook


# ------------------------------------------------------------------------------------------ layering
def test_the_library_imports_no_ui(tmp_path):
    code = textwrap.dedent(f"""
        import sys, ckptlib
        ckptlib.export({str(SAMPLE)!r}, {str(tmp_path / 'o')!r})
        ckptlib.reshard({str(SAMPLE)!r}, {str(tmp_path / 'r')!r}, 3)
        bad = [m for m in sys.modules if m.startswith(("tqdm.notebook", "tqdm.auto", "ipywidgets", "matplotlib",
                                                        "ckptlib.ui", "IPython"))]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_library_module_imports_the_ui():
    import ast

    for path in (ROOT / "ckptlib").rglob("*.py"):
        if "ui" in path.relative_to(ROOT / "ckptlib").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            for n in names:
                assert not n.startswith(("tqdm.notebook", "tqdm.auto", "ckptlib.ui", ".ui", "..ui", "ipywidgets")) \
                    and n != "ui", f"{path}: imports {n}"


def test_importing_the_library_starts_no_process():
    """A fork at import time (e.g. ctypes.util.find_library running ldconfig) briefly doubles the
    process tree's resident memory, which the benchmarks sum; the library must not spawn anything."""
    import subprocess
    import sys

    probe = (
        "import subprocess\n"
        "calls = []\n"
        "orig = subprocess.Popen.__init__\n"
        "def spy(self, *a, **k):\n"
        "    calls.append(a[:1]); return orig(self, *a, **k)\n"
        "subprocess.Popen.__init__ = spy\n"
        "import ckptlib, ckptlib.cli, ckptlib.export, ckptlib.reshard, ckptlib.io.streaming, ckptlib.io.torchzip.writer\n"
        "print(calls)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
