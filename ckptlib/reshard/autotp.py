"""An AutoTP checkpoint at another tensor size above 1: each parameter cut as DeepSpeed's AutoTP would cut it
there (:mod:`ckptlib.deepspeed.autotp`), and the ``universal_checkpoint_info`` whose ``affine_map`` AutoTP
would record there (metadata only).

The model's key-value head count, which AutoTP's split depends on and the checkpoint does not record, comes
from the model's HF config: ``model_config`` (a ``config.json``, the folder holding one, or the parsed dict),
else the ``config.json`` beside the tag folders (where the HF Trainer saves it); without one the reshard is
refused before anything is written.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Union

from ..deepspeed import Checkpoint, SplitRules
from ..deepspeed.autotp import (CONFIG_NAME, HEAD_NAMES, AutoTPGeometry, affine_entry, contiguous_split,
                                geometry_from_config, head_dim_of, read_model_config)
from ..errors import UnsupportedCheckpointError

ModelConfig = Union[str, os.PathLike, dict, None]


def _refuse(ck: Checkpoint, why: str, hint: Optional[str] = None):
    raise UnsupportedCheckpointError(why, path=ck.location.tag_dir, hint=hint)


class AutoTPTarget:
    """The AutoTP split of ``ck``'s parameters at another tensor size (``recorded``: the source's
    ``universal_checkpoint_info``; ``geometry``: the model's key-value heads and grain)."""

    def __init__(self, ck: Checkpoint, recorded: dict, geometry: AutoTPGeometry):
        self.ck, self.recorded, self.geometry = ck, recorded, geometry
        self.rules = SplitRules.from_info(recorded, origin=str(ck.location.tag_dir))
        self.source_tp = ck.universal.source_mesh.tp if ck.universal is not None else ck.mesh.tp  # its affine_map's
        self._aliases: dict = {}
        for p in ck.view.parameters:
            if p.tied_to:
                self._aliases.setdefault(p.tied_to, []).append(p.name)

    def layer_name(self, name: str) -> str:
        """The module name AutoTP splits ``name`` under: its own, or the output head's when tied to it (a
        vocabulary-parallel embedding shares the head's split)."""
        for alias in self._aliases.get(name, []):
            module = alias.rsplit(".", 1)[0]
            if module in HEAD_NAMES:
                return module
        return name.rsplit(".", 1)[0] if "." in name else name

    def split(self, name: str, tp: int) -> tuple:
        """``(dim, sizes)`` of ``name`` at ``tp`` tensor ranks (``dim`` None: whole on every rank)."""
        entry = self.rules.affine_entry(name)
        if entry is None:
            _refuse(self.ck, f"{name}: the AutoTP affine_map does not place it, so nothing says how AutoTP would split "
                             f"it over {tp} tensor ranks")
        try:
            dim, src_sizes = contiguous_split(entry)
        except (KeyError, TypeError, ValueError) as e:
            _refuse(self.ck, f"{name}: its AutoTP affine_map is not one block per tensor rank ({e}); ckptlib cannot "
                             f"derive its split at {tp} tensor ranks")
        shape = tuple(int(s) for s in entry["logical_shape"])
        if dim is None:
            return None, (shape[0],) if shape else ()
        g, layer = self.geometry, self.layer_name(name)
        if g.sizes(shape[dim], self.source_tp, layer) != list(src_sizes):
            _refuse(self.ck, f"{name}: AutoTP's split rule ({g.kv_heads} key-value heads from {g.origin}, grain "
                             f"{g.grain}) gives {g.sizes(shape[dim], self.source_tp, layer)} at {self.source_tp} "
                             f"tensor ranks where the checkpoint's affine_map records {list(src_sizes)}; ckptlib "
                             f"cannot tell how AutoTP would split it at {tp}",
                    hint="check that the model config is this model's")
        sizes = g.sizes(shape[dim], tp, layer)
        if min(sizes) == 0:
            _refuse(self.ck, f"{name}: AutoTP would give tensor rank {sizes.index(0)} of {tp} none of its dim {dim} "
                             f"({shape[dim]} cut into {sizes}; the model has {g.kv_heads} key-value heads)",
                    hint="pick a tensor size that gives every rank a part of every layer (at most the key-value heads)")
        return dim, tuple(sizes)

    def info(self, model, tp: int) -> dict:
        """The ``universal_checkpoint_info`` AutoTP records at ``tp`` ranks: the source's, with every
        ``affine_map`` entry made from the target tensors' cuts (``model``: the target model)."""
        tensors = {t.name: t for t in model.sets[min(model.sets)].module}
        old = self.recorded.get("affine_map") or {}
        params = {}
        for pattern in (old.get("params") or {}):
            name = next((n for n in tensors if re.match(pattern, n)), None)
            if name is None:
                _refuse(self.ck, f"the AutoTP affine_map's pattern {pattern!r} names no tensor of the model")
            t = tensors[name]
            params[pattern] = affine_entry(t.full_shape, t.dim, list(t.sizes), tp)
        out = dict(self.recorded)
        out["affine_map"] = dict(old, params=params)
        return out


def autotp_target(ck: Checkpoint, tp: int, model_config: ModelConfig) -> Optional[AutoTPTarget]:
    """The AutoTP target of ``ck`` at ``tp`` > 1 tensor ranks, or None when ``ck`` records no AutoTP affine map."""
    recorded = ck.sets[min(ck.sets)].model_states_file().obj.get("universal_checkpoint_info")
    if tp <= 1 or not isinstance(recorded, dict) or not (recorded.get("affine_map") or {}).get("params"):
        return None
    if model_config is None:
        beside = os.path.join(ck.location.save_dir, CONFIG_NAME)
        if not os.path.isfile(beside):
            _refuse(ck, f"AutoTP splits attention layers by the model's key-value heads, which the checkpoint does not "
                        f"record: ckptlib needs the model's config to cut it for {tp} tensor ranks",
                    hint="pass --model-config CONFIG.json (model_config= in Python): the model's HF config.json")
        model_config = beside
    if isinstance(model_config, dict):
        config, origin = model_config, "the given model config"
    else:
        config, origin = read_model_config(model_config), os.fspath(model_config)
    geometry = geometry_from_config(config, ck.ds_config, origin)
    _check_key_value_heads(ck, config, geometry)
    return AutoTPTarget(ck, recorded, geometry)


def _check_key_value_heads(ck: Checkpoint, config: dict, g: AutoTPGeometry) -> None:
    """The config must be this model's: its key-value heads times its head size are the rows of every
    ``k_proj`` weight. (A config that only agrees with the source's own split could still be wrong: 8
    key-value heads where the model has 4 cut alike at 2 and 4 ranks, but not at 3.)"""
    keys = [p for p in ck.view.parameters if p.name.endswith("k_proj.weight")]
    head_dim = head_dim_of(config)
    if not keys or head_dim is None or g.kv_heads is None:
        what = ("the model has no k_proj layer" if not keys else
                "the config gives no head size (head_dim, or hidden_size and num_attention_heads)" if head_dim is None
                else "the config gives no key-value head count")
        _refuse(ck, f"ckptlib checks the model config's key-value heads against the k_proj layers before cutting "
                    f"for another tensor size, and {what} ({g.origin})",
                hint="pass --model-config with the model's own HF config.json")
    for p in keys:
        rows = int(p.shape[0]) if p.shape else 0
        if rows != g.kv_heads * head_dim:
            _refuse(ck, f"{p.name}: {rows} rows, but {g.origin} gives {g.kv_heads} key-value heads of {head_dim} "
                        f"({g.kv_heads * head_dim} rows): that config is not this model's, and AutoTP's split "
                        "depends on it", hint="pass --model-config with the model's own HF config.json")


__all__ = ["AutoTPTarget", "autotp_target"]
