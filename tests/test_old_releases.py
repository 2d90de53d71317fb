"""Checkpoints written by DeepSpeed 0.10.3 ... 0.16.9 (committed under tests/data/old_releases/, made by
tests/old_releases/make_old_fixtures.py): read, inspect, export and reshard them bit-exactly, and DeepSpeed
0.19.8 loads the reshards. Layouts that cannot be made here (before 0.6, legacy ZeRO-1, elastic, no
recorded ties) are built from a real fixture with ckptlib's own writer: handled where the documented keys
make it safe, refused naming the DeepSpeed version otherwise.

Each old fixture folder holds the checkpoint, ``reference.pt`` (fp32 masters, Adam moments, step, frozen
16-bit weights and buffers gathered from the live old engine) and ``fixture.json`` (0.19.8 generator
schema); ``<version>/manifest.json`` names the exact deepspeed, torch, numpy and pydantic versions.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.cli import main as ckpt_main
from ckptlib.export import export
from ckptlib.reshard import reshard
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.writer import NewTensor, save
from tests.fixtures.model import FixtureNet
from tests.old_releases.releases import RELEASES, TORCH, configs
from tests.test_export import check_against_reference, load_output

DATA = Path(__file__).parent / "data" / "old_releases"


def _load_fixtures() -> list[dict]:
    out = []
    for vdir in sorted(DATA.iterdir(), key=lambda p: tuple(int(x) for x in p.name.split("."))) if DATA.is_dir() else []:
        if not (vdir / "manifest.json").is_file():
            continue
        for d in sorted(p for p in vdir.iterdir() if (p / "fixture.json").is_file()):
            fx = json.loads((d / "fixture.json").read_text())
            fx["version"] = vdir.name
            fx["path"] = d
            fx["checkpoint_path"] = d / fx["checkpoint_dir"]
            fx["id"] = f"{vdir.name}/{d.name}"
            out.append(fx)
    return out


FIXTURES = _load_fixtures()
BY_ID = {fx["id"]: fx for fx in FIXTURES}
IDS = list(BY_ID)


def _ref(fx) -> dict:
    return torch.load(fx["path"] / "reference.pt", weights_only=True)


def _target(fx) -> int:
    """The reshard target: 2 -> 3, 3 -> 2."""
    return 5 - fx["world_size"]


def _run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ckpt_main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def _inspect_json(path, *extra) -> dict:
    code, out, err = _run_cli("inspect", path, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def _check_values(ck, fx, ref) -> None:
    """Every value ckptlib reads equals the live old engine's, bit for bit."""
    for name, want in ref["fp32"].items():
        got = ck.read_param(name)
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32)), name
        for key, m in ref["optim"][name].items():
            assert torch.equal(ck.read_state(name, key).view(torch.int32), m.view(torch.int32)), f"{name}.{key}"
    for name, want in ref["frozen"].items():
        assert torch.equal(ck.read_param(name), want.float()), f"frozen {name}"
    for name, want in ref["buffers"].items():
        got = ck.read_buffer(name)
        assert got.dtype == want.dtype and torch.equal(got, want), f"buffer {name}"
    for p in fx["parameters"]:
        if p["tied_to"]:
            assert ck.param(p["name"]).tied_to == p["tied_to"]
            assert torch.equal(ck.read_param(p["name"]), ref["fp32"][p["tied_to"]])
    assert ck.optimizer.step == ref["step"]


# ================================================================================================ the data
def test_the_committed_data_is_complete_and_small():
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(RELEASES)
    for version in RELEASES:
        man = json.loads((DATA / version / "manifest.json").read_text())
        assert man["deepspeed"] == version and man["torch"].split("+")[0] == TORCH
        for pin in RELEASES[version]["pins"]:
            name, want = pin.split("==")
            assert man[name] == want, (version, pin)
        assert man["configs"] == sorted(c["name"] for c in configs(version))
        assert [fx["name"] for fx in FIXTURES if fx["version"] == version] == man["configs"]
        assert not list((DATA / version).rglob("zero_to_fp32.py"))
    assert {fx["zero_stage"] for fx in FIXTURES} == {1, 2, 3} and {fx["dtype"] for fx in FIXTURES} == {"fp32", "bf16"}
    assert {fx["world_size"] for fx in FIXTURES} == {2, 3}
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 20e6, total


@pytest.mark.parametrize("fid", IDS)
def test_fixture_matches_its_release(fid):
    """What the generator recorded: the release, its own engine's classes, and the reference checks."""
    fx = BY_ID[fid]
    assert fx["deepspeed_version"] == fx["version"]
    ex = fx["extras"]
    assert ex["reference_rounds_to_module_weights"] is True
    assert fx["optimizer_class"] == ("DeepSpeedZeroOptimizer_Stage3" if fx["zero_stage"] == 3
                                     else "DeepSpeedZeroOptimizer")
    assert [p["name"] for p in fx["parameters"] if p["tied_to"]] == ["head.weight"]
    assert [p["name"] for p in fx["parameters"] if not p["trainable"] and not p["tied_to"]] == \
        ["frozen.weight", "frozen.bias"]
    assert {b["name"]: b["dtype"] for b in fx["buffers"]}.keys() == {"counter", "mask", "feat_scale"}


# ================================================================================================ reading
@pytest.mark.parametrize("fid", IDS)
def test_read_is_bit_exact(fid):
    fx = BY_ID[fid]
    ref = _ref(fx)
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        assert ck.problems == []
        assert (ck.zero_stage, ck.dtype, ck.dp_world_size, ck.deepspeed_version) == \
            (fx["zero_stage"], fx["dtype"], fx["world_size"], fx["version"])
        _check_values(ck, fx, ref)
        if fx["zero_stage"] in (1, 2):  # the reference agrees with the 16-bit weights DeepSpeed saved
            for name, want in ref["fp32"].items():
                lp = ck.module_tensor(name).read()
                assert torch.equal(want.to(lp.dtype), lp), name


# ================================================================================================ inspect
def _expected_quirks(fx, ref) -> list[str]:
    """Phrases ``ckpt inspect`` must show, derived from the live engine's facts (not from the files)."""
    q = ["sparse_tensor_module_names present", "no checkpoint_parallel_dimensions"]
    if fx["zero_stage"] in (1, 2):
        q.append("no param_alignment_paddings")
    if ref["step"] == fx["extras"]["global_steps"] + 1:
        q.append(f"optimizer step {ref['step']} = global_steps + 1")
    if ref["buffers"]["feat_scale"].dtype == torch.bfloat16:
        q.append("float buffers saved in bf16 (feat_scale)")
    return q


@pytest.mark.parametrize("fid", IDS)
def test_inspect_names_the_release_and_its_quirks(fid):
    fx = BY_ID[fid]
    ref = _ref(fx)
    d = _inspect_json(fx["checkpoint_path"])
    assert (d["zero_stage"], d["dtype"], d["dp_world_size"], d["deepspeed_version"]) == \
        (fx["zero_stage"], fx["dtype"], fx["world_size"], fx["version"])
    assert d["tag"] == fx["tag"] == "global_step2" and d["problems"] == []
    assert d["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq"] and d["optimizer"]["step"] == ref["step"]
    got = {p["name"]: p for p in d["parameters"]}
    assert sorted(got) == sorted(p["name"] for p in fx["parameters"])
    for p in fx["parameters"]:
        g = got[p["name"]]
        assert (g["shape"], g["trainable"], g["tied_to"]) == (p["shape"], p["trainable"], p["tied_to"]), p
    assert [(b["name"], b["dtype"]) for b in d["buffers"]] == [(b["name"], b["dtype"]) for b in fx["buffers"]]
    note = [n for n in d["notes"] if n.startswith(f"written by DeepSpeed {fx['version']}: ")]
    assert len(note) == 1, d["notes"]
    for phrase in _expected_quirks(fx, ref):
        assert phrase in note[0], (phrase, note[0])
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        assert ck.quirks and all(q in note[0] for q in ck.quirks)
    code, text, _ = _run_cli("inspect", fx["checkpoint_path"])
    assert code == 0 and f"DeepSpeed   {fx['version']}" in text and note[0] in text and "problems: none" in text


def test_hf_trainer_layouts_of_old_releases(tmp_path):
    hf = [fx for fx in FIXTURES if fx["name"].startswith("hf_trainer")]
    assert sorted(fx["version"] for fx in hf) == sorted(RELEASES)
    for fx in hf:
        ckpt = fx["checkpoint_path"]
        assert ckpt.name == "checkpoint-2" and (ckpt / "latest").read_text() == "global_step2"
        d = _inspect_json(ckpt)
        assert d["tag"] == "global_step2" and d["tags"] == ["global_step2"] and d["deepspeed_version"] == fx["version"]
        assert _inspect_json(ckpt / "global_step2")["tag"] == "global_step2"
        out = tmp_path / fx["version"] / "output"  # a training output folder: the newest checkpoint-N is used
        out.mkdir(parents=True)
        for n in (1, 2):
            (out / f"checkpoint-{n}").symlink_to(ckpt)
        assert _inspect_json(out)["save_dir"].endswith("checkpoint-2")


# ================================================================================================ export
@pytest.mark.parametrize("fid", IDS)
def test_export_is_bit_exact_and_loads_strict(fid, tmp_path):
    fx = BY_ID[fid]
    fmt = "torch" if fx["zero_stage"] == 2 else "safetensors"
    export(fx["checkpoint_path"], tmp_path / "out", format=fmt, states=["exp_avg", "exp_avg_sq"],
           max_shard_size="8KB")
    sd = load_output(tmp_path / "out", fmt)
    check_against_reference(sd, fx)
    FixtureNet("small").load_state_dict(sd, strict=True)
    ref = _ref(fx)
    for key in ("exp_avg", "exp_avg_sq"):
        states = load_output(tmp_path / "out", fmt, key)
        assert set(states) == set(ref["optim"])
        for name, m in ref["optim"].items():
            assert torch.equal(states[name], m[key]), (key, name)


# ================================================================================================ reshard
@pytest.fixture(scope="module")
def reshards(tmp_path_factory):
    """Every old fixture resharded to the other world size (2 <-> 3)."""
    work = tmp_path_factory.mktemp("old-reshard")
    out = {}
    for fx in FIXTURES:
        dst = work / fx["id"].replace("/", "_")
        reshard(fx["checkpoint_path"], dst, _target(fx))
        out[fx["id"]] = dst
    return out


@pytest.mark.parametrize("fid", IDS)
def test_reshard_reads_back_bit_exact(fid, reshards):
    fx = BY_ID[fid]
    with ckptlib.open_checkpoint(reshards[fid]) as ck:
        assert ck.problems == [] and ck.partition_count == _target(fx) and ck.dp_world_size == _target(fx)
        assert ck.deepspeed_version == fx["version"] and (ck.zero_stage, ck.dtype) == (fx["zero_stage"], fx["dtype"])
        _check_values(ck, fx, _ref(fx))


@pytest.fixture(scope="module")
def deepspeed_loads(reshards, tmp_path_factory):
    """DeepSpeed 0.19.8 loads every reshard at its new world size: one launch per world size."""
    pytest.importorskip("deepspeed")
    from tests.fixtures.load_runner import run_load_checks

    jobs = defaultdict(list)
    for fx in FIXTURES:
        m = _target(fx)
        jobs[m].append({"name": fx["id"], "checkpoint_dir": str(reshards[fx["id"]]), "tag": None,
                        "zero_stage": fx["zero_stage"], "dtype": fx["dtype"],
                        "spec_name": f"z{fx['zero_stage']}_{fx['dtype']}_w{m}", "model_size": "small"})
    work = tmp_path_factory.mktemp("old-load")
    results = {}
    for world, js in sorted(jobs.items()):
        results.update(run_load_checks(js, world, work / f"w{world}"))
    return results


@pytest.mark.parametrize("fid", IDS)
def test_deepspeed_0_19_8_loads_the_reshard_exactly(fid, deepspeed_loads):
    fx = BY_ID[fid]
    ref = _ref(fx)
    res = deepspeed_loads[fid]
    assert "error" not in res, res.get("error")
    assert res["world_size"] == _target(fx)
    loaded = res["loaded"]
    assert not loaded["optim_state_missing"] and loaded["step"] == ref["step"]
    for name, want in ref["fp32"].items():
        assert torch.equal(loaded["fp32"][name], want), f"fp32 master {name}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"][name][key], ref["optim"][name][key]), f"{key} {name}"
    for name, want in ref["frozen"].items():
        assert torch.equal(loaded["frozen"][name], want), f"frozen {name}"
    for name, want in ref["buffers"].items():
        got = loaded["buffers"][name]
        if want.is_floating_point():  # an old bf16 buffer lands in 0.19.8's fp32 buffer: same values
            assert got.is_floating_point() and torch.equal(got.double(), want.double()), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name
    after = res["after_step"]
    assert after["step"] == ref["step"] + 1 and torch.isfinite(torch.tensor(after["loss"]))


# ================================================================================================ synthetic
def _rewrite(src: Path, dst: Path, edit_model=None, edit_optim=None) -> Path:
    """Copy the checkpoint (save dir) ``src`` to ``dst``, editing the object trees of its files."""
    shutil.copytree(src, dst)
    tag_dir = dst / (src / "latest").read_text()
    for f in sorted(tag_dir.glob("*.pt")):
        edit = edit_optim if f.name.endswith("optim_states.pt") else edit_model
        if edit is None:
            continue
        src_file = src / tag_dir.name / f.name
        obj = open_torch_file(src_file).obj
        edit(obj, f.name)
        save(obj, f)
    return dst


def _fx(version, stage, dtype=None) -> dict:
    return next(fx for fx in FIXTURES if fx["version"] == version and fx["zero_stage"] == stage
                and (dtype is None or fx["dtype"] == dtype) and fx["name"].startswith("z"))


def _refused(path, *words):
    """open_checkpoint, ``ckpt inspect``, export and reshard all refuse, with ``words`` in the message."""
    with pytest.raises(ckptlib.UnsupportedCheckpointError) as e:
        ckptlib.open_checkpoint(path)
    code, _, err = _run_cli("inspect", path)
    assert code != 0
    for w in words:
        assert w in str(e.value) and w in err, (w, str(e.value))
    for action in (lambda: export(path, path.parent / "out"), lambda: reshard(path, path.parent / "re", 3)):
        with pytest.raises(ckptlib.UnsupportedCheckpointError, match=re.escape(words[0])):
            action()
    assert not (path.parent / "out").exists() and not (path.parent / "re").exists()
    return str(e.value)


@pytest.mark.parametrize("shapes_form", ["list", "dict"])
def test_pre_0_6_param_shapes_in_the_optim_files_are_refused_naming_the_version(tmp_path, shapes_form):
    """Before 0.6 'param_shapes' was at the optimizer files' top level (a single OrderedDict before 0.5.4)."""
    fx = _fx("0.10.3", 2)
    shapes = open_torch_file(fx["checkpoint_path"] / fx["tag"] / "mp_rank_00_model_states.pt").obj["param_shapes"]
    if shapes_form == "dict":
        shapes = type(shapes[0])((k, v) for g in shapes for k, v in g.items())

    def model(obj, _):
        del obj["param_shapes"]
        obj["ds_version"] = "0.5.8"

    def optim(obj, _):
        obj["param_shapes"] = shapes
        obj["ds_version"] = "0.5.8"

    path = _rewrite(fx["checkpoint_path"], tmp_path / "pre06", model, optim)
    _refused(path, "written by DeepSpeed 0.5.8", "'param_shapes' at their top level", "before 0.6")


def test_a_checkpoint_without_any_ds_version_is_refused_saying_so(tmp_path):
    fx = _fx("0.12.6", 1)

    def model(obj, _):
        del obj["param_shapes"], obj["ds_version"]

    def optim(obj, _):
        obj["param_shapes"] = [{"x": torch.Size([3])}]
        obj.pop("ds_version", None)

    path = _rewrite(fx["checkpoint_path"], tmp_path / "nover", model, optim)
    _refused(path, "recorded no ds_version (older than 0.4)", "before 0.6")


def test_legacy_zero1_is_refused_naming_the_version(tmp_path):
    fx = _fx("0.13.5", 1)

    def optim(obj, _):
        osd = obj["optimizer_state_dict"]
        osd["local_sub_partitions_of_fp32_groups"] = [[t] for t in osd.pop("single_partition_of_fp32_groups")]
        osd["num_comm_intervals_per_group"] = [1] * len(osd["local_sub_partitions_of_fp32_groups"])
        obj["ds_version"] = "0.5.8"

    def model(obj, _):
        obj["ds_version"] = "0.5.8"

    path = _rewrite(fx["checkpoint_path"], tmp_path / "legacy", model, optim)
    _refused(path, "written by DeepSpeed 0.5.8", "legacy ZeRO-1", "local_sub_partitions_of_fp32_groups")


def _to_elastic(obj, _):
    """The elastic (list) form of a rigid ZeRO-1/2 optimizer state: unpadded per-group tensors, step apart."""
    osd = obj["optimizer_state_dict"]
    base = osd["base_optimizer_state"]
    lean, step = [], None
    for g, part in enumerate(osd["single_partition_of_fp32_groups"]):
        st = base["state"][g]
        lean.append({k: NewTensor.from_tensor(v.read()[:part.numel]) for k, v in st.items() if k != "step"})
        step = st["step"]
    osd["base_optimizer_state"] = lean
    osd["base_optimizer_state_step"] = step


def test_elastic_optimizer_state_is_read_and_exported_and_reshard_refuses(tmp_path):
    fx = _fx("0.12.6", 2, "bf16")
    ref = _ref(fx)
    path = _rewrite(fx["checkpoint_path"], tmp_path / "elastic", edit_optim=_to_elastic)
    with ckptlib.open_checkpoint(path) as ck:
        assert ck.problems == []
        assert any("elastic" in q for q in ck.quirks)
        _check_values(ck, fx, ref)
    d = _inspect_json(path)
    assert any(n.startswith("written by DeepSpeed 0.12.6: ") and "elastic" in n for n in d["notes"])
    export(path, tmp_path / "out", states=["exp_avg"])
    check_against_reference(load_output(tmp_path / "out", "safetensors"), fx)
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="elastic"):
        reshard(path, tmp_path / "re", 3)


def test_elastic_state_of_the_wrong_length_is_a_problem(tmp_path):
    fx = _fx("0.12.6", 2, "bf16")

    def edit(obj, name):
        _to_elastic(obj, name)
        if "rank_0_" in name:
            st = obj["optimizer_state_dict"]["base_optimizer_state"][0]
            st["exp_avg"] = NewTensor.from_tensor(torch.zeros(7))

    path = _rewrite(fx["checkpoint_path"], tmp_path / "elastic-bad", edit_optim=edit)
    with ckptlib.open_checkpoint(path) as ck:
        assert any("elastic state 'exp_avg' holds 7 elements" in p for p in ck.problems)
        with pytest.raises(ckptlib.IncompleteCheckpointError):
            ck.read_state("embed.weight", "exp_avg")


@pytest.mark.parametrize("stage", [1, 2])
def test_unrecorded_ties_are_found_from_the_module_storage(tmp_path, stage):
    """DeepSpeed < 0.9 (and 0.9.x ZeRO-1/2) write no (or an empty) shared_params: the tie is still found."""
    fx = _fx("0.10.3", stage)
    ref = _ref(fx)

    def model(obj, _):
        obj["shared_params"] = {}
        obj["ds_version"] = "0.8.3"

    path = _rewrite(fx["checkpoint_path"], tmp_path / "ties", model)
    with ckptlib.open_checkpoint(path) as ck:
        assert ck.problems == [] and ck.param("head.weight").tied_to == "embed.weight"
        assert any("shared_params not recorded" in q for q in ck.quirks)
        assert any("older than the DeepSpeed releases ckptlib is tested with" in q for q in ck.quirks)
        _check_values(ck, fx, ref)
    export(path, tmp_path / "out")
    sd = load_output(tmp_path / "out", "safetensors")
    check_against_reference(sd, fx)
    assert torch.equal(sd["head.weight"], ref["fp32"]["embed.weight"])


def test_no_quirks_on_0_19_8_checkpoints(fixture_by_name):
    for name in ("z1_bf16_w2", "z2_fp32_w3", "z3_bf16_w2", "bf16opt_w2", "z0_bf16_w2"):
        with ckptlib.open_checkpoint(fixture_by_name(name)["checkpoint_path"]) as ck:
            assert ck.quirks == [] and not any(n.startswith("written by") for n in ck.notes), (name, ck.quirks)
