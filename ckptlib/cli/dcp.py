"""The command line's DCP options (``ckpt export --format dcp --layout ... --optimizer --dcp-storage ...``),
``ckpt inspect`` and ``ckpt check`` of a DCP folder; the logic is in :mod:`ckptlib.export.dcp` and :mod:`ckptlib.analysis.dcp_summary`."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from ..errors import CkptError

LAYOUT_HELP = ("with --format dcp: torch ({'model', 'optimizer'} of get_state_dict/set_state_dict, FSDP2), "
               "torchtitan (its CheckpointManager's keys), accelerate (Accelerator.save_state's FSDP2 folders)")


def add_dcp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=["torch", "torchtitan", "accelerate"], default=None, help=LAYOUT_HELP +
                   " (default torch)")
    p.add_argument("--dcp-storage", choices=["torch", "hf", "hf-sharded"], default=None,
                   help="with --format dcp: how the bytes are stored: torch (FileSystemWriter's torch.save items, the "
                        "default; the optimizer too), hf (HuggingFaceStorageWriter's model-*-of-*.safetensors and "
                        "index), hf-sharded (its save_distributed=True files, shard-*-model-*-of-*.safetensors per "
                        "rank); the hf storages hold the model alone (docs/dcp.md)")
    p.add_argument("--optimizer", action="store_true",
                   help="with --format dcp: the optimizer state too (fp32 masters, each group's state under the keys "
                        "of the torch optimizer of its kind: AdamW, Muon, SGD, Adagrad, RMSprop; the step; the "
                        "parameter groups' hyper-parameters); --states does the same")


def dcp_options(args: argparse.Namespace) -> Optional[dict]:
    """The ``dcp`` options of :func:`ckptlib.plan_export` (None unless --format dcp)."""
    if args.format != "dcp":
        if args.layout or args.optimizer or args.dcp_storage:
            raise CkptError("--layout, --optimizer and --dcp-storage are for --format dcp")
        return None
    return {"layout": args.layout or "torch", "optimizer": bool(args.optimizer), "storage": args.dcp_storage or "torch"}


def inspect_dcp(path: str, as_json: bool) -> int:
    from ..analysis.dcp_summary import describe_dcp, format_dcp
    from ..dcp import open_dcp

    d = open_dcp(path)
    print(json.dumps(describe_dcp(d), indent=2) if as_json else format_dcp(d))
    return 0


def check_dcp(args: argparse.Namespace, say) -> int:
    """``ckpt check`` of a DCP folder (``--states``, ``--json``, ``-q``); ``say`` prints escaped text."""
    from ..analysis.dcp_summary import plan_check_dcp
    from ..analysis.health import check
    from ..analysis.scan import ReadTqdm

    if args.resume_at is not None or args.against is not None:
        raise CkptError("--resume-at and --against are for DeepSpeed checkpoints, not a DCP folder")
    plan = plan_check_dcp(args.path, states=args.states)
    for note in plan.notes:
        say(f"note: {note}", file=sys.stderr)
    result = check(plan, observer=None if args.quiet or args.json else ReadTqdm("check"))
    say(json.dumps(result.to_dict(), indent=2) if args.json else result.describe())
    return 0 if result.ok else 1


__all__ = ["add_dcp_arguments", "dcp_options", "inspect_dcp", "check_dcp"]
