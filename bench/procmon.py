"""Run a command and sample its memory and I/O from /proc while it runs (Linux)."""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass
class RunStats:
    wall: float
    returncode: int
    peak_anon: int      # bytes, RssAnon
    peak_file: int      # bytes, RssFile
    peak_rss: int       # bytes, VmRSS
    read_bytes: int     # bytes the process made the block layer fetch (page cache misses)
    rchar: int          # bytes passed through read()/pread() calls
    stdout: str
    stderr: str
    cpu: float = 0.0    # seconds of user + system time of the process and its waited-for children


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def _io(pid: int) -> dict:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def drop_caches() -> bool:
    """Empty the page cache so every run reads from disk (needs root); False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return out


def medians(runs: dict, keys: tuple) -> dict:
    """``{tool: {key: median over that tool's RunStats}}`` for ``runs`` = ``{tool: [RunStats, ...]}``."""
    return {t: {k: statistics.median(getattr(s, k) for s in v) for k in keys} for t, v in runs.items()}


def du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def run(cmd: list[str], env: dict | None = None, interval: float = 0.005, tree: bool = False,
        watch_dir: str | None = None) -> RunStats:
    """Run ``cmd``; with ``tree`` memory is the sum over the process and its children at each sample;
    with ``watch_dir`` the peak size of that folder is recorded (``peak_disk``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # output goes to files, not pipes: a command that prints more than a pipe holds (check --states of a large
    # model prints a table of every state) would otherwise wait for ever for this loop to read it
    out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=env, text=True)
    peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    io = {"read_bytes": 0, "rchar": 0}
    ios: dict[int, dict] = {}
    peak_disk, last_du = 0, 0.0
    while proc.poll() is None:
        pids = _tree(proc.pid) if tree else [proc.pid]
        now = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
        for pid in pids:
            try:
                st = _status(pid)
                for k in now:
                    now[k] += st.get(k, 0)
                ios[pid] = _io(pid)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
        for k in peak:
            peak[k] = max(peak[k], now[k])
        if watch_dir and time.perf_counter() - last_du > 0.1:
            peak_disk = max(peak_disk, du(watch_dir))
            last_du = time.perf_counter()
        time.sleep(interval)
    proc.wait()
    out, err = (f.seek(0) or f.read() for f in (out_f, err_f))
    out_f.close()
    err_f.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    io = {k: sum(v.get(k, 0) for v in ios.values()) for k in io}
    stats = RunStats(wall=time.perf_counter() - t0, returncode=proc.returncode, peak_anon=peak["RssAnon"],
                     peak_file=peak["RssFile"], peak_rss=peak["VmRSS"], read_bytes=io["read_bytes"], rchar=io["rchar"],
                     stdout=out, stderr=err, cpu=cpu)
    if watch_dir:
        stats.peak_disk = max(peak_disk, du(watch_dir))
        stats.final_disk = du(watch_dir)
    return stats


def warm_cache(*paths) -> int:
    """Read every file under ``paths`` once (into the page cache); the bytes read."""
    total = 0
    for top in paths:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while chunk := f.read(16 << 20):
                        total += len(chunk)
    return total
