"""Pipeline and tensor-parallel checkpoints resharded to another data-parallel size (stages and tensor ranks
kept), loaded by DeepSpeed itself at the new size: exact masters, moments and step, and one more training step
like DeepSpeed resuming the original at its own size. Also their universal checkpoints, loaded at another size.

Every load is a real ``engine.load_checkpoint`` under torchrun (tests/fixtures/parallel/load_check.py and
tests/fixtures/hf_parallel/load_check.py); the jobs of one world size share one launch.
"""
from __future__ import annotations

import pytest
import torch

import ckptlib

PIPELINE = ["pp2_dp2_z1_fp32", "pp2_dp2_z1_bf16", "pp2_dp2_bf16opt", "pp2_dp1_z1_fp32", "pp2_dp1_z1_bf16",
            "pp2_dp1_bf16opt"]
TENSOR = ["tp2_dp2_z1_fp32", "tp2_dp2_z1_bf16", "tp2_dp2_z2_fp32", "tp2_dp2_z2_bf16", "tp2_dp2_bf16opt",
          "tp2_dp2_z1_bf16_noinfo"]
AUTOTP = ["autotp_tp2_dp2_z1_bf16", "autotp_tp2_dp2_z2_bf16", "autotp_tp2_dp2_z3_bf16", "autotp_tp2_dp2_z2_fp32",
          "autotp_tp2_dp2_z3_bf16_tied", "autotp_tp2_dp1_z1_bf16", "autotp_tp2_dp1_z2_bf16", "autotp_tp2_dp1_z3_bf16",
          "autotp_tp2_dp1_z2_fp32", "autotp_tp2_dp1_z2_bf16_tied"]
UNIVERSAL = ["pp2_dp2_z1_fp32", "pp2_dp1_z1_bf16", "tp2_dp2_z1_bf16", "tp2_dp2_z2_fp32", "autotp_tp2_dp2_z2_bf16",
             "autotp_tp2_dp1_z3_bf16"]


def _target(fx) -> int:
    return 1 if fx["dp"] == 2 else 2


@pytest.fixture(scope="module")
def loads(parallel_fixtures, tmp_path_factory):
    """Reshard / universal outputs of every case, then DeepSpeed's loads of them and of the originals."""
    from tests.fixtures.hf_parallel.load_check import run_load_checks as hf_run
    from tests.fixtures.parallel.check import make_job, run_load_checks

    work = tmp_path_factory.mktemp("parallel-reshard")
    par_jobs: dict[int, list] = {}
    hf_jobs: dict[int, list] = {}
    for name in PIPELINE + TENSOR + AUTOTP:
        fx = parallel_fixtures[name]
        rules = fx["path"] / "tp_rules.json" if (fx["path"] / "tp_rules.json").is_file() else None
        m = _target(fx)
        jobs = []
        out = work / f"{name}-dp{m}"
        ckptlib.reshard(fx["checkpoint_path"], out, m, tp_rules=rules)
        jobs.append((f"{name}/reshard", m, out, False))
        if name in UNIVERSAL:
            uni = work / f"{name}-universal"
            ckptlib.write_universal(fx["checkpoint_path"], uni, tp_rules=rules)
            jobs.append((f"{name}/universal", m, uni, True))
        jobs.append((f"{name}/original", fx["dp"], None, False))
        for job_name, dp, ckpt, universal in jobs:
            if fx["kind"] == "autotp":
                job = {"name": job_name, "fixture_dir": str(fx["path"]), "universal": universal}
                if ckpt is not None:
                    job["checkpoint_dir"] = str(ckpt)
                hf_jobs.setdefault(fx["tp"] * dp, []).append(job)
            else:
                job, world = make_job(fx["path"], dp=dp, checkpoint_dir=ckpt, universal=universal, name=job_name)
                par_jobs.setdefault(world, []).append(job)
    results = {}
    for world, jobs in par_jobs.items():
        results.update(run_load_checks(jobs, world, work / f"par-w{world}"))
    for world, jobs in hf_jobs.items():
        results.update(hf_run(jobs, world, work / f"hf-w{world}"))
    return results


def _bits(t):
    t = t.contiguous().reshape(-1)
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype)) \
        if t.is_floating_point() else t


def _same(a, b, rows=None) -> bool:
    if rows is not None:
        a, b = a[:rows], b[:rows]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _vocab_rows(fx, name):
    info = fx.get("vocab_info") or {}
    return info.get("original_vocab_size") if name in (fx.get("vocab") or []) else None


def check_loaded(fx, res, universal: bool) -> None:
    assert "error" not in res, res.get("error")
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    got = res["loaded"]
    for name, want in ref["params"].items():
        # a universal load pads a vocabulary's padding rows with zeros (DeepSpeed's loader; those rows are
        # never read by the model), so only the real rows can match there
        rows = _vocab_rows(fx, name) if universal else None
        assert _same(got["params"][name], want, rows), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same(got["states"][key][name], ref["states"][key][name], rows), (key, name)
    assert got["step"] == ref["step"]
    if not universal:  # a direct reshard carries the 16-bit weights and buffers over byte for byte
        for name, want in ref["module16"].items():
            assert _same(got["module16"][name], want), name
        for name, want in (ref.get("buffers") or {}).items():
            assert _same(got["buffers"][name], want), name


def check_continuation(fx, res, base, universal: bool) -> None:
    """One more step after loading at M against DeepSpeed resuming the original at N (the same global batch):
    fp32 max |diff| <= 1e-6; 16-bit per parameter ||diff|| / ||update|| <= 0.05."""
    after, want, start = res["after_step"]["params"], base["after_step"]["params"], base["loaded"]["params"]
    for name in want:
        rows = _vocab_rows(fx, name) if universal else None
        a, b, s = (t[:rows] if rows else t for t in (after[name], want[name], start[name]))
        if fx["dtype"] == "fp32":
            assert float((a - b).abs().max()) <= 1e-6, name
        else:
            update = float((b.double() - s.double()).norm())
            assert float((a.double() - b.double()).norm()) <= 0.05 * max(update, 1e-12), name


@pytest.mark.parametrize("name", PIPELINE + TENSOR + AUTOTP)
def test_resharded_checkpoint_loads_exactly_and_trains_on(loads, parallel_fixtures, name):
    fx = parallel_fixtures[name]
    res, base = loads[f"{name}/reshard"], loads[f"{name}/original"]
    check_loaded(fx, res, universal=False)
    check_loaded(fx, base, universal=False)  # the control: the original at its own size
    check_continuation(fx, res, base, universal=False)


@pytest.mark.parametrize("name", UNIVERSAL)
def test_universal_checkpoint_loads_at_another_size(loads, parallel_fixtures, name):
    fx = parallel_fixtures[name]
    res, base = loads[f"{name}/universal"], loads[f"{name}/original"]
    check_loaded(fx, res, universal=True)
    if fx["zero_stage"] != 3:  # DeepSpeed 0.19.8's ZeRO-3 universal load makes both param groups share one
        check_continuation(fx, res, base, universal=True)  # step tensor (Adam's step 2 -> 4): not comparable


def test_the_continuation_check_can_fail(loads, parallel_fixtures):
    """The tolerance is far below what a wrong state gives: the original's own step against a shifted copy."""
    fx = parallel_fixtures["pp2_dp2_z1_bf16"]
    base = loads["pp2_dp2_z1_bf16/original"]
    wrong = {"after_step": {"params": {n: torch.roll(t, 1) for n, t in base["after_step"]["params"].items()}}}
    with pytest.raises(AssertionError):
        check_continuation(fx, wrong, base, universal=False)


def test_moe_and_zero0_pipeline_reshards_are_refused_clearly(parallel_fixtures, tmp_path):
    """MoE reshards (tests/test_mesh_reshard.py) keep the expert-parallel size unless told: one rank cannot hold
    two expert-parallel ranks; ZeRO-0 MoE is not resharded; ZeRO-0 pipelines need none (fp32) or cannot load
    (bf16)."""
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="2 expert-parallel ranks must divide"):
        ckptlib.plan_reshard(parallel_fixtures["moe_ep2_z1_bf16"]["checkpoint_path"], tmp_path / "o", 1)
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="mixture-of-experts checkpoint at ZeRO-0"):
        ckptlib.plan_reshard(parallel_fixtures["moe_ep2_z0_fp32"]["checkpoint_path"], tmp_path / "o", 4)
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="KeyError: 0"):
        ckptlib.plan_reshard(parallel_fixtures["pp2_dp2_z0_bf16"]["checkpoint_path"], tmp_path / "o", 1)
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="no ZeRO partitioning"):
        ckptlib.plan_reshard(parallel_fixtures["pp2_dp2_z0_fp32"]["checkpoint_path"], tmp_path / "o", 1)
