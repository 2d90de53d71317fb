"""CRC-32 (the zip polynomial, as ``zlib.crc32``), as fast as this machine can compute it.

``zlib.crc32`` computes about 2 GB/s on the machines of ``bench/``; libdeflate's ``libdeflate_crc32`` (a system
library wherever libtiff is installed: Debian's ``libdeflate0``) computes the same function about three times
faster with carry-less multiplication. :func:`crc32` uses libdeflate when the library is there and gives
``zlib.crc32``'s value on a test vector (checked once, when first used), else ``zlib.crc32``; both release the GIL
while they run, so a reading thread's CRC goes on beside the writing thread. The result is the same number either way.
"""
from __future__ import annotations

import zlib
from typing import Optional

#: below this many bytes the call into the library costs more than it saves
_SMALL = 1 << 14
_fast = None  # the library's function once proven, False when it is not there or not the same function


def _load() -> Optional[object]:
    """libdeflate's ``libdeflate_crc32``, proven equal to ``zlib.crc32`` on a test vector, or None."""
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("deflate") or "libdeflate.so.0"
        f = ctypes.CDLL(name).libdeflate_crc32
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    sample = bytes(range(256)) * 97 + b"ckptlib"
    for start in (0, 0x12345678):
        if f(start, sample, len(sample)) != zlib.crc32(sample, start):
            return None
    return f


def crc32(data, value: int = 0) -> int:
    """The CRC-32 of ``data`` (bytes, a bytearray or a contiguous memoryview of bytes) continued from ``value``, as
    ``zlib.crc32(data, value)``. Memory: none beyond ``data``."""
    global _fast
    n = len(data) if not isinstance(data, memoryview) else data.nbytes
    if n < _SMALL:
        return zlib.crc32(data, value)
    if _fast is None:
        _fast = _load() or False
    if _fast is False:
        return zlib.crc32(data, value)
    if isinstance(data, bytes):
        return _fast(value, data, n)
    import numpy as np  # a pointer to the buffer, read-only ones too, without a copy

    return _fast(value, np.frombuffer(data, np.uint8).ctypes.data, n)


#: a view at least this long is taken on its own; shorter ones are gathered (:func:`crc32_of_views`)
_GATHER_BELOW = 1 << 16


def crc32_of_views(views, value: int = 0, stage: Optional[memoryview] = None) -> int:
    """The CRC-32 of the concatenation of ``views`` (contiguous memoryviews) continued from ``value``. Short views
    (the rows of a tensor-parallel slice read into every other row of a joined tensor: tens of thousands of a few
    KiB) are copied back to back into ``stage`` (a writable byte view that stays in the CPU's cache) and taken in
    one call: one call per view costs a switch of Python's lock each (measured: 0.9 GB/s in a pp 2 x tp 2 bf16
    export, with the writing thread beside). Memory: ``stage``, none without it (each view taken alone)."""
    if stage is None:
        for v in views:
            value = crc32(v, value)
        return value
    fill, room = 0, stage.nbytes
    for v in views:
        n = v.nbytes
        if n >= _GATHER_BELOW or n > room:
            if fill:
                value, fill = crc32(stage[:fill], value), 0
            value = crc32(v, value)
            continue
        if fill + n > room:
            value, fill = crc32(stage[:fill], value), 0
        stage[fill:fill + n] = v if v.format == "B" else v.cast("B")
        fill += n
    return crc32(stage[:fill], value) if fill else value


def backend() -> str:
    """``"libdeflate"`` or ``"zlib"``: which computes :func:`crc32` here."""
    global _fast
    if _fast is None:
        _fast = _load() or False
    return "zlib" if _fast is False else "libdeflate"


__all__ = ["crc32", "crc32_of_views", "backend"]
