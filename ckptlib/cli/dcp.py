"""The command line's DCP options (``ckpt export --format dcp --layout ... --optimizer``) and ``ckpt
inspect`` of a DCP folder; the logic is in :mod:`ckptlib.export.dcp` and :mod:`ckptlib.analysis.dcp_summary`."""
from __future__ import annotations

import argparse
import json
from typing import Optional

from ..errors import CkptError

LAYOUT_HELP = ("with --format dcp: torch ({'model', 'optimizer'} of get_state_dict/set_state_dict, FSDP2), "
               "torchtitan (its CheckpointManager's keys), accelerate (Accelerator.save_state's FSDP2 folders)")


def add_dcp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=["torch", "torchtitan", "accelerate"], default=None, help=LAYOUT_HELP +
                   " (default torch)")
    p.add_argument("--optimizer", action="store_true",
                   help="with --format dcp: the optimizer state too (fp32 masters, each group's state under the keys "
                        "of the torch optimizer of its kind: AdamW, Muon, SGD, Adagrad, RMSprop; the step; the "
                        "parameter groups' hyper-parameters); --states does the same")


def dcp_options(args: argparse.Namespace) -> Optional[dict]:
    """The ``dcp`` options of :func:`ckptlib.plan_export` (None unless --format dcp)."""
    if args.format != "dcp":
        if args.layout or args.optimizer:
            raise CkptError("--layout and --optimizer are for --format dcp")
        return None
    return {"layout": args.layout or "torch", "optimizer": bool(args.optimizer)}


def inspect_dcp(path: str, as_json: bool) -> int:
    from ..analysis.dcp_summary import describe_dcp, format_dcp
    from ..dcp import open_dcp

    d = open_dcp(path)
    print(json.dumps(describe_dcp(d), indent=2) if as_json else format_dcp(d))
    return 0


__all__ = ["add_dcp_arguments", "dcp_options", "inspect_dcp"]
