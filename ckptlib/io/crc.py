"""Checking the CRC-32 that a torch zip file records for each of its members (torch itself never checks
them): damaged bytes inside tensor data otherwise read as valid numbers.

A member is checked whole (its CRC-32 covers all its bytes). Two ways:

- **as a run reads it** (every export, reshard and merge by default): :func:`crc_members` lists, from a
  plan's byte ranges, the members the run reads bytes of; a :class:`CrcSourceFiles` computes the CRC-32
  (:func:`~ckptlib.io.crc32.crc32`: libdeflate's where present, else ``zlib.crc32``) of every span it reads from them, in the thread that read it (the read-ahead thread
  of :mod:`ckptlib.io.streaming`; bytes a copy moves inside the kernel are read again beside it, from the
  page cache, in small pieces), and notes it in a :class:`CrcLedger`; once the output is written,
  :meth:`CrcLedger.verify` joins each member's spans in file order (:func:`crc32_combine`), reads the
  bytes of it that no span covered (a member read only in part: the padding after the last partition,
  say) and compares the result with the zip directory's value. Spans read twice must agree.
- **in a pass of its own** (``ckpt check``; a distributed run, where the ranks read apart):
  :func:`verify_entries` streams each member through one reusable buffer.

Plans carry the members as plain data (:class:`~ckptlib.io.torchzip.ZipEntry`).

Memory: a ledger holds one small tuple per span read (a span is at most a chunk); the separate pass goes
through one buffer of ``chunk_bytes``, the bytes no span covered and those of kernel copies through
:data:`CRC_PIECE_BYTES`. Time: a CRC-32 over every byte read, beside the read (where a writer keeps the
CRC-32 of its output, the spans' are joined into it instead of computing it again).
"""
from __future__ import annotations

import bisect
import os
import threading
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from ..errors import IncompleteCheckpointError
from ..layout.ranges import StoredRange
from ..plan import CopyFile, DistcpFile, Plan, TreeFile, WeightsFile
from ..progress import check_cancel
from .sources import SourceFiles
from .torchzip.handles import TensorHandle
from .torchzip.reader import ZipEntry, zip_entries_of
from .torchzip.specs import NewTensor
from .torchzip.trees import walk_tensors
from .torchzip.zipfmt import crc32_combine
from .crc32 import crc32, crc32_of_views

#: the piece in which bytes are read again for their CRC-32 alone (beside a kernel copy, or those no read of the
#: run covered): small enough to stay in the CPU's cache between the read and the CRC
CRC_PIECE_BYTES = 256 * 2**10
#: the buffer in which a thread gathers the short views of a scatter read for one CRC-32 call
CRC_STAGE_BYTES = 64 * 2**10


# ================================================================================================ planning
def entries_touching(entries: dict[str, Sequence[ZipEntry]], ranges: Iterable) -> list[ZipEntry]:
    """The members (``entries``: per path, sorted by offset) that the stored ranges read bytes of, in
    (path, offset) order, each once."""
    return crc_members(entries, ((r.path, r.offset, r.nbytes) for r in ranges if isinstance(r, StoredRange)))[0]


def plan_reads(plan: Plan) -> Iterator[tuple[str, int, int]]:
    """Every ``(path, offset, nbytes)`` of the source that a run of ``plan`` reads: its tensors' stored ranges
    (a merge's factors too), the storages its torch files copy, the files it copies whole, and the copies its
    range checks compare with those (the first copy of each check is one the writers read). Metadata only."""
    def spans(ranges) -> Iterator[tuple[str, int, int]]:
        for r in ranges:
            if isinstance(r, StoredRange):
                yield r.path, r.offset, r.nbytes

    for f in plan.files:
        if isinstance(f, WeightsFile):
            for t in f.tensors:
                yield from spans(t.ranges)
                for x in getattr(t, "factors", ()):  # a merge's
                    yield from spans(x.ranges)
                for _, ranges in getattr(t, "terms", ()):  # an average's
                    yield from spans(ranges)
        elif isinstance(f, TreeFile):
            for t in walk_tensors(f.obj, []):
                if isinstance(t, NewTensor):
                    yield from spans(t.ranges)
                    for _, ranges in getattr(t, "terms", ()):  # an average's, computed into a torch file
                        yield from spans(ranges)
                else:
                    s = t.storage.address if isinstance(t, TensorHandle) else t.storage
                    yield s.path, s.data_offset, s.nbytes
        elif isinstance(f, DistcpFile):
            for it in f.items:
                if it.is_tensor:
                    yield from spans(it.value.ranges)
        elif isinstance(f, CopyFile):
            yield f.source, 0, f.write_bytes
    for c in plan.checks:
        yield from spans(c.b)


def crc_members(entries: dict[str, Sequence[ZipEntry]], reads: Iterable[tuple[str, int, int]]
                ) -> tuple[list[ZipEntry], int, int, list[str]]:
    """``(members, unread, partial, without)`` for the ``(path, offset, nbytes)`` spans ``reads``: the members
    of ``entries`` (per path, sorted by offset) they read bytes of, in (path, offset) order; the bytes of those
    members no span reads, in how many members; and the paths read that have no members (no CRC-32 recorded).
    Memory: the spans, grouped by path."""
    by_path: dict[str, list] = defaultdict(list)
    for path, offset, n in reads:
        if n > 0:
            by_path[path].append((offset, offset + n))
    found: list[ZipEntry] = []
    unread = partial = 0
    without = []
    for path, spans in by_path.items():
        es = entries.get(path)
        if not es:
            without.append(path)
            continue
        spans.sort()
        merged = [list(spans[0])]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        starts = [a for a, _ in merged]
        for e in es:
            lo, hi = e.offset, e.offset + e.size
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            covered = 0
            while i < len(merged) and merged[i][0] < hi:
                covered += max(0, min(hi, merged[i][1]) - max(lo, merged[i][0]))
                i += 1
            if covered:  # (an empty member has nothing to check)
                found.append(e)
                if covered < e.size:
                    unread += e.size - covered
                    partial += 1
    found.sort(key=lambda e: (e.path, e.offset))
    return found, unread, partial, sorted(without)


def attach_crc(plan: Plan, entries: Optional[dict[str, Sequence[ZipEntry]]]) -> Plan:
    """Set the plan's CRC-32 checks from its own reads (:func:`plan_reads`): the members it checks as it reads
    them (``plan.crc``), the bytes of them it reads for that alone (``crc_unread``, ``crc_partial``) and the
    files it reads tensor bytes from that record no CRC-32 (``crc_none``). ``entries``: the checkpoint's zip
    members per file (``Checkpoint.zip_entries()``); a file the plan copies whole that is not among them has
    its zip directory read here (a torch file beside the tag folder). ``None``: the run checks no CRC-32
    (``--no-verify-crc``). Reads zip directories only. Returns ``plan``."""
    if entries is None:
        plan.crc, plan.crc_unread, plan.crc_partial, plan.crc_none, plan.crc_off = [], 0, 0, [], True
        return plan
    entries = dict(entries)
    copies = [f.source for f in plan.files if isinstance(f, CopyFile)]
    for path in copies:
        if path not in entries:
            entries[path] = zip_entries_of(path)
    members, unread, partial, without = crc_members(entries, plan_reads(plan))
    plan.crc, plan.crc_unread, plan.crc_partial, plan.crc_off = members, unread, partial, False
    plan.crc_none = [p for p in without if p not in copies]  # a copied text or safetensors file holds no tensor bytes
    return plan


# ================================================================================================ a pass of its own
def verify_entries(entries: Sequence[ZipEntry], files: SourceFiles, chunk_bytes: int = 16 * 2**20,
                   progress: Callable[[int], None] = lambda n: None, cancel: Any = None) -> list[tuple[ZipEntry, int]]:
    """``[(member, the CRC-32 of its bytes now)]`` for every member whose bytes do not match the CRC-32 its
    file records. Memory: one buffer of ``chunk_bytes``."""
    buf = bytearray(max(4096, min(chunk_bytes, max((e.size for e in entries), default=0))))
    view = memoryview(buf)
    bad = []
    for e in entries:
        crc = _crc_of(files, e.path, e.offset, e.size, view, cancel, progress)
        if crc != e.crc:
            bad.append((e, crc))
    return bad


def _crc_of(files: SourceFiles, path: str, offset: int, nbytes: int, view: memoryview, cancel: Any = None,
            progress: Callable[[int], None] = lambda n: None) -> int:
    """The CRC-32 of ``nbytes`` of ``path`` from ``offset``, read through ``view``."""
    crc, pos = 0, 0
    while pos < nbytes:
        check_cancel(cancel)
        n = min(len(view), nbytes - pos)
        SourceFiles.read_into(files, path, offset + pos, view[:n])  # not noted in a ledger: this is the check
        crc = crc32(view[:n], crc)
        pos += n
        progress(n)
    return crc


def describe_mismatch(e: ZipEntry, got: int) -> str:
    """One sentence for a member whose bytes changed."""
    return (f"zip entry {e.name} ({e.size:,} bytes) has CRC-32 {got:08x}, the file records {e.crc:08x}: its bytes "
            "changed after it was saved (bit rot, a bad copy or a damaged disk)")


# ================================================================================================ as the run reads
class CrcLedger:
    """The CRC-32 of every span a run reads from the members it checks (``members``: ZipEntry), noted by the
    threads that read them, in any order, from any number of threads (:meth:`record`), or handed over by
    writing processes (:attr:`spans`, :meth:`add`); :meth:`verify` then checks each member.

    Memory: one small list per stretch of a member a thread reads in order (a gap, another member or another
    thread's read between starts the next); per reading thread, :data:`CRC_STAGE_BYTES` in which the short views
    of a scatter read are gathered for their CRC-32 (:func:`~ckptlib.io.crc32.crc32_of_views`)."""

    def __init__(self, members: Sequence[ZipEntry]):
        self._files: dict[str, tuple[list, list]] = {}
        for e in sorted(members, key=lambda e: (e.path, e.offset)):
            starts, es = self._files.setdefault(e.path, ([], []))
            starts.append(e.offset)
            es.append(e)
        self.spans: list = []  # [path, member index, offset, nbytes, CRC-32]; list.append is atomic
        self._open = threading.local()  # per thread: (path, member index) -> its span that the next read may extend

    def tracks(self, path: str) -> bool:
        """Whether bytes of ``path`` are checked."""
        return path in self._files

    def _stage(self) -> memoryview:
        """This thread's buffer (:data:`CRC_STAGE_BYTES`) in which short views are gathered for their CRC-32."""
        stage = getattr(self._open, "stage", None)
        if stage is None:
            stage = self._open.stage = memoryview(bytearray(CRC_STAGE_BYTES))
        return stage

    def parts(self, path: str, offset: int, nbytes: int) -> Iterator[tuple[int, int, int]]:
        """``(member index, start, end)`` of each checked member's bytes in ``nbytes`` of ``path`` from ``offset``
        (none for a file not checked; a whole file copied holds headers between its members)."""
        known = self._files.get(path)
        if known is None:
            return
        starts, es = known
        i = max(0, bisect.bisect_right(starts, offset) - 1)
        while i < len(es) and es[i].offset < offset + nbytes:
            lo, hi = max(offset, es[i].offset), min(offset + nbytes, es[i].offset + es[i].size)
            if lo < hi:
                yield i, lo, hi
            i += 1

    def record(self, path: str, offset: int, views: Sequence[memoryview], alone: bool = False) -> Optional[int]:
        """Note the span of ``path`` from ``offset`` just read into ``views`` (in file order). Where it continues
        the span this thread noted last in the same member, that one grows (``zlib.crc32`` goes on from its
        value: no joining later, one entry per stretch a thread reads in order). With ``alone`` it is noted on
        its own and its CRC-32 returned, when it lies inside one checked member (else None: not checked, or
        across members, each member's part noted apart)."""
        if path not in self._files:
            return None
        n = sum(v.nbytes for v in views)
        opened = getattr(self._open, "spans", None)
        if opened is None:
            opened = self._open.spans = {}
        whole = None
        for i, lo, hi in self.parts(path, offset, n):
            inside = (lo, hi) == (offset, offset + n)
            last = None if alone else opened.get((path, i))
            span = last if last is not None and last[2] + last[3] == lo else None
            crc = crc32_of_views(views if inside else _cut(views, lo - offset, hi - offset),
                                 span[4] if span is not None else 0, self._stage())
            if span is not None:
                span[3] += hi - lo
                span[4] = crc
            else:
                span = [path, i, lo, hi - lo, crc]
                self.spans.append(span)
                opened[(path, i)] = span
            whole = crc if inside and alone else None
        return whole

    def note(self, path: str, index: int, offset: int, nbytes: int, crc: int) -> None:
        """Note a span of member ``index`` of ``path`` whose CRC-32 was computed elsewhere."""
        self.spans.append([path, index, offset, nbytes, crc])

    def add(self, spans: Iterable[tuple]) -> None:
        """Spans another process noted (its ledger's :attr:`spans`)."""
        self.spans.extend(spans)

    def verify(self, files: SourceFiles, cancel: Any = None) -> list[tuple]:
        """Check every member: ``[(member, CRC-32 found, why)]`` for those that do not match (``why``:
        ``"changed"``, its bytes differ from what was saved; ``"reread"``, two reads of the same bytes differ).
        The bytes of a member no span covered are read here, through a buffer of :data:`CRC_PIECE_BYTES`.
        Time: one :func:`crc32_combine` per span and per stretch read here."""
        grouped: dict = defaultdict(list)
        for path, i, offset, n, crc in self.spans:
            grouped[(path, i)].append((offset, n, crc))
        view = memoryview(bytearray(CRC_PIECE_BYTES))
        bad = []
        for path, (_, es) in self._files.items():
            for i, e in enumerate(es):
                check_cancel(cancel)
                got, agree = _member_crc(e, sorted(grouped.get((path, i), ()), key=lambda s: (s[0], -s[1])), files,
                                         view, cancel)
                if not agree:
                    bad.append((e, got, "reread"))
                elif got != e.crc:
                    bad.append((e, got, "changed"))
        return bad


def _cut(views: Sequence[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Bytes ``[lo, hi)`` of the concatenation of ``views``, as views."""
    out, pos = [], 0
    for v in views:
        a, b = max(lo, pos), min(hi, pos + v.nbytes)
        if a < b:
            out.append(v[a - pos:b - pos])
        pos += v.nbytes
    return out


def _member_crc(e: ZipEntry, spans: list, files: SourceFiles, view: memoryview, cancel: Any) -> tuple[int, bool]:
    """``(the CRC-32 of member e, whether every span agrees)`` from its spans (sorted by offset, longest first):
    a chain of spans from its first byte to its last, the bytes between them read here; every other span (a
    second read of the same bytes) is compared with the chain where its ends are the chain's, else read again."""
    end = e.offset + e.size
    pos, crc = e.offset, 0
    at = {pos: 0}  # chain boundary -> the CRC-32 of the member's bytes before it
    others = []
    for offset, n, c in spans:
        if offset < pos:
            others.append((offset, n, c))
            continue
        if offset > pos:  # bytes no span covered
            crc = crc32_combine(crc, _crc_of(files, e.path, pos, offset - pos, view, cancel), offset - pos)
            at[offset] = crc
        crc = crc32_combine(crc, c, n)
        pos = offset + n
        at[pos] = crc
    if pos < end:
        crc = crc32_combine(crc, _crc_of(files, e.path, pos, end - pos, view, cancel), end - pos)
    for offset, n, c in others:
        if offset in at and offset + n in at:
            same = crc32_combine(at[offset], c, n) == at[offset + n]
        else:
            same = _crc_of(files, e.path, offset, n, view, cancel) == c
        if not same:
            return crc, False
    return crc, True


class CrcSourceFiles(SourceFiles):
    """A :class:`~ckptlib.io.sources.SourceFiles` that notes the CRC-32 of every span it reads from the members
    a :class:`CrcLedger` checks, in the reading thread. :meth:`tracks` tells the writers which files are checked:
    bytes they copy inside the kernel (no buffer holds them) are read again for it beside the copy
    (:meth:`crc_span`, in the read-ahead thread); :meth:`read_gather_crc` also gives each span's CRC-32 (a writer
    joins them into its output member's instead of computing that again)."""

    def __init__(self, ledger: CrcLedger, stats=None, drop: bool = True):
        super().__init__(stats, drop)
        self.ledger = ledger

    def tracks(self, path: str) -> bool:
        return self.ledger.tracks(path)

    def crc_span(self, path: str, offset: int, nbytes: int, buf: memoryview) -> None:
        """Note the CRC-32 of ``nbytes`` of ``path`` from ``offset`` that a copy inside the kernel moves (no buffer
        of the copy holds them): read again from the page cache through ``buf``, small enough to stay in the CPU's
        cache between the read and the CRC (:data:`CRC_PIECE_BYTES`)."""
        fd = self.fd(path)
        pos, end = offset, offset + nbytes
        while pos < end:
            n = os.preadv(fd, [buf[:min(buf.nbytes, end - pos)]], pos)
            if n <= 0:
                raise IncompleteCheckpointError("unexpected end of file (the file shrank or is truncated)",
                                                path=path, hint="copy the file again or use another tag")
            self.ledger.record(path, pos, [buf[:n]])
            pos += n

    def read_into(self, path: str, offset: int, target: memoryview) -> None:
        super().read_into(path, offset, target)
        self.ledger.record(path, offset, [target])

    def read_scattered(self, path: str, offset: int, targets: list, alone: bool = False) -> Optional[int]:
        """:meth:`~ckptlib.io.sources.SourceFiles.read_scattered`, the CRC-32 noted; a long read of a checked file
        goes :data:`HOT_BYTES` at a time, each piece noted as soon as it is read (with ``alone``, whole: its CRC-32
        is returned, see :meth:`CrcLedger.record`)."""
        if alone or not self.ledger.tracks(path) or sum(v.nbytes for v in targets) <= HOT_BYTES:
            super().read_scattered(path, offset, targets)
            return self.ledger.record(path, offset, targets, alone)
        for piece, nbytes in _pieces(targets, HOT_BYTES):  # each piece's CRC-32 taken while it is in the cache
            super().read_scattered(path, offset, piece)
            self.ledger.record(path, offset, piece)
            offset += nbytes
        return None

    def read_gather(self, gather: Sequence, out: memoryview, drop: bool = False) -> list[tuple[str, int, int]]:
        return [s[:3] for s in self.read_gather_crc(gather, out, drop)]

    def read_gather_crc(self, gather: Sequence, out: memoryview, drop: bool = False, alone: bool = False
                        ) -> list[tuple]:
        """:meth:`~ckptlib.io.sources.SourceFiles.read_gather`, each span as ``(path, offset, nbytes, CRC-32 or
        None, where it starts in out or None)``: with ``alone``, the span's own CRC-32 where it lies in one checked
        member (for :func:`joined_crc`), the start where its bytes lie back to back in ``out``."""
        runs: dict[str, list] = {}  # path -> [[file offset, end, [buffers], start in out or None], ...]
        pos = 0
        for r in gather:
            end = pos + r.nbytes
            mine = runs.setdefault(r.path, [])
            if mine and mine[-1][1] == r.offset:
                last = mine[-1]
                if last[3] is not None and last[3] + (last[1] - last[0]) != pos:
                    last[3] = None  # another file's bytes lie between its pieces in out
                last[1] += end - pos
                last[2].append(out[pos:end])
            else:
                mine.append([r.offset, r.offset + end - pos, [out[pos:end]], pos])
            pos = end
        spans = []
        for path, mine in runs.items():
            for start, end, views, at in mine:
                crc = self.read_scattered(path, start, views, alone)
                spans.append((path, start, end - start, crc, at))
                if drop:
                    self.drop_cache(path, start, end - start)
        return spans


#: a long read whose CRC-32 is taken is read in pieces of this size, each taken as soon as it is read (it is still in
#: the core's cache then; a 16 MiB chunk read whole is not, and its CRC-32 reads memory again beside a busy writer)
HOT_BYTES = 2**20


def _pieces(views: Sequence[memoryview], size: int) -> Iterator[tuple[list, int]]:
    """``views`` cut into lists of views of ``size`` bytes each (the last shorter), in order, a long view cut where
    needed; each with its byte count."""
    piece, fill = [], 0
    for v in views:
        v = v if v.format == "B" else v.cast("B")
        while v.nbytes:
            n = min(v.nbytes, size - fill)
            piece.append(v[:n])
            v, fill = v[n:], fill + n
            if fill == size:
                yield piece, fill
                piece, fill = [], 0
    if piece:
        yield piece, fill


def joined_crc(spans: Sequence[tuple], out: memoryview) -> int:
    """The CRC-32 of ``out`` (filled by :meth:`CrcSourceFiles.read_gather_crc` giving ``spans``): the spans'
    own joined in their order in ``out`` where each has one and lies back to back there; else computed."""
    if not spans or any(s[3] is None or s[4] is None for s in spans):
        return crc32(out)
    crc = 0
    for s in sorted(spans, key=lambda s: s[4]):
        crc = crc32_combine(crc, s[3], s[2])
    return crc


def source_files(ledger: Optional[CrcLedger], drop: bool = True) -> SourceFiles:
    """The run's reader: noting CRC-32s in ``ledger``, or a plain one."""
    return CrcSourceFiles(ledger, drop=drop) if ledger is not None else SourceFiles(drop=drop)


__all__ = ["entries_touching", "plan_reads", "crc_members", "attach_crc", "verify_entries", "describe_mismatch",
           "CrcLedger", "CrcSourceFiles", "joined_crc", "source_files", "CRC_PIECE_BYTES"]
