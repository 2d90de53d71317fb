"""DCP export and DCP as a source, in one process: the files against torch 2.13's own reader and writer,
every tensor against the live engine's reference, ``ckpt diff`` of a source and its export, DCP ->
safetensors, ``--verify`` (and what it catches), the restricted unpickler, refusals and memory."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

import ckptlib
from ckptlib import cli
from ckptlib.io.dcp import BytesEntry, Chunk, DcpMetadata, Item, TensorEntry, metadata_pickle, place, write_item
from ckptlib.io.dcp.reader import read_metadata, read_value
from ckptlib.io.torchzip.specs import NewTensor
from tests.fixtures.compare import reference
from tests.fixtures.memory_probe import anon_growth

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _torch_load(folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.parent / (folder.name + ".pt"))
    return torch.load(folder.parent / (folder.name + ".pt"), weights_only=False)


def _write(folder, values: dict, chunked: dict = ()):
    """A DCP folder written by ckptlib's io.dcp: ``values`` (key -> tensor or value) in one file, each tensor
    in ``chunked`` (key -> dim-0 row counts) as several chunks."""
    import os

    folder.mkdir()
    items, entries = [], {}
    for k, v in values.items():
        if torch.is_tensor(v) and k in chunked:
            start = 0
            for rows in chunked[k]:
                items.append(Item(k, NewTensor.from_tensor(v[start:start + rows]),
                                  chunk_offsets=(start,) + (0,) * (v.dim() - 1)))
                start += rows
        else:
            items.append(Item(k, NewTensor.from_tensor(v) if torch.is_tensor(v) else v,
                              chunk_offsets=(0,) * v.dim() if torch.is_tensor(v) else ()))
    place(items)
    fd = os.open(folder / "__0_0.distcp", os.O_WRONLY | os.O_CREAT)
    for it in items:
        write_item(fd, it)
    os.close(fd)
    for it in items:
        if it.is_tensor:
            e = entries.setdefault(it.fqn, TensorEntry(it.fqn, it.value.dtype, tuple(values[it.fqn].shape)))
            e.chunks.append(Chunk(it.chunk_offsets, it.value.shape, "__0_0.distcp", it.offset, it.length))
        else:
            entries[it.fqn] = BytesEntry(it.fqn, "__0_0.distcp", it.offset, it.length)
    md = DcpMetadata(list(entries.values()), {k: tuple(int(p) if p.isdigit() else p for p in k.split(".", 1))
                                              for k in values}, checkpoint_id=str(folder), save_id="s")
    (folder / ".metadata").write_bytes(metadata_pickle(md))


def test_metadata_reads_back_in_torch_as_its_own_and_ckptlib_reads_torchs(tmp_path):
    sd = {"model": {"w": torch.arange(12.).reshape(3, 4), "b": torch.tensor(2.5, dtype=torch.bfloat16),
                    "i": torch.tensor([7, 2**40])},
          "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"], "foreach": None}]}}
    dcp.save(sd, checkpoint_id=tmp_path / "theirs", no_dist=True)
    flat = {"model.w": sd["model"]["w"], "model.b": sd["model"]["b"], "model.i": sd["model"]["i"],
            "optimizer.param_groups.0.lr": 0.1, "optimizer.param_groups.0.betas": (0.9, 0.99),
            "optimizer.param_groups.0.params": ["w"], "optimizer.param_groups.0.foreach": None}
    _write(tmp_path / "ours", flat)
    from torch.distributed.checkpoint import FileSystemReader

    a, b = FileSystemReader(tmp_path / "theirs").read_metadata(), FileSystemReader(tmp_path / "ours").read_metadata()
    assert a.state_dict_metadata == b.state_dict_metadata
    assert set(a.storage_data) == set(b.storage_data)
    assert a.version == b.version == "1.0.0"
    got = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
           "optimizer": {"param_groups": [{"lr": 0, "betas": 0, "params": 0, "foreach": 1}]}}
    dcp.load(got, checkpoint_id=tmp_path / "ours", no_dist=True)
    assert all(torch.equal(got["model"][k], v) for k, v in sd["model"].items())
    assert got["optimizer"] == sd["optimizer"]
    # and ckptlib reads torch's own folder: the same entries, values and tensor bytes
    d = ckptlib.open_tensor_set(tmp_path / "theirs")
    assert sorted(d.tensors) == ["b", "i", "w"]
    md = read_metadata(tmp_path / "theirs")
    assert read_value(tmp_path / "theirs", md.entry("optimizer.param_groups.0.betas")) == (0.9, 0.99)


def test_chunks_join_into_the_full_tensor_as_torch_joins_them(tmp_path):
    w = torch.randn(7, 5)
    _write(tmp_path / "c", {"model.w": w, "model.v": torch.arange(6.)}, chunked={"model.w": [3, 2, 2]})
    got = {"model": {"w": torch.zeros(7, 5), "v": torch.zeros(6)}}
    dcp.load(got, checkpoint_id=tmp_path / "c", no_dist=True)
    assert torch.equal(got["model"]["w"], w)
    ckptlib.export(tmp_path / "c", tmp_path / "st")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "st" / "model.safetensors")["w"], w)


@pytest.mark.parametrize("name", ["z1_bf16_w3", "z2_fp32_w4", "z3_bf16_w2", "z3_subgroup_w3", "bf16opt_w2",
                                  "z2_roundrobin_w3", "exclude_frozen_z3_w3"])
def test_torchs_own_reader_gets_the_live_engines_masters_moments_and_step(fixture_by_name, tmp_path, name):
    fx = fixture_by_name(name)
    ref = reference(fx)
    out = tmp_path / "dcp"
    ckptlib.export(fx["checkpoint_path"], out, format="dcp", dcp={"optimizer": True})
    sd = _torch_load(out)
    for p, want in ref["fp32"].items():
        assert torch.equal(sd["model"][p], want), p
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["optimizer"]["state"][p][key], ref["optim"][p][key]), (p, key)
        step = sd["optimizer"]["state"][p]["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == ref["step"]
    assert set(sd["optimizer"]["state"]) == set(ref["fp32"])  # none for frozen parameters, one per tied pair
    assert torch.equal(sd["model"]["head.weight"], sd["model"]["embed.weight"])
    for p, want in ref["frozen"].items():  # saved with exclude_frozen_parameters: the checkpoint does not know them
        assert (p not in sd["model"]) if fx["exclude_frozen"] else torch.equal(sd["model"][p], want.float()), p
    for b, want in ref["buffers"].items():
        assert torch.equal(sd["model"][b], want), b
    groups = sd["optimizer"]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(n) for n in _fixture_groups()]
    assert [(g["lr"], g["weight_decay"], g["initial_lr"]) for g in groups] == [(1e-2, 0.01, 1e-2), (5e-3, 0.0, 5e-3)]


def test_zero0_optimizer_state_is_refused_where_names_cannot_be_proven_and_the_model_exports(fixture_by_name,
                                                                                          tmp_path):
    """ZeRO-0 records no parameter names for its optimizer entries; FixtureNet's fc1.weight and the frozen
    weight have one shape, so which moments are fc1's cannot be proven: refused, and the model alone exact."""
    fx = fixture_by_name("z0_fp32_w2")
    with pytest.raises(ckptlib.UnsupportedCheckpointError, match="ZeRO-0"):
        ckptlib.export(fx["checkpoint_path"], tmp_path / "o", format="dcp", dcp={"optimizer": True})
    assert not (tmp_path / "o").exists()
    ckptlib.export(fx["checkpoint_path"], tmp_path / "m", format="dcp")
    sd, ref = _torch_load(tmp_path / "m"), reference(fx)
    assert all(torch.equal(sd["model"][p], want) for p, want in ref["fp32"].items()) and "optimizer" not in sd


def _fixture_groups():
    from tests.fixtures.model import build_model, param_group_names

    return param_group_names(build_model())


@pytest.mark.parametrize("layout", ["torch", "torchtitan", "accelerate"])
def test_diff_of_the_source_and_its_export_is_all_same_and_exit_0(fixture_by_name, tmp_path, capsys, layout):
    src = fixture_by_name("z2_bf16_w3")["checkpoint_path"]
    out = tmp_path / "dcp"
    assert cli.main(["export", str(src), str(out), "--format", "dcp", "--layout", layout, "--optimizer", "-q"]) == 0
    capsys.readouterr()
    assert cli.main(["diff", str(src), str(out), "--states", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["tensors"]
    assert len(rows) == 17 + 3 * 11 and all(r["status"] == "same" for r in rows), [r for r in rows if r["status"] != "same"]
    assert sum(r["name"].startswith("step/") for r in rows) == 11  # and the step of each trainable parameter
    assert cli.main(["inspect", str(out)]) == 0
    assert f"({layout} layout)" in capsys.readouterr().out


def test_dcp_to_safetensors_is_byte_identical_to_exporting_the_source(fixture_by_name, tmp_path):
    src = fixture_by_name("z3_bf16_w3")["checkpoint_path"]
    ckptlib.export(src, tmp_path / "dcp", format="dcp", dcp={"optimizer": True}, max_shard_size="20KB")
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) > 2
    ckptlib.export(tmp_path / "dcp", tmp_path / "a", states=("exp_avg", "exp_avg_sq"))
    ckptlib.export(src, tmp_path / "b", states=("exp_avg", "exp_avg_sq"), hf_files=False)
    for f in ("model.safetensors", "exp_avg/model.safetensors", "exp_avg_sq/model.safetensors"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_verify_passes_and_catches_one_flipped_bit(fixture_by_name, tmp_path):
    from ckptlib.analysis.verify import verify

    plan = ckptlib.plan_export(fixture_by_name("z1_fp32_w3")["checkpoint_path"], tmp_path / "o", format="dcp",
                               dcp={"optimizer": True})
    ckptlib.run(plan)
    assert verify(plan).ok
    from ckptlib.dcp import open_dcp

    d = open_dcp(tmp_path / "o")
    r = d.sources(d.tensors["optimizer.state.fc2.weight.exp_avg"])[0]
    raw = bytearray(open(r.path, "rb").read())
    raw[r.offset + 4 * 17 + 1] ^= 0x01  # one bit of element 17 of the stored exp_avg
    open(r.path, "wb").write(raw)
    v = verify(plan)
    assert not v.ok and any("fc2.weight.exp_avg" in " ".join(c.bad) for c in v.checks if not c.ok)


def test_a_hostile_metadata_pickle_is_refused_without_running_it(tmp_path, fixture_by_name):
    out = tmp_path / "o"
    ckptlib.export(fixture_by_name("z2_fp32_w2")["checkpoint_path"], out, format="dcp")
    (out / ".metadata").write_bytes(pickle.dumps(__import__("os").system))
    with pytest.raises(ckptlib.UnsafeCheckpointError, match="posix.system"):
        ckptlib.open_tensor_set(out)
    assert cli.main(["inspect", str(out)]) == 2


def test_plan_shows_files_bytes_and_memory_and_refusals_are_one_message(fixture_by_name, tmp_path, capsys):
    src = fixture_by_name("large_w2")["checkpoint_path"]
    assert cli.main(["export", str(src), str(tmp_path / "o"), "--format", "dcp", "--optimizer", "--plan"]) == 0
    text = capsys.readouterr().out
    assert "DCP, torch layout, model and optimizer state" in text and "predicted peak memory" in text
    assert not (tmp_path / "o").exists()
    assert cli.main(["export", str(src), str(tmp_path / "o"), "--layout", "torchtitan"]) == 2
    assert "--format dcp" in capsys.readouterr().err
    with pytest.raises(ckptlib.CkptError, match="unknown DCP layout"):
        ckptlib.plan_export(src, tmp_path / "o", format="dcp", dcp={"layout": "megatron"})


def test_memory_is_bounded_by_the_buffers_not_the_model(fixture_by_name, tmp_path):
    """large_w2 (3.3 M parameters: 13 MB per fp32 tensor set) exported with its optimizer state in 256 KiB
    chunks: the process grows far less than one state's worth of the model, and less than the plan says."""
    fx = fixture_by_name("large_w2")
    grown = anon_growth("ckptlib.export.export", fx["checkpoint_path"], tmp_path, format="dcp",
                        dcp={"optimizer": True}, chunk_bytes=1 << 18)
    plan = ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "unused", format="dcp", dcp={"optimizer": True},
                               chunk_bytes=1 << 18)
    one_state = sum(v.tensor.nbytes for v in plan.tensors if v.key == "exp_avg")
    assert grown < one_state / 2 and grown <= plan.predicted_peak_bytes, (grown, one_state)


def test_parallel_writer_processes_write_the_same_bytes(fixture_by_name, tmp_path):
    src = fixture_by_name("z2_bf16_w4")["checkpoint_path"]
    one = ckptlib.plan_export(src, tmp_path / "one", format="dcp", dcp={"optimizer": True}, max_shard_size="30KB")
    three = ckptlib.plan_export(src, tmp_path / "three", format="dcp", dcp={"optimizer": True}, max_shard_size="30KB",
                                workers=3)
    ckptlib.run(one)
    ckptlib.run(three)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "three").iterdir()) and len(names) > 3
    for n in names:
        if n != ".metadata":  # differs only by the save id and the folder it names
            assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "three" / n).read_bytes(), n


def test_distributed_export_shares_the_files_and_writes_what_one_process_writes(fixture_by_name, tmp_path):
    """``ckpt export --format dcp --optimizer --distributed --verify`` under torchrun at 2 ranks: every
    ``.distcp`` byte as one process writes it, and the verification shared by the ranks holds."""
    from tests.fixtures.torchrun import REPO, log_tail, torchrun

    src = fixture_by_name("z3_bf16_w4")["checkpoint_path"]
    argv = ["export", str(src), "{out}", "--format", "dcp", "--optimizer", "--max-shard-size", "25KB", "--verify"]
    one = tmp_path / "one"
    assert cli.main([a.format(out=one) for a in argv] + ["-q"]) == 0
    jobs = [{"name": "dcp", "argv": [a.format(out=tmp_path / "dist") for a in argv] + ["--distributed"]}]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    rc = torchrun(REPO / "tests" / "distributed_driver.py", 2, [str(tmp_path / "jobs.json"), str(tmp_path / "res")],
                  tmp_path / "launch.log", 600, launcher="torchrun")  # ckptlib under torchrun itself
    records = [json.loads((tmp_path / "res" / f"rank{r}.jsonl").read_text().splitlines()[0]) for r in range(2)]
    assert [r["rc"] for r in records] == [0, 0], (rc, records, log_tail(tmp_path / "launch.log"))
    assert "verified:" in records[0]["stdout"] and sorted(v[0] for r in records for v in r["verified"]) == [0, 1]
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "dist").iterdir()) and len(names) > 3
    for n in names:
        if n != ".metadata":
            assert (one / n).read_bytes() == (tmp_path / "dist" / n).read_bytes(), n
    a, b = read_metadata(one), read_metadata(tmp_path / "dist")
    assert a.entries == b.entries and a.planner_data == b.planner_data


def test_verify_crc_checks_the_source_before_writing(fixture_by_name, tmp_path):
    """``--verify-crc`` applies to DCP exports as to every export: a damaged byte of a source storage the
    export reads stops it before anything is written."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixture_by_name("z2_fp32_w2")["checkpoint_path"], src)
    plan = ckptlib.plan_export(src, tmp_path / "o", format="dcp", dcp={"optimizer": True}, verify_crc=True)
    assert plan.crc, "the zip entries the export reads"
    r = next(t for vs in plan.values.values() for t in vs if t.fqn.endswith("fc2.weight.exp_avg")).tensor.ranges[0]
    raw = bytearray(open(r.path, "rb").read())
    raw[r.offset + 5] ^= 0x10
    open(r.path, "wb").write(raw)
    with pytest.raises(ckptlib.CkptError, match="CRC"):
        ckptlib.run(ckptlib.plan_export(src, tmp_path / "o", format="dcp", dcp={"optimizer": True}, verify_crc=True))
    assert not (tmp_path / "o").exists()
