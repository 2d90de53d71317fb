"""Experts on expert-parallel ranks and the pipeline x tensor x data grid (issue 38): the facts of
``ckptlib.analysis.meshmap`` (``placement.experts`` / ``placement.grid`` of ``ckpt inspect --json``) and the pictures
that carry them, checked against independent truth on real DeepSpeed 0.19.8 checkpoints: the files on disk read with
``torch.load`` (an expert file holds that expert's 16-bit weights, bit for bit the live engine's; an optimizer file
whose partition is said to hold an expert holds its fp32 master, the others do not; a tensor rank's slice is the
reference's slice), the fixtures' own records of the engines' ranks (``fixture.json``: ep rank, expert-data-parallel
rank and group, experts per layer; the pipeline's parts; the split dims and shard shapes) and the slices covering
each full tensor exactly once. Metadata-only for ckptlib; no DeepSpeed launch beyond the cached fixtures.
"""
from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

import ckptlib
from ckptlib.analysis import meshmap
from ckptlib.ui.mesh_figures import MAX_ROWS, experts_picture, grid_picture
from ckptlib.ui.pictures import facts_in_html

torch = pytest.importorskip("torch")

AUTOEP = ["mixtral_z2_w2_ep2", "mixtral_z3_w2_ep2", "mixtral_z2_w4_ep2", "mixtral_z3_w4_ep2"]
MOE = ["moe_ep1_z0_bf16", "moe_ep1_z1_bf16", "moe_ep1_z2_bf16", "moe_ep2_z0_fp32", "moe_ep2_z1_bf16",
       "moe_ep2_z2_bf16", "moe_dense_ep2_z0_bf16"]
GRID = ["pp2_dp1_z0_fp32", "pp2_dp2_z0_bf16", "pp2_dp2_z1_bf16", "pp2_dp2_bf16opt", "pp2_dp1_z1_bf16_act",
        "pp2_dp2_z1_bf16_noinfo", "tp2_dp2_z1_bf16", "tp2_dp2_z2_fp32", "tp2_dp2_bf16opt", "tp2_dp2_z1_bf16_noinfo",
        "autotp_tp2_dp2_z2_bf16", "autotp_tp2_dp2_z3_bf16", "autotp_tp2_dp1_z2_bf16_tied", "pp2_tp2_dp2_z1_bf16",
        "pp2_tp2_dp1_z0_fp32", "pp1_dp2_z1_bf16", "tp1_dp2_z1_bf16"]


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _root(fx) -> Path:
    """The folder ``relpath`` is relative to (the path the checkpoint was opened with)."""
    return Path(fx["checkpoint_path"]).resolve()


def _facts(fx, what: str):
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ckpt:
        return getattr(meshmap, what)(ckpt)


def _fp32_partitions(path) -> list:
    """The fp32 master partitions of an optimizer-states file (ZeRO-1/2, BF16_Optimizer, ZeRO-3), as saved."""
    osd = _load(path)["optimizer_state_dict"]
    parts = osd.get("single_partition_of_fp32_groups")
    return list(parts if parts is not None else osd["fp32_flat_groups"])


def _contains(flat, row) -> bool:
    """Whether ``row`` (1-D) lies, bit for bit, as consecutive elements of ``flat`` (1-D)."""
    flat, row = flat.flatten(), row.flatten().to(flat.dtype)
    n = row.numel()
    for i in (flat == row[0]).nonzero().flatten().tolist():
        if i + n <= flat.numel() and torch.equal(flat[i:i + n], row):
            return True
    return False


def _tensors(obj) -> list:
    """Every tensor in a nested object."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _json_ready(facts) -> None:
    assert json.loads(json.dumps(facts)) == facts  # lists and string keys only: what a page's JSON gives back


def _check_replicas(x: dict, masters: dict, partitions: dict) -> None:
    """Each replica's ``elements`` are the expert's elements its optimizer file's fp32 partitions hold: each tensor
    of the expert lies whole in the partitions of the ranks said to hold it, and in no other's."""
    assert sum(r["elements"] for r in x["replicas"]) == x["numel"] == sum(m.numel() for m in masters.values())
    for r in x["replicas"]:
        found = sum(m.numel() for m in masters.values()
                    if any(_contains(p.float(), m) for p in partitions[r["data_rank"]]))
        assert found == r["elements"], (x["expert"], r)
    assert sorted(s["file"] for s in x["state_files"]) == sorted(r["file"] for r in x["replicas"] if r["elements"])
    assert x["files"] == sorted({s["file"] for s in x["state_files"]} | ({x["file"]} if x["file"] else set()))


# ============================================================================================== experts
@pytest.mark.parametrize("name", AUTOEP)
def test_autoep_experts_are_where_the_files_and_the_engines_ranks_say(autoep_fixtures, name):
    fx = autoep_fixtures[name]
    root, ref = _root(fx), _load(Path(fx["path"]) / "reference.pt")
    f = _facts(fx, "experts")
    _json_ready(f)
    zero3 = fx["zero_stage"] == 3
    assert (f["kind"], f["format"], f["zero_stage"]) == ("autoep", "zero3_partitioned" if zero3 else "per_expert_files",
                                                         fx["zero_stage"])
    assert (f["ep"], f["edp"], f["dp"]) == (fx["ep_size"], fx["expert_dp_size"], fx["world_size"])
    modules = [L["module"] for L in f["layers"]]
    assert len(f["ranks"]) == len(fx["ranks"])
    for want in fx["ranks"]:  # the live engines' groups, recorded by the generator
        got = f["ranks"][want["rank"]]
        assert (got["data_rank"], got["ep_rank"], got["edp_rank"]) == (want["rank"], want["ep_rank"], want["edp_rank"])
        assert got["experts"] == [want["experts"][m] for m in modules]
        assert f["ep_ranks"][want["ep_rank"]]["data_ranks"] == want["edp_group"]
        assert re.search(rf"(^|/)bf16_zero_pp_rank_{want['rank']}_mp_rank_00_optim_states\.pt$", got["optim_file"])
        assert (root / got["optim_file"]).is_file()
        if zero3:
            assert got["model_file"].endswith(f"zero_pp_rank_{want['rank']}_mp_rank_00_model_states.pt")
    partitions = {r["data_rank"]: _fp32_partitions(root / r["optim_file"]) for r in f["ranks"]}
    group_of = {r["ep_rank"]: r["edp_group"] for r in fx["ranks"]}
    for L in f["layers"]:
        assert [x["expert"] for x in L["experts"]] == list(range(L["num_experts"]))
        for x in L["experts"]:
            g = x["expert"]
            assert [t["name"] for t in x["tensors"]] == [f"{L['prefix']}.w{k}" for k in (1, 2, 3)]
            assert all(t["index"] == g for t in x["tensors"])
            if zero3:  # partition-native: no expert file in the folder at all
                assert x["file"] is None and x["keys"] == []
                assert not list((root / fx["tag"]).glob("layer_*_expert_*"))
            else:
                file = root / x["file"]
                assert file.name == f"layer_{L['layer']}_expert_{g}_mp_rank_00_model_states.pt"
                sd = _load(file)
                assert sorted(sd) == sorted(x["keys"]) == sorted(f"{t['name']}.{g}" for t in x["tensors"])
                for t in x["tensors"]:  # the live engine's 16-bit weights of expert g, bit for bit
                    assert list(sd[f"{t['name']}.{g}"].shape) == t["shape"]
                    assert torch.equal(sd[f"{t['name']}.{g}"], ref["module16"][t["name"]][g])
            assert [r["data_rank"] for r in x["replicas"]] == group_of[x["ep_rank"]]
            masters = {t["name"]: ref["params"][t["name"]][g].flatten() for t in x["tensors"]}
            _check_replicas(x, masters, partitions)


@pytest.mark.parametrize("name", MOE)
def test_deepspeed_moe_experts_are_where_the_files_and_the_engines_ranks_say(parallel_fixtures, name):
    fx = parallel_fixtures[name]
    root, ref = _root(fx), _load(Path(fx["path"]) / "reference.pt")
    f = _facts(fx, "experts")
    _json_ready(f)
    assert (f["kind"], f["format"], f["zero_stage"]) == ("deepspeed_moe", "per_expert_files", fx["zero_stage"])
    assert (f["ep"], f["edp"], f["dp"]) == (fx["ep"], fx["world"] // fx["ep"], fx["world"])
    for want in fx["ranks"]:
        got = f["ranks"][want["rank"]]
        assert (got["data_rank"], got["ep_rank"], got["edp_rank"]) == (want["rank"], want["ep_rank"], want["edp_rank"])
    [layer] = f["layers"]
    assert {str(x["expert"]): x["ep_rank"] for x in layer["experts"]} == fx["expert_placement"]
    stage0 = fx["zero_stage"] == 0
    partitions = {} if stage0 else {r["data_rank"]: _fp32_partitions(root / r["optim_file"]) for r in f["ranks"]}
    expp = {e: _tensors(_load(p)) for e, p in ((int(re.search(r"expp_rank_(\d+)", p.name).group(1)), p)
                                               for p in (root / fx["tag"]).glob("expp_rank_*"))}
    assert bool(expp) == stage0
    for x in layer["experts"]:
        g = x["expert"]
        names = [n for n in fx["expert_names"] if f"deepspeed_experts.{g}." in n]
        assert sorted(t["name"] for t in x["tensors"]) == sorted(names)
        file = root / x["file"]
        assert file.name == f"layer_0_expert_{g}_mp_rank_00_model_states.pt"
        sd = _load(file)
        assert sorted(sd) == sorted(x["keys"]) == sorted(names)
        for n in names:
            assert torch.equal(sd[n], ref["module16"][n])
        if stage0:  # the whole state of ep rank e in expp_rank_e, and in no other ep rank's file
            [state] = x["state_files"]
            assert state["file"].endswith(f"expp_rank_{x['ep_rank']}_mp_rank_00_optim_states.pt")
            for n in names:
                m = ref["states"]["exp_avg"][n]
                holders = {e for e, ts in expp.items() if any(t.shape == m.shape and torch.equal(t, m) for t in ts)}
                assert holders == {x["ep_rank"]}, n
        else:
            masters = {n: ref["params"][n].flatten() for n in names}
            _check_replicas(x, masters, partitions)


@pytest.mark.parametrize("family,name", [("autoep", "mixtral_z2_w2_ep2"), ("autoep", "mixtral_z3_w4_ep2"),
                                         ("parallel", "moe_ep2_z1_bf16")])
def test_a_universal_folders_experts_are_whole_in_its_zero_files(autoep_fixtures, parallel_fixtures, tmp_path,
                                                                 family, name):
    fx = (autoep_fixtures if family == "autoep" else parallel_fixtures)[name]
    ref = _load(Path(fx["path"]) / "reference.pt")
    out = Path(ckptlib.write_universal(fx["checkpoint_path"], tmp_path / "u").out)
    with ckptlib.open_checkpoint(out) as ckpt:
        f, g = meshmap.experts(ckpt), meshmap.grid(ckpt)
    _json_ready(f)
    assert g is None and f["format"] == "universal" and f["ranks"] == []
    assert f["ep"] == fx.get("ep_size", fx.get("ep"))
    root = out.resolve()
    for L in f["layers"]:
        for x in L["experts"]:
            assert x["file"] is None and x["replicas"] == [] and x["zero"]
            assert {(z["tensor"], z["key"]) for z in x["zero"]} == {(t["name"], k) for t in x["tensors"]
                                                                   for k in ("fp32", "exp_avg", "exp_avg_sq")}
            for z in x["zero"]:
                path = root / z["file"]
                assert path.parent.parent.name == "zero" and path.name == f"{z['key']}.pt"
                obj = _load(path)
                flat = (obj["param"] if isinstance(obj, dict) else obj).flatten()
                t = next(t for t in x["tensors"] if t["name"] == z["tensor"])
                want = ref["params"][z["tensor"]] if z["key"] == "fp32" else ref["states"][z["key"]][z["tensor"]]
                want = want[t["index"]] if t["index"] is not None else want
                assert z["count"] == want.numel() == t["numel"]
                assert torch.equal(flat[z["start"]:z["start"] + z["count"]], want.flatten().to(flat.dtype)), z


def test_no_experts_and_no_grid_where_they_do_not_apply(ds_fixtures, parallel_fixtures):
    fx = parallel_fixtures["ulysses_sp2_dp2_z2_bf16"]
    assert _facts(fx, "experts") is None and _facts(fx, "grid") is None
    fx = next(iter(ds_fixtures.values()))
    assert _facts(fx, "experts") is None and _facts(fx, "grid") is None
    fx = parallel_fixtures["pp2_dp2_z1_bf16"]
    assert _facts(fx, "experts") is None


# ============================================================================================== the grid
def _stored_tensor(root: Path, cell: dict, name: str, pipeline: bool):
    """The tensor rank's stored copy of ``name``: its layer file's entry (pipeline) or its model-states module's;
    None where no file holds it whole (ZeRO-3 placeholders, a tied layer's alias)."""
    if pipeline:
        head, _, key = name.partition(".")
        for layer in cell["layers"]:
            if head.isdigit() and int(head) == layer["layer"]:
                return _load(root / layer["file"]).get(key)
        return None
    module = _load(root / cell["model_states"][0]).get("module") or {}
    t = module.get(name)
    return t if t is not None and t.numel() else None


@pytest.mark.parametrize("name", GRID)
def test_the_grid_names_each_ranks_files_layers_and_slices(parallel_fixtures, name):
    fx = parallel_fixtures[name]
    root, tag = _root(fx), _root(fx) / fx["tag"]
    on_disk = sorted(p.name for p in tag.iterdir() if p.is_file())
    layer_files = [n for n in on_disk if n.startswith("layer_") and "expert" not in n]
    tp = fx.get("tp") or 1
    pp = fx.get("pp") or 1
    dp = fx["dp"]
    f = _facts(fx, "grid")
    if pp * tp == 1 and not layer_files:
        assert f is None
        return
    _json_ready(f)
    pipeline = bool(layer_files)
    assert (f["pp"], f["tp"], f["dp"]) == (pp, tp, dp)
    assert f["kind"] == ("pipeline" if pipeline else "tensor_parallel")
    want_cells = {(s if pipeline else None, t if tp > 1 else None) for s in range(pp) for t in range(tp)}
    assert {(c["stage"], c["tp_rank"]) for c in f["cells"]} == want_cells
    ref = _load(Path(fx["path"]) / "reference.pt")
    for c in f["cells"]:
        mp = (c["stage"] or 0) * tp + (c["tp_rank"] or 0)
        assert c["mp_rank"] == mp
        for m in c["model_states"]:
            assert (root / m).is_file() and re.search(rf"(^|/|_)mp_rank_{mp:02d}_model_states\.pt$", m)
        assert c["model_states"]
        assert [d["dp_rank"] for d in c["data"]] == list(range(dp))
        for d in c["data"]:
            want = [n for n in on_disk if re.fullmatch(rf"(bf16_|fp16_)?zero_pp_rank_{d['dp_rank']}_mp_rank_{mp:02d}"
                                                       r"_optim_states\.pt", n)]
            assert (d["file"].rsplit("/", 1)[-1] if d["file"] else None) == (want[0] if want else None)
            if d["file"] and d["partitions"]:  # the sizes the file itself holds
                stored = [p.numel() for p in _fp32_partitions(root / d["file"])]
                assert [p["stored"] for p in d["partitions"]] == stored
                assert all(p["elements"] >= p["stored"] for p in d["partitions"])
                assert d["elements"] == sum(p["elements"] for p in d["partitions"])
        # the layer files this stage and tensor rank hold: the pipeline's own parts
        for layer in c["layers"]:
            m = re.search(r"layer_(\d+)(-model_(\d+))?-model_states\.pt$", layer["file"])
            assert int(m.group(1)) == layer["layer"] and (int(m.group(3)) if m.group(3) else None) == c["tp_rank"]
            parts = fx["pipeline_parts"]
            assert parts[c["stage"]] <= layer["layer"] < parts[c["stage"] + 1]
            keys = list(_load(root / layer["file"]))
            assert len(keys) == len(layer["tensors"])
            if not any(t.startswith("tied_modules.") for t in layer["tensors"]):
                assert sorted(layer["tensors"]) == sorted(f"{layer['layer']}.{k}" for k in keys)
    if pipeline:
        listed = {(x["layer"], x["tp_rank"]): x for x in f["layers"]}
        assert sorted(x["file"].rsplit("/", 1)[-1] for x in f["layers"]) == sorted(layer_files)
        for x in f["layers"]:
            if x["stage"] is None:  # a layer without state: its file is empty, no stage records it
                assert x["tensors"] == [] and _load(root / x["file"]) == {}
        assert all(any(y["layer"] == x["layer"] for c in f["cells"] for y in c["layers"])
                   for x in listed.values() if x["stage"] is not None)
    if not any(c["tensors"] for c in f["cells"]):
        assert "noinfo" in name and any("not known" in n for n in f["notes"])
        return
    _check_slices(fx, f, root, ref, pipeline)


def _check_slices(fx, f: dict, root: Path, ref: dict, pipeline: bool) -> None:
    """Within each stage, the blocks of each tensor cover it exactly once; each slice is the reference's slice
    of the tensor, bit for bit, in the tensor rank's own file; replicated tensors are held whole by every copy."""
    split_dims = fx.get("split_dims") or {}
    shard_shapes = fx.get("tp_shard_shapes") or {}
    replicated = set(fx.get("replicated") or [])
    compared = 0
    for stage in {c["stage"] for c in f["cells"]}:
        cells = [c for c in f["cells"] if c["stage"] == stage]
        by_name: dict = {}
        for c in cells:
            for t in c["tensors"]:
                by_name.setdefault(t["name"], []).append((c, t))
        for name, held in by_name.items():
            shape = held[0][1]["shape"]
            cover = torch.zeros(shape, dtype=torch.int32)
            for c, t in held:
                assert t["shape"] == shape and t["boxes"]
                if not t["replicated"]:
                    for box in t["boxes"]:
                        cover[tuple(slice(lo, hi) for lo, hi in box)] += 1
                else:
                    assert t["whole"] and c["mp_rank"] in t["copies"]
            if not held[0][1]["replicated"]:
                assert bool((cover == 1).all()), f"{name}: the slices do not cover it exactly once"
            else:
                assert {c["mp_rank"] for c, _ in held} <= set(held[0][1]["copies"])
            if name in split_dims:  # AutoTP's record of how each tensor is split
                want = split_dims[name]
                assert all(t["replicated"] if want is None else t["dim"] == want for _, t in held), name
            if name in replicated:
                assert all(t["replicated"] for _, t in held), name
            for c, t in held:
                if name in shard_shapes and c["tp_rank"] is not None:
                    assert t["local_shape"] == list(shard_shapes[name][c["tp_rank"]]), name
                if fx.get("zero_stage") == 3:
                    continue
                stored = _stored_tensor(root, c, name, pipeline)
                full = ref["module16"].get(name)
                if stored is None or full is None or len(t["boxes"]) != 1:
                    continue
                assert list(stored.shape) == t["local_shape"], name
                box = t["boxes"][0]
                want = full[tuple(slice(lo, hi) for lo, hi in box)]
                got = stored[tuple(slice(0, hi - lo) for lo, hi in box)]
                assert torch.equal(got, want.to(got.dtype)), f"{name} on {c['label']}"
                compared += 1
                if "padded" in t:  # a padded vocabulary: the rank stores its rows of the padded tensor
                    lo, hi = t["padded"]["range"]
                    assert stored.shape[t["dim"]] == hi - lo and full.shape[t["dim"]] == t["padded"]["shape"][t["dim"]]
    assert compared or fx.get("zero_stage") == 3  # the slices were compared with the files' own values


# ============================================================================================== pictures
@pytest.mark.parametrize("family,name,kind", [("autoep", "mixtral_z2_w4_ep2", "experts"),
                                              ("autoep", "mixtral_z3_w4_ep2", "experts"),
                                              ("parallel", "moe_ep2_z1_bf16", "experts"),
                                              ("parallel", "pp2_tp2_dp2_z1_bf16", "grid"),
                                              ("parallel", "tp2_dp2_z1_bf16", "grid"),
                                              ("parallel", "autotp_tp2_dp2_z3_bf16", "grid")])
def test_the_pictures_carry_describes_facts(autoep_fixtures, parallel_fixtures, family, name, kind):
    fx = (autoep_fixtures if family == "autoep" else parallel_fixtures)[name]
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ckpt:
        d = ckptlib.describe(ckpt)
        pictures = [experts_picture(ckpt), grid_picture(ckpt)]
    pictures += [experts_picture(d), grid_picture(d), experts_picture(d["placement"]), grid_picture(d["placement"])]
    for p in pictures:
        want = d["placement"][p.kind]
        assert p.facts == want
        [(k, facts)] = facts_in_html(p.html())
        assert k == p.kind and facts == json.loads(json.dumps(want))
        assert p.png.startswith(b"\x89PNG")
        assert (want is None) == (p.kind != kind)
    mine = next(p for p in pictures if p.kind == kind)
    f = d["placement"][kind]
    if kind == "experts":
        assert f"ep {f['ep']} x expert-data-parallel {f['edp']}" in mine.caption
    else:
        assert f"{f['pp']} stage(s) x {f['tp']} tensor rank(s) x {f['dp']} data rank(s)" in mine.caption


def test_large_meshes_are_summarised_and_keep_every_fact(autoep_fixtures, parallel_fixtures):
    """64 experts on 8 ep ranks over 24 layers, and 8 stages: the figures stay a readable size (rows of consecutive
    experts, one summary line for many data ranks) and carry the facts whole. The large facts are made from a real
    fixture's by its own rule (expert g on ep rank g // 8)."""
    f = _facts(autoep_fixtures["mixtral_z2_w4_ep2"], "experts")
    proto = f["layers"][0]["experts"][0]
    layers = []
    for L in range(24):
        xs = []
        for g in range(64):
            x = copy.deepcopy(proto)
            x.update(expert=g, ep_rank=g // 8, local=g % 8,
                     replicas=[{"data_rank": g // 8 + 8 * k, "edp_rank": k, "file": None, "elements": 1}
                               for k in range(2)])
            xs.append(x)
        layers.append(dict(f["layers"][0], layer=L, num_experts=64, num_local=8, experts=xs))
    big = dict(f, ep=8, edp=2, dp=16, layers=layers,
               ep_ranks=[{"ep_rank": e, "data_ranks": [e, e + 8], "experts": []} for e in range(8)])
    p = experts_picture(big)
    assert p.facts is big and sum(len(L["experts"]) for L in p.facts["layers"]) == 64 * 24
    w, h = p.figure.get_size_inches()
    assert w <= 18 and h <= 12
    [ax] = p.figure.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) <= MAX_ROWS and labels[0] == "experts 0–3" and labels[-1] == "experts 60–63"
    assert "23 more layer(s)" in p.figure.get_suptitle()
    g = _facts(parallel_fixtures["pp2_dp2_z1_bf16"], "grid")
    cells = []
    for s in range(8):
        c = copy.deepcopy(g["cells"][s % 2])
        c.update(stage=s, mp_rank=s, label=f"stage {s}", data=[dict(c["data"][0], dp_rank=k) for k in range(8)])
        cells.append(c)
    big = dict(g, pp=8, dp=8, cells=cells)
    p = grid_picture(big)
    assert p.facts is big
    w, h = p.figure.get_size_inches()
    assert w <= 18 and h <= 8 * 1.6 + 1 and math.isfinite(h)
    assert len(p.png) > 1000
