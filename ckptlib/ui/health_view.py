"""The health view: what ``ckpt check`` found, as a table with per-layer norm bars and non-finite markers.

::

    from ckptlib.ui import HealthView, norms_figure
    health = ckptlib.check("samples/zero2_bf16_w2/ckpt")
    HealthView(health)          # or HealthView(path): runs the check in a worker thread, with a progress bar
    norms_figure(health)        # the L2 norm of each layer's fp32 masters; NaN/Inf marked
"""
from __future__ import annotations

import html
import math
import os
import threading
from typing import Optional, Union

import ipywidgets as widgets

import ckptlib
from ckptlib.analysis.scan import layer_of, num

from .common import ErrorArea, find_path, guarded, png_image, set_png
from .plots import figure_png, new_figure

BAD = "#C44E52"
BAR = "#4C72B0"


def layer_rows(result: "ckptlib.CheckResult", states: bool = False) -> list[dict]:
    """One row per layer (in the model's order): its tensors, the L2 norm over them (float64), the NaN
    and Inf counts. Optimizer states count only with ``states``."""
    rows: dict = {}
    for t in result.tensors:
        if (t.kind == "state") != states:
            continue
        row = rows.setdefault(layer_of(t.key), {"layer": layer_of(t.key), "tensors": [], "sumsq": 0.0, "nan": 0,
                                                 "inf": 0, "numel": 0})
        row["tensors"].append(t)
        row["sumsq"] += t.norm ** 2
        row["nan"] += t.nan
        row["inf"] += t.inf
        row["numel"] += t.numel
    for row in rows.values():
        row["norm"] = math.sqrt(row["sumsq"])
    return list(rows.values())


def _bar(value: float, top: float, bad: bool) -> str:
    width = 0 if top <= 0 else max(1.0, 100.0 * value / top)
    return (f"<div class='ckpt-norm-bar' title='{value:.6g}' style='width:{width:.1f}%;height:9px;"
            f"background:{BAD if bad else BAR};border-radius:2px'></div>")


def _marker(nan: int, inf: int) -> str:
    if not nan and not inf:
        return ""
    return (f"<span class='ckpt-nonfinite' style='color:{BAD};font-weight:bold'>&#9888; "
            f"{nan} NaN, {inf} Inf</span>")


def health_table_html(result: "ckptlib.CheckResult", search: str = "", only_problems: bool = False) -> str:
    """The statistics as an HTML table (class ``ckpt-health-table``): one bold row per layer with a bar of
    its norm (relative to the largest layer), then its tensors with their own bars; NaN/Inf marked."""
    bad = {p.tensor for p in result.problems}
    search = search.strip().lower()
    body = []
    for states in (False, True):
        layers = layer_rows(result, states)
        top = max((r["norm"] for r in layers), default=0.0)
        for row in layers:
            tensors = [t for t in row["tensors"] if search in t.key.lower() and (not only_problems or t.key in bad
                                                                                  or not t.finite)]
            if not tensors:
                continue
            flagged = row["nan"] or row["inf"] or any(t.key in bad for t in tensors)
            body.append(f"<tr class='ckpt-layer-row' style='background:{'#fdecea' if flagged else '#f4f6fa'}'>"
                        f"<td><b>{html.escape(row['layer'])}</b>{' (optimizer states)' if states else ''}</td>"
                        f"<td style='text-align:right'>{row['numel']:,}</td><td>{_marker(row['nan'], row['inf'])}</td>"
                        f"<td colspan='5'></td><td style='text-align:right'><b>{row['norm']:.4g}</b></td>"
                        f"<td style='width:160px'>{_bar(row['norm'], top, bool(row['nan'] or row['inf']))}</td></tr>")
            inner_top = max(t.norm for t in row["tensors"])
            for t in tensors:
                cells = "".join(f"<td style='text-align:right'>{html.escape(num(v, 0).strip())}</td>"
                                for v in (t.zeros, t.min, t.max, t.mean, t.std, t.norm))
                style = f" style='color:{BAD}'" if t.key in bad else ""
                body.append(f"<tr class='ckpt-tensor-row'{style}><td style='padding-left:1.5em'><code>"
                            f"{html.escape(t.key)}</code></td><td style='text-align:right'>{t.numel:,}</td>"
                            f"<td>{_marker(t.nan, t.inf)}</td>{cells}"
                            f"<td>{_bar(t.norm, inner_top, not t.finite)}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("tensor", "numel", "NaN / Inf", "zeros", "min", "max", "mean", "std",
                                              "norm", ""))
    return (f"<style>.ckpt-health-table td, .ckpt-health-table th {{padding:1px 8px}}</style>"
            f"<table class='ckpt-health-table' style='border-collapse:collapse;font-size:12px'><thead><tr>{head}"
            f"</tr></thead><tbody>{''.join(body) or '<tr><td colspan=10><i>no tensor matches</i></td></tr>'}"
            "</tbody></table>")


def problems_list_html(result: "ckptlib.CheckResult") -> str:
    if not result.problems:
        return (f"<div class='ckpt-health-ok' style='color:#2e7d32'>&#10004; healthy: {len(result.tensors)} tensors, "
                "no problem found</div>")
    items = "".join(f"<li><code>{html.escape(p.tensor)}</code> in <code>{html.escape(p.file)}</code>: "
                    f"{html.escape(p.what)}</li>" for p in result.problems)
    return (f"<div class='ckpt-health-problems' style='color:{BAD}'><b>{len(result.problems)} problem(s) found:</b>"
            f"<ul>{items}</ul></div>")


def norms_figure(result: "ckptlib.CheckResult", max_layers: int = 60):
    """The L2 norm of each layer's fp32 masters (log scale), layers holding NaN or Inf in red and marked."""
    rows = layer_rows(result)[:max_layers]
    fig = new_figure((8.0, 0.9 + 0.24 * max(len(rows), 3)))
    ax = fig.add_subplot(1, 1, 1)
    names = [r["layer"] for r in rows][::-1]
    norms = [max(r["norm"], 1e-30) for r in rows][::-1]
    bad = [bool(r["nan"] or r["inf"]) for r in rows][::-1]
    ax.barh(names, norms, color=[BAD if b else BAR for b in bad])
    for i, (b, r) in enumerate(zip(bad, rows[::-1])):
        if b:
            ax.annotate(f" NaN {r['nan']} / Inf {r['inf']}", (norms[i], i), va="center", fontsize=7, color=BAD)
    if any(n > 1e-30 for n in norms):
        ax.set_xscale("log")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("L2 norm of the layer's fp32 masters (float64)", fontsize=8)
    verdict = "healthy" if result.ok else f"{len(result.problems)} problem(s)"
    ax.set_title(f"{len(result.tensors)} tensors checked: {verdict}", fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


class HealthView(widgets.VBox):
    """What a check found: verdict and problems, a searchable table (per-layer norm bars, NaN/Inf marked)
    and the norms figure. Given a path or a Checkpoint, it runs the check in a worker thread with a
    progress bar (``wait()`` until it is done); given a :class:`ckptlib.CheckResult`, it shows it."""

    def __init__(self, source: Union["ckptlib.CheckResult", "ckptlib.Checkpoint", str, os.PathLike],
                 states: bool = False):
        self.errors = ErrorArea()
        self.result: Optional[ckptlib.CheckResult] = None
        self.thread: Optional[threading.Thread] = None
        self.verdict = widgets.HTML()
        self.search = widgets.Text(description="search", placeholder="part of a tensor name",
                                   layout=widgets.Layout(width="45%"))
        self.only_problems = widgets.Checkbox(description="only tensors with problems", indent=False)
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="reading",
                                              layout=widgets.Layout(width="60%"))
        self.table = widgets.HTML()
        self.table.add_class("ckpt-health")
        self.figure = png_image("ckpt-norms-figure")
        self.search.observe(self._on_filter, names="value")
        self.only_problems.observe(self._on_filter, names="value")
        super().__init__([self.verdict, self.progress, widgets.HBox([self.search, self.only_problems]), self.table,
                          self.figure, self.errors])
        self.add_class("ckpt-health-view")
        if isinstance(source, ckptlib.CheckResult):
            self.progress.layout.display = "none"
            self.show(source)
        else:
            target = source if isinstance(source, ckptlib.Checkpoint) else find_path(source)
            self.verdict.value = "<i>checking...</i>"
            self.thread = threading.Thread(target=self._work, args=(target, states), daemon=True)
            self.thread.start()

    def _work(self, target, states: bool) -> None:
        view = self

        class Progress(ckptlib.Observer):
            def on_bytes(self, done, total):
                view.progress.value = done / total if total else 1.0

        try:
            result = ckptlib.check(target, states=states, observer=Progress())
            self.progress.bar_style = "success"
            self.show(result)
        except Exception as e:  # shown, not lost in the kernel log
            self.progress.bar_style = "danger"
            self.errors.show(e, "check")

    def wait(self, timeout: Optional[float] = None) -> Optional["ckptlib.CheckResult"]:
        if self.thread is not None:
            self.thread.join(timeout)
        return self.result

    def show(self, result: "ckptlib.CheckResult") -> None:
        self.result = result
        self.verdict.value = problems_list_html(result)
        self.render()
        set_png(self.figure, figure_png(norms_figure(result)))

    @guarded("filter")
    def _on_filter(self, change) -> None:
        self.render()

    def render(self) -> None:
        if self.result is not None:
            self.table.value = health_table_html(self.result, self.search.value, self.only_problems.value)


__all__ = ["HealthView", "health_table_html", "problems_list_html", "norms_figure", "layer_rows"]
