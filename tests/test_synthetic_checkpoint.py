"""bench/make_synthetic_checkpoint.py writes what DeepSpeed writes, minus the tensor bytes.

A tiny Llama-shaped model at 4 ranks, ZeRO-2 and ZeRO-3: the key trees (keys, order, value types,
tensor dtypes) and the globals the pickles name equal those of the real DeepSpeed fixtures of the same
stage; the zip CRCs are those of the (all-zero) data; the files are sparse; ckptlib reads them without
a problem, plans on them, and an export of them reads zeros from exactly the holes.
"""
from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.io.torchzip import TensorHandle, open_torch_file
from ckptlib.io.torchzip.standins import Standin

spec = importlib.util.spec_from_file_location("make_synthetic_checkpoint",
                                              Path(__file__).resolve().parents[1] / "bench" / "make_synthetic_checkpoint.py")
synth = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = synth  # dataclasses look their module up
spec.loader.exec_module(synth)

TINY = dict(layers=2, hidden=64, intermediate=96, vocab=50, heads=4, kv_heads=2)
NAMES = {"module", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
         "param_slice_mappings", "param_alignment_paddings", "ds_config", "buffer_names", "lr_scheduler"}


def shape_of(obj, key=None):
    """The tree's keys and value kinds; the contents of model-dependent entries are left out."""
    if key in NAMES:
        return type(obj).__name__
    if isinstance(obj, TensorHandle):
        return ("tensor", obj.dtype_name, obj.requires_grad, bool(obj.py_state))
    if isinstance(obj, dict):
        return (type(obj).__name__, tuple((k, shape_of(v, k)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, shape_of(obj[0]) if obj else None)
    if isinstance(obj, Standin):
        return (obj.qualname, tuple(sorted(obj.to_dict())))
    return type(obj).__name__


@pytest.fixture(scope="module", params=[2, 3])
def pair(request, tmp_path_factory, fixture_by_name):
    stage = request.param
    out = tmp_path_factory.mktemp(f"synth{stage}") / "ckpt"
    info = synth.make(out, stage, 4, step=2, **TINY)
    return stage, out, info, fixture_by_name(f"z{stage}_bf16_w4")["checkpoint_path"]


def files(root: Path):
    tag = (root / "latest").read_text()
    return sorted((root / tag).glob("*.pt"))


def test_key_trees_and_globals_are_those_deepspeed_writes(pair):
    stage, out, _, real = pair
    ours, theirs = files(out), files(real)
    assert len(ours) == (8 if stage == 3 else 5)  # ZeRO-3: a model-states file per rank too
    assert [f.name for f in ours] == [f.name for f in theirs]
    named = set()
    for a, b in zip(ours, theirs):
        ta, tb = open_torch_file(a).obj, open_torch_file(b).obj
        assert shape_of(ta) == shape_of(tb), a.name
        names = set(torch.serialization.get_unsafe_globals_in_checkpoint(a))
        assert names == set(torch.serialization.get_unsafe_globals_in_checkpoint(b)), a.name
        named |= names
        if "optim" in a.name:
            osd_a, osd_b = ta["optimizer_state_dict"], tb["optimizer_state_dict"]
            assert list(osd_a) == list(osd_b)
            inner = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
            assert list(osd_a[inner]["param_groups"][0]) == list(osd_b[inner]["param_groups"][0])
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in named  # the optimizer files name DeepSpeed's classes


def test_files_are_valid_zips_with_true_crcs_and_take_no_disk(pair):
    stage, out, info, _ = pair
    for f in files(out):
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None  # every member's CRC-32 matches its (zero) bytes
    big = synth.make(out.parent / "big", stage, 8, step=2, layers=4)
    assert big["apparent_bytes"] > 1000 * big["allocated_bytes"]


def test_ckptlib_reads_plans_and_exports_it(pair, tmp_path):
    stage, out, info, _ = pair
    with ckptlib.open_checkpoint(out) as ck:
        assert ck.problems == [] and ck.zero_stage == stage and ck.dp_world_size == 4 and ck.dtype == "bf16"
        assert sum(p.numel for p in ck.parameters) == info["parameters"]
        assert len(ck.parameters) == 2 * 9 + 3
        w = ck.read_param("lm_head.weight")
        assert tuple(w.shape) == (50, 64) and not w.any()
    plan = ckptlib.plan_export(out, tmp_path / "export")
    result = ckptlib.run(plan)
    assert ckptlib.verify(plan, result.out).ok
    reshard = ckptlib.plan_reshard(out, tmp_path / "reshard", 3)
    assert len([f for f in reshard.files if f.kind == "optim_states"]) == 3


@pytest.mark.parametrize("name", ["z3_subgroup_w2", "z3_subgroup_w3"])
def test_sub_groups_are_cut_as_deepspeed_cuts_them(fixture_by_name, monkeypatch, name):
    """The generator's cut of a real DeepSpeed checkpoint's parameter groups (sub_group_size 500) gives the
    sub-groups DeepSpeed wrote: the same parameters in each, and the same per-rank flat sizes."""
    fx = fixture_by_name(name)
    tag = fx["checkpoint_path"] / (fx["checkpoint_path"] / "latest").read_text().strip()
    world = int(name.rsplit("_w", 1)[1])
    model = open_torch_file(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").obj
    osd = open_torch_file(next(tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))).obj["optimizer_state_dict"]
    real = [[(n, tuple(s)) for n, s in sub.items()] for sub in model["param_shapes"]]
    assert len(real) > 2  # several sub-groups, or nothing is tested
    monkeypatch.setattr(synth, "SUB_GROUP_SIZE", 500)
    for g, group in enumerate(osd["optimizer_state_dict"]["param_groups"]):
        members = [(n, s, g) for k in group["params"] for n, s in real[k]]
        cut = synth.zero3_sub_groups(members, world)
        assert [[n for n, _, _ in sub] for sub in cut] == [[n for n, _ in real[k]] for k in group["params"]]
        for sub, k in zip(cut, group["params"]):
            size = sum(synth.ceil_div(synth.math.prod(s), world) for _, s, _ in sub)
            assert size == osd["fp32_flat_groups"][k].numel


def test_a_synthetic_checkpoint_with_sub_groups_reads_and_reshards(monkeypatch, tmp_path):
    """With a small sub_group_size (and the config saying so) the synthetic ZeRO-3 checkpoint has several
    sub-groups, which ckptlib finds consistent and re-cuts for another world size."""
    monkeypatch.setattr(synth, "SUB_GROUP_SIZE", 3000)
    info = synth.make(tmp_path / "ckpt", 3, 4, step=2, **TINY)
    with ckptlib.open_checkpoint(tmp_path / "ckpt") as ck:
        assert ck.problems == [] and sum(p.numel for p in ck.parameters) == info["parameters"]
        assert len(ck.layouts[0].sub_group_sizes) > 2
        plan = ckptlib.plan_reshard(ck, tmp_path / "out", 3)
    assert len([f for f in plan.files if f.kind == "optim_states"]) == 3
    assert plan.describe()
