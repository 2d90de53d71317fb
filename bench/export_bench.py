"""Benchmark `ckpt export` against DeepSpeed's `zero_to_fp32.py --safe_serialization`, in one run.

    python bench/export_bench.py .bench-work/z2_bf16_w4 .bench-work/z3_bf16_w4 --rounds 3

For each checkpoint the two tools run alternately, each round after dropping the page cache (when
allowed), and each in its own process sampled from /proc every 5 ms: wall time, peak RssAnon and
RssFile, and bytes read from storage. Memory is also given over each tool's own import baseline (a
process that only imports what the tool imports). The outputs are compared tensor by tensor. Results
are printed as a markdown table with ckptlib/DeepSpeed ratios (make the checkpoints with
bench/make_checkpoint.py; see docs/benchmarks.md).

``--before SRC`` also runs ckptlib from another source tree (e.g. a clone at an earlier commit) in the
same rounds, right after the current one, to measure a change: its rows are marked "(before)".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIB, before_env, check_ok, ckpt, fresh_output, import_baselines, parser, print_baselines,  # noqa: E402
                    ratio, work_folder, write_json, zero_to_fp32)
from procmon import drop_caches, medians, run  # noqa: E402

#: the anchor, ckptlib's default run (same output, on disk before it appears), the same without waiting for
#: the disk (as the anchor: its output is left to the kernel), and two variants that take the buffered path
TOOLS = {"ds": None, "ck": [], "ck-nosync": ["--no-sync"], "ck-torch": ["--format", "torch"],
         "ck-bf16": ["--dtype", "bf16"]}
LABELS = {"ck": "ckpt export", "ck-nosync": "ckpt export --no-sync", "ck-torch": "ckpt export --format torch",
          "ck-bf16": "ckpt export --dtype bf16"}


def compare(a: Path, b: Path) -> str:
    import safetensors.torch
    import torch

    x, y = safetensors.torch.load_file(a), safetensors.torch.load_file(b)
    if set(x) != set(y):
        return f"different keys: {sorted(set(x) ^ set(y))[:5]}"
    bad = [k for k in x if not torch.equal(x[k], y[k])]
    return "identical tensors" if not bad else f"{len(bad)} tensors differ"


def main() -> int:
    args = parser(__doc__.split("\n\n")[0]).parse_args()
    with work_folder(args, "ckptlib-bench-") as work:
        return measure(args, work)


def measure(args, work: Path) -> int:
    tools = dict(TOOLS)
    if args.before:
        for t in [t for t in TOOLS if t != "ds"]:
            tools[f"{t}@before"] = TOOLS[t]
            LABELS[f"{t}@before"] = LABELS[t] + " (before)"
    bases = import_baselines({"ckptlib": "export", "DeepSpeed": "zero_to_fp32"})
    print_baselines(bases, f"; page cache dropped before each run: {drop_caches()}")
    base_ck, base_ds = bases.values()
    rows, raw = [], {}
    for checkpoint in args.checkpoints:
        res = {tool: [] for tool in tools}
        for r in range(args.rounds):
            for tool, extra in tools.items():
                out = fresh_output(work / f"{checkpoint.name}-{tool}", make=False)
                cmd = zero_to_fp32(checkpoint, out) if tool == "ds" else ckpt("export", checkpoint, out, "-q", *extra)
                st = check_ok(run(cmd, env=before_env(args) if tool.endswith("@before") else None),
                              f"{tool} on {checkpoint}")
                res[tool].append(st)
                print(f"  {checkpoint.name} round {r + 1} {tool}: {st.wall:.2f} s, anon {st.peak_anon / MIB:.0f} MiB, "
                      f"file {st.peak_file / MIB:.0f} MiB, read {st.read_bytes / MIB:.0f} MiB", flush=True)
        name = checkpoint.name
        verdict = compare(work / f"{name}-ds" / "model.safetensors", work / f"{name}-ck" / "model.safetensors")
        verdict += "; --no-sync: " + compare(work / f"{name}-ds" / "model.safetensors",
                                             work / f"{name}-ck-nosync" / "model.safetensors")
        import safetensors.torch
        import torch
        half = safetensors.torch.load_file(work / f"{name}-ck-bf16" / "model.safetensors")
        full = safetensors.torch.load_file(work / f"{name}-ck" / "model.safetensors")
        verdict += "; bf16 output == fp32 output cast by torch: " + str(
            all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full))
        med = medians(res, ("wall", "peak_anon", "peak_file", "read_bytes"))
        raw[name] = {"median": med, "baseline_anon": {"ck": base_ck, "ds": base_ds}, "outputs": verdict}
        rows.append((name, med, verdict))
    print()
    print("| checkpoint | tool | wall time (median) | peak RssAnon | over import baseline | peak RssFile "
          "| read from storage |")
    print("|---|---|---|---|---|---|---|")
    for name, med, verdict in rows:
        ds = med["ds"]
        for tool, m in med.items():
            base = base_ds if tool == "ds" else base_ck
            label = "DeepSpeed zero_to_fp32.py --safe_serialization" if tool == "ds" else LABELS[tool]

            def cell(key, fmt, over_baseline=False):
                mine = m[key] - (base if over_baseline else 0)
                anchor = ds[key] - (base_ds if over_baseline else 0)
                return fmt(mine) + ("" if tool == "ds" else ratio(mine, anchor))

            mib = lambda v: f"{v / MIB:.0f} MiB"  # noqa: E731
            print(f"| {name} | {label} | {cell('wall', lambda v: f'{v:.2f} s')} | {cell('peak_anon', mib)} | "
                  f"{cell('peak_anon', mib, True)} | {cell('peak_file', mib)} | {cell('read_bytes', mib)} |")
        print(f"| {name} | outputs of DeepSpeed and ckpt export | {verdict} | | | | |")
    write_json(args, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
