"""Running a plan under ``torchrun``: every rank writes a disjoint share of the files, rank 0 finishes.

Any plan runs this way (export, reshard, universal: one runner). :func:`shared_plan` makes the plan on
rank 0 only and hands it to every rank (plans are plain data; they pickle), so the others never read
the checkpoint's metadata and all ranks write from one and the same plan. :func:`run_distributed`
then goes in three steps, each ended by a collective:

1. rank 0 checks that the source is unchanged, compares the plan's replicated copies, creates the
   hidden temporary output folder (with the plan's folders and the safetensors headers) and tells the
   others where it is;
2. every rank writes the units :func:`~ckptlib.execute.writers.assign` gives it (the plan's units
   balanced over the ranks by bytes: whole files, a safetensors file's tensors each on its own) with
   ``plan.workers`` threads when the plan writes in threads, and syncs what it wrote to disk (unless the
   plan does not sync); a rank that fails leaves a marker in the shared temporary folder, and the other
   ranks stop at their next chunk instead of writing the rest of their share for nothing;
3. once every rank has reported (a barrier: ``all_gather``), rank 0 writes the text finals and renames
   the folder into place, one atomic rename; if any rank failed, it removes the folder instead and
   every rank raises :class:`DistributedFailure`, whose message (rank 0's) names each failed rank
   and why.

A rank that dies (killed, out of memory) makes the others' collectives fail, or torchrun stops them
with SIGTERM: rank 0 then removes the temporary folder as well. Only the death of rank 0 itself
leaves a hidden temporary sibling behind (never looking finished; the next run on the same output
removes it). The output folder must be on a file system all ranks share (one machine, or NFS/Lustre
across nodes). Uses ``torch.distributed`` with whatever backend is initialised (gloo if ckptlib
initialises it, from torchrun's environment).

Memory per rank: ``plan.predicted_peak_bytes`` (the same as a single-process run of the plan), plus
the pickled plan while it is handed out.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..dtypes import import_torch
from ..errors import Cancelled, CkptError
from ..io.output import AtomicOutputDir, reporting_failures
from ..io.sources import check_unchanged
from ..io.streaming import load_cast_kernels
from ..plan import THREADS, Plan
from ..progress import Observer
from ..system.memory import watch_memory
from .runner import AnyOf, RunResult, compare_copies, finished, verify_source_crcs, write_in_threads
from .writers import Unit, assign, needs_cast_kernels, prepare, units, write_finals


def _torch_distributed():
    """``torch.distributed`` (torchrun's process group), or one line saying that torch is needed."""
    import_torch("--distributed (a run under torchrun)")
    import torch.distributed as dist

    return dist


class DistributedFailure(CkptError):
    """A distributed run (or its planning) failed on some rank; nothing was created. The message names
    the failed ranks and why (with their hints). ``everywhere``: every rank raises this same message,
    which rank 0 sent (the CLI then prints it on rank 0 only); otherwise it is this rank's own (a
    collective failed because another rank died)."""

    default_hint = None

    def __init__(self, message: str, path=None, hint=None, everywhere: bool = True):
        super().__init__(message, path=path, hint=hint)
        self.everywhere = everywhere


class Terminated(BaseException):
    """SIGTERM arrived during a distributed run (torchrun stops the other ranks when one dies)."""


STOP_MARK = ".ckptlib-stop"


class PeerStop:
    """Set once some rank of the run has failed: that rank leaves :data:`STOP_MARK` in the shared temporary
    folder (which the failed run removes in the end), and the others, checking it at every chunk (one
    ``stat``), stop writing a share that would be removed anyway."""

    def __init__(self, tmp: Path):
        self.path = tmp / STOP_MARK

    def is_set(self) -> bool:
        return os.path.exists(self.path)

    def set(self) -> None:
        with contextlib.suppress(OSError):  # best effort: the collective after the writing decides anyway
            self.path.touch()


_JOINS = itertools.count()  # process groups joined by this process (the same count on every rank)


@contextlib.contextmanager
def process_group(backend: str = "gloo") -> Iterator[None]:
    """The default process group for the block: joined here with ``backend`` from torchrun's environment
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) unless one is initialised already, and
    left at the end if it was joined here.

    Raises:
        CkptError: not started by torchrun, or the rendezvous failed.
    """
    dist = _torch_distributed()

    if dist.is_initialized():
        yield
        return
    try:
        store, rank, world = next(dist.rendezvous("env://"))
        # each joining gets its own key space in the launcher's store: after a destroy_process_group a second
        # group would otherwise find the first one's addresses there (the ranks join equally often)
        store = dist.PrefixStore(f"ckptlib-{next(_JOINS)}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    except (RuntimeError, ValueError) as e:  # no torchrun environment, or the rendezvous timed out
        raise CkptError(f"cannot join the process group of a distributed run ({str(e).splitlines()[0]})",
                        hint="start every node with torchrun (e.g. `torchrun --nproc_per_node 2 -m ckptlib reshard "
                             "... --distributed`), or leave out --distributed") from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def _describe(e: BaseException) -> str:
    """One rank's failure in a line or two (its message, not a traceback)."""
    if isinstance(e, CkptError):
        return str(e)
    if isinstance(e, Terminated):
        return "stopped by SIGTERM (torchrun stops every rank when one of them dies)"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else " the output"
        return (f"writing{where} failed ({e.strerror or e})\n  hint: check free space and permissions of the "
                "output location")
    first = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, RuntimeError) and any(w in first for w in ("gloo", "Connection", "connection", "timed out")):
        return (f"lost contact with another rank ({first[:200]})\n  hint: that rank stopped (killed, out of memory, "
                "or it failed to start): its own log says why")
    return f"{type(e).__name__}: {first}"


def shared_plan(make: Callable[[], Plan]) -> Plan:
    """The plan ``make()`` returns on rank 0, on every rank of the default process group (which must be
    initialised, e.g. by :func:`process_group`): rank 0 alone reads the checkpoint's metadata and
    broadcasts the plan, so every rank writes from the same plain data.

    If ``make`` fails on rank 0, rank 0 raises that error and the other ranks raise
    :class:`DistributedFailure` with its message.

    Memory: the plan on every rank (and its pickled bytes while it is broadcast; kilobytes for the
    1 GB benchmark checkpoints).
    """
    dist = _torch_distributed()

    box: list = [None]
    failure: Optional[BaseException] = None
    if dist.get_rank() == 0:
        try:
            box = [("ok", make())]
        except BaseException as e:  # tell the others before raising
            failure = e
            box = [("error", f"rank 0 could not plan the run: {_describe(e)}")]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0][0] == "error":
        raise DistributedFailure(box[0][1])
    return box[0][1]


class _SigtermRaises:
    """While active (a context manager), SIGTERM raises :class:`Terminated` in the main thread (so that
    cleanup runs), until :meth:`quiet` is called: a rank already cleaning up after a failure must not be
    interrupted half-way by the SIGTERM torchrun sends when another rank died. The previous handler is
    restored on exit. Does nothing outside the main thread."""

    def __init__(self):
        self.quieted = False
        self._previous = None
        self._main = threading.current_thread() is threading.main_thread()

    def quiet(self) -> None:
        """From now on a SIGTERM is ignored (the run is already failing)."""
        self.quieted = True

    def _handler(self, signum, frame):
        if not self.quieted:
            self.quieted = True  # once: the cleanup this starts is not interrupted again
            raise Terminated()

    def __enter__(self) -> "_SigtermRaises":
        if self._main:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._main:
            signal.signal(signal.SIGTERM, self._previous)


def _sync_files(plan: Plan, work: list[Unit], tmp: Path) -> None:
    """fsync the files this rank wrote into (another node's rank 0 cannot flush them for it)."""
    for i in sorted({u.file for u in work}):
        fd = os.open(tmp / plan.files[i].name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _scaled_progress(observer: Observer, share: int, total: int) -> Callable[[int], None]:
    """Rank 0's progress through its own share, reported as a part of the whole plan (the shares are
    balanced by bytes, so rank 0 is about as far as the others)."""
    done = [0]
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            done[0] += n
            observer.on_bytes(min(total, done[0] * total // max(share, 1)), total)

    return progress


def run_distributed(plan: Plan, observer: Optional[Observer] = None, cancel: Any = None) -> RunResult:
    """Execute ``plan`` cooperatively on all ranks of the default process group (joined here from
    torchrun's environment if needed; see the module docstring for the steps). Every rank must call it
    with the same plan (:func:`shared_plan` makes sure). Returns the result on every rank
    (``bytes_read`` summed over the ranks; ``memory`` is this rank's); ``observer`` is used on rank 0
    only.

    Raises:
        DistributedFailure: on every rank, if any rank failed; the output folder was not created.

    Memory per rank: ``plan.predicted_peak_bytes`` (``plan.workers`` writing threads per rank when the
    plan writes in threads, else one), whatever the model size.
    """
    dist = _torch_distributed()

    with process_group(), _SigtermRaises() as sigterm:
        rank, world = dist.get_rank(), dist.get_world_size()
        observer = observer if (observer is not None and rank == 0) else Observer()
        t0 = time.perf_counter()
        atomic: Optional[AtomicOutputDir] = None

        def stop(e: BaseException) -> BaseException:
            """The run failed with ``e`` on this rank (SIGTERM already quiet): remove the output (rank 0) and say so;
            what to raise."""
            nonlocal atomic
            if atomic is not None:  # rank 0, before the folder was committed or removed: remove it
                atomic, a = None, atomic
                a.__exit__(type(e), e, None)
            observer.on_error(e)
            if isinstance(e, (Terminated, RuntimeError)) and not isinstance(e, CkptError):
                why, hint = _joined([_describe(e)])
                return DistributedFailure(f"distributed {plan.action} stopped on rank {rank}, the output folder was "
                                          f"not created: {why}", path=plan.out, hint=hint, everywhere=False)
            return e

        try:
            try:
                with watch_memory() as watch:
                    observer.on_start(plan)
                    tmp, atomic = _prepare_on_rank0(plan, rank)
                    mine = assign(units(plan, split=True), world)[rank]
                    error, read = None, 0
                    peer = PeerStop(tmp)
                    try:
                        if needs_cast_kernels(plan):  # as in a single run: numpy loaded (or refused) before writing
                            load_cast_kernels()
                        threads = plan.workers if plan.parallel == THREADS else 1
                        progress = _scaled_progress(observer, sum(u.nbytes for u in mine), plan.write_bytes)
                        read = write_in_threads(plan, mine, tmp, observer, AnyOf(cancel, peer), threads, progress,
                                                int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                        if rank != 0 and plan.sync:
                            _sync_files(plan, mine, tmp)
                    except BaseException as e:  # reported to every rank below
                        if isinstance(e, Cancelled) and peer.is_set() and not (cancel is not None and cancel.is_set()):
                            error = ("stopped", f"rank {rank}: stopped because another rank failed")
                        else:
                            peer.set()
                            error = ("failed", f"rank {rank}: {_describe(e)}")
                    errors: list = [None] * world
                    dist.all_gather_object(errors, error)  # the barrier: every rank has finished its share
                    failed = [m for kind, m in filter(None, errors) if kind == "failed"] or \
                        [m for _, m in filter(None, errors)]
                    final: list = [None]
                    if rank == 0:
                        final = [_finish_on_rank0(plan, atomic, tmp, failed)]
                        atomic = None
                    dist.broadcast_object_list(final, src=0)
                    if final[0] is not None:
                        why, hint = _joined([final[0]])
                        raise DistributedFailure(f"distributed {plan.action} failed, nothing was created: {why}",
                                                 path=plan.out, hint=hint)
                    reads = [0] * world
                    dist.all_gather_object(reads, read)
                    observer.on_bytes(plan.write_bytes, plan.write_bytes)
                sigterm.quiet()  # done: a SIGTERM now comes too late to matter
            except BaseException as e:
                sigterm.quiet()  # (the rank is already failing: the cleanup must not be cut short)
                raised = stop(e)
                if raised is e:
                    raise
                raise raised from None
        except Terminated as e:  # SIGTERM in the instant before quiet() above (raising it made it quiet)
            raise stop(e) from None
    result = finished(plan, time.perf_counter() - t0, sum(reads), watch.report)
    observer.on_finish(result)
    return result


def verify_distributed(plan: Plan, out: os.PathLike):
    """:func:`ckptlib.analysis.verify.verify` shared out among the ranks of the default process group: each rank
    compares every world-th tensor, rank 0 joins the results (:func:`~ckptlib.analysis.verify.merge_verifications`).
    Returns the verification on rank 0, None on the others. A rank whose share fails to run says so in a
    failed check (the others are not left waiting).

    Memory per rank: the comparer's buffers (as a single verification)."""
    dist = _torch_distributed()

    from ..analysis.verify import Check, Share, Verification, merge_verifications, verify

    with process_group():
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            part = verify(plan, out, share=Share(rank, world))
        except Exception as e:  # reported below, in the joined result
            part = Verification(out=Path(out), checks=[Check(f"rank {rank} verified its share", False, _describe(e))])
        parts: list = [None] * world
        dist.all_gather_object(parts, part)
    return merge_verifications(parts) if rank == 0 else None


def _prepare_on_rank0(plan: Plan, rank: int) -> tuple[Path, Optional[AtomicOutputDir]]:
    """Step 1: rank 0 checks the source and makes the temporary folder; every rank learns where it is.
    Returns ``(tmp, atomic)`` (``atomic`` on rank 0 only)."""
    dist = _torch_distributed()

    atomic, msg, failure = None, [None], None
    if rank == 0:
        try:
            with reporting_failures(plan.out, Observer()):  # an OSError becomes one OutputError naming the output
                check_unchanged(plan.source.stamps)
                verify_source_crcs(plan)
                compare_copies(plan)
                atomic = AtomicOutputDir(plan.out, source=plan.source.save_dir, overwrite=plan.overwrite,
                                         sync=plan.sync)
                tmp = atomic.__enter__()
                prepare(plan, tmp)
            msg = [("ok", str(tmp))]
        except BaseException as e:  # tell the others before raising
            if atomic is not None and atomic.tmp is not None:
                atomic.__exit__(type(e), e, None)
            failure = e
            msg = [("error", _describe(e))]
    dist.broadcast_object_list(msg, src=0)
    if failure is not None:
        raise failure
    if msg[0][0] == "error":
        raise DistributedFailure(f"rank 0 could not prepare the output: {msg[0][1]}", path=plan.out)
    return Path(msg[0][1]), atomic


HINT_SEP = "\n  hint: "  # how :func:`_describe` (and CkptError's str) put a hint after the message


def _joined(failures: list) -> tuple:
    """Failures described as ``message[HINT_SEP hint]``: their messages joined in one line, and the first
    hint (each message stays one line; the hint is the error's own, printed on the line after)."""
    parts = [f.split(HINT_SEP, 1) for f in failures]
    hints = [p[1] for p in parts if len(p) > 1]
    return "; ".join(p[0] for p in parts), (hints[0] if hints else None)


def _finish_on_rank0(plan: Plan, atomic: AtomicOutputDir, tmp: Path, failed: list) -> Optional[str]:
    """Step 3 on rank 0: the finals and the one rename, or removal if any rank failed. Returns None on
    success, else what went wrong (``message[HINT_SEP hint]``)."""
    try:
        if failed:
            why, hint = _joined(failed)
            atomic.__exit__(DistributedFailure, DistributedFailure(why, hint=hint), None)
            return why + (HINT_SEP + hint if hint else "")
        write_finals(plan, tmp)
        atomic.__exit__(None, None, None)
        return None
    except BaseException as e:
        if atomic.tmp is not None:
            atomic.__exit__(type(e), e, None)
        return f"rank 0: {_describe(e)}"


__all__ = ["run_distributed", "verify_distributed", "shared_plan", "process_group", "DistributedFailure", "PeerStop",
           "STOP_MARK"]
