"""The errors ckptlib raises.

Every error names the file (or folder) it is about, says what is wrong and what to do. They form one
small hierarchy so callers can catch :class:`CkptError` for everything, or a specific kind:

- :class:`CkptError` — base class.
  - :class:`NotACheckpointError` — the path holds no DeepSpeed checkpoint (also a ``FileNotFoundError``).
  - :class:`IncompleteCheckpointError` — files are missing, extra, truncated or inconsistent.
  - :class:`UnsupportedCheckpointError` — a real checkpoint of a kind ckptlib cannot handle (yet).
  - :class:`UnsafeCheckpointError` — a pickle asks for code ckptlib will not run.
  - :class:`OutputError` — a problem with the output location (exists, inside the source, disk full).
"""
from __future__ import annotations

import os


class CkptError(Exception):
    """Base class of every error ckptlib raises on purpose.

    Args:
        message: what is wrong, in one or two sentences.
        path: the file or folder concerned (shown first in the message).
        hint: what the user can do about it.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None, hint: str | None = None):
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:  # one readable line (two with a hint)
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class NotACheckpointError(CkptError, FileNotFoundError):
    """The path does not hold a DeepSpeed checkpoint (or the requested tag)."""


class IncompleteCheckpointError(CkptError, ValueError):
    """A checkpoint whose files are missing, extra, truncated or do not add up."""


class UnsupportedCheckpointError(CkptError, ValueError):
    """A valid checkpoint of a kind (format, version, feature) that ckptlib does not handle."""


class UnsafeCheckpointError(CkptError, ValueError):
    """A pickle inside a checkpoint file refers to code that ckptlib refuses to run."""


class OutputError(CkptError, OSError):
    """The output location cannot be used (not empty, inside the source, not writable, disk full)."""
