"""`ckpt reshard --distributed` (and `--universal`, and `export`) under torchrun on real DeepSpeed checkpoints: the
ranks share the target files out and write the same bytes as one process; a failure or the death of any rank
leaves no output (nor its temporary folder) and one message, and the other ranks stop writing soon after a failure; two torchrun node launchers (c10d rendezvous on
127.0.0.1) give the same bytes too.

Launches are the expensive part (seconds each), so the commands of one launch run one after another in it
(tests/distributed_driver.py calls ``ckptlib.cli.main`` with each command's arguments, as ``python -m ckptlib``
does): one two-process launch for all the single-node cases, one pair of node launchers for the two-node ones.
The single-process references are ``ckpt`` without ``--distributed``, run here.
"""
from __future__ import annotations

import contextlib
from collections import Counter
import io
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckptlib import cli
from ckptlib.execute.writers import assign, units
from ckptlib.reshard import plan_reshard, plan_universal
from tests.fixtures.torchrun import REPO, launch_env

DRIVER = REPO / "tests" / "distributed_driver.py"
TIMEOUT = 300

# name: (fixture, ckpt arguments after the source and the output)
CASES = {
    "z2_bf16_w4->3": ("z2_bf16_w4", ["reshard", "--world-size", "3"]),
    "z3_bf16_w3->2": ("z3_bf16_w3", ["reshard", "--world-size", "2"]),
    "z3_subgroup_w2->3": ("z3_subgroup_w2", ["reshard", "--world-size", "3"]),
    "hf_trainer_w2->3": ("hf_trainer_w2", ["reshard", "--world-size", "3"]),
    "z2_bf16_w2 universal": ("z2_bf16_w2", ["reshard", "--universal"]),
    "z3_bf16_w3 universal": ("z3_bf16_w3", ["reshard", "--universal"]),
    "pp2_dp2_z1_bf16->1": ("pp2_dp2_z1_bf16", ["reshard", "--world-size", "1"]),
    "tp2_dp2_z2_bf16->1": ("tp2_dp2_z2_bf16", ["reshard", "--world-size", "1"]),
    "tp2_dp2_z2_bf16 universal": ("tp2_dp2_z2_bf16", ["reshard", "--universal"]),
    "export z3_bf16_w3 bf16 6KB shards": ("z3_bf16_w3", ["export", "--dtype", "bf16", "--max-shard-size", "6KB"]),
    "z2_bf16_w4->3 not synced": ("z2_bf16_w4", ["reshard", "--world-size", "3", "--no-sync"]),
    "z3_bf16_w3->2 verified": ("z3_bf16_w3", ["reshard", "--world-size", "2", "--verify"]),
    "export z2_bf16_w4 verified": ("z2_bf16_w4", ["export", "--states", "exp_avg", "--max-shard-size", "20KB",
                                                  "--verify"]),
}
TWO_NODE_CASES = {
    "export large_w2 10MB shards": ("large_w2", ["export", "--max-shard-size", "10MB"]),
    "export large_w2 torch": ("large_w2", ["export", "--format", "torch", "--max-shard-size", "10MB"]),
    "reshard z3_bf16_w3->2": ("z3_bf16_w3", ["reshard", "--world-size", "2"]),
    "reshard pp2_dp2_z1_bf16->1": ("pp2_dp2_z1_bf16", ["reshard", "--world-size", "1"]),
    "export large_w2 not synced": ("large_w2", ["export", "--max-shard-size", "10MB", "--no-sync"]),
}


def _source(name, fixture_by_name, parallel_fixtures) -> tuple[Path, list]:
    fx = parallel_fixtures[name] if name.startswith(("pp", "tp")) else fixture_by_name(name)
    rules = Path(fx["path"]) / "tp_rules.json"
    return Path(fx["checkpoint_path"]), (["--tp-rules", str(rules)] if rules.is_file() else [])


def _key(case: str) -> str:
    """The folder name of a case's outputs."""
    return case.replace(" ", "_").replace(">", "")


def _case_jobs(cases: dict, work: Path, fixture_by_name, parallel_fixtures) -> list:
    """The launch's jobs for ``cases`` (each with ``--distributed``), after writing each one's single-process
    reference under ``work/one``."""
    jobs = []
    for case, (name, cmd) in cases.items():
        src, extra = _source(name, fixture_by_name, parallel_fixtures)
        _single(_argv(cmd, src, work / "one" / _key(case), extra))
        jobs.append({"name": case, "argv": _argv(cmd, src, work / "dist" / _key(case), extra) + ["--distributed"]})
    return jobs


def _argv(cmd: list, src: Path, out: Path, extra: list) -> list:
    return [cmd[0], str(src), str(out), *cmd[1:], *extra, "-q"]


def _single(argv: list) -> None:
    """``ckpt ARGV`` in this process (one process, no --distributed)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = cli.main(argv)
    assert rc == 0, err.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(jobs: list, work: Path, nodes: int) -> dict:
    """Run ``jobs`` in one launch of 2 ranks: one torchrun with 2 processes (``nodes`` 1) or two torchrun node
    launchers with 1 process each (``nodes`` 2). Returns ``{rank: {job name: record}}`` and the launchers' output."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "jobs.json").write_text(json.dumps(jobs))
    run = [sys.executable, "-m", "torch.distributed.run"]
    tail = [str(DRIVER), str(work / "jobs.json"), str(work / "results")]
    if nodes == 1:
        cmds = [run + ["--standalone", "--nnodes", "1", "--nproc_per_node", "2"] + tail]
    else:
        port = _free_port()
        cmds = [run + ["--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                       "--rdzv_endpoint", f"127.0.0.1:{port}"] + tail for n in range(2)]
    logs = [open(work / f"launcher{i}.log", "w") for i in range(len(cmds))]
    procs = [subprocess.Popen(c, cwd=REPO, env=launch_env(), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True) for c, log in zip(cmds, logs)]
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
    records = {}
    for rank in range(2):
        path = work / "results" / f"rank{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[rank] = {r["name"]: r for r in map(json.loads, lines)}
    output = "\n".join((work / f"launcher{i}.log").read_text(errors="replace")[-3000:] for i in range(len(cmds)))
    return {"records": records, "output": output, "codes": [p.returncode for p in procs]}


def _tree(root: Path) -> dict:
    """Every file under ``root`` (relative path -> bytes); hidden files included."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_same_tree(one: Path, dist: Path) -> None:
    a, b = _tree(one), _tree(dist)
    assert len(a) > 2
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name] == b[name], name


def _leftovers(parent: Path, name: str) -> list:
    """What a run on ``parent/name`` may leave behind: the folder, its hidden temporary siblings, its lock."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@pytest.fixture(scope="module")
def one_node(fixture_by_name, parallel_fixtures, tmp_path_factory):
    """All single-node cases in one `torchrun --standalone --nproc_per_node 2` launch (the death of a rank last),
    and their single-process references."""
    work = tmp_path_factory.mktemp("distributed")
    jobs = _case_jobs(CASES, work, fixture_by_name, parallel_fixtures)
    src = Path(fixture_by_name("z2_bf16_w4")["checkpoint_path"])
    for kind in ("plan", "enospc", "missing source", "crash"):
        (work / kind).mkdir()
    jobs += [
        {"name": "plan", "argv": ["reshard", str(src), str(work / "plan" / "out"), "--world-size", "3", "--plan",
                                  "--distributed"]},
        {"name": "missing source", "argv": ["reshard", str(work / "no-such-checkpoint"), str(work / "missing source"
                                                                                           / "out"),
                                            "--world-size", "2", "-q", "--distributed"]},
        {"name": "enospc", "argv": ["reshard", str(src), str(work / "enospc" / "out"), "--world-size", "2", "-q",
                                    "--distributed"], "fault_rank": 1, "fault": "enospc", "slow_rank": 0},
        {"name": "crash", "argv": ["reshard", str(src), str(work / "crash" / "out"), "--world-size", "2", "-q",
                                   "--distributed"], "fault_rank": 1, "fault": "crash"},
    ]
    res = _launch(jobs, work / "launch", nodes=1)
    res["work"] = work
    return res


@pytest.fixture(scope="module")
def two_nodes(fixture_by_name, parallel_fixtures, tmp_path_factory):
    """The two-node cases in one pair of torchrun node launchers (1 process each, c10d rendezvous on 127.0.0.1)."""
    work = tmp_path_factory.mktemp("distributed-nodes")
    res = _launch(_case_jobs(TWO_NODE_CASES, work, fixture_by_name, parallel_fixtures), work / "launch", nodes=2)
    res["work"] = work
    return res


def _assert_ran(res, case):
    for rank in (0, 1):
        rec = res["records"][rank].get(case)
        assert rec is not None, f"rank {rank} has no record of {case!r}:\n{res['output']}"
        assert rec["rc"] == 0 and rec["stderr"] == "", (rank, rec)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_write_the_same_bytes_as_one_process(one_node, case):
    _assert_ran(one_node, case)
    _assert_same_tree(one_node["work"] / "one" / _key(case), one_node["work"] / "dist" / _key(case))


@pytest.mark.parametrize("case", list(TWO_NODE_CASES))
def test_two_node_launchers_write_the_same_bytes_as_one_process(two_nodes, case):
    assert two_nodes["codes"] == [0, 0], two_nodes["output"]
    _assert_ran(two_nodes, case)
    _assert_same_tree(two_nodes["work"] / "one" / _key(case), two_nodes["work"] / "dist" / _key(case))


def test_a_failure_on_one_rank_leaves_nothing_and_one_message(one_node):
    r0, r1 = one_node["records"][0]["enospc"], one_node["records"][1]["enospc"]
    assert r0["rc"] == 2 and r1["rc"] == 2
    lines = r0["stderr"].splitlines()
    assert lines[0].startswith("ckpt reshard: error: ") and "rank 1" in lines[0], r0["stderr"]
    assert "No space left on device" in lines[0] and "nothing was created" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("  hint: ")
    assert r1["stderr"] == ""  # rank 0 says it once
    assert _leftovers(one_node["work"] / "enospc", "out") == []
    # rank 0 (each of its units starting 3 s late) saw rank 1's failure before its first unit and wrote none of
    # its share; only rank 1's failure is in the message
    assert r0["units"] == 0 and "stopped because another rank failed" not in r0["stderr"]


def test_a_rank_that_dies_leaves_nothing(one_node):
    assert one_node["codes"] != [0]  # torchrun reports the dead worker
    assert "crash" not in one_node["records"][1]  # rank 1 died in the middle of its share
    r0 = one_node["records"][0]["crash"]
    assert r0["rc"] == 2 and "Traceback" not in r0["stderr"], r0["stderr"]
    assert r0["stderr"].startswith("ckpt reshard: error: ") and "the output folder was not created" in r0["stderr"]
    # gloo noticed the lost connection first, or torchrun's SIGTERM to the survivors arrived first
    assert "lost contact with another rank" in r0["stderr"] or "SIGTERM" in r0["stderr"], r0["stderr"]
    assert _leftovers(one_node["work"] / "crash", "out") == []


def test_a_planning_failure_is_said_once(one_node):
    r0, r1 = one_node["records"][0]["missing source"], one_node["records"][1]["missing source"]
    assert r0["rc"] == 2 and r1["rc"] == 2
    assert r0["stderr"].startswith("ckpt reshard: error: ") and "no-such-checkpoint" in r0["stderr"], r0["stderr"]
    assert "Traceback" not in r0["stderr"] and r1["stderr"] == ""
    assert _leftovers(one_node["work"] / "missing source", "out") == []


def test_plan_only_is_printed_by_rank_0_and_writes_nothing(one_node, fixture_by_name):
    r0, r1 = one_node["records"][0]["plan"], one_node["records"][1]["plan"]
    assert r0["rc"] == 0 and r1["rc"] == 0
    want = plan_reshard(fixture_by_name("z2_bf16_w4")["checkpoint_path"], one_node["work"] / "plan" / "out",
                        3).describe()
    assert r0["stdout"].strip() == want.strip() and r1["stdout"] == ""
    assert _leftovers(one_node["work"] / "plan", "out") == []


def test_distributed_outside_torchrun_is_one_clear_message(fixture_by_name, tmp_path, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    src = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    assert cli.main(["reshard", str(src), str(tmp_path / "out"), "--world-size", "3", "--distributed"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt reshard: error: cannot join the process group") and "torchrun" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,universal", [("z2_bf16_w4", False), ("z3_bf16_w3", False), ("z3_bf16_w3", True)])
def test_the_shares_are_balanced_by_bytes(fixture_by_name, tmp_path, name, universal):
    src = fixture_by_name(name)["checkpoint_path"]
    plan = plan_universal(src, tmp_path / "o") if universal else plan_reshard(src, tmp_path / "o", 3)
    work = units(plan, split=True)
    for ranks in (2, 3):
        shares = assign(work, ranks)
        assert Counter(u for s in shares for u in s) == Counter(work)  # every unit once
        loads = [sum(u.nbytes for u in s) for s in shares]
        assert max(loads) - min(loads) <= max(u.nbytes for u in work), loads


@pytest.mark.parametrize("case", [c for c in CASES if "--verify" in CASES[c][1]])
def test_each_rank_verifies_a_share_of_the_output(one_node, case):
    """``--verify --distributed``: every rank compared its share of the tensors (rank 0 printed nothing
    with -q, so the joined verification held); the shares' bytes add up to about a single verification's."""
    _assert_ran(one_node, case)
    shares = {r: one_node["records"][r][case]["verified"] for r in (0, 1)}
    assert [s[:2] for s in shares[0]] == [[0, 2]] and [s[:2] for s in shares[1]] == [[1, 2]], shares
    assert shares[0][0][2] > 0 and shares[1][0][2] > 0, shares


SIGTERM_IN_CLEANUP = r'''
import os, signal, sys
import torch.distributed as dist
from ckptlib import cli
from ckptlib.io import output as atomic
from ckptlib.execute import distributed

where = sys.argv[3]
real_gather = dist.all_gather_object

def lost_peer(out, obj, *a, **k):  # what gloo raises on a survivor when another rank died
    if isinstance(obj, tuple) or obj is None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10134.")
    return real_gather(out, obj, *a, **k)

dist.all_gather_object = lost_peer
if where == "removing":  # torchrun's SIGTERM while rank 0 removes the temporary folder
    real_exit = atomic.AtomicOutputDir.__exit__
    def exit_with_sigterm(self, *exc):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_exit(self, *exc)
    atomic.AtomicOutputDir.__exit__ = exit_with_sigterm
else:  # ... or as the failure is described
    real_describe = distributed._describe
    def describe_with_sigterm(e):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_describe(e)
    distributed._describe = describe_with_sigterm
sys.exit(cli.main(["reshard", sys.argv[1], sys.argv[2], "--world-size", "3", "--distributed"]))
'''


@pytest.mark.parametrize("where", ["removing", "describing"])
def test_sigterm_during_the_cleanup_after_a_lost_peer_does_not_cut_it_short(fixture_by_name, tmp_path, where):
    """CI saw it once: rank 1 died, gloo told rank 0 (its collective raised), and torchrun's SIGTERM arrived while
    rank 0 was cleaning up: a traceback, maybe a temporary folder left. Here it arrives there every time."""
    env = launch_env()
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    src = fixture_by_name("z2_bf16_w4")["checkpoint_path"]
    r = subprocess.run([sys.executable, "-c", SIGTERM_IN_CLEANUP, str(src), str(tmp_path / "out"), where], env=env,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("ckpt reshard: error: ") and lines[1].startswith("  hint: "), lines
    assert ("distributed reshard stopped on rank 0, the output folder was not created: lost contact with another "
            "rank ([gloo/transport/tcp/pair.cc:553] Connection closed by peer") in lines[0], lines
    assert _leftovers(tmp_path, "out") == []
