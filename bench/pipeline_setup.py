"""What the large pipeline checkpoint makers share (bench/make_parallel_checkpoint.py, pp 2; and
bench/make_mesh_checkpoint.py, pp 2 x tp 2): their size arguments, DeepSpeed started over gloo on CPU, and
AdamW with weight decay on the matrices only. Run under torchrun."""
from __future__ import annotations

import argparse
import importlib
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist


def size_arguments(doc: str) -> argparse.ArgumentParser:
    """``--out`` and the model's sizes (defaults: about 268 M parameters)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=16)
    return ap


def start_deepspeed(per_dp: int):
    """Import DeepSpeed quietly (its shared-memory op not built), join the gloo group; returns
    ``(deepspeed, rank, world, dp)`` with ``dp = world / per_dp`` (exits unless it divides)."""
    warnings.filterwarnings("ignore")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    if world % per_dp:
        raise SystemExit(f"world size must be {per_dp} x dp")
    return deepspeed, rank, world, world // per_dp


def adamw(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay 0.01 on the matrices, none on vectors."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr)
