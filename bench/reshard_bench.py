"""Benchmark `ckpt reshard` (4 -> 2 and 4 -> 3 ranks) against DeepSpeed's `ds_to_universal`, in one run.

    python bench/reshard_bench.py .bench-work/z2_bf16_w4 .bench-work/z3_bf16_w4 --rounds 2

ds_to_universal is DeepSpeed's way to change the data-parallel size (it writes a size-independent
checkpoint, then `load_universal`); ckptlib writes the target-size checkpoint directly. Each run is a
separate process tree (ds_to_universal uses worker processes: memory is summed over the tree), the
page cache is dropped before each, and the output folder is watched for its peak size: temporary disk
= peak - final. Printed as a markdown table with ratios to ds_to_universal. ``--before SRC`` also runs
ckptlib from another source tree in the same rounds (rows marked "(before)"), to measure a change.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIB, before_env, check_ok, ckpt, ds_to_universal, fresh_output, import_baselines,  # noqa: E402
                    parser, print_baselines, ratio, work_folder)
from procmon import medians, run  # noqa: E402


def main() -> int:
    args = parser(__doc__.split("\n\n")[0], rounds=2).parse_args()
    with work_folder(args, "ckptlib-rbench-") as work:
        return measure(args, work)


def measure(args, work: Path) -> int:
    bases = import_baselines({"ckptlib": "reshard", "DeepSpeed": "ds_to_universal"})
    print_baselines(bases)
    base, base_ds = bases["ckptlib"], bases["DeepSpeed"]
    rows = []
    for checkpoint in args.checkpoints:
        # tool: (target size, extra arguments); --no-sync leaves the output to the kernel, as ds_to_universal does
        tools = {"ds_to_universal": (None, []), "ckpt reshard 4->2": (2, []), "ckpt reshard 4->3": (3, []),
                 "ckpt reshard 4->2 --no-sync": (2, ["--no-sync"])}
        if args.before:
            tools.update({"ckpt reshard 4->2 (before)": (2, []), "ckpt reshard 4->3 (before)": (3, [])})
        res = {t: [] for t in tools}
        for r in range(args.rounds):
            for k, (tool, (m, extra)) in enumerate(tools.items()):
                out = fresh_output(work / f"{checkpoint.name}-{k}")
                if m is None:
                    cmd = ds_to_universal(checkpoint, out)
                else:
                    cmd = ckpt("reshard", checkpoint, out / "resharded", "--world-size", m, "-q", *extra)
                st = run(cmd, env=before_env(args) if tool.endswith("(before)") else None, tree=True, watch_dir=str(out),
                         interval=0.01)
                res[tool].append(check_ok(st, f"{tool} on {checkpoint}"))
                print(f"  {checkpoint.name} round {r + 1} {tool}: {st.wall:.1f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                      f"disk peak {st.peak_disk / MIB:.0f} MiB final {st.final_disk / MIB:.0f} MiB", flush=True)
        med = medians(res, ("wall", "peak_anon", "peak_disk", "final_disk"))
        rows.append((checkpoint.name, med, {t: _stated_bound(checkpoint, m) for t, (m, _) in tools.items()}))
    print()
    print("| checkpoint | tool | wall time (median) | peak RssAnon (process tree) | over import baseline "
          "| stated bound | temporary disk | output on disk |")
    print("|---|---|---|---|---|---|---|---|")
    for name, med, bounds in rows:
        ds = med["ds_to_universal"]
        for tool, m in med.items():
            b = base_ds if tool == "ds_to_universal" else base
            tmp = m["peak_disk"] - m["final_disk"]
            vs_ds = (lambda mine, anchor: "") if tool == "ds_to_universal" else ratio
            print(f"| {name} | {tool} | {m['wall']:.1f} s{vs_ds(m['wall'], ds['wall'])} | "
                  f"{m['peak_anon'] / MIB:.0f} MiB{vs_ds(m['peak_anon'], ds['peak_anon'])} | "
                  f"{(m['peak_anon'] - b) / MIB:.0f} MiB | {bounds[tool]} | {tmp / MIB:.0f} MiB | "
                  f"{m['final_disk'] / MIB:.0f} MiB |")
    return 0


def _stated_bound(checkpoint: Path, m) -> str:
    """The plan's predicted peak (what ckptlib's docstrings promise), from metadata; none for DeepSpeed."""
    if m is None:
        return "none stated"
    from ckptlib.reshard import plan_reshard

    return f"{plan_reshard(checkpoint, Path(tempfile.gettempdir()) / 'unused', m).predicted_peak_bytes / MIB:.0f} MiB"


if __name__ == "__main__":
    sys.exit(main())
