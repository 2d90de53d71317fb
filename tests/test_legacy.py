"""Checkpoints in torch's legacy (non-zip) serialization, which DeepSpeed writes with
``"checkpoint": {"checkpoint_serialization": false}``: read like zip files, never refused (issue 32).

Real DeepSpeed 0.19.8 checkpoints (tests/fixtures/legacy: ZeRO-1/2/3 bf16, the 43 MB FixtureNet at ZeRO-2, a
2-stage pipeline with its layer files, MoE with its expert files): inspect, export with every optimizer state and
reshard (with --verify) are bit-exact against the live engines' references, and DeepSpeed loads the reshards.
The reader (ckptlib/io/torchzip/legacy.py) against torch's own files: every tensor, view and dtype equal;
every damage refused with one error naming the file; memory bounded by the chunk, not the file.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import ckptlib
from ckptlib.analysis.verify import verify
from ckptlib.errors import CkptError, IncompleteCheckpointError, UnsafeCheckpointError, UnsupportedCheckpointError
from ckptlib.io.torchzip import TensorHandle, open_torch_file
from ckptlib.io.torchzip.globalscan import pickle_globals
from tests.fixtures.memory_probe import anon_growth

ZERO = ["legacy_z1_bf16_w2", "legacy_z2_bf16_w2", "legacy_z3_bf16_w2"]
PARALLEL = ["legacy_pp2_dp1_z1_bf16", "legacy_moe_ep1_z1_bf16"]
ZIP_MAGIC, LEGACY_MAGIC = b"PK\x03\x04", b"\x80\x02\x8a\x0a"


def _ref(fx) -> dict:
    return torch.load(fx["path"] / "reference.pt", weights_only=True)


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _tensors(obj, path=""):
    if isinstance(obj, TensorHandle):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def _torch_tensors(obj, path=""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _torch_tensors(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _torch_tensors(v, f"{path}[{i}]")


# ============================================================================================ the reader
def _sample() -> dict:
    base = torch.arange(5000, dtype=torch.float32)
    return {"a": base, "view": base[10:20], "strided": torch.arange(12.0).reshape(3, 4).t(),
            "bf16": torch.arange(7, dtype=torch.bfloat16), "f16": torch.ones(3, dtype=torch.float16),
            "i64": torch.tensor([2**40, 2**24 + 1]), "bool": torch.tensor([True, False, True]),
            "u8": torch.arange(5, dtype=torch.uint8), "empty": torch.empty(0), "scalar": torch.tensor(3.5),
            "shared": [base[100:103], base[4990:]], "param": torch.nn.Parameter(torch.ones(2, 2)),
            "nested": {"step": 7, "lr": 1e-3, "betas": (0.9, 0.95), "name": "x"}}


def test_every_tensor_of_a_legacy_file_equals_torchs_own_load(tmp_path):
    obj = _sample()
    f = tmp_path / "legacy.pt"
    torch.save(obj, f, _use_new_zipfile_serialization=False)
    assert f.read_bytes()[:4] == LEGACY_MAGIC
    want = torch.load(f, weights_only=True)
    with open_torch_file(f) as tf:
        assert tf.format == "legacy" and tf.entries == () and tf.archive_name is None
        got = dict(_tensors(tf.obj))
        assert tf.obj["nested"] == {"step": 7, "lr": 1e-3, "betas": (0.9, 0.95), "name": "x"}
        assert tf.obj["param"].is_parameter
        expected = dict(_torch_tensors(want))
        assert set(got) == set(expected)
        for name, t in expected.items():
            assert _same(got[name].read(), t.detach()), name
        # views share their storage; the storages tile the file after the pickles, each after its 8-byte count
        assert got[".view"].storage is got[".a"].storage is got[".shared[0]"].storage
        refs = sorted(tf.storages.values(), key=lambda r: r.data_offset)
        for r, nxt in zip(refs, refs[1:]):
            assert r.data_offset + r.stored_bytes + 8 == nxt.data_offset
        assert refs[-1].data_offset + refs[-1].stored_bytes == tf.size
        # ranged reads: a piece, not the file
        before = tf.stats.bytes_read
        assert torch.equal(got[".a"].read_flat(1000, 10), torch.arange(1000.0, 1010.0))
        assert tf.stats.bytes_read - before == 40
    assert {g.module + "." + g.name for g in pickle_globals(f)} >= {"torch._utils._rebuild_tensor_v2",
                                                                      "torch.FloatStorage"}


def test_opening_reads_the_pickles_and_one_count_per_storage_not_the_tensors(tmp_path):
    f = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(4_000_000), "b": torch.ones(10)}, f, _use_new_zipfile_serialization=False)
    with open_torch_file(f) as tf:
        assert tf.stats.bytes_read < 80_000 < tf.size  # the 64 KiB pickle buffer at most, of 16 MB
        assert torch.equal(tf.obj["b"].read(), torch.ones(10))


def _legacy(tmp_path, obj=None) -> tuple[Path, bytes]:
    f = tmp_path / "t.pt"
    torch.save(obj if obj is not None else {"a": torch.arange(100.0), "b": torch.arange(7, dtype=torch.int64)}, f,
               _use_new_zipfile_serialization=False)
    return f, f.read_bytes()


def _storage_area(data: bytes) -> int:
    """Where the storage counts begin: after the five pickles (walked with pickletools, nothing run)."""
    import io
    import pickletools

    b = io.BytesIO(data)
    for _ in range(5):
        for _op in pickletools.genops(b):
            pass
    return b.tell()


@pytest.mark.parametrize("damage", ["truncated", "truncated in a count", "appended", "count changed",
                                    "count too large", "no storages", "keys list damaged", "magic"])
def test_damaged_legacy_files_are_refused_naming_the_file(tmp_path, damage):
    f, data = _legacy(tmp_path)
    area = _storage_area(data)
    bad = bytearray(data)
    if damage == "truncated":
        bad = bad[:-3]
    elif damage == "truncated in a count":
        bad = bad[:area + 4]
    elif damage == "appended":
        bad += b"\0" * 8
    elif damage == "count changed":
        bad[area] ^= 1
    elif damage == "count too large":
        bad[area + 6] = 0x7f
    elif damage == "no storages":
        bad = bad[:area]
    elif damage == "keys list damaged":
        bad[area - 2] ^= 0x20  # a character of the last key
    elif damage == "magic":
        bad[5] ^= 1
    f.write_bytes(bytes(bad))
    with pytest.raises(CkptError) as e:
        open_torch_file(f).obj
    assert str(f) in str(e.value), str(e.value)
    assert isinstance(e.value, (IncompleteCheckpointError, UnsupportedCheckpointError)), type(e.value)


def test_a_legacy_pickle_that_asks_for_code_is_refused_and_nothing_runs(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    f = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil()}, f, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointError, match=r"\.print'"):
        open_torch_file(f)
    assert any(not g.allowed and g.name == "print" for g in pickle_globals(f))


def test_the_refusal_and_its_weights_only_false_hint_are_gone():
    text = Path(__file__).resolve().parents[1].joinpath("ckptlib/io/torchzip/reader.py").read_text()
    assert "weights_only=False" not in text and "interleaved" not in text


# ============================================================================================ real DeepSpeed files
def test_deepspeed_wrote_every_file_kind_in_the_legacy_format(legacy_fixtures):
    kinds = set()
    for name in ZERO + PARALLEL + ["legacy_large_w2"]:
        fx = legacy_fixtures[name]
        for f in (fx["checkpoint_path"] / "global_step2").glob("*.pt"):
            assert f.read_bytes()[:4] == LEGACY_MAGIC, f
            kinds.add("optim" if "optim" in f.name else "expert" if "expert" in f.name else
                      "layer" if f.name.startswith("layer_") else "model")
    assert kinds == {"optim", "model", "layer", "expert"}


@pytest.mark.parametrize("name", ZERO + ["legacy_large_w2"])
def test_inspect_and_read_are_bit_exact(legacy_fixtures, name):
    fx = legacy_fixtures[name]
    ref = _ref(fx)
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(fx["checkpoint_path"]), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["problems"] == [] and info["zero_stage"] == fx["zero_stage"] and info["dp_world_size"] == 2
    assert {p["name"] for p in info["parameters"]} == {p["name"] for p in fx["parameters"]}
    assert any("torch's legacy serialization" in n and "no CRC-32" in n for n in info["notes"]), info["notes"]
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        assert ck.problems == []
        for n, want in ref["fp32"].items():
            assert _same(ck.read_param(n), want), n
            for key in ("exp_avg", "exp_avg_sq"):
                assert _same(ck.read_state(n, key), ref["optim"][n][key].float()), (n, key)
        for n, want in ref["frozen"].items():
            assert _same(ck.read_param(n), want.float()), n
        for n, want in ref["buffers"].items():
            assert _same(ck.read_buffer(n), want), n


@pytest.mark.parametrize("name", PARALLEL)
def test_inspect_of_pipeline_and_moe_files(legacy_fixtures, name):
    fx = legacy_fixtures[name]
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(fx["checkpoint_path"]), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["problems"] == [] and info["pp_world_size"] == fx["pp"] and info["dp_world_size"] == fx["dp"]
    assert set(_ref(fx)["params"]) <= {p["name"] for p in info["parameters"]}


def _load_st(folder: Path) -> dict:
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(safetensors.torch.load_file(f))
    return sd


@pytest.mark.parametrize("name", ZERO)
def test_export_with_every_state_is_bit_exact(legacy_fixtures, tmp_path, name):
    fx = legacy_fixtures[name]
    ref = _ref(fx)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ckptlib", "export", str(fx["checkpoint_path"]), str(out),
                        "--states", "all", "--max-shard-size", "8KB"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    sd = _load_st(out)
    for n, want in {**ref["fp32"], **{k: v.float() for k, v in ref["frozen"].items()}}.items():
        assert _same(sd[n], want), n
    for n, want in ref["buffers"].items():
        assert _same(sd[n], want if not want.is_floating_point() else want.float()), n
    for key in ("exp_avg", "exp_avg_sq"):
        states = _load_st(out / key)
        assert set(states) == set(ref["optim"])
        for n, moments in ref["optim"].items():
            assert _same(states[n], moments[key].float()), (key, n)


@pytest.mark.parametrize("name", PARALLEL)
def test_pipeline_and_moe_exports_are_bit_exact(legacy_fixtures, tmp_path, name):
    fx = legacy_fixtures[name]
    ref = _ref(fx)
    out = tmp_path / "out"
    ckptlib.export(fx["checkpoint_path"], out, states=["all"])
    sd = _load_st(out)
    for n, want in ref["params"].items():
        assert _same(sd[n], want), n
    for n, want in (ref.get("buffers") or {}).items():
        assert _same(sd[n], want), n
    for key in ("exp_avg", "exp_avg_sq"):
        states = _load_st(out / key)
        for n, want in ref["states"][key].items():
            assert _same(states[n], want), (key, n)


# ============================================================================================ reshard + DeepSpeed loads
RESHARDS = [("legacy_z1_bf16_w2", 3), ("legacy_z2_bf16_w2", 3), ("legacy_z3_bf16_w2", 3), ("legacy_large_w2", 1)]


@pytest.fixture(scope="module")
def reshards(legacy_fixtures, tmp_path_factory):
    """Every reshard (verified), and DeepSpeed's loads of them (one launch per world size)."""
    from tests.fixtures.load_runner import job_for_fixture, run_load_checks
    from tests.fixtures.parallel.check import make_job
    from tests.fixtures.parallel.check import run_load_checks as par_load_checks

    work = tmp_path_factory.mktemp("legacy-reshard")
    outs, jobs = {}, {}
    for name, m in RESHARDS:
        fx = legacy_fixtures[name]
        out = work / f"{name}-to{m}"
        plan = ckptlib.plan_reshard(fx["checkpoint_path"], out, m)
        ckptlib.reshard(plan)
        checked = verify(plan, out)
        assert checked.ok, checked.describe()
        outs[name] = out
        spec = "large_w2" if "large" in name else name.replace("legacy_", "")  # the same configuration, zip saves
        jobs.setdefault(m, []).append(job_for_fixture(fx, checkpoint_dir=out, name=name, spec_name=spec))
    results = {}
    for m, js in sorted(jobs.items()):
        results.update(run_load_checks(js, m, work / f"w{m}"))
    fx = legacy_fixtures["legacy_pp2_dp1_z1_bf16"]
    out = work / "pp-to-dp2"
    r = subprocess.run([sys.executable, "-m", "ckptlib", "reshard", str(fx["checkpoint_path"]), str(out),
                        "--world-size", "2", "--verify"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "verified:" in r.stdout
    outs["legacy_pp2_dp1_z1_bf16"] = out
    job, world = make_job(fx["path"], dp=2, checkpoint_dir=out, name="legacy_pp2_dp1_z1_bf16")
    results.update(par_load_checks([job], world, work / "pp"))
    fx = legacy_fixtures["legacy_moe_ep1_z1_bf16"]
    out = outs["legacy_moe_ep1_z1_bf16"] = work / "moe-to-dp1"
    plan = ckptlib.plan_reshard(fx["checkpoint_path"], out, 1)
    ckptlib.reshard(plan)
    checked = verify(plan, out)
    assert checked.ok and "every file rewritten in the zip format" in checked.describe(), checked.describe()
    job, world = make_job(fx["path"], dp=1, checkpoint_dir=out, name="legacy_moe_ep1_z1_bf16")
    results.update(par_load_checks([job], world, work / "moe"))
    return outs, results


@pytest.mark.parametrize("name,m", RESHARDS, ids=[f"{n}->{m}" for n, m in RESHARDS])
def test_deepspeed_loads_the_reshard_with_exact_masters_and_moments(reshards, legacy_fixtures, name, m):
    outs, results = reshards
    fx = legacy_fixtures[name]
    ref = _ref(fx)
    got = results[name]
    assert "error" not in got, got.get("error")
    assert got["world_size"] == m
    loaded = got["loaded"]
    for n, want in ref["fp32"].items():
        assert torch.equal(loaded["fp32"][n], want), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"][n][key], ref["optim"][n][key]), (key, n)
    assert loaded["step"] == ref["step"]
    for n, want in ref["frozen"].items():
        assert torch.equal(loaded["frozen"][n], want), n
    for n, want in ref["buffers"].items():
        assert torch.equal(loaded["buffers"][n], want), n


@pytest.mark.parametrize("name", PARALLEL)
def test_deepspeed_loads_the_pipeline_and_moe_reshards_exactly(reshards, legacy_fixtures, name):
    outs, results = reshards
    fx = legacy_fixtures[name]
    ref = _ref(fx)
    got = results[name]
    assert "error" not in got, got.get("error")
    for n, want in ref["params"].items():
        assert _same(got["loaded"]["params"][n], want), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same(got["loaded"]["states"][key][n], ref["states"][key][n]), (key, n)
    for n, want in ref["module16"].items():
        assert _same(got["loaded"]["module16"][n], want), n
    for n, want in (ref.get("buffers") or {}).items():
        assert _same(got["loaded"]["buffers"][n], want), n
    assert got["loaded"]["step"] == ref["step"]


def test_every_file_a_reshard_writes_is_a_zip_file(reshards):
    outs, _ = reshards
    for name, out in outs.items():
        files = list(out.rglob("*.pt"))
        legacy = [f.name for f in files if f.read_bytes()[:4] != ZIP_MAGIC]
        assert files and not legacy, (name, legacy)


# ============================================================================================ memory
def test_memory_is_bounded_by_the_chunk_not_the_file(legacy_fixtures, tmp_path):
    """The large fixture's files are 19.4 MB (optimizer) and 6.6 MB (model); its largest tensor 8.4 MB fp32:
    streamed in 256 KiB chunks, export and reshard stay well under it."""
    fx = legacy_fixtures["legacy_large_w2"]
    files = sorted((fx["checkpoint_path"] / "global_step2").glob("*.pt"))
    largest = 8209 * 257 * 4
    assert min(f.stat().st_size for f in files) > 16 * (1 << 18)
    (tmp_path / "e").mkdir()
    (tmp_path / "r").mkdir()
    grown = anon_growth("ckptlib.export.export", fx["checkpoint_path"], tmp_path / "e", chunk_bytes=1 << 18,
                        states=["exp_avg"])
    assert grown < largest / 2, (grown, largest)
    grown = anon_growth("ckptlib.reshard.reshard", fx["checkpoint_path"], tmp_path / "r", 3, chunk_bytes=1 << 18)
    assert grown < largest / 2, (grown, largest)
