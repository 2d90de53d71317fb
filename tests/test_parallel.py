"""Pipeline-, tensor- and expert-parallel checkpoints written by DeepSpeed itself (tests/fixtures/parallel,
tests/fixtures/hf_parallel): inspect shows the mesh, export gives the full model bit for bit (masters,
moments, buffers) under the un-parallelised model's names, and broken meshes give one clear message."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlib

ROOT = Path(__file__).resolve().parents[1]


def _names():
    from tests.fixtures.hf_parallel.common import all_specs as hf_specs
    from tests.fixtures.mesh.generate import all_specs as mesh_specs
    from tests.fixtures.parallel.generate import all_specs as par_specs

    return [s.name for s in par_specs()] + [s.name for s in hf_specs()] + [s.name for s in mesh_specs()]


def pytest_generate_tests(metafunc):  # noqa: D103 - parametrise by fixture name, known without generating
    if "pfx" in metafunc.fixturenames:
        names = _names()
        only = getattr(metafunc.function, "only", None)
        metafunc.parametrize("pfx", [n for n in names if only is None or only(n)], indirect=True)


@pytest.fixture
def pfx(request, parallel_fixtures):
    return parallel_fixtures[request.param]


def only(pred):
    def deco(fn):
        fn.only = pred
        return fn
    return deco


def rules_of(fx) -> Path | None:
    p = fx["path"] / "tp_rules.json"
    return p if p.is_file() else None


def open_fx(fx):
    return ckptlib.open_checkpoint(fx["checkpoint_path"], tp_rules=rules_of(fx))


def _cut(want, got_shape):
    """A vocabulary tensor the export cut to its original rows (Megatron padding)."""
    return want[:got_shape[0]] if tuple(want.shape) != tuple(got_shape) else want


def _cli(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True, cwd=cwd)
    return r.returncode, r.stdout, r.stderr


# ============================================================================================ inspect
def test_inspect_shows_the_mesh(pfx):
    fx = pfx
    code, out, err = _cli("inspect", fx["checkpoint_path"], "--json",
                          *(["--tp-rules", rules_of(fx)] if rules_of(fx) else []))
    assert code == 0, out + err
    d = json.loads(out)
    kind = {"pipeline": "pipeline", "tensor_parallel": "tensor_parallel", "autotp": "tensor_parallel",
            "moe": "data_parallel", "ulysses": "data_parallel", "pipe_tp": "pipeline"}[fx["kind"]]
    if fx["kind"] == "tensor_parallel" and fx["tp"] == 1:
        kind = "data_parallel"  # one tensor rank: nothing is split
    assert d["parallelism"] == kind and d["problems"] == []
    assert d["pp_world_size"] == fx.get("pp", 1) and d["tp_world_size"] == fx.get("tp", 1)
    assert d["dp_world_size"] == fx["dp"] and d["sp_world_size"] == fx.get("sp", 1)
    assert d["ep_world_size"] == fx.get("ep", 1)
    if fx["kind"] == "moe":
        assert d["num_experts"] == [4]
    assert {f["path"].split("/")[-1] for f in d["files"]} == set(fx["tag_files"])
    for f in d["files"]:
        assert set(f) >= {"stage", "tp_rank", "dp_rank", "expert"}
        if fx["kind"] == "pipeline" and f["kind"] in ("model_states", "optim_states"):
            assert f["stage"] == f["mp_rank"] and f["tp_rank"] is None
        if fx["kind"] in ("tensor_parallel", "autotp") and fx["tp"] > 1 and f["kind"] in ("model_states", "optim_states"):
            assert f["tp_rank"] == f["mp_rank"] and f["stage"] is None
        if fx["kind"] == "pipe_tp" and f["kind"] in ("model_states", "optim_states"):  # mp = stage x tp + tensor rank
            assert (f["stage"], f["tp_rank"]) == divmod(f["mp_rank"], fx["tp"])
        if fx["kind"] == "pipe_tp" and f["kind"] == "layer_states":  # layer_XX-model_YY: the stage holding layer XX
            assert f["tp_rank"] == f["mp_rank"]
            assert f["stage"] == next(s for s in range(fx["pp"]) if fx["pipeline_parts"][s] <= f["layer"]
                                      < fx["pipeline_parts"][s + 1])
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    assert set(ref["params"]) <= {p["name"] for p in d["parameters"]}
    shapes = {p["name"]: p["shape"] for p in d["parameters"]}
    vocab = (fx.get("vocab_info") or {}).get("original_vocab_size")
    for name, want in ref["params"].items():
        expect = list(want.shape)
        if vocab and name in fx.get("vocab", []) and fx["tp"] > 1:
            expect[0] = vocab  # the export's shape: padding rows cut (Megatron's padded vocabulary)
        assert shapes[name] == expect, name
    if fx["kind"] in ("tensor_parallel", "pipe_tp") and fx["tp"] > 1:
        assert sorted(d["replicated"]) == sorted(fx["replicated"])
    elif fx["kind"] == "autotp":
        assert sorted(d["replicated"]) == sorted(fx["roles"]["replicated"])
    elif fx["kind"] == "pipeline" and fx["pp"] > 1:  # the tied weight: one copy on each stage using it
        assert d["replicated"] == [fx["tied_info"]["owner"]]
    else:
        assert d["replicated"] == []


@only(lambda n: n.startswith("tp2_dp2_z1_bf16_noinfo"))
def test_tensor_parallel_without_rules_is_refused_naming_tp_rules(pfx, tmp_path):
    fx = pfx
    code, out, err = _cli("inspect", fx["checkpoint_path"])
    assert code == 0 and "--tp-rules" in out, out + err             # inspect says what is missing, exit 0
    code, out, err = _cli("export", fx["checkpoint_path"], tmp_path / "o")
    assert code == 2 and "--tp-rules" in err and "universal_checkpoint_info" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    code, out, err = _cli("export", fx["checkpoint_path"], tmp_path / "o", "--tp-rules", rules_of(fx), "-q")
    assert code == 0, err
    check_export(fx, tmp_path / "o", "safetensors", states=())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, out, err = _cli("export", fx["checkpoint_path"], tmp_path / "o2", "--tp-rules", bad)
    assert code == 2 and "bad.json" in err and "not valid JSON" in err and "Traceback" not in err


# ============================================================================================ export
def load_output(out: Path, fmt: str, sub: str = "") -> dict:
    folder = out / sub if sub else out
    sd = {}
    if fmt == "safetensors":
        from safetensors.torch import load_file

        for f in sorted(folder.glob("model*.safetensors")):
            sd.update(load_file(f))
    else:
        for f in sorted(folder.glob("pytorch_model*.bin")):
            sd.update(torch.load(f, weights_only=True))
    return sd


def check_export(fx, out: Path, fmt: str, states=("exp_avg", "exp_avg_sq")) -> None:
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    sd = load_output(out, fmt)
    order = fx["state_dict_names"]
    assert set(order) == set(sd), sorted(set(order) ^ set(sd))   # every name of the model's state_dict, once
    if len(list(out.glob("model*.safetensors")) + list(out.glob("pytorch_model*.bin"))) == 1:
        # in its order (shards group by size); safetensors lays out the widest elements first (every tensor
        # aligned to its element size), keeping the order within each size
        want = sorted(order, key=lambda n: -sd[n].element_size()) if fmt == "safetensors" else order
        assert list(sd) == want
    for name, want in ref["params"].items():
        got = sd[name]
        assert got.dtype == torch.float32 and torch.equal(got, _cut(want, got.shape).float()), name
    for name, want in ref.get("buffers", {}).items():
        assert torch.equal(sd[name], want), name
    for alias, owner in (ref.get("tied") or {}).items():
        assert torch.equal(sd[alias], sd[owner])
    for key in states:
        st = load_output(out, fmt, key)
        assert set(st) == set(ref["states"][key]), key
        for name, want in ref["states"][key].items():
            assert torch.equal(st[name], _cut(want, st[name].shape).float()), (key, name)


@pytest.mark.parametrize("fmt,shard", [("safetensors", "5GB"), ("torch", "6KB")])
def test_export_equals_the_live_engines_full_state(pfx, tmp_path, fmt, shard):
    fx = pfx
    out = tmp_path / "out"
    res = ckptlib.export(fx["checkpoint_path"], out, format=fmt, max_shard_size=shard,
                         states=["exp_avg", "exp_avg_sq"], tp_rules=rules_of(fx))
    assert (len([n for n, _ in res.files if not n.startswith("exp")]) > 2) == (shard == "6KB")
    check_export(fx, out, fmt)
    if fmt == "safetensors":
        assert ckptlib.verify(res.plan).ok


@only(lambda n: n in ("tp2_dp2_z2_bf16", "autotp_tp2_dp2_z3_bf16", "pp2_dp2_z1_bf16", "moe_ep2_z1_bf16",
                      "pp2_tp2_dp2_z1_bf16"))
def test_distributed_export_gives_the_same_bytes(pfx, tmp_path):
    fx = pfx
    one = tmp_path / "one"
    ckptlib.export(fx["checkpoint_path"], one, max_shard_size="6KB", tp_rules=rules_of(fx))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "ckptlib", "export", str(fx["checkpoint_path"]), str(tmp_path / "dist"),
                        "--max-shard-size", "6KB", "--distributed", "-q",
                        *(["--tp-rules", str(rules_of(fx))] if rules_of(fx) else [])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "dist").iterdir())
    for n in names:
        assert (one / n).read_bytes() == (tmp_path / "dist" / n).read_bytes(), n


# ============================================================================================ broken meshes
def _copy(fx, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], d)
    return d


@only(lambda n: n == "tp2_dp2_z1_bf16")
def test_a_replicated_tensor_that_differs_between_tensor_ranks_is_an_error(pfx, tmp_path):
    fx = pfx
    d = _copy(fx, tmp_path)
    with ckptlib.open_checkpoint(d) as ck:  # where tensor rank 1 keeps its copy of ln1.weight
        r = ck.sets[1].sources("ln1.weight")[0]
    from tests.hostile import write_consistent

    with open(r.path, "rb") as f:  # a value saved as it is (CRC-32 updated), so only the comparison can tell
        f.seek(r.offset)
        b = f.read(1)
    write_consistent(r.path, r.offset, bytes([b[0] ^ 0x10]))
    with pytest.raises(ckptlib.CkptError, match="ln1.weight"):
        ckptlib.export(d, tmp_path / "out")
    # the copies are compared beside the writing: what it wrote meanwhile is gone, temporary folder and all
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name]
    for universal in (False, True):  # reshard and the universal checkpoint run the same checks (issue 21)
        with pytest.raises(ckptlib.CkptError, match="ln1.weight.*differ"):
            if universal:
                ckptlib.write_universal(d, tmp_path / "out")
            else:
                ckptlib.reshard(d, tmp_path / "out", 1)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["missing_layer_file", "missing_tp_optimizer_file", "expert_file_of_another_run",
                                  "extra_expert_file"])
def test_broken_mesh_inputs_name_the_file(parallel_fixtures, tmp_path, case):
    fx = parallel_fixtures[{"missing_layer_file": "pp2_dp2_z1_bf16", "missing_tp_optimizer_file": "tp2_dp2_z2_fp32",
                            "expert_file_of_another_run": "moe_ep2_z1_bf16",
                            "extra_expert_file": "moe_ep1_z1_bf16"}[case]]
    d = _copy(fx, tmp_path)
    tag = d / "global_step2"
    if case == "missing_layer_file":
        (tag / "layer_03-model_states.pt").unlink()
        words = ["layer_03-model_states.pt", "stage 1"]
    elif case == "missing_tp_optimizer_file":
        (tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
        words = ["tensor rank 1", "dp rank(s) 1"]
    elif case == "expert_file_of_another_run":
        shutil.copy(tag / "layer_0_expert_1_mp_rank_00_model_states.pt", tag / "layer_0_expert_3_mp_rank_00_model_states.pt")
        words = ["layer_0_expert_3_mp_rank_00_model_states.pt", "expert 3"]
    else:
        shutil.copy(tag / "layer_0_expert_1_mp_rank_00_model_states.pt", tag / "layer_0_expert_4_mp_rank_00_model_states.pt")
        words = ["layer_0_expert_4_mp_rank_00_model_states.pt", "4 experts"]
    for cmd in (["inspect", d], ["export", d, tmp_path / "out"], ["reshard", d, tmp_path / "out", "--world-size", "1"]):
        code, out, err = _cli(*cmd)
        text = out if cmd[0] == "inspect" else err
        assert code == (1 if cmd[0] == "inspect" else 2), (cmd[0], out, err)
        assert "Traceback" not in out + err
        for w in words:
            assert w in text, (cmd[0], w, text)
    assert not (tmp_path / "out").exists()


# ============================================================================================ the widgets
@only(lambda n: n in ("pp2_dp2_z1_bf16", "tp2_dp2_z1_bf16"))
def test_the_browser_and_layout_view_show_stages_and_tensor_ranks(pfx):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib")
    from ckptlib.ui import CheckpointBrowser, LayoutView

    pipeline = pfx["kind"] == "pipeline"
    b = CheckpointBrowser(pfx["checkpoint_path"])
    assert ("pipeline, 2 stages" if pipeline else "tensor parallel, 2 tensor ranks") in b.summary.value
    assert ("stage 1 dp 1" if pipeline else "tp 1 dp 1") in b.file_table.value
    view = LayoutView(b.checkpoint)
    labels = [label for label, _ in view.group.options]
    who = "stage" if pipeline else "tensor rank"
    assert any(lbl.startswith(f"{who} 0 · group 0") for lbl in labels)
    assert any(lbl.startswith(f"{who} 1 · group 1") for lbl in labels)
    name = "tied_modules.embed.weight" if pipeline else "fc2.weight"
    view.select(name)
    assert f"{who} 0" in view.where.value and f"{who} 1" in view.where.value  # held on both
    assert view.picture.png.startswith(b"\x89PNG") and view.picture.facts["highlight"] == name
