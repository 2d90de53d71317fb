"""The DeepSpeed load harness (tests/fixtures/load_check.py + load_runner.py) on the real fixtures.

DeepSpeed itself loads each checkpoint into a freshly initialised engine (other seed, perturbed
buffers) and the harness reports what the live engine holds and what one more step produces.
One torchrun launch per world size (module-scoped), plus one subprocess that makes universal
checkpoints (ds_to_universal) and corrupted copies.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.fixtures.generate import bits_equal
from tests.fixtures.load_check import LOAD_SEED, perturb_buffers
from tests.fixtures.load_runner import LoadCheckError, job_for_fixture, run_load_checks
from tests.fixtures.torchrun import launch_env
from tests.fixtures.model import build_model

# Same-world-size loads (DeepSpeed supports N -> N natively): loaded state must be bit-exact.
SAME_W2 = ["z1_bf16_w2", "z2_fp32_w2", "z3_bf16_w2", "z2_roundrobin_w2", "z3_subgroup_w2", "bf16opt_w2",
           "z1_roundrobin_w2", "z2_align_w2", "z3_fp32_w2", "z2_fp16_w2", "z3_fp16_w2", "hf_trainer_w2",
           "z2_bf16_w2", "z0_fp32_w2", "z0_bf16_w2"]
SAME_W3 = ["z1_bf16_w3", "z2_bf16_w3", "z2_fp32_w3", "z3_bf16_w3", "z3_subgroup_w3", "z2_roundrobin_w3",
           "bf16opt_w3"]
# Run twice: after_step must be bitwise equal. The "#again" copies run last; z2_bf16_w2's runs
# FIRST instead (before any ZeRO-3 engine patched torch.nn.functional.linear; see load_check.py).
REPEAT_W2 = ["z3_bf16_w2", "z2_roundrobin_w2", "z2_bf16_w2"]
UNIVERSAL_SRC = ["z2_bf16_w3", "z2_fp32_w3", "z3_bf16_w3"]    # converted, then loaded at 2 ranks
AGAIN = "#again"
# Universal loads do not restore frozen params or buffers: start from the generator's values.
AS_GENERATOR = {"init_seed": 1234, "perturb_buffers": False}


# --------------------------------------------------------------------------------------
# Launches (module scope: one per world size)
# --------------------------------------------------------------------------------------
PREPARE = """
import json, sys
import torch
from deepspeed.checkpoint import ds_to_universal as d
plan = json.loads(sys.argv[1])
for src, dst in plan["convert"]:
    sys.argv = ["ds_to_universal", "--input_folder", src, "--output_folder", dst,
                "--num_extract_workers", "1", "--num_merge_workers", "1"]
    d.main(d.parse_arguments())
for path, kind in plan["corrupt"]:
    sd = torch.load(path, map_location="cpu", weights_only=False)
    osd = sd["optimizer_state_dict"]
    if kind == "short_exp_avg":      # group 0's exp_avg one element short
        st = osd["base_optimizer_state"]["state"][0]
        st["exp_avg"] = st["exp_avg"][:-1].clone()
    elif kind == "short_fp32":       # group 0's fp32 partition 5 elements short
        g = osd["single_partition_of_fp32_groups"]
        g[0] = g[0][:-5].clone()
    torch.save(sd, path)
"""
CORRUPT = ["short_exp_avg", "short_fp32"]  # applied to rank 1's optim file of a copy of z2_bf16_w2


@pytest.fixture(scope="module")
def prepared(fixture_by_name, tmp_path_factory):
    """Copies of fixtures: UNIVERSAL_SRC with a universal checkpoint next to them (latest_universal),
    and z2_bf16_w2 copies with one corrupted rank file each. One subprocess (imports deepspeed)."""
    root = tmp_path_factory.mktemp("prepared")
    plan = {"convert": [], "corrupt": []}
    out = {}
    for name in UNIVERSAL_SRC:
        fx = fixture_by_name(name)
        dst = root / name
        shutil.copytree(fx["checkpoint_path"], dst)
        plan["convert"].append([str(dst / fx["tag"]), str(dst / f"{fx['tag']}_universal")])
        out[f"uc/{name}"] = dst
    fx = fixture_by_name("z2_bf16_w2")
    for kind in CORRUPT:
        dst = root / f"z2_bf16_w2-{kind}"
        shutil.copytree(fx["checkpoint_path"], dst)
        plan["corrupt"].append([str(dst / fx["tag"] / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"), kind])
        out[kind] = dst
    proc = subprocess.run([sys.executable, "-c", PREPARE, json.dumps(plan)], env=launch_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in UNIVERSAL_SRC:
        assert (out[f"uc/{name}"] / "latest_universal").is_file(), name
    return out


@pytest.fixture(scope="module")
def w2(fixture_by_name, prepared, tmp_path_factory):
    fx = fixture_by_name
    jobs = [job_for_fixture(fx(n)) for n in SAME_W2]
    jobs += [job_for_fixture(fx(n), name=n + AGAIN) for n in REPEAT_W2]
    jobs.insert(0, jobs.pop())  # z2_bf16_w2#again first
    assert jobs[0]["name"] == "z2_bf16_w2" + AGAIN
    jobs += [job_for_fixture(fx("z2_bf16_w3")), job_for_fixture(fx("z3_bf16_w3"))]  # controls: 3 -> 2
    jobs.append(job_for_fixture(fx("z2_fp32_w2"), name="z2_fp32_w2/no_optim", load_optimizer_states=False))
    for n in UNIVERSAL_SRC:
        jobs.append(job_for_fixture(fx(n), checkpoint_dir=prepared[f"uc/{n}"], universal=True, name=f"uc/{n}",
                                    **AS_GENERATOR))
    jobs.append(job_for_fixture(fx("z2_bf16_w3"), checkpoint_dir=prepared["uc/z2_bf16_w3"], universal=True,
                                name="uc/z2_bf16_w3/fresh"))  # default seed + perturbed buffers
    jobs += [job_for_fixture(fx("z2_bf16_w2"), checkpoint_dir=prepared[k], name=f"corrupt/{k}") for k in CORRUPT]
    return run_load_checks(jobs, world=2, workdir=tmp_path_factory.mktemp("load-w2"))


@pytest.fixture(scope="module")
def w3(fixture_by_name, tmp_path_factory):
    jobs = [job_for_fixture(fixture_by_name(n)) for n in SAME_W3]
    return run_load_checks(jobs, world=3, workdir=tmp_path_factory.mktemp("load-w3"))


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
def reference(fx) -> dict:
    return torch.load(fx["path"] / "reference.pt", map_location="cpu", weights_only=True)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bits_equal(a, b) if a.is_floating_point() else torch.equal(a, b)


def mismatches(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    bad += [n for n in want if n in got and not same(got[n], want[n])]
    return bad


def moment_mismatches(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    bad += [f"{n}.{k}" for n in want if n in got for k in ("exp_avg", "exp_avg_sq")
            if not same(got[n][k], want[n][k])]
    return bad


def ok(res: dict) -> dict:
    assert "error" not in res, f"{res['name']}: {res['phase']}: {res['error']}"
    return res


def max_abs(a: dict, b: dict) -> float:
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def max_rel_l2_per_param(a: dict, b: dict, base: dict) -> float:
    """max over params of ||a - b|| / ||a - base|| (difference relative to the step's update)."""
    return max(float((a[n] - b[n]).norm() / (a[n] - base[n]).norm()) for n in a)


def check_same_world(res: dict, fx: dict):
    ref = reference(fx)
    ok(res)
    assert res["optimizer_class"] == fx["optimizer_class"]
    got = res["loaded"]
    assert not got["optim_state_missing"]
    assert mismatches(got["fp32"], ref["fp32"]) == []
    assert moment_mismatches(got["optim"], ref["optim"]) == []
    assert got["step"] == ref["step"]
    assert got["global_steps"] == fx["extras"]["global_steps"]
    assert mismatches(got["frozen"], ref["frozen"]) == []
    assert mismatches(got["buffers"], ref["buffers"]) == []
    assert mismatches(got["lp"], ref["lp"]) == []
    after = res["after_step"]
    assert after["step"] == ref["step"] + 1 and not after["step_tensor_shared"]
    assert (res["functional_linear"] == "torch") == (fx["zero_stage"] != 3), res["functional_linear"]
    assert after["global_steps"] == got["global_steps"] + 1 and after["skipped_steps"] == 0
    assert set(after["fp32"]) == set(got["fp32"])
    assert 1e-3 < max_abs(after["fp32"], got["fp32"]) < 0.05  # one AdamW step (lr 1e-2 / 5e-3)
    assert mismatches(after["frozen"], ref["frozen"]) == []


# --------------------------------------------------------------------------------------
# Same world size: bit-exact against reference.pt
# --------------------------------------------------------------------------------------
def test_fresh_engine_differs_from_every_fixture_value(fixture_by_name):
    """The harness's starting point differs from every saved value, so equality proves the load."""
    model = build_model("small", seed=LOAD_SEED)
    perturb_buffers(model)
    ref = reference(fixture_by_name("z2_bf16_w2"))
    fresh = dict(model.named_parameters())
    for n, want in list(ref["fp32"].items()) + list(ref["frozen"].items()):
        assert not torch.equal(fresh[n].detach().to(want.dtype), want), n
    bufs = dict(model.named_buffers())
    for n, want in ref["buffers"].items():
        assert not torch.equal(bufs[n], want), n


@pytest.mark.parametrize("name", SAME_W2)
def test_same_world_load_w2(w2, fixture_by_name, name):
    check_same_world(w2[name], fixture_by_name(name))


@pytest.mark.parametrize("name", SAME_W3)
def test_same_world_load_w3(w3, fixture_by_name, name):
    check_same_world(w3[name], fixture_by_name(name))


@pytest.mark.parametrize("name", REPEAT_W2)
def test_after_step_is_bitwise_deterministic(w2, name):
    a, b = ok(w2[name])["after_step"], ok(w2[name + AGAIN])["after_step"]
    assert mismatches(a["fp32"], b["fp32"]) == []
    assert moment_mismatches(a["optim"], b["optim"]) == []
    assert mismatches(a["lp"], b["lp"]) == []
    assert a["step"] == b["step"] and a["loss"] == b["loss"]


def test_result_structure(w2):
    res = w2["z2_bf16_w2"]
    assert res["world_size"] == 2 and res["launch"]["returncode"] in (0, 1)
    assert res["config"]["train_batch_size"] == 12 and res["config"]["train_micro_batch_size_per_gpu"] == 6
    for snap in (res["loaded"], res["after_step"]):
        assert {"fp32", "optim", "step", "lp", "frozen", "buffers", "global_steps", "skipped_steps",
                "optim_state_missing", "step_tensor_shared"} <= set(snap)
        assert isinstance(snap["step"], int)
        assert all(t.dtype == torch.float32 for t in snap["fp32"].values())
        assert all(t.dtype == torch.bfloat16 for t in snap["lp"].values())
    assert isinstance(res["after_step"]["loss"], float)


# --------------------------------------------------------------------------------------
# World-size change without conversion: DeepSpeed refuses
# --------------------------------------------------------------------------------------
def test_zero2_dp_size_change_is_refused(w2):
    res = w2["z2_bf16_w3"]
    assert res["phase"] == "load", res
    assert res["error"].startswith("ZeRORuntimeException:")
    assert "DP world size of 3" in res["error"] and "current world size is 2" in res["error"]
    assert all(e == res["error"] for e in res["errors_by_rank"])  # every rank refuses


def test_zero3_world_size_change_fails(w2):
    # DeepSpeed 0.19.8 does not reach its DP-size check at ZeRO-3: restoring the frozen-param
    # fragments (this rank's ceil(1089/3) = 363 elements into a ceil(1089/2) = 545 partition,
    # in load_module_state_dict) raises first.
    res = w2["z3_bf16_w3"]
    assert res["phase"] == "load", res
    assert res["error"].startswith("RuntimeError:") and "545" in res["error"] and "363" in res["error"]


# --------------------------------------------------------------------------------------
# Optimizer states not loaded
# --------------------------------------------------------------------------------------
def test_load_without_optimizer_states(w2, fixture_by_name):
    ref = reference(fixture_by_name("z2_fp32_w2"))
    res = ok(w2["z2_fp32_w2/no_optim"])
    got = res["loaded"]
    assert got["optim_state_missing"] and got["step"] == 0  # zeros reported for the absent Adam state
    assert mismatches(got["fp32"], ref["fp32"]) == []        # fp32 run: masters from the module weights
    assert all(not v[k].any() for v in got["optim"].values() for k in ("exp_avg", "exp_avg_sq"))
    assert res["after_step"]["step"] == 1 and not res["after_step"]["optim_state_missing"]
    full = ok(w2["z2_fp32_w2"])["after_step"]
    assert max_abs(res["after_step"]["fp32"], full["fp32"]) > 1e-3  # lost moments are visible


# --------------------------------------------------------------------------------------
# Universal checkpoints: 3 -> 2 ranks
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", UNIVERSAL_SRC)
def test_universal_load_3_to_2(w2, fixture_by_name, name):
    ref = reference(fixture_by_name(name))
    got = ok(w2[f"uc/{name}"])["loaded"]
    assert mismatches(got["fp32"], ref["fp32"]) == []
    assert moment_mismatches(got["optim"], ref["optim"]) == []
    assert got["step"] == ref["step"]
    assert mismatches(got["frozen"], ref["frozen"]) == [] and mismatches(got["buffers"], ref["buffers"]) == []


def test_universal_load_skips_frozen_params_and_buffers(w2, fixture_by_name):
    """DeepSpeed 0.19.8 restores neither from a universal checkpoint (they keep the fresh values)."""
    ref = reference(fixture_by_name("z2_bf16_w3"))
    got = ok(w2["uc/z2_bf16_w3/fresh"])["loaded"]
    assert mismatches(got["fp32"], ref["fp32"]) == []
    assert sorted(mismatches(got["frozen"], ref["frozen"])) == sorted(ref["frozen"])
    assert sorted(mismatches(got["buffers"], ref["buffers"])) == sorted(ref["buffers"])


def test_universal_zero3_shares_one_step_tensor(w2, w3):
    """DeepSpeed 0.19.8 ZeRO-3 universal load puts ONE step tensor into every flat group's Adam
    state, so a training step advances it once per group (2 -> 4 with two param groups)."""
    res = ok(w2["uc/z3_bf16_w3"])
    assert res["loaded"]["step"] == 2 and res["loaded"]["step_tensor_shared"]
    assert res["after_step"]["step"] == 4
    assert ok(w3["z3_bf16_w3"])["after_step"]["step"] == 3


def test_continuation_across_world_sizes(w2, w3):
    """Native 3-rank continuation vs 2-rank continuation of the same state (universal load).

    Same loaded state (bit for bit), same 12 samples; only the reduction order differs. fp32:
    noise ~1e-7; bf16: per-element noise reaches 2.7e-3 (update max 1e-2) where Adam divides by a
    tiny sqrt(v), so compare per parameter relative to the update: noise <= ~0.011, while a lost
    or shifted Adam moment gives ~1 and an off-by-one step 0.165.
    """
    for name in ("z2_fp32_w3", "z2_bf16_w3"):
        a, b = ok(w3[name]), ok(w2[f"uc/{name}"])
        assert mismatches(a["loaded"]["fp32"], b["loaded"]["fp32"]) == []
        assert mismatches(a["loaded"]["lp"], b["loaded"]["lp"]) == []
        rel = max_rel_l2_per_param(a["after_step"]["fp32"], b["after_step"]["fp32"], a["loaded"]["fp32"])
        diff = max_abs(a["after_step"]["fp32"], b["after_step"]["fp32"])
        print(f"{name}: 3 vs 2 ranks after one step: max |diff| {diff:.3g}, per-param rel L2 {rel:.3g}")
        if name.startswith("z2_fp32"):
            assert diff < 1e-6
        assert rel < 0.05


# --------------------------------------------------------------------------------------
# Corrupted rank files: what DeepSpeed accepts and how the harness shows it
# --------------------------------------------------------------------------------------
def test_short_exp_avg_is_accepted_by_deepspeed_and_reported(w2):
    res = w2["corrupt/short_exp_avg"]
    assert res.get("phase") == "gather_loaded", res  # load_checkpoint did not complain
    assert "Adam state does not match" in res["error"] and "rank 1: fp32 group 0: exp_avg" in res["error"]


def test_short_fp32_partition_is_zero_padded_silently(w2, fixture_by_name):
    ref = reference(fixture_by_name("z2_bf16_w2"))
    got = ok(w2["corrupt/short_fp32"])["loaded"]["fp32"]
    bad = mismatches(got, ref["fp32"])
    assert bad == ["fc3.weight"], bad  # the tail of rank 1's group-0 partition
    diff = (got["fc3.weight"] != ref["fp32"]["fc3.weight"]).reshape(-1).nonzero().reshape(-1)
    assert diff.tolist() == list(range(ref["fp32"]["fc3.weight"].numel() - 5, ref["fp32"]["fc3.weight"].numel()))
    assert not got["fc3.weight"].reshape(-1)[-5:].any()


def test_runner_raises_with_log_tail_when_results_are_missing(fixture_by_name, tmp_path):
    job = job_for_fixture(fixture_by_name("z2_bf16_w2"), dtype="fp8")  # load_check.py exits at once
    with pytest.raises(LoadCheckError, match=r"(?s)1 of 1 results missing.*bad dtype 'fp8'"):
        run_load_checks([job], world=1, workdir=tmp_path, timeout=120)
