"""Joining tensor-parallel shards into full tensors: the split rules and where they come from.

Each tensor rank's ZeRO set holds its shard of every weight under the full name. How the shards join is
not in the tensors; it is in ``universal_checkpoint_info``, which Megatron-DeepSpeed passes as client
state and DeepSpeed's AutoTP writes itself:

- ``tp_replicated_parameter_patterns``: the same whole tensor on every tensor rank (checked equal);
- ``parameter_with_row_parallelism_patterns``: split on dim 1 (row-parallel linear weights);
- ``vocabulary_parameter_patterns`` (with ``original_vocab_size``): split on dim 0, padding rows cut;
- everything else: split on dim 0 (column-parallel);
- ``affine_map`` (AutoTP): for every parameter, exactly where each shard's pieces lie in the full tensor.

Patterns are regular expressions matched at the start of the name (``re.match``, as DeepSpeed does).
The same keys can come from a JSON file (``--tp-rules``) for checkpoints saved without them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional

from ..errors import CkptError, UnsupportedCheckpointError
from ..io.jsonfile import read_json_object
from ..layout.placement import COLUMN, REPLICATED, ROW, VOCABULARY, Block, blocks_from_rule
from .model import ModelView
from .records import BufferInfo, ParameterInfo

REPLICATED_KEY = "tp_replicated_parameter_patterns"
ROW_KEY = "parameter_with_row_parallelism_patterns"
VOCAB_KEY = "vocabulary_parameter_patterns"
PIPELINE_KEY = "pipeline_replicated_parameter_patterns"
#: keys whose patterns describe layouts ckptlib does not join (fused sub-parameters, averaged tensors)
UNSUPPORTED_KEYS = ("parameter_with_2_sub_params_cat_dim_0", "parameter_with_sub_params", "parameter_to_average_patterns")
RULES_HINT = ("pass --tp-rules FILE (tp_rules= in Python): a JSON object with the keys of DeepSpeed's "
              "universal_checkpoint_info, e.g. {\"tp_replicated_parameter_patterns\": [\"...norm\\\\.weight$\"], "
              "\"parameter_with_row_parallelism_patterns\": [\"...dense_4h_to_h\\\\.weight$\"], "
              "\"vocabulary_parameter_patterns\": [\"...word_embeddings\\\\.weight$\"], \"original_vocab_size\": N}")


@dataclass(frozen=True)
class SplitRules:
    """How a tensor-parallel checkpoint's shards join (see the module docstring); ``origin`` says where
    the rules came from."""

    replicated: tuple = ()
    row: tuple = ()
    vocabulary: tuple = ()
    original_vocab_size: Optional[int] = None
    pipeline_replicated: tuple = ()  # a pipeline's tied weights, held by several stages (names, as patterns)
    affine: dict = field(default_factory=dict)      # pattern -> affine_map entry
    unsupported: dict = field(default_factory=dict)  # key -> patterns
    origin: str = ""

    @classmethod
    def from_info(cls, info: dict, origin: str) -> "SplitRules":
        def patterns(key):
            v = info.get(key) or []
            if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) for p in v):
                raise CkptError(f"{key} must be a list of regular expressions", path=origin)
            for p in v:
                try:
                    re.compile(p)
                except re.error as e:
                    raise CkptError(f"{key}: {p!r} is not a regular expression ({e})", path=origin) from None
            return tuple(v)

        affine = info.get("affine_map") or {}
        params = affine.get("params", {}) if isinstance(affine, dict) else {}
        vocab = info.get("original_vocab_size")
        return cls(replicated=patterns(REPLICATED_KEY), row=patterns(ROW_KEY), vocabulary=patterns(VOCAB_KEY),
                   pipeline_replicated=patterns(PIPELINE_KEY),
                   original_vocab_size=int(vocab) if isinstance(vocab, (int, float)) else None,
                   affine=dict(params) if isinstance(params, dict) else {},
                   unsupported={k: patterns(k) for k in UNSUPPORTED_KEYS if info.get(k)}, origin=origin)

    def rule(self, name: str) -> str:
        for rule, pats in ((REPLICATED, self.replicated), (ROW, self.row), (VOCABULARY, self.vocabulary)):
            if any(re.match(p, name) for p in pats):
                return rule
        return COLUMN

    def affine_entry(self, name: str) -> Optional[dict]:
        return next((e for p, e in self.affine.items() if re.match(p, name)), None)

    def unsupported_for(self, name: str) -> Optional[str]:
        return next((k for k, pats in self.unsupported.items() if any(re.match(p, name) for p in pats)), None)


def load_rules(path: os.PathLike) -> SplitRules:
    """Split rules from a JSON file (the keys of ``universal_checkpoint_info``)."""
    info = read_json_object(path, "the tensor-parallel rules", hint=RULES_HINT,
                            not_object="the tensor-parallel rules must be a JSON object")
    return SplitRules.from_info(info, os.fspath(path))


def _affine_blocks(entry: dict, name: str, sets: dict) -> tuple[tuple, list[Block]]:
    shape = tuple(int(s) for s in entry["logical_shape"])
    seen: dict = {}
    for t, rank_entry in sorted((int(k), v) for k, v in entry["ranks"].items()):
        for piece in rank_entry["pieces"]:
            key = (int(piece["source"][0]), tuple(piece["source"][1]), tuple(piece["shape"]))
            if key in seen:
                continue
            locs = [int(x) for x in piece.get("locations", [t])]
            replicas = tuple((sets[loc].mp, name) for loc in locs if loc != t and loc in sets)
            seen[key] = Block((sets[t].mp, name), tuple(piece["shape"]), key[0], key[1], int(piece["dest"][0]),
                              tuple(piece["dest"][1]), replicas)
            if piece.get("scale", 1.0) not in (1, 1.0):
                raise UnsupportedCheckpointError(f"the affine map scales a piece of {name}; ckptlib only places "
                                                 "pieces unchanged", path=None)
    return shape, list(seen.values())


def tensor_parallel_view(sets: dict, rules: SplitRules) -> ModelView:
    """The full model of the tensor ranks ``sets`` (tensor rank -> ZeRO set; a whole tensor-parallel
    checkpoint, or one pipeline stage of a 3D one): blocks whose sources are ``(set.mp, name)``."""
    first = sets[min(sets)]
    tps = sorted(sets)
    params, blocks, notes, roles, padded = [], {}, [], {}, {}
    for p in first.parameters:
        if p.tied_to:
            params.append(ParameterInfo(p.name, (), p.trainable, p.tied_to, p.group, p.stored_dtype))
            continue
        key = rules.unsupported_for(p.name)
        if key:
            raise UnsupportedCheckpointError(
                f"parameter {p.name} matches {key} ({rules.origin}): fused or averaged tensor-parallel parameters "
                "are not joined by ckptlib yet", path=first.location.tag_dir)
        shape, bl = _join(p.name, sets, tps, rules, first)
        roles[p.name] = "affine" if rules.affine_entry(p.name) is not None else rules.rule(p.name)
        if roles[p.name] == VOCABULARY and rules.original_vocab_size is not None:
            padded[p.name] = _join(p.name, sets, tps, rules, first, cut=False)
        params.append(ParameterInfo(p.name, shape, p.trainable, None, p.group, p.stored_dtype))
        blocks[p.name] = bl
    by_name = {p.name: p for p in params}
    for p in params:
        if p.tied_to and p.tied_to in by_name:
            owner = by_name[p.tied_to]
            p.shape, p.trainable, p.stored_dtype = owner.shape, owner.trainable, owner.stored_dtype
    buffers = []
    for b in first.buffers:
        shape, bl = _join(b.name, sets, tps, rules, first, buffer=True)
        buffers.append(BufferInfo(b.name, shape, b.dtype))
        blocks[b.name] = bl
        roles[b.name] = ("affine" if rules.affine_entry(b.name) is not None else
                         REPLICATED if len(bl) == 1 and bl[0].replicas or len(tps) == 1 else rules.rule(b.name))
    if rules.original_vocab_size is not None and rules.vocabulary:
        notes.append(f"vocabulary tensors cut to the original {rules.original_vocab_size} rows ({rules.origin})")
    notes.append(f"{len(tps)} tensor ranks joined by the rules of {rules.origin}")
    by_mp = {zs.mp: zs for zs in sets.values()}
    return ModelView(parameters=params, buffers=buffers, order=first.state_dict_names(), blocks=blocks,
                     resolve=lambda source, key: by_mp[source[0]].sources(source[1], key), kind="tensor_parallel",
                     notes=notes, roles=roles, padded=padded, sets=by_mp)


def _join(name: str, sets: dict, tps: list, rules: SplitRules, first, buffer: bool = False, cut: bool = True):
    entry = rules.affine_entry(name)
    try:
        if entry is not None:
            return _affine_blocks(entry, name, sets)
        shards = [((sets[t].mp, name), _local_shape(sets[t], name, buffer)) for t in tps]
        rule = rules.rule(name)
        if buffer and rule == COLUMN and len({s for _, s in shards}) == 1:
            rule = REPLICATED  # a buffer no pattern names, the same shape everywhere: one value, on every rank
        return blocks_from_rule(rule, shards, rules.original_vocab_size if rule == VOCABULARY and cut else None)
    except (KeyError, ValueError) as e:
        raise UnsupportedCheckpointError(f"the tensor-parallel shards of {name} cannot be joined: {e}",
                                         path=first.location.tag_dir,
                                         hint=f"the rules come from {rules.origin}; check them, or {RULES_HINT}") from None


def _local_shape(zs, name: str, buffer: bool) -> tuple:
    return tuple(zs.buffer(name).shape if buffer else zs.param(name).shape)


__all__ = ["SplitRules", "load_rules", "tensor_parallel_view", "RULES_HINT"]
