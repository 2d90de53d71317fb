"""What checking the CRC-32s costs (issue 40): every conversion with its default check and with
``--no-verify-crc``, side by side, in one run.

    python bench/crc_bench.py .bench-work/z2_bf16_w4 .bench-work/z3_bf16_w4 .bench-work/pp2_tp2_bf16 --rounds 5

Export, reshard (native and universal) and the DCP export compute the CRC-32 of every zip member they read as
the bytes stream, and compare it with the zip directory's before the output is put in place
(:mod:`ckptlib.io.crc`). Each conversion runs as ``ckpt`` does (its own process, ``python -P -m ckptlib``,
bytecode as installed), with a warm page cache (its inputs read once and outstanding writes synced, untimed),
alternating per round and conversion: without the check, then with it. Medians of wall and CPU time (user +
system, the process and its children); the ratio with / without is the check's cost (the goal: at most 1.15x).
Prints a markdown table (docs/benchmarks.md); ``--json`` saves the figures.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bytecode_as_installed, check_ok, ckpt, parser, table, work_folder, write_json  # noqa: E402
from floor_bench import info_of  # noqa: E402
from procmon import run, warm_cache  # noqa: E402

#: (label, ckpt arguments from (checkpoint, out, info), applies(info))
CONVERSIONS = [
    ("export", lambda c, o, i: ["export", c, o], lambda i: True),
    ("export --format torch", lambda c, o, i: ["export", c, o, "--format", "torch"], lambda i: True),
    ("export --dtype bf16", lambda c, o, i: ["export", c, o, "--dtype", "bf16"], lambda i: True),
    ("export --format dcp", lambda c, o, i: ["export", c, o, "--format", "dcp"], lambda i: True),
    ("reshard dp/2", lambda c, o, i: ["reshard", c, o, "--world-size", i["dp"] // 2], lambda i: i["dp"] >= 2),
    ("reshard --tp 1", lambda c, o, i: ["reshard", c, o, "--tp", 1], lambda i: i["tp"] == 2),
    ("reshard --universal", lambda c, o, i: ["reshard", c, o, "--universal"], lambda i: True),
]


def main() -> int:
    ap = parser(__doc__, rounds=5)
    ap.add_argument("--only", nargs="*", help="run only these conversions (labels)")
    args = ap.parse_args()
    bytecode_as_installed()
    raw: dict = {}
    rows = []
    with work_folder(args, "crc-bench-") as work:
        for checkpoint in args.checkpoints:
            info = info_of(checkpoint)
            convs = [(lbl, f) for lbl, f, applies in CONVERSIONS if applies(info) and (not args.only or lbl in args.only)]
            times = {(lbl, mode): [] for lbl, _ in convs for mode in ("off", "on")}
            for _ in range(args.rounds):
                for lbl, make in convs:
                    for mode in ("off", "on"):
                        out = work / "out"
                        os.system(f"rm -rf '{out}'; sync")
                        warm_cache(checkpoint)
                        cmd = ckpt(*make(checkpoint, out, info), "-q", *(["--no-verify-crc"] if mode == "off" else []))
                        st = check_ok(run(cmd), f"{lbl} ({mode})")
                        times[(lbl, mode)].append((st.wall, st.cpu))
            os.system(f"rm -rf '{work / 'out'}'")
            for lbl, _ in convs:
                off, on = times[(lbl, "off")], times[(lbl, "on")]
                w0, w1 = statistics.median(t for t, _ in off), statistics.median(t for t, _ in on)
                c0, c1 = statistics.median(c for _, c in off), statistics.median(c for _, c in on)
                rows.append([Path(checkpoint).name, f"`{lbl}`", f"{w0:.2f} s", f"{w1:.2f} s", f"**{w1 / w0:.2f}x**",
                             f"{c0:.2f} s / {c1:.2f} s ({c1 / c0:.2f}x)"])
                raw[f"{Path(checkpoint).name} {lbl}"] = {"off": off, "on": on}
    load = os.getloadavg()[0]
    print(f"median of {args.rounds} alternating rounds, warm page cache; load average (1 min) at the end {load:.1f}\n")
    print(table(["checkpoint", "conversion", "--no-verify-crc", "checked (default)", "ratio", "CPU: without / with"],
                rows))
    write_json(args, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
