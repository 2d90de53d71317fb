"""Benchmark `ckpt reshard --distributed` under torchrun (2 processes) against one process, beside DeepSpeed's
`ds_to_universal`, in one run:

    python bench/distributed_bench.py .bench-work/z2_bf16_w4 --world-size 2 --rounds 3

Tools per round, alternating, page cache dropped before each: DeepSpeed's ds_to_universal (the anchor: its way
to change the data-parallel size), `ckpt reshard` in one process (its default 2 writing threads),
`torchrun --standalone --nproc_per_node 2 -m ckptlib reshard ... --distributed` with 1 and with 2 writing
threads per rank. "Of which the run itself" is the time ckptlib reports for writing (rank 0's, from the start
of the run to the rename; the rest of the wall time is starting the interpreter(s), importing, and torchrun's
launch, rendezvous and teardown). Memory is summed over each run's process tree (torchrun's launcher and its
workers too); "over import baseline" subtracts the same tree doing nothing but the imports (one process
importing ckptlib.cli, ckptlib.reshard and tqdm; torchrun with 2 workers importing those and
torch.distributed). The first round checks that the distributed outputs are byte-identical to the
single-process one (every file, and the file list).
"""
from __future__ import annotations

import filecmp
import os
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIB, PY, ds_to_universal, fresh_output, import_baselines, parser, print_baselines,  # noqa: E402
                    work_folder)
from procmon import medians, run  # noqa: E402

TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0], checkpoints=None)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--no-anchor", action="store_true", help="leave out ds_to_universal")
    args = ap.parse_args()
    with work_folder(args, "ckptlib-dbench-") as work:
        return measure(args, work)


def measure(args, work: Path) -> int:
    ckpt, m = args.checkpoints.resolve(), args.world_size
    env = dict(os.environ, OMP_NUM_THREADS="1")
    dist_imports = "ckptlib.cli, ckptlib.reshard, ckptlib.execute.distributed, torch.distributed, tqdm"
    bases = import_baselines({"ckptlib": "reshard",
                              "torchrun x2 ckptlib": (dist_imports, {"tree": True, "launcher": TORCHRUN}),
                              "DeepSpeed": "ds_to_universal"}, env=env)
    print_baselines(bases, what="RssAnon of the tree")
    base, base_dist, base_ds = bases.values()
    import ckptlib

    with ckptlib.open_checkpoint(ckpt) as ck:
        n = ck.dp_world_size
    cli = ["-m", "ckptlib", "reshard", str(ckpt)]
    one, dist = f"ckpt reshard {n}->{m}", f"ckpt reshard {n}->{m} --distributed"
    tools = {
        f"{one} (1 process, 2 threads)": ([PY] + cli, ["--workers", "2"], base),
        f"{dist} (2 ranks x 1 thread)": (TORCHRUN + cli, ["--workers", "1", "--distributed"], base_dist),
        f"{dist} (2 ranks x 2 threads)": (TORCHRUN + cli, ["--workers", "2", "--distributed"], base_dist),
    }
    if not args.no_anchor:
        tools = {"ds_to_universal": None, **tools}
    res = {t: [] for t in tools}
    checked = {}
    for r in range(args.rounds):
        for tool, spec in tools.items():
            out = fresh_output(work / f"out-{list(tools).index(tool)}")
            if spec is None:
                cmd = ds_to_universal(ckpt, out)
            else:
                head, extra, _ = spec
                cmd = head + [str(out / "resharded"), "--world-size", str(m), *extra]
            st = run(cmd, env=env, tree=True, interval=0.01)
            if st.returncode != 0:
                print(st.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{tool} failed")
            said = re.search(r" in ([0-9.]+) s \(read", st.stdout)  # ckptlib's own time of the run (rank 0's)
            st.run = float(said.group(1)) if said else st.wall
            res[tool].append(st)
            print(f"  round {r + 1} {tool}: {st.wall:.1f} s (run {st.run:.1f} s), anon {st.peak_anon / MIB:.0f} MiB",
                  flush=True)
        if r == 0:
            single = work / f"out-{list(tools).index(next(t for t in tools if '1 process' in t))}" / "resharded"
            for tool in tools:
                if "distributed" in tool:
                    checked[tool] = same_tree(single, work / f"out-{list(tools).index(tool)}" / "resharded")
        for i in range(len(tools)):
            shutil.rmtree(work / f"out-{i}", ignore_errors=True)
    med = medians(res, ("wall", "run", "peak_anon"))
    anchor = med.get("ds_to_universal")
    single = next(t for t in tools if "1 process" in t)
    print()
    print(f"| tool ({ckpt.name} -> {m} ranks) | wall time (median of {args.rounds}) | vs ds_to_universal | "
          "vs 1 process | of which the run itself | peak RssAnon (tree) | over import baseline | output == 1 process |")
    print("|---|---|---|---|---|---|---|---|")
    for tool, v in med.items():
        b = base_ds if spec_is_anchor(tools[tool]) else tools[tool][2]
        vs_ds = f"{v['wall'] / anchor['wall']:.2f}x" if anchor and tool != "ds_to_universal" else ""
        vs_one = f"{v['wall'] / med[single]['wall']:.2f}x" if not spec_is_anchor(tools[tool]) else ""
        same = {True: "byte-identical", False: "DIFFERENT"}.get(checked.get(tool), "")
        run_s = "" if spec_is_anchor(tools[tool]) else f"{v['run']:.1f} s"
        print(f"| {tool} | {v['wall']:.1f} s | {vs_ds} | {vs_one} | {run_s} | {v['peak_anon'] / MIB:.0f} MiB | "
              f"{(v['peak_anon'] - b) / MIB:.0f} MiB | {same} |")
    return 0 if all(checked.values()) else 1


def spec_is_anchor(spec) -> bool:
    return spec is None


if __name__ == "__main__":
    sys.exit(main())
