"""The globals a torch file's pickle names, found without unpickling it (``ckpt inspect --globals``).

:func:`pickle_globals` reads a file's zip directory and its ``data.pkl`` (as :class:`~.reader.TorchFile`
does) and walks the pickle's opcodes with :func:`pickletools.genops`, which only decodes them: nothing is
called, built or imported. ``GLOBAL`` names its global in its argument; ``STACK_GLOBAL`` takes the two
strings pushed (or fetched from the memo) just before it, which a short simulation of those pushes
recovers. Each global is then looked up in the restricted unpickler's allow-list
(:func:`~.unpickler.allowed_global`), so a refused checkpoint can be sorted out: what it asks for, where.

Memory: the pickle (a few KB to MB) and its directory.
"""
from __future__ import annotations

import os
import pickletools
from collections import Counter
from dataclasses import dataclass

from ...errors import IncompleteCheckpointError
from . import zipfmt
from .legacy import MAGIC as LEGACY_MAGIC
from .legacy import legacy_pickle
from .unpickler import allowed_global

_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}


@dataclass(frozen=True)
class PickleGlobal:
    """A global named by a pickle: ``module``, ``name``, how many times, and whether ckptlib loads it."""

    module: str
    name: str
    count: int
    allowed: bool

    def to_dict(self) -> dict:
        return {"global": f"{self.module}.{self.name}", "count": self.count, "allowed": self.allowed}


def globals_in(data: bytes) -> list[PickleGlobal]:
    """The globals the pickle ``data`` names, in the order first named (opcodes decoded, nothing run)."""
    found: Counter = Counter()
    recent: list = []  # the values of the last pushes, as far as strings and memo fetches go
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
                found[(module, attr)] += 1
                recent.append(None)
            elif name == "STACK_GLOBAL":
                module, attr = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
                key = (module, attr) if isinstance(module, str) and isinstance(attr, str) else \
                    ("<unknown>", "<a STACK_GLOBAL whose names are computed>")
                found[key] += 1
                recent[-2:] = [None]
            elif name in _STRINGS:
                recent.append(arg if isinstance(arg, str) else arg.decode("latin-1") if isinstance(arg, bytes) else None)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in _PUTS:
                memo[arg] = recent[-1] if recent else None
            elif name in _GETS:
                recent.append(memo.get(arg))
            elif name not in ("PROTO", "FRAME"):
                recent.append(None)
            del recent[:-8]
    except Exception as e:  # noqa: BLE001 - a malformed pickle: say where the decoding stopped
        found[("<malformed>", f"the pickle does not decode ({type(e).__name__}: {e})")] += 1
    return [PickleGlobal(m, n, c, allowed_global(m, n)) for (m, n), c in found.items()]


def read_pickle(path: str | os.PathLike) -> bytes:
    """The ``data.pkl`` of a torch zip file (the main pickle of a legacy one), read without unpickling it.

    Raises:
        IncompleteCheckpointError: not a readable torch zip file (naming it).
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC:
            return legacy_pickle(path)
        n = min(size, zipfmt.END_SEARCH_MAX)
        f.seek(size - n)
        tail = f.read(n)
        try:
            d = zipfmt.find_directory(tail, size - n)
            if d is None:
                raise zipfmt.ZipFormatError("no end of central directory record")
            f.seek(d.offset + d.shift)
            members = zipfmt.parse_directory(f.read(d.size), d)
            pkl = [m for m in members if m.endswith("/data.pkl") or m == "data.pkl"]
            if len(pkl) != 1:
                raise zipfmt.ZipFormatError("no single data.pkl")
            header = members[pkl[0]][0]
            f.seek(header)
            out: dict = {}
            zipfmt.data_offsets(f.read(zipfmt.LOCAL_HEADER_SIZE + len(pkl[0].encode())), header, [(header, pkl[0])], out,
                                members)
            f.seek(out[pkl[0]] + 0)
            return f.read(members[pkl[0]][2])
        except zipfmt.ZipFormatError as e:
            raise IncompleteCheckpointError(f"not a readable torch zip file ({e})", path=path) from None


def pickle_globals(path: str | os.PathLike) -> list[PickleGlobal]:
    """The globals the pickle of torch file ``path`` names, and whether ckptlib loads each (nothing is run)."""
    return globals_in(read_pickle(path))


__all__ = ["PickleGlobal", "globals_in", "read_pickle", "pickle_globals"]
