"""The files Hugging Face clients keep beside a DeepSpeed checkpoint (folder listings and small JSON only).

An HF Trainer ``checkpoint-N`` folder holds, beside DeepSpeed's ``latest`` and tag folder, the model's
``config.json`` and ``generation_config.json``, the tokenizer files and chat template, and what the
Trainer needs to resume: ``trainer_state.json``, ``scheduler.pt``, ``training_args.bin``, one
``rng_state_{rank}.pth`` per rank (``rng_state.pth`` at one rank) and the 16-bit ``model.safetensors``.
An Accelerate ``save_state`` folder (``checkpoint_N``) holds ``random_states_{rank}.pkl``, and
``scheduler.bin``, ``sampler.bin``, ``custom_checkpoint_{i}.pkl`` ... for what was prepared or registered.

- :func:`model_files` — what ``from_pretrained`` needs beside the weights (an export copies them, with
  the config's dtype set to the exported one by :func:`config_with_dtype`);
- :func:`training_files` — what the client needs to resume, with the per-rank RNG files mapped to the
  new world size (a reshard carries them over byte for byte).

No file is unpickled: the ``.pt``/``.bin``/``.pkl`` files are only copied. Remote-code modules are found
by name (``auto_map``) and by their relative imports, read as text, never run.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONFIG = "config.json"
TRAINER_STATE = "trainer_state.json"
TRAINER, ACCELERATE = "HF Trainer", "Accelerate"

#: files from_pretrained (model, tokenizer, processor) reads beside the weights, with what they are
MODEL_FILES = {
    "config.json": "model config",
    "generation_config.json": "generation config",
    "tokenizer.json": "tokenizer",
    "tokenizer_config.json": "tokenizer config",
    "special_tokens_map.json": "tokenizer",
    "added_tokens.json": "tokenizer",
    "vocab.json": "tokenizer",
    "vocab.txt": "tokenizer",
    "merges.txt": "tokenizer",
    "tokenizer.model": "tokenizer",
    "spiece.model": "tokenizer",
    "sentencepiece.bpe.model": "tokenizer",
    "chat_template.jinja": "chat template",
    "chat_template.json": "chat template",
    "preprocessor_config.json": "processor config",
    "processor_config.json": "processor config",
    "video_preprocessor_config.json": "processor config",
}
#: sub-folders with model files (transformers saves extra chat templates there)
MODEL_FOLDERS = ("additional_chat_templates",)
#: DeepSpeed's own files at the top of a save dir (a reshard writes or copies them itself)
DEEPSPEED_FILES = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")
_TRAINER_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_ACCELERATE_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
_ACCELERATE_FILES = re.compile(r"^(scheduler|sampler|dl_state_dict|custom_checkpoint)(_\d+)?\.(bin|pkl)$|^scaler\.pt$")
_CHECKPOINT_NAME = re.compile(r"^checkpoint[-_]\d+$")
_RELATIVE_IMPORT = re.compile(r"^\s*(?:from\s+\.(\w+)\s+import|import\s+\.(\w+))", re.MULTILINE)
_ROLES = {"trainer_state.json": "Trainer state", "scheduler.pt": "LR scheduler", "training_args.bin":
          "training arguments (copied, never unpickled)", "scheduler.bin": "LR scheduler", "sampler.bin": "sampler",
          "scaler.pt": "loss scaler"}


@dataclass(frozen=True)
class SideFile:
    """A client file to carry into the output: ``name`` there (relative), ``source`` path, its ``bytes``
    and ``role`` (what it is, for the user)."""

    name: str
    source: str
    bytes: int
    role: str


def _files(folder: Path) -> dict[str, Path]:
    try:
        return {p.name: p for p in folder.iterdir() if p.is_file()}
    except OSError:
        return {}


def client(save_dir: Path) -> Optional[str]:
    """Which client wrote the files around a DeepSpeed save dir: :data:`TRAINER`, :data:`ACCELERATE` or
    None (from the file names)."""
    names = _files(Path(save_dir))
    if TRAINER_STATE in names or any(_TRAINER_RNG.match(n) for n in names):
        return TRAINER
    if any(_ACCELERATE_RNG.match(n) or _ACCELERATE_FILES.match(n) for n in names):
        return ACCELERATE
    return None


def config_folder(save_dir: Path) -> Optional[Path]:
    """Where the model's ``config.json`` is: the save dir itself, else (for a ``checkpoint-N`` or
    ``checkpoint_N`` folder) the training output folder above it; None if neither has one."""
    save_dir = Path(save_dir)
    candidates = [save_dir]
    if _CHECKPOINT_NAME.match(save_dir.name):
        candidates.append(save_dir.parent)
        if save_dir.parent.name == "checkpoints":  # Accelerate's automatic naming: project/checkpoints/checkpoint_N
            candidates.append(save_dir.parent.parent)
    return next((c for c in candidates if (c / CONFIG).is_file()), None)


def _remote_code(folder: Path, names: dict[str, Path]) -> list[str]:
    """The ``*.py`` modules the folder's ``auto_map`` entries name, and the sibling modules they import."""
    wanted: list[str] = []
    for cfg in ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        if cfg not in names:
            continue
        try:
            auto_map = json.loads(names[cfg].read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        refs = [v for value in auto_map.values() for v in (value if isinstance(value, list) else [value])]
        for ref in refs:
            if isinstance(ref, str) and "." in ref:
                module = ref.split("--")[-1].rsplit(".", 1)[0]
                wanted.append(module.replace(".", "/") + ".py")
    found: list[str] = []
    while wanted:
        name = wanted.pop(0)
        if name in found or not (folder / name).is_file():
            continue
        found.append(name)
        try:
            text = (folder / name).read_text(errors="replace")
        except OSError:
            continue
        wanted += [(a or b) + ".py" for a, b in _RELATIVE_IMPORT.findall(text)]
    return found


def model_files(save_dir: Path) -> tuple[list[SideFile], Optional[Path]]:
    """The files ``from_pretrained`` reads beside the weights (config, generation config, tokenizer,
    chat templates, remote code named by ``auto_map``), from :func:`config_folder`; and that folder
    (None when there is no ``config.json``: then nothing is returned)."""
    folder = config_folder(save_dir)
    if folder is None:
        return [], None
    return model_side_files(folder), folder


def model_side_files(folder: Path) -> list[SideFile]:
    """The files of :data:`MODEL_FILES` in ``folder`` (config.json among them if it is there), the remote code
    and the chat templates' sub-folder (a peft adapter's folder: the tokenizer beside ``adapter_config.json``)."""
    folder = Path(folder)
    names = _files(folder)
    out = [SideFile(n, os.fspath(p), p.stat().st_size, MODEL_FILES[n]) for n, p in sorted(names.items())
           if n in MODEL_FILES]
    out += [SideFile(n, os.fspath(folder / n), (folder / n).stat().st_size, "remote code")
            for n in _remote_code(folder, names)]
    for sub in MODEL_FOLDERS:
        for n, p in sorted(_files(folder / sub).items()):
            out.append(SideFile(f"{sub}/{n}", os.fspath(p), p.stat().st_size, "chat template"))
    return out


def config_with_dtype(text: str, dtype: str) -> str:
    """``config.json``'s text with the model dtype set to ``dtype`` (a torch name such as ``float32``):
    the keys it has (``dtype`` for transformers 5, ``torch_dtype`` before) or else ``dtype``; written the
    way transformers writes configs (sorted keys, 2-space indent)."""
    config = json.loads(text)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for k in keys:
        config[k] = dtype
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


@dataclass
class TrainingFiles:
    """What a reshard carries over for the client: ``files`` (renamed where needed), the ranks without
    an RNG state file (``new_ranks``), and ``notes`` for the user."""

    client: Optional[str]
    files: list
    new_ranks: list
    notes: list


def _rng(name: str, which: Optional[str]) -> Optional[int]:
    """The rank of a per-rank RNG file (``rng_state.pth``: rank 0), or None."""
    m = _TRAINER_RNG.match(name) if which == TRAINER else _ACCELERATE_RNG.match(name)
    if not m:
        return None
    return int(m.group(1)) if m.group(1) is not None else 0


def _rng_name(which: str, rank: int, world: int) -> str:
    if which == TRAINER:
        return "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"
    return f"random_states_{rank}.pkl"


def training_files(save_dir: Path, world_size: Optional[int], skip_folders: tuple = ()) -> TrainingFiles:
    """The files the client needs beside DeepSpeed's to resume from a folder written for ``world_size``
    ranks: every file at the top of an HF Trainer / Accelerate save dir except DeepSpeed's own and the
    RNG states of ranks that no longer exist (for a folder no client wrote, only :func:`model_files`).
    RNG files are renamed for the new size (the Trainer names its only one ``rng_state.pth``);
    ``world_size`` None (a universal checkpoint, loaded at any size) keeps them as they are."""
    save_dir = Path(save_dir)
    which = client(save_dir)
    if which is None:
        files, _ = model_files(save_dir) if (save_dir / CONFIG).is_file() else ([], None)
        return TrainingFiles(None, files, [], [])
    names = _files(save_dir)
    files, rng, notes = [], {}, []
    for n, p in sorted(names.items()):
        if n in DEEPSPEED_FILES:
            continue
        rank = _rng(n, which)
        if rank is not None:
            rng[rank] = p
            continue
        role = _ROLES.get(n) or MODEL_FILES.get(n) or ("16-bit weights" if n.startswith("model") and
                                                        n.endswith((".safetensors", ".json")) else "client file")
        files.append(SideFile(n, os.fspath(p), p.stat().st_size, role))
    for sub in MODEL_FOLDERS:
        for n, p in sorted(_files(save_dir / sub).items()):
            files.append(SideFile(f"{sub}/{n}", os.fspath(p), p.stat().st_size, "chat template"))
    if world_size is None:
        files += [SideFile(p.name, os.fspath(p), p.stat().st_size, f"RNG state of rank {r}")
                  for r, p in sorted(rng.items())]
        if rng:
            notes.append(f"the RNG states of the {len(rng)} saving rank(s) are carried over as they are: ranks "
                         "beyond them get none when the checkpoint is loaded at a larger size")
    for r in range(world_size or 0):
        if r in rng:
            files.append(SideFile(_rng_name(which, r, world_size), os.fspath(rng[r]), rng[r].stat().st_size,
                                  f"RNG state of rank {r}"))
    new_ranks = [r for r in range(world_size or 0) if r not in rng]
    dropped = sorted(r for r in rng if world_size is not None and r >= world_size)
    if new_ranks:
        what = ("the Trainer logs \"Didn't find an RNG file for process N\" at info level and goes on with its "
                "seeded generators" if which == TRAINER else
                "accelerator.load_state logs \"Could not load random states\" at info level and goes on")
        notes.append(f"rank(s) {_span(new_ranks)} had no RNG state in the source: {what}; the weights and "
                     "optimizer state are exact, only dropout and sampling randomness of those ranks differ")
    if dropped:
        notes.append(f"the RNG states of rank(s) {_span(dropped)} are not carried over (there are "
                     f"{world_size} ranks now)")
    others = sorted(p.name for p in save_dir.iterdir() if p.is_dir() and p.name not in skip_folders
                    and p.name not in MODEL_FOLDERS) if save_dir.is_dir() else []
    if others:
        notes.append(f"not carried over: the folder(s) {', '.join(others)} beside the tag folder")
    return TrainingFiles(which, files, new_ranks, notes)


def _span(ranks: list) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


__all__ = ["SideFile", "TrainingFiles", "client", "config_folder", "model_files", "config_with_dtype",
           "training_files", "TRAINER", "ACCELERATE", "CONFIG", "MODEL_FILES"]
