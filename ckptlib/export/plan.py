"""Planning an export from metadata alone: which files, which tensors in each, where their bytes are.

:func:`plan_export` reads nothing beyond what opening the checkpoint read. The plan is plain data the
notebook shows before the user runs it; :func:`ckptlib.run` executes it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence, Union

from ..analysis.placement import masters
from ..dcp import is_dcp
from ..deepspeed import Checkpoint, hf, open_checkpoint
from ..deepspeed.exactness import require_exact, value_proofs
from ..dtypes import BY_SHORT, OUTPUT_DTYPES, is_floating
from ..errors import CkptError
from ..io.crc import attach_crc
from ..kinds.adapters import looks_like_adapter
from ..kinds.optimizers import describe as describe_families
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..plan import CopyFile, PlannedTensor, RangeCheck, TextFile
from ..system.gcpause import gc_paused
from ..units import parse_size
from .adapter import adapter_sets
from .hf_layout import ModelConfig, in_hf_layout
from .weights import ExportPlan, masters_notes, model_tensors, weights_files

FORMATS = ("safetensors", "torch", "dcp")


@gc_paused
def plan_export(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike], *,
                tag: Optional[str] = None, format: str = "safetensors", dtype: str = "fp32",
                max_shard_size: Union[int, str] = "5GB", exclude_frozen: bool = False,
                states: Sequence[str] = (), workers: int = 1, overwrite: bool = False,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, tp_rules=None, hf_files: bool = True,
                sync: bool = True, dcp: Optional[dict] = None, verify_crc: bool = True,
                model_config: ModelConfig = None, adapter: Optional[bool] = None,
                adapter_config: Union[str, os.PathLike, dict, None] = None) -> ExportPlan:
    """Plan the export of consolidated weights (and optionally optimizer states); reads no tensor data.

    Args:
        checkpoint: an opened :class:`Checkpoint` or a path for :func:`open_checkpoint`.
        out: the output folder (must be empty or absent unless ``overwrite``).
        tag: tag to export when ``checkpoint`` is a path.
        format: ``"safetensors"`` (default) or ``"torch"`` (``pytorch_model*.bin``).
        dtype: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` for parameters and floating buffers;
            integer and bool buffers keep their dtype.
        max_shard_size: shard limit, e.g. ``"5GB"`` (decimal units) or bytes.
        exclude_frozen: leave out frozen parameters (and aliases of them).
        states: optimizer state keys to export too, e.g. ``("exp_avg", "exp_avg_sq")``, or ``("all",)`` for
            every per-element key the optimizer keeps; each goes to its own sub-folder ``out/<key>/`` in the same
            layout (fp32), holding the trainable parameters whose group keeps it (a Muon run: ``momentum_buffer``
            for the matrices, Adam's keys for the rest). The step is a scalar: it is written in the metadata.
        workers: processes to write with (each receives the pickled plan).
        chunk_bytes: streaming chunk size; the memory bound follows from it.
        tp_rules: how a tensor-parallel checkpoint saved without ``universal_checkpoint_info`` joins its
            shards (a JSON file; see :func:`ckptlib.open_checkpoint`).
        hf_files: copy the Hugging Face files found beside the checkpoint (``config.json`` with its dtype
            set to ``dtype``, ``generation_config.json``, tokenizer files, chat templates, remote code named
            by ``auto_map``; :func:`ckptlib.deepspeed.hf.model_files`), so that ``from_pretrained(out)`` loads it as
            it is. The plan's notes say which were copied, or how to add a config when there is none.
        dcp: with ``format="dcp"``: ``layout`` (``"torch"``, ``"torchtitan"``, ``"accelerate"``) and
            ``optimizer`` (True: the optimizer state too; ``states`` naming any state does the same); see
            :mod:`ckptlib.export.dcp`. The result is a :class:`~ckptlib.export.dcp.DcpPlan`.
        model_config: an AutoEP checkpoint's model config (``config.json``, its folder, or the dict; default: the
            ``config.json`` beside the checkpoint): its experts are written as the model's class keeps them
            (:mod:`ckptlib.export.hf_layout`), and the config beside them.
        adapter: write a peft adapter as peft saves it (:mod:`ckptlib.export.adapter`: ``adapter_model.safetensors``
            under peft's names, ``adapter_config.json``, tokenizer and README beside), which
            ``PeftModel.from_pretrained(base, out)`` loads; None (default): so when the checkpoint trains a peft
            adapter and the format is safetensors (a note says so); False: the PeftModel's tensors under DeepSpeed's
            names, as any model. ``adapter_config``: its ``adapter_config.json`` (path, folder or dict; default: the
            one beside the tag).
        verify_crc: check the CRC-32 of every zip member of the checkpoint the export reads, as its bytes stream
            (default; a mismatch is refused, naming the file and member, and nothing is written; False: unchecked).
        sync: put the output on disk before it appears under its name (default; see :class:`~ckptlib.plan.Plan`).
            False leaves the writing to the kernel after the run, as ``torch.save`` and DeepSpeed do:
            faster, still atomic against a killed or failing run, but not against a power cut.

    Tensor-parallel shards are joined into full tensors; tensors replicated on several tensor ranks
    are compared when the plan runs, before anything is written (``plan.checks``).

    Memory: the plan itself (one small record per tensor and stored range).
    """
    if adapter and format != "safetensors":
        raise CkptError(f"an adapter is written as peft saves it, in safetensors (not {format})",
                        hint="leave out --format, or export the full model layout with --no-adapter")
    if not isinstance(checkpoint, Checkpoint) and format != "dcp" and is_dcp(checkpoint):
        from .from_dcp import plan_from_dcp  # a DCP checkpoint as the source

        return plan_from_dcp(checkpoint, out, format=format, dtype=dtype, limit=shard_limit(max_shard_size), states=states,
                             workers=workers, overwrite=overwrite, chunk_bytes=chunk_bytes, sync=sync)
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag, tp_rules=tp_rules)
    if format not in FORMATS:
        raise CkptError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in OUTPUT_DTYPES:
        raise CkptError(f"unknown dtype {dtype!r}; choose one of {', '.join(OUTPUT_DTYPES)}")
    ck, layout_files, layout_notes = in_hf_layout(ck, model_config, BY_SHORT[dtype].name)
    if format == "dcp":
        require_exact(ck)  # the validation of every conversion, as below
        plan = _plan_dcp(ck, out, dtype=dtype, max_shard_size=max_shard_size, states=states, workers=workers,
                         overwrite=overwrite, chunk_bytes=chunk_bytes, sync=sync, exclude_frozen=exclude_frozen,
                         verify_crc=verify_crc, **(dcp or {}))
        plan.notes[:0] = layout_notes
        optimizer = bool((dcp or {}).get("optimizer") or states)
        plan.notes += _masters_notes(ck, dtype, list(ck.optimizer.state_keys) if optimizer and ck.optimizer else [],
                                     optimizer)
        plan.notes += absent_notes(ck)
        return plan
    if dcp:
        raise CkptError("layout and optimizer options are for --format dcp")
    if workers < 1:
        raise CkptError("workers must be at least 1")
    limit = shard_limit(max_shard_size)
    require_exact(ck)  # the one validation of every conversion: readable, every rank file what its name says
    warnings = []
    if ck.flavor != "no_zero" and ck.zero_stage == 1 and any(not p.trainable and not p.tied_to for p in ck.parameters):
        warnings.append("ZeRO-1 does not save fp32 copies of frozen parameters: they are exported from the "
                        f"{ck.dtype} module weights (DeepSpeed's converter drops them)")
    if ck.flavor == "no_zero" and ck.dtype in ("bf16", "fp16"):
        lowp = [p.name for p in ck.parameters if not p.trainable and not p.tied_to]
        if lowp:
            warnings.append(f"ZeRO-0: {', '.join(lowp)} in no optimizer group (frozen; the checkpoint holds no fp32 "
                            f"master for them): exported from the {ck.dtype} module weights")
    out_dtype = BY_SHORT[dtype].name
    states = requested_states(ck, states)
    warnings += _masters_notes(ck, dtype, states)
    peft = adapter_sets(ck, out_dtype, states, adapter, adapter_config) \
        if adapter or (adapter is None and format == "safetensors" and not layout_files) else None
    if peft is not None:
        files, finals, side, side_notes = peft
        side = side if hf_files else side[:1]  # adapter_config.json always: peft cannot load the adapter without it
        if adapter is None:
            side_notes.insert(0, "the checkpoint trains a peft adapter: exported as one (--adapter; --no-adapter "
                                 "writes the PeftModel's tensors under DeepSpeed's names instead)")
        index_files, layout_files, hf_files = {}, [], False
    else:
        files, finals, index_files = weights_files(_model_sets(ck, out_dtype, exclude_frozen, states), format, limit,
                                                   ck.optimizer.step if ck.optimizer else None)
    checks = [RangeCheck(what, tuple(a), tuple(b), a[0].dtype if a else "float32")  # compared as stored
              for f in files for t in f.tensors for what, a, b in ck.replica_checks(t.source, t.key)
              if t.kind != "tied"] + value_proofs(ck)
    if peft is None:
        side, side_notes = _side_files(ck, out_dtype) if hf_files and not layout_files else ([], [])
    if layout_files:  # the config given for the layout, the rest of what from_pretrained reads from beside the checkpoint
        found, _ = hf.model_files(ck.location.save_dir) if hf_files else ([], None)
        side = layout_files + [CopyFile(f.name, f.source, f.bytes, kind="hf") for f in found if f.name != hf.CONFIG]
        side_notes = layout_notes
    files += [f for f in side if isinstance(f, CopyFile)]
    finals = [f for f in side if isinstance(f, TextFile)] + finals
    plan = ExportPlan(source=ck.source_ref(), out=Path(out).expanduser().resolve(), files=files, finals=finals,
                      format=format, dtype=dtype, max_shard_size=limit, exclude_frozen=exclude_frozen,
                      states=tuple(states), index_files=index_files, side_files=[f.name for f in side],
                      chunk_bytes=chunk_bytes, workers=workers,
                      overwrite=overwrite, sync=sync,
                      notes=warnings + [n for n in ck.view.notes if ck.kind != "data_parallel"] + side_notes
                      + absent_notes(ck),
                      checks=checks)
    return attach_crc(plan, ck.zip_entries() if verify_crc else None)


def absent_notes(ck: Checkpoint) -> list[str]:
    """What an export of universal folder ``ck`` cannot hold, one note per tensor the folder lacks (a pipeline's buffers
    when ds_to_universal copied no layer files; a frozen parameter with no value), as the reshard names them; [] for a
    native checkpoint. Metadata only."""
    if ck.universal is None:
        return []
    why: dict = {}  # the reason -> the tensors it keeps out (every one named)
    for a in ck.universal.absent:
        what, _, reason = a.partition(": ")
        why.setdefault(reason, []).append(what)
    return [f"not in the export: {', '.join(whats)} ({reason}). A strict load_state_dict stops at "
            f"{'them' if len(whats) > 1 else 'it'} as missing keys: load with strict=False (the model keeps the values "
            "it is built with), or take them from the original checkpoint" for reason, whats in why.items()]


def _masters_notes(ck: Checkpoint, dtype: str, states: Sequence[str], optimizer: bool = False) -> list[str]:
    """The notes of an export at ``dtype`` (with the optimizer ``states``) of a checkpoint whose optimizer keeps its
    masters in 16 bits (:func:`~.weights.masters_notes`); [] for fp32 masters. Metadata only."""
    m = masters(ck)
    if m is None or m["dtype"] not in ("bfloat16", "float16"):
        return []
    short = "bf16" if m["dtype"] == "bfloat16" else "fp16"
    section = ck.ds_config.get(short) if isinstance(ck.ds_config, dict) else None
    key = short + "_master_weights_and_grads"
    why = key if isinstance(section, dict) and section.get(key) else ""
    out = BY_SHORT[dtype].name
    rounded = [b.name for b in ck.buffers if is_floating(b.dtype) and b.dtype != out] if dtype != "fp32" else []
    return masters_notes(m, dtype, why, {k: m["states"].get(k) for k in states}, rounded, optimizer)


def _model_sets(ck: Checkpoint, out_dtype: str, exclude_frozen: bool, states: Sequence[str]) -> list:
    """The weights under ``""`` and each optimizer state under ``<key>/`` (DeepSpeed's names, the model's order)."""
    sets = [("", model_tensors(ck, out_dtype, exclude_frozen))]
    for key in states:
        sets.append((key + "/", [PlannedTensor(p.name, p.name, key, "state", tuple(p.shape), "float32",
                                               tuple(ck.sources(p.name, key)))
                                 for p in ck.parameters if p.trainable and not p.tied_to
                                 and key in ck.state_keys(p.name)]))
    return sets


def requested_states(ck: Checkpoint, states: Sequence[str]) -> list[str]:
    """The per-element state keys ``states`` asks for (``"all"``: every key any group keeps), each checked.

    Raises:
        CkptError: a key no group keeps, or ``step`` (a scalar, not a per-element state)."""
    opt = ck.optimizer
    known = list(opt.state_keys) if opt else []
    out: list[str] = []
    for key in states:
        if key == "all":
            out += [k for k in known if k not in out]
            continue
        if key == "step":
            raise CkptError(f"the step ({opt.step if opt else None}) is a scalar, not a per-element state: "
                            "--states takes the keys kept per element (" + (", ".join(known) or "none") + "); the "
                            "step is written in the output's metadata", path=ck.location.tag_dir,
                            hint="--states all exports every per-element key")
        if key not in known:
            groups = opt.groups if opt else []
            raise CkptError(f"the optimizer state has no '{key}' (it has: {', '.join(known) or 'none'}"
                            + (f"; {describe_families(groups)}" if groups else "") + ")", path=ck.location.tag_dir,
                            hint="--states all exports every per-element key")
        if key not in out:
            out.append(key)
    return out


def shard_limit(max_shard_size: Union[int, str]) -> int:
    """``max_shard_size`` (bytes, or a size like ``5GB``) in bytes; a bad or non-positive size is refused."""
    try:
        limit = parse_size(max_shard_size)
    except ValueError as e:
        raise CkptError(str(e), hint="write sizes like 5GB, 500MB or 2GiB") from None
    if limit <= 0:
        raise CkptError("max_shard_size must be positive")
    return limit


def _plan_dcp(ck: Checkpoint, out, *, dtype: str, max_shard_size, states: Sequence[str], layout: str = "torch",
              optimizer: bool = False, **options):
    from .dcp import plan_dcp  # the DCP planner, loaded only for DCP exports

    return plan_dcp(ck, Path(out), layout=layout, optimizer=optimizer or bool(states), dtype=dtype,
                    max_shard_size=shard_limit(max_shard_size), **options)


def _side_files(ck: Checkpoint, out_dtype: str) -> tuple[list, list[str]]:
    """The Hugging Face files to copy beside the weights (``config.json`` as text with ``out_dtype``), and
    the note saying what was copied from where, or how to add a config."""
    found, folder = hf.model_files(ck.location.save_dir)
    if folder is None and looks_like_adapter(p.name for p in ck.parameters if p.trainable):
        return [], ["these are a peft adapter's tensors under the PeftModel's names, not a model: from_pretrained(OUT) "
                    "cannot load them (with a copied config.json it would build a randomly initialised model); "
                    "export without --no-adapter for what PeftModel.from_pretrained(base, OUT) loads"]
    if folder is None:
        return [], [f"no config.json beside the checkpoint ({ck.location.save_dir}): from_pretrained(OUT) needs "
                    "one; write it with model.config.save_pretrained(OUT), or copy the config.json of the model "
                    "you trained into OUT (--no-hf-files silences this)"]
    out: list = []
    for f in found:
        if f.name == hf.CONFIG:
            try:
                text = hf.config_with_dtype(Path(f.source).read_text(), out_dtype)
            except (OSError, ValueError) as e:
                raise CkptError(f"this config.json cannot be read as JSON ({e})", path=f.source,
                                hint="repair it, or export without it (--no-hf-files)") from None
            out.append(TextFile(f.name, text, kind="hf"))
        else:
            out.append(CopyFile(f.name, f.source, f.bytes, kind="hf"))
    where = "" if folder == ck.location.save_dir else f" (from {folder})"
    names = [f"{f.name} (dtype {out_dtype})" if f.name == hf.CONFIG else f.name for f in found]
    return out, [f"copied for from_pretrained{where}: {', '.join(names)}"]


__all__ = ["ExportPlan", "plan_export", "requested_states", "FORMATS"]
