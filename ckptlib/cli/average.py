"""``ckpt average SRC1 SRC2 [...] OUT``: the arguments and the command (:func:`ckptlib.plan_average`, run by the one
runner; ``--plan`` and ``--verify`` as for ``ckpt export``)."""
from __future__ import annotations

import argparse

from ..dtypes import OUTPUT_DTYPES
from ..errors import CkptError

DESCRIPTION = """\
Average two or more tags of one run (the same parameter names and shapes; each at any mesh or ZeRO stage ckpt
reads), streamed tensor by tensor, chunk by chunk: memory is a few buffers whatever the number of tags and the model
size. Only the trainable parameters' fp32 masters are averaged; buffers and frozen parameters are the last tag's.

Each element is the float32 rounding of sum_i w_i * x_i, accumulated in float64 in the order the tags are given
(acc = w_1*x_1, then acc = acc + w_i*x_i, every product and sum rounded to float64): deterministic, and what torch
computes as (w_1 * x_1.double() + w_2 * x_2.double() + ...).float(). Weights:
  default    uniform, w_i = 1/N: the result is sum (1/N)*x_i, NOT (sum x_i)/N, which rounds differently in a few
             elements
  --weights  as given; their sum must be 1 (within 1e-9) unless --normalize (then w_i / sum)
  --ema D    e = x_1, then e = D*e + (1-D)*x_i per further tag, as explicit weights: w_1 = D^(N-1),
             w_i = (1-D)*D^(N-i) (powers by repeated float64 multiplication), summed as above

--format safetensors|torch writes the Hugging Face layout as `ckpt export` does (--dtype, shards, config.json
beside); --format deepspeed writes a DeepSpeed checkpoint at the last tag's mesh: its masters the average, its 16-bit
weights rounded from them, its optimizer state and step the last tag's, which DeepSpeed resumes and steps on."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CkptError(f"--weights takes numbers separated by commas, e.g. 0.2,0.3,0.5 (got {text!r})") from None


def run_average(args: argparse.Namespace, plan_and_run) -> int:
    """The command: the plan from the arguments, shown (``--plan``) or run (``plan_and_run``: the CLI's own)."""
    from ..export.average import plan_average

    sources, out = args.sources, args.out
    if len(sources) < 2:
        raise CkptError("give two or more checkpoints and the output folder", hint="ckpt average SRC1 SRC2 [...] OUT")
    weights = _floats(args.weights) if args.weights is not None else None
    if args.normalize and weights is None:
        raise CkptError("--normalize divides the weights given with --weights by their sum: give --weights")
    return plan_and_run(args, lambda: plan_average(
        sources, out, weights=weights, ema=args.ema, normalize=args.normalize, format=args.format, dtype=args.dtype,
        max_shard_size=args.max_shard_size, exclude_frozen=args.exclude_frozen, hf_files=args.hf_files,
        overwrite=args.overwrite, workers=args.workers, sync=args.sync, tp_rules=args.tp_rules,
        verify_crc=args.verify_crc), "average")


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its formulas line by line); each option's default shown where it has one."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_average_command(sub, plan_and_run, no_sync_help: str, tp_rules_help: str, add_crc_arguments=None) -> None:
    """Add the ``average`` sub-command to the sub-parsers ``sub`` (``plan_and_run``: the CLI's runner of plans;
    ``add_crc_arguments``: adds export's ``--no-verify-crc``)."""
    p = sub.add_parser("average", help="average two or more tags of one run (uniform, --weights or --ema), streamed "
                                       "and exact; the HF layout or --format deepspeed",
                       description=DESCRIPTION, formatter_class=_Formatter, allow_abbrev=False)
    p.add_argument("sources", nargs="+", metavar="SRC",
                   help="two or more checkpoints of one run (tag folders, or save dirs holding 'latest'), in order")
    p.add_argument("out", metavar="OUT", help="the output folder (created; must be empty unless --overwrite)")
    p.add_argument("--weights", metavar="W1,W2,...", help="one weight per checkpoint, in their order; they must sum "
                                                          "to 1 unless --normalize")
    p.add_argument("--normalize", action="store_true", help="divide the --weights by their sum")
    p.add_argument("--ema", type=float, metavar="DECAY", help="the exponential moving average of the checkpoints in "
                                                              "the order given: e = DECAY*e + (1-DECAY)*x_i")
    p.add_argument("--format", choices=["safetensors", "torch", "deepspeed"], default="safetensors",
                   help="safetensors or torch: the HF layout as ckpt export writes it; deepspeed: a DeepSpeed "
                        "checkpoint at the last tag's mesh (averaged masters, the last tag's optimizer state and step)")
    p.add_argument("--dtype", choices=list(OUTPUT_DTYPES), default="fp32",
                   help="HF layout: the dtype of the weights written (the float32 average cast as torch casts)")
    p.add_argument("--max-shard-size", default="5GB", help="HF layout: shard limit, decimal units like 5GB or 500MB")
    p.add_argument("--exclude-frozen", action="store_true", help="HF layout: leave out frozen parameters")
    p.add_argument("--no-hf-files", dest="hf_files", action="store_false",
                   help="HF layout: do not write config.json (with the written dtype) and the tokenizer files found "
                        "beside the last checkpoint")
    p.add_argument("--tp-rules", metavar="FILE", help=tp_rules_help)
    p.add_argument("--workers", type=int, default=1, help="writing threads")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--no-sync", dest="sync", action="store_false", help=no_sync_help)
    p.add_argument("--plan", action="store_true", help="only show the plan (sources, weights, files, bytes, memory); "
                                                       "write nothing")
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="re-read the output and compare every averaged tensor with its recomputation from the "
                        "checkpoints (and every other one with the last checkpoint's), bit for bit (exit 1 if any "
                        "differs)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print nothing but errors (and a failed verification); the exit code says how it went")
    if add_crc_arguments is not None:
        add_crc_arguments(p)
    p.set_defaults(func=lambda args: run_average(args, plan_and_run), distributed=False, verify_crc=True)


__all__ = ["add_average_command", "run_average", "DESCRIPTION"]
