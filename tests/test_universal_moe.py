"""DeepSpeed-MoE universal folders (ckptlib's: ds_to_universal 0.19.8 cannot convert these checkpoints) back to native
files (issue 32): the round trip native -> universal (written for expert-parallel size 1 or 2) -> native at any data-
and expert-parallel size is the native reshard of the original, object for object and bit for bit (the 16-bit expert
files made from the masters included), and DeepSpeed loads it natively with the reference's masters, moments,
16-bit weights and step.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptlib
from tests.fixtures.compare import assert_holds_the_reference
from tests.test_universal_source import _walk

#: (source, expert-parallel size the universal folder is written for)
FOLDERS = [("moe_ep2_z1_bf16", 1), ("moe_ep2_z1_bf16", 2), ("moe_ep1_z2_bf16", 2), ("moe_ep2_z2_bf16", 1)]
#: (world, ep) each folder goes back to
MESHES = [(2, 2), (2, 1), (4, 2), (4, 4)]
#: DeepSpeed loads: case -> (folder, world, ep); one launch per (ep, world)
LOADS = {"ep2z1-u1->w2ep2": (("moe_ep2_z1_bf16", 1), 2, 2), "ep1z2-u2->w2ep2": (("moe_ep1_z2_bf16", 2), 2, 2),
         "ep2z2-u1->w2ep1": (("moe_ep2_z2_bf16", 1), 2, 1)}


@pytest.fixture(scope="module")
def moe_universal(parallel_fixtures, tmp_path_factory):
    """``{(source, ep): (fixture, universal tag folder)}``."""
    root = tmp_path_factory.mktemp("umoe")
    out = {}
    for name, ep in FOLDERS:
        fx = parallel_fixtures[name]
        res = ckptlib.write_universal(fx["checkpoint_path"], root / f"{name}-ep{ep}", ep=ep)
        out[(name, ep)] = (fx, Path(res.out) / f"{fx['tag']}_universal")
    return out


@pytest.mark.parametrize("key", FOLDERS, ids=[f"{n}-u{e}" for n, e in FOLDERS])
def test_the_round_trip_is_the_native_reshard(moe_universal, tmp_path, key):
    fx, folder = moe_universal[key]
    for world, ep in MESHES:
        where = tmp_path / f"w{world}ep{ep}"
        native = Path(ckptlib.reshard(fx["checkpoint_path"], where / "native", world, ep=ep).out) / fx["tag"]
        plan = ckptlib.plan_reshard(folder, where / "mine", world, ep=ep)
        mine = Path(ckptlib.reshard(plan).out) / fx["tag"]
        assert ckptlib.verify(plan).ok, ckptlib.verify(plan).describe()
        names = sorted(p.name for p in native.iterdir())
        assert sorted(p.name for p in mine.iterdir()) == names
        assert any(n.startswith("layer_0_expert_") for n in names)  # the 16-bit expert files, made from the masters
        diffs: list = []
        for f in names:
            _walk(torch.load(native / f, weights_only=False), torch.load(mine / f, weights_only=False), f, diffs)
        assert diffs == [], ((world, ep), diffs[:5])


def test_the_default_expert_parallel_size_is_the_sources(moe_universal, tmp_path):
    fx, folder = moe_universal[("moe_ep2_z1_bf16", 1)]
    plan = ckptlib.plan_reshard(folder, tmp_path / "out")
    assert (plan.to_mesh.dp, plan.to_mesh.ep) == (fx["dp"], fx["ep"]) == (2, 2)


@pytest.fixture(scope="module")
def moe_loads(moe_universal, tmp_path_factory):
    from tests.fixtures.mesh.check import mesh_job, run_mesh_loads

    work = tmp_path_factory.mktemp("umoe-load")
    jobs: dict = {}
    outs = {}
    for case, (key, world, ep) in LOADS.items():
        fx, folder = moe_universal[key]
        outs[case] = ckptlib.reshard(folder, work / case, world, ep=ep).out
        job, w = mesh_job(fx["path"], ep=ep, dp=world, checkpoint_dir=outs[case], name=case,
                          save_to=work / f"{case}-saved")
        jobs.setdefault((ep, w), []).append(job)
    results = {}
    for (ep, world), js in sorted(jobs.items()):  # DeepSpeed's expert groups are process-global: one ep a launch
        results.update(run_mesh_loads(js, world, work / f"ep{ep}-w{world}"))
    return results, outs


@pytest.mark.parametrize("case", LOADS)
def test_deepspeed_loads_them_natively_with_the_references_values(moe_universal, moe_loads, case):
    results, outs = moe_loads
    key, world, ep = LOADS[case]
    fx = moe_universal[key][0]
    res = results[case]
    assert "error" not in res, res.get("error")
    assert res["mesh"] == {"pp": 1, "tp": 1, "dp": world, "ep": ep}
    assert_holds_the_reference(res["loaded"], fx, buffers=True)  # its buffer is in the copied model-states file
    assert sorted(p.name for p in (Path(outs[case]) / fx["tag"]).iterdir()) == sorted(res["saved_files"])
