"""Every optimizer through every command, on real DeepSpeed 0.19.8 checkpoints (tests/fixtures/optim: Muon at ZeRO-1/2/3
in bf16 and fp32 at 2 and 3 ranks, torch SGD / Adagrad / RMSprop / Adafactor clients, DeepSpeed's CPU Lion and
Adagrad, AdamW under hpZ and bf16 autocast), against the references gathered from the live engines:

- inspect names each group's optimizer, keys, layout (Muon's whole matrices per rank at ZeRO-1/2) and step;
- ``export --states all`` writes every key of every parameter bit for bit; ``step`` is refused as a scalar;
- ``check --states`` finds no false problem (momentum is signed), and does find a second moment below zero;
- a Muon buffer of the wrong length is refused by every command that would read it;
- dp reshards (2 -> 3, 3 -> 2, hpZ 4 -> 2) load in DeepSpeed with every state bit for bit, and one more step matches
  resuming the original at its own size (the reshard tolerances of tests/fixtures/compare.py);
- ``--universal`` loads exactly in DeepSpeed's ``load_universal`` where its loaders can hold the state, and is
  refused before anything is written where they cannot (Muon at ZeRO-1/2, any ZeRO-3 state but Adam's);
- the DCP export loads exactly into FSDP2 with the matching torch optimizers at 1 and 2 ranks (Muon + AdamW,
  SGD, Adagrad, DeepSpeed's CPU Adagrad as torch's Adagrad, RMSprop, AdamW) and one more step runs; Adafactor
  and Lion are refused before writing, with the reason.
"""
from __future__ import annotations

import math
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.analysis.tensordiff import ONLY_IN_A, ONLY_IN_B
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.specs import NewTensor
from ckptlib.io.torchzip.writer import save
from ckptlib.kinds.optimizers import PARTITIONED, WHOLE_PARAMS
from tests.fixtures.compare import FP32_ATOL, HALF_RTOL, continuation_error
from tests.fixtures.optim import common as C

SPECS = {s.name: s for s in C.all_specs()}
NAMES = sorted(SPECS)
FAMILIES = {"muon": None, "sgd": "sgd", "adagrad": "adagrad", "rmsprop": "rmsprop", "adafactor": "adafactor",
            "adamw": "adam", "cpu_lion": "lion", "cpu_adagrad": "cpu_adagrad"}




def _ref(fx: dict) -> dict:
    return torch.load(fx["path"] / "reference.pt", weights_only=True)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values (the export writes states as fp32; a bf16 state upcasts exactly) and shape."""
    return a.shape == b.shape and torch.equal(a.float(), b.float())


# ============================================================================================ inspect
@pytest.mark.parametrize("name", NAMES)
def test_inspect_names_each_groups_optimizer_keys_layout_and_step(optim_fixtures, name):
    fx = optim_fixtures[name]
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        groups = ck.optimizer.groups
        assert len(groups) == len(fx["state_keys"]) and not ck.problems and not ck.optimizer.state_problems
        for gs in groups:
            want = [k for k in fx["state_keys"][str(gs.group)] if k != "step"]
            assert sorted(gs.key_names) == sorted(want), gs
            assert gs.step == fx["step"][str(gs.group)], gs
            family = FAMILIES[fx["optimizer"]] or ("muon" if "momentum_buffer" in want else "adam")
            assert gs.family.name == family, gs
            whole = family == "muon" and fx["zero_stage"] in (1, 2)
            assert all(k.layout == (WHOLE_PARAMS if whole else PARTITIONED) for k in gs.keys), gs
            for k in gs.keys:
                assert k.dtype == fx["state_dtypes"][str(gs.group)][k.name], (gs, k)
        d = ckptlib.describe(ck)
    assert [g["optimizer"] for g in d["optimizer"]["groups"]] == [g.family.name for g in groups]
    assert d["problems"] == []


def test_inspect_text_shows_muons_groups(optim_fixtures):
    from ckptlib.analysis.summary import format_text

    with ckptlib.open_checkpoint(optim_fixtures["muon_z2_bf16_w3"]["checkpoint_path"]) as ck:
        text = format_text(ck)
    assert "stepping Muon + Adam/AdamW" in text and "step 2" in text
    assert "group 0 group0-muon-params: Muon; momentum_buffer (bf16, whole matrices per rank); no step" in text
    assert "group 1 group0-adam-params: Adam/AdamW; exp_avg (fp32), exp_avg_sq (fp32); step 2" in text


# ============================================================================================ export
def _exported(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("name", NAMES)
def test_export_states_all_is_bit_exact_for_every_key(optim_fixtures, tmp_path, name):
    fx = optim_fixtures[name]
    ref = _ref(fx)
    plan = ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out", states=["all"], hf_files=False)
    ckptlib.run(plan)
    weights = _exported(tmp_path / "out")
    for n, want in ref["fp32"].items():
        assert torch.equal(weights[n], want), n
    keys = sorted({k for st in ref["optim"].values() for k in st})
    assert sorted(plan.states) == keys
    for key in keys:
        got = _exported(tmp_path / "out" / key)
        holders = {n for n, st in ref["optim"].items() if key in st}
        assert set(got) == holders, key
        for n in holders:
            assert _same_values(got[n], ref["optim"][n][key]), (key, n)


def test_export_says_the_step_is_a_scalar(optim_fixtures, tmp_path):
    fx = optim_fixtures["muon_z2_bf16_w2"]
    with pytest.raises(ckptlib.CkptError, match=r"the step \(2\) is a scalar, not a per-element state"):
        ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out", states=["exp_avg", "step"])
    with pytest.raises(ckptlib.CkptError, match="has no 'sum'.*Muon"):
        ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out", states=["sum"])


def test_the_cli_exports_states_all(optim_fixtures, tmp_path):
    from tests.cli import run_cli

    fx = optim_fixtures["sgd_z2_bf16_w3"]
    code, out, err = run_cli("export", fx["checkpoint_path"], tmp_path / "out", "--states", "all", "--no-hf-files")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["momentum_buffer"]


# ============================================================================================ check and diff
@pytest.mark.parametrize("name", NAMES)
def test_check_states_finds_no_false_problem(optim_fixtures, name):
    fx = optim_fixtures[name]
    result = ckptlib.check(fx["checkpoint_path"], states=True)
    assert result.problems == [], [str(p) for p in result.problems]
    if fx["optimizer"] in ("muon", "sgd"):  # the momentum is signed: negative values are not damage
        ref = _ref(fx)
        assert any((st.get("momentum_buffer", torch.zeros(1)) < 0).any() for st in ref["optim"].values())


def _rewrite_state(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint folder ``src`` whose rank-0 optimizer file is edited by ``edit(state dict of the
    first group)``."""
    shutil.copytree(src, dst)
    f = next(dst.glob("*/*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    obj = open_torch_file(f).obj
    osd = obj["optimizer_state_dict"]
    state = osd["optimizer_state_dict"]["state"] if "fp32_flat_groups" in osd else osd["base_optimizer_state"]["state"]
    edit(state[0])
    tmp = f.with_suffix(".tmp")
    save(obj, tmp)
    tmp.replace(f)
    return dst


def test_check_flags_a_sum_of_squares_below_zero(optim_fixtures, tmp_path):
    fx = optim_fixtures["adagrad_1group_z2_bf16_w2"]

    def negate(st):
        t = st["sum"].read().clone()
        t[5] = -1.0
        st["sum"] = NewTensor.from_tensor(t)

    path = _rewrite_state(fx["checkpoint_path"], tmp_path / "bad", negate)
    problems = [str(p) for p in ckptlib.check(path, states=True).problems]
    assert len(problems) == 1 and "1 values below zero: Adagrad's sum (a sum of squared gradients) is never " \
                                   "negative" in problems[0], problems


def test_a_muon_buffer_of_the_wrong_length_is_refused(optim_fixtures, tmp_path):
    fx = optim_fixtures["muon_z2_bf16_w2"]

    def cut(st):
        st["momentum_buffer"] = NewTensor.from_tensor(st["momentum_buffer"].read()[:1502].clone())

    path = _rewrite_state(fx["checkpoint_path"], tmp_path / "bad", cut)
    with ckptlib.open_checkpoint(path) as ck:
        d = ckptlib.describe(ck)
    assert any("the 'momentum_buffer' state of group 0 (Muon) on dp rank 0 holds 1502 elements; the whole "
               "parameters its partition touches need 2046" in p for p in d["problems"]), d["problems"]
    problems = [str(p) for p in ckptlib.check(path, states=True).problems]
    assert any("holds 1502 elements" in p for p in problems), problems
    ckptlib.run(ckptlib.plan_export(path, tmp_path / "weights", hf_files=False))  # the weights are not touched
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="cannot be placed"):
        ckptlib.plan_export(path, tmp_path / "states", states=["momentum_buffer"])
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="cannot be placed"):
        ckptlib.plan_reshard(path, tmp_path / "re", 3)
    assert not (tmp_path / "re").exists() and not (tmp_path / "states").exists()


def test_a_replica_of_a_straddling_matrix_that_differs_is_refused_before_writing(optim_fixtures, tmp_path):
    fx = optim_fixtures["muon_z1_fp32_w2"]  # fc3.weight's momentum is held whole by ranks 0 and 1

    def change(st):
        t = st["momentum_buffer"].read().clone()
        t[1089 + 3] += 1.0  # inside fc3.weight's copy on rank 0
        st["momentum_buffer"] = NewTensor.from_tensor(t)

    path = _rewrite_state(fx["checkpoint_path"], tmp_path / "bad", change)
    with pytest.raises(ckptlib.CkptError, match="fc3.weight/momentum_buffer: dp rank 0 and dp rank 1"):
        ckptlib.run(ckptlib.plan_export(path, tmp_path / "out", states=["all"], hf_files=False))
    assert not (tmp_path / "out").exists()
    problems = [str(p) for p in ckptlib.check(path, states=True).problems]
    assert any("fc3.weight" in p and "momentum_buffer" in p for p in problems), problems


@pytest.mark.parametrize("name", ["muon_z2_bf16_w3", "rmsprop_z3_bf16_w2", "cpu_lion_z2_bf16_w2"])
def test_diff_pairs_every_state_of_a_reshard_and_sees_a_change(optim_fixtures, tmp_path, name):
    fx = optim_fixtures[name]
    out = tmp_path / "re"
    ckptlib.reshard(fx["checkpoint_path"], out, 2 if fx["world_size"] == 3 else 3)
    d = ckptlib.diff(fx["checkpoint_path"], out, states=True)
    ref = _ref(fx)
    n_states = sum(len(st) for st in ref["optim"].values())
    assert d.ok and d.counts["same"] >= len(ref["fp32"]) + n_states, d.describe()
    bad = _rewrite_state(fx["checkpoint_path"], tmp_path / "bad", _bump_first_key)
    d = ckptlib.diff(fx["checkpoint_path"], bad, states=True)
    assert d.counts["changed"] == 1 and d.counts["same"] == len(d.tensors) - 1, d.describe()


def _bump_first_key(st):
    key = next(k for k, v in st.items() if k != "step" and getattr(v, "numel", 0) > 1)
    t = st[key].read().clone()
    t[0] += 1.0
    st[key] = NewTensor.from_tensor(t)


# ============================================================================================ reshard and universal
#: (fixture, target size): every Muon fixture, and the other optimizers at their stages
RESHARDS = ([(n, 3 if SPECS[n].world == 2 else 2) for n in NAMES if n.startswith("muon_")]
            + [(n, 3) for n in ("sgd_z1_bf16_w2", "sgd_z3_bf16_w2", "adagrad_1group_z1_bf16_w2", "rmsprop_z1_bf16_w2",
                                "rmsprop_z3_bf16_w2", "adafactor_z1_bf16_w2", "cpu_lion_z2_bf16_w2",
                                "cpu_lion_z3_bf16_w2", "cpu_adagrad_z2_bf16_w2", "cpu_adagrad_z3_bf16_w2",
                                "adamw_autocast_z2_w2", "adamw_autocast_z3_w2")]
            + [(n, 2) for n in ("sgd_z2_bf16_w3", "adagrad_1group_z2_bf16_w3", "rmsprop_z2_bf16_w3",
                                "adafactor_z2_bf16_w3", "adamw_hpz_z3_bf16_w4")]
            + [("adafactor_z1_bf16_w2", 2)])  # the same size: Adafactor's steps depend on the partitioning
#: (fixture, target size) whose universal checkpoint DeepSpeed's loader holds exactly
UNIVERSALS = [("sgd_z2_bf16_w2", 3), ("rmsprop_z1_bf16_w2", 3), ("adagrad_1group_z2_bf16_w3", 2),
              ("adafactor_z2_bf16_w2", 2), ("cpu_lion_z2_bf16_w2", 3), ("cpu_adagrad_z2_bf16_w2", 3),
              ("adamw_hpz_z3_bf16_w4", 2), ("adamw_autocast_z3_w2", 3), ("cpu_lion_z3_bf16_w2", 3)]
#: (fixture, what the refusal says) of universal checkpoints DeepSpeed 0.19.8's loaders cannot hold
NOT_UNIVERSAL = [("muon_z1_bf16_w2", "cannot hold this momentum"), ("muon_z2_fp32_w3", "cannot hold this momentum"),
                 ("muon_z3_bf16_w2", "restores only exp_avg and exp_avg_sq"),
                 ("sgd_z3_bf16_w2", "restores only exp_avg and exp_avg_sq"),
                 ("adagrad_1group_z3_bf16_w2", "restores only exp_avg and exp_avg_sq"),
                 ("rmsprop_z3_bf16_w2", "restores only exp_avg and exp_avg_sq"),
                 ("cpu_adagrad_z3_bf16_w2", "restores only exp_avg and exp_avg_sq")]


@pytest.fixture(scope="module")
def loads(optim_fixtures, tmp_path_factory):
    """Every reshard and universal checkpoint above loaded by DeepSpeed (one launch per world size), and every
    source resumed at its own size."""
    from tests.fixtures.optim.load_check import job_for_fixture, run_load_checks

    work = tmp_path_factory.mktemp("optim-loads")
    jobs: dict = defaultdict(list)
    originals, names = set(), set()
    for name, m in RESHARDS + [(n, m) for n, m in UNIVERSALS]:
        fx = optim_fixtures[name]
        if name not in originals:
            originals.add(name)
            jobs[fx["world_size"]].append(job_for_fixture(fx, name=f"{name}@orig"))
    for name, m in RESHARDS:
        out = work / f"{name}-to{m}"
        if f"{name}->{m}" in names:
            continue
        plan = ckptlib.plan_reshard(optim_fixtures[name]["checkpoint_path"], out, m)
        ckptlib.run(plan)
        assert ckptlib.verify(plan).ok, ckptlib.verify(plan).describe()
        jobs[m].append(job_for_fixture(optim_fixtures[name], checkpoint_dir=out, name=f"{name}->{m}"))
        names.add(f"{name}->{m}")
    for name, m in UNIVERSALS:
        out = work / f"{name}-universal"
        plan = ckptlib.plan_universal(optim_fixtures[name]["checkpoint_path"], out)
        ckptlib.run(plan)
        assert ckptlib.verify(plan).ok, ckptlib.verify(plan).describe()
        # a universal load restores neither frozen parameters nor buffers: the engine starts from the generator's
        jobs[m].append(job_for_fixture(optim_fixtures[name], checkpoint_dir=out, name=f"{name}->universal{m}",
                                       universal=True, init_seed=C.SEED, perturb_buffers=False))
    # controls: the same checks must fail when Muon's momentum is lost, or shifted by one element on one rank
    fx = optim_fixtures[CONTROL[0]]
    out = work / "control"
    ckptlib.reshard(fx["checkpoint_path"], out, CONTROL[1])
    jobs[CONTROL[1]].append(job_for_fixture(fx, checkpoint_dir=out, name="lost", load_optimizer_states=False))
    shifted = _rewrite_state(out, work / "control-shifted", _roll_momentum)
    jobs[CONTROL[1]].append(job_for_fixture(fx, checkpoint_dir=shifted, name="shifted"))
    results = {}
    for world, js in sorted(jobs.items()):
        results.update(run_load_checks(js, world, work / f"w{world}"))
    return results


CONTROL = ("muon_z2_bf16_w2", 3)


def _roll_momentum(st):
    st["momentum_buffer"] = NewTensor.from_tensor(torch.roll(st["momentum_buffer"].read(), 1))


@pytest.mark.parametrize("label", ["lost", "shifted"])
def test_the_checks_catch_a_lost_or_shifted_muon_momentum(loads, optim_fixtures, label):
    fx = optim_fixtures[CONTROL[0]]
    got, orig = loads[label], loads[f"{CONTROL[0]}@orig"]
    if label == "shifted" and "error" in got:  # the harness compares the copies of a straddling matrix itself
        assert "copy differs" in got["error"], got["error"]
        return
    assert "error" not in got, got.get("error")
    with pytest.raises(AssertionError):
        _assert_holds(got["loaded"], _ref(fx))
    err = continuation_error(got["after_step"]["fp32"], orig["after_step"]["fp32"], orig["loaded"]["fp32"], "bf16")
    assert err > 10 * HALF_RTOL, err


def _assert_holds(loaded: dict, ref: dict) -> None:
    """Every fp32 master and every optimizer state key of every parameter bit for bit (values: a bf16 Muon
    momentum comes back fp32 from torch's load_state_dict, DeepSpeed #7746), and every group's step."""
    for n, want in ref["fp32"].items():
        assert torch.equal(loaded["fp32"][n], want), f"fp32 {n}"
        assert sorted(loaded["optim"][n]) == sorted(ref["optim"][n]), n
        for key, v in ref["optim"][n].items():
            assert _same_values(loaded["optim"][n][key], v), f"{key} {n}"
    steps = {g: s for g, s in ref["step"].items()}
    assert {g: s for g, s in loaded["step"].items()} == steps or sorted(set(loaded["step"].values()) - {None}) == \
        sorted(set(steps.values()) - {None}), (loaded["step"], steps)


def _sign_like(fx: dict, orig: dict) -> dict:
    """Per parameter, the elements whose update is a sign: all of Lion's; Adagrad's where its sum of squared
    gradients is still ~0 (embedding rows no batch has used: the update is then g / sqrt(g^2) = sign(g), whatever
    noise g is). There a last-bit difference of the gradient (another reduction order) flips the update."""
    fp32 = orig["loaded"]["fp32"]
    if fx["optimizer"] == "cpu_lion":
        return {n: torch.ones_like(t, dtype=torch.bool) for n, t in fp32.items()}
    key = {"adagrad": "sum", "cpu_adagrad": "exp_avg_sq"}.get(fx["optimizer"])
    if key is None:
        return {n: torch.zeros_like(t, dtype=torch.bool) for n, t in fp32.items()}
    return {n: orig["loaded"]["optim"][n][key].float() < 1e-12 for n in fp32}


def _assert_continues_like_the_original(got: dict, orig: dict, fx: dict) -> None:
    """One more step after the load matches one more step of the original at its own size, within the reshard
    tolerances (tests/fixtures/compare.py: only the reduction order of the gradients differs). bf16 autocast
    reduces its gradients in bf16: the bf16 tolerance. Where an update is a sign (:func:`_sign_like`), an element
    may flip, by at most the largest step a sign makes (2 lr; Lion, whose every element is one: at most 1% of
    them); the other elements are held to the tolerance."""
    after, oafter, base = got["after_step"]["fp32"], orig["after_step"]["fp32"], orig["loaded"]["fp32"]
    sign = _sign_like(fx, orig)
    lr = max(g["lr"] for g in orig["loaded"]["param_groups"])
    moved = {n: (after[n] - oafter[n]).abs() * sign[n] for n in oafter}
    if fx["optimizer"] == "cpu_lion":  # every element is a sign: few may flip
        assert sum(int((d > 0).sum()) for d in moved.values()) <= 0.01 * sum(d.numel() for d in moved.values())
    assert max(float(d.max()) for d in moved.values()) <= 2 * lr * (1 + 1e-3)
    rest = {n: torch.where(sign[n], oafter[n], after[n]) for n in oafter}
    half = fx["dtype"] != "fp32" or "autocast" in fx["name"]
    err = continuation_error(rest, oafter, base, "bf16" if half else "fp32")
    assert err <= (HALF_RTOL if half else FP32_ATOL), err


@pytest.mark.parametrize("name,m", RESHARDS, ids=[f"{n}->{m}" for n, m in RESHARDS])
def test_deepspeed_loads_the_reshard_exactly_and_continues_like_the_original(loads, optim_fixtures, name, m):
    fx = optim_fixtures[name]
    got, orig = loads[f"{name}->{m}"], loads[f"{name}@orig"]
    assert "error" not in got, got.get("error")
    assert "error" not in orig, orig.get("error")
    assert got["world_size"] == m
    ref = _ref(fx)
    _assert_holds(got["loaded"], ref)
    _assert_holds(orig["loaded"], ref)
    for b, want in ref["buffers"].items():
        assert torch.equal(got["loaded"]["buffers"][b], want), b
    assert math.isfinite(got["after_step"]["loss"])
    if fx["optimizer"] == "adafactor" and m != fx["world_size"]:  # the plan says why the steps differ
        plan = ckptlib.plan_reshard(fx["checkpoint_path"], "/nonexistent/out", m)
        assert any("Adafactor: DeepSpeed's ZeRO Adafactor scales each update by norms taken over a rank's whole flat "
                   "partition" in n for n in plan.notes), plan.notes
        return
    _assert_continues_like_the_original(got, orig, fx)


@pytest.mark.parametrize("name,m", UNIVERSALS, ids=[f"{n}->universal{m}" for n, m in UNIVERSALS])
def test_deepspeeds_universal_loader_restores_the_universal_checkpoint_exactly(loads, optim_fixtures, name, m):
    fx = optim_fixtures[name]
    got, orig = loads[f"{name}->universal{m}"], loads[f"{name}@orig"]
    assert "error" not in got, got.get("error")
    ref = _ref(fx)
    _assert_holds(got["loaded"], ref)
    if fx["zero_stage"] != 3:  # ZeRO-3: DeepSpeed's loader gives every sub-group one step tensor (test_universal.py)
        _assert_continues_like_the_original(got, orig, fx)


@pytest.mark.parametrize("name,why", NOT_UNIVERSAL, ids=[n for n, _ in NOT_UNIVERSAL])
def test_universal_is_refused_before_writing_where_deepspeeds_loader_cannot_hold_the_state(optim_fixtures, tmp_path,
                                                                                         name, why):
    fx = optim_fixtures[name]
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match=why) as e:
        ckptlib.plan_universal(fx["checkpoint_path"], tmp_path / "u")
    assert "ckpt reshard CKPT OUT --world-size N" in e.value.hint
    assert not (tmp_path / "u").exists()


# ============================================================================================ DCP for FSDP2
DCP = ["muon_z2_bf16_w2", "muon_z3_fp32_w3", "muon_z1_bf16_w3",
       "sgd_z1_bf16_w2", "adagrad_1group_z2_bf16_w2", "rmsprop_z3_bf16_w2", "cpu_adagrad_z2_bf16_w2",
       "adamw_hpz_z3_bf16_w4"]
NOT_DCP = [("adafactor_z2_bf16_w2", "keeps a matrix's second moment factored"),
           ("cpu_lion_z2_bf16_w2", "torch has no Lion optimizer")]
TORCH_CLASSES = {"muon": ["Muon", "AdamW", "AdamW"], "sgd": ["SGD"] * 2, "adagrad": ["Adagrad"],
                 "rmsprop": ["RMSprop"] * 2, "cpu_adagrad": ["Adagrad"] * 2, "adamw": ["AdamW"] * 2}


@pytest.fixture(scope="module")
def fsdp(optim_fixtures, tmp_path_factory):
    from tests.fixtures.fsdp_runner import run_fsdp_loads

    pytest.importorskip("torch.distributed.fsdp")
    work = tmp_path_factory.mktemp("optim-dcp")
    jobs, plans = defaultdict(list), {}
    for name in DCP:
        fx = optim_fixtures[name]
        out = work / name
        plan = ckptlib.plan_export(fx["checkpoint_path"], out, format="dcp", dcp={"optimizer": True})
        ckptlib.run(plan)
        assert ckptlib.verify(plan).ok
        plans[name] = plan
        for m in (1, 2):
            jobs[m].append({"name": f"{name}@{m}", "dcp": out, "model": "fixture", "groups": plan.param_groups,
                            "classes": plan.torch_optimizers, "settings": plan.torch_settings, "step": True})
    results = {}
    for m, js in sorted(jobs.items()):
        results.update(run_fsdp_loads(js, m, work / f"fsdp-w{m}"))
    return results, plans


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("name", DCP)
def test_fsdp2_with_the_matching_torch_optimizers_loads_every_state_exactly_and_steps(fsdp, optim_fixtures, name, m):
    results, plans = fsdp
    fx = optim_fixtures[name]
    plan = plans[name]
    assert plan.torch_optimizers == TORCH_CLASSES[fx["optimizer"]]
    got = results[f"{name}@{m}"]
    assert "error" not in got, got.get("error")
    ref = _ref(fx)
    loaded = got["loaded"]
    family = {n: ckptlib.open_checkpoint(fx["checkpoint_path"]).state_group(n).family for n in ref["fp32"]}
    for n, want in ref["fp32"].items():
        assert torch.equal(loaded["params"][n], want), n
        st = loaded["optim"][n]
        for key, v in ref["optim"][n].items():
            assert _same_values(st[family[n].torch_key(key)], v), (n, key)
        if family[n].steps:
            assert st["step"] == float(max(s for s in ref["step"].values() if s is not None)), n
        else:
            assert "step" not in st, n
    assert [g["class"] for g in loaded["groups"]] == plan.torch_optimizers
    for g in loaded["groups"]:
        assert g["lr"] != 0.5  # the checkpoint's hyper-parameters replaced the script's
    assert math.isfinite(got["after_step"]["loss"])


@pytest.mark.parametrize("name", DCP)
def test_diff_of_the_checkpoint_and_its_dcp_export_pairs_torchs_state_keys(fsdp, optim_fixtures, name):
    """Every state of the checkpoint pairs with the DCP folder's, under torch's key where torch names it otherwise
    (CPU Adagrad's exp_avg_sq is torch Adagrad's sum), and all are the same: no 'only in A / only in B'."""
    _, plans = fsdp
    d = ckptlib.diff(optim_fixtures[name]["checkpoint_path"], plans[name].out, states=True)
    assert d.ok and d.counts[ONLY_IN_A] == d.counts[ONLY_IN_B] == 0, d.summary()
    states = {t.key.split("/")[0] for t in d.tensors if "/" in t.key} - {"step"}
    family = ckptlib.open_checkpoint(optim_fixtures[name]["checkpoint_path"]).optimizer
    assert states == {g.family.torch_key(k.name) for g in family.groups for k in g.keys}
    if optim_fixtures[name]["optimizer"] == "cpu_adagrad":  # torch Adagrad's sum, said in the notes
        assert states == {"sum"} and any("exp_avg_sq as sum" in n for n in d.plan.step_notes), d.plan.step_notes


@pytest.mark.parametrize("name,why", NOT_DCP, ids=[n for n, _ in NOT_DCP])
def test_dcp_refuses_what_no_torch_optimizer_continues(optim_fixtures, tmp_path, name, why):
    fx = optim_fixtures[name]
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match=why):
        ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "out", format="dcp", dcp={"optimizer": True})
    assert not (tmp_path / "out").exists()
    ckptlib.run(ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "model", format="dcp"))  # the model alone


# ============================================================================================ no internal error
def _every_plan(path: Path, world: int, config) -> list:
    """What each command plans for a checkpoint: a plan, or a refusal (a CkptError); anything else is a bug."""
    out = []
    attempts = [("describe", lambda: ckptlib.describe(ckptlib.open_checkpoint(path))),
                ("check", lambda: ckptlib.plan_check(path, states=True)),
                ("export", lambda: ckptlib.plan_export(path, "/nonexistent/a", states=["all"], model_config=config)),
                ("dcp", lambda: ckptlib.plan_export(path, "/nonexistent/b", format="dcp", dcp={"optimizer": True},
                                                    model_config=config)),
                ("reshard", lambda: ckptlib.plan_reshard(path, "/nonexistent/c", 3 if world == 2 else 2)),
                ("universal", lambda: ckptlib.plan_universal(path, "/nonexistent/d"))]
    for what, make in attempts:
        try:
            make()
            out.append((what, "planned"))
        except ckptlib.CkptError as e:
            out.append((what, f"refused: {e.message}"))
    return out


def test_every_command_plans_or_refuses_every_optimizer_and_autoep_checkpoint(optim_fixtures, autoep_fixtures):
    """No command stops with an internal error on any of these checkpoints (what they write is checked above and
    in tests/test_autoep.py); the refusals are the ones the docs name."""
    refused = {}
    for fx in list(optim_fixtures.values()) + list(autoep_fixtures.values()):
        config = fx["path"] / "hf_config" if (fx["path"] / "hf_config").is_dir() else None
        for what, result in _every_plan(fx["checkpoint_path"], fx["world_size"], config):
            if result.startswith("refused"):
                refused[(fx["name"], what)] = result
    kinds = {(name.split("_z")[0], what) for name, what in refused}
    assert kinds <= {("muon", "universal"), ("sgd", "universal"), ("rmsprop", "universal"),
                     ("adagrad_1group", "universal"), ("cpu_adagrad", "universal"), ("adafactor", "dcp"),
                     ("cpu_lion", "dcp"), ("mixtral", "reshard"), ("qwen3_moe", "reshard"), ("olmoe", "reshard")}, kinds
    assert all("universal loader" in r for (n, w), r in refused.items() if w == "universal"), refused
