"""What ``ckpt inspect`` says of a peft adapter checkpoint, and the check of peft's ``adapter_model.safetensors``
beside it against the fp32 masters (read as a safetensors file: its header, then its bytes; never unpickled).

The file the Trainer writes beside the tag is, depending on the transformers version and the ZeRO stage, empty (no
tensor, or 0-element tensors: transformers 4.x at ZeRO-3 without the 16-bit gather, a script's own
``save_pretrained`` at ZeRO-3), the 16-bit copy of the masters (each value the master rounded to the file's dtype:
transformers 5), or something else (an older save, another run). :func:`check_weights_file` tells which.
"""
from __future__ import annotations

from typing import Any, Optional

from ..deepspeed import Checkpoint
from ..deepspeed.adapter import Adapter, find_adapter
from ..errors import CkptError
from ..kinds import adapters as A
from ..units import human_bytes
from .compare import Comparer
from .tensorsets import checkpoint_tensors, file_tensors

EMPTY, SAME, COPY16, DIFFERENT, NAMES = "empty", "the fp32 masters", "16-bit copy of the masters", "different", \
    "other names"


def check_weights_file(ck: Checkpoint, adapter: Adapter) -> Optional[dict]:
    """``{"path", "bytes", "status", "tensors", "dtype", "detail"}`` of the adapter file beside the tag (None: none
    there). ``status``: :data:`EMPTY`, :data:`SAME` (bit for bit), :data:`COPY16` (every value the master rounded to
    the file's 16-bit dtype), :data:`DIFFERENT` (``detail`` names the tensors and the largest difference) or
    :data:`NAMES` (the names do not pair with the checkpoint's). Reads the file and the masters once."""
    from pathlib import Path

    path = adapter.weights_file
    if path is None:
        return None
    try:
        stored = {t.key: t for t in file_tensors(Path(path))}
    except CkptError as e:
        return {"path": path, "bytes": Path(path).stat().st_size, "status": "unreadable", "tensors": 0,
                "dtype": None, "detail": str(e)}
    out: dict[str, Any] = {"path": path, "bytes": Path(path).stat().st_size, "tensors": len(stored),
                           "dtype": ", ".join(sorted({t.dtype for t in stored.values()})) or None, "detail": ""}
    if not stored or all(t.numel == 0 for t in stored.values()):
        out["status"] = EMPTY
        out["detail"] = (f"{len(stored)} tensors, all with 0 elements" if stored else "no tensor") + \
            ": PeftModel.from_pretrained loads it with the untrained adapter"
        return out
    masters = checkpoint_tensors(ck)
    saved = {s: n for n, (_, s) in adapter.names.items()}
    missing, extra = sorted(set(saved) - set(stored)), sorted(set(stored) - set(saved))
    # peft saves a targeted embedding's base weight too (save_embedding_layers="auto"): frozen, not in the checkpoint
    base_copies = [n for n in extra if n.endswith(".base_layer.weight")]
    extra = [n for n in extra if n not in base_copies]
    if base_copies:
        out["detail"] = f"beside the adapter, {len(base_copies)} base weights peft saves for a targeted embedding " \
                        f"({base_copies[0]}), not compared: the checkpoint holds no frozen weight"
        stored = {k: v for k, v in stored.items() if k not in base_copies}
    if missing or extra:
        out["status"] = NAMES
        out["detail"] = (f"{len(missing)} of the checkpoint's adapter tensors not in it"
                         + (f" (e.g. {missing[0]})" if missing else "") + f"; {len(extra)} not in the checkpoint"
                         + (f" (e.g. {extra[0]})" if extra else ""))
        return out
    cmp = Comparer()
    try:
        exact, rounded, worst, differ = True, True, 0.0, []
        for s, t in stored.items():
            m = masters[saved[s]]
            if tuple(m.shape) != tuple(t.shape):
                differ.append(f"{s} shape {list(t.shape)}, master {list(m.shape)}")
                exact = rounded = False
                continue
            if cmp.equal(m.ranges, t.ranges, "float32") and t.dtype == "float32":
                continue
            exact = False
            if t.dtype in ("bfloat16", "float16") and cmp.equal(m.ranges, t.ranges, t.dtype):
                worst = max(worst, cmp.difference(m.ranges, t.ranges).max_abs_diff)
                continue
            rounded = False
            d = cmp.difference(m.ranges, t.ranges)
            worst = max(worst, d.max_abs_diff)
            differ.append(f"{s} ({d.changed:,} of {d.numel:,} elements, max |diff| {d.max_abs_diff:.3g})")
    finally:
        cmp.close()
    first = out["detail"]
    if exact:
        out["status"] = SAME
    elif rounded:
        out["status"] = COPY16
        out["detail"] = f"up to {worst:.3g} from the fp32 masters"
    else:
        out["status"] = DIFFERENT
        out["detail"] = f"{len(differ)} tensors differ from the masters: " + "; ".join(differ[:3]) + \
            (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    out["detail"] = "; ".join(d for d in (out["detail"], first) if d)
    return out


def describe_adapter(ck: Checkpoint, check_file: bool = True) -> Optional[dict]:
    """The JSON form of what inspect says of the adapter (None: the checkpoint trains none). An adapter whose
    config cannot be placed is described with ``refused`` (the reason) instead of raising."""
    try:
        adapter = find_adapter(ck)
    except CkptError as e:
        return {"refused": str(e)}
    if adapter is None:
        return None
    c = adapter.config
    params = {p.name: p for p in ck.parameters}
    return {
        "method": c.method if c else None, "peft_type": c.peft_type if c else None,
        "r": c.r if c else None, "alpha": c.alpha if c else None, "scaling": c.scaling if c else None,
        "target_modules": (c.target_modules if c else None), "modules_to_save": list(c.modules_to_save) if c else None,
        "rank_pattern": dict(c.rank_pattern) if c else None, "alpha_pattern": dict(c.alpha_pattern) if c else None,
        "bias": c.bias if c else None, "lora_bias": c.lora_bias if c else None,
        "fan_in_fan_out": c.fan_in_fan_out if c else None, "dora_embeddings": A.dora_embeddings(adapter.names),
        "config": adapter.config_path, "tensors": len(adapter.names), "counts": adapter.counts,
        "trainable_elements": sum(params[n].numel for n in adapter.names),
        "base_in_checkpoint": bool(adapter.frozen), "base": adapter.base_line(),
        "weights_file": check_weights_file(ck, adapter) if check_file else None,
    }


def adapter_rows(d: Optional[dict]) -> list[tuple[str, str]]:
    """The rows of the summary for the adapter, ``(label, text)`` as :func:`ckptlib.analysis.summary.summary_rows`
    gives them (none when there is no adapter)."""
    if not d:
        return []
    if "refused" in d:
        return [("adapter", f"a peft adapter ckptlib cannot place: {d['refused']}")]
    kinds = ", ".join(f"{n} {k}" for k, n in d["counts"].items())
    if d["method"]:
        targets = d["target_modules"] if isinstance(d["target_modules"], str) else ", ".join(d["target_modules"])
        rows = [("adapter", f"peft {d['method']}: r={d['r']} alpha={d['alpha']:g} (scaling {d['scaling']:g}); "
                            f"target modules {targets}"
                            + (f"; modules_to_save {', '.join(d['modules_to_save'])}" if d["modules_to_save"] else ""))]
        per_module = [f"{k} {', '.join(f'{p}: {v:g}' for p, v in d[k].items())}" for k in ("rank_pattern", "alpha_pattern")
                      if d.get(k)]
        trained = ([f"bias={d['bias']!r}"] if d.get("bias") not in (None, "none") else []) + \
            (["lora_bias (lora_B has a bias)"] if d.get("lora_bias") else [])
        if per_module or trained:
            rows.append(("", "; ".join((["per module: " + "; ".join(per_module)] if per_module else [])
                                       + (["biases: " + ", ".join(trained)] if trained else []))))
        layers = (["fan_in_fan_out (peft's flag for Conv1D layers, whose weights are stored transposed, [in, out], as "
                   "GPT-2's: their delta is (B @ A)ᵀ)"] if d.get("fan_in_fan_out") else []) + \
            ([f"DoRA on the embedding {', '.join(d['dora_embeddings'])} (a magnitude per hidden feature, the "
              "embedding's columns)"] if d.get("dora_embeddings") else [])
        if layers:
            rows.append(("", "layers: " + "; ".join(layers)))
    else:
        rows = [("adapter", f"a peft adapter (no {'adapter_config.json'} beside the tag: "
                            "export --adapter takes --adapter-config)")]
    rows.append(("", f"{d['tensors']} adapter tensors ({kinds}), {d['trainable_elements']:,} elements"))
    rows.append(("", f"base weights: {d['base']}"))
    f = d["weights_file"]
    if f is None:
        rows.append(("", "no adapter_model.safetensors beside the tag"))
    else:
        rows.append(("", f"adapter_model.safetensors beside the tag ({human_bytes(f['bytes'])}, "
                         f"{f['tensors']} tensors{', ' + f['dtype'] if f['dtype'] else ''}): {f['status'].upper()}"
                         + (f"; {f['detail']}" if f["detail"] else "")))
        if f["status"] != SAME:
            rows.append(("", "ckpt export CKPT OUT --adapter writes the fp32 masters under peft's names"))
    return rows


def module_rows(ck: Checkpoint, base=None, adapter: Optional[Adapter] = None) -> list[dict]:
    """One row per base tensor the adapter changes, in the checkpoint's order: ``module`` (its path in the base
    model), ``tensor`` (the base tensor), ``method`` (the config's: LoRA, rsLoRA, DoRA, DoRA + rsLoRA; or
    ``modules_to_save``, ``bias``), ``r``, ``alpha``, ``scaling`` (the module's own where ``rank_pattern`` /
    ``alpha_pattern`` say, and ``patterns`` then names the keys), ``tensors`` (the adapter's tensors of it, with their
    shapes), and how far it moved:

    - ``delta_norm``: ``‖scaling · B @ A‖_F`` of a LoRA module, computed without forming ``B @ A``
      (``‖B A‖²_F = Σ (BᵀB) ∘ (A Aᵀ)``, the two r × r Gram matrices in float64). For DoRA it is the change before
      the magnitude rescale (DoRA then scales each row of ``W + ΔW`` to its trained magnitude). A trained
      ``modules_to_save`` weight or bias: ``‖trained − base‖_F`` (needs ``base``); a bias that only gains
      ``scaling · lora_B.bias``: that term's norm;
    - with ``base`` (the base model's folder): ``base_norm`` (``‖W‖_F`` of the base tensor, streamed, float64) and
      ``ratio`` (``delta_norm / base_norm``); else None.

    Reads the adapter's factors whole (r × d each, and the biases) and, with ``base``, each base tensor concerned
    (and a ``modules_to_save`` weight) streamed: memory is the largest factor in float64 and the comparer's buffers,
    never a whole weight.

    Raises:
        CkptError: as :func:`~ckptlib.deepspeed.adapter.find_adapter` (no adapter, a config ckptlib cannot place);
            a base without the tensor, or with another number of elements (named)."""
    import math

    import numpy as np

    from ..io.lora_merge import base_files, base_headers, stored_ranges
    from ..io.streaming import fill_bytes
    from ..layout.ranges import Zeros

    adapter = adapter or find_adapter(ck, required=True)
    c = adapter.config
    held = None
    if base is not None:
        from pathlib import Path

        held = {t.name: stored_ranges(f, t) for f, ts in base_headers(base_files(Path(base))[0]).items() for t in ts}
    cmp = Comparer()
    shapes = {p.name: tuple(p.shape) for p in ck.parameters}

    def array(name: str):
        out = np.empty(math.prod(shapes[name]), np.float32)
        fill_bytes(ck.sources(name), "float32", cmp.files, memoryview(out).cast("B"))
        return out.astype(np.float64).reshape(shapes[name])

    def base_ranges(tensor: str, elements: int):
        if held is None:
            return None
        got = held.get(tensor)
        if got is None or got[0].count != elements:
            raise CkptError(f"the base holds no {tensor} of {elements:,} elements, which the adapter trains", path=base,
                            hint="give the base model the adapter was trained on")
        return got

    rows = []
    try:
        for tensor, parts in A.base_tensors(adapter.names).items():
            module = tensor.rsplit(".", 1)[0]
            r = alpha = scaling = None
            patterns: dict = {}
            if c is not None and ("lora_A" in parts or "lora_embedding_A" in parts or "lora_bias" in parts):
                r, alpha, scaling = c.module_scaling(module)
                patterns = c.module_patterns(module)
            a_name, b_name = parts.get("lora_A") or parts.get("lora_embedding_A"), \
                parts.get("lora_B") or parts.get("lora_embedding_B")
            ranges = base_ranges(tensor, shapes[b_name][0] * shapes[a_name][1] if a_name else
                                 math.prod(shapes[parts.get("whole") or parts.get("bias") or parts["lora_bias"]]))
            if "whole" in parts or ("bias" in parts and "lora_A" not in parts):
                method = A.MODULES_TO_SAVE if "whole" in parts else "bias"
            else:
                method = c.method if c is not None else f"no {A.CONFIG_FILE}"
            delta = None
            if a_name:
                a, b = array(a_name), array(b_name)
                if scaling is not None:
                    delta = abs(scaling) * math.sqrt(max(0.0, float(np.sum((b.T @ b) * (a @ a.T)))))
            elif "whole" in parts and ranges is not None:
                delta = math.sqrt(cmp.difference(ck.sources(parts["whole"]), ranges).sumsq_diff)
            elif "bias" in parts or "lora_bias" in parts:
                extra = array(parts["lora_bias"]) * scaling if "lora_bias" in parts and scaling is not None else 0.0
                if "bias" in parts and ranges is not None:
                    now = np.empty(math.prod(shapes[parts["bias"]]), np.float32)
                    fill_bytes(ranges, "float32", cmp.files, memoryview(now).cast("B"))
                    delta = float(np.linalg.norm(array(parts["bias"]) + extra - now.astype(np.float64)))
                elif "bias" not in parts:
                    delta = float(np.linalg.norm(extra))
            norm = math.sqrt(cmp.difference(ranges, (Zeros(sum(x.count for x in ranges)),)).sumsq_diff) \
                if ranges is not None else None
            rows.append({"module": module, "tensor": tensor, "method": method, "r": r, "alpha": alpha,
                         "scaling": scaling, "patterns": patterns,
                         "tensors": [_part_label(p, shapes[n]) for p, n in parts.items()],
                         "delta_norm": delta, "base_norm": norm,
                         "ratio": delta / norm if delta is not None and norm else None})
    finally:
        cmp.close()
    return rows


def _part_label(part: str, shape: tuple) -> str:
    """``lora_A [4, 64]``: one of a module's tensors, with its shape."""
    label = {"lora_bias": "lora_B.bias", "lora_magnitude_vector": "magnitude", "whole": "weight"}.get(part, part)
    return f"{label} {list(shape)}"


def pair_adapter_names(sa, sb) -> tuple:
    """``(sa, sb, notes)``: when one side is a checkpoint that trains a peft adapter and the other holds tensors under
    peft's saved names (an ``--adapter`` export, the Trainer's ``adapter_model.safetensors``) and none under
    DeepSpeed's, the checkpoint's side renamed to peft's names (its optimizer states ``<key>/<name>`` too), so that
    the names pair; else both as given. Notes say so, and what the other side is when it is empty or 16-bit.

    Both sides the same adapter checkpoint (``ckpt diff checkpoint-N checkpoint-N/``: the Trainer's folder holds the
    tag and peft's ``adapter_model.safetensors``): B is that file, the one comparison that says something (a
    checkpoint is always the same as itself), and a note says so."""
    import dataclasses
    from pathlib import Path

    from .tensorsets import open_tensor_set

    first: list = []
    if sa.kind == sb.kind == "checkpoint" and Path(sa.path).resolve() == Path(sb.path).resolve():
        weights = Path(sb.path).parent / A.WEIGHTS_FILE
        if weights.is_file() and A.looks_like_adapter(k for k in sa.tensors if "/" not in k):
            sb = open_tensor_set(weights)
            first = [f"A and B are the same checkpoint: B is the {A.WEIGHTS_FILE} beside its tag ({weights}), peft's "
                     "save of the adapter, compared with the checkpoint's fp32 masters"]
    for x, y, label in ((sa, sb, "A"), (sb, sa, "B")):
        if x.kind != "checkpoint" or y.kind == "checkpoint":
            continue
        names = [k for k in x.tensors if "/" not in k]
        if not A.looks_like_adapter(names):
            continue
        mapping = {n: got[2] for n in names for got in [A.split(n)] if got}
        if set(mapping) & set(y.tensors) or (y.tensors and not set(mapping.values()) & set(y.tensors)):
            continue

        def renamed(k: str) -> str:
            key, _, name = k.rpartition("/")
            return (key + "/" if key else "") + mapping.get(name, name)

        new = dataclasses.replace(x, tensors={renamed(k): t for k, t in x.tensors.items()},
                                  steps=None if x.steps is None else {mapping.get(k, k): v for k, v in x.steps.items()})
        other = "B" if label == "A" else "A"
        notes = [f"{label}'s adapter tensors paired with peft's saved names ({len(mapping)} renamed: "
                 "…lora_A.default.weight as …lora_A.weight, …lora_magnitude_vector.default.weight as "
                 "…lora_magnitude_vector, …modules_to_save.default.weight as …weight)"]
        if not y.tensors or all(t.numel == 0 for t in y.tensors.values()):
            notes.append(f"{other} is an empty adapter file ({len(y.tensors)} tensors, none with an element): the "
                         "trained weights are only in the checkpoint")
        elif {t.dtype for t in y.tensors.values()} <= {"bfloat16", "float16"}:
            notes.append(f"{other} holds 16-bit copies: they differ from the fp32 masters by their rounding "
                         "(`ckpt inspect` says whether each is exactly the master rounded)")
        return (new, y, first + notes) if label == "A" else (y, new, first + notes)
    return sa, sb, first


__all__ = ["pair_adapter_names", "check_weights_file", "describe_adapter", "adapter_rows", "module_rows", "EMPTY", "SAME",
           "COPY16", "DIFFERENT", "NAMES"]
