"""The DeepSpeed releases whose checkpoints are committed under tests/data/old_releases/, and what each
needs to run on this CPU machine beside torch 2.13 (see /work/shared/docs/old-deepspeed-on-cpu.md).

Torch only (no DeepSpeed import): read by the driver (make_old_fixtures.py), by the generator inside each
release's throw-away venv (old_generate.py, through ds_compat.py) and by the tests.
"""
from __future__ import annotations

TORCH = "2.13.0"

# Exact pins per release: what the committed fixtures were made with (also recorded, as installed, in each
# release's manifest.json). "pins" go on the same pip command line as deepspeed; "patches" are the shims of
# ds_compat.py that the release needs (a: torch.distributed.elastic names it imports, b: stub Intel
# extension modules, c: no oneCCL op build); "no_grad_step": run engine.step() under torch.no_grad() for
# ZeRO-1/2 (0.12.6: gloo's all-gather otherwise fails on an in-place-modified view).
RELEASES: dict[str, dict] = {
    "0.10.3": {"pins": ["numpy==1.26.4", "pydantic==1.10.27"], "patches": ["a", "b", "c"], "no_grad_step": False},
    "0.12.6": {"pins": ["numpy==1.26.4", "pydantic==2.14.4"], "patches": ["a", "b", "c"], "no_grad_step": True},
    "0.13.5": {"pins": ["numpy==1.26.4", "pydantic==2.14.4"], "patches": ["a", "b", "c"], "no_grad_step": False},
    "0.14.5": {"pins": ["numpy==2.4.6", "pydantic==2.14.4"], "patches": [], "no_grad_step": False},
    "0.15.4": {"pins": ["numpy==2.4.6", "pydantic==2.14.4"], "patches": [], "no_grad_step": False},
    "0.16.9": {"pins": ["numpy==2.4.6", "pydantic==2.14.4"], "patches": [], "no_grad_step": False},
}

# Environment of every launch: the CPU accelerator, gloo, and LOCAL_SIZE=1 (ZeRO-3 in 0.14/0.15 otherwise
# shells out to numactl to count local ranks; harmless for the others).
LAUNCH_ENV = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "1", "OMP_NUM_THREADS": "1", "DS_BUILD_OPS": "0"}


def configs(version: str) -> list[dict]:
    """The checkpoints made with ``version``: ZeRO-1/2/3 x fp32/bf16, each at world size 2 or 3, plus one
    HF-Trainer layout (``checkpoint-2/`` holding ``latest`` and ``global_step2/``).

    Every one is FixtureNet (frozen Linear, tied head/embedding, 3- and 1-element parameters, int64/bool
    buffers, two param groups). The world sizes alternate between releases so that each stage x dtype is
    seen at both 2 and 3 ranks across releases while a release stays at 7 small checkpoints.
    """
    flip = list(RELEASES).index(version) % 2
    out = []
    for stage in (1, 2, 3):
        for d, dtype in enumerate(("fp32", "bf16")):
            world = 2 + (stage + d + flip) % 2
            out.append({"name": f"z{stage}_{dtype}_w{world}", "stage": stage, "dtype": dtype, "world": world,
                        "layout": "plain"})
    hf_stage = 2 if flip == 0 else 3
    hf_world = 3 if flip == 0 else 2
    out.append({"name": f"hf_trainer_z{hf_stage}_bf16_w{hf_world}", "stage": hf_stage, "dtype": "bf16",
                "world": hf_world, "layout": "hf_trainer"})
    return out
