"""Benchmark `ckpt check` and `ckpt diff CKPT EXPORT` beside `ckpt export`, in one run.

    python bench/check_diff_bench.py .bench-work/z2_bf16_w4 .bench-work/z3_bf16_w4 --rounds 3

Each round, for each checkpoint: `ckpt export CKPT OUT` (the anchor: fp32 safetensors, the kernel copies
the masters file to file), `ckpt check CKPT`, `ckpt check CKPT --states`, then `ckpt diff CKPT OUT` against
that round's export, each after dropping the page cache (when allowed) and each in its own process
sampled from /proc every 5 ms (bench/procmon.py): wall time, peak RssAnon and RssFile, bytes read from
storage. The read rate after start-up is what the block layer fetched over the wall time, both less
those of a process that only imports what the command imports, then exits (run before it, after a cache
drop too: none of them imports torch; check and diff import numpy). Check and diff must exit 0 (a healthy checkpoint, an
exact export). Prints a markdown table; ratios are against `ckpt export` (see docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procmon import drop_caches, medians, run  # noqa: E402

PY = sys.executable
MIB = 2**20
TOOLS = ("export", "check", "check-states", "diff")
BASELINES = {"export": "import ckptlib.cli, ckptlib.export, numpy",  # what `ckpt export -q` imports (no torch)
             "checkdiff": "import ckptlib.cli, ckptlib.analysis.health, ckptlib.analysis.tensordiff, ckptlib.analysis.scan, tqdm, numpy"}
LABELS = {"export": "ckpt export CKPT OUT", "check": "ckpt check CKPT", "check-states": "ckpt check CKPT --states",
          "diff": "ckpt diff CKPT OUT"}


def command(tool: str, ckpt: Path, out: Path) -> list[str]:
    base = [PY, "-P", "-m", "ckptlib"]  # -P: the installed ckptlib, not the working folder first on sys.path
    if tool == "export":
        return base + ["export", str(ckpt), str(out), "-q"]
    if tool == "check":
        return base + ["check", str(ckpt), "-q"]
    if tool == "check-states":
        return base + ["check", str(ckpt), "--states", "-q"]
    return base + ["diff", str(ckpt), str(out), "-q"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    args = ap.parse_args()
    own_work = args.work is None
    work = args.work or Path(tempfile.mkdtemp(prefix="ckptlib-bench-", dir=args.checkpoints[0].parent))
    print(f"page cache dropped before each run: {drop_caches()}; each command's import baseline is run before it, "
          "after a drop too", flush=True)
    print(f"import baselines: {BASELINES}", flush=True)
    rows, raw = [], {}
    for ckpt in args.checkpoints:
        res = {tool: [] for tool in TOOLS}
        bases = {tool: [] for tool in TOOLS}
        out = work / f"{ckpt.name}-export"
        for r in range(args.rounds):
            shutil.rmtree(out, ignore_errors=True)
            for tool in TOOLS:
                drop_caches()
                bases[tool].append(run([PY, "-c", BASELINES["export" if tool == "export" else "checkdiff"]]))
                drop_caches()
                st = run(command(tool, ckpt, out))
                if st.returncode != 0:
                    print(st.stdout[-2000:], st.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"{tool} exited {st.returncode} on {ckpt}")
                res[tool].append(st)
                print(f"  {ckpt.name} round {r + 1} {tool}: {st.wall:.2f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                      f"file {st.peak_file / MIB:.0f} MiB, read {st.read_bytes / MIB:.0f} MiB (import baseline "
                      f"{bases[tool][-1].wall:.2f} s, {bases[tool][-1].peak_anon / MIB:.0f} MiB)", flush=True)
            last = {t: res[t][-1].stdout.strip().splitlines()[-1] for t in ("check", "check-states", "diff")}
        shutil.rmtree(out, ignore_errors=True)
        med = medians(res, ("wall", "peak_anon", "peak_file", "read_bytes"))
        base = medians(bases, ("wall", "peak_anon", "read_bytes"))
        raw[ckpt.name] = {"median": med, "baseline_median": base, "last_lines": last}
        rows.append((ckpt.name, med, base, last))
    print()
    print("| checkpoint | command | wall time (median) | peak RssAnon | over its import baseline | peak RssFile "
          "| read from storage | read rate | read rate after start-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, med, base, last in rows:
        anchor = med["export"]
        for tool in TOOLS:
            m, b = med[tool], base[tool]
            ratio = "" if tool == "export" else f" ({m['wall'] / anchor['wall']:.2f}x)"
            rate = m["read_bytes"] / MIB / m["wall"]
            net = (m["read_bytes"] - b["read_bytes"]) / MIB / max(m["wall"] - b["wall"], 1e-3)
            print(f"| {name} | {LABELS[tool]} | {m['wall']:.2f} s{ratio} | {m['peak_anon'] / MIB:.0f} MiB | "
                  f"{(m['peak_anon'] - b['peak_anon']) / MIB:.0f} MiB | {m['peak_file'] / MIB:.0f} MiB | "
                  f"{m['read_bytes'] / MIB:.0f} MiB | {rate:.0f} MiB/s | {net:.0f} MiB/s |")
    print()
    for name, med, base, last in rows:
        print(f"- {name}: import baselines (median) {base['export']['wall']:.2f} s, "
              f"{base['export']['peak_anon'] / MIB:.0f} MiB, {base['export']['read_bytes'] / MIB:.0f} MiB read for "
              f"export; {base['check']['wall']:.2f} s, {base['check']['peak_anon'] / MIB:.0f} MiB, "
              f"{base['check']['read_bytes'] / MIB:.0f} MiB read for check and diff")
        for tool, line in last.items():
            print(f"- {name}, `{LABELS[tool]}`: {line}")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2))
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
