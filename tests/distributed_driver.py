"""Runs several `ckpt` commands one after another in ONE torchrun launch (for tests/test_distributed_reshard.py):
each launch costs seconds, the commands only milliseconds.

    torchrun ... tests/distributed_driver.py JOBS.json RESULTS_DIR

JOBS.json is a list of ``{"name", "argv", "fault_rank"?, "fault"?}``. Every job is ``ckptlib.cli.main(argv)``
exactly as ``python -m ckptlib ARGV`` runs it (each one joins and leaves the process group itself). On rank
``fault_rank`` a fault is injected into the writer: ``"enospc"`` makes the writing of the rank's first unit
end with "No space left on device" after the unit was written; ``"crash"`` kills the process there
(``os._exit``, as an OOM kill would). On rank ``slow_rank`` every unit starts only after a pause of
``SLOW`` seconds, and the units it finished are counted (``"units"`` in its record). The shares of a
verification each rank ran are recorded too (``"verified"``: ``[rank, world, bytes compared]`` each). Each rank appends
``{"name", "rc", "stdout", "stderr"}`` per job to RESULTS_DIR/rank<R>.jsonl (an unexpected exception is
recorded with its traceback, rc "exception").
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def faulty(write_unit, fault: str):
    def wrapper(plan, unit, tmp, ctx):
        write_unit(plan, unit, tmp, ctx)
        if fault == "crash":
            sys.stderr.flush()
            os._exit(9)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / plan.files[unit.file].name))

    return wrapper


SLOW = 3.0


def slowed(write_unit, done: list):
    def wrapper(plan, unit, tmp, ctx):
        time.sleep(SLOW)
        write_unit(plan, unit, tmp, ctx)
        done.append(unit)

    return wrapper


def main() -> int:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = Path(sys.argv[2])
    results.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    # when one rank dies torchrun stops the others with SIGTERM; ckptlib's handler (during a run) cleans up and
    # raises; outside a run the record of the job must still be written, so the default (death) is not wanted
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    import importlib

    from ckptlib import cli

    verify_module = importlib.import_module("ckptlib.analysis.verify")  # the module (ckptlib.verify is the function)
    from ckptlib.execute import runner

    verified: list = []
    real_verify = verify_module.verify

    def recording_verify(plan, out=None, **kw):
        result = real_verify(plan, out, **kw)
        share = kw.get("share")
        verified.append([share.rank, share.world, result.bytes_compared] if share else [None, None,
                                                                                        result.bytes_compared])
        return result

    verify_module.verify = recording_verify

    for job in jobs:
        original = runner.write_unit
        done: list = []
        verified.clear()
        if job.get("fault_rank") == rank:
            runner.write_unit = faulty(original, job["fault"])
        if job.get("slow_rank") == rank:
            runner.write_unit = slowed(original, done)
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(job["argv"])
        except SystemExit as e:
            rc = e.code
        except BaseException:
            rc = "exception"
            err.write(traceback.format_exc())
        finally:
            runner.write_unit = original
        with open(results / f"rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"name": job["name"], "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
                                "units": len(done), "verified": list(verified)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
