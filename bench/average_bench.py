"""``ckpt average`` of 3 tags beside ``ckpt export`` of one, on a benchmark checkpoint (issue 39): time and peak
memory, alternating rounds, medians.

    flock /tmp/bench.lock .venv/bin/python bench/average_bench.py .bench-work/z2_bf16_w4 --rounds 3

The three tags: the checkpoint's tag folder and two copies of it (``--work/tags``, made once: the same bytes in
distinct files, so each tag is read from its own pages; the average's arithmetic does not depend on the values). Each
timed run starts as the page's do (docs/benchmarks.md, "The method"): outstanding writes synced and its inputs read
once, untimed (warm page cache); each in its own process, sampled by ``procmon`` (peak RssAnon, CPU). Per round:
``ckpt export TAG OUT`` (safetensors fp32), ``ckpt average TAG1 TAG2 TAG3 OUT`` (the same layout: each master the
float32 rounding of the float64 sum), and ``ckpt average ... --format deepspeed`` (the tag folder again with the
averaged masters). Prints the table and the ratios the page states: the average's peak memory over the export's
(goal: within 2x) and its time beside 3 x the export's.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bytecode_as_installed, check_ok, ckpt, mib, parser, table, tag_of, write_json  # noqa: E402
from procmon import run, warm_cache  # noqa: E402

TAGS = 3


def tag_copies(checkpoint: Path, work: Path) -> list[Path]:
    """The checkpoint's tag folder and ``TAGS - 1`` copies of it under ``work/tags`` (kept between runs)."""
    tag = checkpoint / tag_of(checkpoint)
    out = [tag]
    for i in range(2, TAGS + 1):
        copy = work / "tags" / f"{tag.name}-copy{i}"
        if not copy.is_dir():
            tmp = copy.with_name(copy.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(tag, tmp)
            tmp.rename(copy)
        out.append(copy)
    return out


def masters_files(tags: list[Path]) -> list[Path]:
    return [f for t in tags for f in sorted(t.glob("*optim_states.pt"))]


def timed(cmd: list, warm: list[Path], out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    warm_cache(*warm)
    st = check_ok(run(cmd), " ".join(map(str, cmd[3:6])))
    return {"wall": st.wall, "cpu": st.cpu, "peak_anon": st.peak_anon}


def main() -> int:
    ap = parser(__doc__, checkpoints=1)
    args = ap.parse_args()
    checkpoint = args.checkpoints[0].resolve()
    work = (args.work or checkpoint.parent / "average-bench").resolve()
    work.mkdir(parents=True, exist_ok=True)
    bytecode_as_installed()
    tags = tag_copies(checkpoint, work)
    runs = {  # label: (command, its output, what it reads)
        "export": (ckpt("export", tags[0], work / "export", "-q"), work / "export", masters_files(tags[:1])),
        "average": (ckpt("average", *tags, work / "average", "-q"), work / "average", masters_files(tags)),
        "average --format deepspeed": (ckpt("average", *tags, work / "average-ds", "--format", "deepspeed", "-q"),
                                       work / "average-ds", masters_files(tags)),
    }
    up = Path("/proc/loadavg").read_text().split()[0]
    t0 = time.time()
    raw: dict = {k: [] for k in runs}
    for r in range(args.rounds):
        for label, (cmd, out, warm) in runs.items():
            raw[label].append(timed(cmd, warm, out))
            print(f"round {r + 1} {label}: {raw[label][-1]['wall']:.2f} s, {mib(raw[label][-1]['peak_anon'])}",
                  file=sys.stderr)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("wall", "cpu", "peak_anon")} for k, v in raw.items()}
    ex = med["export"]
    rows = [[f"`{label}`", f"{m['wall']:.2f} s", f"{m['cpu']:.2f} s", mib(m["peak_anon"]),
             f"{m['wall'] / (TAGS * ex['wall']):.2f}x" if label != "export" else "-",
             f"{m['peak_anon'] / ex['peak_anon']:.2f}x"] for label, m in med.items()]
    print(f"{checkpoint.name}: {TAGS} tags, {args.rounds} rounds, medians; load average {up} at the start, "
          f"{Path('/proc/loadavg').read_text().split()[0]} at the end; {time.time() - t0:.0f} s")
    print(table(["run", "wall", "CPU user+sys", "peak memory (RssAnon)", f"wall / ({TAGS} x export)",
                 "peak memory / export's"], rows))
    write_json(args, {"median": med, "raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
