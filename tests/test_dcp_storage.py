"""DCP's other storages, both ways (issue 39, part 1), on folders torch 2.13 itself wrote.

A DeepSpeed 0.19.8 checkpoint (ZeRO-3, 3 ranks; FixtureNet: tied embed/head, a frozen Linear, int64/bool/float
buffers) is exported by ckptlib to DCP (torch storage, with the optimizer), loaded into FSDP2 at 2 ranks on the
CPU (gloo), and saved by FSDP2 again in each of torch 2.13's storages: ``FileSystemWriter`` (torch.save items),
``FileSystemWriter(serialization_format=SAFETENSORS)``, ``HuggingFaceStorageWriter`` consolidated (rank 0's full
state dict) and ``save_distributed=True``. So every value those folders hold is known: the live engine's fp32
masters, moments and buffers (tests/fixtures/compare.reference).

- ckptlib reads each (inspect, check, diff, export) bit for bit equal to the engine's state;
- ckptlib writes torch, hf and hf-sharded storage, and torch's own readers (``FileSystemReader``,
  ``HuggingFaceStorageReader``) load them into FSDP2 at 1 and 2 ranks exactly (the optimizer too, for torch);
  the hf files are laid out as torch writes them (names, keys, pieces, sharding info, index);
- torch's ``consolidate_safetensors_files`` merges the sharded output into the same tensors;
- hand-damaged copies (a missing rank, a hole, overlapping pieces with other bytes, bad global shapes) are
  refused naming the files; overlapping pieces with the same bytes are read.
"""
from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

import ckptlib
from ckptlib import cli
from ckptlib.dcp import open_dcp
from tests.fixtures.compare import reference
from tests.fixtures.fsdp_runner import run_fsdp_loads
from tests.fixtures.model import build_model, param_group_names

SOURCE = "z3_fp32_w3"
SAVED = ("torch", "safetensors", "hf", "hf-sharded")     # what FSDP2 (2 ranks) saves
WRITTEN = ("torch", "hf", "hf-sharded")                  # what ckptlib writes
WITH_OPTIMIZER = ("torch", "safetensors")
WORLDS = (1, 2)


@pytest.fixture(scope="module")
def runs(fixture_by_name, tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    fx = fixture_by_name(SOURCE)
    work = tmp_path_factory.mktemp("dcp-storage")
    src = fx["checkpoint_path"]
    written = {
        "torch": ckptlib.export(src, work / "w-torch", format="dcp", dcp={"optimizer": True}).out,
        "hf": ckptlib.export(src, work / "w-hf", format="dcp", dcp={"storage": "hf"}, max_shard_size="12KB").out,
        "hf-sharded": ckptlib.export(src, work / "w-hfs", format="dcp", dcp={"storage": "hf-sharded"},
                                     max_shard_size="12KB").out,  # 3 ranks (the checkpoint's), 3 files each
    }
    twice = ckptlib.export(src, work / "w-hfs2", format="dcp", dcp={"storage": "hf-sharded", "ranks": 2}).out
    groups = param_group_names(build_model())
    saved = {s: work / f"saved-{s}" for s in SAVED}
    jobs = {m: [{"name": f"{s}@{m}", "dcp": written[s], "model": "fixture", "groups": groups,
                 "loader": "torch" if s == "torch" else "hf"} for s in WRITTEN] for m in WORLDS}
    jobs[2].append({"name": "resave", "dcp": written["torch"], "model": "fixture", "groups": groups,
                    "saves": {s: str(p) for s, p in saved.items()}})
    results = {}
    for m in WORLDS:
        results.update(run_fsdp_loads(jobs[m], m, work / f"fsdp-w{m}"))
    assert "error" not in results["resave"], results["resave"].get("error")
    return {"fx": fx, "ref": reference(fx), "written": written, "twice": twice, "saved": saved, "results": results,
            "work": work}


def _model_state(ref: dict) -> dict:
    """The module's state dict the engine held: masters, frozen weights (upcast), buffers, the tied alias."""
    out = dict(ref["fp32"])
    out.update({k: v.float() for k, v in ref["frozen"].items()})
    out.update(ref["buffers"])
    out["head.weight"] = out["embed.weight"]
    return out


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


def _header(path) -> dict:
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


# ============================================================================================ reading
@pytest.mark.parametrize("storage", SAVED)
def test_torchs_folders_read_diff_and_export_bit_exact(runs, storage, tmp_path, capsys):
    folder, ref = runs["saved"][storage], runs["ref"]
    want = _model_state(ref)
    if storage in ("safetensors", "hf-sharded"):  # saved without the tied alias (fsdp_load.save_storages)
        del want["head.weight"]
    assert open_dcp(folder).storage == storage
    ts = ckptlib.open_tensor_set(folder, states=True)
    if storage == "hf-sharded":  # torch 2.13 records no global shape: the user is told what that leaves unproven
        assert any("largest offset + size" in n and "last rank" in n for n in ts.notes), ts.notes
    assert {k for k in ts.tensors if "/" not in k} == set(want)
    result = ckptlib.diff(runs["fx"]["checkpoint_path"], folder, states=True)
    rows = {t.key: t.status for t in result.tensors}
    held = storage in WITH_OPTIMIZER
    assert rows == {n: "same" if (n in want if "/" not in n else held) else "only_in_a" for n in rows}
    per_parameter = (3 if held else 2) * len(ref["optim"])  # moments and steps; no steps without a B side's
    assert sum(n.startswith(("exp_avg/", "exp_avg_sq/", "step/")) for n in rows) == per_parameter
    assert sum(s == "same" for s in rows.values()) == len(want) + (3 * len(ref["optim"]) if held else 0)
    ckptlib.export(folder, tmp_path / "st", states=("exp_avg", "exp_avg_sq") if storage in WITH_OPTIMIZER else ())
    from safetensors.torch import load_file

    got = load_file(tmp_path / "st" / "model.safetensors")
    assert set(got) == set(want) and all(_bits(got[k], want[k]) for k in want)
    if storage in WITH_OPTIMIZER:
        for key in ("exp_avg", "exp_avg_sq"):
            moments = load_file(tmp_path / "st" / key / "model.safetensors")
            assert set(moments) == set(ref["optim"]) and all(_bits(moments[p], ref["optim"][p][key]) for p in moments)
    assert cli.main(["inspect", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "storage: " in text and {"torch": "torch.save items", "safetensors": "SAFETENSORS",
                                    "hf": "consolidated", "hf-sharded": "save_distributed"}[storage] in text
    assert cli.main(["check", str(folder), "--states", "-q"]) == 0
    assert "healthy" in capsys.readouterr().out


def test_the_safetensors_serialized_layout_is_what_torch_cannot_read_back(runs):
    """The claim docs/dcp.md makes: torch 2.13's own FileSystemReader fails on what
    FileSystemWriter(serialization_format=SAFETENSORS) wrote, where ckptlib reads it (above). The .metadata gives
    every tensor chunk of a file one offset, where the file's safetensors data begins."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    folder = runs["saved"]["safetensors"]
    md = FileSystemReader(folder).read_metadata()
    offsets = {}
    for k, v in md.storage_data.items():
        if k.offset is not None:
            offsets.setdefault(v.relative_path, set()).add(v.offset)
    assert offsets and all(len(v) == 1 for v in offsets.values())
    want = _model_state(runs["ref"])
    sd = {"model": {k: torch.zeros_like(v) for k, v in want.items() if k != "head.weight"}}
    with pytest.raises(BaseException, match="Weights only load failed"):
        dcp.load(sd, storage_reader=FileSystemReader(folder), no_dist=True)


# ============================================================================================ writing
@pytest.mark.parametrize("m", WORLDS)
@pytest.mark.parametrize("storage", WRITTEN)
def test_torchs_readers_load_ckptlibs_writes_into_fsdp2_exactly(runs, storage, m):
    got = runs["results"][f"{storage}@{m}"]
    assert "error" not in got, got.get("error")
    assert got["world_size"] == m
    ref, loaded = runs["ref"], got["loaded"]
    want = _model_state(ref)
    for n, p in loaded["params"].items():
        assert _bits(p, want[n]), n
    for n in runs["ref"]["buffers"]:  # the persistent ones (the non-persistent pos_cache is not saved)
        assert _bits(loaded["buffers"][n], want[n]), n
    assert set(loaded["params"]) | set(ref["buffers"]) == set(want) - {"head.weight"}
    assert loaded["tied"] == ["head.weight"]
    if storage == "torch":  # the optimizer goes where the storage holds it
        assert set(loaded["optim"]) == set(ref["optim"])
        for p, st in loaded["optim"].items():
            assert _bits(st["exp_avg"], ref["optim"][p]["exp_avg"]) and \
                _bits(st["exp_avg_sq"], ref["optim"][p]["exp_avg_sq"]) and st["step"] == ref["step"], p
    else:
        assert loaded["optim"] == {}


def test_hf_files_are_laid_out_as_torch_writes_them(runs):
    """ckptlib's hf output and HuggingFaceStorageWriter's (rank 0's full state dict) of the same state: the same file
    name, keys, dtypes, shapes, bytes, sharding info and index; the hf-sharded output for 2 ranks and torch's
    save_distributed=True at 2 ranks: the same files, and in each the same pieces of every parameter (buffers go to
    the rank torch's planner picks, empty pieces only where torch keeps one)."""
    from safetensors.torch import load_file

    theirs, ours = runs["saved"]["hf"], runs["written"]["hf"]
    one = ckptlib.export(runs["fx"]["checkpoint_path"], runs["work"] / "w-hf1", format="dcp",
                         dcp={"storage": "hf"}).out  # one file, as torch wrote it
    assert sorted(p.name for p in theirs.iterdir()) == sorted(p.name for p in one.iterdir())
    a, b = load_file(theirs / "model-00001-of-00001.safetensors"), load_file(one / "model-00001-of-00001.safetensors")
    assert set(a) == set(b) and all(_bits(a[k], b[k]) for k in a)
    ha, hb = _header(theirs / "model-00001-of-00001.safetensors"), _header(one / "model-00001-of-00001.safetensors")
    meta_a, meta_b = ha.pop("__metadata__"), hb.pop("__metadata__")
    assert json.loads(meta_a.pop("DCP_SHARDING_INFO")) == json.loads(meta_b.pop("DCP_SHARDING_INFO"))
    assert meta_a == meta_b == {"DCP_VERSION": "1.0", "format": "pt"}
    ia, ib = (json.loads((f / "model.safetensors.index.json").read_text()) for f in (theirs, one))
    assert ia["metadata"] == ib["metadata"] and sorted(ia["weight_map"]) == sorted(ib["weight_map"])
    files = sorted(p.name for p in ours.glob("model-*.safetensors"))  # max_shard_size: several files, the index
    index = json.loads((ours / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(files) > 1 and sorted(set(index.values())) == files
    assert all(k in load_file(ours / f) for k, f in index.items()) and set(index) == set(_model_state(runs["ref"]))

    def pieces(folder):
        out = {}
        for f in folder.glob("shard-*.safetensors"):
            h = _header(f)
            info = json.loads(h.pop("__metadata__")["DCP_SHARDING_INFO"])
            out[f.name] = {(k, tuple(info[k]["saved_offsets"]), tuple(v["shape"])) for k, v in h.items()}
        return out

    params = set(runs["ref"]["fp32"]) | set(runs["ref"]["frozen"])
    mine, torchs = pieces(runs["twice"]), pieces(runs["saved"]["hf-sharded"])
    assert sorted(mine) == sorted(torchs) == ["shard-00001-model-00001-of-00001.safetensors",
                                              "shard-00002-model-00001-of-00001.safetensors"]
    for name in mine:
        keep = lambda s: {p for p in s if p[0] in params and 0 not in p[2]}  # noqa: E731
        assert keep(mine[name]) == keep(torchs[name]), name


def test_torchs_consolidation_of_the_sharded_output_gives_the_same_tensors(runs, tmp_path):
    """consolidate_safetensors_files on ckptlib's hf-sharded output (3 ranks, several files): every floating tensor the
    engine's. torch 2.13's consolidation cannot merge an integer or bool tensor (torch.finfo of its dtype), which
    the plan's notes say; ckptlib's own export of the folder merges those too."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    folder, want = runs["written"]["hf-sharded"], _model_state(runs["ref"])
    names = sorted(p.name for p in folder.glob("shard-*.safetensors"))
    assert {n[:11] for n in names} == {"shard-00001", "shard-00002", "shard-00003"} and len(names) > 3, names
    floating = [k for k, v in want.items() if v.is_floating_point()]
    out = tmp_path / "merged"
    out.mkdir()
    consolidate_safetensors_files(str(folder), str(out), {k: 1 for k in floating})
    got = load_file(out / "model-00001-of-00001.safetensors")
    assert set(got) == set(floating) and all(_bits(got[k], want[k]) for k in floating)
    with pytest.raises(TypeError, match="finfo"):
        consolidate_safetensors_files(str(folder), str(tmp_path / "merged"), {"counter": 1})
    ckptlib.export(folder, tmp_path / "ours")
    mine = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(mine) == set(want) and all(_bits(mine[k], want[k]) for k in want)


def test_storage_options_refusals_plan_and_verify(runs, tmp_path, capsys):
    src = str(runs["fx"]["checkpoint_path"])
    assert cli.main(["export", src, str(tmp_path / "a"), "--format", "dcp", "--dcp-storage", "hf", "--optimizer"]) == 2
    err = capsys.readouterr().err
    assert "optimizer state" in err and "--dcp-storage torch" in err and not (tmp_path / "a").exists()
    assert cli.main(["export", src, str(tmp_path / "a"), "--format", "dcp", "--dcp-storage", "hf-sharded",
                     "--layout", "torchtitan"]) == 2
    assert "--dcp-storage torch" in capsys.readouterr().err
    assert cli.main(["export", src, str(tmp_path / "a"), "--dcp-storage", "hf"]) == 2
    assert "--format dcp" in capsys.readouterr().err
    with pytest.raises(ckptlib.CkptError, match="FileSystemReader cannot load"):
        ckptlib.plan_export(src, tmp_path / "a", format="dcp", dcp={"storage": "safetensors"})
    assert cli.main(["export", src, str(tmp_path / "a"), "--format", "dcp", "--dcp-storage", "hf-sharded",
                     "--plan"]) == 0
    text = capsys.readouterr().out
    assert "hf-sharded storage" in text and "shard-00003-model-00001-of-00001.safetensors" in text
    from ckptlib.analysis.verify import verify

    plan = ckptlib.plan_export(src, tmp_path / "v", format="dcp", dcp={"storage": "hf-sharded"})
    ckptlib.run(plan)
    assert verify(plan).ok
    shard = tmp_path / "v" / "shard-00002-model-00001-of-00001.safetensors"
    h = _header(shard)
    start = 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0] + h["fc2.weight"]["data_offsets"][0]
    raw = bytearray(shard.read_bytes())
    raw[start + 4 * 3 + 2] ^= 0x01
    shard.write_bytes(raw)
    v = verify(plan)
    assert not v.ok and any("fc2.weight" in " ".join(c.bad) for c in v.checks if not c.ok)


# ============================================================================================ damage
def _rewrite(path, change) -> None:
    """Write the safetensors file at ``path`` again with ``change(tensors, sharding info)`` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    meta = _header(path)["__metadata__"]
    info = json.loads(meta["DCP_SHARDING_INFO"])
    change(tensors, info)
    save_file(tensors, path, metadata={**meta, "DCP_SHARDING_INFO": json.dumps(info)})


def _copy(runs, tmp_path, name="bad"):
    out = tmp_path / name
    shutil.copytree(runs["saved"]["hf-sharded"], out)
    return out


def _refused(folder, *files):
    with pytest.raises(ckptlib.CkptError) as e:
        ckptlib.open_tensor_set(folder)
    for f in files:
        assert f in str(e.value), (f, str(e.value))
    return str(e.value)


def test_a_missing_rank_and_a_hole_are_refused_naming_the_files(runs, tmp_path):
    """A rank's files missing from the middle of the set (ckptlib's 3-rank output) is refused by the names; a
    missing last rank cannot be told from a smaller set without global_shape (docs/dcp.md). A hole: one piece
    dropped from a file FSDP2 wrote."""
    folder = tmp_path / "rank"
    shutil.copytree(runs["written"]["hf-sharded"], folder)
    for f in folder.glob("shard-00002-*.safetensors"):
        f.unlink()
    _refused(folder, "no file of rank 2", "shard-00002-model-*")

    folder = _copy(runs, tmp_path, "hole")

    def drop(t, info):
        del t["fc2.weight"], info["fc2.weight"]

    _rewrite(folder / "shard-00001-model-00001-of-00001.safetensors", drop)
    msg = _refused(folder, "fc2.weight", "no piece holds element [0, 0]",
                   "shard-00002-model-00001-of-00001.safetensors")
    assert "a hole of 495 elements" in msg  # fc2.weight's 29 rows of 33: rank 1 held rows 0-14
    assert cli.main(["export", str(folder), str(tmp_path / "o")]) == 2 and not (tmp_path / "o").exists()


def test_overlapping_pieces_read_when_equal_refused_when_not(runs, tmp_path):
    want = _model_state(runs["ref"])["fc1.weight"]
    f1, f2 = "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"

    def also(rows, bump=False):
        def change(t, info):  # rank 2 also holds rows 10..16 of fc1.weight (rank 1 holds 0..16, rank 2 17..32)
            extra = want[rows].clone()
            if bump:
                extra[3, 5] += 1.0
            t["fc1.weight"] = torch.cat([extra, t["fc1.weight"]])
            info["fc1.weight"]["saved_offsets"] = [rows.start, 0]
        return change

    same = _copy(runs, tmp_path, "same")
    _rewrite(same / f2, also(slice(10, 17)))
    ts = ckptlib.open_tensor_set(same)
    ckptlib.export(same, tmp_path / "o")
    from safetensors.torch import load_file

    assert _bits(load_file(tmp_path / "o" / "model.safetensors")["fc1.weight"], want) and "fc1.weight" in ts.tensors
    other = _copy(runs, tmp_path, "other")
    _rewrite(other / f2, also(slice(10, 17), bump=True))
    msg = _refused(other, "fc1.weight", "different values", f1, f2)
    assert cli.main(["check", str(other), "-q"]) == 1  # check streams both copies: a problem naming the file
    assert "different" in msg


def test_global_shape_is_used_and_checked(tmp_path):
    """pytorch #189945's global_shape (not in torch 2.13), in hand-made files: it gives the size (a trailing extent
    no piece reaches is then a hole, refused); pieces beyond it, or global shapes that disagree, are refused."""
    from safetensors.torch import save_file

    rows = torch.arange(24.).reshape(6, 4)

    def write(folder, pieces):
        folder.mkdir()
        for r, (a, b, shape) in enumerate(pieces, start=1):
            info = {"w": {"saved_offsets": [a, 0], **({"global_shape": shape} if shape else {})}}
            save_file({"w": rows[a:b].clone()}, folder / f"shard-{r:05d}-model-00001-of-00001.safetensors",
                      metadata={"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"})
        return folder

    ok = write(tmp_path / "ok", [(0, 3, [6, 4]), (3, 6, [6, 4])])
    assert ckptlib.open_tensor_set(ok).tensors["w"].shape == (6, 4)
    ckptlib.export(ok, tmp_path / "o")
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "o" / "model.safetensors")["w"], rows)
    tail = write(tmp_path / "tail", [(0, 2, [6, 4]), (2, 4, [6, 4])])  # rows 4-5 held by no piece
    _refused(tail, "no piece holds element [4, 0]", "shard-00002-model-00001-of-00001.safetensors")
    bare = write(tmp_path / "bare", [(0, 2, None), (2, 4, None)])  # torch 2.13's files: the size from the extents
    assert ckptlib.open_tensor_set(bare).tensors["w"].shape == (4, 4)
    _refused(write(tmp_path / "beyond", [(0, 3, [2, 4]), (3, 6, [6, 4])]), "beyond its global_shape",
             "shard-00001-model-00001-of-00001.safetensors")
    _refused(write(tmp_path / "two", [(0, 3, [6, 4]), (3, 6, [7, 4])]), "2 global shapes",
             "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors")


def test_a_damaged_safetensors_distcp_file_is_refused_naming_it(runs, tmp_path):
    folder = tmp_path / "st"
    shutil.copytree(runs["saved"]["safetensors"], folder)
    victim = sorted(folder.glob("*.distcp"))[-1]
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(ckptlib.CkptError, match=victim.name):
        ckptlib.open_tensor_set(folder)
