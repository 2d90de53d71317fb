"""Benchmark `ckpt export --format dcp` beside the hand-written route to FSDP2, in one run.

    python bench/dcp_bench.py .bench-work/z2_bf16_w4 [--rounds 1]

Rows, each its own process sampled by procmon after the page cache was dropped (when allowed):

- ``ckpt export --format dcp --optimizer``: masters, exp_avg, exp_avg_sq, per-parameter step and the groups;
- ``ckpt export --format dcp``: the model only;
- the hand-written route (what torchtitan's maintainers advise in #765): DeepSpeed's
  ``get_fp32_state_dict_from_zero_checkpoint`` then ``dcp.save({"model": ...})``, weights only (it cannot
  carry the moments);
- the floor: a plain copy (``shutil.copyfile``: inside the kernel) of the checkpoint's optimizer-state
  files, the bytes the optimizer export reads and about the bytes it writes.

Memory is peak RssAnon over each tool's own import baseline. The hand route's and ckptlib's model-only
folders are compared with `ckpt diff` (every tensor, bounded memory); ckptlib's optimizer export with
`ckpt diff --states` against the checkpoint.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, baseline, check_ok, ckpt, mib, parser, table, work_folder, write_json  # noqa: E402
from procmon import drop_caches, medians, run  # noqa: E402

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
#: tool -> (label, command for (checkpoint, out), what its import baseline imports)
TOOLS = {
    "ck-opt": ("ckpt export --format dcp --optimizer",
               lambda c, o: ckpt("export", c, o, "-q", "--format", "dcp", "--optimizer"), "export"),
    "ck": ("ckpt export --format dcp (model only)", lambda c, o: ckpt("export", c, o, "-q", "--format", "dcp"), "export"),
    "hand": ("get_fp32_state_dict_from_zero_checkpoint + dcp.save (model only)",
             lambda c, o: [PY, "-P", "-c", HAND, str(c), str(o)],
             "torch.distributed.checkpoint, deepspeed.utils.zero_to_fp32"),
    "copy": ("floor: plain copy of the optimizer-state files", lambda c, o: [PY, "-P", "-c", COPY, str(c), str(o)],
             "shutil, pathlib"),
}


def diff_line(a: Path, b: Path, states: bool = False) -> str:
    r = run(ckpt("diff", a, b, "-q", *(["--states"] if states else [])))
    return (r.stdout.strip().splitlines() or [r.stderr.strip()])[-1] + f" (exit {r.returncode})"


def main() -> int:
    args = parser(__doc__, rounds=1, checkpoints=None).parse_args()
    bases = {t: baseline(imports).peak_anon for t, (_, _, imports) in TOOLS.items()}
    dropped = drop_caches()
    print("import baselines (RssAnon): " + ", ".join(f"{t} {mib(b)}" for t, b in bases.items())
          + f"; page cache dropped before each run: {dropped}")
    with work_folder(args, "ckptlib-dcp-bench-") as work:
        res = {t: [] for t in TOOLS}
        written = {}
        for r in range(args.rounds):
            for tool, (_, command, _) in TOOLS.items():
                out = work / tool
                shutil.rmtree(out, ignore_errors=True)
                drop_caches()
                st = check_ok(run(command(args.checkpoints, out)), tool)
                res[tool].append(st)
                written[tool] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
                print(f"  round {r + 1} {tool}: {st.wall:.2f} s, anon {mib(st.peak_anon)}, wrote {mib(written[tool])}",
                      flush=True)
        med = medians(res, ("wall", "peak_anon"))
        checks = {"hand route vs ckpt (model)": diff_line(work / "hand", work / "ck"),
                  "checkpoint vs ckpt --optimizer (masters and moments)":
                      diff_line(args.checkpoints, work / "ck-opt", True)}
    floor = med["copy"]["wall"]
    print()
    print(table(["route", "wall time", "x copy floor", "peak RssAnon over import baseline", "written"],
                [[label, f"{med[t]['wall']:.2f} s", f"{med[t]['wall'] / floor:.2f}x",
                  mib(max(0, med[t]["peak_anon"] - bases[t])), mib(written[t])] for t, (label, _, _) in TOOLS.items()]))
    for what, line in checks.items():
        print(f"\n{what}: {line}")
    write_json(args, {"median": med, "baselines": bases, "written": written, "checks": checks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
