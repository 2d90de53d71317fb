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

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import IMPORTS, MIB, baseline, check_ok, ckpt, parser, work_folder, write_json  # noqa: E402
from procmon import drop_caches, medians, run  # noqa: E402

TOOLS = ("export", "check", "check-states", "diff")
LABELS = {"export": "ckpt export CKPT OUT", "check": "ckpt check CKPT", "check-states": "ckpt check CKPT --states",
          "diff": "ckpt diff CKPT OUT"}


def command(tool: str, checkpoint: Path, out: Path) -> list[str]:
    if tool == "export":
        return ckpt("export", checkpoint, out, "-q")
    if tool == "check":
        return ckpt("check", checkpoint, "-q")
    if tool == "check-states":
        return ckpt("check", checkpoint, "--states", "-q")
    return ckpt("diff", checkpoint, out, "-q")


def main() -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    with work_folder(args, "ckptlib-bench-") as work:
        return measure(args, work)


def measure(args, work: Path) -> int:
    print(f"page cache dropped before each run: {drop_caches()}; each command's import baseline is run before it, "
          "after a drop too", flush=True)
    print(f"import baselines: export: {IMPORTS['export']}; check and diff: {IMPORTS['analysis']}", flush=True)
    rows, raw = [], {}
    for checkpoint in args.checkpoints:
        res = {tool: [] for tool in TOOLS}
        bases = {tool: [] for tool in TOOLS}
        out = work / f"{checkpoint.name}-export"
        for r in range(args.rounds):
            shutil.rmtree(out, ignore_errors=True)
            for tool in TOOLS:
                drop_caches()
                bases[tool].append(baseline("export" if tool == "export" else "analysis", sleep=0))
                drop_caches()
                st = check_ok(run(command(tool, checkpoint, out)), f"{tool} on {checkpoint}")
                res[tool].append(st)
                print(f"  {checkpoint.name} round {r + 1} {tool}: {st.wall:.2f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                      f"file {st.peak_file / MIB:.0f} MiB, read {st.read_bytes / MIB:.0f} MiB (import baseline "
                      f"{bases[tool][-1].wall:.2f} s, {bases[tool][-1].peak_anon / MIB:.0f} MiB)", flush=True)
            last = {t: res[t][-1].stdout.strip().splitlines()[-1] for t in ("check", "check-states", "diff")}
        shutil.rmtree(out, ignore_errors=True)
        med = medians(res, ("wall", "peak_anon", "peak_file", "read_bytes"))
        base = medians(bases, ("wall", "peak_anon", "read_bytes"))
        raw[checkpoint.name] = {"median": med, "baseline_median": base, "last_lines": last}
        rows.append((checkpoint.name, med, base, last))
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
    write_json(args, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
