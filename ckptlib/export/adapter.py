"""A peft adapter exported as peft saves it, so that ``PeftModel.from_pretrained(base, OUT)`` loads it as it is.

The checkpoint's trainable tensors (the fp32 masters, or cast to ``dtype``) go into ``adapter_model.safetensors``
under peft's saved names (:mod:`ckptlib.kinds.adapters`), one file (peft reads no sharded adapter), beside
``adapter_config.json`` (from beside the tag, or given), peft's ``README.md`` and the tokenizer files found beside the
tag. ``states``: each optimizer state in ``<key>/adapter_model.safetensors`` under the same names. Metadata only.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence, Union

from ..deepspeed import Checkpoint
from ..deepspeed.adapter import find_adapter
from ..errors import CkptError
from ..kinds import adapters as A
from ..plan import CopyFile, PlannedTensor, TextFile
from .weights import weights_files

NO_LIMIT = 1 << 62


def adapter_sets(ck: Checkpoint, out_dtype: str, states: Sequence[str], adapter: Optional[bool],
                 config: Union[str, os.PathLike, dict, None]) -> Optional[tuple[list, list, list, list]]:
    """``(weights files, final files, side files, notes)`` of the adapter export, or None when ``adapter`` is None
    (choose) and the checkpoint trains no adapter.

    Raises:
        CkptError: ``adapter`` asked and no adapter, a config missing or naming a method ckptlib cannot place, a
            trainable tensor peft would not save."""
    found = find_adapter(ck, config, required=bool(adapter))
    if found is None:
        return None
    if found.config is None:
        raise CkptError("the checkpoint trains a peft adapter but no adapter_config.json is beside the tag: peft "
                        "needs it to load the adapter", path=ck.location.tag_dir,
                        hint="pass it: --adapter-config adapter_config.json (adapter_config= in Python), or write the "
                             "PeftModel's tensors under DeepSpeed's names with --no-adapter")
    names = found.names
    shapes = {p.name: tuple(p.shape) for p in ck.parameters}
    sets = [("", [PlannedTensor(saved, name, None, "trainable", shapes[name], out_dtype, tuple(ck.sources(name)))
                  for name, (_, saved) in names.items()])]
    for key in states:
        sets.append((key + "/", [PlannedTensor(saved, name, key, "state", shapes[name], "float32",
                                               tuple(ck.sources(name, key)))
                                 for name, (_, saved) in names.items() if key in ck.state_keys(name)]))
    files, finals, _ = weights_files(sets, "safetensors", NO_LIMIT, ck.optimizer.step if ck.optimizer else None)
    for f in files:
        f.name = f.name.rsplit("/", 1)[0] + "/" + A.WEIGHTS_FILE if "/" in f.name else A.WEIGHTS_FILE
    if isinstance(config, dict):
        side: list = [TextFile(A.CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n", kind="hf")]
    else:
        side = [CopyFile(A.CONFIG_FILE, found.config_path, os.path.getsize(found.config_path), kind="hf")]
    side += [CopyFile(f.name, f.source, f.bytes, kind="hf") for f in found.side_files]
    c = found.config
    kinds = ", ".join(f"{n} {k}" for k, n in found.counts.items())
    notes = [f"a peft {c.method} adapter (r={c.r}, alpha={c.alpha:g}): {len(names)} tensors ({kinds}) written as peft "
             f"saves them ({A.WEIGHTS_FILE}, {A.CONFIG_FILE} from {found.config_path if not isinstance(config, dict) else 'the config given'}); "
             "load with PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT), BASE the model it "
             "was trained on",
             f"base weights {found.base_line()}"]
    if any(k in (A.EMB_A, A.EMB_B) for k, _ in names.values()) and not found.frozen:
        notes.append("peft's own save of an adapter on an embedding adds that embedding's base weight "
                     "(…base_layer.weight, save_embedding_layers='auto'); it is frozen, so not in the checkpoint: "
                     "PeftModel.from_pretrained takes it from the base model")
    return files, finals, side, notes


__all__ = ["adapter_sets"]
