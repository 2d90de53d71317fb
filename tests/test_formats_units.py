"""The safetensors layout, sizes and the dtype table (pure code; no DeepSpeed, no checkpoint)."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from ckptlib import dtypes
from ckptlib.io.stformat import SafetensorsLayout, TensorSpec, read_header
from ckptlib.units import human_bytes, parse_size


def test_safetensors_layout_is_what_the_safetensors_package_reads(tmp_path):
    ts = {"a": torch.randn(3, 5), "b.i": torch.arange(7, dtype=torch.int64), "c": torch.ones(2, dtype=torch.bfloat16),
          "m": torch.tensor([True, False]), "e": torch.empty(0, 4)}
    layout = SafetensorsLayout([TensorSpec(k, dtypes.name_of(v.dtype), tuple(v.shape)) for k, v in ts.items()],
                               {"format": "pt", "step": "3"})
    path = tmp_path / "x.safetensors"
    layout.create(path)
    with open(path, "r+b") as f:
        for k, v in ts.items():
            f.seek(layout.tensor_offset(k))
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    got = load_file(path)
    assert set(got) == set(ts) and all(torch.equal(got[k], v) for k, v in ts.items())
    assert layout.data_start % 8 == 0 and path.stat().st_size == layout.file_size
    meta, infos = read_header(path)
    assert meta == {"format": "pt", "step": "3"}
    assert sorted((t.name, t.dtype, t.shape, t.offset) for t in infos) == \
        sorted((k, dtypes.name_of(v.dtype), tuple(v.shape), layout.tensor_offset(k)) for k, v in ts.items())
    assert [t.name for t in infos] == ["b.i", "a", "e", "c", "m"]  # widest element first, else as given


def test_every_safetensors_offset_is_a_multiple_of_the_element_size():
    """A 3-byte bool buffer first, then odd-sized 16-bit and 8-byte tensors: laid out in the given order
    the float32 tensors after it would start at odd offsets (zero-copy readers refuse them)."""
    specs = [TensorSpec("mask", "bool", (3,)), TensorSpec("w", "float32", (5,)), TensorSpec("h", "bfloat16", (3,)),
             TensorSpec("n", "int64", (1,)), TensorSpec("f", "float16", (1,)), TensorSpec("d", "float64", (2,)),
             TensorSpec("b", "uint8", (1,)), TensorSpec("x", "float32", (1,))]
    layout = SafetensorsLayout(specs)
    assert layout.data_start % 8 == 0
    for t in specs:
        assert layout.tensor_offset(t.name) % dtypes.itemsize(t.dtype) == 0, t
    header = json.loads(layout.header[8:])
    assert [k for k in header if k != "__metadata__"] == ["n", "d", "w", "x", "h", "f", "mask", "b"]


def test_safetensors_refuses_what_it_cannot_hold_and_bad_headers(tmp_path):
    with pytest.raises(ValueError, match="cannot hold"):
        SafetensorsLayout([TensorSpec("z", "complex64", (2,))])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01")
    with pytest.raises(ValueError, match="too short"):
        read_header(bad)
    head = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(head)) + head + bytes(12))
    with pytest.raises(ValueError, match="do not match"):
        read_header(bad)
    bad.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ValueError, match="not JSON"):
        read_header(bad)


@pytest.mark.parametrize("text,value", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("1.5KB", 1500),
                                        (" 7 ", 7), ("3kib", 3072), (1234, 1234), ("10B", 10)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GB", "5 GBs", "-1GB", "1e3", True])
def test_parse_size_says_how_to_write_a_size(text):
    with pytest.raises(ValueError, match="write it like 5GB"):
        parse_size(text)


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 999, 1000, 1_234_567, 5 * 10**12, 10**16)] == \
        ["0 B", "999 B", "1.0 KB", "1.2 MB", "5.0 TB", "10000.0 TB"]


def test_the_dtype_table_agrees_with_torch():
    for d in dtypes.BY_NAME.values():
        if not hasattr(torch, d.name):
            continue
        t = getattr(torch, d.name)
        assert torch.empty((), dtype=t).element_size() == d.itemsize, d.name
        assert t.is_floating_point == d.floating, d.name
        assert dtypes.name_of(t) == d.name and dtypes.torch_dtype(d.name) is t
    assert dtypes.lookup("bf16").name == "bfloat16" and dtypes.OUTPUT_DTYPES == ("fp32", "bf16", "fp16")
    with pytest.raises(KeyError):
        dtypes.lookup("float13")
