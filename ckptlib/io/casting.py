"""Casting tensor bytes between dtypes on raw buffers, bit for bit what torch's CPU ``.to(dtype)`` writes.

numpy only (torch is never imported here). Every function reads a buffer of ``n`` elements (anything
with the buffer protocol: ``bytes``, ``bytearray``, ``memoryview``, ``mmap``, a contiguous numpy array)
and writes them into the first ``n`` elements of a caller-given writable buffer that does not overlap
it; it returns ``n``. The work is done in blocks of :data:`BLOCK` elements through a :class:`Scratch`,
so it stays in the CPU cache and nothing is allocated per call beyond the scratch:

=================  ==============================================================  ===================
function           what                                                            memory
=================  ==============================================================  ===================
``f32_to_bf16``    round to nearest even; every NaN -> ``0xFFFF``                  scratch
``f32_to_f16``     round to nearest even, subnormals, overflow to inf; NaN quiet   scratch
``bf16_to_f32``    exact (the bits << 16; NaNs unchanged, signalling ones too)     none
``f16_to_f32``     exact; NaN quiet, sign and payload kept                         scratch
``bf16_to_f16``    exactly to float32, then as ``f32_to_f16`` (torch does so too)  scratch
``f16_to_bf16``    exactly to float32, then rounded; every NaN -> ``0x7FC0``       scratch
``copy``           the same dtype (integers and bool too): the bytes as they are   none
=================  ==============================================================  ===================

A :class:`Scratch` is ``13 * block`` bytes (1.6 MiB at the default block; a cast to bfloat16 from float32
touches a third of it). Pass one to reuse it (one per
thread: a scratch is not shared between threads); without one, each call makes its own and drops it on
return (it is then no larger than the input needs). numpy releases the GIL in these loops, so a caller
may cast the halves of a buffer in two threads, each with its scratch.

NaNs come out as torch 2.13 writes them on x86-64 (measured on every NaN pattern; see
``tests/test_casting.py``): float32 -> bfloat16 writes ``0xFFFF`` whatever the sign and payload,
float16 -> bfloat16 ``0x7FC0``; float32 -> float16 keeps the sign and the upper 9 payload bits and sets
the quiet bit (``sign | 0x7E00 | mantissa >> 13``); float16 -> float32 gives
``sign | 0x7FC00000 | payload << 13``. For that last pair torch itself is not consistent: the elements
its kernel converts one at a time (the last ``n % 8`` of each thread's share, so every element of a
tensor of fewer than 8) become ``0x7FFFFFFF`` instead; this module writes the vector kernels' form
everywhere. Everything else (``-0.0``, infinities, subnormals, halfway cases, overflow) is IEEE 754
round to nearest even, as in torch: the tests compare all 2^16 bit patterns of each 16-bit type and
(``CKPTLIB_EXHAUSTIVE_CASTS=1``) all 2^32 float32 patterns with torch, byte for byte.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..dtypes import itemsize, name_of

#: elements per inner step: 512 KiB of fp32. Each step is a few whole-block numpy calls, and on the machine
#: measured a call costs microseconds whatever its length: 2^16 cast at 0.56 G elements/s, 2^17 at 0.70;
#: a step's input, temporary and output still stay in the caches (bench/casting_bench.py)
BLOCK = 1 << 17

_F32_SIGN_MASK = np.uint32(0x7FFFFFFF)
_F32_INF = np.uint32(0x7F800000)
_BF16_NAN = np.uint16(0xFFFF)  # what torch writes for every float32 NaN, whatever its sign
_BF16_NAN_FROM_F16 = np.uint16(0x7FC0)  # ... and for every float16 NaN
_TO_INF, _TO_ZERO = np.float32(2.0 ** 112), np.float32(2.0 ** -110)
_F16_SCALE, _HALF = np.float32(2.0 ** -112), np.float32(0.5)


class Scratch:
    """Work space of the casts: three uint32 blocks (seen as float32 too) and a mask.
    Memory: ``13 * block`` bytes, allocated once here."""

    def __init__(self, block: int = BLOCK):
        self.block = int(block)
        self.a, self.b, self.c = (np.empty(self.block, np.uint32) for _ in range(3))
        self.mask = np.empty(self.block, np.bool_)

    @property
    def nbytes(self) -> int:
        return 3 * self.a.nbytes + self.mask.nbytes


def _src(buf: Any, dtype) -> np.ndarray:
    return np.frombuffer(memoryview(buf).cast("B"), dtype=dtype)


def _out(buf: Any, dtype, n: int) -> np.ndarray:
    view = memoryview(buf).cast("B")
    if view.readonly:
        raise ValueError("the output buffer is read-only")
    need = n * np.dtype(dtype).itemsize
    if view.nbytes < need:
        raise ValueError(f"the output buffer holds {view.nbytes} bytes; {n} elements need {need}")
    return np.frombuffer(view, dtype=dtype, count=n)


def _blocks(n: int, scratch: Scratch):
    for a in range(0, n, scratch.block):
        yield a, min(a + scratch.block, n)


# ------------------------------------------------------------------------------------------ kernels
# Each works on one block in place of a fused SIMD loop: a few whole-block numpy operations, on data that
# stays in the cache. The float16 ones are the branch-free bit recipes of the FP16 library (Maratyszcza),
# which torch's own scalar code uses too; NaNs are then written as torch's vector kernels write them.
def _round_bf16(u: np.ndarray, o: np.ndarray, sc: Scratch, nan=_BF16_NAN) -> None:
    """float32 bits ``u`` -> bfloat16 bits ``o``: round to nearest even on the upper half; NaNs -> ``nan``."""
    t = sc.a[:len(u)]
    np.right_shift(u, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)  # rounding bias: 0x7FFF, +1 when the kept part is odd (ties to even)
    np.add(t, u, out=t)
    t >>= 16
    np.copyto(o, t, casting="unsafe")
    if np.isnan(u.view(np.float32).max()):  # max propagates NaN: one read and no writes when there is none
        m = sc.mask[:len(u)]
        np.bitwise_and(u, _F32_SIGN_MASK, out=t)
        np.greater(t, _F32_INF, out=m)
        o[m] = nan


def _round_f16(u: np.ndarray, o: np.ndarray, sc: Scratch) -> None:
    """float32 bits ``u`` -> float16 bits ``o``: IEEE round to nearest even (subnormals, overflow to inf);
    a NaN keeps its sign and upper payload and becomes quiet (``sign | 0x7E00 | mantissa >> 13``)."""
    n = len(u)
    t, b = sc.a[:n], sc.b[:n]
    base = b.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.bitwise_and(u, _F32_SIGN_MASK, out=b)  # |x|
        base *= _TO_INF  # values that overflow float16 become inf here
        base *= _TO_ZERO
        np.bitwise_and(u, 0x7F800000, out=t)  # the exponent, at least float16's smallest normal one,
        np.maximum(t, 0x38800000, out=t)
        t += 0x07800000  # ... moved up so that adding it rounds |x| at float16's precision
        np.add(t.view(np.float32), base, out=base)
    np.right_shift(b, 13, out=t)
    t &= 0x7C00
    b &= 0x0FFF
    t += b  # exponent and mantissa of the result
    np.right_shift(u, 16, out=b)
    b &= 0x8000
    t |= b
    np.copyto(o, t, casting="unsafe")
    if np.isnan(u.view(np.float32).max()):
        m = sc.mask[:n]
        np.bitwise_and(u, _F32_SIGN_MASK, out=t)
        np.greater(t, _F32_INF, out=m)
        nan = u[m]
        o[m] = ((nan >> 16) & 0x8000 | 0x7E00 | (nan >> 13) & 0x3FF).astype(np.uint16)


def _widen_f16(h: np.ndarray, o: np.ndarray, sc: Scratch) -> None:
    """float16 bits ``h`` -> float32 bits ``o``, exact; a NaN keeps sign and payload and becomes quiet."""
    n = len(h)
    w, d = sc.a[:n], sc.b[:n]
    np.left_shift(h, 17, out=w, dtype=np.uint32)  # exponent and mantissa at the top, sign shifted out
    np.right_shift(w, 4, out=o)
    o += 0x70000000
    with np.errstate(invalid="ignore"):  # normal, inf and NaN (the multiply quiets NaNs, as torch's kernels)
        o.view(np.float32)[...] *= _F16_SCALE
    if w.min() < 0x08000000:  # zeros and subnormals: (0.5 + m * 2^-24) - 0.5
        m = sc.mask[:n]
        np.right_shift(w, 17, out=d)
        d |= 0x3F000000
        d.view(np.float32)[...] -= _HALF
        np.less(w, 0x08000000, out=m)
        np.copyto(o, d, where=m)
    np.bitwise_and(h, 0x8000, out=w, dtype=np.uint32)
    w <<= 16
    o |= w


# ------------------------------------------------------------------------------------------ the casts
def _blockwise(src: Any, src_type, out: Any, out_type, scratch: Scratch | None, kernel) -> int:
    """Run ``kernel(src_block, out_block, scratch)`` over the buffers block by block; returns ``n``."""
    s = _src(src, src_type)
    o = _out(out, out_type, len(s))
    sc = scratch or Scratch(min(BLOCK, len(s) or 1))
    for a, b in _blocks(len(s), sc):
        kernel(s[a:b], o[a:b], sc)
    return len(s)


def _bf16_to_f16_block(s, o, sc: Scratch) -> None:
    wide = sc.c[:len(s)]
    np.left_shift(s, 16, out=wide, dtype=np.uint32)
    _round_f16(wide, o, sc)


def _f16_to_bf16_block(s, o, sc: Scratch) -> None:
    wide = sc.c[:len(s)]
    _widen_f16(s, wide, sc)
    _round_bf16(wide, o, sc, _BF16_NAN_FROM_F16)


def f32_to_bf16(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """float32 -> bfloat16: round to nearest even; every NaN -> ``0xFFFF``. Memory: the scratch."""
    return _blockwise(src, np.uint32, out, np.uint16, scratch, _round_bf16)


def f32_to_f16(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """float32 -> float16: round to nearest even, subnormals, overflow to inf; NaNs quiet, sign and upper
    payload kept. Memory: the scratch."""
    return _blockwise(src, np.uint32, out, np.uint16, scratch, _round_f16)


def bf16_to_f32(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """bfloat16 -> float32, exact: the 16 bits become the upper half (NaNs unchanged). Memory: none."""
    s = _src(src, np.uint16)
    o = _out(out, np.uint32, len(s))
    np.left_shift(s, 16, out=o, dtype=np.uint32)
    return len(s)


def f16_to_f32(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """float16 -> float32, exact; NaNs quiet, sign and payload kept. Memory: the scratch."""
    return _blockwise(src, np.uint16, out, np.uint32, scratch, _widen_f16)


def bf16_to_f16(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """bfloat16 -> float16 through float32 (exact), as torch does. Memory: the scratch."""
    return _blockwise(src, np.uint16, out, np.uint16, scratch, _bf16_to_f16_block)


def f16_to_bf16(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """float16 -> bfloat16 through float32 (exact), as torch does; every NaN -> ``0x7FC0``. Memory: the
    scratch."""
    return _blockwise(src, np.uint16, out, np.uint16, scratch, _f16_to_bf16_block)


def copy(src: Any, out: Any, scratch: Scratch | None = None) -> int:
    """Same dtype (integers, bool, floats): the bytes as they are; returns the bytes copied. Memory: none."""
    s = _src(src, np.uint8)
    np.copyto(_out(out, np.uint8, len(s)), s)
    return len(s)


CASTS: dict[tuple[str, str], Callable[..., int]] = {
    ("float32", "bfloat16"): f32_to_bf16, ("float32", "float16"): f32_to_f16,
    ("bfloat16", "float32"): bf16_to_f32, ("float16", "float32"): f16_to_f32,
    ("bfloat16", "float16"): bf16_to_f16, ("float16", "bfloat16"): f16_to_bf16,
}


def can_cast(src_dtype: Any, dst_dtype: Any) -> bool:
    """Whether :func:`cast` converts ``src_dtype`` to ``dst_dtype`` (names, short names or torch dtypes)."""
    a, b = name_of(src_dtype), name_of(dst_dtype)
    return a == b or (a, b) in CASTS


def cast(src: Any, src_dtype: Any, out: Any, dst_dtype: Any, scratch: Scratch | None = None) -> int:
    """Write the elements of ``src`` (of ``src_dtype``) into ``out`` as ``dst_dtype``; returns the count.

    Same dtype is a copy (any dtype, integers and bool included); the float pairs are those of
    :data:`CASTS`; anything else is a ``ValueError``. Memory: as the function chosen (see the module).
    """
    a, b = name_of(src_dtype), name_of(dst_dtype)
    if a == b:
        return copy(src, out) // itemsize(a)
    fn = CASTS.get((a, b))
    if fn is None:
        raise ValueError(f"no cast from {a} to {b} (only between float32, bfloat16 and float16, or to the same dtype)")
    return fn(src, out, scratch)


__all__ = ["BLOCK", "Scratch", "f32_to_bf16", "f32_to_f16", "bf16_to_f32", "f16_to_f32", "bf16_to_f16",
           "f16_to_bf16", "copy", "CASTS", "can_cast", "cast"]
