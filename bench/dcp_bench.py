"""Benchmark `ckpt export --format dcp` beside the hand-written route to FSDP2, in one run.

    python bench/dcp_bench.py .bench-work/z2_bf16_w4 [--rounds 1]

Rows, each its own process sampled from /proc every 5 ms after the page cache was dropped (when allowed):

- ``ckpt export --format dcp --optimizer``: masters, exp_avg, exp_avg_sq, per-parameter step and the groups;
- ``ckpt export --format dcp``: the model only;
- the hand-written route (what torchtitan's maintainers advise in #765): DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint`` then ``dcp.save({"model": ...})``, weights only (it cannot
  carry the moments);
- the floor: a plain copy (``shutil.copyfile``: inside the kernel) of the checkpoint's optimizer-state files,
  the bytes the optimizer export reads and about the bytes it writes.

Memory is peak RssAnon over each tool's own import baseline (a process that only imports what it
imports). The hand route's and ckptlib's model-only DCP folders are compared with `ckpt diff` (every tensor
of both, bounded memory); ckptlib's optimizer export with `ckpt diff --states` against the checkpoint.
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
HAND = """
import sys, importlib
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
import torch.distributed.checkpoint as dcp
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
dcp.save({"model": sd}, checkpoint_id=sys.argv[2], no_dist=True)
"""
COPY = """
import shutil, sys
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir()
for f in sorted(src.glob("*/*optim_states.pt")):
    shutil.copyfile(f, out / f.name)
"""
TOOLS = {
    "ck-opt": ("ckpt export --format dcp --optimizer", ["-m", "ckptlib", "export", "{src}", "{out}", "-q",
                                                        "--format", "dcp", "--optimizer"]),
    "ck": ("ckpt export --format dcp (model only)", ["-m", "ckptlib", "export", "{src}", "{out}", "-q",
                                                     "--format", "dcp"]),
    "hand": ("get_fp32_state_dict_from_zero_checkpoint + dcp.save (model only)", ["-c", HAND, "{src}", "{out}"]),
    "copy": ("floor: plain copy of the optimizer-state files", ["-c", COPY, "{src}", "{out}"]),
}
BASELINES = {"ck-opt": "ckptlib.cli, ckptlib.export, ckptlib.execute, tqdm", "ck": None,
             "hand": "torch.distributed.checkpoint, deepspeed.utils.zero_to_fp32", "copy": "shutil"}


def baseline(imports: str) -> int:
    return run([PY, "-c", f"import {imports}; import time; time.sleep(0.5)"]).peak_anon


def diff_line(a: Path, b: Path, states: bool = False) -> str:
    r = run([PY, "-P", "-m", "ckptlib", "diff", str(a), str(b), "-q"] + (["--states"] if states else []))
    return (r.stdout.strip().splitlines() or [r.stderr.strip()])[-1] + f" (exit {r.returncode})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    own_work = args.work is None
    work = args.work or Path(tempfile.mkdtemp(prefix="ckptlib-dcp-bench-"))
    bases = {}
    for tool, imports in BASELINES.items():
        bases[tool] = baseline(imports) if imports else bases["ck-opt"]
    dropped = drop_caches()
    print("import baselines (RssAnon): " + ", ".join(f"{t} {b / MIB:.0f} MiB" for t, b in bases.items())
          + f"; page cache dropped before each run: {dropped}")
    res = {t: [] for t in TOOLS}
    for r in range(args.rounds):
        for tool, (_, argv) in TOOLS.items():
            out = work / tool
            shutil.rmtree(out, ignore_errors=True)
            drop_caches()
            st = run([PY, "-P"] + [a.format(src=args.checkpoint, out=out) for a in argv])
            if st.returncode != 0:
                print(st.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{tool} failed")
            written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            st.written = written
            res[tool].append(st)
            print(f"  round {r + 1} {tool}: {st.wall:.2f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                  f"wrote {written / MIB:.0f} MiB", flush=True)
    med = medians(res, ("wall", "peak_anon"))
    written = {t: res[t][-1].written for t in res}
    checks = {"hand vs ckpt (model)": diff_line(work / "hand", work / "ck"),
              "checkpoint vs ckpt --optimizer (masters and moments)": diff_line(args.checkpoint, work / "ck-opt", True)}
    floor = med["copy"]["wall"]
    print()
    print("| route | wall time | x copy floor | peak RssAnon over import baseline | written |")
    print("|---|---|---|---|---|")
    for tool, (label, _) in TOOLS.items():
        m = med[tool]
        print(f"| {label} | {m['wall']:.2f} s | {m['wall'] / floor:.2f}x | "
              f"{max(0, m['peak_anon'] - bases[tool]) / MIB:.0f} MiB | {written[tool] / MIB:.0f} MiB |")
    for what, line in checks.items():
        print(f"\n{what}: {line}")
    if args.json:
        args.json.write_text(json.dumps({"median": med, "baselines": bases, "written": written, "checks": checks},
                                        indent=2))
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
