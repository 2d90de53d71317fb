"""The AutoEP fixtures (tests/fixtures/autoep): real DeepSpeed 0.19.8 checkpoints of tiny Mixtral, Qwen3-MoE and
OLMoE models trained with expert parallelism. Each fixture's reference (gathered from the live engine) is
rebuilt here from the saved files with torch.load and this file's own cutting (tests/fixtures/autoep/FILES.md
describes the layout), the Hugging Face names are checked against transformers, and DeepSpeed loads a few
fixtures back at their own world size bit for bit (tests/fixtures/autoep/load_check.py)."""
from __future__ import annotations

import json
import math
import re
import shutil
from collections import OrderedDict

import pytest
import torch

from tests.fixtures.autoep import common as C

NAMES = [s.name for s in C.all_specs()]
STATE_KEYS = ("exp_avg", "exp_avg_sq")




def _load(p):
    return torch.load(p, map_location="cpu", weights_only=False)


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return C.bits_equal(a, b)


def _same(a: dict, b: dict) -> list:
    """Names whose tensors differ (or are missing) between ``a`` and ``b``."""
    return sorted(set(a) ^ set(b)) + [n for n in a if n in b and not _bits(a[n], b[n])]


# --------------------------------------------------------------------------------------
# Reading the saved files (independently of the generator's gathering)
# --------------------------------------------------------------------------------------
def read_zero2(fx: dict) -> dict:
    """fp32 masters, Adam moments and step from a ZeRO-1/2 AutoEP checkpoint, under AutoEP's names, full.

    Flat group g of ``bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds the parameters of
    ``mp_rank_00_model_states.pt['param_shapes'][g]`` back to back. Dense groups are partitioned over all W
    ranks; the expert group (``param_groups[g]['moe']``) over the expert-data-parallel group of the rank's
    expert-parallel rank: rank r has ep rank r % EP and expert-dp rank r // EP, so ep rank e's local experts
    are the concatenation of ranks e, e + EP, ... (param_shapes gives their local shapes [E/EP, ...])."""
    tag = fx["checkpoint_path"] / fx["tag"]
    W, EP = fx["world_size"], fx["ep_size"]
    ms = _load(tag / "mp_rank_00_model_states.pt")
    osd = [_load(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(W)]
    parts: dict = {k: OrderedDict() for k in ("fp32", *STATE_KEYS)}
    steps = set()
    for g, shapes in enumerate(ms["param_shapes"]):
        moe = bool(osd[0]["base_optimizer_state"]["param_groups"][g].get("moe", False))
        holders = {e: [r for r in range(W) if r % EP == e] for e in range(EP)} if moe else {None: list(range(W))}
        for e, ranks in holders.items():
            assert all(osd[r]["partition_count"][g] == len(ranks) for r in ranks)
            flats = {"fp32": torch.cat([osd[r]["single_partition_of_fp32_groups"][g] for r in ranks])}
            for k in STATE_KEYS:
                flats[k] = torch.cat([osd[r]["base_optimizer_state"]["state"][g][k] for r in ranks])
            steps |= {int(osd[r]["base_optimizer_state"]["state"][g]["step"]) for r in ranks}
            off = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                for k, flat in flats.items():
                    parts[k].setdefault(name, {})[e] = flat[off:off + n].view(tuple(shape))
                off += n
            assert off == flats["fp32"].numel(), (g, e, off, flats["fp32"].numel())
    out = {k: OrderedDict((n, by[None] if None in by else torch.cat([by[e] for e in sorted(by)]))
                          for n, by in d.items()) for k, d in parts.items()}
    assert len(steps) == 1, steps
    out["step"] = steps.pop()
    return out


def read_zero3(fx: dict) -> dict:
    """The same from a ZeRO-3 AutoEP checkpoint ("zero3_partitioned"). Sub-group j of rank r's
    ``bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` is partitioned over
    ``ds_zero_partition_groups[j]['partition_ranks']``: each parameter of
    ``zero_pp_rank_<r>_mp_rank_00_model_states.pt['param_shapes'][j]`` contributes ceil(numel / count) elements
    per rank, in partition-rank order (zero padded at the end). Expert sub-groups hold the experts of the ep
    rank that the same rank's model-states file names in ``ds_autoep_layers[*]['ep_rank']``."""
    tag = fx["checkpoint_path"] / fx["tag"]
    W = fx["world_size"]
    models = [_load(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(W)]
    osd = [_load(tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"] for r in range(W)]
    parts: dict = {k: OrderedDict() for k in ("fp32", *STATE_KEYS)}
    steps = set()
    for j, meta0 in enumerate(osd[0]["ds_zero_partition_groups"]):
        expert = "autoep_expert" in meta0["families"]
        sets = set()
        for r in range(W):
            m = osd[r]["ds_zero_partition_groups"][j]
            assert m["partition_ranks"][m["partition_rank"]] == r and len(m["partition_ranks"]) == m["partition_count"]
            sets.add(tuple(m["partition_ranks"]))
        for ranks in sorted(sets):
            e = None
            if expert:
                eps = {l["ep_rank"] for r in ranks for l in models[r]["ds_autoep_layers"]}
                assert len(eps) == 1, eps
                e = eps.pop()
            shapes = models[ranks[0]]["param_shapes"][j]
            count = len(ranks)
            flats = {"fp32": [osd[r]["fp32_flat_groups"][j] for r in ranks]}
            for k in STATE_KEYS:
                flats[k] = [osd[r]["optimizer_state_dict"]["state"][j][k] for r in ranks]
            steps |= {int(osd[r]["optimizer_state_dict"]["state"][j]["step"]) for r in ranks}
            off = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                pn = -(-numel // count)
                for k, fl in flats.items():
                    full = torch.cat([f[off:off + pn] for f in fl])[:numel]
                    parts[k].setdefault(name, {})[e] = full.view(tuple(shape))
                off += pn
            assert off == flats["fp32"][0].numel()
    out = {k: OrderedDict((n, by[None] if None in by else torch.cat([by[e] for e in sorted(by)]))
                          for n, by in d.items()) for k, d in parts.items()}
    assert len(steps) == 1, steps
    out["step"] = steps.pop()
    return out


@pytest.mark.parametrize("name", NAMES)
def test_saved_files_hold_the_reference(autoep_fixtures, name):
    fx = autoep_fixtures[name]
    ref = _load(fx["path"] / "reference.pt")
    got = read_zero3(fx) if fx["zero_stage"] == 3 else read_zero2(fx)
    assert got["step"] == ref["step"] == 2
    order = [n for n in ref["params"]]
    assert sorted(got["fp32"]) == sorted(order)
    assert _same(got["fp32"], ref["params"]) == []
    for k in STATE_KEYS:
        assert _same(got[k], ref["states"][k]) == []
    # every expert is there, stacked to the full [E, ...]
    E = fx["model_config"].get("num_local_experts", fx["model_config"].get("num_experts"))
    for n in fx["expert_params"]:
        assert ref["params"][n].shape[0] == E


@pytest.mark.parametrize("name", NAMES)
def test_model_states_files(autoep_fixtures, name):
    """mp_rank_00 / zero_pp_rank model states: ds_autoep_layers, universal_checkpoint_info, the 16-bit
    weights (ZeRO-2: in mp_rank_00 and the per-expert files; ZeRO-3: empty placeholders)."""
    fx = autoep_fixtures[name]
    ref = _load(fx["path"] / "reference.pt")
    tag = fx["checkpoint_path"] / fx["tag"]
    W, EP = fx["world_size"], fx["ep_size"]
    E = fx["model_config"].get("num_local_experts", fx["model_config"].get("num_experts"))
    L = E // EP
    files = sorted(p.name for p in tag.iterdir())
    lp = ref["module16"]
    if fx["zero_stage"] < 3:
        experts = [f"layer_{l}_expert_{e}_mp_rank_00_model_states.pt" for l in range(2) for e in range(E)]
        want = sorted(["mp_rank_00_model_states.pt", *experts,
                       *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(W))])
        assert files == want
        ms = _load(tag / "mp_rank_00_model_states.pt")
        model_files = [ms]
        for k, v in ms["module"].items():
            m = C.ALIAS_RE.match(k)
            assert _bits(v, lp[f"{m['mlp']}.router.gate.weight"] if m else lp[k]), k
        assert not any(C.is_expert_name(k) for k in ms["module"])
        for layer in ms["ds_autoep_layers"]:
            for e in range(E):
                sd = _load(tag / f"layer_{layer['moe_layer_id']}_expert_{e}_mp_rank_00_model_states.pt")
                assert sorted(sd) == [f"{layer['expert_key_prefix']}.w{i}.{e}" for i in (1, 2, 3)]
                prefix = layer["expert_key_prefix"]
                for i in (1, 2, 3):
                    assert _bits(sd[f"{prefix}.w{i}.{e}"], lp[f"{prefix}.w{i}"][e])
    else:
        want = sorted([*(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(W)),
                       *(f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(W))])
        assert files == want
        model_files = [_load(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(W)]
        for ms in model_files:
            assert all(v.numel() == 0 for v in ms["module"].values())
    for r, ms in enumerate(model_files):
        assert ms["num_experts"] == [E, E]
        layers = ms["ds_autoep_layers"]
        assert [l["module_path"] for l in layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
        for i, l in enumerate(layers):
            e = r % EP  # mp_rank_00 at ZeRO-2 is rank 0's
            assert (l["moe_layer_id"], l["num_experts"], l["num_local_experts"], l["ep_size"]) == (i, E, L, EP)
            assert l["checkpoint_format"] == ("zero3_partitioned" if fx["zero_stage"] == 3 else "per_expert_files")
            assert (l["ep_rank"], l["global_expert_start"], l["global_expert_end"]) == (e, e * L, e * L + L)
            assert (l["expert_data_parallel_rank"], l["expert_data_parallel_world_size"]) == (r // EP, W // EP)
            assert [x["experts"] for x in l["expert_placement"]["ranks"]] == [list(range(k * L, k * L + L))
                                                                             for k in range(EP)]
        uci = ms["universal_checkpoint_info"]
        assert uci["expert_parameter_patterns"] == [r".*\.experts\.w[123]$"]
        assert uci["ds_autoep_layers"] == layers


@pytest.mark.parametrize("name", NAMES)
def test_hf_names_match_transformers(autoep_fixtures, name):
    """The reference's HF-named masters and moments are the AutoEP ones re-cut (checked here by hand), have
    the names and shapes of a fresh model's state_dict, load strictly, and the generator's logits proof
    held."""
    fx = autoep_fixtures[name]
    ref = _load(fx["path"] / "reference.pt")
    hf = ref["hf"]["params"]
    fresh = C.build_hf_model(fx["model"], 0)
    sd = fresh.state_dict()
    assert list(hf) == list(sd)
    assert {k: tuple(v.shape) for k, v in hf.items()} == {k: tuple(v.shape) for k, v in sd.items()}
    p = ref["params"]
    for layer in range(fx["model_config"]["num_hidden_layers"]):
        mlp = f"model.layers.{layer}.mlp"
        assert _bits(hf[f"{mlp}.gate.weight"], p[f"{mlp}.router.gate.weight"])
        F = p[f"{mlp}.experts.w1"].shape[1]
        assert _bits(hf[f"{mlp}.experts.gate_up_proj"][:, :F], p[f"{mlp}.experts.w1"])
        assert _bits(hf[f"{mlp}.experts.gate_up_proj"][:, F:], p[f"{mlp}.experts.w3"])
        assert _bits(hf[f"{mlp}.experts.down_proj"], p[f"{mlp}.experts.w2"])
    for k in STATE_KEYS:
        assert _same(ref["hf"]["states"][k], C.autoep_to_hf(ref["states"][k], sd.keys())) == []
    assert _same(C.hf_to_autoep(hf), OrderedDict((n, p[n]) for n in C.hf_to_autoep(hf))) == []
    fresh.load_state_dict(hf, strict=True)
    proof = fx["proof"]
    assert proof["argmax_equal"] and proof["max_abs_diff"] <= 1e-6, proof
    assert (ref["proof"]["logits_hf"] - ref["proof"]["logits_autoep"]).abs().max() <= 1e-6


@pytest.mark.parametrize("name", ["mixtral_z2_w2_ep2", "qwen3_moe_z3_w2_ep2", "olmoe_z2_w2_ep2"])
def test_an_hf_export_loads_with_from_pretrained(autoep_fixtures, tmp_path, name):
    """hf_config/ + the HF-named masters as model.safetensors load with from_pretrained, unchanged."""
    import transformers
    from safetensors.torch import save_file

    fx = autoep_fixtures[name]
    ref = _load(fx["path"] / "reference.pt")
    out = tmp_path / "export"
    shutil.copytree(fx["path"] / "hf_config", out)
    save_file({k: v.contiguous() for k, v in ref["hf"]["params"].items()}, str(out / "model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == fx["model_class"]
    assert _same(model.state_dict(), ref["hf"]["params"]) == []


def test_fixture_json_describes_the_fixture(autoep_fixtures):
    assert sorted(autoep_fixtures) == sorted(NAMES)
    for name, fx in autoep_fixtures.items():
        spec = C.spec_by_name(name)
        assert (fx["world_size"], fx["ep_size"], fx["expert_dp_size"], fx["zero_stage"]) == \
               (spec.world, spec.ep, spec.edp, spec.stage)
        assert fx["ds_config"]["expert_parallel"]["autoep_size"] == spec.ep
        assert fx["steps"] == 2 and fx["step"] == 2 and fx["tag"] == "global_step2"
        assert fx["optimizer"] == ("DeepSpeedZeroOptimizer_Stage3" if spec.stage == 3 else "DeepSpeedZeroOptimizer")
        experts = [p for p in fx["params"] if p["expert"]]
        assert {p["name"].rsplit(".", 1)[1] for p in experts} == {"w1", "w2", "w3"}
        assert all(p["shape"][0] == p["local_shape"][0] * spec.ep for p in experts)
        assert [r["ep_rank"] for r in fx["ranks"]] == [r % spec.ep for r in range(spec.world)]
        assert [r["edp_rank"] for r in fx["ranks"]] == [r // spec.ep for r in range(spec.world)]
        assert json.loads((fx["path"] / "hf_config" / "config.json").read_text())["model_type"] == \
            C.MODELS[fx["model"]]["model_type"]


ROUND_TRIPS = {2: ["mixtral_z2_w2_ep2", "olmoe_z3_w2_ep2"], 4: ["mixtral_z3_w4_ep2"]}


@pytest.mark.parametrize("world", sorted(ROUND_TRIPS))
def test_deepspeed_loads_a_fixture_at_its_own_world_exactly(autoep_fixtures, tmp_path, world):
    from tests.fixtures.autoep.load_check import job_for_fixture, run_load_checks

    jobs = [job_for_fixture(autoep_fixtures[n]) for n in ROUND_TRIPS[world]]
    results = run_load_checks(jobs, world, tmp_path)
    for n in ROUND_TRIPS[world]:
        res = results[n]
        assert "error" not in res, (res.get("phase"), res.get("error"))
        ref = _load(autoep_fixtures[n]["path"] / "reference.pt")
        loaded = res["loaded"]
        assert loaded["problems"] == [] and not loaded["optim_state_missing"]
        assert loaded["step"] == ref["step"] == 2
        assert _same(loaded["params"], ref["params"]) == []
        for k in STATE_KEYS:
            assert _same(loaded["states"][k], ref["states"][k]) == []
        assert _same(loaded["module16"], ref["module16"]) == []
        after = res["after_step"]
        assert after["step"] == 3 and after["problems"] == [] and math.isfinite(after["loss"])
        assert _same(after["params"], ref["params"]) != []  # the step changed the masters
        assert re.fullmatch(r".*global_step2.*", res["load_path"])
