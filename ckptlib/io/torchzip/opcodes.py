"""Protocol-2 pickle opcodes of the plain values and containers, shared by ckptlib's two pickle writers (the torch zip
files' :mod:`.writer` and DCP's ``.metadata`` in :mod:`ckptlib.io.dcp.metadata`)."""
from __future__ import annotations

import struct
from typing import Any, Callable


def emit_scalar(out: bytearray, obj: Any) -> bool:
    """Append ``obj``'s opcodes to ``out`` if it is None, a bool, an int, a float or a str, as ``pickle``
    writes them (``BININT`` or ``LONG1``, ``BINFLOAT``, ``BINUNICODE``); False (nothing written) otherwise.
    Subclasses of these count as the base type: a writer that pickles them otherwise checks them first."""
    if obj is None:
        out += b"N"
    elif obj is True:
        out += b"\x88"
    elif obj is False:
        out += b"\x89"
    elif isinstance(obj, int):
        if -2**31 <= obj < 2**31:
            out += b"J" + struct.pack("<i", obj)
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            out += b"\x8a" + bytes([len(raw)]) + raw
    elif isinstance(obj, float):
        out += b"G" + struct.pack(">d", obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw
    else:
        return False
    return True


def emit_container(out: bytearray, obj: Any, emit: Callable[[Any], None]) -> bool:
    """Append the opcodes of a tuple, a list or a dict (any dict as a plain one: a writer that keeps the class
    of an ``OrderedDict`` checks it first) to ``out``, each element through ``emit``, as ``pickle`` writes
    them (``EMPTY_TUPLE`` or ``MARK ... TUPLE``; ``EMPTY_LIST`` / ``EMPTY_DICT``, then ``MARK ... APPENDS`` /
    ``SETITEMS`` when not empty); False (nothing written) otherwise."""
    if isinstance(obj, tuple):
        if obj:
            _marked(out, obj, emit, b"t")
        else:
            out += b")"
    elif isinstance(obj, list):
        out += b"]"
        if obj:
            _marked(out, obj, emit, b"e")
    elif isinstance(obj, dict):
        out += b"}"
        emit_items(out, obj, emit)
    else:
        return False
    return True


def emit_items(out: bytearray, d: dict, emit: Callable[[Any], None]) -> None:
    """The ``MARK key value ... SETITEMS`` of a dict's items (nothing for an empty one)."""
    if d:
        _marked(out, (x for kv in d.items() for x in kv), emit, b"u")


def _marked(out: bytearray, items, emit: Callable[[Any], None], end: bytes) -> None:
    out += b"("
    for x in items:
        emit(x)
    out += end
