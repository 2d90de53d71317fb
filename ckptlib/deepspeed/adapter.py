"""A checkpoint that trained a peft adapter: what it is, from the names DeepSpeed kept and peft's files beside it.

:func:`find_adapter` tells an adapter checkpoint (:func:`ckptlib.kinds.adapters.looks_like_adapter` over its trainable
parameters) and reads ``adapter_config.json`` from beside the tag (the Trainer's ``checkpoint-N/``) or from where the
caller says. Metadata only; the files beside are read as text or as a safetensors header, never unpickled.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..errors import CkptError
from ..io.jsonfile import read_json_object
from ..kinds import adapters as A
from . import hf
from .checkpoint import Checkpoint


@dataclass
class Adapter:
    """A peft adapter in a checkpoint.

    Attributes:
        config: the parsed ``adapter_config.json`` (None when there is none beside the tag and none was given);
            ``config_path``: where it was read from.
        names: ``{DeepSpeed's (the PeftModel's) name: (kind, peft's saved name)}`` of every trainable tensor, in the
            checkpoint's order.
        frozen: the frozen tensors the checkpoint holds data for (the base weights, when the run saved them).
        weights_file: the ``adapter_model.safetensors`` beside the tag (None: none there).
        side_files: what peft lays out beside an adapter that is beside the tag too (README.md, tokenizer files).
    """

    config: Optional[A.AdapterConfig]
    config_path: Optional[str]
    names: dict
    frozen: list
    weights_file: Optional[str]
    side_files: list = field(default_factory=list)

    @property
    def counts(self) -> dict:
        return A.counts(self.names)

    def base_line(self) -> str:
        if self.frozen:
            return (f"in the checkpoint too ({len(self.frozen)} frozen tensors saved); an adapter export leaves "
                    "them out")
        return ("not in the checkpoint (saved with exclude_frozen_parameters): they are the base model's, the one "
                "PeftModel.from_pretrained(base, adapter) loads the adapter on")


def _frozen_with_data(ck: Checkpoint) -> list[str]:
    out = []
    for p in ck.parameters:
        if p.trainable or p.tied_to:
            continue
        try:
            ck.sources(p.name)
        except CkptError:  # no data saved for it
            continue
        out.append(p.name)
    return out


def find_adapter(ck: Checkpoint, config: Union[str, os.PathLike, dict, None] = None,
                 required: bool = False) -> Optional[Adapter]:
    """The adapter ``ck`` trained, or None when its trainable names are no PeftModel's adapter (and ``config``
    is not given). ``config``: ``adapter_config.json`` (a path, its folder, or the dict); default: the one beside
    the tag, if any.

    Raises:
        CkptError: ``required`` and no adapter; a config that cannot be read or whose method ckptlib cannot place;
            a trainable tensor peft would not save (:func:`ckptlib.kinds.adapters.adapter_names`)."""
    trainable = [p.name for p in ck.parameters if p.trainable and not p.tied_to]
    save_dir = Path(ck.location.save_dir)
    if not A.looks_like_adapter(trainable):
        if required or config is not None:
            raise CkptError("the checkpoint trains no peft adapter: its trainable tensors are not a PeftModel's "
                            f"adapter tensors (e.g. {trainable[0] if trainable else 'none at all'})",
                            path=ck.location.tag_dir, hint="export the model as it is (without --adapter)")
        return None
    parsed, where = None, None
    if isinstance(config, dict):
        parsed, where = A.parse_config(config, "the adapter config given"), "given"
    else:
        path = Path(config) if config is not None else save_dir / A.CONFIG_FILE
        if path.is_dir():
            path = path / A.CONFIG_FILE
        if config is not None or path.is_file():
            raw = read_json_object(path, f"the adapter config {A.CONFIG_FILE}")
            parsed, where = A.parse_config(raw, os.fspath(path)), os.fspath(path)
    names = A.adapter_names(trainable, parsed)
    weights = save_dir / A.WEIGHTS_FILE
    side = [f for f in hf.model_side_files(save_dir) if f.name != hf.CONFIG]
    readme = save_dir / A.README
    if readme.is_file():
        side.append(hf.SideFile(A.README, os.fspath(readme), readme.stat().st_size, "peft model card"))
    return Adapter(parsed, where, names, _frozen_with_data(ck), os.fspath(weights) if weights.is_file() else None,
                   side)


__all__ = ["Adapter", "find_adapter"]
