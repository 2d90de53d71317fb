"""AutoTP at another tensor size: how DeepSpeed's AutoTP (0.19.8) would split each parameter, and the
``affine_map`` it would record there (pure arithmetic, no I/O).

An AutoTP checkpoint records in its ``universal_checkpoint_info`` an ``affine_map``: for every parameter, at
the tensor size it was saved with, the block of the full tensor each tensor rank holds. Which layers AutoTP
splits, and along which dimension, is read from that map; the only thing that changes with the tensor size
is how wide each rank's block is. AutoTP gives rank ``r`` of ``tp`` ranks, for a layer cut along a dimension
of ``total`` elements:

- by key-value heads, when the model's key-value head count ``kv`` divides ``total`` and the layer is
  neither an MLP layer (its module name contains ``mlp``, ``gate_proj``, ``up_proj``, ``down_proj``,
  ``w1``, ``w2`` or ``w3``) nor the output head (named ``lm_head`` or ``embed_out``; a vocabulary-parallel
  embedding tied to it takes the head's split): ``kv // tp`` heads, one more for ``r < kv % tp``, each
  ``total / kv`` wide;
- otherwise nearly evenly in grains of ``tp_grain_size`` (``tensor_parallel.tp.tp_grain_size`` of the
  DeepSpeed config, 1 by default): ``g // tp`` grains, one more for ``r < g % tp`` (``g = total //
  grain``), the last rank also taking the ``total % grain`` left over; with ``total < grain``, nearly
  evenly element by element.

Column-parallel biases are cut like their weights; replicated tensors stay whole on every rank. The key-value
head count is not in a DeepSpeed checkpoint: it comes from the model's HF config (``config.json``).

Only maps ckptlib can re-derive with certainty are carried to another size: every rank holding either the
whole tensor, or one unscaled contiguous block along one dimension, the blocks in rank order. Anything else
(fused or interleaved sub-parameters, scaled pieces), a split that does not reproduce the source's own map at
the source's size, and a size at which a rank would hold nothing (``tp`` above the key-value heads) are
refused with the parameter's name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..errors import CkptError
from ..io.jsonfile import read_json_object
from ..layout.placement import row_major_strides

#: DeepSpeed's probe order for the key-value head count (first attribute present wins)
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                "num_attention_heads", "n_heads", "attention_heads")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
HEAD_NAMES = ("lm_head", "embed_out")
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class AutoTPGeometry:
    """What AutoTP's split depends on beyond the names: the key-value heads and the grain."""

    kv_heads: Optional[int]
    grain: int = 1
    origin: str = ""

    def sizes(self, total: int, tp: int, layer: str) -> list[int]:
        """Each tensor rank's extent of a dimension of ``total`` elements of layer ``layer`` (module name)."""
        kv = self.kv_heads
        by_heads = (kv is not None and kv > 0 and total % kv == 0 and "mlp" not in layer
                    and layer not in HEAD_NAMES and not any(s in layer for s in MLP_NAMES))
        if by_heads:
            return [total * (kv // tp + (1 if r < kv % tp else 0)) // kv for r in range(tp)]
        if total >= self.grain:
            grains, rest = divmod(total, self.grain)
            out = [(grains // tp + (1 if r < grains % tp else 0)) * self.grain for r in range(tp)]
            out[-1] += rest
            return out
        return [total // tp + (1 if r < total % tp else 0) for r in range(tp)]


def geometry_from_config(config: dict, ds_config: Optional[dict], origin: str) -> AutoTPGeometry:
    """The geometry of an HF model ``config`` (a parsed ``config.json``) under DeepSpeed config ``ds_config``."""
    text = config.get("text_config")
    if isinstance(text, dict):
        config = text
    kv = next((config[k] for k in KV_HEAD_KEYS if config.get(k) is not None), None)
    if kv is not None and (not isinstance(kv, int) or kv < 1):
        raise CkptError(f"the key-value head count {kv!r} is not a positive integer", path=origin)
    tp_cfg = (ds_config or {}).get("tensor_parallel") or {}
    inner = tp_cfg.get("tp") or tp_cfg.get("tensor_parallel") or {}
    grain = inner.get("tp_grain_size", 1) if isinstance(inner, dict) else 1
    if not isinstance(grain, int) or grain < 1:
        raise CkptError(f"tensor_parallel.tp.tp_grain_size {grain!r} is not a positive integer", path=origin)
    return AutoTPGeometry(kv_heads=kv, grain=grain, origin=origin)


def head_dim_of(config: dict) -> Optional[int]:
    """The attention head size of an HF model ``config``: ``head_dim``, else ``hidden_size`` over
    ``num_attention_heads`` (None when neither gives a positive integer)."""
    text = config.get("text_config")
    if isinstance(text, dict):
        config = text
    dim = config.get("head_dim")
    if isinstance(dim, int) and dim > 0:
        return dim
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0 and hidden > 0:
        return hidden // heads
    return None


def read_model_config(path: os.PathLike) -> dict:
    """A parsed HF ``config.json`` (``path``: the file or the folder holding it)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, CONFIG_NAME)
    return read_json_object(p, "the model config",
                            not_object="the model config must be a JSON object (the model's config.json)")


def contiguous_split(entry: dict) -> tuple[Optional[int], list[int]]:
    """``(dim, sizes)`` of an affine-map entry that is one contiguous block per rank along ``dim`` (``dim`` None:
    the whole tensor on every rank).

    Raises:
        ValueError: the entry is anything else (says what).
    """
    shape = tuple(int(s) for s in entry["logical_shape"])
    ranks = sorted((int(k), v) for k, v in entry["ranks"].items())
    tp = len(ranks)
    if [r for r, _ in ranks] != list(range(tp)):
        raise ValueError(f"its map names tensor ranks {[r for r, _ in ranks]}")
    full_strides = row_major_strides(shape)
    pieces = []
    for r, rank_entry in ranks:
        ps = rank_entry["pieces"]
        if len(ps) != 1:
            raise ValueError(f"tensor rank {r} holds {len(ps)} pieces (fused or interleaved sub-parameters)")
        p = ps[0]
        shard = tuple(int(s) for s in rank_entry["shard_shape"])
        if p.get("scale", 1.0) not in (1, 1.0):
            raise ValueError("a piece is scaled")
        if (tuple(p["shape"]) != shard or tuple(p["source"][1]) != full_strides or int(p["dest"][0]) != 0
                or tuple(p["dest"][1]) != row_major_strides(shard) or len(shard) != len(shape)):
            raise ValueError(f"tensor rank {r}'s piece is not a contiguous block of the tensor")
        pieces.append((shard, int(p["source"][0]), sorted(int(x) for x in p.get("locations", [r]))))
    if all(shard == shape and off == 0 and locs == list(range(tp)) for shard, off, locs in pieces):
        return None, [shape[0]] * tp if shape else []
    differ = {d for shard, _, _ in pieces for d in range(len(shape)) if shard[d] != shape[d]}
    if len(differ) != 1:
        raise ValueError("its blocks are not cut along one dimension")
    dim = differ.pop()
    start = 0
    sizes = []
    for r, (shard, off, locs) in enumerate(pieces):
        if locs != [r] or off != start * full_strides[dim] or shard[:dim] + shard[dim + 1:] != shape[:dim] + shape[dim + 1:]:
            raise ValueError(f"tensor rank {r}'s block is not the next one along dim {dim}")
        sizes.append(shard[dim])
        start += shard[dim]
    if start != shape[dim]:
        raise ValueError(f"its blocks cover {start} of the {shape[dim]} elements of dim {dim}")
    return dim, sizes


def affine_entry(shape: tuple, dim: Optional[int], sizes: list[int], tp: int) -> dict:
    """The ``affine_map`` entry DeepSpeed records for a tensor of ``shape`` at ``tp`` ranks: whole on every rank
    (``dim`` None) or cut along ``dim`` into ``sizes``."""
    shape = [int(s) for s in shape]
    strides = list(row_major_strides(shape))
    if dim is None:
        piece = {"shape": list(shape), "source": [0, list(strides)], "dest": [0, list(strides)],
                 "locations": list(range(tp))}
        return {"logical_shape": list(shape), "ranks": {r: {"shard_shape": list(shape), "pieces": [dict(piece)]}
                                                        for r in range(tp)}}
    ranks, start = {}, 0
    for r, size in enumerate(sizes):
        shard = list(shape)
        shard[dim] = size
        ranks[r] = {"shard_shape": list(shard),
                    "pieces": [{"shape": list(shard), "source": [start * strides[dim], list(strides)],
                                "dest": [0, list(row_major_strides(shard))], "locations": [r]}]}
        start += size
    return {"logical_shape": list(shape), "ranks": ranks}


__all__ = ["AutoTPGeometry", "geometry_from_config", "head_dim_of", "read_model_config", "contiguous_split", "affine_entry",
           "CONFIG_NAME"]
