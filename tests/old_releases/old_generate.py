"""Write FixtureNet checkpoints with an OLD DeepSpeed release (run inside that release's throw-away venv).

    DS_ACCELERATOR=cpu LOCAL_SIZE=1 CKPTLIB_DS_PATCHES=a,b,c PYTHONPATH=<repo> \\
        torchrun --standalone --nproc_per_node W tests/old_releases/old_generate.py --out DIR

(normally launched by make_old_fixtures.py). One launch makes every configuration of
``releases.configs(<installed deepspeed>)`` whose world size is W. Each ends up in ``DIR/<name>/``:

* the DeepSpeed save dir: ``ckpt/`` (``engine.save_checkpoint(ckpt)``) or, for the HF-Trainer layout,
  ``checkpoint-2/`` (what the Trainer does: ``save_checkpoint(checkpoint-2)`` with the default tag);
* ``reference.pt``: fp32 masters, Adam moments and step gathered from the live engine's optimizer
  internals (all-gather of the flat fp32 partitions cut by the group order, never
  ``safe_get_full_fp32_param``), the frozen 16-bit weights, the persistent buffers. Every fp32 master must
  round to the engine's 16-bit module weight bit for bit, or the script fails;
* ``fixture.json``: the schema of tests/fixtures/generate.py, plus in ``extras`` the cross-checks with the
  release's own ``safe_get_full_fp32_param`` and its own ``zero_to_fp32`` (recorded, not required).

It reuses tests/fixtures/model.py and the torch-only helpers of tests/fixtures/generate.py; generate.py
itself is left alone (its hash keys the 0.19.8 fixture cache).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn.functional as F

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.fixtures import generate as g19  # noqa: E402  (torch-only helpers of the 0.19.8 generator)
from tests.fixtures.model import build_model, make_batch, param_groups  # noqa: E402
from tests.old_releases.ds_compat import import_deepspeed  # noqa: E402
from tests.old_releases.releases import configs  # noqa: E402

SEED = g19.SEED
DTYPES = g19.DTYPES
NO_GRAD_STEP = os.environ.get("CKPTLIB_DS_NO_GRAD_STEP") == "1"
_TORCH_LINEAR = torch.nn.functional.linear


class FixtureError(RuntimeError):
    pass


def log(msg):
    if tdist.get_rank() == 0:
        print(f"[old-gen w{tdist.get_world_size()}] {msg}", flush=True)


def make_spec(cfg) -> "g19.Spec":
    return g19.Spec(cfg["name"], cfg["stage"], cfg["dtype"], layout=cfg["layout"])


def train_steps(engine, stage, n_steps, vocab):
    rank = tdist.get_rank()
    losses = []
    for _ in range(n_steps):
        step = engine.global_steps
        ids, tgt = make_batch(seed=10_000 * (step + 1) + rank, batch=g19.MICRO_BATCH, seq=g19.SEQ, vocab=vocab)
        logits = engine(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        engine.backward(loss)
        if NO_GRAD_STEP and stage in (1, 2):
            with torch.no_grad():
                engine.step()
        else:
            engine.step()
        losses.append(float(loss.detach()))
    if engine.skipped_steps != 0:
        raise FixtureError(f"skipped_steps = {engine.skipped_steps}")
    return losses


def independent_reference(engine, names):
    """generate.independent_hp, after giving old ZeRO-1/2 optimizers the offsets it expects.

    Before 0.19.6 DeepSpeedZeroOptimizer has no ``round_robin_bit16_offsets``: the flat group is the
    params of ``round_robin_bit16_groups[i]`` back to back (no round-robin is configured here, and
    there is no per-parameter alignment), so the offsets are cumulative element counts. The bit-exact
    check against the 16-bit module weights that follows catches any error in that assumption.
    """
    opt = engine.optimizer
    if type(opt).__name__ == "DeepSpeedZeroOptimizer" and not hasattr(opt, "round_robin_bit16_offsets"):
        offsets = []
        for group in opt.round_robin_bit16_groups:
            pos, offs = 0, []
            for p in group:
                offs.append(pos)
                pos += p.numel()
            offsets.append(offs)
        opt.round_robin_bit16_offsets = offsets
        how_extra = " (offsets: cumulative numel, old release)"
    else:
        how_extra = ""
    fp32, optim, step, how = g19.independent_hp(engine, names)
    return fp32, optim, step, how + how_extra


def gather_reference(deepspeed, engine, spec):
    model = engine.module
    names = {p: n for n, p in model.named_parameters()}
    model_dtype = DTYPES[spec.dtype]
    info = {}
    fp32, optim, step, how = independent_reference(engine, names)
    info["reference_source"] = how
    lp = g19.lp_weights(deepspeed, engine, model, spec.stage)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen_names = [n for n, p in model.named_parameters() if not p.requires_grad]
    if sorted(fp32) != sorted(trainable):
        raise FixtureError(f"{spec.name}: reference params {sorted(fp32)} != trainable {sorted(trainable)}")
    bad = [n for n in trainable if lp[n].dtype != model_dtype or not g19.bits_equal(fp32[n].to(model_dtype), lp[n])]
    if bad:
        raise FixtureError(f"{spec.name}: fp32 reference does not round to the module weights for {bad}")
    info["reference_rounds_to_module_weights"] = True

    # cross-check (recorded only): the release's own safe_get_full_fp32_param / optimizer state
    try:
        safe_fp32, safe_optim = g19.safe_get_hp(deepspeed, engine, model, info)
        if safe_fp32 is None:
            info["safe_get_full_fp32_param"] = "returned None"
        else:
            diff_w = [n for n in trainable if not g19.bits_equal(safe_fp32[n], fp32[n])]
            diff_o = [n for n in trainable for k in ("exp_avg", "exp_avg_sq")
                      if not g19.bits_equal(safe_optim[n][k], optim[n][k])]
            info["safe_get_full_fp32_param"] = "matches" if not diff_w else f"differs for {diff_w}"
            info["safe_get_full_optimizer_state"] = "matches" if not diff_o else f"differs for {sorted(set(diff_o))}"
    except Exception as e:  # noqa: BLE001 - recorded, the reference does not depend on it
        info["safe_get_full_fp32_param"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        if tdist.get_world_size() > 1:
            tdist.barrier()

    expected = engine.global_steps - engine.skipped_steps
    if step == expected + 1:
        # old ZeRO-1/2 (and BF16_Optimizer) initialise the Adam state with one optimizer.step() on zero
        # gradients and keep its count: the saved step is one ahead of global_steps
        info["optimizer_step_note"] = f"Adam step {step} = global_steps + 1 (dummy step at initialisation)"
    elif step != expected:
        raise FixtureError(f"{spec.name}: optimizer step {step} != global_steps {engine.global_steps}")
    buffers = OrderedDict()
    persistent = g19.persistent_buffer_names(model)
    for n, b in model.named_buffers():
        if n in persistent:
            buffers[n] = g19.cpu_clone(b)
    ref = {
        "fp32": OrderedDict((n, fp32[n].float().contiguous()) for n in trainable),
        "frozen": OrderedDict((n, lp[n].clone()) for n in frozen_names),
        "buffers": buffers,
        "optim": OrderedDict((n, {k: v.float().contiguous() for k, v in optim[n].items()}) for n in trainable),
        "step": int(step),
    }
    return ref, info


def own_converter_check(save_dir: Path, ref: dict, module_names: list) -> dict:
    """What the release's own zero_to_fp32 gives against the reference (rank 0; recorded only)."""
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    out = {"ok": True}
    out["trainable_bit_exact"] = all(n in sd and torch.equal(sd[n].float(), w) for n, w in ref["fp32"].items())
    out["missing"] = sorted(n for n in module_names if n not in sd)
    out["frozen_equal"] = {n: bool(n in sd and torch.equal(sd[n].float(), w.float())) for n, w in ref["frozen"].items()}
    out["buffers_exact"] = {n: bool(n in sd and sd[n].dtype == b.dtype and torch.equal(sd[n], b))
                            for n, b in ref["buffers"].items()}
    out["buffer_dtypes"] = {n: str(sd[n].dtype).replace("torch.", "") for n in ref["buffers"] if n in sd}
    return out


def run_config(deepspeed, cfg, out_root: Path, world: int) -> str:
    torch.nn.functional.linear = _TORCH_LINEAR
    rank = tdist.get_rank()
    spec = make_spec(cfg)
    t0 = time.perf_counter()
    folder = out_root / spec.name
    ckpt_rel = "checkpoint-2" if spec.layout == "hf_trainer" else "ckpt"
    save_dir = folder / ckpt_rel
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    tdist.barrier()
    g19.seed_all(SEED)
    model = build_model("small", seed=SEED)
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    ds_cfg = spec.ds_config(world)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
    opt_cls = type(engine.optimizer).__name__
    losses = train_steps(engine, spec.stage, 2, model.vocab)
    ref, info = gather_reference(deepspeed, engine, spec)
    engine.save_checkpoint(str(save_dir))  # default tag global_step2, as the HF Trainer does too
    tag = f"global_step{engine.global_steps}"
    tdist.barrier()
    extras = {"model_size": "small", "seed": SEED, "micro_batch": g19.MICRO_BATCH, "seq_len": g19.SEQ,
              "ds_config": ds_cfg, "round_robin_gradients": False, "sub_group_size": None,
              "parameter_alignment": False, "grad_accum_dtype": None, "layout": spec.layout,
              "skipped_steps": int(engine.skipped_steps), "global_steps": int(engine.global_steps),
              "losses_rank0": losses, "no_grad_step": NO_GRAD_STEP and spec.stage in (1, 2)}
    if rank == 0:
        listing = g19.check_saved(spec, world, save_dir, [tag], opt_cls)
        extras["files"] = listing
        extras.update(info)
        extras["own_zero_to_fp32"] = own_converter_check(save_dir, ref, [n for n, _ in model.named_parameters(
            remove_duplicate=False)] + list(ref["buffers"]))
        torch.save(ref, folder / "reference.pt")
        meta = g19.fixture_json(spec, world, model, tag, [tag], ckpt_rel, opt_cls, extras, deepspeed)
        meta["torch_version"] = torch.__version__
        (folder / "fixture.json.tmp").write_text(json.dumps(meta, indent=1, default=str))
        (folder / "fixture.json.tmp").rename(folder / "fixture.json")
    engine.destroy() if hasattr(engine, "destroy") else None
    torch.nn.functional.linear = _TORCH_LINEAR
    del engine, model, optimizer
    gc.collect()
    tdist.barrier()
    log(f"OK {spec.name:24s} optimizer={opt_cls:30s} {time.perf_counter() - t0:5.2f}s")
    return opt_cls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--only", nargs="+", default=[])
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    deepspeed = import_deepspeed()
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    world = tdist.get_world_size()
    todo = [c for c in configs(deepspeed.__version__) if c["world"] == world]
    if args.only:
        todo = [c for c in todo if c["name"] in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, {len(todo)} configs")
    summary = {}
    for cfg in todo:
        try:
            summary[cfg["name"]] = run_config(deepspeed, cfg, args.out, world)
        except Exception:
            print(f"[rank {tdist.get_rank()}] {cfg['name']} FAILED\n{traceback.format_exc()}", flush=True)
            raise
    if tdist.get_rank() == 0:
        print("SUMMARY " + json.dumps(summary), flush=True)
    tdist.barrier()
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
