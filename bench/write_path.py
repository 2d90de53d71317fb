"""How fast this machine takes a multi-GB file written in different ways (the choices behind ckptlib's writer).

    python bench/write_path.py --gib 3.5 --rounds 2

Writes the same bytes from one 16 MiB buffer, then ``fsync``: in 16 MiB ``pwrite`` calls, in 1 MiB
calls (:data:`ckptlib.io.sinks.WRITE_SLICE`), and in 1 MiB calls with
:class:`ckptlib.io.sinks.WriteBehind` (writeback started per 16 MiB window, pages dropped once
written). Rounds alternate the modes; times include the ``fsync``; the file is deleted between runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckptlib.io.sinks import WriteBehind, pwrite_all  # noqa: E402

CHUNK = 16 * 2**20


def write_file(path: Path, total: int, mode: str) -> tuple[float, float]:
    buf = bytearray(os.urandom(CHUNK))
    os.sync()
    time.sleep(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    behind = WriteBehind(fd) if mode == "1 MiB + write-behind" else None
    t0, c0 = time.perf_counter(), os.times()
    off = 0
    while off < total:
        n = min(CHUNK, total - off)
        if mode == "16 MiB calls":
            done = 0
            while done < n:
                done += os.pwrite(fd, memoryview(buf)[done:n], off + done)
        else:
            pwrite_all(fd, memoryview(buf)[:n], off)
            if behind:
                behind.wrote(off, n)
        off += n
    if behind:
        behind.close()
    os.fsync(fd)
    os.close(fd)
    c1 = os.times()
    wall = time.perf_counter() - t0
    os.unlink(path)
    return wall, c1.system - c0.system


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=3.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    where = args.dir or Path(tempfile.mkdtemp(prefix="ckptlib-wbench-"))
    total = int(args.gib * 2**30)
    modes = ["16 MiB calls", "1 MiB calls", "1 MiB + write-behind"]
    res = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            wall, sys_t = write_file(where / "wbench.bin", total, m)
            res[m].append((wall, sys_t))
            print(f"  round {r + 1} {m}: {wall:.2f} s (system {sys_t:.2f} s)", flush=True)
    base = statistics.median(w for w, _ in res[modes[0]])
    print(f"\n| {args.gib:g} GiB, fsync included | wall (median) | system time (median) |\n|---|---|---|")
    for m in modes:
        w = statistics.median(x for x, _ in res[m])
        s = statistics.median(y for _, y in res[m])
        print(f"| {m} | {w:.2f} s ({w / base:.2f}x) | {s:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
