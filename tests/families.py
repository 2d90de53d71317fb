"""One real checkpoint of each family the notebooks must show (issue 38), by family name, for the tests that run the
notebooks and their widgets on each (tests/test_notebook_families.py, tests/test_browser.py).

Every checkpoint is one DeepSpeed 0.19.8 wrote on CPU (the cached fixture factories), or a universal folder made from
one (ckptlib's, and DeepSpeed's own ``ds_to_universal`` of a pipeline). NVMe-offloaded checkpoints are shown by
tests/test_nvme.py, which runs last (it waits for DeepSpeed's async_io op to build).
"""
from __future__ import annotations

import importlib
from pathlib import Path

#: family -> (fixture factory module, fixture name)
FAMILIES = {
    "adam-z0": ("tests.fixtures.factory", "z0_bf16_w2"),
    "adam-z1": ("tests.fixtures.factory", "z1_bf16_w3"),
    "adam-z2": ("tests.fixtures.factory", "z2_fp32_w2"),
    "adam-z3": ("tests.fixtures.factory", "z3_bf16_w3"),
    "bf16-optimizer": ("tests.fixtures.factory", "bf16opt_w2"),
    "muon-z1": ("tests.fixtures.optim.factory", "muon_z1_fp32_w2"),
    "muon-z2": ("tests.fixtures.optim.factory", "muon_z2_bf16_w3"),
    "muon-z3": ("tests.fixtures.optim.factory", "muon_z3_bf16_w2"),
    "sgd": ("tests.fixtures.optim.factory", "sgd_z2_bf16_w2"),
    "adagrad": ("tests.fixtures.optim.factory", "adagrad_1group_z1_bf16_w2"),
    "rmsprop": ("tests.fixtures.optim.factory", "rmsprop_z3_bf16_w2"),
    "adafactor": ("tests.fixtures.optim.factory", "adafactor_z2_bf16_w2"),
    "cpu-lion": ("tests.fixtures.optim.factory", "cpu_lion_z2_bf16_w2"),
    "cpu-adagrad": ("tests.fixtures.optim.factory", "cpu_adagrad_z3_bf16_w2"),
    "autoep-z2": ("tests.fixtures.autoep.factory", "mixtral_z2_w4_ep2"),
    "autoep-z3": ("tests.fixtures.autoep.factory", "mixtral_z3_w2_ep2"),
    "deepspeed-moe": ("tests.fixtures.parallel.factory", "moe_ep2_z2_bf16"),
    "pipeline": ("tests.fixtures.parallel.factory", "pp2_dp2_z1_bf16"),
    "autotp": ("tests.fixtures.hf_parallel.factory", "autotp_tp2_dp2_z2_bf16"),
    "3d": ("tests.fixtures.mesh.factory", "pp2_tp2_dp2_z1_bf16"),
    "legacy": ("tests.fixtures.legacy.factory", "legacy_z2_bf16_w2"),
    "peft": ("tests.fixtures.peft.factory", "peft_lora_qv_z3"),
    "bf16-masters": ("tests.fixtures.bf16_masters.factory", "adamw_bf16_masters_z2_w2"),
}
#: the universal folders: family -> the fixture it is made from (ckptlib's write_universal; DeepSpeed's ds_to_universal)
UNIVERSAL = {"universal-ckptlib": ("tests.fixtures.factory", "z2_bf16_w2"),
             "universal-ds-pipeline": ("tests.fixtures.parallel.factory", "pp2_dp2_z1_bf16")}


def _fixture(module: str, name: str) -> dict:
    mod = importlib.import_module(module)
    if module == "tests.fixtures.factory":
        root = mod.ensure_fixtures(worlds=(1, 2, 3, 4))
    else:
        root = mod.ensure_fixtures(verbose=False)
    found = {fx["name"]: fx for fx in mod.list_fixtures(root)}
    return found[name]


def family_checkpoints(tmp: Path, only=None) -> dict:
    """``{family: checkpoint path}`` of every family (``only``: those named), the universal folders made in ``tmp``."""
    import ckptlib

    out = {}
    for family, (module, name) in FAMILIES.items():
        if only is None or family in only:
            out[family] = Path(_fixture(module, name)["checkpoint_path"])
    if only is None or "universal-ckptlib" in only:
        fx = _fixture(*UNIVERSAL["universal-ckptlib"])
        made = ckptlib.write_universal(fx["checkpoint_path"], tmp / "universal-ckptlib").out
        out["universal-ckptlib"] = made / f"{fx['tag']}_universal"
    if only is None or "universal-ds-pipeline" in only:
        from tests.fixtures.universal import ds_to_universal

        fx = _fixture(*UNIVERSAL["universal-ds-pipeline"])
        save = ds_to_universal({"p": fx}, tmp / "universal-ds")["p"]
        out["universal-ds-pipeline"] = save / f"{fx['tag']}_universal"
    return out


__all__ = ["FAMILIES", "UNIVERSAL", "family_checkpoints"]
