"""An AutoEP checkpoint exported in the Hugging Face layout of its model class.

AutoEP checkpoints hold the experts stacked per expert-parallel rank under AutoEP's names
(:mod:`ckptlib.deepspeed.autoep`) and record no model class (no ``config.json`` beside them: DeepSpeed writes none,
and the Trainer is not in the loop). An export that ``from_pretrained`` loads must name and fuse them as the class
does, so it needs the model's config: ``model_config`` (a ``config.json``, the folder holding one, or the parsed
dict), else the ``config.json`` beside the checkpoint; without either the export is refused and says so. The
config is written into the output (with the exported dtype) beside the weights.
"""
from __future__ import annotations

import json
import os
from typing import Union

from ..deepspeed import Checkpoint, hf
from ..deepspeed.autoep import HF_CLASSES
from ..deepspeed.autotp import read_model_config
from ..errors import CkptError
from ..plan import TextFile

ModelConfig = Union[str, os.PathLike, dict, None]


def in_hf_layout(ck: Checkpoint, model_config: ModelConfig, out_dtype: str) -> tuple[Checkpoint, list, list]:
    """``(checkpoint to export, side files, notes)``: an AutoEP checkpoint seen in its class's layout with the
    config as a side file (``config.json`` with ``out_dtype``), any other checkpoint as it is (no side files: the
    usual ones are found beside it).

    Raises:
        CkptError: an AutoEP checkpoint without a model config, or with one of a class ckptlib has not checked."""
    layers = ck.records.autoep_layers
    if not layers:
        return ck, [], []
    ck.check_readable()  # what cannot be read is refused for its own reason first
    given = model_config is not None
    if model_config is None:
        _, folder = hf.model_files(ck.location.save_dir)
        if folder is None:
            raise CkptError(
                "an AutoEP checkpoint records no model class, and the export writes the experts in the layout of "
                "the model's class (Mixtral, Qwen3-MoE, OLMoE: gate_up_proj, down_proj): no config.json beside the "
                "checkpoint", path=ck.location.tag_dir,
                hint="pass the model's config: --model-config CONFIG.json (model_config= in Python)")
        model_config = folder / hf.CONFIG
    config = model_config if isinstance(model_config, dict) else read_model_config(model_config)
    model_type = str(config.get("model_type", ""))
    if model_type not in HF_CLASSES:
        raise CkptError(f"the model config's model_type is {model_type!r}; ckptlib knows the transformers layout AutoEP "
                        f"folds into for {', '.join(sorted(HF_CLASSES))}", path=ck.location.tag_dir,
                        hint="pass the config of the model this checkpoint trained")
    counts = {config[k] for k in ("num_local_experts", "num_experts") if isinstance(config.get(k), int)}
    experts = next((c for c in counts if any(lay.num_experts != c for lay in layers)), None)
    if experts is not None:
        raise CkptError(f"the model config has {experts} experts per layer, the checkpoint "
                        f"{sorted({lay.num_experts for lay in layers})}: the config is another model's",
                        path=ck.location.tag_dir, hint="pass the config of the model this checkpoint trained")
    text = hf.config_with_dtype(json.dumps(config, indent=2) + "\n", out_dtype)
    where = "--model-config" if given else "beside the checkpoint"
    notes = [f"AutoEP experts written as transformers' {HF_CLASSES[model_type]} keeps them (model_type {model_type!r}, "
             f"config from {where}): gate_up_proj = cat(w1, w3), down_proj = w2, mlp.gate.weight = the router"]
    return ck.in_layout(model_type), [TextFile(hf.CONFIG, text, kind="hf")], notes


__all__ = ["in_hf_layout", "ModelConfig"]
