"""The ``ckpt`` command line as the tests run it: ``python -m ckptlib ARGS`` in a process of its own, and the
shape every refusal must have (exit code 2, no traceback, the words that say why, nothing written)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``python -m ckptlib ARGS`` run from the repository's root."""
    r = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    return r.returncode, r.stdout, r.stderr


def assert_refused(code: int, stdout: str, err: str, words, out: Path) -> None:
    """A refusal: exit code 2, no traceback, each of ``words`` in the message, ``out`` not written."""
    assert code == 2, stdout + err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not out.exists()
