"""A peft LoRA / DoRA adapter merged into its base model, tensor by tensor: what ``from_pretrained(OUT)`` loads as is.

``BASE`` is a local Hugging Face folder (``model.safetensors``, or shards with their index). The output has the
base's files and names; every weight a LoRA module targets becomes ``W + scaling · B @ A`` (an embedding's: ``(B @ A)ᵀ``;
DoRA: rescaled row by row to its magnitude vector; ``scaling`` the module's own where ``rank_pattern`` /
``alpha_pattern`` say so), each ``modules_to_save`` weight and each trained bias (``bias="lora_only"|"all"``) is the
trained one, a ``lora_bias`` module's bias gains ``scaling · lora_B.bias``, the rest is the base's. The adapter is
the checkpoint's fp32 masters. The arithmetic is peft 0.21's ``merge_and_unload()`` on a base loaded in the merge
dtype with the fp32 adapter, done with torch (as peft does it, so that the result is peft's bit for bit):

- ``merge_on="base-dtype"`` (default): the base is first rounded to the dtype the run trained against (the
  checkpoint's, e.g. bf16), merged there and written in that dtype: what the run's own ``merge_and_unload()`` gives;
- ``merge_on="fp32"``: merged on the fp32 base, written in fp32.

The result notes how far the two modes lie apart (the largest difference over the merged weights). Memory: a weight
the adapter leaves alone goes through in 64 MB pieces (copied, or cast piece by piece); a targeted one is held with
a few fp32 copies and its module's factors while it is merged; never the model (tests/fixtures/peft/merge_memory.py:
416 MB peak on a 1.1 GB base, 223 MB of it the imports).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..deepspeed import Checkpoint, hf, open_checkpoint
from ..deepspeed.adapter import find_adapter
from ..deepspeed.exactness import require_exact
from ..dtypes import BY_SHORT, import_torch, itemsize, torch_dtype
from ..errors import CkptError
from ..io.stformat import SafetensorsLayout, TensorSpec, read_header
from ..kinds import adapters as A

MERGE_ON = ("base-dtype", "fp32")
_COPY_CHUNK = 64 << 20


@dataclass
class MergeResult:
    out: Path
    merged: list = field(default_factory=list)       # base weights replaced by W + scaling * B @ A
    replaced: list = field(default_factory=list)     # modules_to_save weights
    biases: list = field(default_factory=list)       # trained biases, and biases plus scaling * lora_B.bias
    dtype: str = ""
    seconds: float = 0.0
    mode_gap: float = 0.0                             # max |base-dtype merge - fp32 merge| over merged weights
    notes: list = field(default_factory=list)

    def describe(self) -> str:
        return "\n".join([f"merged {len(self.merged)} weights, replaced {len(self.replaced)} (modules_to_save)"
                          + (f", {len(self.biases)} biases" if self.biases else "")
                          + f", {self.dtype}, into {self.out} in {self.seconds:.1f} s"] + [f"note: {n}" for n in self.notes])


def _base_files(base: Path) -> tuple[list[Path], Optional[Path]]:
    index = base / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set((json.loads(index.read_text()).get("weight_map") or {}).values()))
        return [base / n for n in names], index
    if (base / "model.safetensors").is_file():
        return [base / "model.safetensors"], None
    raise CkptError("the base holds no model.safetensors (or shards with model.safetensors.index.json)", path=base,
                    hint="give the local folder of the base model the adapter was trained on (save_pretrained's)")


_PARTS = {"lora_A.weight": ("weight", "lora_A"), "lora_B.weight": ("weight", "lora_B"),
          "lora_B.bias": ("bias", "lora_bias"), "lora_magnitude_vector": ("weight", "lora_magnitude_vector"),
          "lora_embedding_A": ("weight", "lora_embedding_A"), "lora_embedding_B": ("weight", "lora_embedding_B")}


def _tensor_of(saved: str, kind: str) -> tuple[str, str]:
    """``(the base tensor it changes, part)`` of a peft saved name: ``base_model.model.<m>.lora_A.weight`` ->
    ``(<m>.weight, lora_A)``, ``<m>.lora_B.bias`` -> ``(<m>.bias, lora_bias)``; a trained bias (``<m>.base_layer.bias``
    of a targeted module, ``<m>.bias`` of another) -> ``(<m>.bias, bias)``; a ``modules_to_save`` tensor -> ``(<its
    name in the base>, whole)``."""
    rest = saved[len(A.PREFIX):]
    for suffix, (param, part) in _PARTS.items():
        if rest.endswith("." + suffix):
            return f"{rest[:-len(suffix) - 1]}.{param}", part
    if kind == A.BIAS:
        return rest.replace(".base_layer.bias", ".bias") if rest.endswith(".base_layer.bias") else rest, "bias"
    return rest, "whole"


def merge_adapter(checkpoint: Union[Checkpoint, str, os.PathLike], out: Union[str, os.PathLike],
                  base: Union[str, os.PathLike, None], *, merge_on: str = "base-dtype", tag: Optional[str] = None,
                  adapter_config=None, overwrite: bool = False) -> MergeResult:
    """Merge the checkpoint's peft adapter into ``base`` and write the merged model to ``out`` (see the module
    docstring). Needs torch (the arithmetic is torch's, as peft's).

    Raises:
        CkptError: no base (with the command that would do it), no adapter, a method or option whose merge ckptlib
            has not checked, a base that does not hold a targeted weight or holds it in another shape (named)."""
    ck = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint, tag=tag)
    if base is None:
        raise CkptError("merging needs the base model the adapter was trained on", path=ck.location.save_dir,
                        hint=f"ckpt export {ck.location.save_dir} OUT --merge --base BASE_MODEL_FOLDER")
    if merge_on not in MERGE_ON:
        raise CkptError(f"--merge-on takes {' or '.join(MERGE_ON)}, not {merge_on!r}")
    torch = import_torch("merging an adapter into its base (peft's arithmetic)")
    require_exact(ck)
    adapter = find_adapter(ck, adapter_config, required=True)
    c = adapter.config
    if c is None:
        raise CkptError("no adapter_config.json beside the tag", path=ck.location.tag_dir, hint="pass --adapter-config")
    if c.raw.get("fan_in_fan_out"):
        raise CkptError("the adapter config sets fan_in_fan_out (Conv1D's transposed weights, GPT-2): ckptlib's merge "
                        "has not been checked against peft's with it",
                        hint="export the adapter (--adapter), load it with peft and merge_and_unload()")
    if c.use_dora and any(k in (A.EMB_A, A.EMB_B) for k, _ in adapter.names.values()):
        raise CkptError("DoRA on an embedding: ckptlib's merge has not been checked against peft's with it",
                        hint="export the adapter (--adapter), load it with peft and merge_and_unload()")
    base = Path(base).expanduser().resolve()
    files, index = _base_files(base)
    out = Path(out).expanduser().resolve()
    for what, folder in (("the base", base), ("the checkpoint", Path(ck.location.save_dir).resolve())):
        if out == folder or folder in out.parents or out in folder.parents:
            raise CkptError(f"the output folder would hold, or be inside, {what} ({folder})", path=out,
                            hint="write the merged model into a folder of its own")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CkptError("the output folder is not empty", path=out, hint="choose another or pass --overwrite")
    run_dtype = BY_SHORT[ck.dtype].name if ck.dtype in BY_SHORT else "float32"
    out_dtype = run_dtype if merge_on == "base-dtype" else "float32"

    modules: dict[str, dict] = {}
    for name, (kind, saved) in adapter.names.items():
        tensor, part = _tensor_of(saved, kind)
        modules.setdefault(tensor, {})[part] = name
    infos = {}
    for f in files:
        try:
            _, tensors = read_header(f)
        except (OSError, ValueError) as e:
            raise CkptError(f"not a readable safetensors file ({e})", path=f) from None
        infos[f] = tensors
    held = {t.name: t for ts in infos.values() for t in ts}
    shapes = {p.name: tuple(p.shape) for p in ck.parameters}
    for module, parts in modules.items():
        w = held.get(module)
        if w is None:
            raise CkptError(f"the base holds no {module}, which the adapter trains", path=base,
                            hint="give the base model the adapter was trained on")
        if "whole" in parts or "bias" in parts or "lora_bias" in parts:
            expect = shapes[parts.get("whole") or parts.get("bias") or parts["lora_bias"]]
        elif "lora_embedding_A" in parts:  # A [r, vocab], B [hidden, r]: the embedding is [vocab, hidden]
            expect = (shapes[parts["lora_embedding_A"]][1], shapes[parts["lora_embedding_B"]][0])
        else:
            expect = (shapes[parts["lora_B"]][0], shapes[parts["lora_A"]][1])
        if tuple(w.shape) != expect:
            raise CkptError(f"the base's {module} is {list(w.shape)}, the adapter's is {list(expect)}: "
                            "another model", path=base, hint="give the base model the adapter was trained on")
        factor = parts.get("lora_A") or parts.get("lora_embedding_A")
        if factor is not None and shapes[factor][0] != c.module_scaling(module.rsplit(".", 1)[0])[0]:
            raise CkptError(f"{factor} has rank {shapes[factor][0]}, but the adapter config gives "
                            f"{module.rsplit('.', 1)[0]} r={c.module_scaling(module.rsplit('.', 1)[0])[0]} (r, "
                            "rank_pattern): its scaling would not be peft's", path=adapter.config_path,
                            hint="give the adapter_config.json the run saved (--adapter-config)")

    result = MergeResult(out=out, dtype=out_dtype)
    t0 = time.perf_counter()
    tmp = out.parent / f".{out.name}.merging-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    td_run, td_out = torch_dtype(run_dtype), torch_dtype(out_dtype)
    try:
        for f, tensors in infos.items():
            layout = SafetensorsLayout([TensorSpec(t.name, out_dtype if _floating(t.dtype) else t.dtype, t.shape)
                                        for t in tensors])
            dst = tmp / f.name
            layout.create(dst)
            with open(f, "rb") as src, open(dst, "r+b") as w:
                for t in tensors:
                    w.seek(layout.tensor_offset(t.name))
                    parts = modules.get(t.name)
                    if parts is None and (not _floating(t.dtype) or t.dtype == out_dtype):
                        src.seek(t.offset)
                        left = t.nbytes
                        while left:
                            buf = src.read(min(left, _COPY_CHUNK))
                            w.write(buf)
                            left -= len(buf)
                        continue
                    src.seek(t.offset)
                    if parts is None:  # cast piece by piece (64 MB of the stored dtype at a time)
                        step = max(1, _COPY_CHUNK // itemsize(t.dtype))
                        for start in range(0, _numel(t.shape), step):
                            count = min(step, _numel(t.shape) - start)
                            piece = torch.frombuffer(bytearray(src.read(count * itemsize(t.dtype))),
                                                     dtype=torch_dtype(t.dtype))
                            w.write(piece.to(td_out).view(torch.uint8).numpy().tobytes())
                        continue
                    value = torch.frombuffer(bytearray(src.read(t.nbytes)), dtype=torch_dtype(t.dtype)).reshape(t.shape)
                    scaling = c.module_scaling(t.name.rsplit(".", 1)[0])[2]
                    if "whole" in parts:
                        value = ck.read_param(parts["whole"]).to(td_out)
                        result.replaced.append(t.name)
                    else:
                        how = _merged_bias if "bias" in parts or "lora_bias" in parts else _merged
                        value, gap = how(torch, ck, value, parts, scaling, td_run if merge_on == "base-dtype" else None)
                        result.mode_gap = max(result.mode_gap, gap)
                        (result.merged if how is _merged else result.biases).append(t.name)
                    w.write(value.contiguous().view(torch.uint8).numpy().tobytes())
        if index is not None:
            total = sum(itemsize(out_dtype if _floating(t.dtype) else t.dtype) * _numel(t.shape)
                        for ts in infos.values() for t in ts)
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
            (tmp / index.name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2, sort_keys=True) + "\n")
        for side in hf.model_side_files(base):
            target = tmp / side.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if side.name == hf.CONFIG:
                target.write_text(hf.config_with_dtype(Path(side.source).read_text(), out_dtype))
            else:
                shutil.copyfile(side.source, target)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    result.notes = [f"peft {c.method} (r={c.r}, alpha={c.alpha:g}, scaling {c.scaling:g}"
                    + (", per module where rank_pattern / alpha_pattern say" if c.patterns else "")
                    + f") merged from the fp32 masters into {len(result.merged)} weights of {base}"
                    + (f"; {len(result.replaced)} modules_to_save weights replaced" if result.replaced else "")
                    + (f"; {len(result.biases)} biases trained or with lora_B's bias added" if result.biases else ""),
                    (f"merged on the base rounded to {run_dtype} (the dtype the run trained against), written in "
                     f"{out_dtype}: what the run's own merge_and_unload() gives; --merge-on fp32 merges on the fp32 "
                     f"base instead (up to {result.mode_gap:.3g} apart here)") if merge_on == "base-dtype" else
                    (f"merged on the fp32 base, written in fp32; --merge-on base-dtype merges on the base rounded to "
                     f"{run_dtype}, as the run trained (up to {result.mode_gap:.3g} apart here)")]
    return result


def _merged(torch, ck: Checkpoint, w, parts: dict, scaling: float, run_dtype):
    """``(merged weight, gap)``: peft's merge of one module (its ``scaling``) on ``w`` rounded to ``run_dtype`` (None:
    fp32), and the largest difference from the merge in the other mode."""
    embedding = "lora_embedding_A" in parts
    a = ck.read_param(parts["lora_embedding_A" if embedding else "lora_A"])
    b = ck.read_param(parts["lora_embedding_B" if embedding else "lora_B"])
    # fp32, as peft's get_delta_weight with fp32 factors (an embedding's: B @ A transposed, then scaled)
    delta = (b @ a).T * scaling if embedding else (b @ a) * scaling
    magnitude = ck.read_param(parts["lora_magnitude_vector"]) if "lora_magnitude_vector" in parts else None

    def merge(base):
        if embedding:  # peft adds the delta rounded to the weight's dtype first
            return base + delta.to(base.dtype)
        if magnitude is None:
            return (base.float() + delta).to(base.dtype)
        norm = torch.linalg.norm(base + delta, dim=1).to(torch.float32)
        return ((magnitude / norm).view(-1, 1) * (base + delta)).to(base.dtype)

    return _both(torch, ck, w.to(torch.float32), merge, run_dtype)


def _merged_bias(torch, ck: Checkpoint, b, parts: dict, scaling: float, run_dtype):
    """``(bias, gap)`` of a module whose bias trained (``parts["bias"]``: peft loads it into the base model, in the
    merge dtype) and / or has ``lora_B``'s bias (``lora_bias``: peft's merge adds ``scaling · lora_B.bias`` to it, in
    place), as :func:`_merged`."""
    start = ck.read_param(parts["bias"]) if "bias" in parts else b.to(torch.float32)
    extra = ck.read_param(parts["lora_bias"]) * scaling if "lora_bias" in parts else None

    def merge(base):
        return base if extra is None else (base.float() + extra).to(base.dtype)

    return _both(torch, ck, start, merge, run_dtype)


def _both(torch, ck: Checkpoint, w32, merge, run_dtype):
    """``merge`` on ``w32`` rounded to ``run_dtype`` (None: on ``w32``) and the largest difference from the other."""
    in_fp32 = merge(w32)
    if run_dtype is None:
        other = merge(w32.to(torch.bfloat16) if ck.dtype == "bf16" else w32.to(torch.float16)) \
            if ck.dtype in ("bf16", "fp16") else in_fp32
        return in_fp32, float((in_fp32 - other.float()).abs().max()) if other is not in_fp32 else 0.0
    mine = merge(w32.to(run_dtype))
    return mine, float((mine.float() - in_fp32).abs().max())


def _floating(dtype: str) -> bool:
    return dtype in ("float32", "bfloat16", "float16", "float64")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = ["merge_adapter", "MergeResult", "MERGE_ON"]
