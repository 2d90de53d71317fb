"""DeepSpeed checkpoints made with optimizers other than Adam (tests/fixtures/optim): Muon at ZeRO-1/2/3, torch SGD /
Adagrad / RMSprop / Adafactor clients, DeepSpeed's CPU Lion / Adagrad, AdamW under hpZ and bf16 autocast.

(a) every fixture's reference (gathered from the live engine's optimizer internals) equals what its files hold,
read back here with torch.load and cut by this file's own code: fp32 masters, EVERY optimizer state key, the step
in the form it is held, the param groups, module weights, frozen weights and buffers; for Muon at ZeRO-1/2 the
whole-matrix momentum buffers, every copy of a straddling matrix; (b) DeepSpeed loading each fixture at its own
world size (tests/fixtures/optim/load_check.py) holds exactly the reference, and one more step runs (except the
one load DeepSpeed refuses, REFUSED_LOADS); the universal flag of the load check on an AdamW fixture's
ds_to_universal output. tests/fixtures/optim/FILES.md says what the files hold.
"""
from __future__ import annotations

import math
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from tests.fixtures.optim import common as C

SPECS = {s.name: s for s in C.all_specs()}
NAMES = list(SPECS)
BASE_CLASS = {"muon": "MuonWithAuxAdam", "sgd": "SGD", "adagrad": "Adagrad", "rmsprop": "RMSprop",
              "adafactor": "Adafactor", "adamw": "AdamW", "cpu_lion": "DeepSpeedCPULion",
              "cpu_adagrad": "DeepSpeedCPUAdagrad"}
ADAM_KEYS = ["exp_avg", "exp_avg_sq", "step"]
STATE_KEYS = {  # per flat group, sorted
    "sgd": ["momentum_buffer"],
    "adagrad": ["step", "sum"],
    "rmsprop": ["grad_avg", "momentum_buffer", "square_avg", "step"],
    "adafactor": ["step", "variance"],
    "adamw": ADAM_KEYS,
    "cpu_lion": ADAM_KEYS,
    "cpu_adagrad": ["exp_avg_sq", "step"],
}




def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _reference(fx, tag=None) -> dict:
    refs = fx["extras"].get("references") or {fx["tag"]: "reference.pt"}
    return torch.load(fx["path"] / refs[tag or fx["tag"]], map_location="cpu", weights_only=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, dtype and shape included (NaNs compared by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ib = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ib), b.contiguous().view(ib))
    return torch.equal(a, b)


def _same_scalar(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and _same(a, b)
    return type(a) is type(b) and a == b


# --------------------------------------------------------------------------------------
# Reading the files (this file's own cutting, independent of the generator's gathering)
# --------------------------------------------------------------------------------------
def _rank_files(tag_dir: Path, pattern: str) -> list[Path]:
    files = sorted(tag_dir.glob(pattern), key=lambda p: int(p.name.split("zero_pp_rank_")[1].split("_")[0]))
    return files


def read_files(fx, tag=None) -> dict:
    """What the fixture's files at ``tag`` hold, under the parameter names: {"fp32", "optim", "scalars",
    "param_groups", "lp" (ZeRO-1/2), "buffers", "frozen", "muon_copies": {name: [ranks]}, "momentum_numel":
    {rank: numel}}."""
    tag = tag or fx["tag"]
    tag_dir = fx["checkpoint_path"] / tag
    world, stage = fx["world_size"], fx["zero_stage"]
    optim_files = _rank_files(tag_dir, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")
    assert len(optim_files) == world, optim_files
    osds = [_load(f)["optimizer_state_dict"] for f in optim_files]
    model_file = tag_dir / ("zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    model = _load(model_file)
    shapes = model["param_shapes"]
    out = {"fp32": OrderedDict(), "optim": OrderedDict(), "scalars": {}, "param_groups": [], "muon_copies": {},
           "momentum_numel": {}}
    if stage == 3:
        inner = [o["optimizer_state_dict"] for o in osds]
        base_groups = inner[0]["param_groups"]
        assert len(osds[0]["fp32_flat_groups"]) == len(shapes)  # one sub-group per param group here
    else:
        inner = [o["base_optimizer_state"] for o in osds]
        base_groups = inner[0]["param_groups"]
    for g, group_shapes in enumerate(shapes):
        names = list(group_shapes)
        numels = [math.prod(group_shapes[n]) for n in names]

        if stage == 3:
            chunks = [-(-k // world) for k in numels]
            starts = [sum(chunks[:i]) for i in range(len(chunks))]

            def cut(per_rank):
                assert all(t.numel() == sum(chunks) for t in per_rank), [t.numel() for t in per_rank]
                return {n: torch.cat([t[s:s + c] for t in per_rank])[:k].view(group_shapes[n])
                        for n, k, c, s in zip(names, numels, chunks, starts)}

            fp32_parts = [o["fp32_flat_groups"][g] for o in osds]
        else:
            offsets = [sum(numels[:i]) for i in range(len(numels))]

            def cut(per_rank):
                whole = torch.cat(per_rank)
                return {n: whole[o:o + k].view(group_shapes[n]) for n, k, o in zip(names, numels, offsets)}

            fp32_parts = [o["single_partition_of_fp32_groups"][g] for o in osds]
            padded = fp32_parts[0].numel() + osds[0]["group_paddings"][g]  # rank 0's partition, padding included
        for n, t in cut(fp32_parts).items():
            out["fp32"][n] = t
        states = [s["state"][g] for s in inner]
        keys = sorted(states[0])
        assert all(sorted(s) == keys for s in states), [sorted(s) for s in states]
        muon_group = bool(base_groups[g].get("use_muon", False))
        out["scalars"][g] = {}
        for key in keys:
            vals = [s[key] for s in states]
            if torch.is_tensor(vals[0]) and vals[0].dim() >= 1:
                if muon_group and key == "momentum_buffer" and stage != 3:
                    # each rank: the WHOLE momentum of every matrix with an element in its partition, in flat order
                    for r, buf in enumerate(vals):
                        lo, hi = r * padded, (r + 1) * padded
                        pos = 0
                        for n, k, o in zip(names, numels, offsets):
                            if o < hi and o + k > lo:
                                out["optim"].setdefault(n, {}).setdefault(key, buf[pos:pos + k].view(group_shapes[n]))
                                assert _same(out["optim"][n][key], buf[pos:pos + k].view(group_shapes[n])), \
                                    f"{n}: rank {r}'s copy of the momentum differs"
                                out["muon_copies"].setdefault(n, []).append(r)
                                pos += k
                        assert pos == buf.numel(), (g, r, pos, buf.numel())
                        out["momentum_numel"][r] = buf.numel()
                else:
                    for n, t in cut(vals).items():
                        out["optim"].setdefault(n, {})[key] = t
            else:
                assert all(_same_scalar(v, vals[0]) for v in vals), (g, key, vals)
                out["scalars"][g][key] = vals[0]
        out["param_groups"].append({k: v for k, v in base_groups[g].items() if k != "params"})
    module = model["module"]
    out["buffers"] = {n: module[n] for n in model["buffer_names"]}
    if stage == 3:
        frags = [_load(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")["frozen_param_fragments"]
                 for r in range(world)]
        out["frozen"] = {n: torch.cat([f[n].reshape(-1) for f in frags])[:math.prod(s)].view(s)
                         for n, s in model["frozen_param_shapes"].items()}
    else:
        out["lp"] = dict(module)
        out["frozen"] = ({n: t for n, t in model["frozen_param_fragments"].items()} if stage == 2
                         else {n: module[n] for n in ("frozen.weight", "frozen.bias")})
    return out


# --------------------------------------------------------------------------------------
# (a) the files against the references
# --------------------------------------------------------------------------------------
def test_every_configuration_was_made(optim_fixtures):
    assert sorted(optim_fixtures) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_json_describes_the_run(optim_fixtures, name):
    fx, spec = optim_fixtures[name], SPECS[name]
    assert fx["optimizer"] == spec.optimizer and fx["zero_stage"] == spec.stage and fx["world_size"] == spec.world
    assert fx["optimizer_class"] == ("DeepSpeedZeroOptimizer_Stage3" if spec.stage == 3 else "DeepSpeedZeroOptimizer")
    assert fx["base_optimizer_class"] == BASE_CLASS[spec.optimizer]
    keys = list(fx["state_keys"].values())
    if spec.is_muon:
        assert fx["aux_optimizer_class"] == "FusedAdam"
        assert keys == [["momentum_buffer"], ADAM_KEYS, ADAM_KEYS]
        assert [g["name"] for g in fx["param_groups"]] == ["group0-muon-params", "group0-adam-params",
                                                            "group1-adam-params"]
        assert [g["use_muon"] for g in fx["param_groups"]] == [True, False, False]
        # MuonWithAuxAdam sorts each Muon group by shape, largest first: (33,33), (33,29), (29,33)
        assert fx["flat_groups"][0]["params"] == ["fc1.weight", "fc3.weight", "fc2.weight"]
        assert fx["step_forms"] == {"0": None, "1": "int", "2": "int"}  # FusedAdam: Python int, Muon: no step
        if spec.stage in (1, 2):
            assert any(fx["straddling"].values()), "no Muon matrix straddles a partition boundary"
    else:
        assert keys == [STATE_KEYS[spec.optimizer]] * (1 if spec.one_group else 2)
    if spec.optimizer == "sgd":
        assert all(v is None for v in fx["step"].values())
    elif not spec.is_muon:
        assert all(v == fx["extras"]["global_steps"] for v in fx["step"].values()), fx["step"]


@pytest.mark.parametrize("name", NAMES)
def test_files_hold_the_reference(optim_fixtures, name):
    fx = optim_fixtures[name]
    for tag in fx["tags"]:
        ref = _reference(fx, tag)
        got = read_files(fx, tag)
        assert list(got["fp32"]) and sorted(got["fp32"]) == sorted(ref["fp32"])
        for n, want in ref["fp32"].items():
            assert _same(got["fp32"][n], want), f"{tag}: fp32 master {n}"
        for n, states in ref["optim"].items():
            assert sorted(got["optim"].get(n, {})) == sorted(states), (tag, n)
            for key, want in states.items():
                assert _same(got["optim"][n][key], want), f"{tag}: {key} of {n} ({got['optim'][n][key].dtype} " \
                                                          f"in the file, {want.dtype} in the engine)"
        assert sorted(got["scalars"]) == sorted(ref["scalars"])
        for g, scalars in ref["scalars"].items():
            assert sorted(got["scalars"][g]) == sorted(scalars), (tag, g)
            for key, want in scalars.items():
                assert _same_scalar(got["scalars"][g][key], want), (tag, g, key, got["scalars"][g][key], want)
        for g, want in enumerate(ref["param_groups"]):
            want = {k: v for k, v in want.items() if k != "flat_params"}
            have = {k: (v.item() if torch.is_tensor(v) else v) for k, v in got["param_groups"][g].items()}
            assert have == want, (tag, g)
        for n, want in ref["buffers"].items():
            assert _same(got["buffers"][n], want), (tag, n)
        for n, want in ref["frozen"].items():
            assert _same(got["frozen"][n], want), (tag, n)
        if "lp" in got:
            for n, want in ref["lp"].items():
                assert _same(got["lp"][n], want), (tag, n)
        if fx["optimizer"] == "muon" and fx["zero_stage"] in (1, 2):
            straddling = {n: r for n, r in got["muon_copies"].items() if len(r) > 1}
            assert straddling and straddling == fx["straddling"]["0"]
            layout = fx["muon_layout"]["0"]["ranks"]
            assert got["momentum_numel"] == {e["rank"]: e["buffer_numel"] for e in layout}
            # whole matrices: the ranks' buffers together are larger than the group
            assert sum(got["momentum_numel"].values()) > sum(ref["fp32"][n].numel() for n in got["muon_copies"])


def test_muon_momentum_dtypes(optim_fixtures):
    """The momentum is held in the gradient dtype (bf16 on a bf16 run) at every stage; fp32 runs hold fp32, and so
    does a bf16 ZeRO-3 run after a resume (test_resumed_muon_run)."""
    for name, fx in optim_fixtures.items():
        if fx["optimizer"] == "muon":
            resumed_z3 = fx["spec"]["resume"] and fx["zero_stage"] == 3
            want = "bfloat16" if fx["dtype"] == "bf16" and not resumed_z3 else "float32"
            assert fx["state_dtypes"]["0"] == {"momentum_buffer": want}, name


@pytest.mark.parametrize("stage", [2, 3])
def test_resumed_muon_run(optim_fixtures, stage):
    """DeepSpeed #7746: the momentum comes back fp32 from a load (torch's Optimizer.load_state_dict casts state to
    the fp32 partition's dtype). ZeRO-2's next step turns it back into the gradient dtype (bf16), so its second
    save holds bf16; ZeRO-3 keeps it fp32 (it copies the new momentum into the buffer it has), so its second save
    holds fp32. Either way the resumed run holds the uninterrupted run's values."""
    fx = optim_fixtures[f"muon_z{stage}_bf16_w3_resumed"]
    after = "bfloat16" if stage == 2 else "float32"
    assert fx["tags"] == ["global_step2", "global_step3"] and fx["tag"] == "global_step3"
    resume = fx["extras"]["resume"]
    assert resume["state_dtypes_saved_step2"]["0"] == {"momentum_buffer": "bfloat16"}
    assert resume["state_dtypes_after_load"]["0"] == {"momentum_buffer": "float32"}
    assert resume["state_dtypes_saved_step3"]["0"] == {"momentum_buffer": after}
    assert resume["loaded_equals_step2_values"]["fp32"] == [] and resume["loaded_equals_step2_values"]["optim"] == []
    # the same values as 3 uninterrupted steps; at ZeRO-3 in another dtype (the uninterrupted run holds bf16, and
    # the momentum ZeRO-3 writes back went through a bf16 all-gather, so the fp32 one holds bf16 values)
    differs = resume["uninterrupted_3_steps_differs"]
    assert differs["fp32"] == [] and differs["optim"] == []
    assert len(differs["dtypes"]) == (0 if stage == 2 else 3)
    for tag, dtype in zip(fx["tags"], (torch.bfloat16, getattr(torch, after))):
        files = read_files(fx, tag)
        assert {files["optim"][n]["momentum_buffer"].dtype for n in ("fc1.weight", "fc2.weight", "fc3.weight")} \
            == {dtype}, tag
    assert _reference(fx)["step"] == {0: None, 1: 3, 2: 3}


def test_ds_to_universal_knows_only_adam(optim_fixtures, tmp_path):
    """DeepSpeed's own universal converter refuses every optimizer state but Adam's (#8608): KeyError 'exp_avg'."""
    for name in ("sgd_z2_bf16_w2", "muon_z3_bf16_w2"):
        fx = optim_fixtures[name]
        r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                            str(fx["checkpoint_path"] / fx["tag"]), "--output_folder", str(tmp_path / name)],
                           capture_output=True, text=True, timeout=600, env=_env())
        assert r.returncode != 0 and "KeyError: 'exp_avg'" in r.stderr, (name, r.stderr[-2000:])


def _env() -> dict:
    from tests.fixtures.torchrun import launch_env

    return launch_env()


# --------------------------------------------------------------------------------------
# (b) DeepSpeed loading the fixtures at their own world size
# --------------------------------------------------------------------------------------
UNIVERSAL_SOURCE = "adamw_autocast_z2_w2"  # AdamW: the one optimizer ds_to_universal converts


@pytest.fixture(scope="session")
def load_results(optim_fixtures, tmp_path_factory) -> dict:
    """{name: load-check result}: every fixture loaded at its own world size (one launch per world size), plus
    ``<UNIVERSAL_SOURCE>-universal``: its ds_to_universal output loaded with load_universal."""
    from tests.fixtures.optim.load_check import job_for_fixture, run_load_checks

    work = tmp_path_factory.mktemp("optim-load")
    fx = optim_fixtures[UNIVERSAL_SOURCE]
    uni = work / "universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(fx["checkpoint_path"] / fx["tag"]), "--output_folder", str(uni / "universal_step2")],
                   check=True, capture_output=True, timeout=600, env=_env())
    (uni / "latest_universal").write_text("universal_step2")
    jobs: dict = {}
    for name, f in optim_fixtures.items():
        jobs.setdefault(f["world_size"], []).append(job_for_fixture(f))
    jobs[fx["world_size"]].append(job_for_fixture(fx, checkpoint_dir=uni, name=UNIVERSAL_SOURCE + "-universal",
                                                  universal=True))
    results = {}
    for world, js in sorted(jobs.items()):
        results.update(run_load_checks(js, world, work))
    return results


def _expected_dtype_changes(fx) -> set:
    """(param, key) whose dtype a load changes: Muon's bf16 momentum becomes fp32 (torch's load_state_dict casts
    floating state to the fp32 partition's dtype); not when the saved one is fp32 already (ZeRO-3 resumed)."""
    if fx["optimizer"] == "muon" and fx["state_dtypes"]["0"]["momentum_buffer"] == "bfloat16":
        return {(n, "momentum_buffer") for n in ("fc1.weight", "fc2.weight", "fc3.weight")}
    return set()


#: loads DeepSpeed itself refuses (FILES.md): the client torch Adagrad that ZeRO-3 rebuilds in
#: initialize_optimizer_states keeps its flat partition in its param group, and _rigid_load_state_dict appends the
#: partitions again before torch's Optimizer.load_state_dict, which then finds 2 params against the saved 1
REFUSED_LOADS = {"adagrad_1group_z3_bf16_w2": (
    "load", "ValueError: loaded state dict contains a parameter group that doesn't match the size of optimizer's group")}


@pytest.mark.parametrize("name", NAMES)
def test_load_at_the_same_world_is_exact(optim_fixtures, load_results, name):
    fx = optim_fixtures[name]
    res = load_results[name]
    if name in REFUSED_LOADS:
        assert (res.get("phase"), res.get("error")) == REFUSED_LOADS[name]
        return
    assert "error" not in res, f"{res.get('phase')}: {res.get('error')}"
    ref = _reference(fx)
    got = res["loaded"]
    for n, want in ref["fp32"].items():
        assert _same(got["fp32"][n], want), f"fp32 master {n}"
    changed = set()
    for n, states in ref["optim"].items():
        assert sorted(got["optim"][n]) == sorted(states), n
        for key, want in states.items():
            have = got["optim"][n][key]
            if have.dtype != want.dtype:
                changed.add((n, key))
            # the same values, bit for bit, in both dtypes (a lossless cast)
            assert _same(want.to(have.dtype), have) and _same(have.to(want.dtype), want), f"{key} of {n}"
    assert changed == _expected_dtype_changes(fx)
    assert got["step"] == ref["step"]
    for g, scalars in ref["scalars"].items():
        for key, want in scalars.items():
            assert _same_scalar(got["scalars"][g][key], want), (g, key)
    for part in ("buffers", "frozen", "lp"):
        for n, want in ref[part].items():
            assert _same(got[part][n], want), (part, n)
    assert got["global_steps"] == fx["extras"]["global_steps"]
    after = res["after_step"]
    assert math.isfinite(after["loss"]) and after["global_steps"] == got["global_steps"] + 1
    assert after["step"] == {g: (None if s is None else s + 1) for g, s in got["step"].items()}
    assert any(not torch.equal(after["fp32"][n], got["fp32"][n]) for n in got["fp32"])


def test_universal_load_restores_masters_and_moments(optim_fixtures, load_results):
    """The ``universal`` job flag: ds_to_universal's output of an AdamW fixture loads with every master and moment."""
    fx = optim_fixtures[UNIVERSAL_SOURCE]
    res = load_results[UNIVERSAL_SOURCE + "-universal"]
    assert "error" not in res, f"{res.get('phase')}: {res.get('error')}"
    assert res["config"]["checkpoint"] == {"load_universal": True}
    ref = _reference(fx)
    for n, want in ref["fp32"].items():
        assert _same(res["loaded"]["fp32"][n], want), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same(res["loaded"]["optim"][n][key], ref["optim"][n][key]), (key, n)
