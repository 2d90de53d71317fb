"""Start-up: `ckpt inspect --json` on the bundled sample against `python -c "import torch"`, in one run.

    python bench/startup_bench.py [--rounds 5] [--checkpoint samples/zero2_bf16_w2/ckpt]

Each round runs, alternately, `python -c "import torch"` (the anchor: what every command paid before the
metadata path stopped importing torch), `python -m ckptlib inspect CKPT --json`, and, for the record,
`export --plan` and `reshard --plan --world-size 3` on the same checkpoint; each in a fresh interpreter,
wall time from start to exit. It prints the medians and the ratio inspect / import torch (the issue's
acceptance: at most 0.5), and whether any ckptlib command imported torch (checked in a separate run with
``-X importtime``).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - t0


def imports_torch(cmd: list[str]) -> bool:
    r = subprocess.run([PY, "-X", "importtime", *cmd[1:]], capture_output=True, text=True, cwd=ROOT)
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in r.stderr.splitlines())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "samples" / "zero2_bf16_w2" / "ckpt")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptlib-startup-") as tmp:
        return measure(args, Path(tmp) / "out")  # never written: plans only


def measure(args: argparse.Namespace, out: Path) -> int:
    ck = str(args.checkpoint)
    tools = {
        "python -c 'import torch'": [PY, "-c", "import torch"],
        "ckpt inspect --json": [PY, "-m", "ckptlib", "inspect", ck, "--json"],
        "ckpt export --plan": [PY, "-m", "ckptlib", "export", ck, str(out), "--plan"],
        "ckpt reshard --plan --world-size 3": [PY, "-m", "ckptlib", "reshard", ck, str(out), "--plan",
                                               "--world-size", "3"],
    }
    for cmd in tools.values():  # warm the page cache and the bytecode caches once
        wall(cmd)
    times: dict[str, list[float]] = {name: [] for name in tools}
    for r in range(args.rounds):
        for name, cmd in tools.items():
            times[name].append(wall(cmd))
        print(f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in tools), flush=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    anchor = med["python -c 'import torch'"]
    print()
    print(f"| command | wall time (median of {args.rounds}) | ratio to import torch | imports torch |")
    print("|---|---|---|---|")
    for name, cmd in tools.items():
        ratio = "" if cmd[1] == "-c" else f"{med[name] / anchor:.2f}x"
        uses = "yes" if cmd[1] == "-c" else ("YES" if imports_torch(cmd) else "no")
        print(f"| {name} | {med[name]:.3f} s | {ratio} | {uses} |")
    ratio = med["ckpt inspect --json"] / anchor
    print(f"\ninspect --json / import torch = {ratio:.2f} (acceptance: at most 0.50)")
    return 0 if ratio <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
