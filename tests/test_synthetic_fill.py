"""``bench/make_synthetic_checkpoint.py --fill random`` writes a checkpoint DeepSpeed itself reads.

The 30 GB benchmark (``bench/scale_bench.py``) runs on a checkpoint of that generator with real tensor bytes;
its format is proven here on a small one of the same generator and option (a tiny Llama-shaped model at 3
ranks, ZeRO-3 bf16, and ZeRO-2 for ``zero_to_fp32``):

- every zip member's CRC-32 is right (``zipfile.testzip``), ``torch.load`` reads every file, every value is
  finite and the tensors are not zeros;
- DeepSpeed's ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``) gives exactly the values the
  generator meant (:func:`param_bits`) and exactly what ``ckpt export`` writes;
- a DeepSpeed engine at the checkpoint's world size (3 ranks, CPU, gloo) loads it with ``load_checkpoint``
  and then holds exactly those fp32 masters, ``exp_avg`` and ``exp_avg_sq``, bf16 weights that are their
  rounding, and the step.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.fixtures.torchrun import log_tail, torchrun

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("make_synthetic_checkpoint", REPO / "bench" / "make_synthetic_checkpoint.py")
synth = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = synth  # dataclasses look their module up
spec.loader.exec_module(synth)

TINY = dict(layers=2, hidden=64, intermediate=96, vocab=50, heads=4, kv_heads=2)
RANKS, STEP, SEED = 3, 2, 7  # 3: ZeRO-3 partitions with padding


def expected(kind: int) -> dict:
    """{name: the fp32 tensor the generator meant for each parameter's stream ``kind``}."""
    out = {}
    for i, (n, s, _) in enumerate(synth.llama_params(**TINY)):
        bits = synth.param_bits(SEED, i, kind, 0, math.prod(s))
        out[n] = torch.from_numpy(bits.view("float32").copy()).view(s)
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthfill")
    out = {}
    for stage in (2, 3):
        out[stage] = root / f"z{stage}"
        info = synth.make(out[stage], stage, RANKS, step=STEP, fill="random", seed=SEED, **TINY)
        assert info["allocated_bytes"] >= info["apparent_bytes"] * 0.9  # real bytes, not holes
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


def test_crcs_torch_load_and_finite_values(made):
    for stage, root in made.items():
        files = sorted((root / f"global_step{STEP}").glob("*.pt"))
        assert len(files) == (2 * RANKS if stage == 3 else RANKS + 1)
        for f in files:
            with zipfile.ZipFile(f) as z:
                assert z.testzip() is None, f
            sd = torch.load(f, map_location="cpu", weights_only=False)
            stack, floats = [sd], []
            while stack:
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    if o.is_floating_point() and o.numel():
                        floats.append(o)
                elif isinstance(o, dict):
                    stack += list(o.values())
                elif isinstance(o, (list, tuple)):
                    stack += list(o)
            if "optim" in f.name or stage == 2:
                assert floats and all(torch.isfinite(t).all() for t in floats), f
                assert any(t.abs().max() > 0 for t in floats), f


def test_zero_to_fp32_gives_the_generators_values_and_ckpt_export_the_same(made, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from tests.cli import run_cli

    want = expected(synth.MASTER)
    for stage, root in made.items():
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(root))
        assert sorted(theirs) == sorted(want)
        for n, v in want.items():
            assert bits_equal(theirs[n].detach(), v), (stage, n)
        out = tmp_path / f"export{stage}"
        code, so, se = run_cli("export", root, out, "-q")
        assert code == 0, so + se
        ours = {}
        for f in sorted(out.glob("*.safetensors")):
            ours.update(load_file(f))
        assert sorted(ours) == sorted(want)
        for n, v in want.items():
            assert bits_equal(ours[n], theirs[n].detach()), (stage, n)


LOAD = r'''
import json, sys
import torch
from tests.fixtures.launch import finish, start

deepspeed = start()
import torch.distributed as tdist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

job = json.loads(open(sys.argv[1]).read())
root = torch.nn.Module()
groups = ([], [])
for name, shape, group in job["params"]:  # named_parameters order = the checkpoint's
    *path, leaf = name.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    param = torch.nn.Parameter(torch.zeros(shape))
    mod.register_parameter(leaf, param)
    groups[group].append(param)
hyper = dict(lr=1e-5, betas=(0.9, 0.95), eps=1e-8)
optimizer = torch.optim.AdamW([{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}],
                              **hyper)
engine, _, _, _ = deepspeed.initialize(model=root, optimizer=optimizer, config=job["config"])
path, _ = engine.load_checkpoint(job["checkpoint"])
assert path is not None, "load_checkpoint loaded nothing"
out = {"global_steps": engine.global_steps, "optimizer": type(engine.optimizer).__name__, "params": {}}
for name, p in root.named_parameters():
    with deepspeed.zero.GatheredParameters([p]):
        bf16 = p.data.detach().clone()
    out["params"][name] = {"bf16": bf16, "fp32": safe_get_full_fp32_param(p).detach().clone(),
                           **{k: safe_get_full_optimizer_state(p, k).detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
steps = {float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s}
out["optimizer_steps"] = sorted(steps)
if tdist.get_rank() == 0:
    torch.save(out, job["out"])
sys.exit(finish())
'''


def test_deepspeed_engine_loads_it_at_its_world_size(made, tmp_path):
    pytest.importorskip("deepspeed")
    root = made[3]
    script = tmp_path / "load_synthetic.py"
    script.write_text(LOAD)
    job = {"checkpoint": str(root), "out": str(tmp_path / "loaded.pt"), "config": synth.ds_config(3, RANKS),
           "params": [[n, list(s), g] for n, s, g in synth.llama_params(**TINY)]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    log = tmp_path / "load.log"
    rc = torchrun(script, RANKS, [str(tmp_path / "job.json")], log, timeout=300)
    assert rc == 0 and (tmp_path / "loaded.pt").is_file(), log_tail(log)
    got = torch.load(tmp_path / "loaded.pt", weights_only=False)
    assert got["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert got["global_steps"] == STEP and got["optimizer_steps"] == [float(STEP)]
    want = {k: expected(k) for k in (synth.MASTER, synth.EXP_AVG, synth.EXP_AVG_SQ)}
    assert list(got["params"]) == list(want[synth.MASTER])
    for n, held in got["params"].items():
        fp32 = want[synth.MASTER][n]
        assert bits_equal(held["fp32"].view(fp32.shape), fp32), n
        assert bits_equal(held["exp_avg"].view(fp32.shape), want[synth.EXP_AVG][n]), n
        assert bits_equal(held["exp_avg_sq"].view(fp32.shape), want[synth.EXP_AVG_SQ][n]), n
        assert bits_equal(held["bf16"].view(fp32.shape), fp32.to(torch.bfloat16)), n
