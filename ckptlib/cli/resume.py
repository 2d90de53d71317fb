"""``ckpt check CKPT --resume-at CONFIG.json --world-size N``: the resume check (see
:mod:`ckptlib.analysis.resume`), wired into ``ckpt check`` by :func:`add_arguments` and :func:`run`."""
from __future__ import annotations

import argparse
import json

from ..errors import CkptError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume-at", metavar="CONFIG", help="instead of checking values: predict whether DeepSpeed "
                   "loads the checkpoint with this DeepSpeed config (JSON) at --world-size ranks, what it refuses or "
                   "silently drops, and which ckpt command makes it load (metadata only; exit 1 unless it loads "
                   "exactly)")
    p.add_argument("--world-size", type=int, help="with --resume-at: the job's number of ranks")
    for dim, what in (("tp", "tensor-parallel"), ("pp", "pipeline"), ("ep", "expert-parallel"),
                      ("sp", "sequence-parallel (Ulysses)")):
        p.add_argument(f"--{dim}", type=int, default=1, help=f"with --resume-at: the job's {what} size")


def run(args: argparse.Namespace) -> int:
    from ..analysis.resume import resume_check

    if args.world_size is None:
        raise CkptError("--resume-at needs --world-size (the job's number of ranks)")
    result = resume_check(args.path, args.resume_at, args.world_size, tp=args.tp, pp=args.pp, ep=args.ep, sp=args.sp,
                          tag=args.tag)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.describe())
    return 0 if result.ok else 1
