"""``ckpt average`` (issue 39, part 2): averages of real tags of one run, written by DeepSpeed 0.19.8 on CPU
(tests/fixtures/average: ZeRO-2 and ZeRO-3 bf16 at 2 ranks, ZeRO-2 bf16 at 3, tags global_step1..3, each with the
masters the live engine held before its save), against torch's float64 computation rounded to fp32, bit for bit:

    acc = w_1 * x_1.double();  acc = acc + w_i * x_i.double()  (i = 2..N, in order);  out = acc.float()

for uniform weights (1/N), given ones and EMA (the explicit weights the docs define); the HF layouts (safetensors and
torch, bf16, shards), ``--format deepspeed`` loaded by DeepSpeed with the averaged masters and the last tag's
optimizer state and step, then one more training step; plans, ``--verify`` and its failures, the refusals, memory,
the notebook cell.
"""
from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

import ckptlib
from tests.cli import assert_refused, run_cli

NAMES = ("avg_z2_bf16_w2", "avg_z3_bf16_w2")
GIVEN = (0.2, 0.3, 0.5)
DECAY = 0.9


@pytest.fixture(scope="module")
def avg_fixtures() -> dict:
    from tests.fixtures.average.factory import ensure_fixtures, list_fixtures

    return {fx["name"]: fx for fx in list_fixtures(ensure_fixtures(verbose=False))}


def tag_dirs(fx: dict, tags=None) -> list[Path]:
    return [Path(fx["checkpoint_path"]) / t for t in (tags or fx["tags"])]


def reference(fx: dict, tag: str) -> dict:
    return torch.load(Path(fx["path"]) / fx["extras"]["references"][tag], map_location="cpu", weights_only=False)


def ema_weights(n: int, d: float) -> list[float]:
    """The EMA's explicit weights as docs/average.md defines them: w_1 = d^(N-1), w_i = (1-d) d^(N-i), the powers by
    repeated float64 multiplication."""
    def power(k: int) -> float:
        p = 1.0
        for _ in range(k):
            p = p * d
        return p

    return [power(n - 1)] + [(1.0 - d) * power(n - i) for i in range(2, n + 1)]


def torch_average(xs: list, ws: list) -> torch.Tensor:
    """torch's float64 computation, in the order given, rounded to fp32 (separate multiply and add: no fused op)."""
    acc = ws[0] * xs[0].double()
    for w, x in zip(ws[1:], xs[1:]):
        acc = acc + w * x.double()
    return acc.float()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def expected(refs: list, ws: list) -> dict:
    """{trainable parameter: the torch average of the references' masters}."""
    return {n: torch_average([r["fp32"][n] for r in refs], ws) for n in refs[-1]["fp32"]}


def tied(fx: dict) -> dict:
    return {p["name"]: p["tied_to"] for p in fx["parameters"] if p["tied_to"]}


def weight_args(kind: str, n: int) -> tuple[list, list]:
    """(CLI arguments, the weights) of a weighting."""
    if kind == "uniform":
        return [], [1.0 / n] * n
    if kind == "given":
        ws = list(GIVEN[:n]) if n == 3 else [0.25, 0.75]
        return ["--weights", ",".join(map(str, ws))], ws
    return ["--ema", str(DECAY)], ema_weights(n, DECAY)


def read_safetensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ============================================================================================ the HF layout
@pytest.mark.parametrize("kind", ["uniform", "given", "ema"])
@pytest.mark.parametrize("name", NAMES)
def test_average_of_three_tags_equals_torch_float64_rounded_to_fp32(avg_fixtures, tmp_path, name, kind):
    fx = avg_fixtures[name]
    refs = [reference(fx, t) for t in fx["tags"]]
    args, ws = weight_args(kind, 3)
    out = tmp_path / "avg"
    code, stdout, err = run_cli("average", *tag_dirs(fx), out, *args, "--verify")
    assert code == 0, stdout + err
    assert "verified:" in stdout and "FAIL" not in stdout
    got = read_safetensors(out)
    want = expected(refs, ws)
    for n, w in want.items():
        assert same_bits(got[n], w), n
    for alias, owner in tied(fx).items():
        assert same_bits(got[alias], want[owner]), alias
    last = refs[-1]
    for n, b in last["buffers"].items():  # the last tag's, as stored (floating ones written fp32)
        assert torch.equal(got[n], b.float() if b.is_floating_point() else b), n
    for n, f in last["frozen"].items():
        assert same_bits(got[n], f.float()), n
    # the averages are not any one tag's masters
    assert any(not same_bits(want[n], last["fp32"][n]) for n in want)


@pytest.mark.parametrize("kind", ["uniform", "given", "ema"])
def test_a_pair_at_different_dp_sizes_equals_torch(avg_fixtures, tmp_path, kind):
    """A tag saved at 2 ranks and one at 3 (the same model, ZeRO-2): each read at its own mesh."""
    a, b = avg_fixtures["avg_z2_bf16_w2"], avg_fixtures["avg_z2_bf16_w3"]
    refs = [reference(a, "global_step3"), reference(b, "global_step3")]
    args, ws = weight_args(kind, 2)
    out = tmp_path / "pair"
    code, stdout, err = run_cli("average", tag_dirs(a, ["global_step3"])[0], tag_dirs(b, ["global_step3"])[0], out,
                                *args, "--verify")
    assert code == 0, stdout + err
    got = read_safetensors(out)
    for n, w in expected(refs, ws).items():
        assert same_bits(got[n], w), n


def test_any_stage_and_mesh_in_one_average_and_the_torch_format_in_bf16_shards(avg_fixtures, tmp_path):
    """ZeRO-3 at 2 ranks, ZeRO-2 at 3 and at 2: ``--format torch --dtype bf16`` in shards, the fp32 average cast to
    bf16 as torch casts it; the index maps every tensor; the result equals the same average in one safetensors file
    cast by torch."""
    srcs = [(avg_fixtures["avg_z3_bf16_w2"], "global_step1"), (avg_fixtures["avg_z2_bf16_w3"], "global_step2"),
            (avg_fixtures["avg_z2_bf16_w2"], "global_step3")]
    refs = [reference(fx, t) for fx, t in srcs]
    out = tmp_path / "torch"
    code, stdout, err = run_cli("average", *[tag_dirs(fx, [t])[0] for fx, t in srcs], out, "--format", "torch",
                                "--dtype", "bf16", "--max-shard-size", "4KB", "--verify")
    assert code == 0, stdout + err
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    got = {}
    for f in files:
        got.update(torch.load(out / f, weights_only=True))
    for n, w in expected(refs, [1 / 3] * 3).items():
        assert same_bits(got[n], w.to(torch.bfloat16)), n
    assert set(index["weight_map"]) == set(got)


def test_chunks_do_not_change_the_result(avg_fixtures, tmp_path):
    """The same average streamed in chunks of 64 elements (each tensor over many chunks, ranges cut across them) and
    in the default 2 M: the same bytes."""
    fx = avg_fixtures["avg_z3_bf16_w2"]
    small = ckptlib.run(ckptlib.plan_average(tag_dirs(fx), tmp_path / "small", ema=DECAY, chunk_bytes=512))
    big = ckptlib.run(ckptlib.plan_average(tag_dirs(fx), tmp_path / "big", ema=DECAY))
    assert (small.out / "model.safetensors").read_bytes() == (big.out / "model.safetensors").read_bytes()


# ============================================================================================ --format deepspeed
@pytest.fixture(scope="module")
def deepspeed_outputs(avg_fixtures, tmp_path_factory) -> dict:
    """The three DeepSpeed outputs (written with --verify) and what DeepSpeed holds after loading each, then after one
    more step: ZeRO-2 (EMA) and ZeRO-3 (given weights) at 2 ranks in one launch, the pair (uniform) at 3 in another."""
    from tests.fixtures.load_runner import run_load_checks

    work = tmp_path_factory.mktemp("avg-ds")
    z2, z3, w3 = avg_fixtures["avg_z2_bf16_w2"], avg_fixtures["avg_z3_bf16_w2"], avg_fixtures["avg_z2_bf16_w3"]
    cases = {
        "z2-ema": (z2, tag_dirs(z2), ["--ema", str(DECAY)], ema_weights(3, DECAY), [reference(z2, t) for t in z2["tags"]]),
        "z3-given": (z3, tag_dirs(z3), ["--weights", "0.2,0.3,0.5"], list(GIVEN),
                     [reference(z3, t) for t in z3["tags"]]),
        "pair-w2-w3": (w3, [tag_dirs(z2, ["global_step3"])[0], tag_dirs(w3, ["global_step2"])[0]], [], [0.5, 0.5],
                       [reference(z2, "global_step3"), reference(w3, "global_step2")]),
    }
    out, jobs = {}, {}
    for key, (fx, srcs, args, ws, refs) in cases.items():
        target = work / key
        code, stdout, err = run_cli("average", *srcs, target, "--format", "deepspeed", *args, "--verify")
        out[key] = {"code": code, "stdout": stdout, "err": err, "dir": target, "weights": ws, "refs": refs, "fx": fx}
        if code == 0:
            jobs.setdefault(fx["world_size"], []).append({
                "name": key, "checkpoint_dir": str(target), "tag": None, "zero_stage": fx["zero_stage"],
                "dtype": fx["dtype"], "spec_name": fx["extras"]["spec_name"], "model_size": "small"})
    for world, js in jobs.items():
        for name, result in run_load_checks(js, world, work / f"load-w{world}", timeout=600).items():
            out[name]["load"] = result
    return out


@pytest.mark.parametrize("key", ["z2-ema", "z3-given", "pair-w2-w3"])
def test_the_deepspeed_output_loads_with_the_averaged_masters_and_steps_on(deepspeed_outputs, key):
    case = deepspeed_outputs[key]
    assert case["code"] == 0, case["stdout"] + case["err"]
    assert "verified:" in case["stdout"] and "FAIL" not in case["stdout"]
    result = case["load"]
    assert "error" not in result, result.get("error")
    loaded, after, last = result["loaded"], result["after_step"], case["refs"][-1]
    want = expected(case["refs"], case["weights"])
    assert loaded["fp32"].keys() == want.keys()
    assert any(not same_bits(w, last["fp32"][n]) for n, w in want.items())  # not the last tag's own masters
    for n, w in want.items():
        assert same_bits(loaded["fp32"][n], w), n
        assert same_bits(loaded["lp"][n], w.to(loaded["lp"][n].dtype)), n  # the 16-bit weights rounded from them
        for k in ("exp_avg", "exp_avg_sq"):  # the last tag's optimizer state
            assert same_bits(loaded["optim"][n][k], last["optim"][n][k]), (n, k)
    assert loaded["step"] == last["step"] and not loaded["optim_state_missing"]
    for n, b in last["buffers"].items():  # the load check perturbs them first: these were loaded
        assert torch.equal(loaded["buffers"][n], b), n
    for n, f in last["frozen"].items():
        assert same_bits(loaded["frozen"][n], f), n
    # one more step runs from there
    assert after["step"] == loaded["step"] + 1 and math.isfinite(after["loss"])
    assert after["global_steps"] == loaded["global_steps"] + 1
    assert any(not same_bits(after["fp32"][n], loaded["fp32"][n]) for n in want)


def test_the_deepspeed_output_is_the_last_tags_files_at_its_mesh(deepspeed_outputs):
    """The pair's output is at the last tag's mesh (3 ranks), named as its tag; the notes say what is the last tag's."""
    case = deepspeed_outputs["pair-w2-w3"]
    out = ckptlib.open_checkpoint(case["dir"])
    assert (out.location.tag, out.mesh.dp, out.zero_stage) == ("global_step2", 3, 2)
    src = sorted(p.name for p in (Path(case["fx"]["checkpoint_path"]) / "global_step2").iterdir())
    assert sorted(p.name for p in (case["dir"] / "global_step2").iterdir()) == src
    assert "the optimizer state (exp_avg, exp_avg_sq) and step (2)" in case["err"]
    assert "rounded to bf16" in case["err"] and "not carried" in case["err"]


# ============================================================================================ plans, verify
def test_the_plan_is_plain_data_with_every_sources_ranges_and_weight(avg_fixtures, tmp_path):
    fx = avg_fixtures["avg_z2_bf16_w2"]
    plan = ckptlib.plan_average(tag_dirs(fx), tmp_path / "p", weights=[1, 1, 2], normalize=True)
    assert isinstance(plan, ckptlib.AveragePlan) and plan.weights == (0.25, 0.25, 0.5)
    averaged = [t for t in plan.tensors if t.kind == "averaged"]
    n = sum(1 for p in fx["parameters"] if p["trainable"] and not p["tied_to"])
    assert len(plan.averaged) == n and len(averaged) == n + len(tied(fx))
    for t in averaged:
        assert [w for w, _ in t.terms] == [0.25, 0.25, 0.5]
        assert [Path(r[0].path).parent.name for _, r in t.terms] == fx["tags"]  # each source's own ranges
    again = pickle.loads(pickle.dumps(plan))
    assert again.to_dict() == plan.to_dict()
    export = ckptlib.plan_export(tag_dirs(fx)[0], tmp_path / "e")
    assert plan.predicted_peak_bytes == ckptlib.plan_export(tag_dirs(fx)[0], tmp_path / "e",
                                                            workers=1).predicted_peak_bytes
    one = sum(t.read_bytes for t in export.tensors)  # every source's masters, the last one's buffers and frozen ones
    # (plus the rest of the zip members it reads in part, read for their CRC-32 alone)
    assert plan.read_bytes - plan.crc_unread == 3 * one - 2 * sum(t.read_bytes for t in export.tensors
                                                                    if t.name in plan.from_last)
    code, stdout, err = run_cli("average", *tag_dirs(fx), tmp_path / "q", "--weights", "1,1,2", "--normalize",
                                "--plan", "--json")
    assert code == 0 and not (tmp_path / "q").exists(), err
    shown = json.loads(stdout)
    assert shown["weights"] == [0.25, 0.25, 0.5] and shown["sources"] == [str(p) for p in tag_dirs(fx)]
    code, stdout, err = run_cli("average", *tag_dirs(fx), tmp_path / "q", "--plan")
    assert code == 0 and "uniform: Σ (1/3)·x_i, not (Σ x_i)/3" in stdout and not (tmp_path / "q").exists()


def test_normalized_weights_equal_the_same_weights_given(avg_fixtures, tmp_path):
    fx = avg_fixtures["avg_z3_bf16_w2"]
    a = ckptlib.run(ckptlib.plan_average(tag_dirs(fx), tmp_path / "a", weights=[1, 1, 2], normalize=True))
    b = ckptlib.run(ckptlib.plan_average(tag_dirs(fx), tmp_path / "b", weights=[0.25, 0.25, 0.5]))
    assert (a.out / "model.safetensors").read_bytes() == (b.out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("fmt", ["safetensors", "deepspeed"])
def test_verify_finds_a_changed_average(avg_fixtures, tmp_path, fmt):
    """A flipped bit in an averaged tensor (a master partition of the DeepSpeed output) fails --verify, naming it."""
    fx = avg_fixtures["avg_z2_bf16_w2"]
    plan = ckptlib.plan_average(tag_dirs(fx), tmp_path / "v", format=fmt)
    ckptlib.run(plan)
    assert ckptlib.verify(plan).ok
    if fmt == "safetensors":
        t = next(t for t in plan.tensors if t.name == "fc1.weight")
        from ckptlib.io.stformat import read_header

        path = plan.out / "model.safetensors"
        _, tensors = read_header(path)
        at = next(x.offset for x in tensors if x.name == t.name) + 4 * 7
    else:
        out = ckptlib.open_checkpoint(plan.out)
        r = out.sources("fc1.weight")[0]
        path, at = Path(r.path), r.offset + 4 * 7
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(data)
    checked = ckptlib.verify(plan)
    assert not checked.ok
    bad = [c for c in checked.checks if not c.ok]
    assert any("fc1.weight" in c.bad for c in bad), checked.describe()


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "deepspeed"])
def test_a_flipped_byte_in_a_source_is_refused_by_its_crc(avg_fixtures, tmp_path, fmt):
    """Issue 40 for averages: the CRC-32 of every zip member a source gives bytes from is checked as they stream; a
    flipped byte in the middle tag's master partition stops the run (exit 2, the file and the entry named) and leaves
    no output; with --no-verify-crc the same run writes."""
    import shutil

    fx = avg_fixtures["avg_z2_bf16_w2"]
    copy = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], copy)
    tags = [copy / t for t in fx["tags"]]
    r = ckptlib.open_checkpoint(tags[1]).sources("fc1.weight")[0]
    data = bytearray(Path(r.path).read_bytes())
    data[r.offset + 5] ^= 0x01
    Path(r.path).write_bytes(data)
    code, out, err = run_cli("average", *tags, tmp_path / "out", "--format", fmt)
    assert_refused(code, out, err, ["CRC-32", Path(r.path).name, "zip entry"], tmp_path / "out")
    assert not list(tmp_path.glob(".out*"))
    code, out, err = run_cli("average", *tags, tmp_path / "unchecked", "--format", fmt, "--no-verify-crc")
    assert code == 0 and (tmp_path / "unchecked").is_dir(), out + err


# ============================================================================================ refusals
def test_refusals_name_what_is_wrong(avg_fixtures, ds_fixtures, tmp_path):
    fx = avg_fixtures["avg_z2_bf16_w2"]
    a, b, c = tag_dirs(fx)
    out = tmp_path / "r"
    cases = [
        ((a, out), ["two or more checkpoints"]),
        ((a, b, out, "--weights", "0.2,0.3"), ["the weights sum to 0.5, not 1", "--normalize"]),
        ((a, b, c, out, "--weights", "0.2,0.3"), ["2 weights for 3 checkpoints"]),
        ((a, b, out, "--weights", "0.5,x"), ["--weights takes numbers"]),
        ((a, b, out, "--weights=-0.5,1.5"), ["a weight must be a finite number of 0 or more"]),
        ((a, b, out, "--ema", "1.5"), ["the EMA decay must lie in [0, 1]"]),
        ((a, b, out, "--ema", "0.9", "--weights", "0.5,0.5"), ["--weights or --ema, not both"]),
        ((a, b, out, "--normalize"), ["--normalize divides the weights given with --weights"]),
        ((a, a, out), ["global_step1 is given twice"]),
        ((a, ds_fixtures["large_w2"]["checkpoint_path"], out),
         ["not checkpoints of one run: embed.weight is [67, 33] in source 1", "[8209, 257] in source 2"]),
        ((a, ds_fixtures["exclude_frozen_w2"]["checkpoint_path"], out),
         ["not checkpoints of one run", "has no parameter frozen.weight, which source 1"]),
        ((a, ds_fixtures["z0_bf16_w2"]["checkpoint_path"], out, "--format", "deepspeed"),
         ["--format deepspeed writes data-parallel ZeRO-1/2/3 checkpoints", "no ZeRO partitions"]),
        ((a, b, out, "--format", "deepspeed", "--dtype", "bf16"), ["leave out --dtype"]),
        ((a, b, a / "inside"), ["inside the source"]),
    ]
    for args, words in cases:
        assert_refused(*run_cli("average", *args), words, out)
    assert not (a / "inside").exists()  # nothing written into a source


def test_a_source_of_another_stage_and_dtype_is_averaged_when_it_holds_the_same_model(avg_fixtures, ds_fixtures,
                                                                                       tmp_path):
    """The stage-0 fp32 run of the main family (same FixtureNet) first, a ZeRO-2 tag last: exact too."""
    z0, fx = ds_fixtures["z0_fp32_w2"], avg_fixtures["avg_z2_bf16_w2"]
    refs = [torch.load(Path(z0["path"]) / "reference.pt", weights_only=False), reference(fx, "global_step2")]
    plan = ckptlib.plan_average([z0["checkpoint_path"], tag_dirs(fx, ["global_step2"])[0]], tmp_path / "m",
                                weights=[0.75, 0.25])
    ckptlib.run(plan)
    got = read_safetensors(plan.out)
    for n, w in expected(refs, [0.75, 0.25]).items():
        assert same_bits(got[n], w), n


# ============================================================================================ memory
def test_memory_is_the_streaming_buffers_whatever_the_number_of_sources(avg_fixtures, tmp_path):
    """Two and three sources, 1 MiB chunks: each run adds at most the predicted peak (three buffers + allowance), the
    same prediction as an export's; the arithmetic holds nothing per source."""
    fx = avg_fixtures["avg_z2_bf16_w2"]
    for n in (2, 3):
        plan = ckptlib.plan_average(tag_dirs(fx)[:n], tmp_path / f"m{n}", chunk_bytes=2**20)
        assert plan.predicted_peak_bytes == ckptlib.plan_export(tag_dirs(fx)[0], tmp_path / "e",
                                                                chunk_bytes=2**20, workers=1).predicted_peak_bytes
        result = ckptlib.run(plan)
        assert result.memory.peak_added <= plan.predicted_peak_bytes, result.memory


# ============================================================================================ the notebook
def test_the_notebook_cell_averages_the_tags_given_and_says_when_there_is_one(avg_fixtures, tmp_path):
    pytest.importorskip("papermill")
    nbformat = pytest.importorskip("nbformat")
    from tests.kernels import execute_notebook

    fx = avg_fixtures["avg_z2_bf16_w2"]
    nb = Path(__file__).resolve().parents[1] / "notebooks" / "05_health_and_diff.ipynb"
    params = nbformat.read(nb, as_version=4).cells
    assert sum("average_dirs = None" in c.source for c in params if "parameters" in c.metadata.get("tags", [])) == 1
    executed = tmp_path / "05.ipynb"
    execute_notebook(nb, executed, {
        "checkpoint_dir": str(tag_dirs(fx)[-1]), "output_dir": str(tmp_path / "output"), "other_dir": None,
        "average_dirs": [str(p) for p in tag_dirs(fx)]})
    cells = nbformat.read(executed, as_version=4).cells
    assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for c in cells if "plan_average" in c.source for o in c.get("outputs", []))
    assert "average of 3 checkpoints" in text and "weights: uniform" in text
    assert "verified: " in text and "FAIL" not in text
    got = read_safetensors(tmp_path / "output" / "average")
    want = expected([reference(fx, t) for t in fx["tags"]], [1 / 3] * 3)
    assert all(same_bits(got[n], w) for n, w in want.items())
