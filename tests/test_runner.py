"""The one runner, on plans made by hand (plain data): every kind of file, threads and processes,
a pickled plan in another process, cancel, a failure and a changed source. No DeepSpeed."""
from __future__ import annotations

import collections
import filecmp
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

import ckptlib
from ckptlib.plan import PROCESSES, THREADS, CopyFile, Plan, PlannedTensor, SourceRef, TextFile, TreeFile, WeightsFile
from ckptlib.layout.ranges import StoredRange, Zeros
from ckptlib.io.sources import stamp
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.specs import NewTensor


def make_plan(tmp_path, out_name="out", **kw) -> tuple[Plan, dict]:
    src = tmp_path / "src"
    (src / "t").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(5000)
    y = torch.arange(300, dtype=torch.int64)
    z = torch.randn(40, 30).to(torch.bfloat16)
    torch.save({"x": x, "y": y, "z": z}, src / "t" / "data.pt")
    (src / "t" / "notes.txt").write_text("hello")
    with open_torch_file(src / "t" / "data.pt") as tf:
        hx, hy, hz = tf.obj["x"], tf.obj["y"], tf.obj["z"]
        xs = hx.ranges(100, 3000) + [Zeros(7)]
        files = [
            WeightsFile("model.safetensors", "safetensors", [
                PlannedTensor("a", "x", None, "trainable", (3007,), "float32", tuple(xs)),
                PlannedTensor("z16", "z", None, "trainable", (40, 30), "float16", tuple(hz.ranges())),
                PlannedTensor("ints", "y", None, "buffer", (300,), "int64", tuple(hy.ranges()))]),
            WeightsFile("sub/pytorch_model.bin", "torch", [
                PlannedTensor("b", "x", None, "trainable", (50, 100), "bfloat16", tuple(hx.ranges(0, 5000)))]),
            TreeFile("tree.pt", "model_states", collections.OrderedDict(
                copied=hz.stored(), view=hx.stored(), new=NewTensor("float32", (10,), tuple(hx.ranges(10, 10))),
                inline=NewTensor.from_tensor(torch.tensor([1.5, 2.5])), plain={"n": [1, "x"], "s": torch.Size([2])}),
                read_bytes=0, write_bytes=hz.nbytes + hx.nbytes + 40 + 8),
            CopyFile("t/notes.txt", os.fspath(src / "t" / "notes.txt"), 5),
        ]
    source = SourceRef(save_dir=os.fspath(src), tag="t", tag_dir=os.fspath(src / "t"), zero_stage=None, flavor="x",
                       dtype="fp32", dp_world_size=1, partition_count=1, total_bytes=0,
                       stamps=(stamp(os.fspath(src / "t" / "data.pt")),))
    plan = Plan(source=source, out=tmp_path / out_name, files=files, finals=[TextFile("latest", "t")], folders=["t"],
                chunk_bytes=kw.pop("chunk_bytes", 256), **kw)
    return plan, {"x": x, "y": y, "z": z}


def check_output(out, ref) -> None:
    st = load_file(out / "model.safetensors")
    assert torch.equal(st["a"], torch.cat([ref["x"][100:3100], torch.zeros(7)]))
    assert torch.equal(st["z16"], ref["z"].to(torch.float16)) and torch.equal(st["ints"], ref["y"])
    b = torch.load(out / "sub" / "pytorch_model.bin", weights_only=True)["b"]
    assert torch.equal(b, ref["x"].to(torch.bfloat16).reshape(50, 100))
    tree = torch.load(out / "tree.pt", weights_only=True)
    assert torch.equal(tree["copied"], ref["z"]) and torch.equal(tree["view"], ref["x"])
    assert torch.equal(tree["new"], ref["x"][10:20]) and tree["inline"].tolist() == [1.5, 2.5]
    assert tree["plain"] == {"n": [1, "x"], "s": torch.Size([2])}
    assert (out / "t" / "notes.txt").read_text() == "hello" and (out / "latest").read_text() == "t"


@pytest.mark.parametrize("workers,parallel", [(1, THREADS), (3, THREADS), (2, PROCESSES)])
def test_a_hand_made_plan_runs_in_threads_and_processes(tmp_path, workers, parallel):
    plan, ref = make_plan(tmp_path, workers=workers, parallel=parallel)
    seen = []

    class Record(ckptlib.Observer):
        def on_bytes(self, done, total):
            seen.append((done, total))

    result = ckptlib.run(plan, observer=Record())
    check_output(plan.out, ref)
    assert isinstance(result, ckptlib.RunResult) and result.memory is not None and result.memory.samples >= 2
    assert [n for n, _ in result.files] == [f.name for f in plan.files] + ["latest"]
    assert result.bytes_written == plan.file_bytes and seen[-1] == (plan.write_bytes, plan.write_bytes)
    assert result.bytes_read >= 3000 * 4 + 40 * 30 * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_every_mode_writes_the_same_bytes_and_a_pickled_plan_runs_in_another_process(tmp_path):
    outs = []
    for i, (workers, parallel) in enumerate([(1, THREADS), (3, THREADS), (2, PROCESSES)]):
        plan, _ = make_plan(tmp_path, f"out{i}", workers=workers, parallel=parallel)
        ckptlib.run(plan)
        outs.append(plan.out)
    plan, ref = make_plan(tmp_path, "pickled")
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    code = "import pickle, sys, ckptlib; print(ckptlib.run(pickle.load(open(sys.argv[1], 'rb'))).describe())"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plan.pkl")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "wrote 5 files" in r.stdout, r.stderr
    outs.append(plan.out)
    check_output(plan.out, ref)
    names = sorted(str(p.relative_to(outs[0])) for p in outs[0].rglob("*") if p.is_file())
    for other in outs[1:]:
        assert sorted(str(p.relative_to(other)) for p in other.rglob("*") if p.is_file()) == names
        for n in names:
            assert filecmp.cmp(outs[0] / n, other / n, shallow=False), (other, n)


@pytest.mark.parametrize("workers,parallel", [(1, THREADS), (3, THREADS), (2, PROCESSES)])
def test_cancel_and_failure_leave_nothing(tmp_path, workers, parallel):
    plan, _ = make_plan(tmp_path, workers=workers, parallel=parallel)
    stop = threading.Event()

    class CancelAtOnce(ckptlib.Observer):
        def on_bytes(self, done, total):
            stop.set()

    with pytest.raises(ckptlib.Cancelled):
        ckptlib.run(plan, observer=CancelAtOnce(), cancel=stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    plan.files[1].tensors[0].ranges = (StoredRange(str(tmp_path / "gone.pt"), 0, "float32", 5000),)
    with pytest.raises(ckptlib.CkptError, match="gone.pt"):
        ckptlib.run(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_source_changed_since_the_plan_is_refused(tmp_path):
    plan, _ = make_plan(tmp_path)
    with open(tmp_path / "src" / "t" / "data.pt", "ab") as f:
        f.write(b"!")
    with pytest.raises(ckptlib.IncompleteCheckpointError, match="changed since the plan was made"):
        ckptlib.run(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
