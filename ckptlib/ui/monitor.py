"""A live memory display: current and peak memory of the kernel process, what the machine has left, and
a chart redrawn about once a second (matplotlib Agg → PNG → ``ipywidgets.Image``; no frontend extension).
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import ipywidgets as widgets

from ckptlib.system.memory import MemorySampler, Sample, process_memory, system_memory
from ckptlib.units import human_bytes

from .common import png_image, set_png
from .plots import plot_memory


class MemoryMonitor(widgets.VBox):
    """Samples this process's memory on a daemon thread (every ``interval`` s) and shows it; a second
    daemon thread redraws the chart every ``redraw_every`` s.

    ``predicted``/``baseline`` (bytes) draw the predicted peak as a dashed line. Both threads only set
    widget values. ``start()``/``stop()``, or the toggle button.
    """

    def __init__(self, interval: float = 0.2, redraw_every: float = 1.0, title: str = "memory of this kernel",
                 show_button: bool = True):
        self.title = title
        self.predicted: Optional[int] = None
        self.baseline: Optional[int] = None
        self.redraw_every = redraw_every
        self._draw_lock = threading.Lock()
        self._halt = threading.Event()
        self._drawer: Optional[threading.Thread] = None
        self._started = 0.0
        self._generation = 0
        #: set while not sampling (after the last chart of a run is drawn)
        self.idle = threading.Event()
        self.idle.set()
        self.label = widgets.HTML()
        self.label.add_class("ckpt-memory-label")
        self.image = png_image("ckpt-memory-chart")
        self.toggle = widgets.ToggleButton(value=False, description="Watch memory", icon="line-chart",
                                           tooltip="sample this kernel's memory every 0.2 s")
        self.toggle.observe(self._on_toggle, names="value")
        self.sampler = MemorySampler(interval=interval, on_sample=self._on_sample)
        children = ([self.toggle] if show_button else []) + [self.label, self.image]
        super().__init__(children)
        self.add_class("ckpt-memory-monitor")
        self.update_label()

    # ---------------------------------------------------------------- control
    def start(self) -> "MemoryMonitor":
        """Start sampling (and redrawing the chart about every ``redraw_every`` seconds)."""
        self._start()
        if not self.toggle.value:
            self.toggle.value = True
        return self

    def stop(self) -> None:
        """Stop sampling; the chart is drawn once more with everything sampled."""
        self._stop()
        if self.toggle.value:
            self.toggle.value = False

    def stop_later(self, min_seconds: float = 1.0) -> None:
        """Stop once sampling has lasted ``min_seconds`` (at once if it has): a short run still gets a
        chart of a few samples around it. Does not block."""
        remaining = min_seconds - (time.monotonic() - self._started)
        if remaining <= 0 or not self.sampler.running:
            self.stop()
            return
        generation = self._generation

        def stop_if_same_run():  # a run started since then keeps its monitor
            if self._generation == generation:
                self.stop()

        timer = threading.Timer(remaining, stop_if_same_run)
        timer.daemon = True
        timer.start()

    def _start(self) -> None:
        self._started = time.monotonic()
        self._generation += 1  # a stop_later() pending from an earlier run no longer applies
        if self.sampler.running:
            return
        self.idle.clear()
        self.sampler.start()
        self._halt.clear()
        self._drawer = threading.Thread(target=self._draw_loop, name="ckptlib-memory-chart", daemon=True)
        self._drawer.start()

    def _stop(self) -> None:
        if not self.sampler.running and self._drawer is None:
            return
        self.sampler.stop()
        self._halt.set()
        if self._drawer is not None and self._drawer is not threading.current_thread():
            self._drawer.join(5)
        self._drawer = None
        try:
            self.render()
        finally:
            self.idle.set()

    def _on_toggle(self, change) -> None:
        if change["new"]:
            self._start()
        else:
            self._stop()

    # ---------------------------------------------------------------- drawing (own threads; they set values only)
    def _draw_loop(self) -> None:
        # drawing takes tens of milliseconds: its own thread, so that sampling keeps its pace
        while not self._halt.wait(self.redraw_every):
            try:
                self.render()
            except Exception as e:  # keep drawing later; show nothing worse than a stale chart
                self.sampler.errors.append(e)

    def _on_sample(self, s: Sample) -> None:
        self.update_label(s)

    def update_label(self, s: Optional[Sample] = None) -> None:
        if s is None:
            m = process_memory()
            anon, file = m.anon, m.file
        else:
            anon, file = s.anon, s.file
        sysm = system_memory()
        limit = f"; cgroup limit {human_bytes(sysm.cgroup_limit)}" if sysm.cgroup_limit else ""
        peak = f" (peak {human_bytes(self.sampler.peak_anon)})" if self.sampler.peak_anon else ""
        self.label.value = (f"this kernel: <b>{human_bytes(anon)}</b> anonymous{peak} + {human_bytes(file)} "
                            f"file-backed &nbsp;|&nbsp; machine: {human_bytes(sysm.available)} available of "
                            f"{human_bytes(sysm.total)}{limit}")

    def render(self) -> None:
        """Redraw the chart from the sampler's history (sets ``image.value``)."""
        hist = self.sampler.snapshot()
        if not hist:
            return
        with self._draw_lock:
            set_png(self.image, plot_memory(hist, predicted=self.predicted, baseline=self.baseline, title=self.title))

    def reset(self) -> None:
        """Forget the history and the peak (a new run starts)."""
        self.sampler.reset()
