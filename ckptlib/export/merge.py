"""A peft LoRA / DoRA adapter merged into its base model, as a plan like every other: what ``from_pretrained(OUT)`` loads.

``BASE`` is a local Hugging Face folder (``model.safetensors``, or shards with their index). The output has the
base's files and names; every weight a LoRA module targets becomes ``W + scaling · B @ A`` (an embedding's and a
Conv1D's, stored ``[in, out]`` as GPT-2's: ``(B @ A)ᵀ``; DoRA: rescaled to its magnitude vector, row by row, or column
by column for an embedding or a Conv1D; ``scaling`` the module's own where ``rank_pattern`` /
``alpha_pattern`` say so), each ``modules_to_save`` weight and each trained bias (``bias="lora_only"|"all"``) is the
trained one, a ``lora_bias`` module's bias gains ``scaling · lora_B.bias``, the rest is the base's. The adapter is
the checkpoint's fp32 masters. The arithmetic is peft 0.21's ``merge_and_unload()`` on a base loaded in the merge
dtype with the fp32 adapter, done with torch (:mod:`ckptlib.io.lora_merge`, so that the result is peft's bit for bit):

- ``merge_on="base-dtype"`` (default): the base is first rounded to the dtype the run trained against (the
  checkpoint's, e.g. bf16), merged there and written in that dtype: what the run's own ``merge_and_unload()`` gives;
- ``merge_on="fp32"``: merged on the fp32 base, written in fp32.

:func:`plan_merge` reads metadata only (the checkpoint's, the base's safetensors headers): the plan is plain data,
each merged weight a :class:`~ckptlib.plan.MergedTensor` (the base tensor's range, its dtype, the factors' ranges,
the scaling, the merge dtype), each untouched one a :class:`~ckptlib.plan.PlannedTensor` reading the base's bytes;
:func:`ckptlib.run` carries it out (the arithmetic in the writer), :func:`ckptlib.verify` re-reads the output (merged
weights against a recomputation, the rest against the base and the masters, bit for bit). :func:`merge_adapter` is
plan + run, and says how far the two modes lie apart (the largest difference over the merged weights).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional, Union

from ..deepspeed import Checkpoint, hf, open_checkpoint
from ..deepspeed.adapter import find_adapter
from ..deepspeed.exactness import require_exact, value_proofs
from ..dtypes import BY_SHORT, import_torch, is_floating
from ..errors import CkptError
from ..execute import RunResult, run
from ..io.lora_merge import (INDEX, WHY_TORCH, arithmetic_bytes, base_files, base_headers, largest_gap,
                             stored_ranges)
from ..io.crc import attach_crc
from ..io.jsonfile import read_json_object
from ..io.sources import stamp
from ..io.streaming import DEFAULT_CHUNK_BYTES
from ..kinds import adapters as A
from ..plan import THREADS, CopyFile, Factor, MergedTensor, Plan, PlannedTensor, RangeCheck, TextFile, WeightsFile
from ..progress import Observer
from ..units import human_bytes
from .weights import weights_file_size

MERGE_ON = ("base-dtype", "fp32")
#: what peft's parts are called in a :class:`~ckptlib.plan.Factor`
_ROLES = {"lora_A": "A", "lora_B": "B", "lora_embedding_A": "A", "lora_embedding_B": "B",
          "lora_magnitude_vector": "magnitude", "bias": "bias", "lora_bias": "lora_bias"}


@dataclass(kw_only=True, repr=False)
class MergePlan(Plan):
    """Everything a merge will do, from metadata (plain data; see :class:`ckptlib.plan.Plan`).

    Attributes:
        base: the base model's folder; merge_on: ``"base-dtype"`` or ``"fp32"``; run_dtype: the dtype the run
            trained against (a torch name); dtype: the output's (``run_dtype`` or ``"float32"``).
        files: the base's safetensors files, each tensor a :class:`~ckptlib.plan.MergedTensor` (a targeted weight,
            a trained bias), a ``modules_to_save`` weight (``kind="modules_to_save"``, the masters) or the base's own
            (``kind="base"``, streamed, cast to ``dtype`` where floating); then the base's config (with ``dtype``),
            tokenizer and generation config.
        method: the adapter as one line (``peft LoRA (r=4, alpha=8, scaling 2)``).
        predicted_peak_bytes: the streaming buffers of the untouched weights, plus what merging the largest targeted
            weight holds (:func:`ckptlib.io.lora_merge.arithmetic_bytes`: the weight as stored, its fp32 and
            merge-dtype copies, a few fp32 temporaries, its module's factors); never the model. torch itself is not
            counted: :func:`plan_merge` imports it, so a run in the planning process has it already.
    """

    action: ClassVar[str] = "merge"
    base: str
    merge_on: str
    run_dtype: str
    dtype: str
    method: str = ""
    index_files: dict = field(default_factory=dict)
    side_files: list = field(default_factory=list)
    parallel: str = THREADS

    @property
    def weights(self) -> list:
        return [f for f in self.files if isinstance(f, WeightsFile)]

    @property
    def tensors(self) -> list:
        return [t for f in self.weights for t in f.tensors]

    @property
    def merged(self) -> list:
        """The base weights a LoRA module changes (``W + scaling · B @ A``, DoRA rescaled)."""
        return [t.name for t in self.tensors if isinstance(t, MergedTensor) and t.how != "bias"]

    @property
    def biases(self) -> list:
        """The trained biases, and those ``lora_B``'s bias is added to."""
        return [t.name for t in self.tensors if isinstance(t, MergedTensor) and t.how == "bias"]

    @property
    def replaced(self) -> list:
        """The ``modules_to_save`` weights (the trained ones replace the base's)."""
        return [t.name for t in self.tensors if t.kind == "modules_to_save"]

    @property
    def largest_merge_bytes(self) -> int:
        return max((arithmetic_bytes(t) for t in self.tensors if isinstance(t, MergedTensor)), default=0)

    @property
    def predicted_peak_bytes(self) -> int:
        return super().predicted_peak_bytes + self.largest_merge_bytes

    @property
    def adapter_read_bytes(self) -> int:
        """Bytes of the checkpoint's masters read (factors, trained biases, ``modules_to_save``)."""
        return sum(sum(f.read_bytes for f in t.factors) if isinstance(t, MergedTensor) else
                   (t.read_bytes if t.kind == "modules_to_save" else 0) for t in self.tensors)

    def to_dict(self) -> dict:
        return {
            "source": self.source.tag_dir, "base": self.base, "out": str(self.out), "merge_on": self.merge_on,
            "dtype": self.dtype, "run_dtype": self.run_dtype, "method": self.method,
            "files": [{"name": f.name, "bytes": f.size, "tensors": [t.name for t in f.tensors]} for f in self.weights],
            "merged": self.merged, "biases": self.biases, "replaced": self.replaced,
            "index_files": self.index_files, "side_files": list(self.side_files), "read_bytes": self.read_bytes,
            "adapter_read_bytes": self.adapter_read_bytes, "write_bytes": self.write_bytes,
            "file_bytes": self.file_bytes, "largest_merge_bytes": self.largest_merge_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes, "notes": list(self.notes),
        }

    def describe(self) -> str:
        mode = (f"merged on the base rounded to {self.run_dtype}" if self.merge_on == "base-dtype" else
                "merged on the fp32 base")
        streamed = [t for t in self.tensors if t.kind == "base"]
        big = max((t for t in self.tensors if isinstance(t, MergedTensor)), key=arithmetic_bytes, default=None)
        lines = [
            f"merge {self.source.tag_dir}",
            f"    + base {self.base}",
            f"    -> {self.out}  (safetensors, {self.dtype}; --merge-on {self.merge_on}: {mode})",
            f"{self.method}: {len(self.merged)} weights merged"
            + (f", {len(self.replaced)} modules_to_save weights replaced" if self.replaced else "")
            + (f", {len(self.biases)} biases" if self.biases else "")
            + f"; {len(streamed)} base tensors streamed as they are"
            + (f" (cast to {self.dtype})" if any(t.ranges and t.ranges[0].dtype != t.dtype for t in streamed) else ""),
            f"reads {human_bytes(self.adapter_read_bytes)} of the adapter's fp32 masters (tag folder "
            f"{self.source.tag}) and {human_bytes(self.read_bytes - self.adapter_read_bytes)} of the base; "
            f"{self.writes_text()}",
            f"predicted peak memory: {human_bytes(self.predicted_peak_bytes)} (the largest merged weight"
            + (f", {big.name} {list(big.shape)}, held with its copies and factors: "
               f"{human_bytes(arithmetic_bytes(big))}" if big is not None else ": none")
            + f"; streaming buffers {human_bytes(Plan.predicted_peak_bytes.fget(self))}; torch's own import not "
            "counted)",
        ] + self.summary_lines()[2:]
        width = max([len(f.name) for f in self.weights] + [30])
        lines += [f"  {f.name:<{width}} {human_bytes(f.size):>10}  {len(f.tensors)} tensors" for f in self.weights]
        lines += [f"  {idx}" for idx in self.index_files]
        if self.side_files:
            lines.append(f"  + {', '.join(self.side_files)}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@dataclass
class MergeResult(RunResult):
    """What a merge did: the run's result (files, time, ``memory``) and the weights merged, replaced
    (``modules_to_save``) and biases set, the dtype written, and ``mode_gap``: the largest difference over the
    merged weights between the two ``--merge-on`` modes."""

    merged: list = field(default_factory=list)
    replaced: list = field(default_factory=list)
    biases: list = field(default_factory=list)
    dtype: str = ""
    mode_gap: float = 0.0
    notes: list = field(default_factory=list)

    def describe(self) -> str:
        return "\n".join([f"merged {len(self.merged)} weights, replaced {len(self.replaced)} (modules_to_save)"
                          + (f", {len(self.biases)} biases" if self.biases else "")
                          + f", {self.dtype}, into {self.out} in {self.seconds:.1f} s", RunResult.describe(self)]
                         + [f"note: {n}" for n in self.notes])


def plan_merge(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike],
               base: Union[str, os.PathLike, None], *, merge_on: str = "base-dtype", tag: Optional[str] = None,
               adapter_config=None, overwrite: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               sync: bool = True, verify_crc: bool = True) -> MergePlan:
    """Plan the merge of the checkpoint's peft adapter into ``base`` (see the module docstring); reads metadata only
    (the checkpoint's and the base's safetensors headers), and imports torch (the run's arithmetic needs it).
    ``verify_crc``: check the CRC-32 of the checkpoint's zip members the merge reads as their bytes stream (default;
    the base's safetensors record none).

    Memory: the plan itself; the run's is ``plan.predicted_peak_bytes`` (:class:`MergePlan`).

    Raises:
        CkptError: no base (with the command that would do it), no adapter, a base that does not hold a targeted
            weight or holds it in another shape (named), a square layer of a model with Conv1D layers ckptlib does not
            know (:func:`ckptlib.kinds.adapters.conv1d_modules`), a config whose ``rank_pattern`` gives a module
            another r than its factors have, an output folder that holds or is inside the base or the checkpoint, or
            is not empty."""
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag)
    if base is None:
        raise CkptError("merging needs the base model the adapter was trained on", path=ck.location.save_dir,
                        hint=f"ckpt export {ck.location.save_dir} OUT --merge --base BASE_MODEL_FOLDER")
    if merge_on not in MERGE_ON:
        raise CkptError(f"--merge-on takes {' or '.join(MERGE_ON)}, not {merge_on!r}")
    import_torch(WHY_TORCH)
    require_exact(ck)
    adapter = find_adapter(ck, adapter_config, required=True)
    c = adapter.config
    if c is None:
        raise CkptError("no adapter_config.json beside the tag", path=ck.location.tag_dir, hint="pass --adapter-config")
    base = Path(base).expanduser().resolve()
    files, index = base_files(base)
    out = Path(out).expanduser().resolve()
    for what, folder in (("the base", base), ("the checkpoint", Path(ck.location.save_dir).resolve())):
        if out == folder or folder in out.parents or out in folder.parents:
            raise CkptError(f"the output folder would hold, or be inside, {what} ({folder})", path=out,
                            hint="write the merged model into a folder of its own")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CkptError("the output folder is not empty", path=out, hint="choose another or pass --overwrite")
    run_dtype = BY_SHORT[ck.dtype].name if ck.dtype in BY_SHORT else "float32"
    out_dtype = run_dtype if merge_on == "base-dtype" else "float32"
    modules = A.base_tensors(adapter.names)
    headers = base_headers(files)
    held = {t.name: t for ts in headers.values() for t in ts}
    conv = _check_shapes(ck, c, adapter, modules, held, base)

    weights = []
    for f, tensors in headers.items():
        planned = [_planned(ck, c, f, t, modules.get(t.name), out_dtype, t.name in conv) for t in tensors]
        wf = WeightsFile(f.name, "safetensors", planned, {"format": "pt"})
        wf.size = weights_file_size(wf)
        weights.append(wf)
    finals, index_files = [], {}
    if index is not None:
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        total = sum(wf.nbytes for wf in weights)
        finals.append(TextFile(INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True) + "\n", kind="index"))
        index_files[INDEX] = [wf.name for wf in weights]
    side = hf.model_side_files(base)
    copies = [CopyFile(s.name, s.source, s.bytes, kind="hf") for s in side if s.name != hf.CONFIG]
    finals += [TextFile(s.name, _config_text(Path(s.source), out_dtype), kind="hf") for s in side if s.name == hf.CONFIG]
    factors = [x.source for wf in weights for t in wf.tensors for x in getattr(t, "factors", ())] + \
        [t.source for wf in weights for t in wf.tensors if t.kind == "modules_to_save"]
    checks = [RangeCheck(what, tuple(a), tuple(b), a[0].dtype if a else "float32")
              for name in factors for what, a, b in ck.replica_checks(name, None)] + value_proofs(ck)
    source = ck.source_ref()
    source = dataclasses.replace(source, stamps=source.stamps + tuple(
        stamp(os.fspath(p)) for p in [*files, *([index] if index else []), *(s.source for s in side)]))
    method = f"peft {c.method} (r={c.r}, alpha={c.alpha:g}, scaling {c.scaling:g}" + \
        (", per module where rank_pattern / alpha_pattern say" if c.patterns else "") + ")"
    plan = MergePlan(source=source, out=out, files=weights + copies, finals=finals, chunk_bytes=chunk_bytes,
                     overwrite=overwrite, sync=sync, checks=checks, base=os.fspath(base), merge_on=merge_on,
                     run_dtype=run_dtype, dtype=out_dtype, method=method, index_files=index_files,
                     side_files=[s.name for s in side])
    plan.notes = merge_notes(plan, None)
    attach_crc(plan, ck.zip_entries() if verify_crc else None)
    return plan


def _config_text(path: Path, dtype: str) -> str:
    """The base's ``config.json`` with the written dtype (:func:`ckptlib.deepspeed.hf.config_with_dtype`).

    Raises:
        CkptError: it is not a JSON object (named)."""
    try:
        return hf.config_with_dtype(path.read_text(), dtype)
    except (OSError, ValueError, TypeError) as e:
        raise CkptError(f"not a readable config ({e})", path=path,
                        hint="give the base model's folder as save_pretrained wrote it") from None


def _check_shapes(ck: Checkpoint, c, adapter, modules: dict, held: dict, base: Path) -> set:
    """Every tensor the adapter changes is in the base, in the adapter's shape (a linear layer's ``[out, in]``, or
    ``[in, out]`` where it is a Conv1D: :func:`ckptlib.kinds.adapters.conv1d_modules`), a DoRA magnitude has one value
    a row (a column of an embedding or a Conv1D), and each factor has the rank the config gives its module (else its
    scaling would not be peft's). Returns the base tensors stored transposed (Conv1D weights)."""
    shapes = {p.name: tuple(p.shape) for p in ck.parameters}
    linear = {}
    for module, parts in modules.items():
        w = held.get(module)
        if w is None:
            raise CkptError(f"the base holds no {module}, which the adapter trains", path=base,
                            hint="give the base model the adapter was trained on")
        if "lora_A" in parts:  # [out, in], or [in, out]: conv1d_modules tells
            linear[module.rsplit(".", 1)[0]] = (tuple(w.shape), shapes[parts["lora_A"]][1], shapes[parts["lora_B"]][0])
            expect = tuple(w.shape)
        elif "whole" in parts or "bias" in parts or "lora_bias" in parts:
            expect = shapes[parts.get("whole") or parts.get("bias") or parts["lora_bias"]]
        else:  # an embedding: A [r, vocab], B [hidden, r]; the embedding is [vocab, hidden]
            expect = (shapes[parts["lora_embedding_A"]][1], shapes[parts["lora_embedding_B"]][0])
        b = parts.get("lora_B") or parts.get("lora_embedding_B")
        magnitude = parts.get("lora_magnitude_vector")
        if b is not None and (magnitude is not None) != c.use_dora:
            raise CkptError(f"the adapter config {'sets' if c.use_dora else 'does not set'} use_dora, but "
                            f"{module.rsplit('.', 1)[0]} has {'no' if c.use_dora else 'a'} DoRA magnitude "
                            "(lora_magnitude_vector) in the checkpoint: the config is not this adapter's",
                            path=adapter.config_path, hint="give the adapter_config.json the run saved (--adapter-config)")
        if magnitude is not None and shapes[magnitude] != (shapes[b][0],):
            raise CkptError(f"{magnitude} holds {list(shapes[magnitude])} values, {b} has {shapes[b][0]} rows: no "
                            "DoRA magnitude of this module", path=ck.location.tag_dir)
        if tuple(w.shape) != expect:
            raise CkptError(f"the base's {module} is {list(w.shape)}, the adapter's is {list(expect)}: "
                            "another model", path=base, hint="give the base model the adapter was trained on")
        factor = parts.get("lora_A") or parts.get("lora_embedding_A")
        path = module.rsplit(".", 1)[0]
        if factor is not None and shapes[factor][0] != c.module_scaling(path)[0]:
            raise CkptError(f"{factor} has rank {shapes[factor][0]}, but the adapter config gives {path} "
                            f"r={c.module_scaling(path)[0]} (r, rank_pattern): its scaling would not be peft's",
                            path=adapter.config_path, hint="give the adapter_config.json the run saved (--adapter-config)")
    return {m + ".weight" for m in A.conv1d_modules(linear, _model_type(base), c.fan_in_fan_out, base)}


def _model_type(base: Path) -> Optional[str]:
    """The ``model_type`` the base's ``config.json`` says (None: no config, or none in it)."""
    path = base / hf.CONFIG
    if not path.is_file():
        return None
    value = read_json_object(path, "the base model's config").get("model_type")
    return value if isinstance(value, str) else None


def _planned(ck: Checkpoint, c, path: Path, t, parts: Optional[dict], out_dtype: str, conv: bool = False):
    """One tensor of the merged model: the base's own (streamed), a ``modules_to_save`` weight (the masters), or a
    :class:`~ckptlib.plan.MergedTensor` (``conv``: a Conv1D weight, stored transposed)."""
    shape, ranges = tuple(t.shape), stored_ranges(path, t)
    if parts is None:
        return PlannedTensor(t.name, t.name, None, "base", shape, out_dtype if is_floating(t.dtype) else t.dtype,
                             ranges)
    if "whole" in parts:
        return PlannedTensor(t.name, parts["whole"], None, "modules_to_save", shape, out_dtype,
                             tuple(ck.sources(parts["whole"])))
    factors = tuple(Factor(_ROLES[part], name, tuple(ck.param(name).shape), tuple(ck.sources(name)))
                    for part, name in parts.items())
    dora = "lora_magnitude_vector" in parts
    how = "bias" if ("bias" in parts or "lora_bias" in parts) else \
        ("dora_embedding" if dora else "embedding") if "lora_embedding_A" in parts else \
        ("dora_conv1d" if conv else "dora") if dora else "conv1d" if conv else "linear"
    return MergedTensor(t.name, shape, out_dtype, how, out_dtype, c.module_scaling(t.name.rsplit(".", 1)[0])[2],
                        factors, ranges)


def merge_notes(plan: MergePlan, gap: Optional[float]) -> list[str]:
    """What a merge says: the adapter and what it changed; the mode, and how far the other lies apart (``gap``; None:
    not yet known, before the run)."""
    apart = "the run says how far apart" if gap is None else f"up to {gap:.3g} apart here"
    first = (f"{plan.method} merged from the fp32 masters into {len(plan.merged)} weights of {plan.base}"
             + (f"; {len(plan.replaced)} modules_to_save weights replaced" if plan.replaced else "")
             + (f"; {len(plan.biases)} biases trained or with lora_B's bias added" if plan.biases else ""))
    if plan.merge_on == "base-dtype":
        mode = (f"merged on the base rounded to {plan.run_dtype} (the dtype the run trained against), written in "
                f"{plan.dtype}: what the run's own merge_and_unload() gives; --merge-on fp32 merges on the fp32 "
                f"base instead ({apart})")
    else:
        mode = (f"merged on the fp32 base, written in fp32; --merge-on base-dtype merges on the base rounded to "
                f"{plan.run_dtype}, as the run trained ({apart})")
    return [first, mode]


def run_merge(plan: MergePlan, observer: Optional[Observer] = None,
              cancel: Optional[threading.Event] = None) -> MergeResult:
    """Run a merge plan (:func:`ckptlib.run`: atomic output, progress, ``cancel``, ``memory``), then compute how far
    the two ``--merge-on`` modes lie apart (:func:`ckptlib.io.lora_merge.largest_gap`: the targeted weights read
    once more, one at a time)."""
    result = run(plan, observer=observer, cancel=cancel)
    gap = largest_gap([t for t in plan.tensors if isinstance(t, MergedTensor)], plan.run_dtype)
    return MergeResult(**{f.name: getattr(result, f.name) for f in dataclasses.fields(RunResult)},
                       merged=plan.merged, replaced=plan.replaced, biases=plan.biases, dtype=plan.dtype,
                       mode_gap=gap, notes=merge_notes(plan, gap))


def merge_adapter(checkpoint: Union[Checkpoint, str, os.PathLike, MergePlan], out: Union[str, os.PathLike, None] = None,
                  base: Union[str, os.PathLike, None] = None, *, merge_on: str = "base-dtype",
                  tag: Optional[str] = None, adapter_config=None, overwrite: bool = False,
                  observer: Optional[Observer] = None, cancel: Optional[threading.Event] = None) -> MergeResult:
    """Merge the checkpoint's peft adapter into ``base`` and write the merged model to ``out`` (see the module
    docstring): :func:`plan_merge` (or the plan given), then :func:`run_merge`. Needs torch.

    Memory: ``plan.predicted_peak_bytes`` (:class:`MergePlan`): a targeted weight held with a few fp32 copies and
    its module's factors while it is merged; the untouched weights streamed; never the model.

    Raises:
        CkptError: as :func:`plan_merge`; the run's refusals (a source changed since the plan, the output taken)."""
    plan = checkpoint if isinstance(checkpoint, MergePlan) else plan_merge(
        checkpoint, out, base, merge_on=merge_on, tag=tag, adapter_config=adapter_config, overwrite=overwrite)
    return run_merge(plan, observer=observer, cancel=cancel)


__all__ = ["plan_merge", "merge_adapter", "run_merge", "merge_notes", "MergePlan", "MergeResult", "MERGE_ON"]
