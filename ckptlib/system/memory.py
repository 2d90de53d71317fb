"""Memory: what this process holds, what the machine has left, and the peak of a run.

- :func:`process_memory` — the process's resident memory split into *anonymous* (heap, buffers: what
  an out-of-memory kill counts) and *file-backed* (mapped files, page cache: reclaimable), from
  ``/proc/self/status`` (``RssAnon``, ``RssFile``, ``RssShmem``, ``VmHWM``); psutil where there is no
  ``/proc``.
- :func:`system_memory` — the machine's available memory (``/proc/meminfo``; psutil where there is none)
  and the cgroup limit, if any (``/sys/fs/cgroup/memory.max``, or cgroup v1's ``memory.limit_in_bytes``).
- :class:`MemorySampler` — a daemon thread that samples every ``interval`` seconds (0.2 s) into a
  bounded history (a deque) and keeps the peak.
- :func:`watch_memory` — a context manager around a piece of work: ``with watch_memory() as w: ...``,
  then ``w.report`` is a :class:`MemoryReport` (baseline, peak, peak added). Every run of a plan
  (:func:`ckptlib.run`) is inside one, so every result carries ``result.memory``.
- :func:`memory_verdict` — before a run: does the plan's predicted peak fit in what is available?
Plots of the history are in :mod:`ckptlib.ui.plots`. Nothing here imports matplotlib, or psutil at
import time.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Deque, Optional, Union

from ..units import human_bytes

PROC_STATUS = Path("/proc/self/status")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: the default sampling interval of the background sampler (seconds)
DEFAULT_INTERVAL = 0.2


# ============================================================================================ snapshots
@dataclass(frozen=True)
class ProcessMemory:
    """Resident memory of one process, in bytes.

    ``anon`` is what the process allocated (heap, tensors, buffers): the part that can get it killed.
    ``file`` is mapped file pages (code, mmapped files); the kernel can reclaim them. ``hwm`` is the
    kernel's high-water mark of ``rss`` over the process's life (0 when unknown).
    """

    rss: int
    anon: int
    file: int
    shmem: int = 0
    hwm: int = 0


@dataclass(frozen=True)
class SystemMemory:
    """The machine's memory as this process sees it, in bytes.

    ``available`` is the kernel's estimate of what can be allocated without swapping
    (``MemAvailable``). ``cgroup_limit``/``cgroup_usage`` are the container's limit and use (None
    when there is no limit); ``data_limit``/``data_used`` and ``address_limit``/``address_used`` this
    process's ``ulimit -d`` (``RLIMIT_DATA``, against ``VmData``) and ``ulimit -v`` (``RLIMIT_AS``,
    against ``VmSize``). :attr:`headroom` is what a run can still use: the smallest of them;
    :attr:`bound_by` says which one that is.
    """

    total: int
    available: int
    cgroup_limit: Optional[int] = None
    cgroup_usage: Optional[int] = None
    data_limit: Optional[int] = None
    data_used: Optional[int] = None
    address_limit: Optional[int] = None
    address_used: Optional[int] = None

    def _rooms(self) -> list[tuple[int, str]]:
        rooms = [(self.available, "available on the machine")]
        if self.cgroup_limit is not None:
            rooms.append((self.cgroup_limit - (self.cgroup_usage or 0),
                          f"left under the cgroup limit of {human_bytes(self.cgroup_limit)}"))
        if self.data_limit is not None:
            rooms.append((self.data_limit - (self.data_used or 0),
                          f"left under the data-segment limit (ulimit -d) of {human_bytes(self.data_limit)}"))
        if self.address_limit is not None:
            rooms.append((self.address_limit - (self.address_used or 0),
                          f"left under the address-space limit (ulimit -v) of {human_bytes(self.address_limit)}"))
        return rooms

    @property
    def headroom(self) -> int:
        return max(0, min(room for room, _ in self._rooms()))

    @property
    def bound_by(self) -> str:
        """``"left under the data-segment limit (ulimit -d) of 268.4 MB"``: what limits :attr:`headroom`."""
        return min(self._rooms())[1]


def _read_status(path: Path = PROC_STATUS) -> Optional[dict]:
    try:
        text = path.read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


def process_memory(pid: Optional[int] = None) -> ProcessMemory:
    """Resident memory of this process (or ``pid``): anonymous, file-backed, shared, total, peak."""
    st = _read_status(PROC_STATUS if pid is None else Path(f"/proc/{pid}/status"))
    if st and "RssAnon" in st:
        return ProcessMemory(rss=st.get("VmRSS", st["RssAnon"] + st.get("RssFile", 0)), anon=st["RssAnon"],
                             file=st.get("RssFile", 0), shmem=st.get("RssShmem", 0), hwm=st.get("VmHWM", 0))
    try:  # no /proc (or an old kernel): psutil's rss/shared are the best split there is
        import psutil

        mi = psutil.Process(pid).memory_info()
        shared = getattr(mi, "shared", 0)
        return ProcessMemory(rss=mi.rss, anon=max(0, mi.rss - shared), file=shared)
    except Exception:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return ProcessMemory(rss=peak, anon=peak, file=0, hwm=peak)


def _read_int(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= 2**60 else value  # cgroup v1 writes "no limit" as a huge number


def cgroup_memory(root: Path = CGROUP_ROOT) -> tuple[Optional[int], Optional[int]]:
    """``(limit, usage)`` of this process's memory cgroup in bytes; ``(None, None)`` when unlimited."""
    v2 = _read_int(root / "memory.max")
    if v2 is not None:
        return v2, _read_int(root / "memory.current")
    v1 = _read_int(root / "memory" / "memory.limit_in_bytes")
    if v1 is not None:
        return v1, _read_int(root / "memory" / "memory.usage_in_bytes")
    return None, None


def system_memory() -> SystemMemory:
    """The machine's total and available memory, and the cgroup limit if there is one."""
    info = _read_status(Path("/proc/meminfo")) or {}  # what psutil reads on Linux, without its 60 ms import
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    if total is None or available is None:
        try:
            import psutil

            vm = psutil.virtual_memory()
            total, available = vm.total, vm.available
        except Exception:
            total, available = total, info.get("MemFree", total)
    if total is None:
        total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit, usage = cgroup_memory()
    data_limit, address_limit = process_limits()
    status = _read_status() or {}
    return SystemMemory(total=int(total), available=int(available), cgroup_limit=limit, cgroup_usage=usage,
                        data_limit=data_limit, data_used=status.get("VmData") if data_limit else None,
                        address_limit=address_limit, address_used=status.get("VmSize") if address_limit else None)


def process_limits() -> tuple[Optional[int], Optional[int]]:
    """``(ulimit -d, ulimit -v)`` of this process in bytes (soft limits; None when unlimited)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None, None
    out = []
    for which in (resource.RLIMIT_DATA, resource.RLIMIT_AS):
        soft = resource.getrlimit(which)[0]
        out.append(None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft))
    return out[0], out[1]


# ============================================================================================ sampling
@dataclass(frozen=True)
class Sample:
    """One measurement: seconds since the sampler started, and the process's memory."""

    t: float
    anon: int
    file: int
    rss: int


class MemorySampler:
    """Samples the process's memory on a daemon thread into a bounded history, keeping the peak.

    Args:
        interval: seconds between samples (0.2 by default).
        maxlen: samples kept (older ones drop out; the peaks are kept regardless).
        measure: returns a :class:`ProcessMemory` (default :func:`process_memory`); tests pass a fake.
        clock: returns seconds (default ``time.monotonic``).
        on_sample: called with each :class:`Sample` on the sampler's thread (e.g. to update a widget;
            it must only set values, never print). Its exceptions are kept in :attr:`errors`.

    ``sample()`` takes one sample synchronously (tests drive the sampler with it, without a thread).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL, maxlen: int = 3000,
                 measure: Callable[[], ProcessMemory] = process_memory, clock: Callable[[], float] = time.monotonic,
                 on_sample: Optional[Callable[[Sample], None]] = None):
        self.interval = interval
        self.history: Deque[Sample] = collections.deque(maxlen=maxlen)
        self.measure, self.clock, self.on_sample = measure, clock, on_sample
        self.peak_anon = 0
        self.peak_rss = 0
        self.errors: list[BaseException] = []
        self._t0 = clock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def sample(self) -> Sample:
        m = self.measure()
        s = Sample(t=self.clock() - self._t0, anon=m.anon, file=m.file, rss=m.rss)
        with self._lock:
            self.history.append(s)
            self.peak_anon = max(self.peak_anon, s.anon)
            self.peak_rss = max(self.peak_rss, s.rss)
        if self.on_sample is not None:
            try:
                self.on_sample(s)
            except Exception as e:  # never let a display problem kill the sampler
                if len(self.errors) < 10:
                    self.errors.append(e)
        return s

    def reset(self) -> None:
        """Forget the history and the peaks; time starts again at 0."""
        with self._lock:
            self.history.clear()
            self.peak_anon = self.peak_rss = 0
            self._t0 = self.clock()

    def snapshot(self) -> list[Sample]:
        """A copy of the history (safe to use while the thread runs)."""
        with self._lock:
            return list(self.history)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except MemoryError as e:  # at the memory floor: stop sampling, quietly (the run says what ran out)
                if len(self.errors) < 10:
                    self.errors.append(e)
                return
            self._stop.wait(self.interval)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "MemorySampler":
        if not self.running:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ckptlib-memory-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ============================================================================================ a run's peak
@dataclass
class MemoryReport:
    """The memory of one piece of work (bytes, anonymous resident memory unless said otherwise).

    Attributes:
        baseline: anonymous memory when it started.
        peak: the highest anonymous memory seen while it ran (samples every ``interval`` plus one at
            the start and one at the end; a spike shorter than the interval can be missed).
        peak_added: ``peak - baseline``: what the work added; compare it with
            ``plan.predicted_peak_bytes``.
        peak_rss: the highest total resident memory seen (anonymous + file-backed).
        seconds: how long it ran; samples: how many samples were taken.
    """

    baseline: int
    peak: int
    peak_rss: int
    seconds: float
    samples: int
    history: list = field(default_factory=list, repr=False)

    @property
    def peak_added(self) -> int:
        return max(0, self.peak - self.baseline)

    def describe(self) -> str:
        return (f"peak memory {human_bytes(self.peak)} anonymous (+{human_bytes(self.peak_added)} over the "
                f"{human_bytes(self.baseline)} at the start), {human_bytes(self.peak_rss)} resident in total; "
                f"{self.samples} samples in {self.seconds:.2f} s")

    def __str__(self) -> str:
        return self.describe()


class MemoryWatch:
    """What :func:`watch_memory` yields; :attr:`report` is set when the block ends."""

    def __init__(self, sampler: MemorySampler):
        self.sampler = sampler
        self.baseline = 0
        self.report: Optional[MemoryReport] = None
        self._t0 = 0.0

    @property
    def peak_added(self) -> int:
        """What the work has added so far (also while it runs)."""
        return max(0, self.sampler.peak_anon - self.baseline)


class watch_memory:
    """Context manager: sample this process's memory while the block runs.

    ::

        with watch_memory() as w:
            do_work()
        print(w.report.peak_added)

    Args:
        interval: seconds between samples (default 0.1: runs are often short).
        measure: as for :class:`MemorySampler`.
    """

    def __init__(self, interval: float = 0.1, measure: Callable[[], ProcessMemory] = process_memory):
        self.interval, self.measure = interval, measure
        self.watch: Optional[MemoryWatch] = None

    def __enter__(self) -> MemoryWatch:
        # an hour at 0.1 s (a few MB at most); the peak is kept whatever drops out of the history
        sampler = MemorySampler(interval=self.interval, maxlen=36_000, measure=self.measure)
        self.watch = MemoryWatch(sampler)
        first = sampler.sample()
        self.watch.baseline = first.anon
        self.watch._t0 = time.perf_counter()
        sampler.start()
        return self.watch

    def __exit__(self, *exc) -> None:
        w = self.watch
        w.sampler.stop()
        w.sampler.sample()
        hist = w.sampler.snapshot()
        w.report = MemoryReport(baseline=w.baseline, peak=w.sampler.peak_anon, peak_rss=w.sampler.peak_rss,
                                seconds=time.perf_counter() - w._t0, samples=len(hist), history=hist)


# ============================================================================================ before a run
@dataclass(frozen=True)
class MemoryVerdict:
    """Does a run's predicted peak fit? ``level`` is ``"ok"``, ``"tight"`` (over half of the headroom)
    or ``"no"`` (more than the headroom); ``message`` says it in one sentence."""

    predicted: int
    available: int
    limit: Optional[int]
    fits: bool
    level: str
    message: str

    def __str__(self) -> str:
        return self.message


def memory_verdict(predicted: Union[int, Any], system: Optional[SystemMemory] = None) -> MemoryVerdict:
    """Compare a predicted peak (bytes, or a plan with ``predicted_peak_bytes``) with what is available.

    A cgroup limit counts: the headroom is the smaller of the machine's available memory and what the
    cgroup still allows.
    """
    if not isinstance(predicted, int):
        predicted = int(getattr(predicted, "predicted_peak_bytes"))
    system = system or system_memory()
    room = system.headroom
    where = system.bound_by
    if predicted > room:
        level, fits = "no", False
        msg = (f"does NOT fit: the run needs about {human_bytes(predicted)}, only {human_bytes(room)} is {where}; "
               "free memory, or lower chunk_bytes")
    elif predicted > room / 2:
        level, fits = "tight", True
        msg = (f"fits, but tightly: about {human_bytes(predicted)} of {human_bytes(room)} {where}")
    else:
        level, fits = "ok", True
        msg = f"fits: about {human_bytes(predicted)} needed, {human_bytes(room)} {where}"
    return MemoryVerdict(predicted=predicted, available=room, limit=system.cgroup_limit, fits=fits, level=level,
                         message=msg)


__all__ = ["ProcessMemory", "SystemMemory", "Sample", "MemorySampler", "MemoryReport", "MemoryWatch",
           "MemoryVerdict", "process_memory", "system_memory", "cgroup_memory", "watch_memory", "memory_verdict",
           "process_limits"]
