"""Universal checkpoints written by ckptlib (plan_universal / write_universal), checked against DeepSpeed.

DeepSpeed 0.19.8 loads the outputs at 1, 2, 3 and 4 ranks (each stage at each size, two sizes per
source; "load_universal": true; one torchrun launch per world size for all jobs) with masters,
moments and step equal to the fixture's reference bit for bit, and one more training step continues
like DeepSpeed resuming the ORIGINAL checkpoint at N (metric and tolerances of tests/test_reshard.py)
and exactly like DeepSpeed resuming the same state resharded natively to M. The files equal what
DeepSpeed's own ds_to_universal writes, tensor for tensor, except where ds_to_universal is wrong
(round_robin_gradients) or where ckptlib chose otherwise (documented in ckptlib/reshard/universal.py).
No temporary files are made; memory is bounded by the chunk buffers.

DeepSpeed's own limitations, shown here rather than hidden:
* ZeRO-3: the universal loader hands ONE step tensor to every sub-group, so in the one training step
  sub-group j uses step t+1+j instead of t+1. Parameters of sub-group 0 are compared with the original
  like ZeRO-1/2; for the others the test shows that the update is exactly AdamW with that wrong step
  (recomputed from the engine's own moments), and that with the right step it would match the
  original: the files hold the right state, the deviation is DeepSpeed's.
* ZeRO-3 with load_optimizer_states=False needs `latest` and the original rank files in the load folder.
* An engine with round_robin_gradients maps universal fragments in the wrong order (any files).
"""
from __future__ import annotations

import filecmp
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import ckptlib
from ckptlib.layout.flat import zero3_sub_groups
from ckptlib.reshard import reshard
from ckptlib.reshard import LATEST_UNIVERSAL, plan_universal, write_universal
from ckptlib.progress import Observer
from ckptlib.io.torchzip import Standin, TensorHandle, open_torch_file
from tests.fixtures.compare import (FP32_ATOL, HALF_RTOL, assert_masters_and_moments_equal, continuation_error,
                                   reference)
from tests.fixtures.load_check import LR
from tests.fixtures.load_runner import job_for_fixture, run_load_checks
from tests.fixtures.universal import ds_to_universal
from tests.fixtures.memory_probe import anon_growth
from tests.fixtures.model import build_model, param_group_names, param_groups

# source -> the sizes it is loaded at: every stage at each of 1, 2, 3, 4 (and never its own size N)
# (few 4-rank jobs: 4 processes on 2 cores are the slowest)
TARGETS = {"z1_fp32_w4": (2, 3), "z1_bf16_w3": (1, 4), "bf16opt_w3": (1, 2),
           "z2_fp32_w4": (1, 3), "z2_bf16_w2": (3, 4), "z2_roundrobin_w3": (1, 2),
           "z3_fp32_w2": (3, 4), "z3_bf16_w3": (1, 2), "z3_subgroup_w3": (1, 2)}
SOURCES = list(TARGETS)
CASES = [(n, m) for n, ms in TARGETS.items() for m in ms]
# compared file by file with DeepSpeed's ds_to_universal
DS_CASES = ["z1_bf16_w3", "z1_fp32_w4", "z2_fp32_w4", "z2_bf16_w2", "z3_bf16_w2", "z3_fp32_w4", "bf16opt_w3",
            "z3_subgroup_w3", "z2_roundrobin_w3"]
# Universal loads restore neither frozen params nor buffers: start from the generator's values so that
# the continuation can be compared with the original (which restores them).
AS_GENERATOR = {"init_seed": 1234, "perturb_buffers": False}
ZERO3_ONLY_RANK0 = ("z3_fp32_w2", 3)   # output left with zero_pp_rank_0's model states only, loaded at 3
DS_ZERO3_LOAD = ("z3_bf16_w2", 3)      # DeepSpeed's own ZeRO-3 output, loaded at 3
WEIGHTS_ONLY = ("z3_bf16_w3", 1)       # ZeRO-3 universal load with load_optimizer_states=False
# DeepSpeed 0.19.8 engines with round_robin_gradients link each parameter to its fp32 fragment at the
# NATURAL-order offset although the flat group is in round-robin order (no parameter_alignment), so a
# universal load into such an engine scatters every fragment. Round-robin sources are loaded by engines
# with round_robin_gradients off; RR_CONTROLS shows what happens otherwise.
RR_OFF = {"zero_optimization": {"round_robin_gradients": False}}
RR_CONTROLS = {"rr_on ours->2": ("ours", 2), "rr_on ds->3": ("ds", 3), "rr_on ds->2": ("ds", 2)}
RR_SOURCE = "z2_roundrobin_w3"
# the same state loaded natively at M (ckptlib's N->M reshard): DeepSpeed must then compute the same step
TWINS = [("z2_bf16_w2", 3), ("z3_bf16_w3", 2), ("bf16opt_w3", 2)]
TIMINGS: dict = {}


def _utag(fx) -> str:
    return f"{fx['tag']}_universal"


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def written(fixture_by_name, tmp_path_factory):
    """ckptlib's universal output for every source (one per source: it loads at any size)."""
    root = tmp_path_factory.mktemp("uc")
    out = {}
    t0 = time.perf_counter()
    for name in sorted(set(SOURCES) | set(DS_CASES) | {"exclude_frozen_z3_w3", "hf_trainer_w2"}):
        fx = fixture_by_name(name)
        out[name] = root / name
        write_universal(fx["checkpoint_path"], out[name])
    TIMINGS["write"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def ds_written(fixture_by_name, tmp_path_factory):
    """DeepSpeed's ds_to_universal output (next to a copy of each source), one subprocess."""
    t0 = time.perf_counter()
    out = ds_to_universal({name: fixture_by_name(name) for name in DS_CASES}, tmp_path_factory.mktemp("ds_uc"),
                          timeout=300)
    TIMINGS["ds_to_universal"] = time.perf_counter() - t0
    return out


@pytest.fixture(scope="module")
def runs(fixture_by_name, written, ds_written, tmp_path_factory):
    work = tmp_path_factory.mktemp("uc_load")
    jobs = defaultdict(list)
    for name in SOURCES:
        fx = fixture_by_name(name)
        jobs[fx["world_size"]].append(job_for_fixture(fx, name=f"{name}@orig"))
        extra = {"ds_config_overrides": RR_OFF} if fx["extras"].get("round_robin_gradients") else {}
        for m in (m for n, m in CASES if n == name):
            jobs[m].append(job_for_fixture(fx, checkpoint_dir=written[name], universal=True, name=f"{name}->{m}",
                                           **AS_GENERATOR, **extra))
    for name, m in TWINS:
        fx = fixture_by_name(name)
        resharded = work / f"reshard-{name}-{m}"
        reshard(fx["checkpoint_path"], resharded, m)
        jobs[m].append(job_for_fixture(fx, checkpoint_dir=resharded, name=f"{name}=>{m}", **AS_GENERATOR))
    fx = fixture_by_name(RR_SOURCE)
    for label, (whose, m) in RR_CONTROLS.items():
        path = written[RR_SOURCE] if whose == "ours" else ds_written[RR_SOURCE]
        jobs[m].append(job_for_fixture(fx, checkpoint_dir=path, universal=True, name=label, **AS_GENERATOR))
    name, m = ZERO3_ONLY_RANK0
    fx = fixture_by_name(name)
    only0 = work / "only_rank0"
    shutil.copytree(written[name], only0)
    for f in (only0 / _utag(fx)).glob("zero_pp_rank_*_model_states.pt"):
        if not f.name.startswith("zero_pp_rank_0_"):
            f.unlink()
    jobs[m].append(job_for_fixture(fx, checkpoint_dir=only0, universal=True, name="only_rank0", **AS_GENERATOR))
    name, m = WEIGHTS_ONLY
    jobs[m].append(job_for_fixture(fixture_by_name(name), checkpoint_dir=written[name], universal=True,
                                   name="weights_only", load_optimizer_states=False, **AS_GENERATOR))
    name, m = DS_ZERO3_LOAD
    jobs[m].append(job_for_fixture(fixture_by_name(name), checkpoint_dir=ds_written[name], universal=True,
                                   name="ds_to_universal", **AS_GENERATOR))
    results = {}
    for world, js in sorted(jobs.items()):
        t0 = time.perf_counter()
        results.update(run_load_checks(js, world, work / f"w{world}"))
        TIMINGS[f"launch w{world} ({len(js)} jobs)"] = time.perf_counter() - t0
    return results


@pytest.fixture(scope="module", autouse=True)
def _report_timings():
    yield
    if TIMINGS:
        print("\nuniversal timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in TIMINGS.items()))


# ------------------------------------------------------------------------------------------------ helpers
def _ok(res: dict) -> dict:
    assert "error" not in res, f"{res.get('phase')}: {res.get('error')}"
    return res


def _hyper() -> dict:
    """{param name: (lr, weight_decay, group index)} of the harness's optimizer (generator's groups)."""
    model = build_model("small", seed=0)
    out = {}
    for g, (names, group) in enumerate(zip(param_group_names(model), param_groups(model))):
        for n in names:
            out[n] = (group.get("lr", LR), group["weight_decay"], g)
    return out


def _zero3_sub_group_of(fx, m: int) -> dict:
    """{param name: index of its ZeRO-3 sub-group in the engine that loads at m ranks}."""
    model = build_model("small", seed=0)
    shapes = dict((n, p.numel()) for n, p in model.named_parameters())
    sgs = (fx.get("extras") or {}).get("sub_group_size") or 1_000_000_000
    out, k = {}, 0
    for names in param_group_names(model):
        for sub in zero3_sub_groups([shapes[n] for n in names], m, int(sgs)):
            for i in sub:
                out[names[i]] = k
            k += 1
    return out


def _adamw(p0, m1, v1, step: int, lr: float, wd: float, betas=(0.9, 0.999), eps=1e-8):
    """torch AdamW's update of p0, given the moments after the step (what the optimizer used)."""
    p = p0.clone()
    if wd:
        p.mul_(1 - lr * wd)
    denom = (v1.sqrt() / ((1 - betas[1] ** step) ** 0.5)).add_(eps)
    return p.addcdiv_(m1, denom, value=-(lr / (1 - betas[0] ** step)))


def _rel(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor) -> float:
    return (a - b).double().norm().item() / max((b - base).double().norm().item(), 1e-12)


def _tol(fx) -> float:
    return FP32_ATOL if fx["dtype"] == "fp32" else HALF_RTOL


# ------------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("name,m", CASES, ids=[f"{n}->{m}" for n, m in CASES])
def test_deepspeed_loads_the_universal_output_exactly_and_continues_like_the_original(runs, fixture_by_name,
                                                                                       name, m):
    fx = fixture_by_name(name)
    ref = reference(fx)
    got, orig = _ok(runs[f"{name}->{m}"]), _ok(runs[f"{name}@orig"])
    assert got["world_size"] == m and got["config"]["checkpoint"]["load_universal"] is True
    assert Path(got["load_path"]).parent.name == _utag(fx)
    loaded = got["loaded"]
    assert_masters_and_moments_equal(loaded, ref)
    # precondition of the comparison with the original (universal loads skip them; AS_GENERATOR)
    for kind in ("frozen", "buffers"):
        for p, want in ref[kind].items():
            assert torch.equal(loaded[kind][p], want), f"{kind} {p}"

    after, oafter = got["after_step"], orig["after_step"]
    tol = _tol(fx)
    # the moments after the step do not depend on the step count or the learning rate: all must match
    for key in ("exp_avg", "exp_avg_sq"):
        a = {p: v[key] for p, v in after["optim"].items()}
        b = {p: v[key] for p, v in oafter["optim"].items()}
        base = {p: v[key] for p, v in orig["loaded"]["optim"].items()}
        assert continuation_error(a, b, base, fx["dtype"]) <= tol, key
    if fx["zero_stage"] != 3:
        assert after["step"] == ref["step"] + 1 and not loaded["step_tensor_shared"]
        err = continuation_error(after["fp32"], oafter["fp32"], orig["loaded"]["fp32"], fx["dtype"])
        assert err <= tol, err
        return

    # ZeRO-3: one shared step tensor, advanced once per sub-group (DeepSpeed 0.19.8)
    sub = _zero3_sub_group_of(fx, m)
    n_sub = max(sub.values()) + 1
    assert loaded["step_tensor_shared"] and after["step"] == ref["step"] + n_sub
    hyper = _hyper()
    first = [p for p in ref["fp32"] if sub[p] == 0]
    assert first
    err = continuation_error({p: after["fp32"][p] for p in first}, {p: oafter["fp32"][p] for p in first},
                             orig["loaded"]["fp32"], fx["dtype"])
    assert err <= tol, err
    for p in ref["fp32"]:
        lr, wd, _ = hyper[p]
        p0, m1, v1 = loaded["fp32"][p], after["optim"][p]["exp_avg"], after["optim"][p]["exp_avg_sq"]
        used = _adamw(p0, m1, v1, ref["step"] + 1 + sub[p], lr, wd)
        assert (used - after["fp32"][p]).abs().max().item() <= 1e-6, f"{p}: not AdamW with the shared step"
        right = _adamw(p0, m1, v1, ref["step"] + 1, lr, wd)
        if fx["dtype"] == "fp32":
            assert (right - oafter["fp32"][p]).abs().max().item() <= FP32_ATOL, p
        else:
            assert _rel(right, oafter["fp32"][p], orig["loaded"]["fp32"][p]) <= HALF_RTOL, p
        if sub[p] > 0:  # and the shared step visibly changed the update
            assert _rel(after["fp32"][p], right, p0) > 0.05, p


@pytest.mark.parametrize("name,m", TWINS, ids=[f"{n}->{m}" for n, m in TWINS])
def test_the_step_after_a_universal_load_equals_the_step_after_a_native_load_of_the_same_state(
        runs, fixture_by_name, name, m):
    """Universal load at M vs loading the N->M reshard of the same checkpoint natively at M: identical
    engines and the same state, so the step must agree bit for bit (the M-vs-N differences of the test
    above are DeepSpeed's reduction order). ZeRO-3: sub-group 0 only; the shared step moves the others."""
    fx = fixture_by_name(name)
    uni, nat = _ok(runs[f"{name}->{m}"]), _ok(runs[f"{name}=>{m}"])
    for kind in ("fp32", "lp"):
        assert all(torch.equal(uni["loaded"][kind][p], v) for p, v in nat["loaded"][kind].items()), kind
    sub = _zero3_sub_group_of(fx, m) if fx["zero_stage"] == 3 else {p: 0 for p in nat["after_step"]["fp32"]}
    same = [p for p in nat["after_step"]["fp32"] if sub[p] == 0]
    assert same and all(torch.equal(uni["after_step"]["fp32"][p], nat["after_step"]["fp32"][p]) for p in same)
    assert all(torch.equal(uni["after_step"]["optim"][p][k], nat["after_step"]["optim"][p][k])
               for p in nat["after_step"]["optim"] for k in ("exp_avg", "exp_avg_sq"))
    assert uni["after_step"]["loss"] == nat["after_step"]["loss"]


def test_zero3_universal_load_reads_only_rank0_model_states(runs, fixture_by_name, written):
    """At any M every rank opens <tag>/zero_pp_rank_0_mp_rank_*_model_states.pt (DeepSpeed 0.19.8 globs
    with pp rank "0" when load_universal is on), so rank 0's file alone suffices, also for M > N."""
    name, m = ZERO3_ONLY_RANK0
    fx = fixture_by_name(name)
    assert m > fx["world_size"]
    got = _ok(runs["only_rank0"])["loaded"]
    ref = reference(fx)
    assert all(torch.equal(got["fp32"][p], v) for p, v in ref["fp32"].items())
    names = sorted(f.name for f in (written[name] / _utag(fx)).glob("*_model_states.pt"))
    assert names == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(fx["world_size"])]


def test_zero3_weights_only_universal_load_needs_the_original_checkpoint(runs, fixture_by_name):
    """A DeepSpeed 0.19.8 limitation, reported by the plan: with load_optimizer_states=False a ZeRO-3 engine
    first runs zero_to_fp32 on the load folder (via `latest`, even when loading a universal checkpoint)
    and only then reads zero/. A universal checkpoint in a folder of its own therefore loads only with
    optimizer states (the default); next to the original (ds_to_universal's layout) it works, after
    reading the whole original checkpoint."""
    res = runs["weights_only"]
    assert res.get("phase") == "load" and "Unable to find 'latest' file" in res["error"], res.get("error")
    name, _ = WEIGHTS_ONLY
    plan = plan_universal(fixture_by_name(name)["checkpoint_path"], "/nonexistent/out")
    assert any("load_optimizer_states=False" in n for n in plan.notes)


def test_deepspeed_own_zero3_output_gives_every_group_the_first_groups_hyperparameters(runs, fixture_by_name):
    """ds_to_universal keeps param_groups[0] whole, and the ZeRO-3 loader copies it into every group: the
    second group (lr 5e-3, no weight decay) then steps with lr 1e-2 and weight decay 0.01. ckptlib's
    optimizer_state.pt leaves differing entries out (test above: every group keeps its own)."""
    name, m = DS_ZERO3_LOAD
    fx = fixture_by_name(name)
    res = _ok(runs["ds_to_universal"])
    loaded, after = res["loaded"], res["after_step"]
    sub, hyper = _zero3_sub_group_of(fx, m), _hyper()
    lr0, wd0, _ = next(h for h in hyper.values() if h[2] == 0)
    second = [p for p, h in hyper.items() if h[2] == 1]
    assert second
    for p in second:
        p0, m1, v1 = loaded["fp32"][p], after["optim"][p]["exp_avg"], after["optim"][p]["exp_avg_sq"]
        step = reference(fx)["step"] + 1 + sub[p]
        assert (_adamw(p0, m1, v1, step, lr0, wd0) - after["fp32"][p]).abs().max().item() <= 1e-6, p
        lr, wd, _ = hyper[p]
        assert (_adamw(p0, m1, v1, step, lr, wd) - after["fp32"][p]).abs().max().item() > 1e-4, p


def test_round_robin_engines_scatter_any_universal_load(runs, fixture_by_name):
    """DeepSpeed's own bug, not the files': with round_robin_gradients on, the loading engine puts every
    fragment at its natural-order offset. ckptlib's (right) files then load wrong; ds_to_universal's
    (wrong, cut the same way at save) files load right only when M == N, where the two errors cancel."""
    fx = fixture_by_name(RR_SOURCE)
    ref = reference(fx)

    def wrong(label):
        got = _ok(runs[label])["loaded"]
        return [p for p, v in ref["fp32"].items() if not torch.equal(got["fp32"][p], v)]

    assert wrong("rr_on ds->3") == [] and fx["world_size"] == 3
    assert len(wrong("rr_on ours->2")) >= 3 and len(wrong("rr_on ds->2")) >= 3
    for m in (m for n, m in CASES if n == RR_SOURCE):  # with round_robin_gradients off: exact (test above)
        assert _ok(runs[f"{RR_SOURCE}->{m}"])["config"]["zero_optimization"]["round_robin_gradients"] is False


# ------------------------------------------------------------------------------------------------ files
def _obj(path: Path):
    return open_torch_file(path).obj


def _plain(x):
    """Comparable form of an object tree read by ckptlib (tensors as values, stand-ins as dicts)."""
    if isinstance(x, TensorHandle):
        return ("tensor", x.dtype, tuple(x.shape), x.read().reshape(-1).tolist())
    if isinstance(x, Standin):
        return (type(x).qualname, _plain(x.to_dict()))
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _tensor(obj):
    return (obj["param"] if isinstance(obj, dict) else obj).read()


@pytest.mark.parametrize("name", DS_CASES)
def test_files_equal_deepspeeds_ds_to_universal(written, ds_written, fixture_by_name, name):
    fx = fixture_by_name(name)
    ck = ckptlib.open_checkpoint(fx["checkpoint_path"])
    ours, theirs = written[name] / _utag(fx), ds_written[name] / _utag(fx)
    assert (written[name] / LATEST_UNIVERSAL).read_text() == (ds_written[name] / LATEST_UNIVERSAL).read_text()
    assert sorted(p.name for p in written[name].iterdir()) == sorted([LATEST_UNIVERSAL, _utag(fx)])  # no `latest`
    # model-states files: the same copies of the source
    ms = sorted(p.name for p in theirs.glob("*_model_states.pt"))
    assert ms == sorted(p.name for p in ours.glob("*_model_states.pt"))
    assert all(filecmp.cmp(ours / f, theirs / f, shallow=False) for f in ms)

    rel = lambda root: {str(p.relative_to(root / "zero")) for p in (root / "zero").rglob("*.pt")}  # noqa: E731
    a, b = rel(ours), rel(theirs)
    trainable = [p.name for p in ck.parameters if p.trainable and not p.tied_to]
    frozen = [p.name for p in ck.parameters if not p.trainable and not p.tied_to]
    tied = [p.name for p in ck.parameters if p.tied_to]
    if ck.zero_stage == 3:  # DeepSpeed: raw flat tensors, no step.pt, no frozen params
        assert b - a == set()
        assert a - b == {f"{n}/step.pt" for n in trainable} | {f"{n}/fp32.pt" for n in frozen}
    else:  # DeepSpeed also writes buffers and tied aliases from the 16-bit module, as float32
        assert a - b == set()
        assert b - a == {f"{n}/fp32.pt" for n in [bb.name for bb in ck.buffers] + tied}
    wrong = []
    for f in sorted(a & b):
        if f == "optimizer_state.pt":
            continue
        x, y = _obj(ours / "zero" / f), _obj(theirs / "zero" / f)
        if f.endswith("step.pt"):
            assert torch.equal(x.read(), y.read()), f
            continue
        tx, ty = _tensor(x), _tensor(y)
        assert tx.dtype == ty.dtype and tx.numel() == ty.numel(), f
        if isinstance(y, dict):  # ZeRO-1/2: the same dict, full shape
            assert list(x) == list(y) and x.get("cat_dim") == y.get("cat_dim") and tx.shape == ty.shape, f
        else:  # ZeRO-3: DeepSpeed's raw flat tensor, ours the parameter's shape in the same dict form
            assert list(x) == ["cat_dim", "param"] and ty.dim() == 1, f
        if not torch.equal(tx.reshape(-1), ty.reshape(-1)):
            wrong.append(f)
        if f.endswith("/fp32.pt") and f.split("/")[0] in trainable:
            assert x["param"].requires_grad == (y["param"] if isinstance(y, dict) else y).requires_grad, f
    if fx["extras"].get("round_robin_gradients"):
        # DeepSpeed cuts the fragments by param_slice_mappings, which it computes in natural order while
        # the flat groups are in round-robin order: its values are wrong, ours are the reference's
        ref = reference(fx)
        assert wrong
        for f in wrong:
            pname, key = f.rsplit("/", 1)
            key = key[:-3]
            want = ref["fp32"][pname] if key == "fp32" else ref["optim"][pname][key]
            assert torch.equal(_tensor(_obj(ours / "zero" / f)), want), f
            assert not torch.equal(_tensor(_obj(theirs / "zero" / f)).reshape(want.shape), want), f
    else:
        assert wrong == []

    # zero/optimizer_state.pt
    x, y = _plain(_obj(ours / "zero" / "optimizer_state.pt")), _plain(_obj(theirs / "zero" / "optimizer_state.pt"))
    if ck.zero_stage != 3:
        assert x == y
    else:  # without the fp32 partitions and per-element states; group 0 without entries other groups differ in
        assert y.pop("fp32_flat_groups") and "fp32_flat_groups" not in x
        for k, st in y["optimizer_state_dict"]["state"].items():
            assert st.pop("exp_avg")[2] and st.pop("exp_avg_sq")[2]
        groups = y["optimizer_state_dict"]["param_groups"]
        differ = {k for k in groups[0] if k != "params" and any(g[k] != groups[0][k] for g in groups[1:])}
        assert differ == {"lr", "weight_decay"}
        groups[0] = {k: v for k, v in groups[0].items() if k not in differ}
        assert x == y
        assert x["param_groups"] == _plain(_obj(theirs / "zero" / "optimizer_state.pt"))["param_groups"]


@pytest.mark.parametrize("name", sorted(set(SOURCES) | {"exclude_frozen_z3_w3", "hf_trainer_w2"}))
def test_values_equal_the_reference(written, fixture_by_name, name):
    """Every file against the live engine's values (no DeepSpeed involved)."""
    fx = fixture_by_name(name)
    ref = reference(fx)
    zero = written[name] / _utag(fx) / "zero"
    for p, want in ref["fp32"].items():
        obj = _obj(zero / p / "fp32.pt")
        assert list(obj) == ["cat_dim", "param"] and obj["cat_dim"] == 0
        assert torch.equal(obj["param"].read(), want), p
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_tensor(_obj(zero / p / f"{key}.pt")), ref["optim"][p][key]), (p, key)
        step = _obj(zero / p / "step.pt")
        assert step.dtype == torch.float32 and step.shape == () and step.read().item() == ref["step"]
        assert sorted(f.name for f in (zero / p).iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    for p, want in ref["frozen"].items():
        if fx["exclude_frozen"]:
            assert not (zero / p).exists()
        else:
            assert torch.equal(_tensor(_obj(zero / p / "fp32.pt")), want.float()), p
    dirs = {d.name for d in zero.iterdir() if d.is_dir()}
    assert dirs == set(ref["fp32"]) | (set() if fx["exclude_frozen"] else set(ref["frozen"]))


# ------------------------------------------------------------------------------------------------ writing
class _Watch(Observer):
    """Lists everything in the output's parent whenever a file is started, and at the end."""

    def __init__(self, parent: Path):
        self.parent, self.snapshots = parent, []

    def _snap(self):
        self.snapshots.append(sorted(str(p.relative_to(self.parent)) for p in self.parent.rglob("*") if p.is_file()))

    def on_file(self, name):
        self._snap()

    def on_finish(self, result):
        self._snap()


def test_no_temporary_files_and_bounded_buffers(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w2")
    parent = tmp_path / "parent"
    parent.mkdir()
    # 16 elements per chunk, one file at a time (the snapshots below follow the plan's order)
    plan = plan_universal(fx["checkpoint_path"], parent / "out", chunk_bytes=64, workers=1)
    watch = _Watch(parent)
    result = write_universal(plan, observer=watch)
    final = sorted(str(p.relative_to(parent)) for p in parent.rglob("*") if p.is_file())
    planned = sorted(f"out/{f.name}" for f in plan.files) + [f"out/{LATEST_UNIVERSAL}"]
    assert final == planned and [n for n, _ in result.files] == [f.name for f in plan.files] + [LATEST_UNIVERSAL]
    assert [p.name for p in parent.iterdir()] == ["out"]  # no lock, no temporary folder left
    lock = ".out.ckptlib-lock"
    for i, snap in enumerate(watch.snapshots[:-1]):
        # while writing: the lock, and the finished files under the hidden folder that becomes `out`
        tmpdirs = {s.split("/", 1)[0] for s in snap if s != lock}
        assert len(tmpdirs) <= 1 and all(d.startswith(".out.ckptlib-tmp-") for d in tmpdirs)
        inside = [s.split("/", 1)[1] for s in snap if s != lock]
        assert len(inside) == i and set(inside) <= {p[len("out/"):] for p in planned}, snap
    assert watch.snapshots[-1] == planned
    # 64-byte chunks one file at a time give the same bytes as the default 16 MiB in parallel threads
    again = write_universal(fx["checkpoint_path"], tmp_path / "default")
    assert again.bytes_written == result.bytes_written
    for f in planned:
        assert filecmp.cmp(parent / f, tmp_path / "default" / f[len("out/"):], shallow=False), f


def test_memory_is_bounded_by_the_buffers_not_the_parameters(fixture_by_name, tmp_path):
    """256 KiB chunks: the process grows far less than the largest parameter (8.4 MB as fp32 here)."""
    fx = fixture_by_name("large_w2")
    grown = anon_growth("ckptlib.reshard.write_universal", fx["checkpoint_path"], tmp_path,
                        chunk_bytes=1 << 18)
    largest = max(p.numel() * 4 for p in build_model("large", seed=0).parameters())
    assert grown < largest / 2, (grown, largest)


def test_plan_is_metadata_only(fixture_by_name, tmp_path):
    fx = fixture_by_name("z3_bf16_w3")
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        before = ck.stats.bytes_read
        plan = plan_universal(ck, tmp_path / "out")
        assert ck.stats.bytes_read == before and not (tmp_path / "out").exists()
        d = plan.to_dict()
        assert d["universal_tag"] == "global_step2_universal"
        assert d["predicted_peak_bytes"] < plan.workers * 3 * plan.chunk_bytes + 16 * 2**20
        assert {f["kind"] for f in d["files"]} == {"param_state", "optimizer_state", "copy"}
        text = plan.describe()
        assert "no temporary files" in text and "ONE step tensor" in text and "weight_decay, lr" in text
        write_universal(plan)
        assert ck.stats.bytes_read - before <= plan.read_bytes
    ds_total = sum(f.stat().st_size for f in fx["checkpoint_path"].rglob("*_optim_states.pt"))
    opt = tmp_path / "out" / "global_step2_universal" / "zero" / "optimizer_state.pt"
    assert opt.stat().st_size < 4096 < ds_total  # no fp32 partitions or moments in it


def test_cancel_leaves_nothing(fixture_by_name, tmp_path):
    import threading

    cancel = threading.Event()

    class CancelAtThirdFile(Observer):
        n = 0

        def on_file(self, name):
            self.n += 1
            if self.n == 3:
                cancel.set()

    with pytest.raises(ckptlib.Cancelled):
        write_universal(fixture_by_name("z3_bf16_w2")["checkpoint_path"], tmp_path / "out",
                        observer=CancelAtThirdFile(), cancel=cancel)
    assert list(tmp_path.iterdir()) == []


def test_refusals(fixture_by_name, tmp_path):
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="stage 0"):
        plan_universal(fixture_by_name("z0_bf16_w2")["checkpoint_path"], tmp_path / "x")
    src = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    with pytest.raises(ckptlib.OutputError, match="inside the source"):
        write_universal(src, src / "inner")
    assert not (src / "inner").exists()
    write_universal(src, tmp_path / "y")
    with pytest.raises(ckptlib.OutputError, match="not empty"):
        write_universal(src, tmp_path / "y")
    write_universal(src, tmp_path / "y", overwrite=True)


def test_a_hostile_parameter_name_cannot_leave_the_output(fixture_by_name, tmp_path):
    from ckptlib.reshard.universal import check_name

    ck = ckptlib.open_checkpoint(fixture_by_name("z2_bf16_w2")["checkpoint_path"])
    for bad in ("../escape", "a/b", "..", "", "optimizer_state.pt"):
        with pytest.raises(ckptlib.UnsupportedCheckpointError):
            check_name(bad, ck)
    check_name("model.layers.0.weight", ck)


# --------------------------------------------------------------------------------------- as a source
@pytest.mark.parametrize("maker", ["deepspeed", "ckptlib"])
def test_a_universal_folder_is_a_source(written, ds_written, fixture_by_name, maker):
    """inspect, export, check and reshard read a universal folder (DeepSpeed's ds_to_universal output, or ckptlib's,
    given as its save dir holding latest_universal or as the folder itself): issue 32, where they said "the config
    says ZeRO stage 2 but there are no *_optim_states.pt files: the save is incomplete". What they give is tested in
    tests/test_universal_source.py."""
    from tests.cli import run_cli

    name = DS_CASES[0]
    fx = fixture_by_name(name)
    paths = [ds_written[name] / _utag(fx)] if maker == "deepspeed" else [written[name], written[name] / _utag(fx)]
    for i, path in enumerate(paths):
        out = path.parent.parent / f"out-{maker}-{i}"
        for args in (["inspect", path], ["export", path, out / "e"], ["check", path, "--states"],
                     ["reshard", path, out / "r", "--world-size", "2"]):
            code, text, err = run_cli(*args)
            assert code == 0 and "Traceback" not in err, (args, err)
        assert "universal checkpoint" in run_cli("inspect", path)[1]
        assert ckptlib.diff(fx["checkpoint_path"], path, states=True).ok
        assert ckptlib.diff(fx["checkpoint_path"], out / "e").ok
