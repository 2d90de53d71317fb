"""The least a down-casting export can take on this machine and stack, beside ckpt's and the copy floor.

    python bench/min_cast_export.py .bench-work/z3_bf16_w4 --rounds 5

A stand-in exporter with nothing but the bytes' path: Python and numpy start, then two threads read as
many float32 bytes as the checkpoint's fp32 partitions hold (each ``*optim_states.pt`` file's largest zip
member, read whole in 1 MiB ``preadv`` pieces from the page cache), round them to bfloat16 (nearest even, no
NaN handling) and ``pwrite`` them into one output file, handed to the disk every 16 MiB
(``sync_file_range``), then ``fsync``. No plan, no checks, no names: it is not an exporter, only what any
exporter on this stack pays at least for the same bytes. Per round, alternating, page cache warm: the
stand-in, ``cp`` + ``sync`` of its output (the copy floor of ``bench/floor_bench.py``), and ``ckpt export
--dtype bf16`` of the same checkpoint. Prints wall and CPU times and the medians.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

PIECE = 2**20
WINDOW = 16 * 2**20


def partitions(tag_dir: Path) -> list[tuple[str, int, int]]:
    """``(path, data offset, bytes)`` of the largest zip member of each optimizer-state file."""
    out = []
    for f in sorted(tag_dir.glob("*optim_states.pt")):
        with zipfile.ZipFile(f) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
        with open(f, "rb") as fh:
            fh.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", fh.read(30)[26:30])
        out.append((str(f), info.header_offset + 30 + name_len + extra_len, info.file_size))
    return out


def stand_in(tag_dir: str, out: str) -> None:
    """The stand-in exporter (run in a process of its own by :func:`main`)."""
    import numpy as np

    jobs, pos = [], 0
    for path, offset, nbytes in partitions(Path(tag_dir)):
        jobs.append((path, offset, nbytes, pos))
        pos += nbytes // 2
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, pos)
    sfr = ctypes.CDLL(None, use_errno=True).sync_file_range
    sfr.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]

    def work(mine) -> None:
        buf = memoryview(bytearray(PIECE))
        t, o = np.empty(PIECE // 4, np.uint32), np.empty(PIECE // 4, np.uint16)
        for path, offset, nbytes, at in mine:
            src = os.open(path, os.O_RDONLY)
            done = since = 0
            flight = []
            while done < nbytes:
                k = min(PIECE, nbytes - done)
                os.preadv(src, [buf[:k]], offset + done)
                u = np.frombuffer(buf[:k], np.uint32)
                m = len(u)
                np.right_shift(u, 16, out=t[:m])
                np.bitwise_and(t[:m], 1, out=t[:m])
                np.add(t[:m], 0x7FFF, out=t[:m])
                np.add(t[:m], u, out=t[:m])
                np.right_shift(t[:m], 16, out=t[:m])
                np.copyto(o[:m], t[:m], casting="unsafe")
                os.pwrite(fd, o[:m], at + done // 2)
                done += k
                since += k // 2
                if since >= WINDOW or done == nbytes:
                    start = at + done // 2 - since
                    sfr(fd, start, since, 2)
                    flight.append((start, since))
                    since = 0
                    if len(flight) > 8:
                        s, n = flight.pop(0)
                        sfr(fd, s, n, 7)
                        os.posix_fadvise(fd, s, n, os.POSIX_FADV_DONTNEED)
            os.close(src)

    threads = [threading.Thread(target=work, args=(jobs[i::2],)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    os.fsync(fd)
    os.close(fd)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--stand-in":
        stand_in(sys.argv[2], sys.argv[3])
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # here, not above: the stand-in imports no more
    from common import PY, bytecode_as_installed, ckpt, parser, tag_of, work_folder  # than it needs
    from procmon import run, warm_cache

    ap = parser(__doc__.split("\n\n")[0], rounds=5, checkpoints=None)
    args = ap.parse_args()
    bytecode_as_installed()
    checkpoint = args.checkpoints
    tag_dir = checkpoint / tag_of(checkpoint)
    rows = {"stand-in": [], "copy floor (cp + sync of its output)": [], "ckpt export --dtype bf16": []}
    with work_folder(args, "ckptlib-mincast-") as work:
        for r in range(args.rounds):
            (work / "stand-in").mkdir(exist_ok=True)
            out, copy, exp = work / "stand-in" / "out.bin", work / "copy.bin", work / "export"
            subprocess.run(["sync"], check=True)
            warm_cache(tag_dir)
            st = run([PY, __file__, "--stand-in", str(tag_dir), str(out)])
            rows["stand-in"].append(st)
            subprocess.run(["sync"], check=True)
            warm_cache(out.parent)
            rows["copy floor (cp + sync of its output)"].append(run(["sh", "-c", 'cp "$1" "$2" && sync', "sh",
                                                                     str(out), str(copy)]))
            subprocess.run(["rm", "-rf", str(out), str(copy), str(exp)], check=True)
            subprocess.run(["sync"], check=True)
            warm_cache(tag_dir)
            rows["ckpt export --dtype bf16"].append(run(ckpt("export", checkpoint, exp, "--dtype", "bf16", "-q")))
            subprocess.run(["rm", "-rf", str(exp)], check=True)
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1].wall:.2f} s (CPU {v[-1].cpu:.2f} s)"
                                                    for k, v in rows.items()), flush=True)
    floor = statistics.median(s.wall for s in rows["copy floor (cp + sync of its output)"])
    print(f"\n| {checkpoint.name}, {args.rounds} rounds | wall (median) | / copy floor | CPU user+sys (median) |")
    print("|---|---|---|---|")
    for k, v in rows.items():
        wall = statistics.median(s.wall for s in v)
        print(f"| {k} | {wall:.2f} s | {wall / floor:.2f}x | {statistics.median(s.cpu for s in v):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
