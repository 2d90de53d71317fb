"""The files of a tag folder, each pickle opened once (metadata only), failures kept as problems."""
from __future__ import annotations

import os
from typing import Optional

from ..errors import CkptError, UnsafeCheckpointError
from ..io.torchzip import PickleMemo, ReadStats, TorchFile
from . import files as fnames
from .discovery import Location
from .offload import swap_name, swap_paths
from .records import FileInfo


def list_files(location: Location) -> list[FileInfo]:
    """The tag folder's files with their roles, in a stable order (kind, ranks, natural name), then the
    NVMe swap files under ``offloaded_tensors/`` (kind ``swap``, ``dp_rank`` from their rank folder); a universal
    folder's: :func:`universal_files`."""
    if location.universal:
        return universal_files(location)
    given = location.given.resolve()
    out = []
    for p in location.tag_dir.iterdir():
        if not p.is_file():
            continue
        role = fnames.classify(p.name)
        out.append((role.sort_key, FileInfo(path=p, relpath=os.path.relpath(p, given), bytes=p.stat().st_size,
                                            kind=role.kind, dp_rank=role.dp_rank, mp_rank=role.mp_rank,
                                            prefix=role.prefix, layer=role.layer, expert=role.expert)))
    swaps = []
    for p in swap_paths(location.tag_dir):
        name = swap_name(location.tag_dir, p)
        rel = os.path.relpath(p, location.tag_dir)
        swaps.append(((name.rank if name else -1, fnames.natural_key(rel)),
                      FileInfo(path=p, relpath=os.path.relpath(p, given), bytes=p.stat().st_size, kind=fnames.SWAP,
                               dp_rank=name.rank if name else None)))
    return [f for _, f in sorted(out, key=lambda t: t[0])] + [f for _, f in sorted(swaps, key=lambda t: t[0])]


def universal_files(location: Location) -> list[FileInfo]:
    """The folder's files: its own (model states, layer files; classified by name), then ``zero/``'s (the optimizer
    state, then each parameter's files in natural order)."""
    given = location.given.resolve()
    top = []
    for p in location.tag_dir.iterdir():
        if p.is_file():
            role = fnames.classify(p.name)
            top.append((role.sort_key, FileInfo(path=p, relpath=os.path.relpath(p, given), bytes=p.stat().st_size,
                                                kind=role.kind, dp_rank=role.dp_rank, mp_rank=role.mp_rank,
                                                prefix=role.prefix, layer=role.layer, expert=role.expert)))
    out = [f for _, f in sorted(top, key=lambda t: t[0])]
    zero = location.tag_dir / "zero"
    for d in sorted(zero.iterdir(), key=lambda p: (p.is_dir(), fnames.natural_key(p.name))):
        if d.is_file():
            out.append(FileInfo(path=d, relpath=os.path.relpath(d, given), bytes=d.stat().st_size,
                                kind=fnames.UNIVERSAL_OPTIMIZER if d.name == fnames.UNIVERSAL_OPTIMIZER_FILE else fnames.OTHER))
            continue
        for f in sorted(d.iterdir(), key=lambda p: fnames.natural_key(p.name)):
            if f.is_file():
                out.append(FileInfo(path=f, relpath=os.path.relpath(f, given), bytes=f.stat().st_size,
                                    kind=fnames.FRAGMENT if f.suffix == ".pt" else fnames.OTHER))
    return out


class OpenedFiles:
    """Opens the pickles of a tag folder's files on demand, once each (a file whose pickle repeats one
    already read is checked without unpickling it again until its tree is used:
    :class:`~ckptlib.io.torchzip.PickleMemo`).

    A file that cannot be read becomes a problem (``problems``, one sentence naming it) and ``None``;
    a hostile pickle stops everything (:class:`~ckptlib.errors.UnsafeCheckpointError`).
    """

    def __init__(self, location: Location, problems: Optional[list] = None):
        self.location = location
        self.stats = ReadStats()
        self.files = list_files(location)
        self.problems: list[str] = problems if problems is not None else []
        self._open: dict[str, Optional[TorchFile]] = {}
        self._errors: dict[str, CkptError] = {}
        self._memo: Optional[PickleMemo] = PickleMemo()  # ZeRO-3's rank files repeat one pickle

    def forget_pickles(self) -> None:
        """Stop remembering the pickles seen (files opened from now on are unpickled on their own)."""
        self._memo = None

    def of(self, kind: str, mp_rank: int = 0) -> list[FileInfo]:
        return [f for f in self.files if f.kind == kind and (f.mp_rank or 0) == mp_rank]

    def get(self, info: FileInfo) -> Optional[TorchFile]:
        key = str(info.path)
        if key not in self._open:
            try:
                self._open[key] = TorchFile(info.path, stats=self.stats, memo=self._memo)
            except UnsafeCheckpointError:
                raise  # never half-open a checkpoint that holds a hostile pickle
            except CkptError as e:
                self.problems.append(f"{info.relpath}: {e.message}")
                self._open[key] = None
                self._errors[key] = e
        return self._open[key]

    def opened(self) -> list[tuple[FileInfo, TorchFile]]:
        """The files opened so far (readable ones), in the folder's order."""
        return [(f, self._open[str(f.path)]) for f in self.files if self._open.get(str(f.path)) is not None]

    def error(self, info: FileInfo) -> Optional[CkptError]:
        """Why :meth:`get` gave None for ``info``."""
        return self._errors.get(str(info.path))

    def close(self) -> None:
        for f in self._open.values():
            if f is not None:
                f.close()
        self._open.clear()


__all__ = ["list_files", "universal_files", "OpenedFiles"]
