"""Progress reporting and cancellation for long operations (export, reshard).

Long operations call an :class:`Observer`; the library itself never imports ``tqdm.notebook`` or any UI.
:class:`TqdmObserver` is the terminal one; notebooks pass their own (see ``ckptlib.ui``). A
``threading.Event`` passed as ``cancel`` stops an operation at the next chunk; it then raises
:class:`Cancelled` and leaves no output behind.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional

from .errors import Cancelled


class Observer:
    """Receives progress; override what you need (all methods are no-ops here).

    Methods are called from the thread that runs the operation.
    """

    def on_start(self, plan: Any) -> None:
        """Before anything is written; ``plan`` is the plan being executed."""

    def on_file(self, name: str) -> None:
        """An output file is started."""

    def on_tensor(self, name: str) -> None:
        """A tensor is started."""

    def on_bytes(self, done: int, total: int) -> None:
        """``done`` of ``total`` output bytes are written."""

    def on_finish(self, result: Any) -> None:
        """The output is complete and in place."""

    def on_error(self, error: BaseException) -> None:
        """The operation failed (or was cancelled); the output was not created."""


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or a stand-in without isatty
        return False


class TqdmObserver(Observer):
    """A plain tqdm bar for terminals (output bytes)."""

    def __init__(self, desc: str = "export", disable: Optional[bool] = None):
        self.desc, self.disable = desc, disable
        self.bar = None

    def on_start(self, plan):
        self.bar = self.open_bar(plan.write_bytes)

    def open_bar(self, total: int):
        """A tqdm bar over ``total`` bytes, or None where it would show nothing: ``disable=None`` off a
        terminal (tqdm's own rule), decided before importing tqdm, which then costs a run nothing."""
        if self.disable or (self.disable is None and not _is_terminal(sys.stderr)):
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, desc=self.desc, disable=self.disable)

    def on_bytes(self, done, total):
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def on_file(self, name):
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_finish(self, result):
        self._close()

    def on_error(self, error):
        self._close()


def check_cancel(cancel: Any) -> None:
    """Raise :class:`~ckptlib.errors.Cancelled` if ``cancel`` (anything with ``is_set()``) is set."""
    if cancel is not None and cancel.is_set():
        raise Cancelled("cancelled by the user; nothing was written to the destination")


def progress_to(observer: Observer, total: int) -> Callable[[int], None]:
    """A thread-safe ``progress(nbytes)`` reporting the running total to ``observer``; the observer is
    called under the lock, so the totals it sees never go back."""
    done, lock = [0], threading.Lock()

    def progress(n: int) -> None:
        with lock:
            done[0] += n
            observer.on_bytes(done[0], total)

    return progress
