"""Reshard N -> M: DeepSpeed loads the result at M with exact masters and moments, and one more training
step matches DeepSpeed resuming the original at N; N -> M -> N gives the source back."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import ckptlib
from ckptlib.reshard import plan_reshard, reshard
from ckptlib.io.torchzip import TensorHandle, open_torch_file
from ckptlib.io.torchzip.writer import NewTensor, save
from tests.fixtures.compare import (FP32_ATOL, HALF_RTOL, assert_masters_and_moments_equal, continuation_error,
                                   reference)
from tests.fixtures.load_runner import job_for_fixture, run_load_checks
from tests.fixtures.memory_probe import anon_growth

PAIRS = [(4, 2), (2, 4), (3, 2), (2, 3), (4, 3), (1, 2)]
CASES = [(f"z{s}_{d}_w{n}", m) for s in (1, 2, 3) for d in ("fp32", "bf16") for n, m in PAIRS] + [
    ("bf16opt_w3", 2), ("bf16opt_w2", 3), ("z1_roundrobin_w2", 3), ("z2_roundrobin_w3", 2), ("z2_align_w2", 3),
    ("z3_subgroup_w3", 2), ("z3_subgroup_w2", 3), ("exclude_frozen_w3", 2), ("exclude_frozen_z3_w3", 2),
    ("z1_fp16_w4", 3), ("z2_fp16_w2", 3), ("z3_fp16_w3", 2), ("hf_trainer_w2", 3)]
# controls: the same continuation check must fail when a moment is shifted by one element or lost
CONTROLS = {"shifted z2_fp32_w4->2": ("z2_fp32_w4", 2, "shift"), "shifted z3_bf16_w2->3": ("z3_bf16_w2", 3, "shift"),
            "lost z2_fp32_w4->2": ("z2_fp32_w4", 2, "lost"), "lost z1_bf16_w3->2": ("z1_bf16_w3", 2, "lost")}


def _shift_first_moment(out):
    """Corrupt a resharded checkpoint: rank 0's exp_avg of the first group moved by one element."""
    f = next((out / "global_step2").glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    obj = open_torch_file(f).obj
    osd = obj["optimizer_state_dict"]
    state = osd["optimizer_state_dict"]["state"] if "fp32_flat_groups" in osd else osd["base_optimizer_state"]["state"]
    first = next(iter(state))
    state[first]["exp_avg"] = NewTensor.from_tensor(torch.roll(state[first]["exp_avg"].read(), 1))
    tmp = f.with_suffix(".tmp")
    save(obj, tmp)
    tmp.replace(f)


@pytest.fixture(scope="module")
def runs(fixture_by_name, tmp_path_factory):
    work = tmp_path_factory.mktemp("reshard")
    jobs = defaultdict(list)
    originals = set()
    for name, m in CASES:
        fx = fixture_by_name(name)
        out = work / f"{name}-to{m}"
        reshard(fx["checkpoint_path"], out, m)
        jobs[m].append(job_for_fixture(fx, checkpoint_dir=out, name=f"{name}->{m}"))
        if name not in originals:
            originals.add(name)
            jobs[fx["world_size"]].append(job_for_fixture(fx, name=f"{name}@orig"))
    for label, (name, m, kind) in CONTROLS.items():
        fx = fixture_by_name(name)
        out = work / label.replace(" ", "_").replace(">", "")
        reshard(fx["checkpoint_path"], out, m)
        if kind == "shift":
            _shift_first_moment(out)
        jobs[m].append(job_for_fixture(fx, checkpoint_dir=out, name=label, load_optimizer_states=(kind != "lost")))
    results = {}
    for world, js in sorted(jobs.items()):
        results.update(run_load_checks(js, world, work / f"w{world}"))
    return results


@pytest.mark.parametrize("name,m", CASES, ids=[f"{n}->{m}" for n, m in CASES])
def test_deepspeed_loads_the_reshard_exactly_and_continues_like_the_original(runs, fixture_by_name, name, m):
    fx = fixture_by_name(name)
    ref = reference(fx)
    got, orig = runs[f"{name}->{m}"], runs[f"{name}@orig"]
    assert "error" not in got, got.get("error")
    assert "error" not in orig, orig.get("error")
    assert got["world_size"] == m and orig["world_size"] == fx["world_size"]
    loaded = got["loaded"]
    assert_masters_and_moments_equal(loaded, ref)
    for p, want in ref["frozen"].items():
        if not fx["exclude_frozen"]:
            assert torch.equal(loaded["frozen"][p], want), f"frozen {p}"
    for b, want in ref["buffers"].items():
        assert torch.equal(loaded["buffers"][b], want), f"buffer {b}"
    err = continuation_error(got["after_step"]["fp32"], orig["after_step"]["fp32"], orig["loaded"]["fp32"], fx["dtype"])
    assert err <= (FP32_ATOL if fx["dtype"] == "fp32" else HALF_RTOL), err


@pytest.mark.parametrize("label", list(CONTROLS))
def test_the_continuation_check_catches_a_shifted_or_lost_moment(runs, fixture_by_name, label):
    name, m, _ = CONTROLS[label]
    fx = fixture_by_name(name)
    got, orig = runs[label], runs[f"{name}@orig"]
    assert "error" not in got, got.get("error")
    err = continuation_error(got["after_step"]["fp32"], orig["after_step"]["fp32"], orig["loaded"]["fp32"], fx["dtype"])
    assert err > 10 * (FP32_ATOL if fx["dtype"] == "fp32" else HALF_RTOL), err


def test_deepspeed_refuses_the_unresharded_checkpoint(runs):
    """The control the feature exists for: the N-rank checkpoint itself does not load at M (in the harness
    tests: 'The checkpoint being loaded used a DP world size of 3 but the current world size is 2')."""
    assert all("error" not in r for k, r in runs.items() if k.endswith("@orig"))


# ------------------------------------------------------------------------------------------------ round trip
def _tensors(obj, path=""):
    if isinstance(obj, TensorHandle):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def _zero3_padding(ck, rank: int, path: str, numel: int) -> torch.Tensor:
    """Mask of the positions of a ZeRO-3 rank tensor that are partition padding (uninitialised in DeepSpeed)."""
    mask = torch.zeros(numel, dtype=torch.bool)
    lay = ck.layouts[0]
    if ".frozen_param_fragments." in path:
        p = ck.param(path.rsplit(".frozen_param_fragments.", 1)[1])
        c = -(-p.numel // ck.partition_count)
        real = max(0, min(c, p.numel - rank * c))
        mask[real:] = True
        return mask
    k = int(path.rsplit("[", 1)[1].rstrip("]")) if path.endswith("]") else int(path.split(".state.", 1)[1].split(".")[0])
    for seg in lay.segments(rank, k):
        if seg.is_padding:
            mask[seg.rank_start:seg.rank_start + seg.count] = True
    return mask


@pytest.mark.parametrize("name,m", [("z1_fp32_w4", 3), ("z2_bf16_w2", 3), ("z1_bf16_w3", 4), ("bf16opt_w3", 2),
                                    ("z2_align_w3", 2), ("z2_roundrobin_w2", 3), ("z3_bf16_w3", 2),
                                    ("z3_fp32_w4", 3), ("z3_subgroup_w3", 2), ("exclude_frozen_z3_w3", 4),
                                    ("z3_fp16_w2", 1),
                                    ("z3_bf16_w2", 40)])  # ranks whose partition of a sub-group is all padding
def test_n_to_m_to_n_gives_the_source_back(fixture_by_name, tmp_path, name, m):
    fx = fixture_by_name(name)
    src = ckptlib.open_checkpoint(fx["checkpoint_path"])
    reshard(src, tmp_path / "m", m)
    reshard(tmp_path / "m", tmp_path / "n", src.partition_count)
    assert (tmp_path / "n" / "latest").read_text() == fx["tag"]
    padding_bytes = 0
    for f in src.files:
        a = dict(_tensors(open_torch_file(f.path).obj))
        b = dict(_tensors(open_torch_file(tmp_path / "n" / fx["tag"] / f.path.name).obj))
        assert list(a) == list(b), f.path.name
        for key, ha in a.items():
            x, y = ha.read(), b[key].read()
            assert (x.dtype, x.shape) == (y.dtype, y.shape), (f.path.name, key)
            xb = x.reshape(-1).view(torch.uint8).reshape(x.numel(), -1) if x.numel() else x
            yb = y.reshape(-1).view(torch.uint8).reshape(y.numel(), -1) if y.numel() else y
            same = (xb == yb).all(dim=1) if x.numel() and x.dim() else torch.tensor([torch.equal(x, y)])
            if same.all():
                continue
            # only ZeRO-3 partition padding may differ: DeepSpeed leaves it uninitialised, ckptlib writes zeros
            assert src.zero_stage == 3, (f.path.name, key)
            pad = _zero3_padding(src, f.dp_rank, key, x.numel())
            assert bool(pad[~same].all()), (f.path.name, key, (~same).nonzero().flatten()[:10])
            assert bool((y.reshape(-1)[pad] == 0).all())
            padding_bytes += int((~same).sum()) * x.element_size()
    if src.zero_stage != 3:
        assert padding_bytes == 0


def test_plan_shows_feeds_and_memory_without_reading(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w4")
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        before = ck.stats.bytes_read
        plan = plan_reshard(ck, tmp_path / "out", 3)
        assert ck.stats.bytes_read == before and not (tmp_path / "out").exists()
        assert plan.feeds() == {0: [0, 1], 1: [1, 2], 2: [2, 3]}
        d = plan.to_dict()
        assert d["from_world_size"] == 4 and d["to_world_size"] == 3
        # three streaming buffers per writing thread, whatever the model size
        assert d["predicted_peak_bytes"] < plan.workers * 3 * plan.chunk_bytes + 16 * 2**20
        assert plan_reshard(ck, tmp_path / "out", 3, workers=1).predicted_peak_bytes < 64 * 2**20
        assert "0 <- 0, 1" in plan.describe()


def test_refusals(fixture_by_name, tmp_path):
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="stage 0"):
        plan_reshard(fixture_by_name("z0_bf16_w2")["checkpoint_path"], tmp_path / "x", 3)
    src = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    with pytest.raises(ckptlib.OutputError, match="inside the source"):
        reshard(src, src / "inner", 3)


@pytest.mark.parametrize("name,m", [("z2_bf16_w4", 3), ("z3_fp32_w3", 2)])
def test_parallel_writers_write_the_same_bytes_as_one(fixture_by_name, tmp_path, name, m):
    src = fixture_by_name(name)["checkpoint_path"]
    one = reshard(plan_reshard(src, tmp_path / "one", m, workers=1, chunk_bytes=4096))
    three = reshard(plan_reshard(src, tmp_path / "three", m, workers=3))
    assert one.plan.workers == 1 and three.plan.workers == 3
    names = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(tmp_path / "three") for p in (tmp_path / "three").rglob("*") if p.is_file())
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "three" / n).read_bytes(), n


def test_a_failing_writer_thread_stops_the_others_and_leaves_nothing(fixture_by_name, tmp_path):
    import threading

    from ckptlib.layout.ranges import StoredRange

    src = fixture_by_name("z2_fp32_w4")["checkpoint_path"]
    plan = plan_reshard(src, tmp_path / "out", 2, workers=2, chunk_bytes=256)
    # plans are plain data: point one tensor of one target file at a file that is not there
    victim = next(f for f in plan.files if f.kind == "optim_states" and f.rank == 1)
    t = victim.obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    t.ranges = (StoredRange(str(tmp_path / "gone.pt"), 0, t.dtype, t.numel),)
    with pytest.raises(ckptlib.IncompleteCheckpointError, match="gone.pt"):
        reshard(plan)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary folder, no lock
    assert not [t for t in threading.enumerate() if t.name.startswith("ckptlib-write")]


def test_cancel_with_parallel_writers(fixture_by_name, tmp_path):
    import threading

    src = fixture_by_name("z3_bf16_w4")["checkpoint_path"]
    cancel = threading.Event()

    class CancelOnFirstBytes(ckptlib.Observer):
        def on_bytes(self, done, total):
            cancel.set()

    with pytest.raises(ckptlib.Cancelled):
        reshard(src, tmp_path / "out", 3, workers=2, chunk_bytes=256, observer=CancelOnFirstBytes(), cancel=cancel)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_memory_is_bounded_by_the_buffers_not_the_partitions(fixture_by_name, tmp_path):
    """Two writing threads with 256 KiB chunks: the process grows far less than one source partition
    (3.3 M parameters over 2 ranks: 6.6 MB of fp32 per rank per state) and less than the plan says."""
    fx = fixture_by_name("large_w2")
    grown = anon_growth("ckptlib.reshard.reshard", fx["checkpoint_path"], tmp_path, 3, chunk_bytes=1 << 18,
                        workers=2)
    plan = plan_reshard(fx["checkpoint_path"], tmp_path / "unused", 3, chunk_bytes=1 << 18, workers=2)
    partition = max(f.read_bytes for f in plan.files if f.kind == "optim_states") // 3  # one state's share
    assert grown < partition / 2 and grown <= plan.predicted_peak_bytes, (grown, partition)


@pytest.mark.parametrize("universal", [False, True], ids=["reshard", "universal"])
def test_progress_from_parallel_writers_only_goes_up_and_ends_at_the_total(fixture_by_name, tmp_path, universal):
    from ckptlib.reshard import write_universal

    seen = []

    class Record(ckptlib.Observer):
        def on_bytes(self, done, total):
            seen.append((done, total))

    src = fixture_by_name("z3_fp32_w4")["checkpoint_path"]
    if universal:
        result = write_universal(src, tmp_path / "out", workers=3, chunk_bytes=512, observer=Record())
    else:
        result = reshard(src, tmp_path / "out", 3, workers=3, chunk_bytes=512, observer=Record())
    dones = [d for d, _ in seen]
    assert len(seen) > 20 and dones == sorted(dones)
    streamed = result.plan.write_bytes  # progress counts the bytes streamed into files; the result, their sizes
    assert dones[-1] == streamed and {t for _, t in seen} == {streamed}
    assert result.bytes_written == result.plan.file_bytes == \
        sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file())
