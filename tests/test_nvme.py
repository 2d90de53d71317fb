"""NVMe-offloaded (ZeRO-Infinity) checkpoints made by DeepSpeed on CPU (tests/fixtures/nvme): inspect lists
the swap files, export (with the optimizer states) and check read them exactly, reshard writes an ordinary
ZeRO-3 checkpoint that DeepSpeed loads exactly at 1 and 2 ranks with CPU offload or none, DeepSpeed's
own NVMe load is caught by verify_loaded and predicted by the resume check, and damaged swap folders
are refused naming the file."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckptlib
from ckptlib.analysis.resume import DROPS, LOADS, REFUSED, resume_check
from ckptlib.errors import CkptError
from tests.fixtures.compare import assert_masters_and_moments_equal, reference
from tests.fixtures.torchrun import launch_env

SWAPPING = ["nvme_one_fp32_adamw", "nvme_one_bf16_adamw", "nvme_one_fp32_cpuadam", "nvme_one_bf16_cpuadam",
            "nvme_all_fp32_adamw", "nvme_all_bf16_cpuadam"]
NONE = ["nvme_none_fp32_adamw", "nvme_none_bf16_cpuadam"]


@pytest.fixture(scope="module")
def nvme():
    from tests.fixtures.nvme import factory

    why = factory.ops_missing()
    if why:
        pytest.skip(why)
    root = factory.ensure_fixtures()
    return {fx["name"]: fx for fx in factory.list_fixtures(root)}


def ckpt_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True,
                          env=launch_env(), timeout=600)


def test_fixtures_swap_as_described(nvme):
    """What the generator asked for is what DeepSpeed did (guards the other tests' meaning)."""
    assert sorted(nvme) == sorted(SWAPPING + NONE)
    for name, fx in nvme.items():
        n = len(fx["sub_group_partition_numel"])
        want = {"one": [0], "all": list(range(n)), "none": []}[fx["swap"]]
        assert fx["swapped_sub_groups"] == want, name
        assert fx["base_optimizer_class"] == ("DeepSpeedCPUAdam" if fx["optimizer"] == "cpuadam" else "AdamW")
        swaps = [f for f in fx["files"] if "/offloaded_tensors/" in f]
        assert len(swaps) == (0 if fx["swap"] == "none" else 2 * 3 * len(want)), (name, swaps)


@pytest.mark.parametrize("name", SWAPPING + NONE)
def test_inspect_lists_the_swap_files(nvme, name):
    fx = nvme[name]
    r = ckpt_cli("inspect", fx["checkpoint_path"], "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["problems"] == [] and d["cannot_read"] == []
    listed = {f["path"].split("/ckpt/")[-1] if "/ckpt/" in f["path"] else f["path"]: f for f in d["files"]}
    swaps = {f: size for f, size in fx["files"].items() if "/offloaded_tensors/" in f}
    got = {p: f["bytes"] for p, f in listed.items() if f["kind"] == "swap"}
    assert got == swaps
    assert all(listed[p]["dp_rank"] == int(p.split("/rank")[1][:2]) for p in got)
    # every file is counted: the total is the tag folder's
    tag_files = {f: s for f, s in fx["files"].items() if f.startswith(fx["tag"] + "/")}
    assert d["total_bytes"] == sum(tag_files.values())
    assert d["bytes_read"] < d["total_bytes"]
    text = ckpt_cli("inspect", fx["checkpoint_path"]).stdout
    if swaps:
        assert "swap" in text and "NVMe offload" in text and "ckpt reshard" in text


@pytest.mark.parametrize("name", SWAPPING)
def test_swap_files_matched_by_deepspeeds_ids(nvme, name):
    """The sub-group -> file matching agrees with the ds_ids the live engine had (recorded by the generator)."""
    fx = nvme[name]
    ck = ckptlib.open_checkpoint(fx["checkpoint_path"])
    swapped = ck.main.records.index.swapped
    assert sorted(swapped) == sorted((r, k) for r in range(fx["world_size"]) for k in fx["swapped_sub_groups"])
    for (r, k), tensors in swapped.items():
        ids = fx["sub_group_ds_ids"][r][k]
        assert tensors[None].path.endswith(f"/offloaded_tensors/rank{r:02d}/{ids[0]}_{ids[-1]}.tensor.swp")
        assert sorted(t for t in tensors if t) == ["exp_avg", "exp_avg_sq"]
        assert tensors[None].count == fx["sub_group_partition_numel"][k]


@pytest.mark.parametrize("name", SWAPPING + NONE)
def test_export_with_states_is_exact(nvme, name, tmp_path):
    fx = nvme[name]
    ref = reference(fx)
    out = tmp_path / "out"
    ckptlib.export(ckptlib.plan_export(fx["checkpoint_path"], out, states=["exp_avg", "exp_avg_sq"]))
    weights = safetensors.torch.load_file(out / "model.safetensors")
    for p, want in ref["fp32"].items():
        assert torch.equal(weights[p], want), p
    for key in ("exp_avg", "exp_avg_sq"):
        sd = safetensors.torch.load_file(out / key / "model.safetensors")
        assert set(sd) == set(ref["optim"])
        for p, moments in ref["optim"].items():
            assert torch.equal(sd[p], moments[key]), (key, p)
    for p, want in ref["frozen"].items():
        assert torch.equal(weights[p], want.float()), p


@pytest.mark.parametrize("name", SWAPPING + NONE)
def test_check_reads_the_swap_files(nvme, name):
    fx = nvme[name]
    result = ckptlib.check(ckptlib.plan_check(fx["checkpoint_path"], states=True))
    assert result.ok, result.describe()
    r = ckpt_cli("check", fx["checkpoint_path"], "--states", "-q")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["nvme_all_fp32_adamw", "nvme_one_bf16_cpuadam"])
def test_universal_and_diff(nvme, name, tmp_path):
    """The universal layout holds every swapped partition: `ckpt diff --states` finds it equal to the source."""
    fx = nvme[name]
    ckptlib.write_universal(fx["checkpoint_path"], tmp_path / "uni")
    r = ckpt_cli("diff", fx["checkpoint_path"], tmp_path / "uni", "--states", "-q")
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 changed" in r.stdout and "0 only in A" in r.stdout and "0 only in B" in r.stdout, r.stdout


def _copy(fx, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], dst)
    return dst, dst / fx["tag"] / "offloaded_tensors"


def test_damaged_swap_folders_are_refused(nvme, tmp_path):
    fx = nvme["nvme_all_fp32_adamw"]
    cases = {}
    dst, swap = _copy(fx, tmp_path / "missing")
    victim = sorted((swap / "rank01").glob("exp_avg_sq-*"))[0]
    victim.unlink()
    cases["missing"] = (dst, victim.name)
    dst, swap = _copy(fx, tmp_path / "short")
    victim = sorted((swap / "rank00").glob("[0-9]*"))[0]
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 1024)
    cases["short"] = (dst, victim.name)
    dst, swap = _copy(fx, tmp_path / "renamed")
    for f in sorted((swap / "rank00").iterdir()):  # ids shifted by one: no offset names every sub-group
        stem = f.name.split(".")[0]
        state, _, ids = stem.rpartition("-")
        a, b = map(int, ids.split("_"))
        f.rename(f.with_name(f"{state + '-' if state else ''}{a + 1}_{b + 1}.tensor.swp"))
    cases["renamed"] = (dst, "rank00")
    dst, swap = _copy(fx, tmp_path / "exchanged")  # the two sub-groups' partition files swap names
    first, second = sorted((swap / "rank01").glob("[0-9]*"))
    first.rename(swap / "rank01" / "tmp")
    second.rename(first)
    (swap / "rank01" / "tmp").rename(second)
    cases["exchanged"] = (dst, first.name)
    dst, swap = _copy(fx, tmp_path / "gone")
    shutil.rmtree(swap)
    cases["gone"] = (dst, "offloaded_tensors")
    for case, (path, named) in cases.items():
        for cmd in (("export", path, tmp_path / f"out-{case}"), ("check", path)):
            r = ckpt_cli(*cmd)
            assert r.returncode == 2, (case, cmd[0], r.stdout, r.stderr)
            assert named in r.stderr and "Traceback" not in r.stderr, (case, r.stderr)
        with pytest.raises(CkptError):
            ckptlib.plan_reshard(path, tmp_path / f"re-{case}", 2)


# ----------------------------------------------------------------------------------------------- loads
@pytest.fixture(scope="module")
def resharded(nvme, tmp_path_factory):
    """Each swapping fixture resharded to 1 and 2 ranks (ordinary ZeRO-3: every partition in the .pt files)."""
    root = tmp_path_factory.mktemp("nvme-resharded")
    out = {}
    for name in SWAPPING:
        for m in (1, 2):
            dst = root / f"{name}-w{m}"
            plan = ckptlib.plan_reshard(nvme[name]["checkpoint_path"], dst, m)
            assert any("NVMe offload" in n for n in plan.notes)
            ckptlib.reshard(plan)
            assert not list(dst.rglob("*.swp"))
            out[(name, m)] = dst
    return out


@pytest.fixture(scope="module")
def loads(nvme, resharded, tmp_path_factory):
    """DeepSpeed loads: the resharded checkpoints at 1 and 2 ranks (CPU offload and none), and the original
    NVMe checkpoints with DeepSpeed's own NVMe load (2 ranks) and at 1 rank."""
    from tests.fixtures.nvme.factory import run_loads

    work = tmp_path_factory.mktemp("nvme-loads")
    results = {}
    for m in (1, 2):
        jobs = []
        for name in SWAPPING:
            for offload in ("cpu", "none"):
                jobs.append({"name": f"{name}/re-w{m}/{offload}", "checkpoint_dir": str(resharded[(name, m)]),
                             "tag": None, "spec": name, "offload": offload, "verify": None})
        for name in ("nvme_one_fp32_adamw", "nvme_all_bf16_cpuadam"):
            for offload in ("nvme", "cpu"):
                jobs.append({"name": f"{name}/{offload}-load", "checkpoint_dir": str(nvme[name]["checkpoint_path"]),
                             "tag": None, "spec": name, "offload": offload, "verify": None})
        results.update({(m, k): v for k, v in run_loads(jobs, m, work / f"w{m}").items()})
    return results


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("name", SWAPPING)
def test_resharded_loads_exactly_in_deepspeed(nvme, loads, name, m):
    ref = reference(nvme[name])
    for offload in ("cpu", "none"):
        res = loads[(m, f"{name}/re-w{m}/{offload}")]
        assert "error" not in res, res
        assert_masters_and_moments_equal(res["loaded"], ref)
        assert res["verify"]["ok"], res["verify"]["mismatches"][:5]


@pytest.mark.parametrize("name", ["nvme_one_fp32_adamw", "nvme_all_bf16_cpuadam"])
def test_deepspeeds_nvme_load_is_caught(nvme, loads, name):
    """DeepSpeed 0.19.8's own NVMe load at the saved size restores the swapped masters only; verify_loaded
    finds what it dropped, and the resume check predicted it."""
    ref = reference(nvme[name])
    res = loads[(2, f"{name}/nvme-load")]
    assert "error" not in res, res
    assert not res["verify"]["ok"]
    found = {}
    for n, what, _ in res["verify"]["mismatches"]:
        found.setdefault(what, set()).add(n)
    # DeepSpeed copies the swap files back under their names, which hold the saving engine's parameter ids: the
    # swapped masters come back only for an engine with the same ids (this harness's engines have others, so
    # none does); the masters of the sub-groups kept in memory and every moment never come back
    swapped = {p for p in ref["fp32"] if nvme[name]["swap"] == "all" or p.endswith("weight")}  # sub-group 0: weights
    assert found.get("fp32", set()) >= set(ref["fp32"]) - swapped, "what DeepSpeed's NVMe load restores changed"
    assert found["exp_avg"] == set(ref["optim"]), "DeepSpeed restored moments: the silent-drop prediction is out of date"
    assert ("optimizer", "step") in {(n, what) for n, what, _ in res["verify"]["mismatches"]}
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
           "bf16": {"enabled": nvme[name]["dtype"] == "bf16"}}
    assert resume_check(nvme[name]["checkpoint_path"], cfg, 2).verdict == DROPS


def test_deepspeeds_nvme_load_at_another_size_is_refused(nvme, loads):
    for name in ("nvme_one_fp32_adamw", "nvme_all_bf16_cpuadam"):
        res = loads[(1, f"{name}/nvme-load")]
        assert "error" in res, res
        cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
        assert resume_check(nvme[name]["checkpoint_path"], cfg, 1).verdict == REFUSED


def test_loading_the_placeholders_is_refused(nvme, loads):
    """Without NVMe offload DeepSpeed reads the .pt files, whose swapped partitions are empty placeholders."""
    for name in ("nvme_one_fp32_adamw", "nvme_all_bf16_cpuadam"):
        res = loads[(2, f"{name}/cpu-load")]
        cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
               "bf16": {"enabled": nvme[name]["dtype"] == "bf16"}}
        predicted = resume_check(nvme[name]["checkpoint_path"], cfg, 2)
        assert predicted.verdict == REFUSED
        assert "error" in res and res["phase"] == "load", res
        assert res["error"] in [f.deepspeed for f in predicted.findings], (res["error"], predicted.describe())


def test_resume_check_on_the_resharded(nvme, resharded):
    for name in SWAPPING:
        for m in (1, 2):
            for device in ("cpu", None):
                zero = {"stage": 3, **({"offload_optimizer": {"device": device}} if device else {})}
                assert resume_check(resharded[(name, m)], {"zero_optimization": zero,
                                                           "bf16": {"enabled": nvme[name]["dtype"] == "bf16"}},
                                    m).verdict == LOADS


def test_deepspeeds_converter_on_them(nvme, tmp_path):
    """zero_to_fp32 reads the empty placeholders of swapped sub-groups and fails (what docs/resume.md says);
    with nothing swapped it works and agrees with ckptlib's export."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name in ("nvme_one_fp32_adamw", "nvme_all_bf16_cpuadam"):
        with pytest.raises(Exception):
            get_fp32_state_dict_from_zero_checkpoint(str(nvme[name]["checkpoint_path"]))
    fx = nvme["nvme_none_fp32_adamw"]
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(fx["checkpoint_path"]))
    ckptlib.export(ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out"))
    ours = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(ours[k], v.float()) for k, v in theirs.items())


@pytest.mark.parametrize("name", ["nvme_all_bf16_cpuadam"])
def test_the_notebooks_show_an_nvme_checkpoint(nvme, name, tmp_path):
    """Issue 38's NVMe family: inspect's text is its JSON's and the browser's tabs state it (the swap files listed);
    01_browse and 02_partition_layout run on it with no error output and state what inspect states
    (tests/test_notebook_families.py's checks)."""
    from tests.test_notebook_families import check_01, check_02, check_tabs
    from tests.test_notebooks import _execute

    path = Path(nvme[name]["checkpoint_path"])
    check_tabs(path)
    for notebook, check in (("01_browse", check_01), ("02_partition_layout", check_02)):
        executed = tmp_path / f"{notebook}.ipynb"
        _execute(notebook, path, tmp_path / "output", executed)
        check(executed, path)
