"""Consolidated export: bit-exact, loadable, sharded, atomic, parallel; against DeepSpeed's converter."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckptlib
from ckptlib.export import export, plan_export
from ckptlib.progress import Cancelled, Observer
from tests.fixtures.memory_probe import anon_growth
from tests.fixtures.model import FixtureNet


def load_output(out: Path, fmt: str, sub: str = "") -> dict:
    base = out / sub if sub else out
    stem = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    index = base / f"{stem}.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        files = sorted(set(idx["weight_map"].values()))
        assert idx["metadata"]["total_size"] == sum(_tensor_bytes(base / f, fmt) for f in files)
    else:
        files = [stem]
    sd = {}
    for f in files:
        part = safetensors.torch.load_file(base / f) if fmt == "safetensors" else torch.load(base / f, weights_only=True)
        assert not set(part) & set(sd)
        sd.update(part)
    if index.exists():
        assert {k: v for k, v in idx["weight_map"].items()} == {k: f for f in files for k in _keys(base / f, fmt)}
    return sd


def _keys(path, fmt):
    return list(safetensors.torch.load_file(path)) if fmt == "safetensors" else list(torch.load(path, weights_only=True))


def _tensor_bytes(path, fmt):
    sd = safetensors.torch.load_file(path) if fmt == "safetensors" else torch.load(path, weights_only=True)
    return sum(t.numel() * t.element_size() for t in sd.values())


def check_against_reference(sd: dict, fx: dict, dtype=torch.float32):
    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    for name, want in ref["fp32"].items():
        assert sd[name].dtype == dtype and torch.equal(sd[name], want.to(dtype)), name
    for name, want in ref["frozen"].items():
        if fx["exclude_frozen"]:
            assert name not in sd
        else:
            assert torch.equal(sd[name], want.float().to(dtype)), name
    for name, want in ref["buffers"].items():
        expect = want.to(dtype) if want.is_floating_point() else want
        assert sd[name].dtype == expect.dtype and torch.equal(sd[name], expect), name
    for p in fx["parameters"]:
        if p["tied_to"] and p["name"] in sd:
            assert torch.equal(sd[p["name"]], sd[p["tied_to"]])


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_is_bit_exact_and_loads_strict(ds_fixture, fmt, tmp_path):
    fx = ds_fixture
    for shard in ("5GB", "3KB"):
        out = tmp_path / f"out-{shard}"
        res = export(fx["checkpoint_path"], out, format=fmt, max_shard_size=shard)
        assert (len(res.files) > 1) == (shard == "3KB")
        sd = load_output(out, fmt)
        check_against_reference(sd, fx)
        if not fx["exclude_frozen"]:
            FixtureNet("large" if fx["name"].startswith("large") else "small").load_state_dict(sd, strict=True)
        if fmt == "torch":  # each shard holds only its own tensors' bytes
            for name, _ in res.files:
                if name.endswith(".index.json"):
                    continue
                for t in torch.load(out / name, weights_only=True).values():
                    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
                assert os.path.getsize(out / name) < _tensor_bytes(out / name, fmt) + 4096 + 200 * 30


def test_half_dtypes_equal_torch_casts(fixture_by_name, tmp_path):
    for name in ("z2_fp32_w3", "z3_bf16_w2"):
        fx = fixture_by_name(name)
        for dtype, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            out = tmp_path / f"{name}-{dtype}"
            export(fx["checkpoint_path"], out, dtype=dtype)
            check_against_reference(load_output(out, "safetensors"), fx, tdt)


def test_states_equal_the_engines_optimizer_state(fixture_by_name, tmp_path):
    for name in ("z1_bf16_w3", "z2_roundrobin_w2", "z3_subgroup_w3", "bf16opt_w2", "z0_fp16_w2"):
        fx = fixture_by_name(name)
        ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
        for fmt in ("safetensors", "torch"):
            out = tmp_path / f"{name}-{fmt}"
            export(fx["checkpoint_path"], out, format=fmt, states=["exp_avg", "exp_avg_sq"], max_shard_size="4KB")
            for key in ("exp_avg", "exp_avg_sq"):
                sd = load_output(out, fmt, key)
                assert set(sd) == set(ref["optim"])
                for pname, moments in ref["optim"].items():
                    assert torch.equal(sd[pname], moments[key].float()), (name, key, pname)


DS_SUPPORTED = [n for n in ("z1_fp32_w2", "z1_bf16_w3", "z1_fp16_w4", "z2_fp32_w1", "z2_bf16_w4", "z2_fp16_w3",
                            "z3_fp32_w4", "z3_bf16_w3", "z3_fp16_w2", "z3_subgroup_w3", "z2_roundrobin_w3",
                            "z2_align_w2", "exclude_frozen_w2", "exclude_frozen_z3_w3", "hf_trainer_w2")]


@pytest.mark.parametrize("name", DS_SUPPORTED)
def test_equal_to_deepspeeds_converter(fixture_by_name, tmp_path, name):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fx = fixture_by_name(name)
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(fx["checkpoint_path"]))
    export(fx["checkpoint_path"], tmp_path / "out")
    ours = load_output(tmp_path / "out", "safetensors")
    assert set(theirs) <= set(ours)
    if fx["zero_stage"] == 1:  # DeepSpeed drops ZeRO-1 frozen parameters; ckptlib keeps them
        assert set(ours) - set(theirs) == {p["name"] for p in fx["parameters"] if not p["trainable"]}
    else:
        assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v.float()), k


def test_plan_reads_metadata_only_and_predicts(fixture_by_name, tmp_path):
    fx = fixture_by_name("large_w2")
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        before = ck.stats.bytes_read
        plan = plan_export(ck, tmp_path / "out", max_shard_size="10MB")
        assert ck.stats.bytes_read == before
        d = plan.to_dict()
        assert len(d["files"]) == len(plan.files) > 1 and "model.safetensors.index.json" in d["index_files"]
        assert d["predicted_peak_bytes"] < 64 * 2**20
        assert "predicted peak memory" in plan.describe()
        assert not (tmp_path / "out").exists()
        res = export(plan)
        # the plan's sizes are the files' exact sizes on disk (headers and index included)
        assert res.bytes_written == plan.file_bytes > plan.write_bytes
        assert all(os.path.getsize(tmp_path / "out" / f) == n for f, n in res.files)
        assert sum(os.path.getsize(p) for p in (tmp_path / "out").rglob("*") if p.is_file()) == plan.file_bytes


def test_workers_and_torchrun_give_the_same_bytes(fixture_by_name, tmp_path):
    fx = fixture_by_name("large_w2")
    for fmt in ("safetensors", "torch"):
        export(fx["checkpoint_path"], tmp_path / f"one-{fmt}", format=fmt, max_shard_size="10MB")
        export(fx["checkpoint_path"], tmp_path / f"two-{fmt}", format=fmt, max_shard_size="10MB", workers=2)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "ckptlib", "export", str(fx["checkpoint_path"]), str(tmp_path / f"dist-{fmt}"),
                            "--format", fmt, "--max-shard-size", "10MB", "--distributed", "-q"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        names = sorted(os.listdir(tmp_path / f"one-{fmt}"))
        assert len(names) > 2
        for other in ("two", "dist"):
            assert sorted(os.listdir(tmp_path / f"{other}-{fmt}")) == names
            for n in names:
                assert (tmp_path / f"one-{fmt}" / n).read_bytes() == (tmp_path / f"{other}-{fmt}" / n).read_bytes(), n


def test_refusals(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w2")
    src = fx["checkpoint_path"]
    with pytest.raises(ckptlib.OutputError, match="inside the source"):
        export(src, src / "global_step2" / "out")
    with pytest.raises(ckptlib.OutputError, match="source checkpoint is inside"):
        export(src, src.parent, overwrite=True)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    with pytest.raises(ckptlib.OutputError, match="not empty"):
        export(src, busy)
    assert (busy / "keep.txt").read_text() == "x"
    export(src, busy, overwrite=True)
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").exists()
    r = subprocess.run([sys.executable, "-m", "ckptlib", "export", str(src), str(tmp_path / "x"), "--states", "momentum"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "momentum" in r.stderr and "Traceback" not in r.stderr


def test_cancel_leaves_nothing(fixture_by_name, tmp_path):
    fx = fixture_by_name("large_w2")
    cancel = threading.Event()

    class CancelSoon(Observer):
        def on_bytes(self, done, total):
            if done > total // 3:
                cancel.set()

    with pytest.raises(Cancelled):
        export(fx["checkpoint_path"], tmp_path / "out", observer=CancelSoon(), cancel=cancel, chunk_bytes=2**16)
    assert os.listdir(tmp_path) == []


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from ckptlib.export import export
    from ckptlib.progress import Observer
    class Slow(Observer):
        def on_bytes(self, done, total):
            time.sleep(0.005)
    export(sys.argv[1], sys.argv[2], observer=Slow(), chunk_bytes=2**15, max_shard_size="4MB", format=sys.argv[3])
""")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_kill_9_leaves_no_finished_output_and_rerun_succeeds(fixture_by_name, tmp_path, seed):
    import random

    fx = fixture_by_name("large_w2")
    fmt = ["safetensors", "torch"][seed % 2]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(fx["checkpoint_path"]), str(out), fmt])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.startswith(".out.ckptlib-tmp-") for p in tmp_path.iterdir()):
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0.0, 1.0))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed export must not leave the output folder"
    export(fx["checkpoint_path"], out, format=fmt, max_shard_size="4MB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # stale temporaries were cleaned
    check_against_reference(load_output(out, fmt), fx)


def test_exclude_frozen(fixture_by_name, tmp_path):
    for name in ("z1_bf16_w2", "z3_fp16_w3"):
        fx = fixture_by_name(name)
        export(fx["checkpoint_path"], tmp_path / name, exclude_frozen=True)
        sd = load_output(tmp_path / name, "safetensors")
        frozen = {p["name"] for p in fx["parameters"] if not p["trainable"]}
        assert frozen and not frozen & set(sd)
        assert "head.weight" in sd  # tied to a trainable parameter: kept
        FixtureNet().load_state_dict(sd, strict=False)


def test_memory_is_bounded_by_the_buffers_not_the_tensors(fixture_by_name, tmp_path):
    """Streaming in 256 KiB chunks must stay well under the largest tensor (8.4 MB fp32 here)."""
    fx = fixture_by_name("large_w2")
    grown = anon_growth("ckptlib.export.export", fx["checkpoint_path"], tmp_path, chunk_bytes=1 << 18)
    largest = max(p.numel() * 4 for p in FixtureNet("large").parameters())
    assert grown < largest / 2, (grown, largest)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_tensor_is_aligned_to_its_element_size(fixture_by_name, tmp_path, dtype):
    """The fixture's model has int64, bool and float buffers (a 3-element bool mask among them) and bf16
    weights; exported at fp32 and bf16, with the optimizer states, in shards: every tensor of every
    safetensors file starts at a multiple of its element size, and the files still load exactly."""
    from ckptlib.dtypes import itemsize
    from ckptlib.io.stformat import read_header

    fx = fixture_by_name("z2_bf16_w2")
    out = tmp_path / "out"
    export(fx["checkpoint_path"], out, dtype=dtype, states=("exp_avg",), max_shard_size="20KB")
    files = sorted(out.rglob("*.safetensors"))
    assert len(files) > 2
    kinds = set()
    for f in files:
        _, tensors = read_header(f)
        for t in tensors:
            assert t.offset % itemsize(t.dtype) == 0, (f.name, t.name, t.dtype, t.offset)
            kinds.add(t.dtype)
    assert {"bool", "int64"} <= kinds and ("bfloat16" in kinds) == (dtype == "bf16")
    check_against_reference(load_output(out, "safetensors"), fx, torch.float32 if dtype == "fp32" else torch.bfloat16)


def test_zero0_entries_that_could_be_another_parameter_are_proven_or_refused(fixture_by_name, tmp_path):
    """ZeRO-0 names nothing: the fixture's frozen.weight (33, 33) and frozen.bias (33,) have the shapes of
    trainable parameters, so which ones the optimizer's entries are follows from module order only if the
    frozen ones are not in a group. With 16-bit training the saved weights prove it (each is its master
    rounded; compared before writing); in fp32 the weights are exact either way (the module holds them), but
    an optimizer state could be either parameter's, and is refused."""
    fx = fixture_by_name("z0_fp32_w2")
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="ZeRO-0 records no names: optimizer group 0 entry"):
        export(fx["checkpoint_path"], tmp_path / "states", states=["exp_avg"])
    assert not (tmp_path / "states").exists()
    export(fx["checkpoint_path"], tmp_path / "weights")
    check_against_reference(load_output(tmp_path / "weights", "safetensors"), fx)
    fx = fixture_by_name("z0_bf16_w2")
    plan = plan_export(fx["checkpoint_path"], tmp_path / "bf16", states=["exp_avg"])
    assert sum("its fp32 master (optimizer group" in c.what for c in plan.checks) == 4
    assert any("frozen.weight, frozen.bias in no optimizer group" in n for n in plan.notes)
    export(plan)
    check_against_reference(load_output(tmp_path / "bf16", "safetensors"), fx)
    bad = plan.checks[0]  # were fc1.weight's entry frozen.weight's: refused before anything is written
    assert bad.what.startswith("fc1.weight: ") and "frozen.weight has the same shape" in bad.what
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        plan.checks[0] = type(bad)(bad.what, bad.a, tuple(ck.module_tensor("frozen.weight").ranges()), bad.dtype)
    with pytest.raises(ckptlib.IncompleteCheckpointError, match="the optimizer entry is not this parameter"):
        export(dataclasses.replace(plan, out=tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
