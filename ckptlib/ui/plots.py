"""Plots of memory and figures on matplotlib's Agg canvas (no pyplot: safe from threads, and the
notebook's backend is left alone). matplotlib is imported only when a figure is made.
"""
from __future__ import annotations

import io
from typing import Optional

MB = 10**6  # decimal megabytes, like every other size ckptlib prints (human_bytes)


def memory_figure(history, predicted: Optional[int] = None, baseline: Optional[int] = None,
                  available: Optional[int] = None, title: str = "memory of this process",
                  size: tuple = (6.4, 2.6)):
    """A matplotlib ``Figure`` (Agg canvas, no pyplot) of a sample history: anonymous and file-backed
    resident memory over time, with the predicted peak (over ``baseline``) as a dashed line."""
    fig = new_figure(size)
    ax = fig.add_subplot(1, 1, 1)
    hist = list(history)
    t = [s.t for s in hist]
    anon = [s.anon / MB for s in hist]
    file = [s.file / MB for s in hist]
    if hist:
        ax.stackplot(t, anon, file, labels=["anonymous", "file-backed"], colors=["#4C72B0", "#C7D6EC"],
                     alpha=0.9)
        ax.plot(t, anon, color="#2A4D80", linewidth=1, marker="." if len(hist) < 40 else None)
        if t[-1] - t[0] < 1.0:  # a short run: show at least a second, so that a few samples read as a chart
            ax.set_xlim(t[0] - 0.05, t[0] + 1.0)
        peak = max(hist, key=lambda s: s.anon)
        ax.plot([peak.t], [peak.anon / MB], marker="v", color="#C44E52")
        right = peak.t > (t[0] + max(t[-1] - t[0], 1.0) / 2)
        ax.annotate(f"peak {peak.anon / MB:.0f} MB", (peak.t, peak.anon / MB), textcoords="offset points",
                    xytext=(-4 if right else 4, 4), ha="right" if right else "left", fontsize=8, color="#C44E52")
    if predicted is not None:
        base = baseline if baseline is not None else (hist[0].anon if hist else 0)
        ax.axhline((base + predicted) / MB, color="#DD8452", linestyle="--", linewidth=1.2,
                   label=f"predicted peak (+{predicted / MB:.0f} MB)")
    if available is not None:
        top = ax.get_ylim()[1]
        if available / MB < top * 4:
            ax.axhline(((hist[-1].rss if hist else 0) + available) / MB, color="#C44E52", linewidth=1,
                       label="available")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left", fontsize=7, frameon=True, framealpha=0.8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


_FIGURE_CLASS = None


def new_figure(size: tuple = (6.4, 3.0), dpi: int = 100):
    """A matplotlib ``Figure`` on an Agg canvas (no pyplot, so safe from threads and leaving the
    notebook's backend alone) that shows itself as a PNG when it is a notebook cell's result."""
    global _FIGURE_CLASS
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if _FIGURE_CLASS is None:
        class PngFigure(Figure):
            def _repr_png_(self):
                return figure_png(self)

        _FIGURE_CLASS = PngFigure
    fig = _FIGURE_CLASS(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def figure_png(fig) -> bytes:
    """PNG bytes of a matplotlib figure (rendered on an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_memory(history, predicted: Optional[int] = None, baseline: Optional[int] = None,
                available: Optional[int] = None, title: str = "memory of this process") -> bytes:
    """:func:`memory_figure` as PNG bytes (for an ``ipywidgets.Image``, a file or a report)."""
    return figure_png(memory_figure(history, predicted=predicted, baseline=baseline, available=available,
                                    title=title))


__all__ = ["memory_figure", "plot_memory", "figure_png", "new_figure", "MB"]
