"""The ``ckpt`` command line (also ``python -m ckptlib``).

Errors ckptlib raises on purpose are printed as one clear message (exit code 2); no traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .errors import CkptError


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .deepspeed import open_checkpoint
    from .summary import describe, format_text

    with open_checkpoint(args.path, tag=args.tag) as ckpt:
        if args.json:
            print(json.dumps(describe(ckpt), indent=2))
        else:
            print(format_text(ckpt))
        return 1 if ckpt.problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt", description="Inspect and convert DeepSpeed ZeRO checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="summarise a checkpoint (metadata only, reads almost nothing)")
    p.add_argument("path", help="save dir (holds 'latest'), tag folder, or HF checkpoint-N / output folder")
    p.add_argument("--tag", help="tag to inspect (default: the one 'latest' names)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CkptError as e:
        print(f"ckpt {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
