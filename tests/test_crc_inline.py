"""The CRC-32 of every zip member a run reads, checked by default as its bytes stream (issue 40).

torch records a CRC-32 for every member of its zip files and never checks it: one flipped bit in tensor data
otherwise exports as a wrong value with exit 0. Export, reshard (native and universal), DCP export and the
adapter merge now compute it as the bytes pass (:mod:`ckptlib.io.crc`) and compare it with the zip directory's
before the output is put in place; ``--no-verify-crc`` turns that off. Real checkpoints of every kind named in
the issue (ZeRO-1/2/3, a pipeline layer file, DeepSpeed-MoE and AutoEP expert files) with one payload byte
flipped are refused naming the file and the entry, and leave nothing; undamaged ones export byte for byte as
without the check. The joining of CRC-32s (``crc32_combine``), the ledger of spans (read in pieces, by
several threads, twice, in part) and writers in threads and in processes are tested on real files.
"""
from __future__ import annotations

import random
import shutil
import threading
import zlib
from pathlib import Path

import pytest

import ckptlib
from ckptlib.errors import IncompleteCheckpointError
from ckptlib.io.crc import CrcLedger, CrcSourceFiles, crc_members, joined_crc
from ckptlib.io.sources import SourceFiles
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.zipfmt import crc32_combine
from tests.cli import assert_refused, run_cli


# ================================================================================================ crc32_combine
def test_crc32_combine_equals_zlib_of_every_concatenation():
    """Any cut of any bytes into pieces: the pieces' CRC-32s joined in order are zlib's CRC-32 of the whole
    (pieces of 0 and 1 bytes, odd lengths, a few MiB)."""
    rng = random.Random(40)
    for trial in range(60):
        data = rng.randbytes(rng.choice([0, 1, 7, 4096, 65537, 3 * 2**20 + 5]))
        cuts = sorted(rng.sample(range(len(data) + 1), min(len(data) + 1, rng.randint(0, 12))))
        bounds = [0, *cuts, len(data)]
        crc = 0
        for a, b in zip(bounds, bounds[1:]):
            crc = crc32_combine(crc, zlib.crc32(data[a:b]), b - a)
        assert crc == zlib.crc32(data), (trial, len(data), cuts)


# ================================================================================================ the ledger
def _optim_file(fx) -> Path:
    return next((fx["checkpoint_path"] / fx["tag"]).glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))


def _pieces(e, rng, most: int) -> list[tuple[int, int]]:
    """Member ``e`` cut into pieces of 1..most bytes: ``[(offset, nbytes)]`` in file order."""
    out, pos = [], e.offset
    while pos < e.offset + e.size:
        n = min(rng.randint(1, most), e.offset + e.size - pos)
        out.append((pos, n))
        pos += n
    return out


def test_the_ledger_joins_spans_read_in_any_order_by_several_threads(fixture_by_name, tmp_path):
    """Every member of a real optimizer-state file read in pieces of random sizes, shuffled, by four threads
    through a :class:`CrcSourceFiles`, some pieces left out (read at the check), some read twice: the clean file
    verifies; the same reads of a copy with one byte flipped name that member, whether the flipped byte was read
    by a thread or only at the check."""
    src = _optim_file(fixture_by_name("z2_bf16_w2"))
    for damaged_read in (None, True, False):
        f = tmp_path / f"{damaged_read}.pt"
        shutil.copy(src, f)
        with open_torch_file(f) as tf:
            members = [e for e in tf.entries if e.size]
        rng = random.Random(str(damaged_read))
        reads = [p for e in members for p in _pieces(e, rng, 3000)]
        left_out = set(rng.sample(range(len(reads)), len(reads) // 5))
        twice = rng.sample(range(len(reads)), 10)
        victim = max(members, key=lambda e: e.size)
        if damaged_read is not None:  # a byte inside a piece the threads read, or inside one left out
            k = next(i for i, (o, n) in enumerate(reads)
                     if victim.offset <= o < victim.offset + victim.size and (i in left_out) != damaged_read)
            raw = bytearray(f.read_bytes())
            raw[reads[k][0]] ^= 0x40
            f.write_bytes(bytes(raw))
        todo = [reads[i] for i in range(len(reads)) if i not in left_out] + [reads[i] for i in twice]
        rng.shuffle(todo)
        ledger = CrcLedger(members)
        files = CrcSourceFiles(ledger)

        def read(share):
            for offset, n in share:
                files.read_into(str(f), offset, memoryview(bytearray(n)))

        threads = [threading.Thread(target=read, args=(todo[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        files.close()
        assert 0 < len(ledger.spans) <= len(todo)  # pieces a thread read in order grew one span
        with SourceFiles() as check:
            bad = ledger.verify(check)
            assert check.stats.bytes_read >= sum(reads[i][1] for i in left_out - set(twice))  # what no thread read

        if damaged_read is None:
            assert bad == [], bad
        else:
            assert [(e.name, why) for e, _, why in bad] == [(victim.name, "changed")]


def test_a_member_read_in_order_is_one_span_and_its_crc_goes_on(fixture_by_name):
    """Pieces of a member one thread reads in file order extend one span (``zlib.crc32`` continued from its value,
    nothing to join); a piece read ``alone`` (a writer that joins the CRC-32s into its own) gets its own CRC-32."""
    f = str(_optim_file(fixture_by_name("z2_bf16_w2")))
    with open_torch_file(f) as tf:
        e = max(tf.entries, key=lambda e: e.size)
    ledger = CrcLedger([e])
    with CrcSourceFiles(ledger) as files:
        for offset, n in _pieces(e, random.Random(1), 1000):
            files.read_into(f, offset, memoryview(bytearray(n)))
        assert len(ledger.spans) == 1 and ledger.spans[0][2:4] == [e.offset, e.size] and ledger.spans[0][4] == e.crc
        got = files.read_scattered(f, e.offset, [memoryview(bytearray(10))], alone=True)
    raw = Path(f).read_bytes()
    assert got == zlib.crc32(raw[e.offset:e.offset + 10]) and len(ledger.spans) == 2
    with SourceFiles() as check:
        assert ledger.verify(check) == []


def test_two_reads_of_the_same_bytes_must_agree(fixture_by_name):
    """A span read twice: equal CRC-32s pass, whether the second read has the same bounds as the first or other
    ones; a second read that saw other bytes (the file changed during the run) is named, not taken."""
    f = _optim_file(fixture_by_name("z2_bf16_w2"))
    with open_torch_file(f) as tf:
        e = max(tf.entries, key=lambda e: e.size)
    raw = f.read_bytes()[e.offset:e.offset + e.size]

    def crc(a, b):
        return zlib.crc32(raw[a:b])

    half, third = e.size // 2, e.size // 3
    for extra, ok in (((0, half), True), ((third, e.size), True), ((third, half), True), ((third, half + 1), True),
                      ((third, half), False)):
        ledger = CrcLedger([e])
        ledger.note(str(f), 0, e.offset, half, crc(0, half))
        ledger.note(str(f), 0, e.offset + half, e.size - half, crc(half, e.size))
        a, b = extra
        ledger.note(str(f), 0, e.offset + a, b - a, crc(a, b) if ok else crc(a, b) ^ 1)
        with SourceFiles() as files:
            bad = ledger.verify(files)
        assert bad == ([] if ok else [(e, e.crc, "reread")]), (extra, ok, bad)


def test_a_writer_joins_the_spans_crcs_instead_of_computing_its_own(fixture_by_name):
    """:func:`joined_crc` of a gather read by :meth:`CrcSourceFiles.read_gather_crc` (ranges of several members,
    back to back, out of file order) is zlib's CRC-32 of the buffer; where the pieces of one span lie apart in the
    buffer it is computed."""
    from ckptlib.layout.ranges import StoredRange

    f = str(_optim_file(fixture_by_name("z2_bf16_w2")))
    with open_torch_file(f) as tf:
        es = [e for e in tf.entries if e.size >= 64]
    a, b = es[-1], es[-2]
    for gather in ([StoredRange(f, a.offset + 8, "uint8", 40), StoredRange(f, b.offset, "uint8", 24),
                    StoredRange(f, a.offset + 48, "uint8", 8)],  # a's two ranges continue each other, b's between
                   [StoredRange(f, b.offset, "uint8", 64), StoredRange(f, a.offset, "uint8", 32)]):
        out = memoryview(bytearray(sum(r.nbytes for r in gather)))
        with CrcSourceFiles(CrcLedger(es)) as files:
            spans = files.read_gather_crc(gather, out)
        assert joined_crc(spans, out) == zlib.crc32(out)


# ================================================================================================ acceptance
def _flip_member(ckpt: Path, glob: str, plan) -> tuple[Path, str]:
    """Flip one bit in the middle of the largest zip member of the file ``glob`` (under ckpt) that ``plan``
    reads; the file and the member's name."""
    f = next(ckpt.rglob(glob))
    e = max((e for e in plan.crc if Path(e.path).name == f.name), key=lambda e: e.size)
    raw = bytearray(f.read_bytes())
    raw[e.offset + e.size // 2] ^= 0x08
    f.write_bytes(bytes(raw))
    return f, e.name


#: (case, fixture family, fixture, file damaged, export arguments or None, reshard arguments)
CASES = [
    ("ZeRO-1", "ds", "z1_bf16_w3", "*zero_pp_rank_1_mp_rank_00_optim_states.pt", [], ["--world-size", 2]),
    ("ZeRO-2", "ds", "z2_bf16_w2", "*zero_pp_rank_1_mp_rank_00_optim_states.pt", [], ["--world-size", 3]),
    ("ZeRO-3", "ds", "z3_bf16_w2", "*zero_pp_rank_1_mp_rank_00_optim_states.pt", [], ["--world-size", 3]),
    ("ZeRO-3 universal", "ds", "z3_fp32_w2", "*zero_pp_rank_0_mp_rank_00_optim_states.pt", None, ["--universal"]),
    ("pipeline layer file", "parallel", "pp2_dp1_z1_bf16", "layer_02-model_states.pt", [], ["--world-size", 2]),
    ("pipeline layer file, pp 1", "parallel", "pp2_dp1_z1_bf16", "layer_02-model_states.pt", None, ["--pp", 1]),
    ("DeepSpeed-MoE expert file", "parallel", "moe_ep2_z0_fp32", "layer_0_expert_1_mp_rank_00_model_states.pt", [],
     None),
    ("DeepSpeed-MoE expert file", "parallel", "moe_ep2_z1_bf16", "layer_0_expert_1_mp_rank_00_model_states.pt", None,
     ["--world-size", 4]),
    ("AutoEP expert file", "autoep", "mixtral_z2_w2_ep2", "layer_1_expert_2_mp_rank_00_model_states.pt", None,
     ["--world-size", 2, "--ep", 1]),
    # the rows of a tensor-parallel slice, read back to back into every other row (their CRC-32 gathered)
    ("tensor-parallel join", "parallel", "tp2_dp2_z1_bf16", "*zero_pp_rank_1_mp_rank_01_optim_states.pt", [],
     ["--tp", 1]),
]


def _fixture(request, family: str, name: str) -> dict:
    if family == "ds":
        return request.getfixturevalue("fixture_by_name")(name)
    return request.getfixturevalue(f"{family}_fixtures")[name]


def _plan(ckpt: Path, out: Path, command: str, args: list):
    if command == "export":
        return ckptlib.plan_export(ckpt, out, hf_files=False)
    if args == ["--universal"]:
        return ckptlib.plan_universal(ckpt, out, hf_files=False)
    kw = {{"--world-size": "world_size", "--pp": "pp", "--ep": "ep", "--tp": "tp"}[k]: v for k, v in zip(args[::2], args[1::2])}
    return ckptlib.plan_reshard(ckpt, out, hf_files=False, **kw)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_a_flipped_payload_byte_is_refused_without_any_flag(request, tmp_path, case):
    """Without any flag, export and reshard of a copy of a real checkpoint with one payload byte flipped (in a zip
    member the run reads) exit 2 naming the file and the entry, and leave nothing (no output, no hidden temporary
    folder); ``--no-verify-crc`` writes it (the check is what refuses); undamaged, the output is byte for byte the
    one written without the check."""
    label, family, name, glob, export, reshard = case
    fx = _fixture(request, family, name)
    for command, args in (("export", export), ("reshard", reshard)):
        if args is None:
            continue
        work = tmp_path / command
        ckpt = work / "ckpt"
        shutil.copytree(fx["checkpoint_path"], ckpt)
        clean, unchecked = work / "clean", work / "unchecked"
        assert run_cli(command, ckpt, clean, *args, "--no-hf-files")[0] == 0
        assert run_cli(command, ckpt, unchecked, *args, "--no-hf-files", "--no-verify-crc")[0] == 0
        assert _tree(clean) == _tree(unchecked), (label, command)
        f, entry = _flip_member(ckpt, glob, _plan(ckpt, work / "x", command, args))
        out = work / "out"
        assert_refused(*run_cli(command, ckpt, out, *args, "--no-hf-files"), [f.name, entry, "CRC-32", "restore"], out)
        assert sorted(p.name for p in work.iterdir()) == ["ckpt", "clean", "unchecked"]  # nothing left behind
        code, _, err = run_cli(command, ckpt, out, *args, "--no-hf-files", "--no-verify-crc")
        assert code == 0, err
        assert _tree(out) != _tree(clean), (label, command, "the flipped byte lies in what the run copies")


def _tree(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ================================================================================================ the plan, the flags
def test_the_plan_says_what_it_checks(fixture_by_name, legacy_fixtures, parallel_fixtures, tmp_path):
    """``--plan`` names the entries checked as read and what is read in part (the padding after the last rank's
    partition), files that record no CRC-32 (torch's legacy format), and ``--no-verify-crc``; nothing is read."""
    ck = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    code, out, err = run_cli("export", ck, tmp_path / "o", "--plan")
    assert code == 0, err
    assert "checks the CRC-32 of the" in out and "zip entries it reads" in out and "before the output is put in place" \
        in out, out
    assert "reads only in part: their other" in out, out  # ZeRO-2's padding
    plan = ckptlib.plan_export(ck, tmp_path / "o")
    assert plan.crc and plan.crc_partial and 0 < plan.crc_unread < 1024 and not plan.crc_none
    assert plan.read_bytes == sum(f.read_bytes for f in plan.files) + sum(c.read_bytes for c in plan.checks) + \
        plan.crc_unread
    code, out, err = run_cli("reshard", ck, tmp_path / "o", "--world-size", 3, "--plan", "--no-verify-crc")
    assert code == 0 and "does not check the CRC-32 of the source (--no-verify-crc)" in out, out + err
    assert not ckptlib.plan_reshard(ck, tmp_path / "o", 3, verify_crc=False).crc
    legacy = legacy_fixtures["legacy_z2_bf16_w2"]["checkpoint_path"]
    code, out, err = run_cli("export", legacy, tmp_path / "o", "--plan")
    assert code == 0 and "not checked: " in out and "record no CRC-32" in out and "legacy" in out, out + err
    layer = parallel_fixtures["pp2_dp1_z1_bf16"]["checkpoint_path"]
    code, out, err = run_cli("reshard", layer, tmp_path / "o", "--world-size", 2, "--plan")
    assert code == 0 and "checks the CRC-32 of the" in out, out + err
    assert not (tmp_path / "o").exists()
    for command in ("export", "reshard"):
        code, out, _ = run_cli(command, "--help")
        assert "--no-verify-crc" in out and "the default (kept for scripts)" in out


def test_members_read_in_part_and_files_without_crc(fixture_by_name, tmp_path):
    """:func:`crc_members` on a real file: a member touched by one byte is listed with the rest of its bytes to
    read; one not touched is not; a file without members is named."""
    f = _optim_file(fixture_by_name("z2_bf16_w2"))
    with open_torch_file(f) as tf:
        es = [e for e in tf.entries if e.size > 8]
    a, b = es[0], es[1]
    found, unread, partial, without = crc_members({str(f): es}, [(str(f), a.offset, a.size), (str(f), b.offset + 3, 1),
                                                                 (str(f), b.offset, 2), ("/no/crc.bin", 0, 10)])
    assert found == [a, b] and unread == b.size - 3 and partial == 1 and without == ["/no/crc.bin"]


# ================================================================================================ threads, processes
def _damaged(fixture, tmp_path) -> tuple[Path, str]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture["checkpoint_path"], ckpt)
    f, entry = _flip_member(ckpt, "*zero_pp_rank_1_mp_rank_00_optim_states.pt",
                            ckptlib.plan_export(ckpt, tmp_path / "x", hf_files=False))
    return ckpt, entry


def test_threads_and_processes_check_what_they_read(fixture_by_name, tmp_path, monkeypatch):
    """Writers in two processes (export ``--workers 2``: each sends the CRC-32s of its spans back), two threads
    (reshard), and the kernel-copy path (long ranges, their bytes read again beside the copy in small chunks, so
    that one member is read in many pieces by two threads): a damaged member is refused naming it, nothing is
    written; undamaged, the outputs equal the unchecked runs'."""
    from ckptlib.io import streaming

    fx = fixture_by_name("z3_bf16_w2")
    ckpt, entry = _damaged(fx, tmp_path)
    clean = fx["checkpoint_path"]
    runs = {
        "export, 2 processes": lambda c, o, v: ckptlib.plan_export(c, o, workers=2, hf_files=False, verify_crc=v),
        "reshard, 2 threads": lambda c, o, v: ckptlib.plan_reshard(c, o, 3, workers=2, hf_files=False, verify_crc=v),
        "DCP export with the optimizer": lambda c, o, v: ckptlib.plan_export(c, o, format="dcp", verify_crc=v,
                                                                             dcp={"optimizer": True}, hf_files=False),
    }
    for what, plan in runs.items():
        with pytest.raises(IncompleteCheckpointError, match="CRC-32") as e:
            ckptlib.run(plan(ckpt, tmp_path / "out", True))
        assert entry in str(e.value), (what, str(e.value))
        assert not (tmp_path / "out").exists()
        ckptlib.run(plan(clean, tmp_path / "a", True))
        ckptlib.run(plan(clean, tmp_path / "b", False))
        a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
        for t in (a, b):  # DCP's metadata records a random id of the save
            t.pop(Path(".metadata"), None)
        assert a == b, what
        shutil.rmtree(tmp_path / "a")
        shutil.rmtree(tmp_path / "b")
    # every range a kernel copy (a 16-byte threshold), in chunks of 1 KiB: the CRC-32 read beside each copy; a
    # member read in many pieces, by two threads
    monkeypatch.setattr(streaming, "KERNEL_COPY_MIN_BYTES", 16)
    copies = []
    beside = streaming.crc_beside

    def counted(*a):
        fut = beside(*a)
        copies.append(fut is not None)
        return fut

    monkeypatch.setattr(streaming, "crc_beside", counted)
    seen = _spy(monkeypatch)
    kernel = {"export": lambda c, o, v: ckptlib.plan_export(c, o, hf_files=False, chunk_bytes=1024, verify_crc=v),
              "reshard": lambda c, o, v: ckptlib.plan_reshard(c, o, 3, workers=2, hf_files=False, chunk_bytes=1024,
                                                              verify_crc=v)}
    reads: list = []
    record = CrcLedger.record

    def counted_record(self, path, offset, views, alone=False):
        reads.append((path, offset))
        return record(self, path, offset, views, alone)

    monkeypatch.setattr(CrcLedger, "record", counted_record)
    for what, plan in kernel.items():
        with pytest.raises(IncompleteCheckpointError, match=entry):
            ckptlib.run(plan(ckpt, tmp_path / "out", True))
        reads.clear()
        ckptlib.run(plan(clean, tmp_path / "a", True))
        per_file = {p: sum(1 for q, _ in reads if q == p) for p, _ in reads}
        assert max(per_file.values()) > 10 and len(seen[-1]) <= len(reads), what  # many pieces, as many spans or fewer
        ckptlib.run(plan(clean, tmp_path / "b", False))
        assert _tree(tmp_path / "a") == _tree(tmp_path / "b"), what
        shutil.rmtree(tmp_path / "a")
        shutil.rmtree(tmp_path / "b")
    assert sum(copies) > 10  # the kernel copies' bytes read again for their CRC-32


def _spy(monkeypatch) -> list:
    """The spans every ledger holds when it verifies (a list, one entry per run)."""
    seen: list = []
    verify = CrcLedger.verify

    def spy(self, files, cancel=None):
        seen.append(list(self.spans))
        return verify(self, files, cancel)

    monkeypatch.setattr(CrcLedger, "verify", spy)
    return seen


def test_a_tensor_stored_twice_is_checked_where_each_copy_is_read(parallel_fixtures, tmp_path, monkeypatch):
    """A tensor stored on two pipeline stages (the tied embedding): the copy the writer reads is checked as the
    writer reads it; the other one as the copies check beside the writing reads it to compare (no pass of its own
    after the writing). A flipped byte in either copy is refused naming its file, and nothing is written."""
    from ckptlib.io.crc import plan_reads

    fx = parallel_fixtures["pp2_dp1_z1_bf16"]
    plan = ckptlib.plan_export(fx["checkpoint_path"], tmp_path / "o", hf_files=False)
    check = next(c for c in plan.checks if all(hasattr(r, "path") for r in (*c.a, *c.b)))
    reads = list(plan_reads(plan))
    for r in (*check.a, *check.b):
        assert any(r.path == p and o <= r.offset < o + n for p, o, n in reads)
    assert plan.crc_unread < 64  # nothing read again after the writing but a few bytes of padding
    seen = _spy(monkeypatch)
    ckptlib.run(plan)
    b = check.b[0]
    assert any(p == b.path and o <= b.offset < o + n for p, _, o, n, _ in seen[-1])  # noted by the copies check
    for side in ("a", "b"):
        ckpt = tmp_path / side / "ckpt"
        shutil.copytree(fx["checkpoint_path"], ckpt)
        r = getattr(check, side)[0]
        f = ckpt / Path(r.path).relative_to(fx["checkpoint_path"])
        raw = bytearray(f.read_bytes())
        raw[r.offset + 1] ^= 0x01
        f.write_bytes(bytes(raw))
        with pytest.raises(IncompleteCheckpointError) as e:
            ckptlib.run(ckptlib.plan_export(ckpt, tmp_path / side / "o", hf_files=False))
        assert f.name in str(e.value), str(e.value)  # the copies differ: found beside the writing
        assert not (tmp_path / side / "o").exists()


def test_a_distributed_run_checks_in_a_pass_of_its_own(fixture_by_name, tmp_path):
    """Where the writers cannot check as they read (a distributed run: each rank reads a share), rank 0 checks the
    plan's members first (:func:`~ckptlib.execute.runner.verify_source_crcs`)."""
    from ckptlib.execute.runner import verify_source_crcs

    ckpt, entry = _damaged(fixture_by_name("z2_bf16_w2"), tmp_path)
    plan = ckptlib.plan_export(ckpt, tmp_path / "o", hf_files=False)
    verify_source_crcs(plan, inline=True)  # the one runner checks them itself
    with pytest.raises(IncompleteCheckpointError, match=entry):
        verify_source_crcs(plan)
    verify_source_crcs(ckptlib.plan_export(fixture_by_name("z2_bf16_w2")["checkpoint_path"], tmp_path / "o"))


def test_a_merge_checks_the_checkpoint_it_reads(peft_fixtures, tmp_path):
    """The adapter merge (a plan the runner runs) checks the checkpoint's members it reads (the factors' masters);
    the base's safetensors record no CRC-32 and the plan says so."""
    from ckptlib.export.merge import plan_merge

    fx = peft_fixtures["peft_lora_emb_z2"]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], ckpt)
    plan = plan_merge(ckpt, tmp_path / "m", fx["base_path"])
    assert plan.crc and plan.crc_none and "record no CRC-32" in plan.describe()
    e = max(plan.crc, key=lambda e: e.size)
    raw = bytearray(Path(e.path).read_bytes())
    raw[e.offset + e.size // 2] ^= 0x02
    Path(e.path).write_bytes(bytes(raw))
    with pytest.raises(IncompleteCheckpointError, match="CRC-32") as err:
        ckptlib.run(plan_merge(ckpt, tmp_path / "m", fx["base_path"]))
    assert e.name in str(err.value) and not (tmp_path / "m").exists()
    ckptlib.run(plan_merge(ckpt, tmp_path / "m", fx["base_path"], verify_crc=False))


def test_files_copied_whole_beside_the_tag_are_checked_too(tmp_path):
    """A reshard of an HF Trainer ``checkpoint-N`` copies the Trainer's torch files beside the tag folder as they
    are (``scheduler.pt``, ``rng_state_0.pth``, ``training_args.bin``): their zip directories are read at planning
    (:func:`~ckptlib.io.torchzip.reader.zip_entries_of`, nothing unpickled; ``()`` for a file that is not a zip) and
    every member is checked as the copy streams; a flipped byte in one is refused naming it."""
    from ckptlib.io.torchzip.reader import zip_entries_of
    from tests.fixtures.hf import factory

    pytest.importorskip("transformers")
    fx = {f["name"]: f for f in factory.list_fixtures(factory.ensure_fixtures(verbose=False))}["hf_llama_z2_w2"]
    src = fx["checkpoint_paths"][0]
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(src, ckpt)
    sched = ckpt / "scheduler.pt"
    with open_torch_file(sched) as tf:
        assert zip_entries_of(sched) == tf.entries
    assert zip_entries_of(ckpt / "trainer_state.json") == ()
    plan = ckptlib.plan_reshard(ckpt, tmp_path / "o", 1)
    assert {"scheduler.pt", "rng_state_0.pth", "training_args.bin"} <= {Path(e.path).name for e in plan.crc}
    e = max((e for e in plan.crc if e.path == str(sched)), key=lambda e: e.size)
    raw = bytearray(sched.read_bytes())
    raw[e.offset + e.size // 2] ^= 0x20
    sched.write_bytes(bytes(raw))
    assert_refused(*run_cli("reshard", ckpt, tmp_path / "o", "--world-size", 1), ["scheduler.pt", e.name, "CRC-32"],
                   tmp_path / "o")


def test_the_fast_crc32_is_zlibs_function():
    """ckptlib.io.crc32 (libdeflate where the system has it) gives zlib.crc32's value on every kind of buffer, from any
    start value, cut anywhere; the fallback is zlib itself."""
    import os
    import zlib

    from ckptlib.io import crc32 as fast

    data = os.urandom((1 << 20) + 12345)
    views = [data, bytearray(data), memoryview(data)[17:], memoryview(bytearray(data))[3:-5], data[:100]]
    for v in views:
        for start in (0, 1, 0xDEADBEEF):
            assert fast.crc32(v, start) == zlib.crc32(v, start)
    cut = 777_777
    assert fast.crc32(data[cut:], fast.crc32(data[:cut])) == zlib.crc32(data)
    assert fast.backend() in ("libdeflate", "zlib")
    # many views, short and long, of bytes and of floats, gathered through a stage or taken alone
    whole = memoryview(bytearray(data))
    cuts = sorted({0, len(data), *range(0, 40_000, 997), *range(40_000, len(data), 70_001), 300_000, 300_003})
    parts = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
    parts[5] = parts[5][:len(parts[5]) // 4 * 4].cast("f")
    joined = b"".join(bytes(p) for p in parts)
    for stage in (None, memoryview(bytearray(4096)), memoryview(bytearray(1 << 18))):
        for start in (0, 0xDEADBEEF):
            assert fast.crc32_of_views(parts, start, stage) == zlib.crc32(joined, start), stage
