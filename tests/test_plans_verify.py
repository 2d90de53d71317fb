"""Plans are plain data that run anywhere; every run returns one result type; verification re-reads the
output and finds what differs; ``--verify`` works without the notebook stack. On real fixtures."""
from __future__ import annotations

import filecmp
import pickle
import subprocess
import sys
import textwrap

import pytest

import ckptlib
from ckptlib.plan import PROCESSES, THREADS

BLOCK_UI = textwrap.dedent("""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ipywidgets", "matplotlib", "IPython"):
                raise ImportError(name + " is blocked in this test")
    sys.meta_path.insert(0, Block())
""")


def _plans(fixture_by_name, tmp_path, where):
    return [
        ckptlib.plan_export(fixture_by_name("z3_bf16_w2")["checkpoint_path"], tmp_path / f"{where}-export",
                            states=["exp_avg", "exp_avg_sq"], max_shard_size="20KB", dtype="bf16"),
        ckptlib.plan_reshard(fixture_by_name("z2_fp32_w4")["checkpoint_path"], tmp_path / f"{where}-reshard", 3),
        ckptlib.plan_universal(fixture_by_name("z1_bf16_w3")["checkpoint_path"], tmp_path / f"{where}-universal"),
    ]


def _same_tree(a, b) -> None:
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names and names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), n


def test_plans_pickle_print_and_run_in_another_process(fixture_by_name, tmp_path):
    here = _plans(fixture_by_name, tmp_path, "here")
    there = _plans(fixture_by_name, tmp_path, "there")
    for plan, other in zip(here, there):
        assert plan.describe() and plan.to_dict()["write_bytes"] == plan.write_bytes
        result = ckptlib.run(plan)
        assert type(result) is ckptlib.RunResult and result.memory is not None and result.action == plan.action
        assert result.memory.peak_added <= plan.predicted_peak_bytes
        blob = tmp_path / f"{plan.action}.pkl"
        blob.write_bytes(pickle.dumps(other))
        code = "import pickle, sys, ckptlib; r = ckptlib.run(pickle.load(open(sys.argv[1], 'rb'))); print(r.action)"
        r = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.strip() == plan.action, r.stderr[-2000:]
        _same_tree(plan.out, other.out)
        assert ckptlib.verify(other).ok


def test_export_workers_are_processes_that_receive_the_pickled_plan(fixture_by_name, tmp_path):
    src = fixture_by_name("large_w2")["checkpoint_path"]
    one = ckptlib.plan_export(src, tmp_path / "one", max_shard_size="10MB")
    two = ckptlib.plan_export(src, tmp_path / "two", max_shard_size="10MB", workers=2)
    assert (one.parallel, two.parallel, two.workers) == (PROCESSES, PROCESSES, 2)
    assert ckptlib.plan_reshard(src, tmp_path / "r", 3).parallel == THREADS
    ckptlib.run(one)
    res = ckptlib.run(two)
    _same_tree(one.out, two.out)
    assert res.bytes_read >= two.read_bytes  # counted in the worker processes


def _flip(path, offset) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_verification_names_the_tensor_that_differs(fixture_by_name, tmp_path):
    from ckptlib.io.stformat import read_header

    fx = fixture_by_name("z2_bf16_w3")
    plan = ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "export")
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    _, infos = read_header(plan.out / "model.safetensors")
    victim = next(t for t in infos if t.name == "fc1.weight")
    _flip(plan.out / "model.safetensors", victim.offset + 7)
    v = ckptlib.verify(plan)
    assert not v.ok and "fc1.weight" in v.describe() and "verification FAILED" in v.describe()
    assert [c.ok for c in v.checks].count(False) == 1

    rplan = ckptlib.plan_reshard(fx["checkpoint_path"], tmp_path / "reshard", 2)
    ckptlib.run(rplan)
    assert ckptlib.verify(rplan).ok
    with ckptlib.open_checkpoint(rplan.out) as new:
        r = new.sources("fc2.bias", "exp_avg_sq")[0]
    _flip(r.path, r.offset + 1)
    v = ckptlib.verify(rplan)
    bad = [c for c in v.checks if not c.ok]
    assert len(bad) == 1 and "exp_avg_sq" in bad[0].what and "fc2.bias" in bad[0].detail


@pytest.mark.parametrize("command", ["export", "reshard", "universal"])
def test_cli_verify_works_without_ipywidgets_and_matplotlib(fixture_by_name, tmp_path, command):
    src = str(fixture_by_name("z3_fp32_w3")["checkpoint_path"])
    args = {"export": ["export", src, str(tmp_path / "o"), "--states", "exp_avg"],
            "reshard": ["reshard", src, str(tmp_path / "o"), "--world-size", "2"],
            "universal": ["reshard", src, str(tmp_path / "o"), "--universal"]}[command]
    code = BLOCK_UI + textwrap.dedent(f"""
        from ckptlib.cli import main
        rc = main({args + ["--verify"]!r})
        assert not any(m.split(".")[0] in ("ipywidgets", "matplotlib") for m in sys.modules), "UI imported"
        sys.exit(rc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\nverified: " in r.stdout and "bit for bit" in r.stdout and "FAIL" not in r.stdout


def test_cli_verify_exits_1_on_a_mismatch(fixture_by_name, tmp_path):
    """The run is real; right after it one byte of the output is changed, as a faulty disk would."""
    src = str(fixture_by_name("z2_fp32_w2")["checkpoint_path"])
    code = BLOCK_UI + textwrap.dedent(f"""
        import ckptlib.execute.runner as runner
        real = runner.run
        def run_then_damage(plan, **kw):
            result = real(plan, **kw)
            path = result.out / "model.safetensors"
            data = bytearray(path.read_bytes())
            data[-3] ^= 0x40
            path.write_bytes(bytes(data))
            return result
        import ckptlib.execute
        ckptlib.execute.run = run_then_damage
        from ckptlib.cli import main
        sys.exit(main(["export", {src!r}, {str(tmp_path / "o")!r}, "--verify", "-q"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verification FAILED" in r.stdout and "FAIL every tensor equals" in r.stdout
    assert "Traceback" not in r.stderr


def test_refused_layouts_are_unsupported_and_broken_ones_incomplete(fixture_by_name, tmp_path):
    import shutil

    src = fixture_by_name("z2_bf16_w3")["checkpoint_path"]
    # ZeRO-0 fp32 names nothing: an optimizer entry that could be either of two same-shape parameters
    z0 = fixture_by_name("z0_fp32_w2")["checkpoint_path"]
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="cannot be told to be either's"):
        ckptlib.plan_export(z0, tmp_path / "o", states=["exp_avg"])
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ckptlib.IncompleteCheckpointError, match="missing bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        ckptlib.plan_reshard(broken, tmp_path / "o", 2)
    assert not (tmp_path / "o").exists()


def test_shared_verifications_join_into_the_single_one(fixture_by_name, tmp_path):
    """Processes that share a verification (each compares every n-th tensor) give, joined, what one process
    finds: the same checks, the same damaged tensors, and the bytes compared split between them."""
    from ckptlib.io.stformat import read_header
    from ckptlib.analysis.verify import Share, merge_verifications, verify

    fx = fixture_by_name("z2_bf16_w3")
    plans = [ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "export", states=["exp_avg"]),
             ckptlib.plan_reshard(fx["checkpoint_path"], tmp_path / "reshard", 2),
             ckptlib.plan_universal(fx["checkpoint_path"], tmp_path / "universal")]
    for plan in plans:
        ckptlib.run(plan)
    _, infos = read_header(plans[0].out / "model.safetensors")
    _flip(plans[0].out / "model.safetensors", next(t for t in infos if t.name == "fc1.weight").offset + 7)
    _, infos = read_header(plans[0].out / "exp_avg" / "model.safetensors")
    _flip(plans[0].out / "exp_avg" / "model.safetensors", next(t for t in infos if t.name == "fc2.bias").offset + 3)
    with ckptlib.open_checkpoint(plans[1].out) as new:
        r = new.sources("fc2.bias", "exp_avg_sq")[0]
    _flip(r.path, r.offset + 1)
    for plan in plans:
        one = verify(plan)
        for world in (2, 3):
            parts = [verify(plan, share=Share(rank, world)) for rank in range(world)]
            joined = merge_verifications(parts)
            assert [(c.what, c.ok, c.detail) for c in joined.checks] == [(c.what, c.ok, c.detail) for c in one.checks]
            assert joined.bytes_compared == one.bytes_compared
            assert all(0 < p.bytes_compared < one.bytes_compared for p in parts), [p.bytes_compared for p in parts]
        assert one.ok == (plan.action == "universal"), one.describe()
    assert "fc1.weight" in verify(plans[0]).describe() and "exp_avg/fc2.bias" in verify(plans[0]).describe()


def test_a_share_that_could_not_run_fails_the_joined_verification(tmp_path):
    from ckptlib.analysis.verify import Check, Verification, merge_verifications

    ok = Verification(out=tmp_path, checks=[Check("a", True), Check("b", True, "3 of 3", total=3)], bytes_compared=8)
    failed = Verification(out=tmp_path, checks=[Check("rank 1 verified its share", False, "OSError: gone")])
    joined = merge_verifications([ok, failed])
    assert not joined.ok and "rank 1 verified its share" in joined.describe() and "OSError: gone" in joined.describe()
