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

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procmon import drop_caches, medians, run  # noqa: E402

PY = sys.executable
MIB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--before", type=Path, default=None, help="also run ckptlib from this source tree")
    args = ap.parse_args()
    before_env = dict(os.environ, PYTHONPATH=str(args.before.resolve())) if args.before else None
    own_work = args.work is None  # a temporary folder of ours: removed at the end (outputs are GBs)
    work = args.work or Path(tempfile.mkdtemp(prefix="ckptlib-rbench-"))
    work.mkdir(parents=True, exist_ok=True)
    base = run([PY, "-c", "import ckptlib.cli, ckptlib.reshard, tqdm; import time; time.sleep(0.5)"]).peak_anon
    base_ds = run([PY, "-c", "import torch, deepspeed, deepspeed.checkpoint.ds_to_universal; import time; "
                   "time.sleep(0.5)"]).peak_anon
    print(f"import baselines (RssAnon): ckptlib {base / MIB:.0f} MiB, DeepSpeed {base_ds / MIB:.0f} MiB")
    rows = []
    for ckpt in args.checkpoints:
        tag = (ckpt / "latest").read_text().strip()
        # tool: (target size, extra arguments); --no-sync leaves the output to the kernel, as ds_to_universal does
        tools = {"ds_to_universal": (None, []), "ckpt reshard 4->2": (2, []), "ckpt reshard 4->3": (3, []),
                 "ckpt reshard 4->2 --no-sync": (2, ["--no-sync"])}
        if args.before:
            tools.update({"ckpt reshard 4->2 (before)": (2, []), "ckpt reshard 4->3 (before)": (3, [])})
        res = {t: [] for t in tools}
        for r in range(args.rounds):
            for k, (tool, (m, extra)) in enumerate(tools.items()):
                out = work / f"{ckpt.name}-{k}"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                drop_caches()
                if m is None:
                    cmd = [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag),
                           "--output_folder", str(out / f"{tag}_universal")]
                else:
                    cmd = [PY, "-P", "-m", "ckptlib", "reshard", str(ckpt), str(out / "resharded"), "--world-size", str(m),
                           "-q", *extra]
                st = run(cmd, env=before_env if tool.endswith("(before)") else None, tree=True, watch_dir=str(out),
                         interval=0.01)
                if st.returncode != 0:
                    print(st.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{tool} failed on {ckpt}")
                res[tool].append(st)
                print(f"  {ckpt.name} round {r + 1} {tool}: {st.wall:.1f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                      f"disk peak {st.peak_disk / MIB:.0f} MiB final {st.final_disk / MIB:.0f} MiB", flush=True)
        med = medians(res, ("wall", "peak_anon", "peak_disk", "final_disk"))
        rows.append((ckpt.name, med, {t: _stated_bound(ckpt, m) for t, (m, _) in tools.items()}))
    print()
    print("| checkpoint | tool | wall time (median) | peak RssAnon (process tree) | over import baseline "
          "| stated bound | temporary disk | output on disk |")
    print("|---|---|---|---|---|---|---|---|")
    for name, med, bounds in rows:
        ds = med["ds_to_universal"]
        for tool, m in med.items():
            b = base_ds if tool == "ds_to_universal" else base
            tmp = m["peak_disk"] - m["final_disk"]

            def ratio(mine, anchor):
                return "" if tool == "ds_to_universal" or anchor <= 0 else f" ({mine / anchor:.2f}x)"

            print(f"| {name} | {tool} | {m['wall']:.1f} s{ratio(m['wall'], ds['wall'])} | "
                  f"{m['peak_anon'] / MIB:.0f} MiB{ratio(m['peak_anon'], ds['peak_anon'])} | "
                  f"{(m['peak_anon'] - b) / MIB:.0f} MiB | {bounds[tool]} | {tmp / MIB:.0f} MiB | "
                  f"{m['final_disk'] / MIB:.0f} MiB |")
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _stated_bound(ckpt: Path, m) -> str:
    """The plan's predicted peak (what ckptlib's docstrings promise), from metadata; none for DeepSpeed."""
    if m is None:
        return "none stated"
    from ckptlib.reshard import plan_reshard

    return f"{plan_reshard(ckpt, Path(tempfile.gettempdir()) / 'unused', m).predicted_peak_bytes / MIB:.0f} MiB"


if __name__ == "__main__":
    sys.exit(main())
