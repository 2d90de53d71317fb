"""Time and memory of planning (metadata only) on synthetic 70B-parameter checkpoints at many ranks.

For each checkpoint (ZeRO-2 and ZeRO-3, bf16, a Llama-2-70B-shaped model, written sparse by
``bench/make_synthetic_checkpoint.py``) it runs, each in a fresh process sampled from ``/proc`` every
5 ms as ``bench/procmon.py`` does:

* ``ckpt inspect CKPT --json``
* ``ckpt export CKPT OUT --plan``
* ``ckpt reshard CKPT OUT --world-size M --plan`` (M = 3N/4: 384 at N = 512)

and, with ``--profile``, the same commands again under cProfile (top functions by own time and by
cumulative time go to ``WORK/profiles/*.txt``). Results go to ``WORK/planning.json`` and are printed as
a markdown table.

    python bench/planning_bench.py --work .bench-work/planning                       # 64..512 ranks, 80 layers
    python bench/planning_bench.py --work .bench-work/planning --ranks 512 --layers 40 --profile

The acceptance target of the issue: each command under 10 s and 1 GB at 70B x 512 ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import make_synthetic_checkpoint as synth  # noqa: E402

PY = sys.executable
TARGET_SECONDS, TARGET_BYTES = 10.0, 10**9


def sample(cmd: list[str], timeout: float, interval: float = 0.005) -> dict:
    """Run ``cmd`` in a fresh process; wall time, CPU time (user + system, from the kernel's rusage: less
    sensitive than wall time to other load on the machine), the kernel's peak RSS (``max_rss``) and the
    peaks of RssAnon / RssFile / VmRSS sampled from ``/proc`` every 5 ms as ``bench/procmon.py`` does;
    killed after ``timeout`` seconds (``timed_out``)."""
    import tempfile

    err_file = tempfile.TemporaryFile("w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, text=True, cwd=REPO)
    peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    timed_out = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            pass
        if not timed_out and time.perf_counter() - t0 > timeout:
            proc.kill()
            timed_out = True
        time.sleep(interval)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err_file.seek(0)
    err = err_file.read()
    err_file.close()
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "returncode": proc.returncode,
            "timed_out": timed_out, "peak_anon": peak["RssAnon"], "peak_file": peak["RssFile"],
            "peak_rss": peak["VmRSS"], "max_rss": usage.ru_maxrss * 1024, "stderr": err[-2000:]}


def measure(cmd: list[str], timeout: float, rounds: int) -> dict:
    """:func:`sample` ``rounds`` times; the medians of wall time and peaks (every wall time in ``walls``)
    and the 1-minute load average before the first run."""
    load = os.getloadavg()[0]
    runs = [sample(cmd, timeout)]
    while len(runs) < rounds and not runs[-1]["timed_out"]:
        runs.append(sample(cmd, timeout))
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    out = dict(runs[-1], wall=med("wall"), cpu=med("cpu"), peak_anon=med("peak_anon"), peak_file=med("peak_file"),
               peak_rss=med("peak_rss"), max_rss=med("max_rss"), timed_out=any(r["timed_out"] for r in runs))
    out.update(walls=[r["wall"] for r in runs], cpus=[r["cpu"] for r in runs], load=load)
    return out


def commands(ckpt: Path, out: Path, target: int) -> dict[str, list[str]]:
    return {
        "inspect --json": ["inspect", str(ckpt), "--json"],
        "export --plan": ["export", str(ckpt), str(out / "export"), "--plan"],
        f"reshard --world-size {target} --plan": ["reshard", str(ckpt), str(out / "reshard"), "--world-size",
                                                  str(target), "--plan"],
    }


def profile(args: list[str], path: Path, timeout: float) -> str:
    """Run ``ckpt ARGS`` under cProfile into ``path`` (.prof); the top functions as text (also saved .txt)."""
    cmd = [PY, "-m", "cProfile", "-o", str(path), "-m", "ckptlib", *args]
    try:
        subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"(profile timed out after {timeout:.0f} s)"
    if not path.exists():
        return "(no profile written)"
    import io

    buf = io.StringIO()
    st = pstats.Stats(str(path), stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)
    text = buf.getvalue()
    path.with_suffix(".txt").write_text(text)
    return text


def ensure_checkpoint(work: Path, stage: int, ranks: int, layers: int) -> tuple[Path, dict]:
    ckpt = work / "checkpoints" / f"z{stage}_r{ranks}_l{layers}"
    meta = ckpt / "synthetic.json"
    if meta.is_file():
        return ckpt, json.loads(meta.read_text())
    info = synth.make(ckpt, stage, ranks, layers=layers)
    meta.write_text(json.dumps(info, indent=1))
    return ckpt, info


def verdict(r: dict) -> str:
    """Under 10 s and 1 GB? CPU time decides (wall time on this shared machine depends on the others' load),
    the wall time is said beside it when it is over."""
    if r["timed_out"] or r["returncode"] not in (0, 1):
        return "no (killed)" if r["timed_out"] else f"no (exit {r['returncode']})"
    if r["cpu"] >= TARGET_SECONDS or r["max_rss"] >= TARGET_BYTES:
        return "no"
    return "yes" if r["wall"] < TARGET_SECONDS else f"yes by CPU (wall {r['wall']:.1f} s at load {r['load']:.1f})"


def table(results: list[dict]) -> str:
    rows = ["| checkpoint | command | wall (median) | CPU user+sys (median) | peak RssAnon | peak RSS | load (1 min) "
            "| under 10 s and 1 GB |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        wall = f"> {r['wall']:.0f} s (killed)" if r["timed_out"] else f"{r['wall']:.2f} s"
        c = r["checkpoint"]
        rows.append(f"| ZeRO-{c['stage']}, {c['parameters'] / 1e9:.1f} B params, N={c['ranks']} | `{r['command']}` "
                    f"| {wall} | {r['cpu']:.2f} s | {r['peak_anon'] / 2**20:.0f} MiB | {r['max_rss'] / 2**20:.0f} MiB "
                    f"| {r['load']:.1f} | {verdict(r)} |")
    return "\n".join(rows)


def growth(results: list[dict], base: dict) -> str:
    """How each command's CPU time above the import baseline grows with N (the parameters are the same at
    every N, so costs linear in parameters x ranks double when N doubles: a ratio of about 2 or less)."""
    lines = []
    by: dict = {}
    for r in results:
        c = r["checkpoint"]
        command = r["command"].split(" --world-size")[0]
        by.setdefault((c["stage"], command), []).append((c["ranks"], r["cpu"] - base["cpu"]))
    for (stage, command), points in by.items():
        points.sort()
        steps = [f"{b / a:.2f}x ({n0}->{n1})" for (n0, a), (n1, b) in zip(points, points[1:]) if a > 0]
        text = ", ".join(f"N={n}: {w:.2f} s" for n, w in points)
        lines.append(f"ZeRO-{stage} {command}: CPU above the import baseline {text}"
                     + ("; per doubling of N: " + ", ".join(steps) if steps else ""))
    return "\n".join(lines)


def source_state() -> dict:
    """Which ckptlib was measured: the commit, and whether ckptlib/ had uncommitted changes."""
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"commit": git("rev-parse", "--short", "HEAD"), "ckptlib_dirty": bool(git("status", "--porcelain", "ckptlib"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=REPO / ".bench-work" / "planning")
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--layers", type=int, nargs="+", default=[80])
    ap.add_argument("--only", nargs="+", help="command names to run (default: all three)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before a command is killed")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each command (medians are reported)")
    ap.add_argument("--profile", action="store_true", help="also profile each command with cProfile")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "profiles").mkdir(exist_ok=True)
    res_path = args.work / "planning.json"
    saved = json.loads(res_path.read_text()) if res_path.is_file() else {"runs": []}
    base = measure([PY, "-c", "import ckptlib.cli, ckptlib.export, ckptlib.reshard, ckptlib.analysis.summary"],
                   args.timeout, args.rounds)
    print(f"ckptlib at {source_state()}; import baseline: {base['wall']:.2f} s wall, {base['cpu']:.2f} s CPU, "
          f"RssAnon {base['peak_anon'] / 2**20:.0f} MiB, peak RSS {base['max_rss'] / 2**20:.0f} MiB", flush=True)
    results = []
    for layers in args.layers:
        for stage in args.stages:
            for ranks in args.ranks:
                t0 = time.perf_counter()
                ckpt, info = ensure_checkpoint(args.work, stage, ranks, layers)
                info = dict(info, layers=layers)
                print(f"checkpoint ZeRO-{stage} N={ranks} layers={layers}: {info['files']} files, "
                      f"apparent {info['apparent_bytes'] / 1e9:.0f} GB, on disk {info['allocated_bytes'] / 2**20:.1f} MiB "
                      f"(made in {info['seconds']:.1f} s; {time.perf_counter() - t0:.1f} s now)", flush=True)
                target = max(1, ranks * 3 // 4)
                for name, cargs in commands(ckpt, args.work / "out", target).items():
                    if args.only and not any(name.startswith(o) for o in args.only):
                        continue
                    r = measure([PY, "-m", "ckptlib", *cargs], args.timeout, args.rounds)
                    r.update(command=f"ckpt {name}", checkpoint=info, baseline=base, when=time.strftime("%F %T"),
                             source=source_state())
                    results.append(r)
                    print(f"  {name:<36} {r['wall']:8.2f} s ({' '.join(f'{w:.2f}' for w in r['walls'])})  "
                          f"cpu {r['cpu']:7.2f} s  anon {r['peak_anon'] / 2**20:7.0f} MiB  "
                          f"rss {r['peak_rss'] / 2**20:7.0f} MiB  max_rss {r['max_rss'] / 2**20:7.0f} MiB  "
                          f"rc {r['returncode']}  load {r['load']:.2f}{'  TIMED OUT' if r['timed_out'] else ''}",
                          flush=True)
                    if r["returncode"] not in (0, 1) and not r["timed_out"]:
                        print(r["stderr"], flush=True)
                    if args.profile:
                        tag = f"z{stage}_r{ranks}_l{layers}_{name.split()[0]}"
                        text = profile(cargs, args.work / "profiles" / f"{tag}.prof", args.timeout * 3)
                        r["profile"] = str(args.work / "profiles" / f"{tag}.txt")
                        print("\n".join(text.splitlines()[:45]), flush=True)
    saved["runs"] += results
    res_path.write_text(json.dumps(saved, indent=1))
    print()
    print(table(results))
    print()
    print(growth(results, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
