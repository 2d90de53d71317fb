"""Exit codes of the ``ckpt`` command and what it prints when ckptlib itself fails.

=====  ===============================================================================================
0      success
1      a finding: ``check`` found problems, ``diff`` differences, ``--verify`` a mismatch, ``inspect``
       problems
2      an error with a message (bad input, a damaged or refused checkpoint, the output folder, memory):
       one line naming the file, and a hint
3      an internal error, i.e. a bug in ckptlib: one line asking for a report; the traceback is written to
       a file (named in that line), never to the terminal
=====  ===============================================================================================

:func:`internal_error` is the last guard of :func:`ckptlib.cli.main.main`: whatever escapes the
command's own handling ends here.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, Sequence

from ..errors import printable

SUCCESS, FINDING, ERROR, INTERNAL = 0, 1, 2, 3
REPORT_DIR_ENV = "CKPTLIB_CRASH_DIR"  # where the traceback files go (default: the temporary folder)


def crash_file(exc: BaseException, argv: Optional[Sequence[str]]) -> Optional[str]:
    """Write the traceback of ``exc`` with the versions and the command line to a new file; its path, or
    None if no file could be written."""
    import tempfile  # only when ckptlib failed: the command line starts without them
    import traceback

    from .. import __version__

    folder = os.environ.get(REPORT_DIR_ENV) or tempfile.gettempdir()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        fd, path = tempfile.mkstemp(prefix=f"ckpt-internal-error-{stamp}-", suffix=".txt", dir=folder)
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(f"ckptlib {__version__}, Python {sys.version.split()[0]}, {sys.platform}\n")
            f.write(f"command: ckpt {' '.join(map(str, argv if argv is not None else sys.argv[1:]))}\n\n")
            f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return path
    except OSError:
        return None


def internal_error(command: str, exc: BaseException, argv: Optional[Sequence[str]] = None) -> int:
    """Say in one line that ckptlib failed (not the checkpoint) and where the traceback is; exit code 3."""
    path = crash_file(exc, argv)
    what = printable(f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__, 160)
    where = f"the details are in {path}" if path else "no file could be written for the details"
    print(f"ckpt {command}: internal error ({what}): this is a bug in ckptlib, not a problem of your checkpoint; "
          f"please report it with the command you ran ({where})", file=sys.stderr)
    return INTERNAL


__all__ = ["SUCCESS", "FINDING", "ERROR", "INTERNAL", "REPORT_DIR_ENV", "crash_file", "internal_error"]
