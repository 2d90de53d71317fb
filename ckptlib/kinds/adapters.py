"""What a peft adapter is, as a DeepSpeed checkpoint and peft's own files show it: the one table every command reads.

A run that trains a peft adapter (LoRA, DoRA, ...) through the HF Trainer gives DeepSpeed the ``PeftModel``: its
checkpoint keeps the PeftModel's parameter names, and with ``exclude_frozen_parameters=True`` (the Trainer's choice
for every PEFT model) only the trainable ones, i.e. the adapter. peft saves the same tensors in
``adapter_model.safetensors`` under other names, and describes them in ``adapter_config.json``.

Names (peft 0.21, adapter ``default``; ``<m>`` a targeted module's path, ``<s>`` a module of ``modules_to_save``):

==================================================  =========================================  ===========
PeftModel (DeepSpeed)                               peft's file                                kind
==================================================  =========================================  ===========
``<m>.lora_A.default.weight``                       ``<m>.lora_A.weight``                      lora_A
``<m>.lora_B.default.weight`` (``.bias``)           ``<m>.lora_B.weight`` (``.bias``)          lora_B
``<m>.lora_embedding_A.default``                    ``<m>.lora_embedding_A``                   lora_embedding_A
``<m>.lora_embedding_B.default``                    ``<m>.lora_embedding_B``                   lora_embedding_B
``<m>.lora_magnitude_vector.default.weight``        ``<m>.lora_magnitude_vector``              DoRA magnitude
``<s>.modules_to_save.default.<p>``                 ``<s>.<p>``                                modules_to_save
``<m>.base_layer.bias`` (``bias`` not ``"none"``)   the same                                   bias
==================================================  =========================================  ===========

(every name starts ``base_model.model.``). ``<s>.original_module.<p>`` is the frozen copy peft keeps and never
saves. :func:`saved_name` maps one name, :func:`adapter_names` a whole checkpoint (or refuses, with the reason);
:func:`parse_config` reads ``adapter_config.json`` (a dict) into an :class:`AdapterConfig`, refusing what ckptlib
cannot place; :func:`conv1d_modules` tells the targeted layers that store their weight transposed (transformers'
Conv1D, GPT-2's: peft's ``fan_in_fan_out``). Plain data and pure functions.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from ..errors import CkptError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
#: the files peft writes beside the adapter that a copy keeps (the tokenizer ones come from the model's list)
README = "README.md"

LORA_A, LORA_B, EMB_A, EMB_B, MAGNITUDE, MODULES_TO_SAVE, BIAS = (
    "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "DoRA magnitude", "modules_to_save", "bias")
_LORA = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                   r"\.(?P<adapter>[^.]+)(?P<rest>(\.[^.]+)*)$")
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_KIND = {"lora_A": LORA_A, "lora_B": LORA_B, "lora_embedding_A": EMB_A, "lora_embedding_B": EMB_B,
         "lora_magnitude_vector": MAGNITUDE}
#: peft types ckptlib places: LoRA and its variants (rsLoRA, DoRA) keep the tensors of the table above
PLACED_TYPES = ("LORA",)
#: LoRA options that change what is saved, or where, beyond the table (refused where set)
_UNPLACED_OPTIONS = {
    "layer_replication": "layer_replication shares base layers between model layers, so the names of the adapter "
                         "do not follow the model's",
    "target_parameters": "target_parameters adapts nn.Parameters directly (ParamWrapper), saved under names ckptlib "
                         "has not checked",
    "trainable_token_indices": "trainable_token_indices keeps token deltas (trainable_tokens_delta) ckptlib has not "
                               "checked",
    "use_qalora": "QALoRA pools its inputs, a weight layout ckptlib has not checked",
    "use_bdlora": "BD-LoRA keeps block-diagonal factors ckptlib has not checked",
    "arrow_config": "Arrow routes between several adapters, kept under names ckptlib has not checked",
    "alora_invocation_tokens": "aLoRA's activation is kept outside the weights ckptlib places",
}


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says about the weights.

    Attributes:
        peft_type: peft's ``peft_type`` (``"LORA"``); ``method``: how users know it (``"LoRA"``, ``"rsLoRA"``,
            ``"DoRA"``, ``"DoRA + rsLoRA"``).
        r, alpha: the rank and ``lora_alpha``; ``scaling``: what B @ A is multiplied by (alpha / r, or
            alpha / sqrt(r) with rsLoRA) where no ``rank_pattern`` / ``alpha_pattern`` entry says otherwise.
        target_modules: a list of module names, or a regex (a string), as the config has it.
        modules_to_save: the modules trained and saved whole (``lm_head`` ...).
        bias: ``"none"``, ``"all"`` or ``"lora_only"``; use_rslora, use_dora as the config says.
        patterns: whether ``rank_pattern`` or ``alpha_pattern`` give some modules their own r or alpha.
        raw: the parsed JSON, as it was.
        rank_pattern, alpha_pattern: ``((regex, value), ...)`` in the config's order (:meth:`module_scaling`).
        lora_bias: whether ``lora_B`` has a bias of its own (``lora_bias=True``), added to the base layer's by a merge.
        fan_in_fan_out: the config's flag (peft sets it on each Conv1D layer it wraps, and clears it on each
            ``nn.Linear``: the saved flag is the last layer's; :func:`conv1d_modules` tells the layers).
    """

    peft_type: str
    method: str
    r: int
    alpha: float
    scaling: float
    target_modules: object
    modules_to_save: tuple
    bias: str
    use_rslora: bool
    use_dora: bool
    patterns: bool
    raw: dict
    rank_pattern: tuple = ()
    alpha_pattern: tuple = ()
    lora_bias: bool = False
    fan_in_fan_out: bool = False

    def module_scaling(self, module: str) -> tuple[int, float, float]:
        """``(r, alpha, scaling)`` of one targeted module (its path in the base model, ``model.layers.0.q_proj``), as
        peft 0.21 gives them (``LoraModel._create_and_replace`` with ``peft.utils.other.get_pattern_key``): the first
        key of ``rank_pattern`` (resp. ``alpha_pattern``), in the config's order, that ``re.match(rf"(.*\\.)?({key})$",
        module)`` accepts gives the module its r (alpha), else the config's ``r`` (``lora_alpha``); the scaling is
        alpha / r, or alpha / sqrt(r) with rsLoRA."""
        r = int(_pattern_value(self.rank_pattern, module, self.r))
        alpha = float(_pattern_value(self.alpha_pattern, module, self.alpha))
        return r, alpha, alpha / (math.sqrt(r) if self.use_rslora else r)

    def module_patterns(self, module: str) -> dict[str, str]:
        """``{"rank_pattern": key, "alpha_pattern": key}``: the pattern keys that give ``module`` its own r or alpha
        (as :meth:`module_scaling` matches them; none: the config's ``r`` and ``lora_alpha``)."""
        out = {}
        for label, pattern in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            key = _pattern_key(pattern, module)
            if key is not None:
                out[label] = key
        return out

    def describe(self) -> str:
        targets = self.target_modules if isinstance(self.target_modules, str) else ", ".join(self.target_modules)
        return (f"{self.method} r={self.r} alpha={self.alpha:g} (scaling {self.scaling:g}"
                + (", per-module patterns" if self.patterns else "") + f") on {targets or 'no module'}"
                + (f"; modules_to_save: {', '.join(self.modules_to_save)}" if self.modules_to_save else ""))


def _pattern_key(pattern: tuple, module: str) -> Optional[str]:
    """peft's ``get_pattern_key(pattern.keys(), module)`` where the key is in ``pattern`` (None: no key applies)."""
    for key, _ in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module if module in dict(pattern) else None


def _pattern_value(pattern: tuple, module: str, default):
    """peft's ``pattern.get(get_pattern_key(pattern.keys(), module), default)``."""
    key = _pattern_key(pattern, module)
    return default if key is None else dict(pattern)[key]


def _pattern(config: dict, key: str, source: str) -> tuple:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise CkptError(f"{source}: {key} is no mapping of module patterns", path=source)
    for k, v in value.items():
        try:
            re.compile(k)
            float(v)
        except (re.error, TypeError, ValueError) as e:
            raise CkptError(f"{source}: {key} entry {k!r}: {v!r} is not a regex and a number ({e})", path=source) \
                from None
    return tuple(value.items())


def parse_config(config: dict, source: str = CONFIG_FILE) -> AdapterConfig:
    """``adapter_config.json`` (parsed) as an :class:`AdapterConfig`.

    Raises:
        CkptError: a peft type or option whose weights ckptlib cannot place, naming it and why; a config without
            ``r`` or ``lora_alpha``."""
    if not isinstance(config, dict):
        raise CkptError(f"{source} holds no JSON object", path=source)
    peft_type = str(config.get("peft_type", ""))
    if peft_type not in PLACED_TYPES:
        raise CkptError(f"{source} says peft_type {peft_type or '(none)'!r}: ckptlib places the weights of LoRA "
                        "adapters only (lora_A/B, lora_embedding_A/B, DoRA's magnitude, modules_to_save, bias); "
                        f"{peft_type or 'this type'} keeps tensors ckptlib has not checked", path=source,
                        hint="export the full model layout instead (--no-adapter)")
    for key, why in _UNPLACED_OPTIONS.items():
        if config.get(key):
            raise CkptError(f"{source} sets {key}: {why}", path=source,
                            hint="export the full model layout instead (--no-adapter)")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise CkptError(f"{source}: no valid r / lora_alpha ({e})", path=source) from None
    rslora, dora = bool(config.get("use_rslora")), bool(config.get("use_dora"))
    method = " + ".join(m for m, on in (("DoRA", dora), ("rsLoRA", rslora)) if on) or "LoRA"
    targets = config.get("target_modules") or []
    targets = targets if isinstance(targets, str) else sorted(targets)
    return AdapterConfig(peft_type=peft_type, method=method, r=r, alpha=alpha,
                         scaling=alpha / (math.sqrt(r) if rslora else r), target_modules=targets,
                         modules_to_save=tuple(config.get("modules_to_save") or ()),
                         bias=str(config.get("bias") or "none"), use_rslora=rslora, use_dora=dora,
                         patterns=bool(config.get("rank_pattern") or config.get("alpha_pattern")), raw=config,
                         rank_pattern=_pattern(config, "rank_pattern", source),
                         alpha_pattern=_pattern(config, "alpha_pattern", source),
                         lora_bias=bool(config.get("lora_bias")), fan_in_fan_out=bool(config.get("fan_in_fan_out")))


def split(name: str) -> Optional[tuple[str, str, str]]:
    """``(kind, adapter name, peft's saved name)`` of one PeftModel parameter name, or None when it is no
    adapter tensor (a base weight, ``original_module``, a bias: see :func:`saved_name`)."""
    m = _SAVED.match(name)
    if m and ".original_module." not in name:
        return MODULES_TO_SAVE, m["adapter"], f"{m['module']}.{m['rest']}"
    m = _LORA.match(name)
    if m:
        part, rest = m["part"], m["rest"]
        if part == "lora_magnitude_vector" and rest == ".weight":
            rest = ""  # peft saves the magnitude without its ".weight"
        return _KIND[part], m["adapter"], f"{m['module']}.{part}{rest}"
    return None


def saved_name(name: str, config: Optional[AdapterConfig] = None) -> tuple[str, str]:
    """``(kind, peft's saved name)`` of a trainable PeftModel parameter.

    Raises:
        CkptError: a tensor peft would not save with this config (not an adapter tensor, nor a bias the config's
            ``bias`` saves), naming it."""
    got = split(name)
    if got:
        return got[0], got[2]
    if name.endswith(".bias") and config is not None and config.bias != "none":
        return BIAS, name
    raise CkptError(f"the trainable tensor {name} is no adapter tensor peft saves (not lora_A/B, "
                    "lora_embedding_A/B, lora_magnitude_vector or modules_to_save"
                    + ("" if config is None else f"; the config's bias is {config.bias!r}") + ")",
                    hint="export the full model layout instead (--no-adapter)")


def looks_like_adapter(names) -> bool:
    """Whether parameter names are a PeftModel's with an adapter among them (every one under ``base_model.model.``
    and one at least an adapter tensor)."""
    names = list(names)
    return bool(names) and all(n.startswith(PREFIX) for n in names) and any(split(n) for n in names)


def adapter_names(trainable, config: Optional[AdapterConfig] = None) -> dict[str, tuple[str, str]]:
    """``{PeftModel name: (kind, peft's saved name)}`` of a checkpoint's trainable parameters.

    Raises:
        CkptError: a tensor peft would not save, several adapters (peft saves one a folder), or two names that
            would be saved as one."""
    out = {n: saved_name(n, config) for n in trainable}
    adapters = sorted({s[1] for s in map(split, out) if s})
    if len(adapters) > 1:
        raise CkptError(f"the checkpoint trains {len(adapters)} adapters ({', '.join(adapters)}): peft saves one "
                        "adapter a folder", hint="export the full model layout instead (--no-adapter)")
    seen: dict[str, str] = {}
    for n, (_, s) in out.items():
        if s in seen:
            raise CkptError(f"{seen[s]} and {n} would both be saved as {s}")
        seen[s] = n
    return out


def counts(mapping: dict[str, tuple[str, str]]) -> dict[str, int]:
    """``{kind: number of tensors}`` in the order of the table."""
    order = (LORA_A, LORA_B, EMB_A, EMB_B, MAGNITUDE, MODULES_TO_SAVE, BIAS)
    found = [k for k, _ in mapping.values()]
    return {k: found.count(k) for k in order if k in found}


#: the parts of a module a merge reads, by the end of peft's saved name: ``(the base tensor's last name, part)``
_PARTS = {"lora_A.weight": ("weight", "lora_A"), "lora_B.weight": ("weight", "lora_B"),
          "lora_B.bias": ("bias", "lora_bias"), "lora_magnitude_vector": ("weight", "lora_magnitude_vector"),
          "lora_embedding_A": ("weight", "lora_embedding_A"), "lora_embedding_B": ("weight", "lora_embedding_B")}


def base_tensor_of(saved: str, kind: str) -> tuple[str, str]:
    """``(the base model's tensor it changes, part)`` of a peft saved name: ``base_model.model.<m>.lora_A.weight``
    -> ``(<m>.weight, "lora_A")``, ``<m>.lora_B.bias`` -> ``(<m>.bias, "lora_bias")``; a trained bias
    (``<m>.base_layer.bias`` of a targeted module, ``<m>.bias`` of another) -> ``(<m>.bias, "bias")``; a
    ``modules_to_save`` tensor -> ``(its name in the base, "whole")``."""
    rest = saved[len(PREFIX):]
    for suffix, (param, part) in _PARTS.items():
        if rest.endswith("." + suffix):
            return f"{rest[:-len(suffix) - 1]}.{param}", part
    if kind == BIAS:
        return rest.replace(".base_layer.bias", ".bias") if rest.endswith(".base_layer.bias") else rest, "bias"
    return rest, "whole"


#: transformers' models whose linear layers are ``Conv1D`` (``transformers.pytorch_utils.Conv1D``: the weight stored
#: ``[in, out]``, the transpose of ``nn.Linear``'s ``[out, in]``), by ``model_type``: the names of those layers; every
#: other linear layer of these models is an ``nn.Linear`` (tests/test_adapters.py holds the table against the models'
#: own modules). peft gives each Conv1D layer ``fan_in_fan_out`` itself, whatever the config says: the saved config's
#: flag is that of the last layer it wrapped, not a fact about every layer.
CONV1D_LAYERS = {"gpt2": ("c_attn", "q_attn", "c_proj", "c_fc"), "openai-gpt": ("c_attn", "c_proj", "c_fc"),
                 "imagegpt": ("c_attn", "q_attn", "c_proj", "c_fc"),
                 "decision_transformer": ("c_attn", "q_attn", "c_proj", "c_fc")}
_ASK_PEFT = "export the adapter (--adapter), load it with peft and merge_and_unload()"


def conv1d_modules(layers: dict, model_type: Optional[str], fan_in_fan_out: bool, source=None) -> set:
    """The LoRA-targeted linear layers that store their weight transposed (transformers' ``Conv1D``; peft merges them
    with ``fan_in_fan_out``: ``W + (scaling · B @ A)ᵀ``). ``layers``: ``{module path: (the base weight's shape,
    in_features, out_features)}`` (``in``: lora_A's columns, ``out``: lora_B's rows); ``model_type``: the base's
    ``config.json`` says it (None: no config); ``fan_in_fan_out``: the adapter config's flag.

    A model of :data:`CONV1D_LAYERS` is told by its layers' names (and every shape must agree); another by the shapes,
    ``[in, out]`` being a Conv1D's, ``[out, in]`` an ``nn.Linear``'s. A square layer of such a model is taken for an
    ``nn.Linear`` only while nothing says the model has Conv1D layers (no layer stored ``[in, out]``, the flag unset).

    Raises:
        CkptError: a base weight of neither shape, or of the other layer's (another model); a square layer whose
            layout cannot be told, naming it."""
    known = CONV1D_LAYERS.get(model_type or "")
    out, square = set(), []
    for module, (shape, fin, fout) in layers.items():
        shape, linear, conv = tuple(shape), (fout, fin), (fin, fout)
        if known is not None:
            is_conv = module.rsplit(".", 1)[-1] in known
            want = conv if is_conv else linear
            if shape != want:
                raise CkptError(f"the base's {module}.weight is {list(shape)}, the adapter's is {list(want)} (a "
                                f"{model_type} {module.rsplit('.', 1)[-1]} is "
                                + ("a Conv1D, stored [in, out]" if is_conv else "an nn.Linear, stored [out, in]")
                                + "): another model", path=source, hint="give the base model the adapter was trained on")
        elif shape not in (linear, conv):
            raise CkptError(f"the base's {module}.weight is {list(shape)}, the adapter's is {list(linear)}: another "
                            "model", path=source, hint="give the base model the adapter was trained on")
        elif linear == conv:
            square.append(module)
            continue
        else:
            is_conv = shape == conv
        if is_conv:
            out.add(module)
    if square and (out or fan_in_fan_out):
        why = f"{len(out)} of its targeted layers are stored [in, out]" if out else "the adapter config sets fan_in_fan_out"
        raise CkptError(f"the base's {square[0]}.weight is square, in a model (model_type {model_type!r}) whose Conv1D "
                        f"layers ckptlib does not know, and {why}: whether {square[0]} is a Conv1D (stored transposed) "
                        "cannot be told from the files", path=source, hint=_ASK_PEFT)
    return out


def dora_embeddings(mapping: dict[str, tuple[str, str]]) -> list[str]:
    """The embeddings an adapter trains with DoRA (``lora_embedding_A`` and a magnitude on one module), by their path
    in the base model."""
    parts = base_tensors(mapping)
    return [t.rsplit(".", 1)[0] for t, p in parts.items() if "lora_embedding_A" in p and "lora_magnitude_vector" in p]


def base_tensors(mapping: dict[str, tuple[str, str]]) -> dict[str, dict[str, str]]:
    """``{base tensor: {part: the checkpoint's (PeftModel's) name}}`` of an adapter (:func:`adapter_names`'s
    mapping), in the checkpoint's order: what each base tensor of the model gets from the adapter (parts as
    :func:`base_tensor_of` names them)."""
    out: dict[str, dict[str, str]] = {}
    for name, (kind, saved) in mapping.items():
        tensor, part = base_tensor_of(saved, kind)
        out.setdefault(tensor, {})[part] = name
    return out


__all__ = ["AdapterConfig", "parse_config", "split", "saved_name", "looks_like_adapter", "adapter_names", "counts",
           "base_tensor_of", "base_tensors", "conv1d_modules", "dora_embeddings", "CONV1D_LAYERS", "CONFIG_FILE",
           "WEIGHTS_FILE", "PREFIX", "README"]
