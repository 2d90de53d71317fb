"""Run a command and sample its memory and I/O from /proc while it runs (Linux)."""
from __future__ import annotations

import os
import subprocess
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


def run(cmd: list[str], env: dict | None = None, interval: float = 0.005) -> RunStats:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    io = {"read_bytes": 0, "rchar": 0}
    while proc.poll() is None:
        try:
            st = _status(proc.pid)
            for k in peak:
                peak[k] = max(peak[k], st.get(k, 0))
            cur = _io(proc.pid)
            io = {k: cur.get(k, 0) for k in io}
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
        time.sleep(interval)
    out, err = proc.communicate()
    return RunStats(wall=time.perf_counter() - t0, returncode=proc.returncode, peak_anon=peak["RssAnon"],
                    peak_file=peak["RssFile"], peak_rss=peak["VmRSS"], read_bytes=io["read_bytes"], rchar=io["rchar"],
                    stdout=out, stderr=err)
