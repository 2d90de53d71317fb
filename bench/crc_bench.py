"""What verifying the stored CRC-32s costs: ``ckpt export`` with and without ``--verify-crc``, and
``ckpt check`` (``--states``) with and without its CRC pass, on one checkpoint, in one run.

    python bench/crc_bench.py CHECKPOINT [--rounds 5]

Each variant runs in-process after one warm-up (the page cache holds the checkpoint: the numbers are the
CPU cost of the CRCs and the extra read through the page cache, not the disk), alternating, median of
``rounds``. Prints a markdown table (docs/safety.md).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckptlib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="crc-bench-"))

    def export(verify: bool) -> float:
        out = work / "out"
        plan = ckptlib.plan_export(args.checkpoint, out, verify_crc=verify, hf_files=False, sync=False)
        t0 = time.perf_counter()
        ckptlib.run(plan)
        took = time.perf_counter() - t0
        shutil.rmtree(out)
        return took

    def check(states: bool, crc: bool) -> float:
        plan = ckptlib.plan_check(args.checkpoint, states=states)
        if not crc:
            plan.crc = []
        t0 = time.perf_counter()
        ckptlib.check(plan)
        return time.perf_counter() - t0

    variants = {"export": lambda: export(False), "export --verify-crc": lambda: export(True),
                "check (no CRC pass)": lambda: check(False, False), "check": lambda: check(False, True),
                "check --states (no CRC pass)": lambda: check(True, False), "check --states": lambda: check(True, True)}
    for f in variants.values():
        f()  # warm-up: imports, page cache
    times = {k: [] for k in variants}
    for _ in range(args.rounds):
        for k, f in variants.items():
            times[k].append(f())
    plan = ckptlib.plan_export(args.checkpoint, work / "o", verify_crc=True, hf_files=False)
    total = sum(f.bytes for f in ckptlib.open_checkpoint(args.checkpoint).files)
    print(f"checkpoint {args.checkpoint}: {total / 2**20:.1f} MiB in the tag folder; export --verify-crc verifies "
          f"{len(plan.crc)} entries, {sum(e.size for e in plan.crc) / 2**20:.1f} MiB; median of {args.rounds}, warm cache\n")
    print("| run | seconds | vs. without |")
    print("|---|---|---|")
    pairs = {"export --verify-crc": "export", "check": "check (no CRC pass)",
             "check --states": "check --states (no CRC pass)"}
    for k, ts in times.items():
        m = statistics.median(ts)
        base = pairs.get(k)
        ratio = f"{m / statistics.median(times[base]):.2f}x" if base else ""
        print(f"| {k} | {m:.3f} | {ratio} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
