"""Benchmark exporting a pipeline- or tensor-parallel checkpoint: `ckpt export` (and `ckpt reshard --universal`)
beside DeepSpeed's `ds_to_universal`, the only DeepSpeed tool that reads these, in one run.

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 bench/make_parallel_checkpoint.py \\
        --out .bench-work/pp2_dp1_bf16 --dim 1024 --hidden 4096 --layers 28 --vocab 32000
    python bench/parallel_bench.py .bench-work/pp2_dp1_bf16 --rounds 1

Each tool runs in its own process tree (ds_to_universal uses worker processes: memory is summed over
the tree), the page cache dropped before each run; memory is also given over each tool's import
baseline. ckptlib's export is checked against ds_to_universal's fp32 files for a few tensors.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIB, check_ok, ckpt, ds_to_universal, fresh_output, import_baselines, parser,  # noqa: E402
                    print_baselines, ratio, tag_of, work_folder)
from procmon import drop_caches, medians, run  # noqa: E402


def main() -> int:
    args = parser(__doc__.split("\n\n")[0], rounds=1).parse_args()
    with work_folder(args, "ckptlib-pbench-") as work:
        return measure(args, work)


def measure(args, work: Path) -> int:
    bases = import_baselines({"ckptlib": "export", "DeepSpeed": "ds_to_universal"})
    print_baselines(bases, f"; page cache dropped before each run: {drop_caches()}")
    base_ck, base_ds = bases.values()
    rows = []
    for checkpoint in args.checkpoints:
        tag = tag_of(checkpoint)
        tools = {"ds_to_universal": "ds", "ckpt export": "export", "ckpt reshard --universal": "universal"}
        res = {t: [] for t in tools}
        for r in range(args.rounds):
            for tool, kind in tools.items():
                out = fresh_output(work / f"{checkpoint.name}-{kind}")
                if kind == "ds":
                    cmd = ds_to_universal(checkpoint, out)
                elif kind == "export":
                    cmd = ckpt("export", checkpoint, out / "x", "-q")
                else:
                    cmd = ckpt("reshard", checkpoint, out / "x", "--universal", "-q")
                st = run(cmd, env=dict(os.environ, DS_ACCELERATOR="cpu"), tree=True, watch_dir=str(out),
                         interval=0.01)
                res[tool].append(check_ok(st, f"{tool} on {checkpoint}"))
                print(f"  {checkpoint.name} round {r + 1} {tool}: {st.wall:.1f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                      f"disk peak {st.peak_disk / MIB:.0f} MiB final {st.final_disk / MIB:.0f} MiB", flush=True)
        verdict = _same(work / f"{checkpoint.name}-ds" / f"{tag}_universal", work / f"{checkpoint.name}-export" / "x")
        rows.append((checkpoint.name, medians(res, ("wall", "peak_anon", "peak_disk", "final_disk")), verdict))
    print()
    print("| checkpoint | tool | wall time | peak RssAnon (process tree) | over import baseline | temporary disk |")
    print("|---|---|---|---|---|---|")
    for name, med, verdict in rows:
        ds = med["ds_to_universal"]
        for tool, m in med.items():
            b = base_ds if tool == "ds_to_universal" else base_ck
            vs_ds = (lambda mine, anchor: "") if tool == "ds_to_universal" else ratio
            print(f"| {name} | {tool} | {m['wall']:.1f} s{vs_ds(m['wall'], ds['wall'])} | "
                  f"{m['peak_anon'] / MIB:.0f} MiB{vs_ds(m['peak_anon'], ds['peak_anon'])} | "
                  f"{(m['peak_anon'] - b) / MIB:.0f} MiB{vs_ds(m['peak_anon'] - b, ds['peak_anon'] - base_ds)} | "
                  f"{(m['peak_disk'] - m['final_disk']) / MIB:.0f} MiB |")
        print(f"| {name} | ckpt export vs ds_to_universal fp32 | {verdict} | | | |")
    return 0


def _same(universal: Path, export: Path) -> str:
    """Every fp32 master of ds_to_universal's output against ckptlib's export, bit for bit."""
    import torch
    from safetensors import safe_open

    files = sorted(export.glob("model*.safetensors"))
    names, bad = 0, []
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                p = universal / "zero" / k / "fp32.pt"
                if not p.is_file():
                    continue  # buffers: ds_to_universal writes none for a pipeline (its module is None)
                theirs = torch.load(p, weights_only=False)["param"]
                names += 1
                if not torch.equal(theirs.reshape(h.get_slice(k).get_shape()), h.get_tensor(k)):
                    bad.append(k)
    return f"{names - len(bad)} of {names} fp32 tensors identical" + (f"; differ: {bad[:3]}" if bad else "")


if __name__ == "__main__":
    sys.exit(main())
