"""Pipeline universal folders back to native files (issue 32): folders written by DeepSpeed 0.19.8's ds_to_universal
from real pipeline checkpoints (PipelineModule, 2 stages, a tied embedding on layers 0 and 5, fp32 and int64 buffers;
ZeRO-1 fp32 and bf16, BF16_Optimizer, and a pipeline x tensor x data mesh) and by ckptlib.

ds_to_universal copies no layer files, so its folders do not say which layer builds a tied module (``--pp-tied``
says it) and hold none of the pipeline's buffers: the native files made from them are the native reshard of the
original, object for object and bit for bit, but for those buffers (absent, and named in the plan's notes) and the
order of the keys inside a layer file (the optimizer groups' order; DeepSpeed loads layer files by key). DeepSpeed
loads them natively at another pipeline, tensor and data size with ``load_module_strict=False`` and holds the
reference's masters, moments, 16-bit weights and step; a strict load names the buffers the files lack. ckptlib's own
universal folders copy the layer files: their round trip is exact, buffers included, with nothing to tell.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlib
from tests.fixtures.compare import assert_holds_the_reference
from tests.fixtures.universal import ds_to_universal
from tests.test_universal_source import _walk

PIPELINES = ["pp2_dp2_z1_fp32", "pp2_dp2_z1_bf16", "pp2_dp2_bf16opt", "pp2_tp2_dp1_z1_bf16"]
TIED = {"embed": [0, 5]}          # the fixtures' TiedLayerSpec uses: layer 0 builds it, layer 5 reuses it
BUFFER_KEYS = ("scale", "counter")  # each Block's buffers, which ds_to_universal's folders lack
#: (source, dp, pp, tp) written from each folder and compared with the native reshard of the original
TREE_CASES = ([(n, dp, pp, 1) for n in PIPELINES[:3] for dp, pp in ((2, 2), (1, 1), (3, 3), (1, 2))]
              + [(PIPELINES[3], 1, 2, 2), (PIPELINES[3], 2, 1, 1), (PIPELINES[3], 1, 2, 1)])
#: DeepSpeed loads: case -> (source, dp, pp, tp, strict); one launch per world size
LOADS = {"bf16-pp1-dp2": ("pp2_dp2_z1_bf16", 2, 1, 1, False),
         "fp32-pp2-dp1": ("pp2_dp2_z1_fp32", 1, 2, 1, False),
         "bf16opt-pp1-dp2": ("pp2_dp2_bf16opt", 2, 1, 1, False),
         "3d-pp1-tp1-dp2": ("pp2_tp2_dp1_z1_bf16", 2, 1, 1, False),
         "bf16-pp1-dp2-strict": ("pp2_dp2_z1_bf16", 2, 1, 1, True),
         "fp32-pp3-dp1": ("pp2_dp2_z1_fp32", 1, 3, 1, False),
         "3d-same-mesh": ("pp2_tp2_dp1_z1_bf16", 1, 2, 2, False)}


@pytest.fixture(scope="module")
def pipe_universal(parallel_fixtures, tmp_path_factory):
    """``{name: (fixture, original tag folder, ds_to_universal's folder, ckptlib's folder)}``."""
    root = tmp_path_factory.mktemp("upipe")
    fixtures = {n: parallel_fixtures[n] for n in PIPELINES}
    out = {}
    for name, save in ds_to_universal(fixtures, root / "ds").items():
        fx = fixtures[name]
        ours = Path(ckptlib.write_universal(fx["checkpoint_path"], root / "ours" / name).out) / f"{fx['tag']}_universal"
        out[name] = (fx, save / fx["tag"], save / f"{fx['tag']}_universal", ours)
    return out


def _cli(*args) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _without_buffers(tree, name: str):
    """A native file's tree as a ds_to_universal folder can give it: a layer file without the buffers, by key; a
    model-states file listing no buffers."""
    if name.startswith("layer_"):
        return dict(sorted((k, v) for k, v in tree.items() if k not in BUFFER_KEYS))
    if isinstance(tree, dict) and "buffer_names" in tree:
        return dict(tree, buffer_names=[])
    return tree


@pytest.mark.parametrize("name,dp,pp,tp", TREE_CASES, ids=[f"{n}->dp{d}pp{p}tp{t}" for n, d, p, t in TREE_CASES])
def test_native_files_from_a_pipeline_folder_are_the_native_reshards(pipe_universal, tmp_path, name, dp, pp, tp):
    fx, original, ds_folder, ours_folder = pipe_universal[name]
    native = Path(ckptlib.reshard(original, tmp_path / "native", dp, pp=pp, tp=tp).out) / fx["tag"]
    names = sorted(p.name for p in native.iterdir())
    for writer, folder in (("ds", ds_folder), ("ours", ours_folder)):
        plan = ckptlib.plan_reshard(folder, tmp_path / writer, dp, pp=pp, tp=tp,
                                    pp_tied=TIED if writer == "ds" else None)
        out = Path(ckptlib.reshard(plan).out) / fx["tag"]
        assert ckptlib.verify(plan).ok
        assert sorted(p.name for p in out.iterdir()) == names, writer
        note = next((n for n in plan.notes if "load_module_strict=False" in n), None)
        assert (note is not None) == (writer == "ds"), plan.notes
        if writer == "ds":
            with ckptlib.open_checkpoint(original) as ck:
                buffers = [b.name for b in ck.buffers]
            assert buffers and all(b in note for b in buffers), (buffers, note)
        diffs: list = []
        for f in names:
            want = torch.load(native / f, weights_only=False)
            got = torch.load(out / f, weights_only=False)
            if writer == "ds":
                want, got = _without_buffers(want, f), _without_buffers(got, f)
            _walk(want, got, f, diffs)
        assert diffs == [], (writer, diffs[:5])


def test_which_layer_builds_a_tied_module_is_asked(pipe_universal, tmp_path):
    """ds_to_universal's folder does not say which layer builds the tied module: reshard asks for --pp-tied, and
    refuses a --pp-tied that names a layer of its own or an unknown key; ckptlib's folder (its layer files) needs none."""
    _, _, folder, _ = pipe_universal["pp2_dp2_z1_bf16"]
    code, text = _cli("reshard", folder, tmp_path / "a", "--world-size", "2", "--pp", "1")
    assert code == 2 and "tied module 'embed'" in text and "--pp-tied embed:" in text and "Traceback" not in text, text
    code, text = _cli("reshard", folder, tmp_path / "b", "--world-size", "2", "--pp-tied", "embed:3,5")
    assert code == 2 and "layer 3 is a layer of its own" in text and "Traceback" not in text, text
    code, text = _cli("reshard", folder, tmp_path / "c", "--world-size", "2", "--pp-tied", "head:0,5")
    assert code == 2 and "head" in text and "holds: embed" in text and "Traceback" not in text, text
    code, text = _cli("reshard", folder, tmp_path / "d", "--world-size", "2", "--pp", "3", "--pp-tied", "embed:0,5")
    assert code == 0 and "load_module_strict=False" in text, text
    assert not any((tmp_path / x).exists() for x in "abc")


@pytest.fixture(scope="module")
def pipe_loads(pipe_universal, tmp_path_factory):
    from tests.fixtures.mesh.check import mesh_job, run_mesh_loads

    work = tmp_path_factory.mktemp("upipe-load")
    jobs: dict = {}
    outs = {}
    for case, (name, dp, pp, tp, strict) in LOADS.items():
        fx, _, folder, _ = pipe_universal[name]
        outs[case] = ckptlib.reshard(folder, work / case, dp, pp=pp, tp=tp, pp_tied=TIED).out
        job, world = mesh_job(fx["path"], pp=pp, tp=tp, dp=dp, checkpoint_dir=outs[case], name=case,
                              save_to=work / f"{case}-saved", strict=strict)
        jobs.setdefault(world, []).append(job)
    results = {}
    for world, js in sorted(jobs.items()):
        results.update(run_mesh_loads(js, world, work / f"w{world}"))
    return results, outs


@pytest.mark.parametrize("case", [c for c in LOADS if not LOADS[c][4]])
def test_deepspeed_loads_them_natively_with_the_references_values(pipe_universal, pipe_loads, case):
    """engine.load_checkpoint (no universal mode, load_module_strict=False) at the new mesh: the reference's fp32
    masters, both moments, 16-bit weights and step; named as DeepSpeed names its own files at that mesh."""
    results, outs = pipe_loads
    name, dp, pp, tp, _ = LOADS[case]
    fx = pipe_universal[name][0]
    res = results[case]
    assert "error" not in res, res.get("error")
    assert res["mesh"] == {"pp": pp, "tp": tp, "dp": dp, "ep": 1}
    assert_holds_the_reference(res["loaded"], fx, buffers=False)  # the folder has none to give (the notes say so)
    assert sorted(p.name for p in (Path(outs[case]) / fx["tag"]).iterdir()) == sorted(res["saved_files"])


def test_a_strict_load_names_the_buffers_the_files_lack(pipe_loads):
    res = pipe_loads[0]["bf16-pp1-dp2-strict"]
    assert "error" in res and "Missing key(s)" in res["error"] and '"scale", "counter"' in res["error"], res


def test_inspect_and_notes_of_a_pipeline_folder(pipe_universal):
    _, _, folder, ours = pipe_universal["pp2_dp2_z1_fp32"]
    code, text = _cli("inspect", folder, "--json")
    assert code == 0, text
    u = json.loads(text)["universal"]
    assert (u["source_mesh"]["pp"], u["source_mesh"]["dp"]) == (2, 2)
    assert sorted(a.split(":")[0].split()[-1] for a in u["absent"]) == sorted(
        f"{i}.{k}" for i in (1, 2, 3) for k in BUFFER_KEYS)
    code, text = _cli("inspect", ours, "--json")
    assert code == 0 and json.loads(text)["universal"]["absent"] == [], text


@pytest.mark.parametrize("name", PIPELINES)
def test_the_export_names_every_buffer_the_folder_cannot_hold(pipe_universal, tmp_path, name):
    """Issue 40: an export of a ds_to_universal pipeline folder holds every parameter and state exactly but none of the
    pipeline's buffers (ds_to_universal copies no layer files): its ``--plan`` and the notes of the run name each one
    the original export has and this one lacks; ckptlib's own folder lacks none and says nothing."""
    from safetensors import safe_open

    fx, original, folder, ours = pipe_universal[name]
    full = ckptlib.export(original, tmp_path / "original", states=["exp_avg", "exp_avg_sq"])
    with safe_open(str(Path(full.out) / "model.safetensors"), "pt") as f:
        wanted = set(f.keys())
    code, planned = _cli("export", folder, tmp_path / "plan", "--states", "exp_avg,exp_avg_sq", "--plan")
    assert code == 0, planned
    code, said = _cli("export", folder, tmp_path / "univ", "--states", "exp_avg,exp_avg_sq")
    assert code == 0, said
    with safe_open(str(tmp_path / "univ" / "model.safetensors"), "pt") as f:
        lacks = wanted - set(f.keys())
    assert lacks and all(n.split(".")[-1] in BUFFER_KEYS for n in lacks)  # the buffers, and nothing else
    for text in (planned, said):
        line = next(x for x in text.splitlines() if "not in the export" in x)
        assert all(f"buffer {n}" in line for n in lacks) and "strict=False" in line, line
    code, text = _cli("export", ours, tmp_path / "ours", "--plan")
    assert code == 0 and "not in the export" not in text, text


def test_a_layer_without_state_keeps_its_file(parallel_fixtures, tmp_path):
    """pp2_dp1_z1_bf16_act has a layer module without state (layer 6), whose empty file DeepSpeed needs to load: the
    native reshard to one stage moves it (tests/test_mesh_reshard.py loads it), ckptlib's universal folder copies it
    and its round trip writes it back; ds_to_universal's folder does not say where such layers are, and the plan's
    notes say how to add the file."""
    fx = parallel_fixtures["pp2_dp1_z1_bf16_act"]
    native = Path(ckptlib.reshard(fx["checkpoint_path"], tmp_path / "native", 2, pp=1).out) / fx["tag"]
    assert (native / "layer_06-model_states.pt").is_file()
    assert torch.load(native / "layer_06-model_states.pt", weights_only=True) == {}
    uni = Path(ckptlib.write_universal(fx["checkpoint_path"], tmp_path / "u").out) / f"{fx['tag']}_universal"
    assert (uni / "layer_06-model_states.pt").is_file()
    plan = ckptlib.plan_reshard(uni, tmp_path / "back", 2, pp=1)
    back = Path(ckptlib.reshard(plan).out) / fx["tag"]
    assert ckptlib.verify(plan).ok
    names = sorted(p.name for p in native.iterdir())
    assert sorted(p.name for p in back.iterdir()) == names
    diffs: list = []
    for f in names:
        _walk(torch.load(native / f, weights_only=False), torch.load(back / f, weights_only=False), f, diffs)
    assert diffs == [], diffs[:5]
    ds = ds_to_universal({"act": fx}, tmp_path / "ds")["act"] / f"{fx['tag']}_universal"
    plan = ckptlib.plan_reshard(ds, tmp_path / "from_ds", 2, pp=1, pp_tied=TIED)
    assert any("torch.save({}, 'layer_XX-model_states.pt')" in n for n in plan.notes), plan.notes

