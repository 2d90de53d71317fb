"""The ``ckpt`` command line (also ``python -m ckptlib``).

Exit codes (:mod:`ckptlib.cli.crash`): 0 success, 1 a finding (problems, differences, a failed
verification), 2 an error with one clear message (what ckptlib raises on purpose), 3 an internal error
(a bug: one line asking for a report, the traceback in a file). Never a traceback on the terminal.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from .. import __version__
from ..dtypes import OUTPUT_DTYPES
from ..errors import CkptError, printable
from ..units import human_bytes
from .average import add_average_command
from .crash import internal_error
from .dcp import add_dcp_arguments
from .resume import add_arguments as resume_arguments

TP_RULES_HELP = ("tensor-parallel checkpoints saved without universal_checkpoint_info: a JSON file with its keys "
                 "(tp_replicated_parameter_patterns, parameter_with_row_parallelism_patterns, "
                 "vocabulary_parameter_patterns, original_vocab_size) saying how the shards join")


def _say(text: str, file=None) -> None:
    """Print text made of names from the checkpoint (tensor names, tags, ``latest``): control characters
    escaped line by line, so nothing a file holds reaches the terminal raw."""
    print("\n".join(printable(line) for line in str(text).split("\n")), file=file or sys.stdout)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ..analysis.summary import all_problems, describe, format_text
    from ..dcp import is_dcp
    from ..deepspeed import open_checkpoint

    if is_dcp(args.path):
        from .dcp import inspect_dcp

        return inspect_dcp(args.path, args.json)

    if args.globals:
        from ..analysis.pickles import format_globals, globals_report

        report = globals_report(args.path, args.tag)
        _say(json.dumps(report, indent=2) if args.json else format_globals(report))
        return 1 if report["refused"] else 0

    with open_checkpoint(args.path, tag=args.tag, tp_rules=args.tp_rules) as ckpt:
        if args.json:
            print(json.dumps(describe(ckpt), indent=2))
        else:
            _say(format_text(ckpt))
        return 1 if all_problems(ckpt) else 0


def _finish(args: argparse.Namespace, plan, result, checked=None) -> int:
    """Print what a run did (and, with ``--verify``, what was checked: ``checked`` if the ranks of a
    distributed run verified it already); the exit code. With ``-q`` nothing is printed unless
    verification fails."""
    if not args.quiet:
        for note in plan.notes:
            _say(f"note: {note}", file=sys.stderr)
        _say(result.describe())
    if not args.verify:
        return 0
    if checked is None:
        from ..analysis.verify import verify

        checked = verify(plan, result.out)
    if not args.quiet or not checked.ok:
        _say(checked.describe())
    return 0 if checked.ok else 1


def _plan_and_run(args: argparse.Namespace, make_plan, desc: str) -> int:
    """Make the plan, show it (``--plan``) or run it. With ``--distributed`` (under torchrun) rank 0 makes
    the plan and hands it to every rank, each rank writes its share, and only rank 0 prints (a failure on
    any rank: one message, from rank 0)."""
    from ..progress import TqdmObserver

    rank = int(os.environ.get("RANK", "0")) if args.distributed else 0
    observer = None if args.quiet or rank != 0 else TqdmObserver(desc)
    if not args.distributed:
        from ..execute import run

        plan = make_plan()
        if args.plan:
            _say(json.dumps(plan.to_dict(), indent=2) if args.json else plan.describe())
            return 0
        return _finish(args, plan, run(plan, observer=observer))
    from ..execute.distributed import (
        DistributedFailure,
        process_group,
        run_distributed,
        shared_plan,
        verify_distributed,
    )

    try:
        with process_group():
            plan = shared_plan(make_plan)
            if args.plan:
                if rank == 0:
                    _say(json.dumps(plan.to_dict(), indent=2) if args.json else plan.describe())
                return 0
            result = run_distributed(plan, observer=observer)
            checked = verify_distributed(plan, result.out) if args.verify else None  # every rank compares a share
    except DistributedFailure as e:
        if rank != 0 and e.everywhere:  # rank 0 prints the same message
            return 2
        raise
    return _finish(args, plan, result, checked) if rank == 0 else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..export import plan_export
    from .dcp import dcp_options

    states = [s for s in (args.states or "").split(",") if s]
    if args.merge or args.base:
        return _merge(args, states)
    return _plan_and_run(args, lambda: plan_export(
        args.path, args.out, tag=args.tag, format=args.format, dtype=args.dtype,
        max_shard_size=args.max_shard_size, exclude_frozen=args.exclude_frozen, states=states,
        workers=args.workers, overwrite=args.overwrite, tp_rules=args.tp_rules, hf_files=args.hf_files,
        sync=args.sync, dcp=dcp_options(args), verify_crc=args.verify_crc, model_config=args.model_config,
        adapter=args.adapter, adapter_config=args.adapter_config), "export")


def _merge(args: argparse.Namespace, states: list) -> int:
    """``--merge --base BASE``: a merge plan (:func:`ckptlib.plan_merge`), shown (``--plan``) or run by the one
    runner, then how far the two ``--merge-on`` modes lie apart, then (``--verify``) the output re-read."""
    from ..export.merge import plan_merge, run_merge
    from ..progress import TqdmObserver

    other = [o for o, on in (("--states", states), ("--distributed", args.distributed),
                             ("--format " + args.format, args.format != "safetensors"), ("--dtype", args.dtype != "fp32"),
                             ("--no-adapter", args.adapter is False), ("--workers", args.workers != 1),
                             ("--max-shard-size", args.max_shard_size != "5GB"), ("--exclude-frozen", args.exclude_frozen),
                             ("--model-config", args.model_config), ("--no-hf-files", not args.hf_files)) if on]
    if other:
        raise CkptError(f"--merge writes the merged model alone, in the base's files and the dtype --merge-on says: "
                        f"not with {', '.join(other)}")
    plan = plan_merge(args.path, args.out, args.base, merge_on=args.merge_on, tag=args.tag,
                      adapter_config=args.adapter_config, overwrite=args.overwrite, sync=args.sync,
                      verify_crc=args.verify_crc)
    if args.plan:
        _say(json.dumps(plan.to_dict(), indent=2) if args.json else plan.describe())
        return 0
    result = run_merge(plan, observer=None if args.quiet else TqdmObserver("merge"))
    if not args.quiet:
        _say(result.describe())
    if not args.verify:
        return 0
    from ..analysis.verify import verify

    checked = verify(plan, result.out)
    if not args.quiet or not checked.ok:
        _say(checked.describe())
    return 0 if checked.ok else 1


def _cmd_reshard(args: argparse.Namespace) -> int:
    from ..reshard import plan_reshard, plan_universal

    def make_plan():
        mesh_given = any(v is not None for v in (args.tp, args.pp, args.ep))
        if not args.universal and args.world_size is None and not mesh_given:
            raise CkptError("give the new size: --world-size (data parallel), --tp, --pp or --ep "
                            "(or --universal for a size-independent checkpoint)")
        if args.universal:
            if args.world_size is not None or args.tp is not None or args.pp is not None:
                raise CkptError("--universal writes a checkpoint for any data, tensor and pipeline size: leave out "
                                "--world-size, --tp, --pp (--ep: the expert-parallel size of an MoE checkpoint's)")
            return plan_universal(args.path, args.out, tag=args.tag, overwrite=args.overwrite, workers=args.workers,
                                  tp_rules=args.tp_rules, hf_files=args.hf_files, sync=args.sync,
                                  verify_crc=args.verify_crc, ep=args.ep)
        from ..reshard.stages import parse_tied

        return plan_reshard(args.path, args.out, args.world_size, tp=args.tp, pp=args.pp, ep=args.ep,
                            pp_partition=args.pp_partition, pp_layers=args.pp_layers,
                            pp_tied=parse_tied(args.pp_tied) if args.pp_tied else None, tag=args.tag,
                            overwrite=args.overwrite, workers=args.workers, tp_rules=args.tp_rules,
                            hf_files=args.hf_files, sync=args.sync, gpu_memory=args.gpu_memory,
                            verify_crc=args.verify_crc, model_config=args.model_config)

    return _plan_and_run(args, make_plan, "reshard")


def _cmd_check(args: argparse.Namespace) -> int:
    from ..analysis.health import check, plan_check
    from ..analysis.scan import ReadTqdm
    from ..dcp import is_dcp

    if is_dcp(args.path):
        from .dcp import check_dcp

        return check_dcp(args, _say)
    if args.resume_at is not None:
        from . import resume

        return resume.run(args)
    if args.against is not None:
        from ..analysis.universal_check import check_universal

        result = check_universal(args.path, args.against, tag=args.tag, tp_rules=args.tp_rules,
                                 observer=None if args.quiet or args.json else ReadTqdm("check"))
        _say(json.dumps(result.to_dict(), indent=2) if args.json else result.describe())
        return 0 if result.ok else 1
    plan = plan_check(args.path, tag=args.tag, states=args.states, tp_rules=args.tp_rules)
    for note in plan.notes:
        _say(f"note: {note}", file=sys.stderr)
    result = check(plan, observer=None if args.quiet or args.json else ReadTqdm("check"))
    _say(json.dumps(result.to_dict(), indent=2) if args.json else result.describe())
    return 0 if result.ok else 1


def _cmd_diff(args: argparse.Namespace) -> int:
    from ..analysis.scan import ReadTqdm
    from ..analysis.tensordiff import diff, plan_diff

    plan = plan_diff(args.a, args.b, tag_a=args.tag_a, tag_b=args.tag_b, states=args.states, atol=args.atol,
                     rtol=args.rtol, tp_rules=args.tp_rules)
    for note in plan.notes:
        _say(f"note: {note}", file=sys.stderr)
    result = diff(plan, observer=None if args.quiet or args.json else ReadTqdm("diff"))
    _say(json.dumps(result.to_dict(), indent=2) if args.json else result.describe())
    return 0 if result.ok else 1


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default (where it has one worth showing)."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


NO_SYNC_HELP = ("do not wait for the disk: the output appears as soon as it is written and the kernel stores it "
                "afterwards, as torch.save and DeepSpeed do (still atomic if the run is killed or fails, but a power "
                "cut in the next seconds may leave it incomplete); by default it is on disk before it appears")


NO_VERIFY_CRC_HELP = ("do not check the CRC-32 torch records for every zip entry of the checkpoint that the run reads "
                      "(torch never checks them). By default ckptlib computes it as the bytes stream and refuses "
                      "damaged bytes before the output appears, naming the file and entry (docs/safety.md)")
VERIFY_CRC_HELP = "the default (kept for scripts): the CRC-32 of what the run reads is checked; does nothing more"


def add_crc_arguments(p: argparse.ArgumentParser) -> None:
    """``--no-verify-crc`` (and ``--verify-crc``, the default, accepted as it was) of export and reshard."""
    p.add_argument("--no-verify-crc", dest="verify_crc", action="store_false", help=NO_VERIFY_CRC_HELP)
    p.add_argument("--verify-crc", dest="verify_crc", action="store_true", help=VERIFY_CRC_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt", description="Inspect and convert DeepSpeed ZeRO checkpoints.",
                                     formatter_class=_Formatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"ckpt (ckptlib) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_parser(name: str, **kw):
        return sub.add_parser(name, formatter_class=_Formatter, allow_abbrev=False, **kw)  # --tp is not --tp-rules

    p = add_parser("inspect", help="summarise a checkpoint (metadata only, reads almost nothing)")
    p.add_argument("path", help="save dir (holds 'latest'), tag folder, or HF checkpoint-N / output folder")
    p.add_argument("--tag", help="tag to inspect (default: the one 'latest' names)")
    p.add_argument("--tp-rules", metavar="FILE", help=TP_RULES_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--globals", action="store_true",
                   help="list every global each pickle names and which ones ckptlib refuses, without running any "
                        "(also for a checkpoint inspect refuses); exit 1 if any is refused")
    p.set_defaults(func=_cmd_inspect)

    p = add_parser("export", help="write consolidated weights (safetensors or torch, HF layout), streaming")
    p.add_argument("path", help="the checkpoint (as for inspect)")
    p.add_argument("out", help="output folder (created; must be empty unless --overwrite)")
    p.add_argument("--tag", help="tag to export (default: the one 'latest' names)")
    p.add_argument("--tp-rules", metavar="FILE", help=TP_RULES_HELP)
    p.add_argument("--format", choices=["safetensors", "torch", "dcp"], default="safetensors",
                   help="safetensors: model*.safetensors; torch: pytorch_model*.bin (torch.save, weights_only loads it); "
                        "dcp: a torch.distributed.checkpoint folder for FSDP2 (see --layout, --optimizer, --dcp-storage)")
    p.add_argument("--dtype", choices=list(OUTPUT_DTYPES), default="fp32",
                   help="dtype of parameters and floating buffers (integer buffers stay exact)")
    p.add_argument("--max-shard-size", default="5GB", help="shard limit, decimal units like 5GB or 500MB")
    p.add_argument("--no-hf-files", dest="hf_files", action="store_false",
                   help="do not copy config.json (with the exported dtype), generation_config.json, tokenizer "
                        "files, chat templates and remote code from beside the checkpoint")
    p.add_argument("--exclude-frozen", action="store_true", help="leave out frozen parameters")
    p.add_argument("--model-config", metavar="CONFIG.json",
                   help="an AutoEP checkpoint's HF model config (default: config.json beside the checkpoint): its "
                        "experts are written as the model's class keeps them (gate_up_proj, down_proj), the config "
                        "beside them, for from_pretrained")
    p.add_argument("--adapter", action=argparse.BooleanOptionalAction, default=None,
                   help="a peft adapter (LoRA, DoRA) as peft saves it: adapter_model.safetensors under peft's names "
                        "(the fp32 masters, or --dtype), adapter_config.json, tokenizer and README beside, which "
                        "PeftModel.from_pretrained(base, OUT) loads; chosen by default when the checkpoint trains one "
                        "(--no-adapter: the PeftModel's tensors under DeepSpeed's names)")
    p.add_argument("--adapter-config", metavar="adapter_config.json",
                   help="the adapter's config (default: adapter_config.json beside the checkpoint)")
    p.add_argument("--merge", action="store_true",
                   help="a peft adapter merged into its base model (--base): the base's safetensors with every "
                        "targeted weight W + scaling * B @ A (DoRA rescaled) from the fp32 masters and modules_to_save "
                        "replaced, which from_pretrained(OUT) loads; streamed tensor by tensor; needs torch; takes "
                        "--plan and --verify (merged weights against a recomputation, the rest against the base)")
    p.add_argument("--base", metavar="BASE", help="with --merge: the base model's local folder (save_pretrained's)")
    p.add_argument("--merge-on", choices=["base-dtype", "fp32"], default="base-dtype",
                   help="base-dtype (default): merge on the base rounded to the dtype the run trained against and "
                        "write that dtype (the run's own merge_and_unload()); fp32: merge on the fp32 base, write fp32")
    p.add_argument("--states", help="optimizer states to export too, comma separated (e.g. exp_avg,exp_avg_sq or "
                                    "momentum_buffer), or 'all' for every per-element key the optimizer keeps "
                                    "(`ckpt inspect` lists them per group)")
    add_dcp_arguments(p)
    p.add_argument("--workers", type=int, default=1, help="processes to write with")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--no-sync", dest="sync", action="store_false", help=NO_SYNC_HELP)
    p.add_argument("--plan", action="store_true", help="only show the plan (files, bytes, memory); write nothing")
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: every rank writes its share of the shards (gloo)")
    p.add_argument("--verify", action="store_true",
                   help="re-read the output and compare every tensor with the checkpoint, bit for bit (exit 1 if any "
                        "differs; with --distributed every rank compares a share)")
    add_crc_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print nothing but errors (and a failed verification); the exit code says how it went")
    p.set_defaults(func=_cmd_export)

    p = add_parser("reshard", help="rewrite a checkpoint for another data-, tensor- or pipeline-parallel size")
    p.add_argument("path", help="the checkpoint (as for inspect)")
    p.add_argument("out", help="output folder: a DeepSpeed save dir (latest + tag folder) that loads at the new size")
    p.add_argument("--world-size", "--dp", dest="world_size", type=int,
                   help="the new data-parallel size (default: kept when --tp or --pp change the mesh)")
    p.add_argument("--tp", type=int, help="the new tensor-parallel size (default: kept)")
    p.add_argument("--pp", type=int, help="the new number of pipeline stages (default: kept)")
    p.add_argument("--ep", type=int, help="the new expert-parallel size (default: kept)")
    p.add_argument("--pp-partition", metavar="HOW",
                   help="how the PipelineModule places its layers when the checkpoint does not show it: uniform, "
                        "parameters, or the stage boundaries B0,B1,...,Bn (n stages; Bn = the number of layer specs)")
    p.add_argument("--pp-layers", type=int, metavar="N", help="the number of layer specs of the PipelineModule")
    p.add_argument("--pp-tied", action="append", metavar="KEY:I,J",
                   help="every layer using the tied module KEY (a TiedLayerSpec use with forward_fn writes no file), "
                        "first the one that builds it (no forward_fn; a universal folder does not record it); "
                        "repeat for several keys")
    p.add_argument("--model-config", metavar="CONFIG.json",
                   help="an AutoTP checkpoint's HF model config (default: config.json beside the tag folders): "
                        "AutoTP cuts attention by its key-value heads at another --tp")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="with --plan: compare each rank's training memory at the new mesh with a GPU of this size, "
                        "e.g. 80GB")
    p.add_argument("--tag", help="tag to reshard (default: the one 'latest' names)")
    p.add_argument("--tp-rules", metavar="FILE", help=TP_RULES_HELP)
    p.add_argument("--no-hf-files", dest="hf_files", action="store_false",
                   help="do not carry over the HF Trainer / Accelerate files (trainer_state.json, scheduler.pt, "
                        "training_args.bin, model.safetensors, config, tokenizer, RNG states, scheduler.bin ...)")
    p.add_argument("--universal", action="store_true",
                   help="write DeepSpeed's universal checkpoint layout instead (load with load_universal at any size; "
                        "MoE: at the expert-parallel size --ep, default the source's)")
    p.add_argument("--plan", action="store_true", help="only show which source ranks feed which target rank, "
                   "bytes and memory; write nothing")
    p.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--no-sync", dest="sync", action="store_false", help=NO_SYNC_HELP)
    p.add_argument("--workers", type=int, default=None,
                   help="files written at a time, each thread with its own 48 MiB of buffers "
                        "(default: 2 with 2+ cores)")
    p.add_argument("--verify", action="store_true",
                   help="re-open the output and compare every master, optimizer state, frozen parameter and buffer "
                        "with the source, bit for bit (exit 1 if any differs; with --distributed every rank compares a "
                        "share)")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun (one machine or several nodes, output on a shared file system): rank 0 "
                        "plans, every rank writes its share of the target files (balanced by bytes, --workers "
                        "threads each), rank 0 renames the output into place once all ranks finished (gloo)")
    add_crc_arguments(p)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print nothing but errors (and a failed verification); the exit code says how it went")
    p.set_defaults(func=_cmd_reshard)

    p = add_parser("check", help="statistics of every fp32 master (and optimizer state) and what is wrong "
                       "(NaN/Inf, a second moment below zero, 16-bit weights, steps, padding); exit 1 on a problem")
    p.add_argument("path", help="the checkpoint (as for inspect)")
    p.add_argument("--tag", help="tag to check (default: the one 'latest' names)")
    p.add_argument("--states", action="store_true", help="also every optimizer state (Adam's exp_avg and exp_avg_sq, "
                                                            "Muon's or SGD's momentum_buffer, ...)")
    p.add_argument("--json", action="store_true", help="print JSON: tensors, problems, bytes_read")
    p.add_argument("--tp-rules", metavar="FILE", help=TP_RULES_HELP)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--against", metavar="ORIGINAL", help="PATH is a universal checkpoint: compare its masters, "
                   "optimizer states and steps with the native checkpoint it was made from and name, per parameter, "
                   "what a resume would lose (zeroed moments, another step, changed or missing states); exit 1 if any")
    resume_arguments(p)
    p.set_defaults(func=_cmd_check)

    p = add_parser("diff", help="compare two checkpoints, exports or universal checkpoints tensor by tensor; "
                       "exit 0 when every tensor is the same, 1 otherwise")
    p.add_argument("a", help="a checkpoint (any stage, world size, tag folder), an export folder or file, or a "
                   "universal checkpoint")
    p.add_argument("b", help="the same kinds as A")
    p.add_argument("--tag-a", help="tag of A when it is a checkpoint (default: the one 'latest' names)")
    p.add_argument("--tag-b", help="tag of B when it is a checkpoint")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance: same when |a-b| <= atol + rtol*|b|")
    p.add_argument("--states", action="store_true", help="compare optimizer states too (an export's <state>/ "
                   "sub-folders, a universal checkpoint's exp_avg.pt, ...)")
    p.add_argument("--json", action="store_true", help="print JSON: tensors, summary, bytes_read")
    p.add_argument("--tp-rules", metavar="FILE", help=TP_RULES_HELP + " (for either side)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_diff)
    add_average_command(sub, _plan_and_run, NO_SYNC_HELP, TP_RULES_HELP, add_crc_arguments)
    return parser


def _one_blas_thread() -> None:
    """ckpt never multiplies matrices: numpy's OpenBLAS (loaded for casts) gets one thread unless told otherwise,
    which saves its ~41 MiB of buffers per further thread (the memory floor of a cast export,
    tests/test_memory_floor.py; the measurement is in docs/benchmarks.md's git history)."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _one_blas_thread()
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
    except (MemoryError, RuntimeError, SyntaxError, ImportError, OSError) as e:  # an allocation failed outside a run
        # (a run says more); a shared library that a late import could not map is one too
        from ..system.allocation import is_allocation_failure
        from ..system.memory import system_memory

        if not is_allocation_failure(e):
            return internal_error(args.command, e, argv)
        room = system_memory()
        print(f"ckpt {args.command}: error: ran out of memory ({human_bytes(room.headroom)} was {room.bound_by})\n"
              "  hint: free memory or raise the limit; `ckpt export --plan` shows what a run needs", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug in ckptlib: one line, the traceback in a file (exit 3)
        return internal_error(args.command, e, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
