"""Pipeline x tensor x data (3D) checkpoints written by DeepSpeed itself (tests/fixtures/mesh): read as one mesh
(inspect, export and --states are covered with every parallel fixture in tests/test_parallel.py), checked
healthy, a corrupted copy found, refused without split rules and exact with them, their universal checkpoint
loaded by DeepSpeed exactly, and broken 3D inputs named by file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptlib
from tests.cli import run_cli as _cli

THREE_D = ["pp2_tp2_dp1_z1_bf16", "pp2_tp2_dp1_z1_bf16_noinfo", "pp2_tp2_dp1_z0_fp32", "pp2_tp2_dp1_z0_fp32_noinfo",
           "pp2_tp2_dp2_z1_bf16", "pp2_tp2_dp2_z1_bf16_noinfo"]


def _rules(fx) -> list:
    p = fx["path"] / "tp_rules.json"
    return ["--tp-rules", p] if p.is_file() else []


@pytest.mark.parametrize("name", THREE_D)
def test_check_finds_a_3d_checkpoint_healthy(parallel_fixtures, name):
    fx = parallel_fixtures[name]
    code, out, err = _cli("check", fx["checkpoint_path"], "--states", "--json", *_rules(fx))
    assert code == 0, out[-2000:] + err
    d = json.loads(out)
    assert d["problems"] == []
    names = {t["name"] for t in d["tensors"]}
    assert "tied_modules.embed.weight" in names and "exp_avg/1.fc2.weight" in names


@pytest.mark.parametrize("name", ["pp2_tp2_dp1_z1_bf16_noinfo", "pp2_tp2_dp1_z0_fp32_noinfo"])
def test_without_rules_a_3d_checkpoint_is_refused_naming_tp_rules(parallel_fixtures, tmp_path, name):
    fx = parallel_fixtures[name]
    code, out, err = _cli("inspect", fx["checkpoint_path"])
    assert code == 0 and "--tp-rules" in out and "pp=2 tp=2" in out.replace("dp=1 ", ""), out
    assert "restore" not in out  # nothing is damaged: a name is missing, not a file
    code, out, err = _cli("export", fx["checkpoint_path"], tmp_path / "o")
    assert code == 2 and "--tp-rules" in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["tied copy on stage 1", "replica on tensor rank 1"])
def test_a_corrupted_copy_is_found(parallel_fixtures, tmp_path, where):
    """The tied weight's copy on the second stage, or a LayerNorm's replica on tensor rank 1, damaged in one
    byte of its fp32 master: check names it (exit 1), export and reshard refuse before writing anything."""
    fx = parallel_fixtures["pp2_tp2_dp2_z1_bf16"]
    d = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], d)
    with ckptlib.open_checkpoint(d) as ck:
        mp = 2 if where.startswith("tied") else 1        # stage 1 tensor rank 0 / stage 0 tensor rank 1
        name = "tied_modules.embed.weight" if where.startswith("tied") else "1.ln.weight"
        r = ck.sets[mp].sources(name)[-1]
    with open(r.path, "r+b") as f:
        f.seek(r.offset + r.nbytes - 2)
        b = f.read(1)
        f.seek(r.offset + r.nbytes - 2)
        f.write(bytes([b[0] ^ 0x40]))
    code, out, err = _cli("check", d)
    assert code == 1 and name in out, out[-3000:]
    # the problem names the damaged file (windows span files; the one with the finding is split by file)
    assert any(l.startswith(f"PROBLEM {name} (") and Path(r.path).name in l and "differs" in l
               for l in out.splitlines()), out[-3000:]
    for cmd in (["export", d, tmp_path / "o"], ["reshard", d, tmp_path / "o", "--tp", "1"]):
        code, out, err = _cli(*cmd)
        assert code == 2 and name in err and "Traceback" not in err, (cmd[0], err)
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["missing layer file of one tensor rank", "missing mp_rank file"])
def test_broken_3d_inputs_name_the_file(parallel_fixtures, tmp_path, case):
    fx = parallel_fixtures["pp2_tp2_dp1_z1_bf16"]
    d = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], d)
    tag = d / fx["tag"]
    if case.startswith("missing layer"):
        (tag / "layer_02-model_01-model_states.pt").unlink()
        words = ["layer_02-model_01-model_states.pt", "tensor rank 1"]
    else:
        (tag / "mp_rank_03_model_states.pt").unlink()
        words = ["mp_rank_03_model_states.pt"]
    for cmd in (["inspect", d], ["export", d, tmp_path / "out"], ["reshard", d, tmp_path / "out", "--tp", "1"]):
        code, out, err = _cli(*cmd)
        text = out if cmd[0] == "inspect" else err
        assert code == (1 if cmd[0] == "inspect" else 2), (cmd[0], out, err)
        assert "Traceback" not in out + err
        for w in words:
            assert w in text, (cmd[0], w, text[-2000:])
    assert not (tmp_path / "out").exists()


def test_universal_of_3d_loads_exactly_at_its_own_and_another_mesh(parallel_fixtures, tmp_path):
    """ckptlib's universal checkpoint of a 3D run: DeepSpeed's load_universal at pp2 x tp2 (its own mesh) and
    at pp1 x tp1 holds the live engine's masters, moments and step bit for bit (buffers: the universal loader
    does not restore them, as for any pipeline)."""
    from tests.fixtures.mesh.check import mesh_job, run_mesh_loads

    fx = parallel_fixtures["pp2_tp2_dp1_z1_bf16"]
    uni = tmp_path / "uni"
    ckptlib.write_universal(fx["checkpoint_path"], uni)
    jobs: dict = {}
    for name, mesh in (("own", {}), ("pp1tp1", {"pp": 1, "tp": 1, "dp": 1})):
        job, world = mesh_job(fx["path"], checkpoint_dir=uni, universal=True, name=name, **mesh)
        jobs.setdefault(world, []).append(job)
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    for world, js in jobs.items():
        for name, res in run_mesh_loads(js, world, tmp_path / f"w{world}").items():
            assert "error" not in res, (name, res.get("error"))
            got = res["loaded"]
            for n, want in ref["params"].items():
                assert torch.equal(got["params"][n], want), (name, n)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(got["states"][key][n], ref["states"][key][n]), (name, key, n)
            assert got["step"] == ref["step"]


@pytest.mark.parametrize("name", ["pp2_tp2_dp1_z1_bf16", "pp2_tp2_dp2_z1_bf16", "pp2_tp2_dp1_z0_fp32"])
def test_dcp_export_with_the_optimizer_holds_the_live_engines_masters_and_moments(parallel_fixtures, tmp_path, name):
    """A DCP export of a 3D checkpoint, read back by torch's own DCP reader: the full masters and moments
    (every stage's and tensor rank's optimizer state joined) and the step."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fx = parallel_fixtures[name]
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    out = tmp_path / "dcp"
    ckptlib.export(fx["checkpoint_path"], out, format="dcp", dcp={"optimizer": True})
    dcp_to_torch_save(out, tmp_path / "dcp.pt")
    sd = torch.load(tmp_path / "dcp.pt", weights_only=False)
    assert set(ref["params"]) <= set(sd["model"])
    for n, want in ref["params"].items():
        assert torch.equal(sd["model"][n], want), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["optimizer"]["state"][n][key], ref["states"][key][n]), (n, key)
        assert sd["optimizer"]["state"][n]["step"].item() == ref["step"], n
