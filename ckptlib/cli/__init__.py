"""The ``ckpt`` command line, a face on the public API (the launcher is :mod:`ckptlib.__main__`).

May import: every layer of ckptlib; nothing in the library imports it.
"""
from .main import build_parser, main

__all__ = ["main", "build_parser"]
