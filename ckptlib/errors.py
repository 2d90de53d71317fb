"""The errors ckptlib raises.

Every error names the file (or folder) it is about, says what is wrong and what to do. They form one
small hierarchy so callers can catch :class:`CkptError` for everything, or a specific kind:

- :class:`CkptError` — base class.
  - :class:`NotACheckpointError` — the path holds no DeepSpeed checkpoint (also a ``FileNotFoundError``).
  - :class:`IncompleteCheckpointError` — files are missing, extra, truncated or inconsistent.
    - :class:`MissingEntryError` — an entry the metadata promises is not in the file (also a ``KeyError``).
  - :class:`UnsupportedCheckpointError` — a real checkpoint of a kind ckptlib cannot handle (yet).
    - :class:`PipelineUnknownError` — how the PipelineModule places its layers at the new number of stages
      is not in the checkpoint: the user must say it (``pp_partition``, ``pp_layers``, ``pp_tied``).
  - :class:`UnsafeCheckpointError` — a pickle asks for code ckptlib will not run.
  - :class:`OutputError` — a problem with the output location (exists, inside the source, disk full).
  - :class:`OutOfMemoryError` — an allocation failed: how much the run needs, what was left (also a ``MemoryError``).
  - :class:`Cancelled` — the user stopped an operation; nothing was written.
  - :class:`MissingDependencyError` — an optional package (torch) that this operation needs is not installed.
"""
from __future__ import annotations

import os
from typing import Optional


def printable(text: str, limit: int = 0) -> str:
    """``text`` safe to print on a terminal: control and formatting characters (escape sequences, carriage
    returns, bidirectional overrides: everything ``str.isprintable`` rejects) written as ``\\xNN`` /
    ``\\uNNNN`` escapes, and cut to ``limit`` characters (0: no limit). Names of files and the contents of
    ``latest`` come from the checkpoint."""
    out = []
    for ch in str(text):
        if ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    s = "".join(out)
    return s if not limit or len(s) <= limit else s[:limit] + "..."


class CkptError(Exception):
    """Base class of every error ckptlib raises on purpose.

    Args:
        message: what is wrong, in one or two sentences.
        path: the file or folder concerned (shown first in the message).
        hint: what the user can do about it.
    """

    #: the hint shown when the raiser gives none
    default_hint = "see `ckpt --help`"

    def __init__(self, message: str, path: str | os.PathLike | None = None, hint: str | None = None):
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint or self.default_hint
        super().__init__(self.__str__())

    def __str__(self) -> str:  # one readable line (two with a hint); nothing from a file reaches the terminal raw
        what, hint = message_and_hint(self)
        return f"{what}\n  hint: {hint}" if hint else what


def message_and_hint(exc: BaseException) -> tuple[str, Optional[str]]:
    """What ``ckpt`` says about an error, as two parts: the message (the file it is about first) and the
    hint (None without one), each safe to print (:func:`printable`). ``str()`` of a :class:`CkptError` is
    ``message`` and, on a second line, ``  hint: hint``; the notebook widgets show the same two parts. Any
    other exception: ``"TypeName: text"`` and no hint."""
    if isinstance(exc, CkptError):
        what = f"{printable(exc.path)}: {printable(exc.message)}" if exc.path else printable(exc.message)
        return what, (printable(exc.hint) if exc.hint else None)
    text = str(exc)
    return printable(f"{type(exc).__name__}: {text}" if text else type(exc).__name__), None


class NotACheckpointError(CkptError, FileNotFoundError):
    """The path does not hold a DeepSpeed checkpoint (or the requested tag)."""

    default_hint = ("point at the folder given to engine.save_checkpoint (it holds 'latest'), a tag folder such "
                    "as global_step100, or an HF Trainer checkpoint-N / output folder")


class IncompleteCheckpointError(CkptError, ValueError):
    """A checkpoint whose files are missing, extra, truncated or do not add up."""

    default_hint = "restore the files named from a copy, or use another tag (--tag); `ckpt inspect` lists all problems"


class MissingEntryError(IncompleteCheckpointError, KeyError):
    """An entry the checkpoint's own metadata says is there is not (e.g. an optimizer state of one rank);
    also a ``KeyError``, for callers that look entries up."""


class UnsupportedCheckpointError(CkptError, ValueError):
    """A valid checkpoint of a kind (format, version, feature) that ckptlib does not handle."""

    default_hint = "`ckpt inspect` shows what was found; please report this kind of checkpoint"


class PipelineUnknownError(UnsupportedCheckpointError):
    """A pipeline (``PipelineModule``) checkpoint whose layers would go to the new stages in more than one way
    (or in none) that its files allow: it records where its layers are, not the partition method, the number
    of layer specs or which layers use a tied module. The user says it (``plan_reshard(pp_partition=...,
    pp_layers=..., pp_tied=...)``, ``ckpt reshard --pp-partition/--pp-layers/--pp-tied``)."""

    default_hint = ("say how your PipelineModule places its layers: --pp-partition uniform|parameters|B0,B1,...,Bn "
                    "(the stage boundaries; Bn = the number of layer specs), --pp-layers N (the number of layer "
                    "specs) and --pp-tied KEY:I,J (every layer that uses the tied module KEY, first the one that "
                    "builds it)")


class UnsafeCheckpointError(CkptError, ValueError):
    """A pickle inside a checkpoint file refers to code that ckptlib refuses to run."""


class OutputError(CkptError, OSError):
    """The output location cannot be used (not empty, inside the source, not writable, disk full)."""

    default_hint = "choose another output folder"


class OutOfMemoryError(CkptError, MemoryError):
    """Memory ran out: the message says how much the plan needs and how much was left, and under which limit."""

    default_hint = ("free memory or raise the limit; with --workers 1 a run needs the least (the plan's "
                    "predicted peak memory, shown by --plan); nothing was written")


class Cancelled(CkptError):
    """The operation was cancelled; nothing was written to the destination."""

    default_hint = "run it again to finish it; no output was created"


class MissingDependencyError(CkptError, ImportError):
    """An operation needs an optional package that is not installed (torch: ``pip install 'ckptlib[torch]'``)."""

    default_hint = "pip install 'ckptlib[torch]'"
