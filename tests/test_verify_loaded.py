"""ckptlib.verify_loaded inside real DeepSpeed processes (the load harness, 2 ranks): it passes on exact loads
(also of a checkpoint resharded from 3 ranks, compared with the original), and finds the deliberately wrong
ones: optimizer states not loaded, a stale tag."""
from __future__ import annotations

import pytest

import ckptlib
from tests.fixtures.load_runner import job_for_fixture, run_load_checks


@pytest.fixture(scope="module")
def results(fixture_by_name, tmp_path_factory):
    work = tmp_path_factory.mktemp("verify-loaded")
    fx = fixture_by_name
    jobs = []
    for name in ("z2_bf16_w2", "z3_bf16_w2", "bf16opt_w2", "z2_roundrobin_w2"):
        f = fx(name)
        jobs.append(job_for_fixture(f, name=f"{name}/ok", verify=str(f["checkpoint_path"])))
    for name in ("z2_bf16_w2", "z3_bf16_w2"):
        f = fx(name)
        jobs.append(job_for_fixture(f, name=f"{name}/no-optim", load_optimizer_states=False,
                                    verify=str(f["checkpoint_path"])))
    for name in ("z2_bf16_w3", "z3_bf16_w3"):  # resharded to 2 ranks: compared with the 3-rank original
        f = fx(name)
        out = work / f"{name}-w2"
        ckptlib.reshard(f["checkpoint_path"], out, 2)
        jobs.append(job_for_fixture(f, checkpoint_dir=out, name=f"{name}/resharded", verify=str(f["checkpoint_path"])))
    hf = fx("hf_trainer_w2")
    older = hf["tags"][0]
    jobs.append(job_for_fixture(hf, name="stale", tag=older, verify=str(hf["checkpoint_path"])))  # latest: newer
    jobs.append(job_for_fixture(hf, name="older", tag=older, verify=str(hf["checkpoint_path"]), verify_tag=older))
    return run_load_checks(jobs, world=2, workdir=work)


def verdict(res: dict) -> dict:
    assert "error" not in res, res
    return res["verify"]


@pytest.mark.parametrize("name", ["z2_bf16_w2/ok", "z3_bf16_w2/ok", "bf16opt_w2/ok", "z2_roundrobin_w2/ok",
                                  "z2_bf16_w3/resharded", "z3_bf16_w3/resharded", "older"])
def test_exact_loads_pass(results, name):
    v = verdict(results[name])
    assert v["ok"], v["mismatches"][:5]
    assert v["elements"] > 0 and v["step"][0] == v["step"][1]


@pytest.mark.parametrize("name", ["z2_bf16_w2/no-optim", "z3_bf16_w2/no-optim"])
def test_optimizer_state_not_loaded_is_found(results, fixture_by_name, name):
    v = verdict(results[name])
    assert not v["ok"]
    found = {(n, what) for n, what, _ in v["mismatches"]}
    trainable = [p["name"] for p in fixture_by_name(name.split("/")[0])["parameters"]
                 if p["trainable"] and not p["tied_to"]]
    assert ("optimizer", "step") in found
    assert {(p, "exp_avg") for p in trainable} <= found, sorted(found)[:10]


def test_stale_tag_is_found(results):
    v = verdict(results["stale"])
    assert not v["ok"]
    whats = {what for _, what, _ in v["mismatches"]}
    assert {"fp32", "exp_avg", "exp_avg_sq", "step"} <= whats
    assert v["step"][0] < v["step"][1]
