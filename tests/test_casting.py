"""ckptlib.io.casting (numpy only) against torch's own CPU casts, byte for byte.

Exhaustive for the 16-bit types (all 2^16 bit patterns of bfloat16 and float16, to float32, to the other
16-bit type, and back from float32); float32 inputs by hypothesis over bit patterns, a few million
seeded random patterns, and the edge cases by construction (halfway points, the largest finite values,
overflow thresholds, subnormals, NaNs with payloads, both signs). ``CKPTLIB_EXHAUSTIVE_CASTS=1`` also
compares all 2^32 float32 patterns (about a minute).
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlib.io import casting
from ckptlib.io.casting import (CASTS, Scratch, bf16_to_f16, bf16_to_f32, can_cast, cast, f16_to_bf16, f16_to_f32,
                             f32_to_bf16, f32_to_f16)

NP_BITS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}
TORCH_BITS = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16}
ALL16 = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


def torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """What torch writes for ``bits`` (raw patterns of ``src``) cast to ``dst``, as raw patterns."""
    t = torch.from_numpy(bits.view(np.int32 if src == "float32" else np.int16).copy()).view(getattr(torch, src))
    out = t.to(getattr(torch, dst))
    return out.view(TORCH_BITS[dst]).numpy().view(NP_BITS[dst])


def ours(bits: np.ndarray, src: str, dst: str, scratch=None) -> np.ndarray:
    out = np.full(len(bits), 0xA5A5A5A5 if dst == "float32" else 0xA5A5, dtype=NP_BITS[dst])
    assert cast(bits, src, out, dst, scratch) == len(bits)
    return out


def torch_vector_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """What torch's vector kernels write: the input padded to a multiple of 128 elements, so that no
    element falls in the element-by-element remainder of a thread's share."""
    padded = np.zeros(-(-len(bits) // 128) * 128, dtype=bits.dtype)
    padded[:len(bits)] = bits
    return torch_cast(padded, src, dst)[:len(bits)]


def check(bits, src: str, dst: str, scratch=None) -> None:
    bits = np.asarray(bits, dtype=NP_BITS[src])
    want, got = torch_cast(bits, src, dst), ours(bits, src, dst, scratch)
    if (src, dst) == ("float16", "float32"):  # torch's own NaNs depend on the position there (see below)
        nan = (bits & 0x7C00 == 0x7C00) & (bits & 0x3FF != 0)
        want[nan] = torch_vector_cast(bits, src, dst)[nan]
    if not np.array_equal(want, got):
        bad = np.flatnonzero(want != got)[:8]
        raise AssertionError(f"{src}->{dst}: " + ", ".join(f"{int(bits[i]):#x} -> torch {int(want[i]):#x}, "
                                                            f"ours {int(got[i]):#x}" for i in bad))


def f32_edge_cases() -> np.ndarray:
    """float32 patterns at every rounding boundary of bfloat16 and float16, both signs."""
    out = []
    # bfloat16: ties (low half 0x8000) with even and odd kept parts, and one below / above, across exponents
    for hi in list(range(0, 0x200)) + list(range(0x3F00, 0x3FC0)) + list(range(0x7E00, 0x7F81)):
        for lo in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            out.append(hi << 16 | lo)
    # float16: for each f16 exponent (subnormals included), the values next to the halfway points
    f16 = np.arange(0, 0x7C00, 7, dtype=np.uint16)
    lo = f16.view(np.float16).astype(np.float64)
    hi = (f16 + 1).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32).view(np.uint32)
    for d in (-2, -1, 0, 1, 2):
        out += list((mid.astype(np.int64) + d).astype(np.uint32))
    specials = [0x00000000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,  # zero, f32 subnormals
                0x33000000, 0x33000001, 0x337FFFFF, 0x33800000, 0x33C00000,            # 2^-25 (half the f16 minimum)
                0x387FC000, 0x387FE000, 0x38800000,                                    # the f16 subnormal/normal edge
                0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,            # 65504, 65520: f16 overflow
                0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000,                        # bf16 overflow, max, inf
                0x7F800001, 0x7F800FFF, 0x7F801000, 0x7FA00000, 0x7FBFFFFF,            # signalling NaNs
                0x7FC00000, 0x7FC00001, 0x7FD55555, 0x7FFFE000, 0x7FFFFFFF]            # quiet NaNs
    out += specials
    arr = np.array(out, dtype=np.uint32)
    return np.concatenate([arr, arr | np.uint32(0x80000000)])


# ============================================================================================ 16-bit inputs
@pytest.mark.parametrize("src", ["bfloat16", "float16"])
@pytest.mark.parametrize("dst", ["float32", "bfloat16", "float16"])
def test_every_16_bit_pattern_casts_as_torch_casts_it(src, dst):
    check(ALL16, src, dst)


@pytest.mark.parametrize("src", ["bfloat16", "float16"])
@pytest.mark.parametrize("via", ["float32"])
def test_every_16_bit_pattern_goes_to_float32_and_back_as_in_torch(src, via):
    wide = torch_cast(ALL16, src, via)
    assert np.array_equal(ours(ALL16, src, via), wide)
    check(wide, via, src)
    other = "float16" if src == "bfloat16" else "bfloat16"
    check(wide, via, other)


# ============================================================================================ float32 inputs
@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_float32_edge_cases_cast_as_torch_casts_them(dst):
    check(f32_edge_cases(), "float32", dst)


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_millions_of_random_float32_patterns_cast_as_in_torch(dst):
    rng = np.random.default_rng(20261201)
    bits = rng.integers(0, 2**32, size=1 << 22, dtype=np.uint64).astype(np.uint32)
    check(bits, "float32", dst)
    # values of the size weights have, where the f16 subnormal and overflow ranges are
    for scale in (1e-8, 1e-5, 1e-2, 1.0, 6e4):
        vals = (rng.standard_normal(1 << 18) * scale).astype(np.float32)
        check(vals.view(np.uint32), "float32", dst)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.sampled_from(["bfloat16", "float16"]))
def test_float32_bit_patterns_cast_as_torch_casts_them(patterns, dst):
    check(patterns, "float32", dst)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=300),
       st.sampled_from([("bfloat16", "float16"), ("float16", "bfloat16"), ("bfloat16", "float32"),
                        ("float16", "float32")]),
       st.integers(1, 40))
def test_16_bit_inputs_in_small_blocks_cast_as_in_torch(patterns, pair, block):
    check(patterns, *pair, scratch=Scratch(block))


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_nans_anywhere_in_any_length_cast_as_in_torch(dst):
    """torch's kernels do the bulk in vectors and the tail of each thread's share element by element; a
    NaN must come out the same at every position."""
    nans = np.array([0x7F800001, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00001, 0xFFFFFFFF],
                    dtype=np.uint32)
    for n in list(range(1, 70)) + [127, 128, 129, 32768, 32769, 100_003]:
        bits = np.zeros(n, np.uint32)
        positions = sorted({0, n - 1, n // 2, max(0, n - 17), min(n - 1, 16)})
        for k, p in enumerate(positions):
            bits[p] = nans[k % len(nans)]
        check(bits, "float32", dst)
    big = np.zeros(1 << 22, np.uint32)  # torch splits this between its threads
    big[::4099] = nans[np.arange(len(big[::4099])) % len(nans)]
    check(big, "float32", dst)


def test_float16_nans_to_float32_take_the_form_of_torchs_vector_kernels():
    """torch 2.13 is not consistent here: its vector kernels quiet a float16 NaN keeping sign and payload
    (``sign | 0x7FC00000 | payload << 13``), while the elements its kernel converts one by one (the last
    ``n % 8`` of each thread's share, so every element of a tensor shorter than 8) all become
    ``0x7FFFFFFF``. ckptlib.io.casting writes the first form at every position (as does every other pair,
    where torch is consistent)."""
    nans = ALL16[(ALL16 & 0x7C00 == 0x7C00) & (ALL16 & 0x3FF != 0)]
    u = nans.astype(np.uint32)
    form = (u & 0x8000) << 16 | 0x7FC00000 | (u & 0x3FF) << 13
    assert np.array_equal(torch_vector_cast(nans, "float16", "float32"), form)
    one_by_one = np.concatenate([torch_cast(nans[i:i + 1], "float16", "float32") for i in range(len(nans))])
    assert set(one_by_one.tolist()) == {0x7FFFFFFF}, "torch changed: make casting follow it"
    for n in (1, 7, 8, 9, 100):
        assert np.array_equal(ours(np.resize(nans, n), "float16", "float32"), np.resize(form, n))


@pytest.mark.skipif(os.environ.get("CKPTLIB_EXHAUSTIVE_CASTS") != "1", reason="set CKPTLIB_EXHAUSTIVE_CASTS=1")
@pytest.mark.slow
@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_all_float32_patterns_cast_as_in_torch(dst):
    step = 1 << 24
    sc = Scratch()
    for start in range(0, 2**32, step):
        check(np.arange(start, start + step, dtype=np.uint64).astype(np.uint32), "float32", dst, sc)


# ============================================================================================ the API
def test_cast_copies_same_dtypes_and_refuses_other_pairs():
    ints = np.array([2**24 + 1, -3, 2**62], dtype=np.int64)
    out = np.zeros(3, np.int64)
    assert cast(ints, "int64", out, "int64") == 3 and np.array_equal(out, ints)
    mask = np.array([True, False, True])
    got = np.zeros(3, np.bool_)
    assert cast(mask, "bool", got, torch.bool) == 3 and np.array_equal(got, mask)
    f = np.array([1.5, -0.0], dtype=np.float32)
    g = np.zeros(2, np.float32)
    assert cast(f, "fp32", g, "float32") == 2 and g.tobytes() == f.tobytes()
    assert can_cast("fp32", "bf16") and can_cast(torch.float16, "bfloat16") and can_cast("int64", "int64")
    assert not can_cast("int64", "float32") and not can_cast("float64", "float32")
    with pytest.raises(ValueError, match="no cast from int64 to float32"):
        cast(ints, "int64", np.zeros(3, np.float32), "float32")
    assert set(CASTS) == {(a, b) for a in ("float32", "bfloat16", "float16")
                          for b in ("float32", "bfloat16", "float16") if a != b}


def test_buffers_of_any_kind_and_output_checks():
    vals = np.array([1.0, 1.00390625, -2.5, 3e38], dtype=np.float32)
    want = torch_cast(vals.view(np.uint32), "float32", "bfloat16")
    for src in (vals.tobytes(), bytearray(vals.tobytes()), memoryview(vals.tobytes()), vals):
        out = bytearray(8)
        assert f32_to_bf16(src, out) == 4 and bytes(out) == want.tobytes()
    t = torch.empty(6, dtype=torch.bfloat16)  # a larger output: the first n elements are written
    assert f32_to_bf16(vals, t.view(torch.uint8).numpy()) == 4
    assert t[:4].view(torch.int16).numpy().view(np.uint16).tolist() == want.tolist()
    with pytest.raises(ValueError, match="holds 6 bytes"):
        f32_to_bf16(vals, bytearray(6))
    with pytest.raises(ValueError, match="read-only"):
        f32_to_bf16(vals, bytes(8))
    assert f32_to_f16(b"", bytearray()) == 0 and bf16_to_f32(b"", bytearray()) == 0
    assert f16_to_f32(np.float16([1.0]), bytearray(4)) == 1
    assert bf16_to_f16(b"\x80\x3f", bytearray(2)) == 1 and f16_to_bf16(b"\x00\x3c", bytearray(2)) == 1


def test_a_scratch_is_reused_and_its_size_is_stated():
    sc = Scratch(1000)
    assert sc.nbytes == 13 * 1000 and Scratch().nbytes == 13 * casting.BLOCK
    bits = np.random.default_rng(1).integers(0, 2**32, 12345, dtype=np.uint64).astype(np.uint32)
    for dst in ("bfloat16", "float16"):
        check(bits, "float32", dst, sc)


def test_the_module_does_not_import_torch():
    """Neither casting.py nor what it imports from ckptlib (the dtype table) imports torch at import time."""
    tree = ast.parse(Path(casting.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "torch"], names
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert relative == {"dtypes"}
    dtypes = ast.parse((Path(casting.__file__).parents[1] / "dtypes.py").read_text())
    top = [a.name for n in dtypes.body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module or "" for n in dtypes.body if isinstance(n, ast.ImportFrom)]
    assert not [n for n in top if n.split(".")[0] == "torch"], top


# ------------------------------------------------------------------ the casts of check, diff and verify
@pytest.mark.parametrize("src,dst", [("float64", "bfloat16"), ("float64", "float16"), ("bfloat16", "float64"),
                                     ("float16", "float64"), ("float32", "float64"), ("float64", "float32"),
                                     ("float32", "bfloat16"), ("bfloat16", "float32"), ("int32", "int64"),
                                     ("bool", "int64"), ("uint8", "float32"), ("int64", "float32")])
def test_cast_values_writes_what_torch_writes(src, dst):
    """ckptlib.analysis.compare.cast_values (numpy windows; what check, diff and verify cast with) against torch's
    ``.to()``, byte for byte, on values with edge cases, across more than one float32 block."""
    from ckptlib.analysis.compare import cast_values, np_type

    g = torch.Generator().manual_seed(3)
    n = casting.BLOCK + 4321
    if src in ("float64", "float32", "bfloat16", "float16"):
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 8, (n,), generator=g))
        x[:12] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65520.0, 1e-8, -1e-40,
                               3.0e38, 1.0 + 2 ** -9, 1.0 + 2 ** -8 + 2 ** -30], dtype=torch.float64)
        x = x.to(getattr(torch, src))
    elif src == "bool":
        x = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        x = torch.randint(-2 ** 31 if src != "uint8" else 0, 2 ** 31 if src != "uint8" else 256, (n,), generator=g,
                          dtype=torch.int64).to(getattr(torch, src))
    want = x.to(getattr(torch, dst))
    src_np = x.view(torch.int16).numpy().view(np_type(src)) if src == "bfloat16" else x.numpy()
    out = np.empty(n, np_type(dst))
    cast_values(src_np, src, out, dst)
    want_bits = want.view(torch.int16).numpy() if dst == "bfloat16" else want.numpy()
    assert out.tobytes() == want_bits.tobytes(), (src, dst)


@pytest.mark.parametrize("pair", [("float32", "bfloat16"), ("float32", "float16"), ("float16", "bfloat16"),
                                  ("bfloat16", "float32")])
@pytest.mark.parametrize("n", [1, 5, (1 << 17) + 1, 3 * (1 << 17) + 37])
@pytest.mark.parametrize("crc", [False, True], ids=["plain", "crc"])
def test_a_cast_in_pieces_on_two_threads_writes_what_torch_writes(tmp_path, pair, n, crc):
    """copy_ranges casts a chunk piece by piece (ckptlib.io.castcopy.cast_pieces): the writing thread and
    the cast helper take pieces in turn and write each at its place. The file holds torch's bytes whatever
    ``n``, across the pieces' seams and the ranges' own, and a CRC-keeping sink's CRC is the file's."""
    import zlib

    from ckptlib.io.castcopy import piece_elems
    from ckptlib.io.sinks import PwriteSink, WriteBehind
    from ckptlib.io.sources import SourceFiles
    from ckptlib.io.streaming import ChunkBuffers, copy_ranges
    from ckptlib.io.threads import CastHelper
    from ckptlib.layout.ranges import StoredRange

    src, dst = pair
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    if src != "float32":
        bits = bits.astype(np.uint16)
    size = bits.itemsize
    stored = tmp_path / "stored.bin"
    stored.write_bytes(b"xyz" + bits[: n // 3].tobytes() + b"gap" + bits[n // 3:].tobytes())
    ranges = [StoredRange(str(stored), 3, src, n // 3), StoredRange(str(stored), 6 + (n // 3) * size, src, n - n // 3)]
    ranges = [r for r in ranges if r.count]
    bufs = ChunkBuffers(1 << 20)  # pieces of 1/2 MiB of the wider dtype, chunks of 1 MiB: many of both
    helper = CastHelper.get()
    calls = []
    if helper is not None:
        submit = helper.pool.submit
        helper.pool.submit = lambda *a: calls.append(a[0]) or submit(*a)
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        os.pwrite(fd, b"head", 0)
        behind = WriteBehind(fd, window=4096, lag=2)  # windows handed over while the helper casts (catch_up)
        sink = PwriteSink(fd, 4, crc=crc, behind=behind)
        catch_up = sink.catch_up
        sink.catch_up = lambda: calls.append("catch_up") or catch_up()
        with SourceFiles() as files:
            written = copy_ranges(ranges, dst, sink, bufs, files, drop_cache=False)
        behind.close()
    finally:
        os.close(fd)
        bufs.close()
        if helper is not None:
            del helper.pool.submit
    want = torch_cast(bits, src, dst).view(np.uint8).tobytes()
    data = out.read_bytes()
    assert written == len(want) and data == b"head" + want
    if crc:
        assert sink.crc == zlib.crc32(want)
    pieces = -(-n // piece_elems(1 << 20, src, dst))
    if helper is not None and pieces > 1:
        assert calls.count("catch_up") == sum(c != "catch_up" for c in calls) > 0  # the helper took pieces, and
        # each time the writing thread caught up with the write-behind first
