"""DCP export, loaded by real clients: FSDP2 (``fully_shard``, ``torch.optim.AdamW``, ``get_state_dict`` /
``dcp.load`` / ``set_state_dict``) at 1, 2 and 3 ranks on CPU with gloo holds bit-exact fp32 masters,
moments, the step, the groups' hyper-parameters, frozen parameters and buffers, from ZeRO-1/2/3 and
BF16_Optimizer sources saved at other sizes (bf16 and fp32; FixtureNet is tied and has frozen parameters),
a pipeline and a tensor-parallel source; one more training step matches DeepSpeed's own next step;
torchtitan's own CheckpointManager loads the torchtitan layout, Accelerate's FSDP2 loading the accelerate layout."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import ckptlib
from tests.fixtures.compare import FP32_ATOL, HALF_RTOL, continuation_error, reference
from tests.fixtures.fsdp_runner import run_fsdp_loads
from tests.fixtures.load_runner import job_for_fixture, run_load_checks
from tests.fixtures.model import build_model, param_group_names

# FixtureNet sources (tied embed/head, a frozen Linear, buffers): (fixture, FSDP2 ranks)
FIXTURE_CASES = [("z1_fp32_w2", 1), ("z3_bf16_w2", 1), ("bf16opt_w2", 1),
                 ("z2_bf16_w3", 2), ("z3_fp32_w3", 2), ("z1_bf16_w4", 2), ("z3_subgroup_w3", 2),
                 ("z2_fp32_w2", 3), ("z1_fp32_w4", 3), ("z3_bf16_w4", 3), ("z2_bf16_w2", 3)]
# pipeline and tensor-parallel sources (4 ranks): masters and moments under the un-parallelised names
PARALLEL_CASES = [("pp2_dp2_z1_bf16", 1), ("tp2_dp2_z2_fp32", 1), ("tp2_dp2_z1_bf16", 2), ("pp2_dp2_z1_fp32", 2),
                  ("pp2_dp2_bf16opt", 3), ("tp2_dp2_z2_bf16", 3)]
TITAN_CASES = [("z2_bf16_w2", 2), ("z3_fp32_w3", 3)]
SAVED_CASES = [("z2_bf16_w3", 2), ("z3_bf16_w4", 3)]  # FSDP2 saves what it loaded: uneven Shard(0) chunks at 3 ranks
ACCELERATE_CASES = [("z1_bf16_w3", 2), ("z3_bf16_w2", 1)]


def _groups_of(shapes: dict, frozen: set) -> list:
    decay = [n for n, s in shapes.items() if n not in frozen and len(s) >= 2]
    rest = [n for n, s in shapes.items() if n not in frozen and len(s) < 2]
    return [g for g in (decay, rest) if g]


@pytest.fixture(scope="module")
def runs(fixture_by_name, parallel_fixtures, tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    work = tmp_path_factory.mktemp("dcp")
    jobs, ds_jobs = defaultdict(list), defaultdict(list)
    groups = param_group_names(build_model())
    for name, m in FIXTURE_CASES:
        fx = fixture_by_name(name)
        out = work / name
        ckptlib.export(fx["checkpoint_path"], out, format="dcp", dcp={"optimizer": True})
        jobs[m].append({"name": f"{name}@{m}", "dcp": out, "model": "fixture", "groups": groups, "step": True,
                        "mixed": "bf16" if fx["dtype"] == "bf16" else None,
                        "save": str(work / f"{name}@{m}-saved") if (name, m) in SAVED_CASES else None})
        ds_jobs[fx["world_size"]].append(job_for_fixture(fx, name=f"{name}@orig"))
    for name, m in TITAN_CASES:
        fx = fixture_by_name(name)
        out = work / f"{name}-titan"
        ckptlib.export(fx["checkpoint_path"], out, format="dcp", dcp={"optimizer": True, "layout": "torchtitan"})
        jobs[m].append({"name": f"{name}@{m}-titan", "dcp": out, "model": "fixture", "groups": groups,
                        "loader": "torchtitan"})
    for name, m in ACCELERATE_CASES:
        fx = fixture_by_name(name)
        out = work / f"{name}-accelerate"
        ckptlib.export(fx["checkpoint_path"], out, format="dcp", dcp={"optimizer": True, "layout": "accelerate"})
        jobs[m].append({"name": f"{name}@{m}-accelerate", "dcp": out, "model": "fixture", "groups": groups,
                        "loader": "accelerate"})
    for name, m in PARALLEL_CASES:
        fx = parallel_fixtures[name]
        ck = ckptlib.open_checkpoint(fx["checkpoint_path"])
        shapes = {p.name: list(p.shape) for p in ck.parameters if not p.tied_to}
        frozen = {p.name for p in ck.parameters if not p.trainable}
        buffers = {b.name: [list(b.shape), b.dtype] for b in ck.buffers}
        out = work / name
        ckptlib.export(ck, out, format="dcp", dcp={"optimizer": True})
        jobs[m].append({"name": f"{name}@{m}", "dcp": out, "model": "named", "shapes": shapes, "buffers": buffers,
                        "frozen": sorted(frozen), "groups": _groups_of(shapes, frozen)})
    results = {"saved": {j["name"]: j["save"] for js in jobs.values() for j in js if j.get("save")}}
    for world, js in sorted(jobs.items()):
        results.update(run_fsdp_loads(js, world, work / f"fsdp-w{world}"))
    for world, js in sorted(ds_jobs.items()):
        results.update(run_load_checks(js, world, work / f"ds-w{world}"))
    return results


def _exact(loaded: dict, fp32: dict, optim: dict, step: int) -> None:
    for p, want in fp32.items():
        assert torch.equal(loaded["params"][p], want), f"fp32 master {p}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"][p][key], optim[p][key]), f"{key} {p}"
        assert loaded["optim"][p]["step"] == step, f"step of {p}"
    assert set(loaded["optim"]) == set(fp32), "optimizer state for exactly the trainable parameters"


@pytest.mark.parametrize("name,m", FIXTURE_CASES, ids=[f"{n}->fsdp{m}" for n, m in FIXTURE_CASES])
def test_fsdp2_loads_masters_moments_step_groups_frozen_and_buffers_exactly(runs, fixture_by_name, name, m):
    fx = fixture_by_name(name)
    ref = reference(fx)
    got = runs[f"{name}@{m}"]
    assert "error" not in got, got.get("error")
    assert got["world_size"] == m and m != fx["world_size"]
    loaded = got["loaded"]
    _exact(loaded, ref["fp32"], ref["optim"], ref["step"])
    assert loaded["tied"] == ["head.weight"]  # still one parameter with embed.weight after the load
    for p, want in ref["frozen"].items():
        assert torch.equal(loaded["params"][p], want.float()), f"frozen {p}"
    for b, want in ref["buffers"].items():
        assert torch.equal(loaded["buffers"][b], want), f"buffer {b}"
    lrs = {tuple(sorted(g["params"])): (g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in loaded["groups"]}
    names = param_group_names(build_model())
    assert lrs == {tuple(sorted(names[0])): (1e-2, 0.01, (0.9, 0.999), 1e-8),
                   tuple(sorted(names[1])): (5e-3, 0.0, (0.9, 0.999), 1e-8)}


@pytest.mark.parametrize("name,m", FIXTURE_CASES, ids=[f"{n}->fsdp{m}" for n, m in FIXTURE_CASES])
def test_one_more_step_matches_deepspeeds_own_next_step(runs, fixture_by_name, name, m):
    fx = fixture_by_name(name)
    got, orig = runs[f"{name}@{m}"], runs[f"{name}@orig"]
    assert "error" not in got and "error" not in orig, (got.get("error"), orig.get("error"))
    after = {n: got["after_step"]["params"][n] for n in orig["after_step"]["fp32"]}
    err = continuation_error(after, orig["after_step"]["fp32"], orig["loaded"]["fp32"], fx["dtype"])
    assert err <= (FP32_ATOL if fx["dtype"] == "fp32" else HALF_RTOL), err
    assert got["after_step"]["optim"]["fc1.weight"]["step"] == orig["after_step"]["step"]


@pytest.mark.parametrize("name,m", PARALLEL_CASES, ids=[f"{n}->fsdp{m}" for n, m in PARALLEL_CASES])
def test_fsdp2_loads_pipeline_and_tensor_parallel_sources_exactly(runs, parallel_fixtures, name, m):
    fx = parallel_fixtures[name]
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    got = runs[f"{name}@{m}"]
    assert "error" not in got, got.get("error")
    shapes = {n: t.shape for n, t in got["loaded"]["params"].items()}

    def cut(name, t):  # a vocabulary tensor: the un-parallelised model has the original rows (padding cut)
        return t[:shapes[name][0]] if name in fx.get("vocab", []) and t.shape != shapes[name] else t

    params = {p: cut(p, t) for p, t in ref["params"].items()}
    optim = {p: {k: cut(p, ref["states"][k][p]) for k in ("exp_avg", "exp_avg_sq")} for p in ref["params"]}
    _exact(got["loaded"], params, optim, ref["step"])
    for b, want in ref["buffers"].items():
        assert torch.equal(got["loaded"]["buffers"][b], want), f"buffer {b}"


@pytest.mark.parametrize("name,m", TITAN_CASES, ids=[f"{n}->titan{m}" for n, m in TITAN_CASES])
def test_torchtitan_checkpoint_manager_loads_the_torchtitan_layout(runs, fixture_by_name, name, m):
    pytest.importorskip("torchtitan")
    fx = fixture_by_name(name)
    ref = reference(fx)
    got = runs[f"{name}@{m}-titan"]
    assert "error" not in got, got.get("error")
    _exact(got["loaded"], ref["fp32"], ref["optim"], ref["step"])
    assert got["titan"] == {"train_step": fx["extras"]["global_steps"], "ntokens_seen": 0,
                            "last_epoch": fx["extras"]["global_steps"]}


@pytest.mark.parametrize("name,m", ACCELERATE_CASES, ids=[f"{n}->accelerate{m}" for n, m in ACCELERATE_CASES])
def test_accelerates_fsdp2_loading_reads_the_accelerate_layout(runs, fixture_by_name, name, m):
    """Accelerate's load_fsdp_model / load_fsdp_optimizer (what Accelerator.load_state runs for FSDP; it
    cannot run FSDP on CPU itself, see tests/fixtures/fsdp_load.py) on an FSDP2 model."""
    fx = fixture_by_name(name)
    ref = reference(fx)
    got = runs[f"{name}@{m}-accelerate"]
    assert "error" not in got, got.get("error")
    _exact(got["loaded"], ref["fp32"], ref["optim"], ref["step"])


@pytest.mark.parametrize("name,m", SAVED_CASES, ids=[f"{n}->fsdp{m}-saved" for n, m in SAVED_CASES])
def test_what_fsdp2_saves_reads_back_in_ckptlib_equal_to_the_deepspeed_checkpoint(runs, fixture_by_name, tmp_path,
                                                                                 name, m):
    """The loop closed: DeepSpeed -> ckptlib's DCP -> FSDP2 at m ranks -> FSDP2's own dcp.save (each tensor in
    m row chunks) -> ckptlib reads it: every master and moment the same as the DeepSpeed checkpoint's, and
    its export to safetensors holds the checkpoint's export's bits."""
    from ckptlib.dcp import open_dcp

    fx = fixture_by_name(name)
    got = runs[f"{name}@{m}"]
    assert "error" not in got, got.get("error")
    folder = runs["saved"][f"{name}@{m}"]
    d = open_dcp(folder)
    assert d.layout == "torch" and max(len(t.entry.chunks) for t in d.tensors.values()) == m
    result = ckptlib.diff(fx["checkpoint_path"], folder, states=True)
    assert len(result.tensors) == 17 + 3 * 11 and all(t.status == "same" for t in result.tensors)  # and 11 steps
    _exports_hold_the_same_bits(folder, fx["checkpoint_path"], tmp_path)


def _exports_hold_the_same_bits(dcp_folder, checkpoint, tmp_path) -> None:
    """Both exported to safetensors: every tensor the same dtype, shape and bits (the files' order of
    tensors is each source's: FSDP2's metadata lists them in its own order)."""
    from safetensors.torch import load_file

    ckptlib.export(dcp_folder, tmp_path / "a", states=("exp_avg", "exp_avg_sq"))
    ckptlib.export(checkpoint, tmp_path / "b", states=("exp_avg", "exp_avg_sq"), hf_files=False)
    for f in ("model.safetensors", "exp_avg/model.safetensors", "exp_avg_sq/model.safetensors"):
        a, b = load_file(tmp_path / "a" / f), load_file(tmp_path / "b" / f)
        assert sorted(a) == sorted(b), f
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (f, k)
            assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), (f, k)
