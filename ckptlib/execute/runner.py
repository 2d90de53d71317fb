"""The one runner: executes any plan (export, reshard, universal) into an atomic output folder.

:func:`run` checks that the source is unchanged since the plan was made, watches the process's memory,
compares the copies the plan says must be equal (in a thread beside the writing), writes the plan's files into a hidden temporary sibling of the output folder (with the plan's
``workers`` as threads, or as processes that each receive the pickled plan), checks the CRC-32 of every zip
member of the source it read (``plan.crc``: computed as the bytes streamed, :mod:`ckptlib.io.crc`), then writes
its text finals (``latest`` last), and renames the folder into place; any failure, a mismatch or a cancel
leaves nothing behind.
Progress goes to an :class:`~ckptlib.progress.Observer`; every run returns a :class:`RunResult` with
its :class:`~ckptlib.system.memory.MemoryReport`. Buffers are released when the run ends.

Memory: ``plan.predicted_peak_bytes`` per writing process, whatever the model size.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import Cancelled, IncompleteCheckpointError
from ..io.crc import CrcLedger, describe_mismatch, source_files, verify_entries
from ..layout.ranges import slice_ranges
from ..io.output import AtomicOutputDir, reporting_failures
from ..io.sources import SourceFiles, check_unchanged
from ..io.streaming import first_differences, load_cast_kernels
from ..io.threads import thread_room
from ..plan import PROCESSES, Plan
from ..progress import Observer, check_cancel, progress_to
from ..system.allocation import translating_allocation_failures
from ..system.memory import MemoryReport, watch_memory
from .writers import (Unit, WriteContext, drops_source_pages, drops_written_pages, needs_cast_kernels, prepare,
                      units, unsynced_budget, write_finals, write_unit)


@dataclass
class RunResult:
    """What a run produced: the output folder, every file written with its bytes (in plan order, the text
    finals last), time, bytes read from the source and written, and the run's memory."""

    action: str
    out: Path
    files: list
    seconds: float
    bytes_read: int
    bytes_written: int
    memory: Optional[MemoryReport] = None
    plan: Optional[Plan] = field(default=None, repr=False)

    def describe(self) -> str:
        from ..units import human_bytes

        text = (f"wrote {len(self.files)} file{'s' if len(self.files) != 1 else ''}, {self.bytes_written:,} bytes "
                f"to {self.out} in {self.seconds:.1f} s (read {self.bytes_read:,} bytes)")
        if self.memory is not None:
            text += f"; peak memory +{human_bytes(self.memory.peak_added)} over the start"
        return text


class AnyOf:
    """Set when any of the events is (the user's cancel, or a failure in another writing thread)."""

    def __init__(self, *events):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)


def run(plan: Plan, observer: Optional[Observer] = None, cancel: Any = None) -> RunResult:
    """Execute ``plan``: write its output folder atomically and return what was done.

    Args:
        plan: a plan from :func:`ckptlib.plan_export`, :func:`ckptlib.plan_reshard` or
            :func:`ckptlib.plan_universal` (or one made or edited by hand: it is plain data).
        observer: receives progress (:class:`~ckptlib.progress.Observer`).
        cancel: a ``threading.Event``; setting it stops the run at the next chunk (it then raises
            :class:`~ckptlib.errors.Cancelled` and leaves nothing behind).

    Memory: ``plan.predicted_peak_bytes`` per writing process. The source is only read.
    """
    observer = observer or Observer()
    t0 = time.perf_counter()
    with watch_memory() as watch:
        observer.on_start(plan)
        with reporting_failures(plan.out, observer), translating_allocation_failures(plan, plan.out):
            check_unchanged(plan.source.stamps)
            if needs_cast_kernels(plan):  # numpy, loaded (or refused for want of memory) before anything is written
                load_cast_kernels()
            verify_source_crcs(plan, cancel, inline=True)
            ledger = CrcLedger(plan.crc) if plan.crc else None  # the CRC-32s noted as the bytes stream
            checks = CopiesCheck(plan, cancel, ledger)
            try:
                with AtomicOutputDir(plan.out, source=plan.source.save_dir, overwrite=plan.overwrite,
                                     sync=plan.sync) as tmp:
                    prepare(plan, tmp)
                    stop = AnyOf(cancel, checks.failed)  # a difference found stops the writing too
                    try:
                        if plan.parallel == PROCESSES and plan.workers > 1:
                            from .processes import write_in_processes  # multiprocessing, only for worker processes

                            read = write_in_processes(plan, tmp, observer, stop, ledger)
                        else:
                            read = write_in_threads(plan, units(plan), tmp, observer, stop, plan.workers,
                                                    ledger=ledger)
                    except Cancelled:
                        checks.result()  # when a difference stopped the writing, that is the error
                        raise
                    checks.result()  # before anything is put in place
                    read += check_crcs(plan, ledger, cancel)
                    write_finals(plan, tmp)
                    check_cancel(cancel)
            finally:
                checks.close()
    result = finished(plan, time.perf_counter() - t0, read, watch.report)
    observer.on_finish(result)
    return result


def verify_source_crcs(plan: Plan, cancel: Any = None, inline: bool = False) -> None:
    """Check the CRC-32 of the source's zip members the plan lists (``plan.crc``) in a pass of their own, before
    anything is written: what a run does where its writers cannot check them as they read (a distributed run,
    whose ranks each read a share). ``inline``: the caller checks them as the bytes stream (:func:`check_crcs`):
    nothing to do here.

    Raises:
        IncompleteCheckpointError: naming every file and member whose bytes changed since they were saved.
    """
    if not plan.crc or inline:
        return
    with SourceFiles() as files:
        bad = verify_entries(plan.crc, files, plan.chunk_bytes, cancel=cancel)
    if bad:
        raise crc_error(plan, [(e, got, "changed") for e, got in bad])


def check_crcs(plan: Plan, ledger: Optional[CrcLedger], cancel: Any = None) -> int:
    """Once the output is written, before it is put in place: every member's CRC-32 from the spans the run read
    (:meth:`~ckptlib.io.crc.CrcLedger.verify`; the bytes of a member it read only in part are read here).
    Returns the bytes read for it.

    Raises:
        IncompleteCheckpointError: naming every file and member whose bytes do not match.
    """
    if ledger is None:
        return 0
    with SourceFiles() as files:
        bad = ledger.verify(files, cancel)
    if bad:
        raise crc_error(plan, bad)
    return files.stats.bytes_read


def crc_error(plan: Plan, bad: list) -> IncompleteCheckpointError:
    """One error for the members whose bytes do not match their CRC-32 (``(member, CRC-32 found, why)``): the
    file (or, for several, the tag folder) as its path, each file and member named."""
    paths = list(dict.fromkeys(e.path for e, _, _ in bad))
    if all(why == "reread" for _, _, why in bad):
        return IncompleteCheckpointError(
            "the source changed while it was read: two reads of the same bytes differ in " + "; ".join(
                f"{Path(e.path).name}: zip entry {e.name}" for e, _, _ in bad),
            path=paths[0] if len(paths) == 1 else plan.source.tag_dir,
            hint="make sure nothing writes to the checkpoint and run again; nothing was written")
    parts = [(f"{Path(e.path).name}: " if len(paths) > 1 else "") + describe_mismatch(e, got)
             for e, got, why in bad if why == "changed"]
    return IncompleteCheckpointError(
        "the CRC-32 of the source does not match: " + "; ".join(parts), path=paths[0] if len(paths) == 1 else
        plan.source.tag_dir, hint=f"restore {'the file' if len(paths) == 1 else 'the files named'} from a copy (the "
        "original, a backup), or use another tag; nothing was written")


#: the copies check beside the writing reads in pieces of this size: its two buffers are within the run's
#: fixed allowance (``FIXED_OVERHEAD_BYTES``), not more chunks, and stay in the cache while compared
CHECK_PIECE_BYTES = 2**20


class CopiesCheck:
    """The plan's range checks (:func:`compare_copies`) in a thread of their own, beside the writing. A
    difference sets ``failed`` (the writing stops at its next chunk) and :meth:`result` raises it before the
    output is put in place, so the run ends as if the check had come first: one message, nothing written.
    Without room for a thread (:func:`~ckptlib.io.threads.thread_room`) the checks run here, first.

    Memory: a thread and two pieces of :data:`CHECK_PIECE_BYTES`."""

    def __init__(self, plan: Plan, cancel: Any = None, ledger: Optional[CrcLedger] = None):
        self.failed, self._stop = threading.Event(), threading.Event()
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if not plan.checks:
            return
        try:
            thread_room()
        except MemoryError:
            compare_copies(plan, cancel, ledger=ledger)
            return
        self._thread = threading.Thread(target=self._check, args=(plan, AnyOf(cancel, self._stop), ledger),
                                        name="ckptlib-check", daemon=True)
        self._thread.start()

    def _check(self, plan: Plan, cancel: Any, ledger: Optional[CrcLedger]) -> None:
        try:
            compare_copies(plan, cancel, CHECK_PIECE_BYTES, ledger)
        except BaseException as e:  # raised in the run's thread by result()
            self._error = e
            self.failed.set()

    def result(self) -> None:
        """Wait for the checks; raise what they found."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the checks (at their next piece) and wait for them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def compared_spans(plan: Plan) -> list[tuple[str, int, int]]:
    """The ``(path, offset, nbytes)`` of every stored range the plan's range checks read."""
    return [(r.path, r.offset, r.nbytes) for c in plan.checks for r in (*c.a, *c.b) if hasattr(r, "path")]


def compare_copies(plan: Plan, cancel: Any = None, chunk_bytes: Optional[int] = None,
                   ledger: Optional[CrcLedger] = None) -> None:
    """Run the plan's range checks (copies that must be equal), reading ``chunk_bytes`` of each copy at a
    time (the plan's chunk by default). The CRC-32s of the copies compared with the first one are noted in
    ``ledger`` as they are read (their members are checked whole, and the run's writers do not read them); the
    first copy is what the writers read and check.

    Raises:
        IncompleteCheckpointError: two copies differ (naming them and the first element that differs).
    """
    if not plan.checks:
        return
    groups: dict = {}  # (first copy, dtype) -> its checks: a tensor on several ranks is read once for all
    for c in plan.checks:
        groups.setdefault((c.a, c.dtype), []).append(c)
    with source_files(ledger) as files, SourceFiles() as first:
        for (a, dtype), group in groups.items():
            found = first_differences(a, [c.b for c in group], dtype, files, chunk_bytes or plan.chunk_bytes, cancel,
                                      first)
            c, at = next(((c, at) for c, at in zip(group, found) if at is not None), (None, None))
            if c is not None:
                proof = " master" in c.what  # a value proof (ZeRO-0's unnamed optimizer entries)
                files = [f for f in (_file_at(c.a, at), _file_at(c.b, at)) if f]
                where = f" ({' and '.join(dict.fromkeys(files))})" if files else ""
                raise IncompleteCheckpointError(
                    f"{c.what}{where} differ (first at element {at})" + (
                        ": the optimizer entry is not this parameter, and which one it is cannot be proven; nothing "
                        "was written" if proof else " although the checkpoint says they are one tensor stored on "
                        "several ranks; ckptlib does not pick one"), path=plan.source.tag_dir,
                    hint="a file is damaged or from another run: restore it from a copy" if not proof else
                    "re-save the checkpoint with ZeRO-1 or later (which records names), or report it")


def _file_at(ranges, element: int) -> str:
    """The name of the file holding element ``element`` of a tensor stored as ``ranges`` ("" in zeros)."""
    held = slice_ranges(ranges, element, 1)
    return Path(held[0].path).name if held and hasattr(held[0], "path") else ""


def finished(plan: Plan, seconds: float, read: int, memory: Optional[MemoryReport]) -> RunResult:
    files = [(f.name, f.size if f.size is not None else f.write_bytes) for f in plan.files] + \
        [(f.name, f.size) for f in plan.finals]
    return RunResult(action=plan.action, out=plan.out, files=files, seconds=seconds, bytes_read=read,
                     bytes_written=sum(n for _, n in files), memory=memory, plan=plan)


def write_in_threads(plan: Plan, work: list[Unit], tmp: Path, observer: Observer, cancel: Any,
                     threads: int = 1, progress: Optional[Callable[[int], None]] = None,
                     processes_on_machine: int = 1, ledger: Optional[CrcLedger] = None) -> int:
    """Write ``work`` with ``threads`` writing threads (the calling thread when 1: in plan order; else
    largest first). The first failure stops the other threads at their next chunk and is raised.
    ``processes_on_machine`` (writing processes sharing this machine's page cache) divides what a run
    that does not sync leaves to the kernel; ``ledger`` notes the CRC-32s of what is read. Returns the bytes
    read from the source."""
    failed = threading.Event()
    files = source_files(ledger, drop=drops_source_pages(plan))
    files.keep_cached(compared_spans(plan))  # the copies compared beside the writing are read there too
    ctx = WriteContext(plan.chunk_bytes, files, progress or progress_to(observer, plan.write_bytes),
                       AnyOf(cancel, failed), observer, unsynced_budget(plan, processes_on_machine),
                       drops_written_pages(plan))
    try:
        if threads <= 1 or len(work) <= 1:
            for u in work:
                write_unit(plan, u, tmp, ctx)
            return files.stats.bytes_read
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for u in sorted(work, key=lambda u: -u.nbytes):
            todo.put(u)
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                while not failed.is_set():
                    try:
                        u = todo.get_nowait()
                    except queue.Empty:
                        return
                    write_unit(plan, u, tmp, ctx)
            except BaseException as e:  # the first failure is the one raised
                errors.append(e)
                failed.set()

        pool = [threading.Thread(target=worker, name=f"ckptlib-write-{i}", daemon=True)
                for i in range(min(threads, len(work)))]
        for t in pool:
            t.start()
        try:
            for t in pool:
                t.join()
        finally:  # also when this thread is interrupted (Ctrl-C, SIGTERM): the buffers outlive the writers
            failed.set()
            for t in pool:
                t.join()
        if errors:
            raise errors[0]
        return files.stats.bytes_read
    finally:
        ctx.close()
        files.close()


__all__ = ["RunResult", "run", "write_in_threads", "progress_to", "finished", "AnyOf", "verify_source_crcs",
           "check_crcs", "crc_error"]
