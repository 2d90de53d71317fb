"""Find the DeepSpeed checkpoint a user points at (folder names and small text files only).

Accepted paths:

- a *save dir*: the folder given to ``engine.save_checkpoint`` (holds ``latest`` and tag folders);
  this is also what Accelerate writes and what an HF Trainer ``checkpoint-N/`` folder is;
- a *tag folder* (holds ``*_model_states.pt``);
- a training *output* folder holding several HF Trainer ``checkpoint-N`` (or Accelerate ``checkpoint_N``)
  folders, or an Accelerate project folder (``checkpoints/checkpoint_N``): they are listed and the newest
  (largest N) holding DeepSpeed files is used.

When a checkpoint is damaged, :func:`repair_hint` names the older checkpoint folder or the other tag to use.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import NotACheckpointError, printable
from .files import MODEL_STATES, OPTIM_STATES, classify, natural_key

_HF_CHECKPOINT = re.compile(r"^checkpoint[-_](\d+)$")  # HF Trainer checkpoint-N, Accelerate checkpoint_N
_HF_WEIGHTS = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)$")


@dataclass
class Location:
    """Where a checkpoint is.

    Attributes:
        given: the path the user gave.
        save_dir: the folder holding ``latest`` and the tag folders.
        tag: the tag in use.
        tags: every tag folder found in ``save_dir`` (natural order).
        latest: the content of ``save_dir/latest`` (None when there is no such file).
        checkpoints: for a training output folder, the ``checkpoint-N`` folders found (newest last).
        notes: how the choice was made, for the user.
    """

    given: Path
    save_dir: Path
    tag: str
    tags: list
    latest: Optional[str]
    checkpoints: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    universal: bool = False  # a universal checkpoint folder (zero/ with one folder per parameter)

    @property
    def tag_dir(self) -> Path:
        return self.save_dir / self.tag


def is_tag_dir(path: Path) -> bool:
    """A folder holding DeepSpeed model-state or optimizer-state files."""
    try:
        return path.is_dir() and any(classify(p.name).kind in (MODEL_STATES, OPTIM_STATES)
                                     for p in path.iterdir() if p.is_file())
    except OSError:
        return False


LATEST_LIMIT = 1024  # a tag name is short; DeepSpeed writes the tag and nothing else


def read_latest(save_dir: Path) -> Optional[str]:
    """The tag ``save_dir/latest`` names, or None when there is no such file.

    ``latest`` is only read when it is a regular file of the save dir itself (DeepSpeed writes one): a
    symbolic link (to ``/etc/passwd``, say) is never followed, and a FIFO or device is never opened.

    Raises:
        NotACheckpointError: ``latest`` is a link or not a regular file, or does not hold a tag name (too long,
            several lines, control characters, a path).
    """
    p = save_dir / "latest"
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    hint = "remove or repair it, or pass --tag with one of the tag folders"
    if stat.S_ISLNK(st.st_mode):
        raise NotACheckpointError("'latest' is a symbolic link; ckptlib does not follow it (DeepSpeed writes a "
                                  "file holding the tag name)", path=p, hint=hint)
    if not stat.S_ISREG(st.st_mode):
        raise NotACheckpointError("'latest' is not a regular file (a folder, FIFO or device)", path=p, hint=hint)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        raw = os.read(fd, LATEST_LIMIT + 1)
    finally:
        os.close(fd)
    text = raw.decode("utf-8", "replace").strip()
    if len(raw) > LATEST_LIMIT or any(not ch.isprintable() for ch in text) or "/" in text or "\\" in text \
            or text in (".", ".."):
        raise NotACheckpointError(f"'latest' does not hold a tag name ({printable(text, 60)!s})", path=p, hint=hint)
    return text


def list_tags(save_dir: Path) -> list[str]:
    try:
        return sorted((p.name for p in save_dir.iterdir() if is_tag_dir(p)), key=natural_key)
    except OSError:
        return []


def list_hf_checkpoints(folder: Path) -> list[Path]:
    """The ``checkpoint-N`` (HF Trainer) and ``checkpoint_N`` (Accelerate) folders in ``folder``, oldest
    first by N; for an Accelerate project folder, those in its ``checkpoints/``."""
    try:
        found = [p for p in folder.iterdir() if p.is_dir() and _HF_CHECKPOINT.match(p.name)]
    except OSError:
        return []
    if not found and (folder / "checkpoints").is_dir():
        return list_hf_checkpoints(folder / "checkpoints")
    return sorted(found, key=lambda p: int(_HF_CHECKPOINT.match(p.name).group(1)))


def _contents(folder: Path, limit: int = 6) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    except OSError:
        return "nothing readable"
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _hf_weights(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.is_file() and _HF_WEIGHTS.match(p.name))
    except OSError:
        return []


def older_checkpoints(save_dir: Path) -> list[Path]:
    """The ``checkpoint-N`` / ``checkpoint_N`` folders beside ``save_dir`` with a smaller N that hold a
    DeepSpeed checkpoint, newest first."""
    m = _HF_CHECKPOINT.match(save_dir.name)
    if not m:
        return []
    n = int(m.group(1))
    return [c for c in reversed(list_hf_checkpoints(save_dir.parent))
            if int(_HF_CHECKPOINT.match(c.name).group(1)) < n and list_tags(c)]


def repair_hint(location: "Location") -> str:
    """What to do about a damaged checkpoint: restore the files, or use the older checkpoint folder or
    another tag found beside it (named)."""
    older = older_checkpoints(location.save_dir)
    others = [t for t in location.tags if t != location.tag]
    if older:
        alt = f"or use the older checkpoint {older[0]}"
    elif others:
        alt = f"or use another tag: --tag {others[-1]}" + (f" (tags here: {', '.join(others)})" if len(others) > 1 else "")
    else:
        alt = "(there is no older checkpoint or other tag beside it)"
    return f"restore the files named from a copy, {alt}; `ckpt inspect` lists all problems"


@dataclass
class Detected:
    """What a folder looks like, from its names alone (no file is opened; for browsing).

    ``kind``: ``"checkpoint"`` (holds ``latest`` or tag folders), ``"tag"`` (holds DeepSpeed's
    ``*_model_states.pt`` / ``*_optim_states.pt``), ``"training-output"`` (holds ``checkpoint-N``
    folders) or ``"folder"``. ``tags`` are in natural order, ``checkpoints`` oldest first.
    """

    path: Path
    kind: str
    tags: list = field(default_factory=list)
    latest: Optional[str] = None
    checkpoints: list = field(default_factory=list)


def detect(path: str | os.PathLike) -> Detected:
    """Recognise a checkpoint (``latest`` file, tag folders), a tag folder or a training output folder,
    the same way :func:`locate` does."""
    path = Path(path)
    if is_tag_dir(path):
        return Detected(path, "tag")
    try:
        latest = read_latest(path)
    except OSError:
        return Detected(path, "folder")
    tags = list_tags(path)
    if latest is not None or tags:
        return Detected(path, "checkpoint", tags=tags, latest=latest[:200] if latest else latest)
    hf = list_hf_checkpoints(path)
    if hf:
        return Detected(path, "training-output", checkpoints=[d.name for d in hf])
    return Detected(path, "folder")


def _not_a_checkpoint(given: Path, checkpoints: list[Path]) -> NotACheckpointError:
    """The error for a folder without DeepSpeed files, saying what it does hold."""
    if checkpoints:
        newest = checkpoints[-1]
        weights = _hf_weights(newest)
        what = (f"{newest.name} holds only Hugging Face weights ({', '.join(weights)}) and client files: saved "
                "without DeepSpeed's state (e.g. save_only_model=True)" if weights else
                f"{newest.name} holds {_contents(newest)}")
        return NotACheckpointError(
            f"none of the {len(checkpoints)} checkpoint folders here holds a DeepSpeed checkpoint (no 'latest', no "
            f"global_step* folder): {what}", path=given,
            hint="a folder with only model.safetensors already opens with from_pretrained; to convert DeepSpeed's "
                 "state, point at a checkpoint saved with it")
    weights = _hf_weights(given)
    if weights:
        older = older_checkpoints(given)
        return NotACheckpointError(
            f"this folder holds Hugging Face weights ({', '.join(weights)}) but no DeepSpeed checkpoint (no "
            "'latest', no global_step* folder): it was saved without DeepSpeed's state (e.g. save_only_model=True)",
            path=given, hint=(f"the older checkpoint {older[0]} has DeepSpeed's state; " if older else "")
            + "from_pretrained opens this folder as it is")
    return NotACheckpointError(
        f"no DeepSpeed checkpoint here: no 'latest' file, no tag folder with *_model_states.pt files, no "
        f"checkpoint-N or checkpoint_N folders (it holds {_contents(given)})", path=given,
        hint="point at the folder given to engine.save_checkpoint (it holds 'latest'), at a tag folder such as "
             "global_step100, or at an HF Trainer output folder / Accelerate project or checkpoints folder")


def universal_tag_dir(path: Path, tag: Optional[str] = None) -> Optional[Path]:
    """The universal checkpoint folder ``path`` is or points at (``zero/`` with one folder per parameter, beside
    model-states files and no optimizer-state files; or a save dir whose ``latest_universal`` names one and
    that has no ``latest``), else None."""
    def universal(folder: Path) -> bool:
        try:
            return (folder / "zero").is_dir() and not any(classify(p.name).kind == OPTIM_STATES
                                                          for p in folder.iterdir() if p.is_file())
        except OSError:
            return False
    if tag is not None:
        return path / tag if universal(path / tag) else None
    if universal(path):
        return path
    latest = path / "latest_universal"
    if latest.is_file() and not os.path.lexists(path / "latest"):
        try:
            name = latest.read_text(errors="replace").strip()[:LATEST_LIMIT]
        except OSError:
            return None
        return path / name if name and "/" not in name and universal(path / name) else None
    return None


def _universal_location(given: Path, found: Path) -> Location:
    """The Location of universal folder ``found`` (its save dir: the folder holding it; its tags: the universal
    folders there; ``latest``: what ``latest_universal`` names)."""
    save_dir = found.parent
    tags = [p.name for p in sorted(save_dir.iterdir(), key=lambda p: natural_key(p.name))
            if p.is_dir() and universal_tag_dir(p) == p]
    latest = None
    if (save_dir / "latest_universal").is_file():
        try:
            latest = (save_dir / "latest_universal").read_text(errors="replace").strip()[:LATEST_LIMIT] or None
        except OSError:
            latest = None
    return Location(given=given, save_dir=save_dir, tag=found.name, tags=tags, latest=latest, universal=True,
                    notes=[f"{found.name} is a universal checkpoint (zero/ holds one folder per parameter)"])


def locate(path: str | os.PathLike, tag: Optional[str] = None) -> Location:
    """Resolve ``path`` (and ``tag``) to one checkpoint; raises :class:`NotACheckpointError`."""
    given = Path(path).expanduser()
    if not given.exists():
        raise NotACheckpointError("no such file or folder", path=given)
    if given.is_file():
        if classify(given.name).kind in (MODEL_STATES, OPTIM_STATES):
            given = given.parent
        else:
            raise NotACheckpointError("this is a file, not a checkpoint folder", path=given,
                                      hint="give the folder that holds 'latest' and the tag folders")
    given = given.resolve()
    found = universal_tag_dir(given, tag)
    if found is not None:
        return _universal_location(Path(path), found)
    notes: list[str] = []
    checkpoints: list[Path] = []

    if is_tag_dir(given) and tag is None:
        save_dir, tag = given.parent, given.name
        notes.append(f"using the tag folder given, '{tag}'")
    else:
        save_dir = given
        if not list_tags(save_dir) and not os.path.lexists(save_dir / "latest"):
            checkpoints = list_hf_checkpoints(given)
            usable = [c for c in checkpoints if list_tags(c)]
            if usable:
                save_dir = usable[-1]
                notes.append(f"found {len(checkpoints)} checkpoint folders ({checkpoints[0].name} ... "
                             f"{checkpoints[-1].name}); using the newest with DeepSpeed files, {save_dir.name}")
                newer = checkpoints[checkpoints.index(save_dir) + 1:]
                if newer:
                    notes.append(f"{', '.join(c.name for c in newer)} hold{'s' if len(newer) == 1 else ''} no "
                                 "DeepSpeed checkpoint "
                                 f"({newer[-1].name} holds {_contents(newer[-1])})")
            else:
                raise _not_a_checkpoint(given, checkpoints)

    tags = list_tags(save_dir)
    try:
        latest = read_latest(save_dir)
    except NotACheckpointError as e:
        if tag is None:
            raise
        latest = None
        notes.append(f"'latest' ignored: {e.message}")
    if tag is None:
        if latest is not None:
            if latest not in tags:
                raise NotACheckpointError(
                    f"'latest' names the tag '{latest}', but there is no such tag folder "
                    f"(tags found: {', '.join(tags) or 'none'})", path=save_dir / "latest",
                    hint="the save was probably interrupted; pass --tag with one of the tags found")
            tag = latest
        elif tags:
            tag = tags[-1]
            notes.append(f"no 'latest' file; using the last tag in natural order, '{tag}'")
        else:
            raise NotACheckpointError("no tag folder with DeepSpeed files here", path=save_dir)
    elif tag not in tags:
        raise NotACheckpointError(f"there is no tag '{tag}' (tags found: {', '.join(tags) or 'none'})",
                                  path=save_dir, hint="pass one of the tags found")
    return Location(given=Path(path), save_dir=save_dir, tag=tag, tags=tags, latest=latest,
                    checkpoints=[str(c) for c in checkpoints], notes=notes)
