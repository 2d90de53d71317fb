"""AutoEP checkpoints (DeepSpeed 0.19.8, expert parallelism for Hugging Face MoE models: Mixtral, Qwen3-MoE and
OLMoE presets; tests/fixtures/autoep) through ckptlib, against the live engines' references:

- ZeRO-2 (per-expert files) and ZeRO-3 ("zero3_partitioned": sub-groups partitioned over different rank sets):
  inspect (experts per ep rank, the router alias, no false problem), every AutoEP tensor read exactly (each expert
  weight stacked from its expert-parallel ranks), the export in the layout of the model's class that
  ``from_pretrained`` of that class loads as is (weights and ``--states`` equal to the live engine's masters under
  HF's names), refused without a model config; check and diff; the DCP model export;
- reshards to another data-parallel and expert-parallel size (ZeRO-2 and ZeRO-3: ep 2 -> 1, 2 -> 4, dp 2 <-> 4)
  that DeepSpeed's AutoEP engine loads with every master, moment, 16-bit weight and the step bit for bit, and one
  more step within the reshard tolerance; universal checkpoints DeepSpeed's loader restores at any ep size; what
  cannot be (a tensor axis, an ep size that does not divide) refused.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import ckptlib
from tests.fixtures.autoep import common as C

NAMES = [s.name for s in C.all_specs()]




def assert_loaded_exactly(loaded: dict, ref: dict) -> None:
    """What DeepSpeed's AutoEP engine holds after a load (the harness's ``loaded``) is the reference, bit for bit:
    masters, Adam's moments, 16-bit weights and step."""
    for n, want in ref["params"].items():
        assert torch.equal(loaded["params"][n], want), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["states"][key][n], ref["states"][key][n]), (key, n)
    for n, want in ref["module16"].items():
        assert torch.equal(loaded["module16"][n], want), n
    assert loaded["step"] == ref["step"] and not loaded["problems"], loaded["problems"]


def _ref(fx: dict) -> dict:
    return torch.load(fx["path"] / "reference.pt", map_location="cpu", weights_only=False)


@pytest.mark.parametrize("name", NAMES)
def test_inspect_and_read_every_autoep_tensor_exactly(autoep_fixtures, name):
    fx = autoep_fixtures[name]
    ref = _ref(fx)
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        assert ck.problems == [] and ck.mesh.ep == fx["ep_size"] and ck.mesh.dp == fx["world_size"]
        d = ckptlib.describe(ck)
        assert d["problems"] == []
        names = {p.name for p in ck.parameters if not p.tied_to}
        assert names == set(ref["params"]), sorted(names ^ set(ref["params"]))
        for n, want in ref["params"].items():
            assert torch.equal(ck.read_param(n), want), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ck.read_state(n, key), ref["states"][key][n]), (key, n)
        aliases = {p.name: p.tied_to for p in ck.parameters if p.tied_to}
        assert aliases == {f"model.layers.{i}.mlp.gate.gate.weight": f"model.layers.{i}.mlp.router.gate.weight"
                           for i in range(2)}
        assert ck.view.full_shape("model.layers.0.mlp.experts.w1")[0] == 4
        assert [lay.checkpoint_format for lay in ck.records.autoep_layers] == \
            ["zero3_partitioned" if fx["zero_stage"] == 3 else "per_expert_files"] * 2


def _export(fx, out, **kw) -> ckptlib.ExportPlan:
    plan = ckptlib.plan_export(fx["checkpoint_path"], out, model_config=fx["path"] / "hf_config", **kw)
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    return plan


@pytest.mark.parametrize("name", NAMES)
def test_the_export_loads_with_from_pretrained_of_the_class_with_the_live_engines_masters(autoep_fixtures, tmp_path,
                                                                                          name):
    import transformers
    from safetensors.torch import load_file

    fx = autoep_fixtures[name]
    ref = _ref(fx)
    plan = _export(fx, tmp_path / "out", states=["all"])
    assert any("gate_up_proj = cat(w1, w3)" in n for n in plan.notes)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(ref["hf"]["params"])
    for n, want in ref["hf"]["params"].items():
        assert torch.equal(got[n], want), n
    for key in ("exp_avg", "exp_avg_sq"):
        states = load_file(tmp_path / "out" / key / "model.safetensors")
        for n, want in ref["hf"]["states"][key].items():
            assert torch.equal(states[n], want), (key, n)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == json.loads((fx["path"] / "hf_config" / "config.json").read_text())["model_type"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(model).__name__ == fx["model_class"]
    sd = model.state_dict()
    assert sorted(sd) == sorted(ref["hf"]["params"])
    for n, want in ref["hf"]["params"].items():
        assert torch.equal(sd[n], want), n


def test_the_export_asks_for_the_model_config_and_refuses_another_models(autoep_fixtures, tmp_path):
    fx = autoep_fixtures["qwen3_moe_z2_w2_ep2"]
    with pytest.raises(ckptlib.CkptError, match="records no model class") as e:
        ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out")
    assert "--model-config" in e.value.hint
    other = json.loads((fx["path"] / "hf_config" / "config.json").read_text())
    with pytest.raises(ckptlib.CkptError, match="model_type is 'llama'"):
        ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out", model_config=dict(other, model_type="llama"))
    with pytest.raises(ckptlib.CkptError, match="has 8 experts per layer"):
        ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out", model_config=dict(other, num_experts=8))
    assert not (tmp_path / "out").exists()
    beside = tmp_path / "beside"  # a config.json beside the checkpoint is taken as the model's
    shutil.copytree(fx["checkpoint_path"], beside)
    shutil.copy(fx["path"] / "hf_config" / "config.json", beside / "config.json")
    plan = ckptlib.plan_export(beside, tmp_path / "out2")
    assert any("config from beside the checkpoint" in n for n in plan.notes)


def test_the_cli_exports_an_autoep_checkpoint(autoep_fixtures, tmp_path):
    from tests.cli import run_cli

    fx = autoep_fixtures["olmoe_z2_w2_ep2"]
    code, out, err = run_cli("export", fx["checkpoint_path"], tmp_path / "out", "--model-config",
                             fx["path"] / "hf_config" / "config.json")
    assert code == 0, err
    assert "OlmoeForCausalLM" in out + err
    code, out, err = run_cli("inspect", fx["checkpoint_path"])
    assert code == 0 and "AutoEP" in out and "expert parallel 2" in out, out


#: (fixture, target world, target ep): ep 2 -> 1, data-parallel changes, ep 2 -> 4
RESHARDS = [("mixtral_z2_w2_ep2", 2, 1), ("mixtral_z2_w2_ep2", 4, 2), ("mixtral_z2_w4_ep2", 2, 2),
            ("mixtral_z2_w4_ep2", 4, 4), ("qwen3_moe_z2_w2_ep2", 2, 1), ("olmoe_z2_w2_ep2", 4, 2),
            ("mixtral_z3_w2_ep2", 4, 2), ("mixtral_z3_w4_ep2", 2, 1), ("qwen3_moe_z3_w2_ep2", 2, 1),
            ("olmoe_z3_w2_ep2", 4, 4)]
#: (fixture, world, ep) loading ckptlib's universal checkpoint (``load_universal``)
UNIVERSALS = [("mixtral_z2_w2_ep2", 4, 4), ("qwen3_moe_z2_w2_ep2", 2, 1), ("mixtral_z3_w4_ep2", 2, 2),
              ("olmoe_z3_w2_ep2", 4, 2)]


@pytest.fixture(scope="module")
def loads(autoep_fixtures, tmp_path_factory):
    """Every reshard above loaded by DeepSpeed's AutoEP engine at its new size, and each source at its own."""
    from collections import defaultdict

    from tests.fixtures.autoep.load_check import job_for_fixture, run_load_checks

    work = tmp_path_factory.mktemp("autoep-loads")
    jobs = defaultdict(list)
    for name in sorted({n for n, _, _ in RESHARDS}):
        fx = autoep_fixtures[name]
        jobs[fx["world_size"]].append(job_for_fixture(fx, name=f"{name}@orig"))
    for name, world, ep in RESHARDS:
        fx = autoep_fixtures[name]
        out = work / f"{name}-w{world}-ep{ep}"
        plan = ckptlib.plan_reshard(fx["checkpoint_path"], out, world, ep=ep)
        ckptlib.run(plan)
        assert ckptlib.verify(plan).ok, ckptlib.verify(plan).describe()
        jobs[world].append(job_for_fixture(fx, checkpoint_dir=out, name=f"{name}->w{world}ep{ep}", ep_size=ep))
    for name, world, ep in UNIVERSALS:
        fx = autoep_fixtures[name]
        out = work / f"{name}-universal"
        if not out.exists():
            plan = ckptlib.plan_universal(fx["checkpoint_path"], out)
            ckptlib.run(plan)
            assert ckptlib.verify(plan).ok, ckptlib.verify(plan).describe()
        # a launch of its own: run after the other jobs of a shared launch, these loads timed out here (not
        # investigated further; each alone loads in seconds)
        alone = job_for_fixture(fx, checkpoint_dir=out, name=f"{name}->universal-w{world}ep{ep}", ep_size=ep,
                                universal=True)
        jobs[(world, alone["name"])].append(alone)
    results = {}
    for key, js in sorted(jobs.items(), key=lambda kv: str(kv[0])):
        world = key[0] if isinstance(key, tuple) else key
        results.update(run_load_checks(js, world, work / f"w{world}", timeout=300))
    return results


@pytest.mark.parametrize("name,world,ep", RESHARDS, ids=[f"{n}->w{w}ep{e}" for n, w, e in RESHARDS])
def test_deepspeeds_autoep_engine_loads_the_reshard_exactly(loads, autoep_fixtures, name, world, ep):
    from tests.fixtures.compare import HALF_RTOL, continuation_error

    fx = autoep_fixtures[name]
    got, orig = loads[f"{name}->w{world}ep{ep}"], loads[f"{name}@orig"]
    assert "error" not in got, got.get("error")
    assert "error" not in orig, orig.get("error")
    assert got["world_size"] == world and got["ep_size"] == ep
    assert_loaded_exactly(got["loaded"], _ref(fx))
    err = continuation_error(got["after_step"]["params"], orig["after_step"]["params"], orig["loaded"]["params"],
                             "bf16")
    assert err <= HALF_RTOL, err


def test_what_an_autoep_reshard_cannot_do_is_refused_with_what_works(autoep_fixtures, tmp_path):
    from tests.cli import assert_refused, run_cli

    fx = autoep_fixtures["mixtral_z2_w2_ep2"]
    code, out, err = run_cli("reshard", fx["checkpoint_path"], tmp_path / "out", "--world-size", "4", "--tp", "2")
    assert_refused(code, out, err, ["no tensor"], tmp_path / "out")
    code, out, err = run_cli("reshard", fx["checkpoint_path"], tmp_path / "out", "--world-size", "3")
    assert_refused(code, out, err, ["must divide the 4 experts and the world of 3 ranks"], tmp_path / "out")


@pytest.mark.parametrize("name,world,ep", UNIVERSALS, ids=[f"{n}->universal-w{w}ep{e}" for n, w, e in UNIVERSALS])
def test_deepspeeds_universal_loader_restores_ckptlibs_universal_autoep_checkpoint_exactly(loads, autoep_fixtures, name,
                                                                                          world, ep):
    fx = autoep_fixtures[name]
    got = loads[f"{name}->universal-w{world}ep{ep}"]
    assert "error" not in got, got.get("error")
    assert got["world_size"] == world and got["ep_size"] == ep
    ref = _ref(fx)
    for n, want in ref["params"].items():
        assert torch.equal(got["loaded"]["params"][n], want), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["loaded"]["states"][key][n], ref["states"][key][n]), (key, n)
    assert got["loaded"]["step"] == ref["step"]


@pytest.mark.parametrize("name", ["mixtral_z2_w4_ep2", "qwen3_moe_z2_w2_ep2", "mixtral_z3_w4_ep2", "olmoe_z3_w2_ep2"])
def test_check_and_diff(autoep_fixtures, tmp_path, name):
    fx = autoep_fixtures[name]
    result = ckptlib.check(fx["checkpoint_path"], states=True)
    assert result.problems == [], [str(p) for p in result.problems]
    _export(fx, tmp_path / "out")
    d = ckptlib.diff(fx["checkpoint_path"], fx["checkpoint_path"], states=True)
    assert d.ok and d.counts["same"] == len(d.tensors)


@pytest.mark.parametrize("name", ["mixtral_z2_w2_ep2", "qwen3_moe_z3_w2_ep2"])
def test_the_dcp_model_export_holds_the_hf_names(autoep_fixtures, tmp_path, name):
    import torch.distributed.checkpoint as dcp

    fx = autoep_fixtures[name]
    ref = _ref(fx)
    plan = ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "dcp", format="dcp",
                               model_config=fx["path"] / "hf_config")
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    sd = {"model": {n: torch.empty_like(t) for n, t in ref["hf"]["params"].items()}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    for n, want in ref["hf"]["params"].items():
        assert torch.equal(sd["model"][n], want), n
