"""``ckpt check`` and ``ckpt diff`` on pipeline, tensor-parallel (Megatron mpu, AutoTP), MoE and Ulysses
checkpoints written by DeepSpeed itself (tests/fixtures/parallel, tests/fixtures/hf_parallel): every fixture
is healthy; statistics equal torch's on the live engines' reference tensors; each checkpoint diffs ``same``
against its own export (with states), its reshard and its universal output where ckptlib writes them; and
damage in one rank's file of one stage, tensor rank or expert group is found, naming the tensor and file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.analysis.healthrules import replica_pairs, saved_weights_view
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.writer import save
from tests.test_health_diff import _cli, _same_stats, _strict_json, _write

STATES = ("exp_avg", "exp_avg_sq")


def _names():
    from tests.fixtures.hf_parallel.common import all_specs as hf_specs
    from tests.fixtures.parallel.generate import all_specs as par_specs

    return [s.name for s in par_specs()] + [s.name for s in hf_specs()]


def pytest_generate_tests(metafunc):  # noqa: D103 - parametrise by fixture name, known without generating
    if "pfx" in metafunc.fixturenames:
        only = getattr(metafunc.function, "only", None)
        metafunc.parametrize("pfx", [n for n in _names() if only is None or only(n)], indirect=True)


@pytest.fixture
def pfx(request, parallel_fixtures):
    return parallel_fixtures[request.param]


def only(pred):
    def deco(fn):
        fn.only = pred
        return fn
    return deco


def _rules(fx) -> list:
    p = fx["path"] / "tp_rules.json"
    return ["--tp-rules", p] if p.is_file() else []


def _rules_path(fx):
    p = fx["path"] / "tp_rules.json"
    return p if p.is_file() else None


def _ref(fx) -> dict:
    return torch.load(fx["path"] / "reference.pt", weights_only=True)


def _cut(want: torch.Tensor, name: str, fx) -> torch.Tensor:
    """A vocabulary tensor as the checkpoint's model has it: Megatron's padding rows cut."""
    vocab = (fx.get("vocab_info") or {}).get("original_vocab_size")
    return want[:vocab] if vocab and name in (fx.get("vocab") or []) else want


def _reshardable(fx) -> bool:
    """ckptlib reshards every parallel kind but ZeRO-0 pipelines and ZeRO-0 MoE (at another data-parallel size)."""
    return not (fx["kind"] in ("pipeline", "moe") and fx["zero_stage"] == 0)


def _universal(fx) -> bool:
    """... and writes universal checkpoints of them (MoE: its expert files stack the experts of one local id,
    which diff reads under their global ids)."""
    return _reshardable(fx)


# ================================================================================================ health
def test_healthy_parallel_fixtures_exit_0(pfx):
    fx = pfx
    code, out = _cli("check", fx["checkpoint_path"], "--states", "--json", *_rules(fx))
    report = _strict_json(out)
    assert code == 0 and report["problems"] == [], report["problems"]
    ref = _ref(fx)
    names = {t["name"] for t in report["tensors"]}
    assert names == set(ref["params"]) | {f"{k}/{n}" for k in STATES for n in ref["states"][k]} | \
        {n for n, b in ref["buffers"].items() if b.is_floating_point()}
    steps = {s["step"] for s in report["steps"]}
    assert steps <= {float(ref["step"])}
    if fx["zero_stage"] or fx["bf16_optimizer"]:  # ZeRO-0 (without BF16_Optimizer): one optimizer per rank set
        sets = fx.get("pp", 1) * fx.get("tp", 1)
        assert steps == {float(ref["step"])} and len({(s["mp_rank"], s["rank"]) for s in report["steps"]}) == \
            sets * fx["dp"] * fx.get("sp", 1)


STATS = ["pp2_dp2_z1_bf16", "pp2_dp1_bf16opt", "tp2_dp2_z1_bf16", "tp2_dp2_z2_fp32", "moe_ep2_z2_bf16",
         "moe_ep2_z0_bf16", "autotp_tp2_dp2_z3_bf16", "ulysses_sp2_dp2_z2_bf16"]


@pytest.mark.parametrize("name", STATS)
@pytest.mark.parametrize("chunk_bytes", [16 * 2**20, 1024])  # whole tensors, and many windows per tensor
def test_statistics_equal_torchs_on_the_references(parallel_fixtures, name, chunk_bytes):
    fx = parallel_fixtures[name]
    ref = _ref(fx)
    plan = ckptlib.plan_check(fx["checkpoint_path"], states=True, chunk_bytes=chunk_bytes, tp_rules=_rules_path(fx))
    result = ckptlib.check(plan)
    assert result.ok, result.problems
    got = {t.key: t for t in result.tensors}
    for n, want in ref["params"].items():
        _same_stats(got[n], _cut(want, n, fx).float())
        for key in STATES:
            _same_stats(got[f"{key}/{n}"], _cut(ref["states"][key][n], n, fx).float())
    floating = {n: b for n, b in ref["buffers"].items() if b.is_floating_point()}
    for n, want in floating.items():  # float buffers are checked too
        _same_stats(got[n], want.float())
    assert len(got) == len(ref["params"]) * 3 + len(floating)
    assert result.memory.peak_added <= plan.predicted_peak_bytes
    assert result.bytes_read >= plan.read_bytes


# ================================================================================================ diff
def test_a_checkpoint_is_the_same_as_its_export_reshard_and_universal_output(pfx, tmp_path):
    fx = pfx
    src, rules = fx["checkpoint_path"], _rules_path(fx)
    outs = {"export": ckptlib.export(src, tmp_path / "export", states=list(STATES), tp_rules=rules).out}
    if _reshardable(fx):
        m = 1 if fx["dp"] > 1 else 2
        if fx["kind"] == "moe" and fx["ep"] > 1:
            m = 2 * fx["dp"]  # the expert-parallel size (kept) must divide the new world
        outs["reshard"] = ckptlib.reshard(src, tmp_path / "reshard", m, tp_rules=rules).out
        if _universal(fx):
            outs["universal"] = ckptlib.write_universal(src, tmp_path / "universal", tp_rules=rules).out
        else:
            with pytest.raises(ckptlib.CkptError):
                ckptlib.plan_universal(src, tmp_path / "universal", tp_rules=rules)
    else:
        with pytest.raises(ckptlib.CkptError):
            ckptlib.plan_reshard(src, tmp_path / "reshard", 1 if fx["dp"] > 1 else 2, tp_rules=rules)
    ref = _ref(fx)
    want = set(fx["state_dict_names"]) | {f"{k}/{n}" for k in STATES for n in ref["states"][k]}
    for what, out in outs.items():
        code, text = _cli("diff", src, out, "--states", "--json", *_rules(fx))
        report = _strict_json(text)
        statuses = {t["name"]: t["status"] for t in report["tensors"]}
        assert code == 0 and set(statuses.values()) == {"same"}, (what, report["summary"])
        steps = {k for k in statuses if k.startswith("step/")}  # the optimizer steps both sides record
        assert set(statuses) - steps == want, (what, sorted((set(statuses) - steps) ^ want))
        assert steps <= {f"step/{n}" for n in ref["states"][STATES[0]]}, (what, sorted(steps))
        assert all(t["max_abs_diff"] == 0 and t["rel_diff"] == 0 for t in report["tensors"]), what
        if what == "reshard":  # the resharded checkpoint is itself healthy (padding, steps, 16-bit weights)
            health = ckptlib.check(out, states=True, tp_rules=rules)
            assert health.ok, health.problems


# ------------------------------------------------------------------------------------------- damaged
def _copy(fx, dst: Path) -> Path:
    shutil.copytree(fx["checkpoint_path"], dst)
    return dst


def _split_piece(ck, file_part: str):
    """A trainable parameter stored once (not tied, not replicated) with a piece in a file whose name holds
    ``file_part``, and that piece's range."""
    aliased = {p.tied_to for p in ck.parameters if p.tied_to}
    for p in ck.parameters:
        if p.trainable and not p.tied_to and p.name not in aliased and not replica_pairs(ck, p.name):
            for r in ck.sources(p.name):
                if file_part in Path(r.path).name:
                    return p.name, r
    raise AssertionError(f"no parameter with a piece in *{file_part}*")


DAMAGED = {"pp2_dp2_z1_bf16": "zero_pp_rank_1_mp_rank_01_", "pp2_dp2_bf16opt": "zero_pp_rank_1_mp_rank_01_",
           "tp2_dp2_z1_bf16": "zero_pp_rank_1_mp_rank_01_", "autotp_tp2_dp2_z2_bf16": "zero_pp_rank_1_mp_rank_01_",
           "moe_ep2_z2_bf16": "zero_pp_rank_1_mp_rank_00_"}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_nan_in_one_ranks_partition_is_found_and_is_the_one_change(parallel_fixtures, tmp_path, name):
    fx = parallel_fixtures[name]
    dst = _copy(fx, tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst, tp_rules=_rules_path(fx)) as ck:
        tensor, r = _split_piece(ck, DAMAGED[name])
    _write(r.path, r.offset + 4 * (r.count // 2), "<f", float("nan"))
    code, out = _cli("check", dst, "--json", *_rules(fx))
    problems = _strict_json(out)["problems"]
    assert code == 1
    nan = [p for p in problems if "NaN" in p["what"]]
    assert len(nan) == 1 and nan[0]["tensor"] == tensor and nan[0]["file"].endswith(Path(r.path).name), problems
    assert "1 NaN and 0 Inf" in nan[0]["what"]
    assert {p["tensor"] for p in problems} == {tensor}  # the saved 16-bit weight no longer matches either
    code, text = _cli("diff", fx["checkpoint_path"], dst, "--states", "--json", *_rules(fx))
    report = _strict_json(text)
    changed = [t for t in report["tensors"] if t["status"] != "same"]
    assert code == 1 and [t["name"] for t in changed] == [tensor], report["summary"]
    assert changed[0]["status"] == "changed" and changed[0]["nonfinite_mismatches"] == 1


@pytest.mark.parametrize("name,tensor,copy", [("tp2_dp2_z1_bf16", "ln1.weight", "_mp_rank_01_"),
                                              ("autotp_tp2_dp2_z2_bf16", "model.norm.weight", "_mp_rank_01_"),
                                              ("pp2_dp2_z1_bf16", "tied_modules.embed.weight", "_mp_rank_01_")])
def test_a_nan_in_a_further_copy_is_found(parallel_fixtures, tmp_path, name, tensor, copy):
    """A replicated tensor (every tensor rank holds it) or a pipeline's tied layer (each stage that uses it):
    the model reads the first copy, but each rank trains on its own, so check looks at every copy."""
    fx = parallel_fixtures[name]
    dst = _copy(fx, tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst, tp_rules=_rules_path(fx)) as ck:
        assert all(copy not in Path(r.path).name for r in ck.sources(tensor))  # not the copy the model reads
        pairs = replica_pairs(ck, tensor)
        r = next(x for _, _, b in pairs for x in b if copy in Path(x.path).name)
    _write(r.path, r.offset, "<f", float("nan"))
    code, out = _cli("check", dst, "--json", *_rules(fx))
    problems = _strict_json(out)["problems"]
    assert code == 1 and {p["tensor"] for p in problems} == {tensor}, problems
    assert {p["file"] for p in problems} == {str(Path(r.path).relative_to(dst))}, problems
    assert any("1 NaN and 0 Inf" in p["what"] and "copy" in p["what"] for p in problems), problems
    assert any("differs from the first" in p["what"] and "at 1 of" in p["what"] for p in problems), problems


@pytest.mark.parametrize("name,file_part", [("pp2_dp2_z1_bf16", "layer_03-model_states.pt"),
                                            ("tp2_dp2_z1_bf16", "mp_rank_01_model_states.pt"),
                                            ("moe_ep2_z2_bf16", "layer_0_expert_3_mp_rank_00_model_states.pt")])
def test_a_changed_16_bit_weight_in_a_stage_tensor_rank_or_expert_file_is_found(parallel_fixtures, tmp_path,
                                                                               name, file_part):
    fx = parallel_fixtures[name]
    dst = _copy(fx, tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst, tp_rules=_rules_path(fx)) as ck:
        saved = saved_weights_view(ck)
        tensor, r = next((p.name, x) for p in ck.parameters if p.trainable and not p.tied_to
                         and p.name not in ck.replicated() for x in saved.sources(p.name)
                         if Path(x.path).name == file_part and x.count > 5)
    assert r.dtype == "bfloat16"
    with open(r.path, "rb") as f:  # flip a low mantissa bit of one bf16 element, saved so (CRC-32 updated)
        f.seek(r.offset + 2 * 5)
        b = f.read(1)
    from tests.hostile import write_consistent

    write_consistent(r.path, r.offset + 2 * 5, bytes([b[0] ^ 0x01]))
    code, out = _cli("check", dst, "--json", *_rules(fx))
    problems = _strict_json(out)["problems"]
    assert code == 1 and len(problems) == 1, problems
    assert problems[0]["tensor"] == tensor and problems[0]["file"].endswith(file_part), problems
    assert "bfloat16 weight differs from the fp32 master (in global_step2/" in problems[0]["what"]
    assert "optim_states.pt) cast" in problems[0]["what"] and "at 1 of" in problems[0]["what"]


@pytest.mark.parametrize("name", ["pp2_dp2_z1_bf16", "tp2_dp2_z2_bf16", "moe_ep2_z1_bf16"])
def test_a_step_changed_on_one_rank_of_a_later_stage_or_tensor_rank_is_found(parallel_fixtures, tmp_path, name):
    fx = parallel_fixtures[name]
    dst = _copy(fx, tmp_path / "ckpt")
    last = max(1, fx.get("pp", 1), fx.get("tp", 1)) - 1
    with ckptlib.open_checkpoint(dst, tp_rules=_rules_path(fx)) as ck:
        zs = ck.sets[last]
        rank = zs.rank(fx["dp"] - 1)
        step = zs.partition_tensor(rank, 0, "step")
        r = step.ranges()[0]
        file = Path(zs.optim_states_file(rank).path).name
    _write(r.path, r.offset, "<f", 9.0)
    code, out = _cli("check", dst, "--json", *_rules(fx))
    problems = _strict_json(out)["problems"]
    assert code == 1 and len(problems) == 1, problems
    assert problems[0]["tensor"] == "step" and problems[0]["file"].endswith(file)
    assert f"group 0 on {rank} is 9" in problems[0]["what"] and "hold 2" in problems[0]["what"]


def _edit_optim(src: Path, dst: Path, file: str, edit) -> None:
    tag = (src / "latest").read_text().strip()
    obj = open_torch_file(src / tag / file).obj
    edit(obj["optimizer_state_dict"])
    save(obj, dst / tag / file)


def test_padding_over_expert_elements_is_found_in_the_expert_data_parallel_layout(parallel_fixtures, tmp_path):
    """The experts' group is partitioned over the expert data-parallel group (here 1 rank: each rank holds
    its experts whole, no padding); padding recorded there covers expert elements, by their global names."""
    fx = parallel_fixtures["moe_ep2_z2_bf16"]
    src, file = fx["checkpoint_path"], "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    dst = _copy(fx, tmp_path / "pads")

    def pads(osd):
        assert osd["partition_count"] == [2, 1] and osd["group_paddings"] == [1, 0]
        osd["group_paddings"][1] = 5

    _edit_optim(src, dst, file, pads)
    code, out = _cli("check", dst, "--json")
    problems = _strict_json(out)["problems"]
    assert code == 1 and len(problems) == 1, problems  # the last 5 elements: expert 3's (rank 1's local 1) fc2.bias
    assert problems[0]["tensor"] == "moe.deepspeed_moe.experts.deepspeed_experts.3.fc2.bias"
    assert problems[0]["file"].endswith(file) and "5 padding elements at the end of" in problems[0]["what"]
    assert "partition 0 of its 1 expert data-parallel ranks" in problems[0]["what"]

    dst = _copy(fx, tmp_path / "maps")

    def maps(osd):
        m = osd["param_slice_mappings"][1]
        key = "moe.deepspeed_moe.experts.deepspeed_experts.0.fc1.bias"
        m[key].start += 3000

    _edit_optim(src, dst, file, maps)
    code, out = _cli("check", dst, "--json")
    problems = _strict_json(out)["problems"]
    assert code == 1 and len(problems) == 1, problems
    assert problems[0]["tensor"] == "moe.deepspeed_moe.experts.deepspeed_experts.2.fc1.bias"  # global id 2
    assert "param_slice_mappings puts it at 3627..3646" in problems[0]["what"] and "layout at 627..646" in \
        problems[0]["what"]


def test_a_tensor_parallel_checkpoint_without_rules_is_one_message(parallel_fixtures, tmp_path):
    fx = parallel_fixtures["tp2_dp2_z1_bf16_noinfo"]
    import subprocess
    import sys

    for args in (["check", fx["checkpoint_path"]], ["diff", fx["checkpoint_path"], fx["checkpoint_path"]]):
        r = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "--tp-rules" in r.stderr, r.stderr
    code, out = _cli("check", fx["checkpoint_path"], "--json", *_rules(fx))
    assert code == 0 and json.loads(out)["problems"] == []
