#!/usr/bin/env python
"""Make the bundled sample checkpoint ``samples/zero2_bf16_w2/``.

It is a real DeepSpeed checkpoint (ZeRO-2, bf16, 2 ranks, the test suite's FixtureNet),
written by running the fixture generator with ``--only z2_bf16_w2`` under
``torch.distributed.run`` into a temporary folder, checking the result and copying it:

    samples/zero2_bf16_w2/ckpt/          the save_dir (latest, global_step2/, zero_to_fp32.py, ...)
    samples/zero2_bf16_w2/reference.pt   ground truth from the live engine (see tests/fixtures/generate.py)
    samples/zero2_bf16_w2/fixture.json   metadata

Needs torch and deepspeed (CPU is fine). Usage: ``python scripts/make_sample.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.fixtures.factory import LAUNCH_TIMEOUT, check_fixture_dir  # noqa: E402
from tests.fixtures.torchrun import log_tail, torchrun  # noqa: E402

FIXTURE = "z2_bf16_w2"
WORLD = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "samples" / "zero2_bf16_w2")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ckptlib-sample-") as tmp:
        tmp = Path(tmp)
        log = tmp / "generate.log"
        rc = torchrun(REPO / "tests" / "fixtures" / "generate.py", WORLD,
                      ["--out", str(tmp / "out"), "--only", FIXTURE], log, LAUNCH_TIMEOUT, launcher="torchrun")
        src = tmp / "out" / FIXTURE
        problems = check_fixture_dir(src)
        if problems:
            print(f"generation failed (exit code {rc}): {problems}\n{log_tail(log)}", file=sys.stderr)
            return 1
        if rc != 0:
            print(f"note: generator exit code {rc}, but every file was produced and checked", file=sys.stderr)
        dest = args.out.resolve()
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # DeepSpeed copies its own converter scripts next to `latest`; they are DeepSpeed's code, not ours,
        # and not part of the checkpoint's data, so the bundled sample leaves them out.
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("zero_to_fp32.py", "zero_to_torch.py"))

    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"wrote {dest} ({size / 1024:.0f} KiB):")
    for f in sorted(dest.rglob("*")):
        if f.is_file():
            print(f"  {f.relative_to(dest)}  {f.stat().st_size} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
