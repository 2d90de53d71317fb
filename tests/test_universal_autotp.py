"""AutoTP universal folders back to native files (issue 32): folders written by DeepSpeed 0.19.8's ds_to_universal
from real AutoTP checkpoints (a tiny Llama at tp 2; ZeRO-1/2/3, bf16 and fp32, a tied head) go through the same
planner as a native AutoTP source: the split rules and affine_map from the folder's universal_checkpoint_info, the
key-value heads from the model config. Every file, at the source's tensor size and at tp 1, 3 and 4, is the native
reshard of the original, object for object and bit for bit; real AutoTP engines (and the plain model at tp 1) load
them natively with the reference's masters, moments, 16-bit weights and step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptlib
from tests.fixtures.compare import assert_holds_the_reference
from tests.fixtures.universal import ds_to_universal
from tests.test_universal_source import _walk

SOURCES = ["autotp_tp2_dp1_z1_bf16", "autotp_tp2_dp1_z3_bf16", "autotp_tp2_dp1_z2_fp32", "autotp_tp2_dp1_z2_bf16_tied",
           "autotp_tp2_dp2_z3_bf16_tied"]
#: (dp, tp) each folder is written back for: the source's tp at another dp, the plain model, AutoTP's even and uneven
#: head splits
MESHES = [(2, 2), (1, 1), (1, 4), (1, 3)]
#: DeepSpeed loads: case -> (source, dp, tp); one launch per world size (AutoTP engines and the plain model apart)
LOADS = {"z1_bf16-tp4": ("autotp_tp2_dp1_z1_bf16", 1, 4),
         "z3_bf16-tp4": ("autotp_tp2_dp1_z3_bf16", 1, 4),
         "z3_tied-tp2-dp1": ("autotp_tp2_dp2_z3_bf16_tied", 1, 2),
         "tied-tp1-dp2": ("autotp_tp2_dp1_z2_bf16_tied", 2, 1),
         "z2_fp32-tp1-dp2": ("autotp_tp2_dp1_z2_fp32", 2, 1)}


def _config(fx, folder: Path) -> Path:
    """The model's HF config.json (what the HF Trainer saves beside the checkpoint), from the fixture's record."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(dict(fx["model_config"], model_type="llama")))
    return path


@pytest.fixture(scope="module")
def autotp_universal(parallel_fixtures, tmp_path_factory):
    """``{name: (fixture, original tag folder, ds_to_universal's folder, model config)}``."""
    root = tmp_path_factory.mktemp("uautotp")
    fixtures = {n: parallel_fixtures[n] for n in SOURCES}
    return {name: (fixtures[name], save / fixtures[name]["tag"], save / f"{fixtures[name]['tag']}_universal",
                   _config(fixtures[name], root / "config" / name))
            for name, save in ds_to_universal(fixtures, root / "ds").items()}


@pytest.mark.parametrize("name", SOURCES)
def test_native_files_from_an_autotp_folder_are_the_native_reshards(autotp_universal, tmp_path, name):
    fx, original, folder, config = autotp_universal[name]
    for dp, tp in MESHES:
        where = tmp_path / f"dp{dp}tp{tp}"
        native = Path(ckptlib.reshard(original, where / "native", dp, tp=tp, model_config=config).out) / fx["tag"]
        plan = ckptlib.plan_reshard(folder, where / "mine", dp, tp=tp, model_config=config)
        mine = Path(ckptlib.reshard(plan).out) / fx["tag"]
        assert ckptlib.verify(plan).ok
        names = sorted(p.name for p in native.iterdir())
        assert sorted(p.name for p in mine.iterdir()) == names, (dp, tp)
        diffs: list = []
        for f in names:
            _walk(torch.load(native / f, weights_only=False), torch.load(mine / f, weights_only=False), f, diffs)
        assert diffs == [], ((dp, tp), diffs[:5])


def test_a_tensor_size_change_needs_the_model_config(autotp_universal, tmp_path):
    """AutoTP cuts attention by the key-value heads, which the folder does not record: without the model config the
    reshard to another tensor size above 1 is refused before anything is written."""
    _, _, folder, _ = autotp_universal["autotp_tp2_dp1_z1_bf16"]
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="model's config"):
        ckptlib.plan_reshard(folder, tmp_path / "out", 1, tp=4)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def autotp_loads(autotp_universal, tmp_path_factory):
    from tests.fixtures.hf_parallel.load_check import run_load_checks

    work = tmp_path_factory.mktemp("uautotp-load")
    jobs: dict = {}
    outs = {}
    for case, (name, dp, tp) in LOADS.items():
        fx, _, folder, config = autotp_universal[name]
        outs[case] = ckptlib.reshard(folder, work / case, dp, tp=tp, model_config=config).out
        jobs.setdefault((tp > 1, dp * tp), []).append({"name": case, "fixture_dir": str(fx["path"]),
                                             "checkpoint_dir": str(outs[case]), "tag": None, "tp": tp,
                                             "save_to": str(work / f"{case}-saved")})
    results = {}
    for (autotp, world), js in sorted(jobs.items()):  # the plain model (tp 1) in launches of its own
        results.update(run_load_checks(js, world, work / f"w{world}{'-autotp' if autotp else ''}"))
    return results, outs


@pytest.mark.parametrize("case", LOADS)
def test_deepspeed_loads_them_natively_with_the_references_values(autotp_universal, autotp_loads, case):
    """engine.load_checkpoint (no universal mode): an AutoTP engine at tp 2 and 4, the plain model at tp 1; named as
    the loading engine names its own files."""
    results, outs = autotp_loads
    name, dp, tp = LOADS[case]
    fx = autotp_universal[name][0]
    res = results[case]
    assert "error" not in res, (res.get("phase"), res.get("error"))
    assert (res["par"], res["dp"]) == (tp, dp)
    assert_holds_the_reference(res["loaded"], fx, buffers=False)  # the tiny Llama saves no buffer
    assert sorted(p.name for p in (Path(outs[case]) / fx["tag"]).iterdir()) == sorted(res["saved_files"])
