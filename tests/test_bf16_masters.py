"""Checkpoints whose optimizer keeps its masters in bf16 (DeepSpeed 0.19.1+: ``"bf16": {"enabled": true,
"bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}``), real ones written by DeepSpeed 0.19.8 at
ZeRO-1/2/3, world 2, torch AdamW (tests/fixtures/bf16_masters; FILES.md there says what the files hold).

Everything is compared bit for bit with the live engine's masters and moments (the fixtures' reference.pt, bf16):
the files themselves; ``ckpt inspect`` naming them (text and JSON); an export at fp32 (the masters widened) and at
bf16 (the masters as stored), ``--states all`` (the bf16 moments widened), and the notes that say so; a DCP export
loaded by torch's own get_state_dict / dcp.load / set_state_dict (the dtype torch's AdamW then holds); ckptlib's
universal folder and DeepSpeed's ds_to_universal's; and DeepSpeed itself loading a reshard to 3 ranks and ckptlib's
universal folder (one launch of 3 ranks for the six loads).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

import ckptlib
from ckptlib import cli
from ckptlib.analysis import placement
from tests.fixtures.bf16_masters.common import BF16_MASTERS, all_specs
from tests.fixtures.bf16_masters.factory import SPECS_MODULE
from tests.fixtures.compare import reference
from tests.test_optim_fixtures import read_files

NAMES = [s.name for s in all_specs()]
KEYS = ("exp_avg", "exp_avg_sq")
#: what masters() (ckpt inspect's ``masters`` row) says of these checkpoints
MASTERS_TEXT = ("bf16: the optimizer's master weights themselves are bf16 (bf16_master_weights_and_grads), and so are "
                "its exp_avg, exp_avg_sq (bf16_optimizer_states); an fp32 export is the bf16 masters widened, exactly "
                "(no bit is lost), and --dtype bf16 writes them as stored: nothing rounded")
FP32_NOTE = "the weights written are the bf16 masters widened to fp32, exactly"
BF16_NOTE = "the weights written are the masters as stored: nothing rounded"
STATES_NOTE = "the optimizer states exp_avg, exp_avg_sq are stored in bf16 and written in fp32"


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    ib = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ib), b.contiguous().view(ib))


def _safetensors(path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def fx_ref(bf16_master_fixtures):
    return {name: (bf16_master_fixtures[name], reference(bf16_master_fixtures[name])) for name in NAMES}


# ------------------------------------------------------------------------------------------------ the fixtures
def test_deepspeed_kept_masters_and_moments_in_bf16_at_every_stage(bf16_master_fixtures, fx_ref):
    assert sorted(bf16_master_fixtures) == sorted(NAMES)
    for name, (fx, ref) in fx_ref.items():
        assert fx["extras"]["ds_config"]["bf16"] == BF16_MASTERS
        assert fx["optimizer_class"] == ("DeepSpeedZeroOptimizer_Stage3" if fx["zero_stage"] == 3
                                         else "DeepSpeedZeroOptimizer"), name
        assert fx["base_optimizer_class"] == "AdamW" and fx["extras"]["skipped_steps"] == 0
        want = {"exp_avg": "bfloat16", "exp_avg_sq": "bfloat16", "step": "tensor(float32, 0-dim)"}
        assert fx["state_dtypes"] == {"0": want, "1": want}, name
        assert {t.dtype for t in ref["fp32"].values()} == {torch.bfloat16}, name
        assert {t.dtype for s in ref["optim"].values() for t in s.values()} == {torch.bfloat16}, name
        # the engine's 16-bit module weights are the masters themselves (ZeRO-3: the same partition)
        for n, m in ref["fp32"].items():
            assert _bits(ref["lp"][n], m), (name, n)


@pytest.mark.parametrize("name", NAMES)
def test_the_files_hold_the_live_engines_bf16_masters_and_moments(fx_ref, name):
    """Read with torch.load and cut by tests/test_optim_fixtures.read_files: the dtype as the engine held it, bf16."""
    fx, ref = fx_ref[name]
    got = read_files(fx)
    assert sorted(got["fp32"]) == sorted(ref["fp32"])
    for n, want in ref["fp32"].items():
        assert _bits(got["fp32"][n], want), n
        for k in KEYS:
            assert _bits(got["optim"][n][k], ref["optim"][n][k]), (n, k)
    for g, scalars in ref["scalars"].items():
        assert _bits(got["scalars"][g]["step"], scalars["step"]), g


# ------------------------------------------------------------------------------------------------ inspect
@pytest.mark.parametrize("name", NAMES)
def test_inspect_names_the_bf16_masters_and_moments(fx_ref, capsys, name):
    fx, _ = fx_ref[name]
    assert cli.main(["inspect", str(fx["checkpoint_path"])]) == 0
    text = capsys.readouterr().out
    assert f"masters     {MASTERS_TEXT}\n" in text, text
    assert cli.main(["inspect", "--json", str(fx["checkpoint_path"])]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["masters"] == {"dtype": "bfloat16", "text": MASTERS_TEXT,
                            "states": {"exp_avg": "bfloat16", "exp_avg_sq": "bfloat16"}}
    assert [[(k["key"], k["dtype"]) for k in g["keys"]] for g in d["optimizer"]["groups"]] == \
        [[("exp_avg", "bfloat16"), ("exp_avg_sq", "bfloat16")]] * 2


def test_inspect_says_nothing_of_masters_for_fp32_masters(fixture_by_name, capsys):
    """A plain bf16 run keeps fp32 masters: no ``masters`` row, and the JSON says fp32."""
    fx = fixture_by_name("z2_bf16_w2")
    assert cli.main(["inspect", str(fx["checkpoint_path"])]) == 0
    assert "\nmasters " not in capsys.readouterr().out
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        m = placement.masters(ck)
    assert m["dtype"] == "float32" and m["states"] == {"exp_avg": "float32", "exp_avg_sq": "float32"}


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("name", NAMES)
def test_export_is_the_live_masters_widened_at_fp32_and_as_stored_at_bf16(fx_ref, tmp_path, capsys, name):
    fx, ref = fx_ref[name]
    ck = fx["checkpoint_path"]
    plan = ckptlib.plan_export(ck, tmp_path / "fp32", states=("all",))
    assert any(FP32_NOTE in n for n in plan.notes) and any(STATES_NOTE in n for n in plan.notes), plan.notes
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    w, _ = _safetensors(tmp_path / "fp32" / "model.safetensors")
    for n, m in ref["fp32"].items():
        assert _bits(w[n], m.float()), n
    assert _bits(w["head.weight"], ref["fp32"]["embed.weight"].float())
    for n, t in ref["frozen"].items():
        assert _bits(w[n], t.float()), n
    for n, t in ref["buffers"].items():
        assert _bits(w[n], t.float() if t.is_floating_point() else t), n
    for k in KEYS:
        s, meta = _safetensors(tmp_path / "fp32" / k / "model.safetensors")
        assert meta["step"] == "2" and sorted(s) == sorted(ref["optim"])
        for n, states in ref["optim"].items():
            assert _bits(s[n], states[k].float()), (k, n)

    assert cli.main(["export", str(ck), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert BF16_NOTE in out and "feat_scale, stored in another dtype, is rounded to bf16" in out, out
    w, _ = _safetensors(tmp_path / "bf16" / "model.safetensors")
    for n, m in ref["fp32"].items():
        assert _bits(w[n], m), n  # the bf16 masters themselves, nothing rounded


def test_dcp_export_widens_the_moments_and_torch_holds_them_in_its_parameters_dtype(fx_ref, tmp_path):
    """torch's own get_state_dict / dcp.load / set_state_dict (one process) on FixtureNet with AdamW: fp32 parameters
    get the masters and moments widened, bf16 parameters (--dtype bf16) the bf16 values stored; step 2."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tests.fixtures.model import build_model, param_groups

    for name, (fx, ref) in fx_ref.items():
        for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            out = tmp_path / f"{name}-{dtype}"
            plan = ckptlib.plan_export(fx["checkpoint_path"], out, format="dcp", dtype=dtype, dcp={"optimizer": True})
            note = FP32_NOTE if dtype == "fp32" else BF16_NOTE
            assert any(note in n for n in plan.notes), plan.notes
            assert any(STATES_NOTE + " (as every state of a DCP export), widened exactly; torch's optimizer holds its "
                       "state in its parameters' dtype" in n for n in plan.notes), plan.notes
            ckptlib.run(plan)
            model = build_model("small", seed=5).to(torch_dtype)
            opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optimizer": osd}
            dcp.load(sd, checkpoint_id=out, no_dist=True)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
            names = {p: n for n, p in model.named_parameters()}
            assert len(opt.state) == len(ref["fp32"])
            for p, st in opt.state.items():
                n = names[p]
                assert _bits(p.detach(), ref["fp32"][n].to(torch_dtype)), (name, dtype, n)
                assert _bits(st["step"], torch.tensor(2.0)), (name, dtype, n)
                for k in KEYS:
                    assert _bits(st[k], ref["optim"][n][k].to(torch_dtype)), (name, dtype, n, k)


# ------------------------------------------------------------------------------------------------ universal
@pytest.mark.parametrize("name", NAMES)
def test_ckptlibs_universal_folder_keeps_bf16_masters_and_moments(fx_ref, tmp_path, name):
    fx, ref = fx_ref[name]
    made = ckptlib.write_universal(fx["checkpoint_path"], tmp_path / "uc").out / f"{fx['tag']}_universal"
    for n, m in ref["fp32"].items():
        assert _bits(torch.load(made / "zero" / n / "fp32.pt", weights_only=True)["param"], m), n
        for k in KEYS:
            assert _bits(torch.load(made / "zero" / n / f"{k}.pt", weights_only=True)["param"], ref["optim"][n][k])
    with ckptlib.open_checkpoint(made) as ck:
        assert placement.masters(ck)["text"] == MASTERS_TEXT


def test_ds_to_universal_keeps_them_bf16_and_ckptlib_reads_its_folders_exactly(bf16_master_fixtures, fx_ref, tmp_path):
    """DeepSpeed's own converter writes the bf16 masters to ``fp32.pt`` as they are (bf16; flat at ZeRO-3); ckptlib
    names them and exports them as stored."""
    from tests.fixtures.universal import ds_to_universal

    saved = ds_to_universal(bf16_master_fixtures, tmp_path / "ds")
    for name, (fx, ref) in fx_ref.items():
        folder = saved[name] / f"{fx['tag']}_universal"
        got = torch.load(folder / "zero" / "fc1.weight" / "fp32.pt", weights_only=False)
        got = got["param"] if isinstance(got, dict) else got
        assert _bits(got.reshape(ref["fp32"]["fc1.weight"].shape), ref["fp32"]["fc1.weight"]), name
        with ckptlib.open_checkpoint(folder) as ck:
            assert placement.masters(ck)["dtype"] == "bfloat16", name
            ckptlib.export(ck, tmp_path / f"{name}-out", dtype="bf16", states=KEYS)
        w, _ = _safetensors(tmp_path / f"{name}-out" / "model.safetensors")
        for n, m in ref["fp32"].items():
            assert _bits(w[n], m), (name, n)
        for k in KEYS:
            s, _ = _safetensors(tmp_path / f"{name}-out" / k / "model.safetensors")
            for n in ref["optim"]:
                assert _bits(s[n], ref["optim"][n][k].float()), (name, n, k)


# ------------------------------------------------------------------------------------------------ DeepSpeed loads
@pytest.fixture(scope="module")
def loads(fx_ref, tmp_path_factory) -> dict:
    """One launch of 3 ranks: each fixture resharded to 3 ranks (``<name>-w3``) and ckptlib's universal folder of it
    (``<name>-universal``, load_universal), each loaded by DeepSpeed with the fixture's configuration."""
    from tests.fixtures.optim.load_check import job_for_fixture, run_load_checks

    work = tmp_path_factory.mktemp("bf16-masters-load")
    jobs = []
    for name, (fx, _) in fx_ref.items():
        resharded = work / f"{name}-w3"
        plan = ckptlib.plan_reshard(fx["checkpoint_path"], resharded, world_size=3)
        ckptlib.run(plan)
        assert ckptlib.verify(plan).ok
        with ckptlib.open_checkpoint(resharded) as ck:  # the target keeps the masters bf16, as DeepSpeed would
            assert placement.masters(ck)["text"] == MASTERS_TEXT and ck.dp_world_size == 3
        jobs.append(job_for_fixture(fx, checkpoint_dir=resharded, name=f"{name}-w3", specs=SPECS_MODULE))
        uc = ckptlib.write_universal(fx["checkpoint_path"], work / f"{name}-uc").out
        jobs.append(job_for_fixture(fx, checkpoint_dir=uc, name=f"{name}-universal", universal=True,
                                    specs=SPECS_MODULE))
    return run_load_checks(jobs, 3, work)


def _assert_loaded_exactly(res: dict, ref: dict, frozen_and_buffers: bool, next_step: int = 3) -> None:
    assert "error" not in res, f"{res.get('phase')}: {res.get('error')}"
    got = res["loaded"]
    for n, want in ref["fp32"].items():
        assert _bits(got["fp32"][n], want), f"master {n}"
        for k in KEYS:
            assert _bits(got["optim"][n][k], ref["optim"][n][k]), f"{k} of {n}"
    assert got["step"] == ref["step"] == {0: 2, 1: 2}
    for g, scalars in ref["scalars"].items():
        assert _bits(got["scalars"][g]["step"], scalars["step"]), g
    assert got["global_steps"] == 2 and res["loaded_info"]["masters_round_to_module"]
    if frozen_and_buffers:
        for part in ("frozen", "buffers", "lp"):
            for n, want in ref[part].items():
                assert _bits(got[part][n], want), (part, n)
    after = res["after_step"]
    assert math.isfinite(after["loss"]) and after["global_steps"] == 3
    assert after["step"] == {0: next_step, 1: next_step}
    assert {dt for d in after["state_dtypes"].values() for k, dt in d.items() if k != "step"} == {"bfloat16"}


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_resumes_a_reshard_to_3_ranks_with_bf16_masters_and_moments_exact(fx_ref, loads, name):
    _assert_loaded_exactly(loads[f"{name}-w3"], fx_ref[name][1], frozen_and_buffers=True)


@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_loads_ckptlibs_universal_folder_at_3_ranks_exactly(fx_ref, loads, name):
    """DeepSpeed's universal load restores the masters, moments and steps (not buffers or frozen parameters). Its
    ZeRO-3 loader gives both sub-groups one shared step tensor, which the next step then advances twice (DeepSpeed
    0.19.8; ckptlib/reshard/universal.py)."""
    _assert_loaded_exactly(loads[f"{name}-universal"], fx_ref[name][1], frozen_and_buffers=False,
                           next_step=4 if fx_ref[name][0]["zero_stage"] == 3 else 3)
