"""``ckpt check`` and ``ckpt diff`` on real DeepSpeed fixtures: statistics equal torch's on the reference
tensors, healthy fixtures pass, corrupted copies are found (tensor and rank file named), and a checkpoint
diffs ``same`` against its own export, reshard and universal output, and like torch between two tags."""
from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import numpy as np
import torch

import ckptlib
from ckptlib.cli import main as ckpt_main
from ckptlib.mesh import Rank
from ckptlib.analysis.tensorstats import RunningStats
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.writer import save

OLD = Path(__file__).parent / "data" / "old_releases"


def _ref(fx, tag=None) -> dict:
    name = (fx.get("extras", {}).get("references") or {}).get(tag, "reference.pt") if tag else "reference.pt"
    return torch.load(fx["path"] / name, weights_only=True)


def _cli(*args) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = ckpt_main([str(a) for a in args])
    return code, out.getvalue()


def _strict_json(text: str):
    def bad(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=bad)


def _same_stats(got, want: torch.Tensor) -> None:
    w = want.reshape(-1)
    assert got.numel == w.numel() and got.nan == 0 and got.inf == 0
    assert got.zeros == int((w == 0).sum())
    assert got.min == float(w.min()) and got.max == float(w.max())
    # the norm is accumulated in float64: torch's norm of the float64 values to 1e-6 (it agrees to 1e-12);
    # torch's own fp32 norm accumulates in fp32 and is itself off by ~1e-6 on a few 10k elements (e.g. 1.5e-6 on
    # autotp's exp_avg_sq/lm_head.weight, where ours equals math.fsum), so it is held to 1e-5
    assert math.isclose(got.norm, float(torch.linalg.vector_norm(w.double())), rel_tol=1e-6, abs_tol=1e-300)
    assert math.isclose(got.norm, float(torch.linalg.vector_norm(w.double())), rel_tol=1e-12, abs_tol=1e-300)
    assert math.isclose(got.norm, float(torch.linalg.vector_norm(w)), rel_tol=1e-5, abs_tol=1e-30)
    assert math.isclose(got.mean, float(w.double().mean()), rel_tol=1e-9, abs_tol=1e-15)
    if w.numel() > 1:  # torch.std's default: the sample standard deviation
        assert math.isclose(got.std, float(w.double().std()), rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(got.std, float(w.std()), rel_tol=1e-5, abs_tol=1e-12)
    else:
        assert got.std is None


# ================================================================================================ health
@pytest.mark.parametrize("name", ["z1_bf16_w3", "z2_fp32_w2", "z3_bf16_w4", "bf16opt_w2", "z0_fp16_w2",
                                  "z3_subgroup_w3", "exclude_frozen_w2"])
@pytest.mark.parametrize("chunk_bytes", [16 * 2**20, 1024])  # whole tensors, and ~18 windows for embed.weight
def test_statistics_equal_torchs_on_the_references(fixture_by_name, name, chunk_bytes):
    fx = fixture_by_name(name)
    ref = _ref(fx)
    plan = ckptlib.plan_check(fx["checkpoint_path"], states=True, chunk_bytes=chunk_bytes)
    assert pickle_roundtrip(plan).describe() == plan.describe()
    result = ckptlib.check(plan)
    assert result.ok, result.problems
    got = {t.key: t for t in result.tensors}
    for n, want in ref["fp32"].items():
        _same_stats(got[n], want)
        for key in ("exp_avg", "exp_avg_sq"):
            _same_stats(got[f"{key}/{n}"], ref["optim"][n][key])
    for n, want in ref["frozen"].items():
        if not fx["exclude_frozen"]:
            _same_stats(got[n], want.float())
    floating = {n: b for n, b in ref["buffers"].items() if b.is_floating_point()}
    for n, want in floating.items():  # float buffers too (a NaN in a running variance is a problem)
        _same_stats(got[n], want.float())
    assert set(got) == set(ref["fp32"]) | {f"{k}/{n}" for n in ref["fp32"] for k in ("exp_avg", "exp_avg_sq")} \
        | (set() if fx["exclude_frozen"] else set(ref["frozen"])) | set(floating)
    if fx["zero_stage"] or fx["optimizer_class"] == "BF16_Optimizer":  # stage 0: one optimizer, no ranks to compare
        assert set(result.steps.values()) == {float(ref["step"])} and len(result.steps) >= fx["world_size"]
    assert result.memory.peak_added <= plan.predicted_peak_bytes
    assert result.bytes_read >= plan.read_bytes


def pickle_roundtrip(obj):
    import pickle

    return pickle.loads(pickle.dumps(obj))


HEALTHY = ["z0_fp32_w1", "z0_bf16_w2", "z1_fp16_w4", "z2_fp16_w3", "z2_align_w2", "z2_align_w3", "z1_roundrobin_w3",
           "z2_roundrobin_w2", "bf16opt_w3", "hf_trainer_w2", "exclude_frozen_z3_w3", "z3_fp16_w4", "z3_subgroup_w2",
           "large_w2"]


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_fixtures_exit_0(fixture_by_name, name):
    code, out = _cli("check", fixture_by_name(name)["checkpoint_path"], "--states", "--json")
    report = _strict_json(out)
    assert code == 0 and report["problems"] == [], report["problems"]
    assert report["tensors"] and report["bytes_read"] > 0


@pytest.mark.parametrize("fixture", ["0.10.3/z2_bf16_w3", "0.10.3/z3_bf16_w2", "0.12.6/z1_bf16_w3",
                                     "0.14.5/z2_fp32_w3"])
def test_checkpoints_of_older_releases_are_healthy(fixture):
    path = OLD / fixture
    fx = json.loads((path / "fixture.json").read_text())
    result = ckptlib.check(path / fx["checkpoint_dir"], states=True)
    assert result.ok, result.problems


def test_running_stats_keep_precision_when_the_mean_dominates():
    x = 1e4 + 1e-3 * torch.randn(5000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.float()
    stats, work = RunningStats(), np.empty(700, np.float64)
    for i in range(0, x.numel(), 700):
        stats.add(x[i:i + 700].numpy(), work)
    t = stats.result("x", "trainable", "float32", (5000,), [])
    assert math.isclose(t.std, float(x.double().std()), rel_tol=1e-6)
    assert math.isclose(t.mean, float(x.double().mean()), rel_tol=1e-12)
    assert t.min == float(x.min()) and t.max == float(x.max())


# ------------------------------------------------------------------------------------------- corrupted
def _copy(fx, dst: Path) -> Path:
    shutil.copytree(fx["checkpoint_path"], dst)
    return dst


def _write(path: str, offset: int, fmt: str, value) -> None:
    """A value saved as it is (its zip member's CRC-32 updated): what training wrote, not damage."""
    from tests.hostile import write_consistent

    write_consistent(path, offset, struct.pack(fmt, value))


def _piece_on(ck, rank: int):
    """A trainable parameter without a tied alias with a piece on ``rank``, and that piece's range."""
    tied = {p.tied_to for p in ck.parameters if p.tied_to}
    for p in ck.parameters:
        if p.trainable and not p.tied_to and p.name not in tied:
            for r in ck.sources(p.name):
                if f"zero_pp_rank_{rank}_" in r.path:
                    return p.name, r
    raise AssertionError("no piece on that rank")


def _problems(path, *extra) -> tuple[int, list[dict]]:
    code, out = _cli("check", path, "--json", *extra)
    return code, _strict_json(out)["problems"]


@pytest.fixture(scope="module")
def nan_copy(fixture_by_name, tmp_path_factory):
    """z2_bf16_w3 with a NaN written into rank 1's fp32 partition of one parameter."""
    src = fixture_by_name("z2_bf16_w3")
    dst = _copy(src, tmp_path_factory.mktemp("nan") / "ckpt")
    with ckptlib.open_checkpoint(dst) as ck:
        name, r = _piece_on(ck, 1)
    _write(r.path, r.offset + 4 * (r.count // 2), "<f", float("nan"))
    return src, dst, name, Path(r.path).name


def test_a_nan_in_one_ranks_partition_is_found(nan_copy):
    _, dst, name, file = nan_copy
    code, problems = _problems(dst)
    assert code == 1
    nan = [p for p in problems if "NaN" in p["what"]]
    assert len(nan) == 1 and nan[0]["tensor"] == name and nan[0]["file"].endswith(file), problems
    assert "1 NaN and 0 Inf" in nan[0]["what"]
    assert {p["tensor"] for p in problems} == {name}  # and the bf16 weight no longer matches its master
    t = ckptlib.check(dst).tensor(name)
    assert (t.nan, t.inf) == (1, 0) and t.min is not None and math.isfinite(t.norm)


def test_a_changed_16_bit_weight_in_the_model_file_is_found(fixture_by_name, tmp_path):
    dst = _copy(fixture_by_name("z2_bf16_w3"), tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst) as ck:
        r = ck.module_tensor("fc2.weight").ranges()[0]
    with open(r.path, "rb") as f:  # flip a low mantissa bit of one bf16 element, saved so (CRC-32 updated)
        f.seek(r.offset + 2 * 5)
        b = f.read(1)
    from tests.hostile import write_consistent

    write_consistent(r.path, r.offset + 2 * 5, bytes([b[0] ^ 0x01]))
    code, problems = _problems(dst)
    assert code == 1 and len(problems) == 1, problems
    p = problems[0]
    assert p["tensor"] == "fc2.weight" and p["file"].endswith("mp_rank_00_model_states.pt")
    assert "bfloat16 weight differs from the fp32 master (in global_step2/bf16_zero_pp_rank_" in p["what"]
    assert "at 1 of" in p["what"] and "one of the two files is damaged" in p["what"]  # both files named


def test_a_negative_exp_avg_sq_is_found(fixture_by_name, tmp_path):
    dst = _copy(fixture_by_name("z3_bf16_w2"), tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst) as ck:
        r = [x for x in ck.sources("fc3.bias", "exp_avg_sq") if "zero_pp_rank_1_" in x.path][0]
    _write(r.path, r.offset, "<f", -1e-3)
    assert _problems(dst)[0] == 0  # the states are only looked at with --states
    code, problems = _problems(dst, "--states")
    assert code == 1 and len(problems) == 1, problems
    assert problems[0]["tensor"] == "exp_avg_sq/fc3.bias" and "1 values below zero" in problems[0]["what"]
    assert problems[0]["file"].endswith("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_a_step_changed_on_one_rank_is_found(fixture_by_name, tmp_path):
    dst = _copy(fixture_by_name("z1_fp32_w3"), tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst) as ck:
        step = ck.partition_tensor(Rank(dp=1), 0, "step")
        r = step.ranges()[0]
        assert r.dtype == "float32" and float(step.read()) == 2.0
    _write(r.path, r.offset, "<f", 7.0)
    code, problems = _problems(dst)
    assert code == 1 and len(problems) == 1, problems
    p = problems[0]
    assert p["tensor"] == "step" and p["file"].endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert "group 0 on dp rank 1 is 7" in p["what"] and "hold 2" in p["what"]


def test_recorded_padding_over_parameter_elements_is_found(fixture_by_name, tmp_path):
    """group_paddings of rank 0 say its partition ends in padding, where the layout has parameters."""
    src = fixture_by_name("z2_bf16_w3")["checkpoint_path"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tag = (src / "latest").read_text()
    name = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    obj = open_torch_file(src / tag / name).obj
    assert obj["optimizer_state_dict"]["group_paddings"][0] == 0
    obj["optimizer_state_dict"]["group_paddings"][0] = 7
    save(obj, dst / tag / name)
    code, problems = _problems(dst)
    assert code == 1 and problems, problems
    assert all(p["file"].endswith(name) and "padding" in p["what"] for p in problems), problems
    assert "7 padding elements at the end of dp rank 0's partition" in problems[0]["what"]


def test_bad_input_is_one_message_and_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    for args in (["check", tmp_path / "empty"], ["diff", tmp_path / "empty", tmp_path / "missing"],
                 ["diff", tmp_path, tmp_path, "--atol", "-1"]):
        r = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr


# ================================================================================================ diff
def _stamps(path: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", ["z2_bf16_w3", "z3_bf16_w2", "z1_fp32_w4", "bf16opt_w2"])
def test_a_checkpoint_is_the_same_as_its_export_reshard_and_universal_output(fixture_by_name, tmp_path, name):
    src = fixture_by_name(name)["checkpoint_path"]
    before = _stamps(src)
    ck = ckptlib.open_checkpoint(src)
    world = ck.dp_world_size
    outs = {
        "export": ckptlib.export(src, tmp_path / "export", states=["exp_avg", "exp_avg_sq"]).out,
        "export-sharded-torch": ckptlib.export(src, tmp_path / "export-t", format="torch", max_shard_size="5KB",
                                               states=["exp_avg"]).out,
        "reshard": ckptlib.reshard(src, tmp_path / "reshard", 2 if world != 2 else 3).out,
        "universal": ckptlib.write_universal(ckptlib.plan_universal(src, tmp_path / "universal")).out,
    }
    for what, out in outs.items():
        code, text = _cli("diff", src, out, "--states", "--json")
        report = _strict_json(text)
        statuses = {t["name"]: t["status"] for t in report["tensors"]}
        if what == "export-sharded-torch":  # exported without exp_avg_sq
            assert {k for k, s in statuses.items() if s != "same"} == {k for k in statuses
                                                                      if k.startswith("exp_avg_sq/")}
            continue
        assert code == 0 and set(statuses.values()) == {"same"}, (what, report["summary"])
        assert report["summary"]["same"] == len(statuses) and any(k.startswith("exp_avg_sq/") for k in statuses)
        assert all(t["max_abs_diff"] == 0 and t["rel_diff"] == 0 for t in report["tensors"])
    # the tag folder, and either side swapped, give the same
    assert ckptlib.diff(outs["universal"], src / ck.location.tag, states=True).ok
    assert _stamps(src) == before  # the source is only read


def test_two_tags_of_one_run_differ_as_torch_says(fixture_by_name):
    fx = fixture_by_name("hf_trainer_w2")  # global_step2 and global_step4 of one training run
    assert fx["tags"] == ["global_step2", "global_step4"]
    a, b = _ref(fx, "global_step2"), _ref(fx, "global_step4")
    code, text = _cli("diff", fx["checkpoint_path"], fx["checkpoint_path"], "--tag-a", "global_step2", "--tag-b",
                      "global_step4", "--states", "--json")
    report = _strict_json(text)
    got = {t["name"]: t for t in report["tensors"]}
    assert code == 1
    for n in a["fp32"]:
        want = float((a["fp32"][n] - b["fp32"][n]).abs().max())
        assert got[n]["max_abs_diff"] == want and got[n]["status"] == ("changed" if want else "same"), n
        rel = float(torch.linalg.vector_norm((a["fp32"][n] - b["fp32"][n]).double())
                    / torch.linalg.vector_norm(a["fp32"][n].double()))
        assert math.isclose(got[n]["rel_diff"], rel, rel_tol=1e-9), n
        for key in ("exp_avg", "exp_avg_sq"):
            d = float((a["optim"][n][key] - b["optim"][n][key]).abs().max())
            assert got[f"{key}/{n}"]["max_abs_diff"] == d, (key, n)
    for n in list(a["frozen"]) + list(a["buffers"]):
        assert got[n]["status"] == "same", n
    big = max((t for t in report["tensors"] if t["rel_diff"]), key=lambda t: t["rel_diff"])
    assert report["summary"]["largest_in"] == big["name"] and report["summary"]["changed"] > 0


def test_only_the_nan_tensor_differs_from_the_nan_copy(nan_copy):
    src, dst, name, _ = nan_copy
    for a, b in ((src["checkpoint_path"], dst), (dst, src["checkpoint_path"])):
        result = ckptlib.diff(a, b, states=True)
        changed = [t for t in result.tensors if t.status != "same"]
        assert [t.key for t in changed] == [name] and changed[0].status == "changed"
        assert changed[0].changed == 1 and changed[0].nonfinite == 1 and not result.ok
    assert ckptlib.diff(dst, dst).ok  # NaN equals NaN in the same place


def test_statuses_tolerances_and_the_bf16_export(fixture_by_name, tmp_path):
    plain, no_frozen = fixture_by_name("z2_bf16_w2"), fixture_by_name("exclude_frozen_w2")
    result = ckptlib.diff(plain["checkpoint_path"], no_frozen["checkpoint_path"])
    assert {t.key for t in result.tensors if t.status != "same"} == {"frozen.weight", "frozen.bias"}
    assert {t.status for t in result.tensors if t.key.startswith("frozen.")} == {"only_in_a"}
    large = ckptlib.diff(plain["checkpoint_path"], fixture_by_name("large_w2")["checkpoint_path"])
    assert large.counts["shape_changed"] > 5 and not large.ok
    assert {t.key for t in large.tensors if t.status == "changed"} <= {"tiny", "scalar"}  # same shapes in both sizes
    bf16 = ckptlib.export(plain["checkpoint_path"], tmp_path / "bf16", dtype="bf16").out
    exact = ckptlib.diff(plain["checkpoint_path"], bf16)
    floating = {t.key for t in exact.tensors if t.dtype_a in ("float32", "bfloat16") and t.key != "frozen.weight"
                and t.key != "frozen.bias" and t.key != "feat_scale"}
    assert floating <= {t.key for t in exact.tensors if t.status == "changed"}
    assert ckptlib.diff(plain["checkpoint_path"], bf16, rtol=2.0 ** -8).ok
    assert exact.largest.rel_diff < 2.0 ** -8
    assert exact.tensor("counter").status == "same" and exact.tensor("counter").dtype_b == "int64"


def test_check_and_diff_memory_stays_within_the_buffers(fixture_by_name, tmp_path):
    src = fixture_by_name("large_w2")["checkpoint_path"]  # 3.3 M parameters; the largest tensor 8 MiB
    plan = ckptlib.plan_check(src, states=True, chunk_bytes=2**20)
    result = ckptlib.check(plan)
    assert result.ok and result.memory.peak_added <= plan.predicted_peak_bytes
    out = ckptlib.export(src, tmp_path / "export").out
    dplan = pickle_roundtrip(ckptlib.plan_diff(src, out, chunk_bytes=2**20))  # plain data
    d = ckptlib.diff(dplan)
    assert d.ok and d.memory.peak_added <= dplan.predicted_peak_bytes
    assert d.bytes_read >= dplan.read_bytes


def test_check_and_diff_stop_when_cancelled(fixture_by_name):
    import threading

    src = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    stop = threading.Event()
    stop.set()
    with pytest.raises(ckptlib.Cancelled):
        ckptlib.check(src, cancel=stop)
    with pytest.raises(ckptlib.Cancelled):
        ckptlib.diff(src, src, cancel=stop)


# ================================================================================================ widgets
def test_health_and_diff_views(nan_copy, tmp_path):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("matplotlib")
    from ckptlib.ui import DiffView, HealthView, diff_figure, norms_figure
    from ckptlib.ui.health_view import layer_rows

    src, dst, name, _ = nan_copy
    health = ckptlib.check(dst)
    view = HealthView(health)
    assert "ckpt-nonfinite" in view.table.value and "ckpt-norm-bar" in view.table.value
    assert "problem(s) found" in view.verdict.value and name in view.verdict.value
    view.only_problems.value = True
    assert name in view.table.value and "embed.weight" not in view.table.value
    layer = name.rsplit(".", 1)[0]
    row = next(r for r in layer_rows(health) if r["layer"] == layer)
    assert row["nan"] == 1 and math.isclose(row["norm"], math.sqrt(sum(t.norm ** 2 for t in row["tensors"])))
    assert norms_figure(health).get_axes() and view.figure.value[:4] == b"\x89PNG"
    live = HealthView(dst)
    assert live.wait(60) is not None and live.result.problems == health.problems
    d = ckptlib.diff(src["checkpoint_path"], dst)
    dv = DiffView(d)
    assert dv.changed == [name] and name in dv.table.value and "embed.weight" not in dv.table.value
    dv.status.value = "all"
    assert "embed.weight" in dv.table.value
    assert diff_figure(d).get_axes() and dv.figure.value[:4] == b"\x89PNG"


def test_a_nan_in_a_float_buffer_is_found(fixture_by_name, tmp_path):
    dst = _copy(fixture_by_name("z2_bf16_w2"), tmp_path / "ckpt")
    with ckptlib.open_checkpoint(dst) as ck:
        b = next(b for b in ck.buffers if b.dtype == "float32")
        r = ck.sources(b.name)[0]
    _write(r.path, r.offset, "<f", float("nan"))
    code, problems = _problems(dst)
    assert code == 1 and [p["tensor"] for p in problems] == [b.name], problems
    assert "1 NaN and 0 Inf" in problems[0]["what"] and problems[0]["file"].endswith("mp_rank_00_model_states.pt")


def test_diff_marks_tied_aliases_and_leaves_unknown_norms_null(fixture_by_name):
    """head.weight is a tied alias of embed.weight: it changes with it and says so; tensors whose bytes are
    identical are passed over, so their norm is unknown (null), never 0.0."""
    a, b = fixture_by_name("z2_bf16_w2")["checkpoint_path"], fixture_by_name("z2_fp32_w2")["checkpoint_path"]
    code, out = _cli("diff", a, b, "--json")
    report = _strict_json(out)
    rows = {t["name"]: t for t in report["tensors"]}
    assert code == 1 and rows["head.weight"]["alias_of"] == "embed.weight" and rows["embed.weight"]["alias_of"] is None
    same = [t for t in report["tensors"] if t["status"] == "same"]
    assert same and all(t["norm_a"] is None for t in same), same
    assert all(t["norm_a"] > 0 for t in report["tensors"] if t["status"] == "changed")
    code, text = _cli("diff", a, b)
    assert "tied alias of embed.weight" in next(line for line in text.splitlines() if " head.weight " in line)


@pytest.mark.parametrize("name", ["z2_bf16_w3", "z3_bf16_w2"])
def test_the_optimizer_step_is_compared_naming_the_parameter(fixture_by_name, tmp_path, name):
    """With --states, each trainable parameter's optimizer step is compared too (issue 32: a universal folder
    whose step.pt was changed used to be reported as all same): against ckptlib's universal output, an export's
    recorded step and a DCP export, and a changed step.pt is found, naming the parameter."""
    src = fixture_by_name(name)["checkpoint_path"]
    with ckptlib.open_checkpoint(src) as ck:
        trainable = {p.name for p in ck.parameters if p.trainable and not p.tied_to}
        step = ck.optimizer.step
    outs = {"universal": ckptlib.write_universal(ckptlib.plan_universal(src, tmp_path / "universal")).out,
            "export": ckptlib.export(src, tmp_path / "export", states=["all"]).out,
            "dcp": ckptlib.export(src, tmp_path / "dcp", format="dcp", dcp={"optimizer": True}).out}
    for what, out in outs.items():
        result = ckptlib.diff(src, out, states=True)
        steps = {t.key[len("step/"):]: t for t in result.tensors if t.key.startswith("step/")}
        assert set(steps) == trainable and result.ok, (what, sorted(steps), result.summary())
        assert all(t.status == "same" and t.numel == 1 and t.max_abs_diff == 0 for t in steps.values()), what
    files = sorted(Path(outs["universal"]).rglob("step.pt"))
    victim = files[len(files) // 2]
    torch.save(torch.tensor(float(step) - 1), victim)  # what the issue did: step.pt changed to 1
    code, text = _cli("diff", src, outs["universal"], "--states", "--json")
    report = _strict_json(text)
    changed = [t for t in report["tensors"] if t["status"] != "same"]
    assert code == 1 and [t["name"] for t in changed] == [f"step/{victim.parent.name}"], changed
    assert changed[0]["max_abs_diff"] == 1.0
    assert ckptlib.diff(src, outs["universal"]).ok  # without --states: the weights alone, all the same
