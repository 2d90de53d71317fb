"""Seeded fuzzing of real checkpoints: a few hundred mutations (bit flips, overwritten and zeroed runs,
truncations, appended bytes, deleted, duplicated and swapped rank files, odd ``latest`` files) of DeepSpeed's
own files, each exported with ``verify_crc``.

The property (issue 21): an export either refuses with ckptlib's one clear error (a :class:`CkptError`
naming a file or folder: never another exception), or succeeds with output bit-equal to the export of the
undamaged checkpoint, and then every mutated byte provably lies outside the bytes that export reads (the
plan's byte ranges and the zip members whose CRC-32 it verifies): damage to bytes the output depends on never
passes. The source is restored byte for byte after each mutation.
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

import ckptlib
from ckptlib.errors import CkptError

SEED = 20261201
MUTATIONS = 120  # per fixture


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _restore(root: Path, original: dict[Path, bytes]) -> None:
    for p in list(root.rglob("*")):
        if p.is_file() and p not in original:
            p.unlink()
    for p, data in original.items():
        if not p.exists() or p.read_bytes() != data:
            p.write_bytes(data)


def _mutate(rng: random.Random, tag: Path, ckpt: Path, original: dict) -> tuple[str, list]:
    """Apply one mutation; ``(what, [(path, first byte, end)] it changed, or [] when not byte-local)``."""
    ranks = sorted(tag.glob("*optim_states.pt")) + sorted(tag.glob("*model_states.pt"))
    f = rng.choice(ranks)
    size = len(original[f])
    kind = rng.choice(["flip", "flip", "flip", "overwrite", "zero", "truncate", "append", "delete", "duplicate",
                       "swap", "latest"])
    if kind in ("flip", "overwrite", "zero"):
        at = rng.randrange(size)
        n = 1 if kind == "flip" else rng.randint(1, 16)
        data = bytearray(original[f])
        for i in range(at, min(size, at + n)):
            data[i] = data[i] ^ (1 << rng.randrange(8)) if kind == "flip" else (
                rng.randrange(256) if kind == "overwrite" else 0)
        if bytes(data) == original[f]:
            data[at] ^= 1
        f.write_bytes(bytes(data))
        return f"{kind} {f.name}@{at}+{n}", [(str(f), at, min(size, at + n))]
    if kind == "truncate":
        f.write_bytes(original[f][:rng.randrange(size)])
        return f"truncate {f.name}", []
    if kind == "append":
        f.write_bytes(original[f] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
        return f"append {f.name}", []
    if kind == "delete":
        f.unlink()
        return f"delete {f.name}", []
    others = [g for g in ranks if g != f and g.name.split("zero_pp_rank_")[0] == f.name.split("zero_pp_rank_")[0]
              and ("optim" in g.name) == ("optim" in f.name)]
    if kind in ("duplicate", "swap") and others:
        g = rng.choice(others)
        g.write_bytes(original[f])
        if kind == "swap":
            f.write_bytes(original[g])
        return f"{kind} {f.name} {g.name}", []
    (ckpt / "latest").write_bytes(rng.choice([b"", b"global_step2\n\x1b[2J", b"../global_step2", b"x" * 5000,
                                              bytes(rng.randrange(256) for _ in range(12))]))
    return "latest", []


def _read_bytes(plan) -> dict[str, list]:
    """Per source file, the byte ranges the export reads: its tensors' ranges, the range checks', and the zip
    members whose CRC-32 it verifies."""
    out: dict = {}
    for f in plan.weights:
        for t in f.tensors:
            for r in t.ranges:
                if hasattr(r, "path"):
                    out.setdefault(r.path, []).append((r.offset, r.offset + r.nbytes))
    for e in plan.crc:
        out.setdefault(e.path, []).append((e.offset, e.offset + e.size))
    return out


@pytest.mark.parametrize("name", ["z2_bf16_w2", "z3_fp32_w2", "z1_fp16_w3"])
def test_a_successful_export_of_a_mutated_checkpoint_is_exact(fixture_by_name, tmp_path, name):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture_by_name(name)["checkpoint_path"], ckpt)
    tag = ckpt / "global_step2"
    original = _files(ckpt)
    clean = ckptlib.plan_export(ckpt, tmp_path / "ref", verify_crc=True, hf_files=False, states=["exp_avg"])
    used = _read_bytes(clean)
    ckptlib.export(clean)
    reference = {p.relative_to(tmp_path / "ref"): p.read_bytes() for p in (tmp_path / "ref").rglob("*") if p.is_file()}
    rng = random.Random(f"{SEED}-{name}")
    outcomes: dict = {"refused": 0, "exact": 0}
    for i in range(MUTATIONS):
        what, changed = _mutate(rng, tag, ckpt, original)
        out = tmp_path / f"out{i}"
        try:
            ckptlib.export(ckpt, out, verify_crc=True, hf_files=False, states=["exp_avg"])
        except CkptError as e:
            outcomes["refused"] += 1
            assert e.path or str(ckpt) in str(e), (what, str(e))
            assert not out.exists(), what
        except Exception as e:  # noqa: BLE001 - anything else is a bug the fuzzing found
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        else:
            outcomes["exact"] += 1
            got = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
            assert got == reference, f"{what}: a successful export differs from the undamaged checkpoint's"
            for path, a, b in changed:  # and the damage lay outside every byte the export reads
                assert not any(lo < b and a < hi for lo, hi in used.get(path, [])), what
            shutil.rmtree(out)
        _restore(ckpt, original)
    assert outcomes["refused"] > MUTATIONS // 3 and outcomes["exact"] > 0, outcomes
