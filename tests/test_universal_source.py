"""Universal checkpoints as sources (issue 32): folders written by DeepSpeed 0.19.8's own ds_to_universal from real
checkpoints (ZeRO-1/2/3, bf16 and fp32, BF16_Optimizer; the fixtures' model has a tied weight, frozen parameters and
int64/bool/fp32 buffers, one holding 16777217, which ds_to_universal's zero/ copy rounds to 16777216) and by ckptlib.

- inspect says what the folder is (universal, its source's stage and mesh, the steps, what it cannot give);
- export with every optimizer state equals the live engine's references bit for bit (masters, moments, frozen
  weights, buffers at their own dtype);
- reshard writes native files that are, object for object and bit for bit, what ckptlib's native reshard of the
  original writes (which tests/test_reshard.py loads in DeepSpeed), and DeepSpeed loads them natively (no universal
  mode) with the masters, moments, step, frozen weights and buffers of the reference;
- a folder whose step files disagree is refused by reshard and reported by inspect.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptlib
from tests.fixtures.compare import assert_masters_and_moments_equal, reference
from tests.fixtures.load_runner import job_for_fixture, run_load_checks
from tests.fixtures.universal import ds_to_universal

# sources converted by DeepSpeed's ds_to_universal (one subprocess) and by ckptlib
DS_SOURCES = ["z1_bf16_w3", "z2_fp32_w4", "z2_bf16_w2", "z3_bf16_w2", "z3_fp32_w4", "bf16opt_w3", "z3_subgroup_w3"]
OURS = ["z2_bf16_w3", "z3_bf16_w3", "z1_fp32_w4"]
# (source, writer, target size) loaded by DeepSpeed natively, one torchrun launch
LOADS = [("z2_bf16_w2", "ds", 3), ("z3_bf16_w2", "ds", 3), ("bf16opt_w3", "ds", 3), ("z1_fp32_w4", "ours", 3)]
TREE_CASES = [(n, "ds", m) for n in DS_SOURCES for m in (1, 3)] + [(n, "ours", 2) for n in OURS]

@pytest.fixture(scope="module")
def universal(fixture_by_name, tmp_path_factory):
    """``{(source, "ds"|"ours"): the universal tag folder}``."""
    root = tmp_path_factory.mktemp("usrc")
    fixtures = {name: fixture_by_name(name) for name in DS_SOURCES}
    out = {(name, "ds"): save / f"{fixtures[name]['tag']}_universal"
           for name, save in ds_to_universal(fixtures, root / "ds").items()}
    for name in OURS:
        fx = fixture_by_name(name)
        res = ckptlib.write_universal(fx["checkpoint_path"], root / "ours" / name)
        out[(name, "ours")] = Path(res.out) / f"{fx['tag']}_universal"
    return out


def _cli(*args) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


# ================================================================================================ inspect
@pytest.mark.parametrize("name", DS_SOURCES)
def test_inspect_says_what_the_folder_is(universal, fixture_by_name, name):
    fx = fixture_by_name(name)
    code, text = _cli("inspect", universal[(name, "ds")], "--json")
    assert code == 0, text
    d = json.loads(text)
    u = d["universal"]
    assert u["written_by"] == "ds_to_universal" and u["source_zero_stage"] == (fx["zero_stage"] or None) or \
        fx["zero_stage"] == 0, u
    assert u["source_mesh"]["dp"] == fx["world_size"] and not d["problems"], (u, d["problems"])
    assert set(u["steps"].values()) == {float(reference(fx)["step"])}
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as orig:
        want = {p.name: (list(p.shape), p.trainable, p.tied_to) for p in orig.parameters}
        buffers = {b.name: b.dtype for b in orig.buffers}
    assert {p["name"]: (p["shape"], p["trainable"], p["tied_to"]) for p in d["parameters"]} == want
    assert {b["name"]: b["dtype"] for b in d["buffers"]} == buffers  # their own dtypes (int64, bool), not float32
    code, text = _cli("inspect", universal[(name, "ds")])
    assert code == 0 and "universal   every tensor whole" in text and "written by ds_to_universal" in text, text
    assert "zero/<parameter>/" in text and "problems: none found" in text, text


# ================================================================================================ export
@pytest.mark.parametrize("key", [(n, "ds") for n in DS_SOURCES] + [(n, "ours") for n in OURS],
                         ids=[f"{n}-ds" for n in DS_SOURCES] + [f"{n}-ours" for n in OURS])
def test_export_with_states_equals_the_live_engine(universal, fixture_by_name, tmp_path, key):
    fx = fixture_by_name(key[0])
    ref = reference(fx)
    plan = ckptlib.plan_export(universal[key], tmp_path / "out", states=["all"])
    out = ckptlib.export(plan).out
    w = load_file(Path(out) / "model.safetensors")
    for n, v in ref["fp32"].items():
        assert torch.equal(w[n], v), n
    for n, v in ref["frozen"].items():
        assert torch.equal(w[n], v.float()), n
    for n, v in ref["buffers"].items():
        assert w[n].dtype == v.dtype and torch.equal(w[n], v), n  # 16777217 stays 16777217
    for k in ("exp_avg", "exp_avg_sq"):
        s = load_file(Path(out) / k / "model.safetensors")
        assert set(s) == set(ref["optim"]), k
        for n, st in ref["optim"].items():
            assert torch.equal(s[n], st[k]), (k, n)
    assert ckptlib.verify(plan).ok


# ================================================================================================ reshard
def _walk(a, b, path: str, diffs: list) -> None:
    if torch.is_tensor(a):
        if not (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                and a.requires_grad == b.requires_grad):
            diffs.append(path)
        return
    if isinstance(a, dict):
        if list(a) != list(b):
            diffs.append(f"{path}: keys {list(a)} != {list(b)}")
        for k in a:
            if k in b:
                _walk(a[k], b[k], f"{path}/{k}", diffs)
        return
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            diffs.append(f"{path}: {type(a).__name__}[{len(a)}] != {type(b).__name__}[{len(b)}]")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", diffs)
        return
    if repr(a) != repr(b):
        diffs.append(f"{path}: {repr(a)[:60]} != {repr(b)[:60]}")


@pytest.mark.parametrize("name,writer,m", TREE_CASES, ids=[f"{n}-{w}->{m}" for n, w, m in TREE_CASES])
def test_reshard_writes_what_the_native_reshard_of_the_original_writes(universal, fixture_by_name, tmp_path,
                                                                      name, writer, m):
    fx = fixture_by_name(name)
    plan = ckptlib.plan_reshard(universal[(name, writer)], tmp_path / "from_universal", m)
    mine = ckptlib.reshard(plan).out
    assert ckptlib.verify(plan).ok  # --verify: the output re-opened and compared with the universal folder
    native = ckptlib.reshard(fx["checkpoint_path"], tmp_path / "native", m).out
    a, b = Path(native) / fx["tag"], Path(mine) / fx["tag"]
    assert (Path(mine) / "latest").read_text() == fx["tag"]
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in sorted(a.iterdir()):
        diffs: list = []
        _walk(torch.load(f, weights_only=False), torch.load(b / f.name, weights_only=False), f.name, diffs)
        assert not diffs, diffs[:5]


# universal-mode loads (load_universal) checked by verify_loaded: against the folder itself, and a folder whose
# exp_avg of fc1.weight was zeroed against the original (the "trains as if from scratch" resume); the engines start
# from the generator's buffers, which a universal load does not restore
UNIVERSAL_LOADS = [("z2_bf16_w2", 3), ("z3_bf16_w2", 3)]
AS_GENERATOR = {"init_seed": 1234, "perturb_buffers": False}


@pytest.fixture(scope="module")
def loads(universal, fixture_by_name, tmp_path_factory):
    work = tmp_path_factory.mktemp("uload")
    jobs: dict = {}
    for name, writer, m in LOADS:
        out = ckptlib.reshard(universal[(name, writer)], work / f"{name}-{writer}-{m}", m).out
        jobs.setdefault(m, []).append(job_for_fixture(fixture_by_name(name), checkpoint_dir=out,
                                                      name=f"{name}-{writer}->{m}"))
    for name, m in UNIVERSAL_LOADS:
        fx, folder = fixture_by_name(name), universal[(name, "ds")]
        jobs.setdefault(m, []).append(job_for_fixture(fx, checkpoint_dir=folder.parent, universal=True,
                                                      name=f"{name}-universal@{m}", verify=str(folder),
                                                      **AS_GENERATOR))
        zeroed = work / f"{name}-zeroed" / folder.name
        shutil.copytree(folder, zeroed)
        (zeroed.parent / "latest_universal").write_text(folder.name)
        p = zeroed / "zero" / "fc1.weight" / "exp_avg.pt"
        obj = torch.load(p, weights_only=False)
        (obj["param"] if isinstance(obj, dict) else obj).zero_()
        torch.save(obj, p)
        jobs[m].append(job_for_fixture(fx, checkpoint_dir=zeroed.parent, universal=True, name=f"{name}-zeroed@{m}",
                                       verify=str(fx["checkpoint_path"]), **AS_GENERATOR))
    results = {}
    for m, js in jobs.items():
        results.update(run_load_checks(js, m, work / f"w{m}"))
    return results


@pytest.mark.parametrize("name,writer,m", LOADS, ids=[f"{n}-{w}->{m}" for n, w, m in LOADS])
def test_deepspeed_loads_the_native_files_exactly(loads, fixture_by_name, name, writer, m):
    fx = fixture_by_name(name)
    ref = reference(fx)
    got = loads[f"{name}-{writer}->{m}"]
    assert "error" not in got, got.get("error")
    assert got["world_size"] == m
    loaded = got["loaded"]
    assert_masters_and_moments_equal(loaded, ref)  # masters, moments and the step, bit for bit
    for p, want in ref["frozen"].items():
        assert torch.equal(loaded["frozen"][p], want), f"frozen {p}"
    for b, want in ref["buffers"].items():
        assert torch.equal(loaded["buffers"][b], want), f"buffer {b}"  # the int64 16777217 too


# ================================================================================================ refusals
def test_disagreeing_steps_are_reported_and_refused(universal, tmp_path):
    src = universal[("z2_bf16_w2", "ds")]
    copy = tmp_path / "ckpt" / src.name
    shutil.copytree(src, copy)
    victim = sorted(copy.rglob("step.pt"))[2]
    torch.save(torch.tensor(1.0), victim)
    code, text = _cli("inspect", copy)
    assert code == 0 and f"{victim.parent.name} 1" in text and "disagree" in text, text
    code, text = _cli("reshard", copy, tmp_path / "out", "--world-size", "3")
    assert code != 0 and "disagree" in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()
    # an export holds each parameter's value; the step is what the folder says per parameter
    assert ckptlib.export(copy, tmp_path / "exp").out


def test_a_missing_master_is_named(universal, tmp_path):
    src = universal[("z3_bf16_w2", "ds")]
    copy = tmp_path / "ckpt" / src.name
    shutil.copytree(src, copy)
    os.remove(copy / "zero" / "fc1.weight" / "fp32.pt")
    code, text = _cli("export", copy, tmp_path / "out")
    assert code != 0 and "zero/fc1.weight/fp32.pt is missing" in text and "Traceback" not in text, text


# ================================================================================================ the named check
@pytest.mark.parametrize("writer", ["ds", "ours"])
def test_check_against_the_original_names_zeroed_moments_and_changed_steps(universal, fixture_by_name, tmp_path,
                                                                            writer):
    """`ckpt check UNIVERSAL --against ORIGINAL`: passes the untouched folder; flags, naming the parameter, an
    exp_avg zeroed (the "trains as if from scratch" resume of DeepSpeed #6691), a step changed, a state changed, a
    master file removed."""
    name = "z2_bf16_w2" if writer == "ds" else "z2_bf16_w3"
    fx = fixture_by_name(name)
    src = universal[(name, writer)]
    code, text = _cli("check", src, "--against", fx["checkpoint_path"], "-q")
    assert code == 0 and "ok: the universal checkpoint holds the original's" in text, text
    copy = tmp_path / "ckpt" / src.name
    shutil.copytree(src, copy)

    def edit(param, key, fn):
        p = copy / "zero" / param / f"{key}.pt"
        obj = torch.load(p, weights_only=False)
        t = obj["param"] if isinstance(obj, dict) else obj
        fn(t)
        torch.save(obj, p)

    edit("fc1.weight", "exp_avg", lambda t: t.zero_())
    edit("tiny", "exp_avg_sq", lambda t: t.view(-1)[:1].add_(1.0))
    torch.save(torch.tensor(1.0), copy / "zero" / "norm.bias" / "step.pt")
    code, text = _cli("check", copy, "--against", fx["checkpoint_path"], "--json", "-q")
    assert code == 1, text
    found = {(f["parameter"], f["what"], f["kind"]) for f in json.loads(text)["findings"]}
    assert found == {("fc1.weight", "exp_avg", "zeroed"), ("tiny", "exp_avg_sq", "changed"),
                     ("norm.bias", "step", "step")}, found
    r = ckptlib.check_universal(copy, fx["checkpoint_path"])
    assert not r.ok and "fc1.weight: its exp_avg is all zero" in r.describe()
    code, text = _cli("check", fx["checkpoint_path"], "--against", fx["checkpoint_path"])
    assert code == 2 and "not a universal checkpoint" in text and "Traceback" not in text, text


# ================================================================================================ parallel sources
PARALLEL = ["tp2_dp2_z1_bf16", "pp2_dp2_z1_fp32"]
TP_SOURCES = ["tp2_dp2_z1_bf16", "tp2_dp2_z2_fp32", "tp2_dp2_bf16opt"]


@pytest.fixture(scope="module")
def parallel_universal(parallel_fixtures, tmp_path_factory):
    """``{name: (fixture, original tag folder, universal folder)}`` of ds_to_universal's parallel conversions."""
    return _converted({n: parallel_fixtures[n] for n in PARALLEL + TP_SOURCES[1:]}, tmp_path_factory.mktemp("upar"))


def _converted(fixtures: dict, root: Path) -> dict:
    return {name: (fixtures[name], save / fixtures[name]["tag"], save / f"{fixtures[name]['tag']}_universal")
            for name, save in ds_to_universal(fixtures, root).items()}


@pytest.mark.parametrize("name", PARALLEL)
def test_a_tensor_or_pipeline_parallel_source(parallel_universal, tmp_path, name):
    """ds_to_universal's folder of a tensor-parallel (with its universal_checkpoint_info) and of a pipeline run:
    inspect gives the source mesh and names the pipeline buffers the folder lacks (ds_to_universal copies no layer
    files); export with the states equals the export of the original bit for bit (the tensor-parallel shards joined
    by DeepSpeed, the vocabulary's padding rows cut as the original's model has it)."""
    fx, original, uni = parallel_universal[name]
    code, text = _cli("inspect", uni, "--json")
    assert code == 0, text
    d = json.loads(text)
    mesh = d["universal"]["source_mesh"]
    assert (mesh["tp"], mesh["pp"], mesh["dp"]) == ((2, 1, 2) if name.startswith("tp") else (1, 2, 2)), mesh
    if name.startswith("pp"):
        assert d["universal"]["absent"] and all("layer files" in a for a in d["universal"]["absent"])
    a = ckptlib.export(original, tmp_path / "a", states=["all"], tp_rules=None).out
    b = ckptlib.export(uni, tmp_path / "b", states=["all"]).out
    wa, wb = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    absent = {x.split(":")[0].split()[-1] for x in d["universal"]["absent"]}
    assert set(wa) - set(wb) == absent and set(wb) <= set(wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wb)
    for k in ("exp_avg", "exp_avg_sq"):
        sa, sb = load_file(Path(a) / k / "model.safetensors"), load_file(Path(b) / k / "model.safetensors")
        assert set(sa) == set(sb) and all(torch.equal(sa[n], sb[n]) for n in sa), k
    code, text = _cli("check", uni, "--against", original, "-q")
    assert code == 0, text
    # native files from it: tests/test_universal_pipeline.py (pipeline), test_a_tensor_parallel_universal_folder_...


def _differing(a, b, path: str, out: list) -> None:
    """``(path, differing elements)`` of every tensor of tree ``a`` unlike ``b``'s (None: not comparable)."""
    if torch.is_tensor(a):
        if not (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            same = torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
            out.append((path, int((a != b).sum()) if same else None))
        return
    if isinstance(a, dict):
        for k in a:
            _differing(a[k], b.get(k) if isinstance(b, dict) else None, f"{path}/{k}", out)
    elif isinstance(a, (list, tuple)):
        for i, x in enumerate(a):
            _differing(x, b[i] if isinstance(b, (list, tuple)) and i < len(b) else None, f"{path}[{i}]", out)


def _only_padding_rows(mine: Path, theirs: Path, fx, cols: int) -> None:
    """Every file of ``theirs`` is in ``mine`` with the same tree (see _walk), and its tensors differ only in the
    vocabulary's padding rows: no more differing elements than those rows hold, in the vocabulary weights and the
    fp32 partitions that hold them."""
    info = fx.get("vocab_info") or {}
    vocab = list(fx.get("vocab") or [])
    assert vocab and info.get("padded_vocab_size", 0) > info.get("original_vocab_size", 0), (vocab, info)
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for f in sorted(theirs.iterdir()):
        a, b = torch.load(f, weights_only=False), torch.load(mine / f.name, weights_only=False)
        structure: list = []
        _walk(a, b, f.name, structure)  # the same keys, types and lengths; values may differ (below)
        assert not [d for d in structure if ": " in d], structure
        out: list = []
        _differing(a, b, f.name, out)
        for path, n in out:
            assert n is not None and (any(path.endswith(f"/module/{v}") for v in vocab)
                                      or "single_partition_of_fp32_groups" in path), (path, n)
        pad_elements = sum((info["padded_vocab_size"] - info["original_vocab_size"]) * cols for _ in vocab)
        assert sum(n for _, n in out) <= pad_elements * 2, out  # each vocabulary tensor's rows, module and master


@pytest.fixture(scope="module")
def tp_loads(parallel_universal, tmp_path_factory):
    """DeepSpeed loads (the parallel harness, an mpu model at tp 2) of the native tp 2 x dp 1 files made from
    ds_to_universal's folder of tp2_dp2_z1_bf16."""
    from tests.fixtures.parallel.check import make_job, run_load_checks

    fx, _, uni = parallel_universal["tp2_dp2_z1_bf16"]
    work = tmp_path_factory.mktemp("utp")
    out = ckptlib.reshard(uni, work / "tp2dp1", 1).out
    job, world = make_job(fx["path"], dp=1, checkpoint_dir=out, name="universal->tp2dp1")
    return run_load_checks([job], world, work / "w")


@pytest.mark.parametrize("name", TP_SOURCES)
def test_a_tensor_parallel_universal_folder_back_to_native_files(parallel_universal, tp_loads, tmp_path, name):
    """ds_to_universal cuts a tensor-parallel vocabulary to original_vocab_size rows; back to native files the
    rows are padded to the recorded padded_vocab_size with zeros (as DeepSpeed's universal loader pads them) and the
    tensors cut by the folder's universal_checkpoint_info. At the source's mesh (tp 2 x dp 2, the default) every
    file is the original's, object for object and bit for bit, but the padding rows (never trained: the original
    holds their initial values there); at tp 1 the native reshard of the original's, likewise; DeepSpeed loads the
    tp 2 x dp 1 files natively with the reference's masters, moments and step on every real row (ZeRO-1 bf16; the
    fp32 ZeRO-2 and BF16_Optimizer sources are compared file by file)."""
    from tests.test_parallel_reshard import check_loaded

    fx, original, uni = parallel_universal[name]
    same_mesh = ckptlib.plan_reshard(uni, tmp_path / "same", 2)
    assert (same_mesh.to_mesh.tp, same_mesh.to_mesh.dp) == (2, 2)
    ckptlib.reshard(same_mesh)
    assert ckptlib.verify(same_mesh).ok
    tp1 = ckptlib.reshard(uni, tmp_path / "tp1", 2, tp=1).out
    native_tp1 = ckptlib.reshard(fx["checkpoint_path"], tmp_path / "native_tp1", 2, tp=1).out
    with ckptlib.open_checkpoint(uni) as ck:
        cols = ck.param(fx["vocab"][0]).shape[1]
    _only_padding_rows(tmp_path / "same" / fx["tag"], original, fx, cols)
    _only_padding_rows(Path(tp1) / fx["tag"], Path(native_tp1) / fx["tag"], fx, cols)
    if name == TP_SOURCES[0]:
        check_loaded(fx, tp_loads["universal->tp2dp1"], universal=True)


@pytest.mark.parametrize("name,m", UNIVERSAL_LOADS, ids=[f"{n}@{m}" for n, m in UNIVERSAL_LOADS])
def test_verify_loaded_after_a_universal_load(loads, name, m):
    """After engine.load_checkpoint in universal mode, verify_loaded against the universal folder passes (masters,
    moments, step, and the buffers, which the engine was built with as saved); a folder whose fc1.weight exp_avg was
    zeroed, checked against the original, is named: the engine holds zeros there."""
    got = loads[f"{name}-universal@{m}"]
    assert "error" not in got, got.get("error")
    assert got["verify"]["ok"], got["verify"]["mismatches"]
    assert got["verify"]["step"] == [2, 2] or tuple(got["verify"]["step"]) == (2, 2)
    bad = loads[f"{name}-zeroed@{m}"]
    assert "error" not in bad, bad.get("error")
    assert not bad["verify"]["ok"]
    assert {(n, w) for n, w, _ in bad["verify"]["mismatches"]} == {("fc1.weight", "exp_avg")}, bad["verify"]


# ================================================================================================ AutoEP
AUTOEP = ["mixtral_z2_w2_ep2", "mixtral_z3_w2_ep2"]


@pytest.fixture(scope="module")
def autoep_universal(autoep_fixtures, tmp_path_factory):
    return _converted({n: autoep_fixtures[n] for n in AUTOEP}, tmp_path_factory.mktemp("uautoep"))


@pytest.mark.parametrize("name", AUTOEP)
def test_an_autoep_universal_folder(autoep_universal, tmp_path, name):
    """ds_to_universal's folder of an AutoEP run (Mixtral, ep 2, ZeRO-2 and ZeRO-3): each layer's experts are one
    [experts, ...] tensor under the engine's name, the gate its router's alias (ds_to_universal writes the 16-bit copy
    of it in a folder of its own, which is not read); it equals the original tensor for tensor with every state and
    step (diff and check --against), exports as the original does (in transformers' Mixtral layout with the model
    config); native files from it: test_an_autoep_universal_folder_back_to_native_files."""
    fx, original, uni = autoep_universal[name]
    code, text = _cli("inspect", uni, "--json")
    assert code == 0, text
    d = json.loads(text)
    assert d["universal"]["experts"] == "AutoEP" and not d["problems"], d["problems"]
    experts = [p for p in d["parameters"] if p["name"].endswith("mlp.experts.w1")]
    assert experts and all(p["shape"][0] == 4 for p in experts), experts  # all 4 experts, not ep rank 0's 2
    assert any(p["tied_to"] and p["name"].endswith("gate.gate.weight") for p in d["parameters"])
    result = ckptlib.diff(original, uni, states=True)
    assert result.ok and any(t.key.startswith("step/") for t in result.tensors), result.summary()
    code, text = _cli("check", uni, "--against", original, "-q")
    assert code == 0, text
    config = fx["path"] / "hf_config" / "config.json"  # the experts in transformers' Mixtral layout, as natively
    a = ckptlib.export(original, tmp_path / "a", states=["all"], model_config=config).out
    b = ckptlib.export(uni, tmp_path / "b", states=["all"], model_config=config).out
    for sub in ("", "exp_avg", "exp_avg_sq"):
        wa, wb = load_file(Path(a) / sub / "model.safetensors"), load_file(Path(b) / sub / "model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), sub


#: (source, world, ep) the AutoEP folders go back to: their own mesh, and ep 4 at 4 ranks
AUTOEP_NATIVE = [(n, w, e) for n in AUTOEP for w, e in ((2, 2), (4, 4))]


@pytest.fixture(scope="module")
def autoep_loads(autoep_universal, tmp_path_factory):
    from tests.fixtures.autoep.load_check import job_for_fixture, run_load_checks

    work = tmp_path_factory.mktemp("uautoep-loads")
    jobs: dict = {}
    for name, world, ep in AUTOEP_NATIVE:
        fx, _, uni = autoep_universal[name]
        out = ckptlib.reshard(uni, work / f"{name}-w{world}ep{ep}", world, ep=ep).out
        jobs.setdefault((world, ep), []).append(job_for_fixture(fx, checkpoint_dir=out, name=f"{name}->w{world}ep{ep}",
                                                                ep_size=ep))
    results = {}
    for (world, ep), js in sorted(jobs.items()):  # one launch per mesh, both sources in it
        results.update(run_load_checks(js, world, work / f"run-w{world}", timeout=300))
    return results


@pytest.mark.parametrize("name,world,ep", AUTOEP_NATIVE, ids=[f"{n}->w{w}ep{e}" for n, w, e in AUTOEP_NATIVE])
def test_an_autoep_universal_folder_back_to_native_files(autoep_universal, autoep_fixtures, autoep_loads, tmp_path,
                                                         name, world, ep):
    """AutoEP (Mixtral, ep 2; ZeRO-2 and ZeRO-3) from ds_to_universal's folder to native files at 2 ranks ep 2 and 4
    ranks ep 4: every file (ZeRO-2: the per-expert 16-bit files made from the masters included; ZeRO-3: each rank's
    sub-groups, experts over their ep rank's members) is what the native reshard of the original writes, object for
    object and bit for bit, but universal_checkpoint_info's expert_parameter_patterns, which ds_to_universal rewrote
    in the ZeRO-2 model-states file it copied ('.*\\.experts...' -> '\\.experts...'); DeepSpeed's AutoEP engine loads
    them with the reference's masters, moments, 16-bit weights and step."""
    fx, original, uni = autoep_universal[name]
    plan = ckptlib.plan_reshard(uni, tmp_path / "mine", world, ep=ep)
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    native = ckptlib.reshard(fx["checkpoint_path"], tmp_path / "native", world, ep=ep).out
    a, b = Path(native) / fx["tag"], tmp_path / "mine" / fx["tag"]
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in sorted(a.iterdir()):
        diffs: list = []
        _walk(torch.load(f, weights_only=False), torch.load(b / f.name, weights_only=False), f.name, diffs)
        assert all("universal_checkpoint_info/expert_parameter_patterns" in d for d in diffs), diffs[:5]
    got = autoep_loads[f"{name}->w{world}ep{ep}"]
    assert "error" not in got, got.get("error")
    assert got["world_size"] == world and got["ep_size"] == ep
    from tests.test_autoep import assert_loaded_exactly

    assert_loaded_exactly(got["loaded"], torch.load(fx["path"] / "reference.pt", weights_only=False))


# ================================================================================================ off DeepSpeed
@pytest.mark.parametrize("name", ["z2_bf16_w2", "z3_bf16_w2"])
def test_dcp_with_the_optimizer_from_a_universal_folder(universal, fixture_by_name, tmp_path, name):
    """`ckpt export UNIVERSAL OUT --format dcp --optimizer` carries a run off DeepSpeed from its universal folder:
    the DCP checkpoint (model, AdamW states, steps, hyper-parameters), read back by torch's own dcp_to_torch_save,
    equals the one exported from the original, object for object; `--universal` on a universal folder is refused."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    fx = fixture_by_name(name)
    trees = []
    for what, src in (("native", fx["checkpoint_path"]), ("universal", universal[(name, "ds")])):
        out = ckptlib.export(src, tmp_path / what, format="dcp", dcp={"optimizer": True}).out
        dcp_to_torch_save(out, tmp_path / f"{what}.pt")
        trees.append(torch.load(tmp_path / f"{what}.pt", weights_only=False))
    diffs: list = []
    _walk(trees[0], trees[1], "dcp", diffs)
    assert not diffs and trees[0]["optimizer"]["state"], diffs[:5]
    code, text = _cli("reshard", universal[(name, "ds")], tmp_path / "u", "--universal")
    assert code == 2 and "already a universal checkpoint" in text, text
