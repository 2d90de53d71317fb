"""Write a synthetic DeepSpeed 0.19.8 checkpoint of a Llama-2-70B-shaped model at N data-parallel ranks, sparse
or with real tensor bytes.

Every file is a real torch zip archive with a real protocol-2 pickle holding the key tree DeepSpeed
0.19.8 writes (checked against the real fixtures of ``tests/fixtures/generate.py``). By default no tensor
byte is ever written: the data regions of the zip members are holes (the files are truncated to their
final size), so a 1 TB checkpoint takes a few MB of disk. Readers that only look at metadata
(``ckpt inspect``, ``ckpt export --plan``, ``ckpt reshard --plan``) see exactly what they would see
on the real checkpoint; a reader of values would see zeros.

With ``--fill random`` every tensor byte is written (a checkpoint to convert, time and check at scale,
``bench/scale_bench.py``): each parameter has three deterministic pseudo-random value streams (fp32 master,
``exp_avg``, ``exp_avg_sq``: :func:`param_bits`, finite normal numbers, the second moment non-negative),
and every storage holds its rank's part of them where DeepSpeed puts it: ZeRO-3 partitions of
``ceil(numel / N)`` elements padded with zeros, ZeRO-2 flat-group slices with zero padding, ZeRO-2's bf16
module weights the round-to-nearest-even of the masters; the Adam ``step`` is the global step. Streamed in
8 MiB pieces (memory: one piece and the pickle), each member's CRC-32 computed on the way; every file is
fsynced. ``tests/test_synthetic_fill.py`` proves the format with DeepSpeed's own readers (``zero_to_fp32``,
an engine's ``load_checkpoint``).

    python bench/make_synthetic_checkpoint.py --out .bench-work/synthetic/z3_r512 --stage 3 --ranks 512
    python bench/make_synthetic_checkpoint.py --out DIR --stage 2 --ranks 64 --layers 40   # about half
    python bench/make_synthetic_checkpoint.py --out DIR --ranks 8 --layers 11 --hidden 4096 --intermediate 11008 \
        --vocab 35000 --heads 32 --kv-heads 32 --fill random          # 30.2 GB on disk, about a minute

What is written (bf16 training with a torch AdamW and two parameter groups, as HF Trainer builds them:
the 2-D weights with weight decay, the RMSNorm weights without):

* ``DIR/latest`` (the tag, no newline); ``DIR/zero_to_fp32.py`` and ``zero_to_torch.py`` when the
  installed DeepSpeed has them (DeepSpeed copies them there);
* ZeRO-2: ``DIR/<tag>/mp_rank_00_model_states.pt`` whose ``module`` holds the bf16 weights as views of
  one flat storage per group (padded to a multiple of ``2N``, as DeepSpeed's bit16 groups), and
  ``bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank with ``single_partition_of_fp32_groups``
  (lean views of padded storages), the padded ``exp_avg``/``exp_avg_sq``, ``group_paddings``,
  ``param_alignment_paddings``, ``partition_count``, ``param_slice_mappings`` (``fragment_address``);
* ZeRO-3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank (every parameter an empty bf16 tensor,
  ``param_shapes`` one OrderedDict per sub-group) and ``bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt``
  with ``fp32_flat_groups`` (with their ``ds_id``) and the torch optimizer state per sub-group; sub-groups
  are cut as DeepSpeed cuts them (``sub_group_size`` 1e9).

Sparse, the CRC-32 of each zip member is the true CRC-32 of its (all-zero) data, computed from the CRC of one
zero byte with :func:`ckptlib.io.torchzip.zipfmt.crc32_combine` by doubling, so ``zipfile.testzip`` and
``torch.load`` accept the files too (ckptlib's reader does not check member CRCs). The pickles come from
the small emitter below (no torch, no DeepSpeed import): it writes the opcodes ``torch.save`` writes,
memo included, naming torch's rebuild functions and DeepSpeed's classes as globals.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import shutil
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckptlib.io.torchzip.zipfmt import central_directory, crc32_combine, layout_records, local_header  # noqa: E402

DS_VERSION = "0.19.8"
SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default zero_optimization.sub_group_size
STORAGE_CLASS = {"float32": "FloatStorage", "bfloat16": "BFloat16Storage", "float16": "HalfStorage",
                 "int64": "LongStorage"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}


# ============================================================================================ the model
def llama_params(layers: int = 80, hidden: int = 8192, intermediate: int = 28672, vocab: int = 32000,
                 heads: int = 64, kv_heads: int = 8) -> list[tuple[str, tuple, int]]:
    """``(name, shape, group)`` of ``LlamaForCausalLM`` in ``named_parameters`` order (defaults: Llama-2-70B,
    68,976,648,192 parameters); group 0 = weight decay (2-D weights), 1 = no decay (RMSNorm weights)."""
    kv = hidden // heads * kv_heads
    out = [("model.embed_tokens.weight", (vocab, hidden), 0)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden), 0), (p + "self_attn.k_proj.weight", (kv, hidden), 0),
                (p + "self_attn.v_proj.weight", (kv, hidden), 0), (p + "self_attn.o_proj.weight", (hidden, hidden), 0),
                (p + "mlp.gate_proj.weight", (intermediate, hidden), 0), (p + "mlp.up_proj.weight", (intermediate, hidden), 0),
                (p + "mlp.down_proj.weight", (hidden, intermediate), 0),
                (p + "input_layernorm.weight", (hidden,), 1), (p + "post_attention_layernorm.weight", (hidden,), 1)]
    out += [("model.norm.weight", (hidden,), 1), ("lm_head.weight", (vocab, hidden), 0)]
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ============================================================================================ pickles
@dataclass(eq=False)
class Storage:
    dtype: str
    numel: int
    #: what the storage holds with ``--fill random``: ``(source, start, count)`` runs of elements in order
    #: (see :func:`storage_pieces`); None: all zeros
    fill: Optional[list] = None

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


@dataclass(eq=False)
class Tensor:
    storage: Storage
    offset: int
    shape: tuple
    requires_grad: bool = False
    py_state: Optional[dict] = None


@dataclass(frozen=True)
class Size:
    """``torch.Size``."""
    dims: tuple


@dataclass(eq=False)
class Obj:
    """An instance of class ``qualname`` pickled with ``NEWOBJ`` + ``BUILD`` (LossScaler, fragment_address)."""
    qualname: str
    state: dict


@dataclass(frozen=True)
class Enum:
    """An enum member pickled as ``cls(value)`` (ZeroStageEnum)."""
    qualname: str
    value: int


def tensor(dtype: str, numel: int, shape: Optional[tuple] = None, fill: Optional[list] = None, **kw) -> Tensor:
    """A new contiguous tensor with a storage of its own."""
    return Tensor(Storage(dtype, numel, fill), 0, (numel,) if shape is None else shape, **kw)


class Pickler:
    """Protocol-2 pickles the way ``torch.save`` writes them (memo included); storages get the keys
    ``"0"``, ``"1"``, ... in the order they are first met, and are listed in ``storages``."""

    def __init__(self):
        self.out = bytearray(b"\x80\x02")
        self.memo: dict = {}
        self.keys: dict[int, str] = {}
        self.storages: list[Storage] = []

    def put(self, key=None) -> None:
        i = len(self.memo)
        self.memo[key if key is not None else ("anon", i)] = i
        self.out += b"q" + bytes([i]) if i < 256 else b"r" + struct.pack("<I", i)

    def get(self, key) -> bool:
        i = self.memo.get(key)
        if i is None:
            return False
        self.out += b"h" + bytes([i]) if i < 256 else b"j" + struct.pack("<I", i)
        return True

    def glob(self, module: str, name: str) -> None:
        if not self.get(("global", module, name)):
            self.out += f"c{module}\n{name}\n".encode()
            self.put(("global", module, name))

    def emit(self, o: Any) -> None:  # noqa: C901
        out = self.out
        if o is None:
            out += b"N"
        elif o is True or o is False:
            out += b"\x88" if o else b"\x89"
        elif isinstance(o, int):
            if 0 <= o < 256:
                out += b"K" + bytes([o])
            elif 0 <= o < 65536:
                out += b"M" + struct.pack("<H", o)
            elif -2**31 <= o < 2**31:
                out += b"J" + struct.pack("<i", o)
            else:
                raw = o.to_bytes((o.bit_length() + 8) // 8, "little", signed=True)
                out += b"\x8a" + bytes([len(raw)]) + raw
        elif isinstance(o, float):
            out += b"G" + struct.pack(">d", o)
        elif isinstance(o, str):
            if not self.get(("str", o)):
                raw = o.encode()
                out += b"X" + struct.pack("<I", len(raw)) + raw
                self.put(("str", o))
        elif isinstance(o, tuple):
            if not o:
                out += b")"
                return
            if len(o) > 3:
                out += b"("
            for x in o:
                self.emit(x)
            self.out += b"t" if len(o) > 3 else b"\x85\x86\x87"[len(o) - 1:len(o)]
            self.put()
        elif isinstance(o, list):
            self.out += b"]"
            self.put()
            self._batch(o, b"e", b"a")
        elif isinstance(o, collections.OrderedDict):
            self.glob("collections", "OrderedDict")
            self.out += b")R"
            self.put()
            self._items(o)
        elif isinstance(o, dict):
            self.out += b"}"
            self.put()
            self._items(o)
        elif isinstance(o, Size):
            self.glob("torch", "Size")
            self.emit((o.dims,))
            self.out += b"R"
            self.put()
        elif isinstance(o, Enum):
            module, name = o.qualname.rsplit(".", 1)
            self.glob(module, name)
            self.emit((o.value,))
            self.out += b"R"
            self.put()
        elif isinstance(o, Obj):
            module, name = o.qualname.rsplit(".", 1)
            self.glob(module, name)
            self.out += b")\x81"
            self.put()
            self.emit(o.state)
            self.out += b"b"
        elif isinstance(o, Tensor):
            self._tensor(o)
        else:
            raise TypeError(type(o).__name__)

    def _batch(self, items: list, many: bytes, one: bytes) -> None:
        for i in range(0, len(items), 1000):
            chunk = items[i:i + 1000]
            if len(chunk) == 1:
                self.emit(chunk[0])
                self.out += one
            else:
                self.out += b"("
                for x in chunk:
                    self.emit(x)
                self.out += many

    def _items(self, d: dict) -> None:
        items = list(d.items())
        for i in range(0, len(items), 1000):
            chunk = items[i:i + 1000]
            if len(chunk) > 1:
                self.out += b"("
            for k, v in chunk:
                self.emit(k)
                self.emit(v)
            self.out += b"u" if len(chunk) > 1 else b"s"

    def _tensor(self, t: Tensor) -> None:
        if t.py_state:
            self.glob("torch._tensor", "_rebuild_from_type_v2")
            self.out += b"("
            self.glob("torch._utils", "_rebuild_tensor_v2")
            self.glob("torch", "Tensor")
        else:
            self.glob("torch._utils", "_rebuild_tensor_v2")
        s = t.storage
        if id(s) not in self.keys:
            self.keys[id(s)] = str(len(self.storages))
            self.storages.append(s)
        stride, acc = [], 1
        for d in reversed(t.shape):
            stride.append(acc)
            acc *= d
        self.out += b"(("
        self.emit("storage")
        self.glob("torch", STORAGE_CLASS[s.dtype])
        self.emit(self.keys[id(s)])
        self.emit("cpu")
        self.emit(s.numel)
        self.out += b"t"
        self.put()
        self.out += b"Q"
        self.emit(t.offset)
        self.emit(tuple(t.shape))
        self.emit(tuple(reversed(stride)))
        self.emit(bool(t.requires_grad))
        self.glob("collections", "OrderedDict")
        self.out += b")R"
        self.put()
        self.out += b"t"
        self.put()
        if t.py_state:
            self.emit(dict(t.py_state))
            self.out += b"t"
            self.put()
        self.out += b"R"
        self.put()

    def finish(self) -> bytes:
        return bytes(self.out + b".")


# ============================================================================================ values
#: The kinds of per-element values of a parameter (``("param", index, kind)`` sources)
MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2
#: elements per pseudo-random block: element ``i`` of a stream is element ``i % FILL_BLOCK`` of block
#: ``i // FILL_BLOCK``, each block a PCG64 stream of its own, so any run of a stream is made without the rest
FILL_BLOCK = 1 << 18
PIECE = 1 << 21  # elements per piece written (8 MiB of fp32): what bounds the writer's memory


def param_bits(seed: int, index: int, kind: int, start: int, count: int):
    """fp32 bit patterns (uint32) of elements ``[start, start + count)`` of parameter ``index``'s value
    stream ``kind`` (:data:`MASTER`, :data:`EXP_AVG`, :data:`EXP_AVG_SQ`): pseudo-random, deterministic, the
    same whichever run is asked for. Every value is a finite normal fp32 number of magnitude in
    ``[2**-31, 2)``: the exponent's top bit cleared, its next two set; :data:`EXP_AVG_SQ` also non-negative."""
    import numpy as np

    out = np.empty(count, np.uint32)
    pos, end = start, start + count
    while pos < end:
        j, lo = divmod(pos, FILL_BLOCK)
        hi = min(FILL_BLOCK, end - j * FILL_BLOCK)
        gen = np.random.PCG64(np.random.SeedSequence([seed, index, kind, j]))
        raw = gen.random_raw((hi + 1) // 2).view(np.uint32)  # a prefix of the block: the same values
        out[pos - start:pos - start + hi - lo] = raw[lo:hi]
        pos += hi - lo
    out &= np.uint32(0x3FFFFFFF if kind == EXP_AVG_SQ else 0xBFFFFFFF)
    out |= np.uint32(0x30000000)
    return out


def to_bf16_bits(bits):
    """bf16 bit patterns (uint16) of finite fp32 bit patterns, rounded to nearest even (as ``Tensor.to``)."""
    import numpy as np

    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def storage_pieces(st: Storage, seed: int, piece: int = PIECE):
    """The bytes of storage ``st`` filled from its :attr:`Storage.fill` runs, in pieces of at most ``piece``
    elements (one buffer, reused: consume each piece before asking for the next). A run's source is
    ``("param", index, kind)`` (that stream's elements ``start...``; a bf16 storage holds the bf16 rounding of
    the fp32 values), ``("const", value)`` (``count`` copies of a number) or None (zeros)."""
    import numpy as np

    if st.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"cannot fill a {st.dtype} storage")
    bf16 = st.dtype == "bfloat16"
    runs = st.fill if st.fill is not None else [(None, 0, st.numel)]
    if sum(c for _, _, c in runs) != st.numel:
        raise ValueError(f"fill runs of {sum(c for _, _, c in runs)} elements for a storage of {st.numel}")
    buf = np.empty(min(piece, max(st.numel, 1)), np.uint16 if bf16 else np.uint32)
    pos = 0
    for src, start, count in runs:
        done = 0
        while done < count:
            k = min(count - done, len(buf) - pos)
            dst = buf[pos:pos + k]
            if src is None:
                dst[:] = 0
            elif src[0] == "const":
                bits = np.array([src[1]], np.float32).view(np.uint32)
                dst[:] = to_bf16_bits(bits)[0] if bf16 else bits[0]
            else:
                bits = param_bits(seed, src[1], src[2], start + done, k)
                dst[:] = to_bf16_bits(bits) if bf16 else bits
            pos += k
            done += k
            if pos == len(buf):
                yield memoryview(buf).cast("B")
                pos = 0
    if pos:
        yield memoryview(buf[:pos]).cast("B")


# ============================================================================================ zip files
_ZERO_CRC: dict[int, int] = {}


def zero_crc(n: int) -> int:
    """CRC-32 of ``n`` zero bytes, by doubling with ``crc32_combine`` (O(log n), no data)."""
    if n in _ZERO_CRC:
        return _ZERO_CRC[n]
    crc, run, run_len, rest = 0, zlib.crc32(b"\0"), 1, n
    while rest:
        if rest & 1:
            crc = crc32_combine(crc, run, run_len)
        rest >>= 1
        if rest:
            run, run_len = crc32_combine(run, run, run_len), run_len * 2
    _ZERO_CRC[n] = crc
    return crc


def _layout(path: Path, obj: Any):
    """Pickle ``obj``; ``(members [(name, bytes or Storage)], records, central directory offset, pickling s)``."""
    t0 = time.perf_counter()
    p = Pickler()
    p.emit(obj)
    pkl = p.finish()
    t_pickle = time.perf_counter() - t0
    archive = path.stem
    small = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")]
    tail = [("version", b"3\n"), (".data/serialization_id", b"%040d" % (zlib.crc32(str(path).encode()) * 7919))]
    members = small + [(f"data/{i}", s) for i, s in enumerate(p.storages)] + tail
    records, cd_offset = layout_records([(f"{archive}/{n}", len(c) if isinstance(c, bytes) else c.nbytes)
                                         for n, c in members])
    return members, records, cd_offset, t_pickle


def write_sparse_torch_file(path: Path, obj: Any) -> tuple[int, float]:
    """Write ``obj`` as a torch zip file whose tensor data are holes; ``(apparent size, seconds pickling)``."""
    members, records, cd_offset, t_pickle = _layout(path, obj)
    pieces: list[tuple[int, bytes]] = []
    for rec, (_, content) in zip(records, members):
        if isinstance(content, bytes):
            rec.crc = zlib.crc32(content)
            pieces.append((rec.data_offset, content))
        else:
            rec.crc = zero_crc(content.nbytes)
        pieces.append((rec.header_offset, local_header(rec)))
    cd = central_directory(records, cd_offset)
    pieces.append((cd_offset, cd))
    size = cd_offset + len(cd)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)  # everything not written below stays a hole
        start, buf = None, bytearray()
        for off, data in sorted(pieces):
            if start is not None and off - (start + len(buf)) < 4096:  # same or next block: one write
                buf += bytes(off - (start + len(buf))) + data
                continue
            if start is not None:
                os.pwrite(fd, buf, start)
            start, buf = off, bytearray(data)
        if start is not None:
            os.pwrite(fd, buf, start)
    finally:
        os.close(fd)
    return size, t_pickle


def write_filled_torch_file(path: Path, obj: Any, seed: int) -> tuple[int, float]:
    """Write ``obj`` as a torch zip file whose tensors hold the values :func:`storage_pieces` makes (every
    byte written, no holes), streamed: each member's data first, its CRC-32 computed on the way, then its
    local header before it; ``(size, seconds pickling)``. Memory: one piece (8 MiB) and the pickle."""
    members, records, cd_offset, t_pickle = _layout(path, obj)
    with open(path, "wb", buffering=1 << 20) as f:
        for rec, (_, content) in zip(records, members):
            f.seek(rec.data_offset)
            if isinstance(content, bytes):
                rec.crc = zlib.crc32(content)
                f.write(content)
            else:
                crc = 0
                for chunk in storage_pieces(content, seed):
                    crc = zlib.crc32(chunk, crc)
                    f.write(chunk)
                rec.crc = crc
            end = f.tell()
            f.seek(rec.header_offset)
            f.write(local_header(rec))  # ends where the data start (its padding fills the gap)
            f.seek(end)
        f.seek(cd_offset)
        f.write(central_directory(records, cd_offset))
        size = f.tell()
        f.flush()
        os.fsync(f.fileno())
    return size, t_pickle


# ============================================================================================ trees
def ds_config(stage: int, ranks: int) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 500000000}
    if stage == 3:
        zero.update({"sub_group_size": float(SUB_GROUP_SIZE), "stage3_prefetch_bucket_size": 50000000,
                     "stage3_param_persistence_threshold": 100000, "stage3_gather_16bit_weights_on_model_save": False})
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8, "train_batch_size": 8 * ranks,
            "gradient_clipping": 1.0, "steps_per_print": 10**9, "zero_optimization": zero,
            "wall_clock_breakdown": False, "bf16": {"enabled": True}}


def param_group(g: int, sub_groups: list[int]) -> dict:
    return {"weight_decay": 0.1 if g == 0 else 0.0, "lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-08,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True, "params": list(sub_groups)}


def adam_state(numel: int, step: int, runs) -> dict:
    """A torch AdamW state of ``numel`` elements; ``runs(kind)``: the fill runs of its exp_avg / exp_avg_sq."""
    return {"step": tensor("float32", 1, (), fill=[(("const", float(step)), 0, 1)]),
            "exp_avg": tensor("float32", numel, fill=runs(EXP_AVG)), "exp_avg_sq": tensor("float32", numel, fill=runs(EXP_AVG_SQ))}


def flat_runs(members: list, offsets: dict, lo: int, hi: int, kind: int) -> list:
    """The fill runs of positions ``[lo, hi)`` of a flat group holding ``members`` ``(index, name, shape)``
    one after the other from ``offsets[name]`` (a bit16 group, a ZeRO-2 partition): each parameter's values
    where it lies, zeros past the last one (padding)."""
    runs, pos = [], lo
    for i, n, s in members:
        a, b = max(offsets[n], lo), min(offsets[n] + math.prod(s), hi)
        if a < b:
            runs.append((("param", i, kind), a - offsets[n], b - a))
            pos = b
    if pos < hi:
        runs.append((None, 0, hi - pos))
    return runs


def model_states(params: list, stage: int, ranks: int, shapes: list, module: collections.OrderedDict,
                 step: int) -> dict:
    return {
        "module": module, "buffer_names": [], "optimizer": None, "param_shapes": shapes,
        "frozen_param_shapes": collections.OrderedDict(), "shared_params": {},
        "frozen_param_fragments": collections.OrderedDict(), "lr_scheduler": None, "data_sampler": None,
        "random_ltd": None, "skipped_steps": 0, "global_steps": step, "global_samples": step * 8 * ranks,
        "dp_world_size": ranks, "mp_world_size": 1, "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": ds_config(stage, ranks), "ds_version": DS_VERSION,
        "universal_checkpoint_info": {"universal_checkpoint_version": 0.4},
    }


def loss_scaler() -> Obj:
    return Obj("deepspeed.runtime.fp16.loss_scaler.LossScaler", {"cur_scale": 1.0, "dynamic": False})


def zero2_files(params: list, ranks: int, step: int):
    """``(file name, object tree)`` of every ZeRO-2 file (model states first)."""
    groups = [[(n, s) for n, s, g in params if g == k] for k in (0, 1)]
    indexed = [[(i, n, s) for i, (n, s, g) in enumerate(params) if g == k] for k in (0, 1)]
    flat, offsets, totals = [], {}, []
    for members in groups:
        pos = 0
        for n, s in members:
            offsets[n] = pos
            pos += math.prod(s)
        totals.append(pos)
        padded = ceil_div(pos, 2 * ranks) * 2 * ranks
        flat.append(Storage("bfloat16", padded, flat_runs(indexed[len(flat)], offsets, 0, padded, MASTER)))
    module = collections.OrderedDict((n, Tensor(flat[g], offsets[n], s)) for n, s, g in params)
    shapes = [collections.OrderedDict((n, Size(s)) for n, s in m) for m in groups]
    yield "mp_rank_00_model_states.pt", model_states(params, 2, ranks, shapes, module, step)
    for r in range(ranks):
        fp32, state, pads, mappings = [], {}, [], []
        for g, members in enumerate(groups):
            part = flat[g].numel // ranks
            lo, hi = r * part, (r + 1) * part
            lean = max(0, min(hi, totals[g]) - lo)
            fp32.append(Tensor(Storage("float32", part, flat_runs(indexed[g], offsets, lo, hi, MASTER)), 0, (lean,),
                               requires_grad=True))
            state[g] = adam_state(part, step, lambda kind, g=g, lo=lo, hi=hi: flat_runs(indexed[g], offsets, lo, hi, kind))
            pads.append(part - lean)
            m = collections.OrderedDict()
            for n, s in members:
                a, b = max(offsets[n], lo), min(offsets[n] + math.prod(s), hi)
                if a < b:
                    m[n] = Obj("deepspeed.utils.tensor_fragment.fragment_address", {"numel": b - a, "start": a - lo})
            mappings.append(m)
        osd = {"loss_scaler": loss_scaler(), "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
               "base_optimizer_state": {"state": state, "param_groups": [param_group(0, [0]), param_group(1, [1])]},
               "single_partition_of_fp32_groups": fp32,
               "zero_stage": Enum("deepspeed.runtime.zero.config.ZeroStageEnum", 2),
               "group_paddings": pads, "param_alignment_paddings": [[0] * len(m) for m in groups],
               "partition_count": [ranks, ranks], "ds_version": DS_VERSION, "param_slice_mappings": mappings}
        yield (f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
               {"optimizer_state_dict": osd, "ds_config": ds_config(2, ranks), "ds_version": DS_VERSION})


def zero3_sub_groups(members: list, ranks: int) -> list[list]:
    """DeepSpeed's cut of one parameter group into sub-groups (running sum of ceil(numel/N) >= sub_group_size)."""
    sizes = [ceil_div(math.prod(s), ranks) for _, s, _ in members]
    if SUB_GROUP_SIZE >= sum(sizes):
        return [members]
    out, cur, acc = [], [], 0
    for i, (m, size) in enumerate(zip(members, sizes)):
        cur.append(m)
        acc += size
        if acc >= SUB_GROUP_SIZE or i == len(members) - 1:
            out.append(cur)
            cur, acc = [], 0
    return out


def zero3_files(params: list, ranks: int, step: int):
    """``(file name, object tree)`` of every ZeRO-3 file (model states of each rank, then optimizer states)."""
    ds_ids = {n: i for i, (n, _, _) in enumerate(params)}
    subs, group_subs = [], []
    for g in (0, 1):
        cut = zero3_sub_groups([p for p in params if p[2] == g], ranks)
        group_subs.append(list(range(len(subs), len(subs) + len(cut))))
        subs += cut
    shapes = [collections.OrderedDict((n, Size(s)) for n, s, _ in sub) for sub in subs]
    sizes = [sum(ceil_div(math.prod(s), ranks) for _, s, _ in sub) for sub in subs]
    for r in range(ranks):
        module = collections.OrderedDict((n, tensor("bfloat16", 0)) for n, _, _ in params)
        yield f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", model_states(params, 3, ranks, shapes, module, step)
    for r in range(ranks):
        def runs(sub: list, kind: int, r: int = r) -> list:
            """Rank ``r``'s partition of every parameter of ``sub``, one after the other: ``ceil(numel / N)``
            elements each, from element ``r * ceil(numel / N)``, padded with zeros (as DeepSpeed partitions)."""
            out = []
            for n, s, _ in sub:
                numel = math.prod(s)
                part = ceil_div(numel, ranks)
                valid = max(0, min(numel, (r + 1) * part) - r * part)
                if valid:
                    out.append((("param", ds_ids[n], kind), r * part, valid))
                if valid < part:
                    out.append((None, 0, part - valid))
            return out

        flats = [tensor("float32", size, requires_grad=True, fill=runs(sub, MASTER),
                        py_state={"ds_id": f"{ds_ids[sub[0][0]]}_{ds_ids[sub[-1][0]]}"})
                 for sub, size in zip(subs, sizes)]
        inner = {"state": {k: adam_state(size, step, lambda kind, sub=sub: runs(sub, kind))
                           for k, (sub, size) in enumerate(zip(subs, sizes))},
                 "param_groups": [param_group(g, group_subs[g]) for g in (0, 1)]}
        osd = {"zero_stage": Enum("deepspeed.runtime.zero.config.ZeroStageEnum", 3), "loss_scaler": loss_scaler(),
               "dynamic_loss_scale": False, "overflow": False, "partition_count": ranks,
               "optimizer_state_dict": inner, "fp32_flat_groups": flats}
        yield (f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
               {"optimizer_state_dict": osd, "ds_config": ds_config(3, ranks), "ds_version": DS_VERSION})


# ============================================================================================ main
def disk_usage(path: Path) -> tuple[int, int, int]:
    """``(files, apparent bytes, bytes allocated on disk)`` under ``path``."""
    count = apparent = allocated = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            count += 1
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return count, apparent, allocated


def make(out: Path, stage: int, ranks: int, step: int = 1000, fill: str = "none", seed: int = 0, **model) -> dict:
    """Write the checkpoint into ``out`` (replaced if it exists); returns a summary. ``fill``: ``"none"``
    (tensor data are holes) or ``"random"`` (every tensor byte written: :func:`param_bits` values of ``seed``)."""
    t0 = time.perf_counter()
    params = llama_params(**model)
    if out.exists():
        shutil.rmtree(out)
    tag = f"global_step{step}"
    (out / tag).mkdir(parents=True)
    files = zero3_files(params, ranks, step) if stage == 3 else zero2_files(params, ranks, step)
    pickling = 0.0
    for name, obj in files:
        if fill == "random":
            pickling += write_filled_torch_file(out / tag / name, obj, seed)[1]
        elif fill == "none":
            pickling += write_sparse_torch_file(out / tag / name, obj)[1]
        else:
            raise ValueError(f"fill {fill!r}: none or random")
    (out / "latest").write_text(tag)
    try:  # DeepSpeed copies its converters beside the tag folders
        import importlib.util

        spec = importlib.util.find_spec("deepspeed")
        if spec and spec.origin:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                src = Path(spec.origin).parent / "utils" / script
                if src.is_file():
                    shutil.copyfile(src, out / script)
    except (ImportError, ValueError):
        pass
    count, apparent, allocated = disk_usage(out)
    return {"out": str(out), "stage": stage, "ranks": ranks, "files": count,
            "parameters": sum(math.prod(s) for _, s, _ in params), "tensors": len(params),
            "apparent_bytes": apparent, "allocated_bytes": allocated, "seconds": time.perf_counter() - t0,
            "pickling_seconds": pickling, "fill": fill, "seed": seed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--stage", type=int, choices=(2, 3), default=3)
    ap.add_argument("--ranks", type=int, default=512, help="data-parallel size N (default 512)")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--step", type=int, default=1000)
    ap.add_argument("--fill", choices=("none", "random"), default="none",
                    help="none: tensor data are holes (sparse files, a few MB); random: every tensor byte written, "
                         "deterministic pseudo-random finite values (param_bits), streamed in 8 MiB pieces")
    ap.add_argument("--seed", type=int, default=0, help="with --fill random: the values' seed")
    args = ap.parse_args(argv)
    s = make(args.out, args.stage, args.ranks, args.step, args.fill, args.seed, layers=args.layers, hidden=args.hidden,
             intermediate=args.intermediate, vocab=args.vocab, heads=args.heads, kv_heads=args.kv_heads)
    print(f"ZeRO-{s['stage']} x {s['ranks']} ranks, {s['parameters']:,} parameters in {s['tensors']} tensors: "
          f"{s['files']} files, apparent {s['apparent_bytes'] / 1e9:,.1f} GB, on disk {s['allocated_bytes'] / 2**20:,.1f} MiB, "
          f"{s['seconds']:.1f} s ({s['pickling_seconds']:.1f} s pickling), fill {s['fill']} -> {s['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
