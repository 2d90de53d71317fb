"""The resume check (`ckpt check --resume-at`) against real DeepSpeed loads: each prediction is compared
with what DeepSpeed 0.19.8 does when it loads the fixture at that configuration (one torchrun launch at 2
ranks): a predicted refusal must fail with DeepSpeed's message, a predicted exact load must restore the
masters, moments, step, frozen weights and buffers bit for bit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ckptlib.analysis.resume import DROPS, LOADS, REFUSED, resume_check
from tests.fixtures.compare import reference
from tests.fixtures.load_runner import job_for_fixture, run_load_checks
from tests.fixtures.torchrun import launch_env

CPU_OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer": False}
# (job name, fixture, overrides of the load job) -> the verdict the resume check must give
CASES = [
    ("same", "z2_bf16_w2", {}, LOADS),
    ("dp 3->2 z2", "z2_bf16_w3", {}, REFUSED),
    ("dp 3->2 z3", "z3_bf16_w3", {}, REFUSED),
    ("stage 2->1", "z2_bf16_w2", {"zero_stage": 1}, LOADS),
    ("stage 1->2", "z1_bf16_w2", {"zero_stage": 2}, LOADS),
    ("stage 2->3", "z2_bf16_w2", {"zero_stage": 3}, REFUSED),
    ("stage 3->2", "z3_bf16_w2", {"zero_stage": 2}, REFUSED),
    ("stage 0->1", "z0_fp32_w2", {"zero_stage": 1}, REFUSED),
    ("stage 2->0", "z2_fp32_w2", {"zero_stage": 0}, REFUSED),
    ("bf16->fp32 z2", "z2_bf16_w2", {"dtype": "fp32"}, REFUSED),
    ("fp32->bf16 z2", "z2_fp32_w2", {"dtype": "bf16"}, REFUSED),
    ("bf16->fp32 z3", "z3_bf16_w2", {"dtype": "fp32"}, REFUSED),
    ("fp16->fp32 z2", "z2_fp16_w2", {"dtype": "fp32"}, LOADS),
    ("z3 cpu offload", "z3_bf16_w2", {"ds_config_overrides": CPU_OFFLOAD}, LOADS),
    ("z2 cpu offload", "z2_bf16_w2", {"ds_config_overrides": CPU_OFFLOAD}, LOADS),
    ("bf16opt->zero1", "bf16opt_w2", {"ds_config_overrides": {"data_types": {"grad_accum_dtype": "bf16"}}}, LOADS),
    ("zero1->bf16opt", "z1_bf16_w2", {"ds_config_overrides": {"data_types": {"grad_accum_dtype": "fp32"}}}, LOADS),
    ("load_universal", "z2_bf16_w2", {"universal": True}, REFUSED),
]


@pytest.fixture(scope="module")
def loaded(fixture_by_name, tmp_path_factory):
    jobs = [job_for_fixture(fixture_by_name(fx), name=name, **over) for name, fx, over, _ in CASES]
    return run_load_checks(jobs, world=2, workdir=tmp_path_factory.mktemp("resume"))


def config_of(result: dict) -> dict:
    return result["config"]


def exact(loaded: dict, ref: dict) -> list[str]:
    bad = [f"fp32 {p}" for p, t in ref["fp32"].items() if not torch.equal(loaded["fp32"][p], t)]
    bad += [f"{k} {p}" for p, m in ref["optim"].items() for k in ("exp_avg", "exp_avg_sq")
            if not torch.equal(loaded["optim"][p][k], m[k])]
    bad += [f"frozen {p}" for p, t in ref["frozen"].items() if not torch.equal(loaded["frozen"][p], t)]
    bad += [f"buffer {p}" for p, t in ref["buffers"].items() if not torch.equal(loaded["buffers"][p], t)]
    return bad + ([f"step {loaded['step']} != {ref['step']}"] if loaded["step"] != ref["step"] else [])


@pytest.mark.parametrize("name,fx,over,verdict", CASES, ids=[c[0] for c in CASES])
def test_prediction_matches_deepspeed(fixture_by_name, loaded, name, fx, over, verdict):
    res = loaded[name]
    fixture = fixture_by_name(fx)
    predicted = resume_check(fixture["checkpoint_path"], config_of(res), 2)
    assert predicted.verdict == verdict, predicted.describe()
    if verdict == REFUSED:
        assert "error" in res and res["phase"] == "load", res
        said = [f.deepspeed for f in predicted.findings if f.verdict == REFUSED and f.deepspeed]
        assert said, predicted.describe()
        assert res["error"] in said or any(s.startswith(res["error"]) or res["error"].startswith(s.split(" (")[0])
                                           for s in said), (res["error"], said)
        fixed = any(f.fix for f in predicted.findings if f.verdict == REFUSED)
        assert fixed == (not name.startswith("stage")), predicted.describe()  # no command changes the stage
    else:
        assert "error" not in res, res
        assert exact(res["loaded"], reference(fixture)) == []


# pipeline and tensor-parallel fixtures loaded at 2 ranks (their data-parallel size changes, the mesh stays)
MESH_CASES = [("pp2 dp1 same", "pp2_dp1_z1_bf16", 2, 1, LOADS), ("pp2 dp 2->1", "pp2_dp2_z1_bf16", 2, 1, REFUSED),
              ("tp2 dp 2->1", "tp2_dp2_z1_bf16", 1, 2, REFUSED)]


@pytest.fixture(scope="module")
def mesh_loaded(parallel_fixtures, tmp_path_factory):
    from tests.fixtures.parallel.check import run_load_checks as run_parallel

    jobs = [{"name": name, "fixture": str(parallel_fixtures[fx]["path"]), "checkpoint_dir": None, "tag": None,
             "universal": False} for name, fx, *_ in MESH_CASES]
    return run_parallel(jobs, world=2, workdir=tmp_path_factory.mktemp("resume-mesh"))


@pytest.mark.parametrize("name,fx,pp,tp,verdict", MESH_CASES, ids=[c[0] for c in MESH_CASES])
def test_mesh_prediction_matches_deepspeed(parallel_fixtures, mesh_loaded, name, fx, pp, tp, verdict):
    res = mesh_loaded[name]
    fixture = parallel_fixtures[fx]
    predicted = resume_check(fixture["checkpoint_path"], res["config"], 2, pp=pp, tp=tp)
    assert predicted.verdict == verdict, predicted.describe()
    if verdict == REFUSED:
        assert "error" in res and res["phase"] == "load", res
        assert res["error"] in [f.deepspeed for f in predicted.findings], (res["error"], predicted.describe())
    else:
        assert "error" not in res, res
        ref = torch.load(fixture["path"] / "reference.pt", weights_only=True)
        assert all(torch.equal(res["loaded"]["params"][n], t) for n, t in ref["params"].items())
        assert res["loaded"]["step"] == ref["step"]
    # another mesh than the saved one is predicted refused (not loaded here: no fixture changes tp or pp)
    other = resume_check(fixture["checkpoint_path"], res["config"], 4, pp=pp * 2, tp=tp)
    assert other.verdict == REFUSED and any("pipeline size" in f.what for f in other.findings)
    fix = next(f.fix for f in other.findings if "pipeline size" in f.what)
    assert f"--tp {tp} --pp {pp * 2} " in fix and fix.startswith("ckpt reshard "), fix  # the mesh reshard's command


def test_dp_change_fix_is_a_reshard(fixture_by_name):
    fx = fixture_by_name("z2_bf16_w3")
    r = resume_check(fx["checkpoint_path"], {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, 2)
    assert r.verdict == REFUSED
    assert any(f.fix and "ckpt reshard" in f.fix and "--world-size 2" in f.fix for f in r.findings)


def test_cli_exit_codes_and_json(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w3")
    cfg = tmp_path / "ds.json"
    for world, code in ((3, 0), (2, 1)):
        cfg.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
        r = subprocess.run([sys.executable, "-m", "ckptlib", "check", str(fx["checkpoint_path"]), "--resume-at",
                            str(cfg), "--world-size", str(world), "--json"], capture_output=True, text=True,
                           env=launch_env(), timeout=300)
        assert r.returncode == code, r.stdout + r.stderr
        assert json.loads(r.stdout)["verdict"] == (LOADS if code == 0 else REFUSED)
    cfg.write_text(json.dumps({"zero_optimization": {"stage": "auto"}}))
    r = subprocess.run([sys.executable, "-m", "ckptlib", "check", str(fx["checkpoint_path"]), "--resume-at", str(cfg),
                        "--world-size", "2"], capture_output=True, text=True, env=launch_env(), timeout=300)
    assert r.returncode == 2 and "auto" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "ckptlib", "check", str(fx["checkpoint_path"]), "--resume-at",
                        str(tmp_path / "nope.json"), "--world-size", "2"], capture_output=True, text=True,
                       env=launch_env(), timeout=300)
    assert r.returncode == 2 and "nope.json" in r.stderr


def test_universal_limits_are_reported(fixture_by_name):
    fx = fixture_by_name("z2_bf16_w2")
    r = resume_check(fx["checkpoint_path"], {"zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}, 4)
    assert r.verdict == REFUSED
    assert any(f.verdict == DROPS and "frozen" in f.what for f in r.findings)


def test_an_moe_universal_fix_names_the_expert_parallel_size_to_load_at(parallel_fixtures):
    """An MoE universal folder is for one expert-parallel size (docs/reshard.md): the fix names the target's."""
    fx = parallel_fixtures["moe_ep2_z1_bf16"]
    cfg = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "checkpoint": {"load_universal": True}}
    fixes = [f.fix for f in resume_check(fx["checkpoint_path"], cfg, 2, ep=1).findings if f.fix]
    assert any("--universal --ep 1 " in f for f in fixes), fixes
    fixes = [f.fix for f in resume_check(fx["checkpoint_path"], cfg, 2, ep=2).findings if f.fix]
    assert fixes and all("--ep" not in f for f in fixes if "--universal" in f), fixes
