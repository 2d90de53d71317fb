"""Interrupted and concurrent runs: never a finished-looking output, reruns succeed, one writer per output."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ckptlib
from ckptlib.export import export
from ckptlib.reshard import reshard

SLOW = textwrap.dedent("""
    import sys, time
    import ckptlib
    from ckptlib.progress import Observer
    class Slow(Observer):
        def on_bytes(self, done, total):
            time.sleep(0.004)
    what, src, out = sys.argv[1:4]
    if what == "export":
        ckptlib.export(src, out, observer=Slow(), chunk_bytes=2**15, max_shard_size="4MB")
    else:
        ckptlib.reshard(src, out, int(sys.argv[4]), observer=Slow(), chunk_bytes=2**15)
    print("finished")
""")


def _start(what, src, out, *extra):
    return subprocess.Popen([sys.executable, "-c", SLOW, what, str(src), str(out), *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_temporary(parent, name, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(p.name.startswith(f".{name}.ckptlib-tmp-") for p in parent.iterdir()):
            return
        time.sleep(0.01)
    raise AssertionError("the run never started writing")


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_reshard_killed_at_a_random_moment(fixture_by_name, tmp_path, seed):
    fx = fixture_by_name("large_w2")
    out = tmp_path / "out"
    proc = _start("reshard", fx["checkpoint_path"], out, 3)
    _wait_for_temporary(tmp_path, "out")
    time.sleep(random.Random(seed).uniform(0.0, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed reshard must not leave the output folder"
    reshard(fx["checkpoint_path"], out, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    ck = ckptlib.open_checkpoint(out)
    src = ckptlib.open_checkpoint(fx["checkpoint_path"])
    assert ck.problems == [] and ck.dp_world_size == 3
    for p in src.parameters:
        assert ck.read_param(p.name).equal(src.read_param(p.name))


@pytest.mark.parametrize("what", ["export", "reshard"])
def test_two_runs_on_the_same_output(fixture_by_name, tmp_path, what):
    fx = fixture_by_name("large_w2")
    out = tmp_path / "out"
    first = _start(what, fx["checkpoint_path"], out, 3)
    _wait_for_temporary(tmp_path, "out")
    with pytest.raises(ckptlib.OutputError, match="another ckptlib run is writing this output folder"):
        if what == "export":
            export(fx["checkpoint_path"], out)
        else:
            reshard(fx["checkpoint_path"], out, 3)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0 and "finished" in stdout, stderr
    assert out.exists()
