"""The diff view: what ``ckpt diff`` found, with the relative change of each layer plotted.

::

    from ckptlib.ui import DiffView, diff_figure
    d = ckptlib.diff("ckpt", "ckpt-export")
    DiffView(d)                 # summary, a status filter, the table, the figure
    diff_figure(d)              # ||a - b|| / ||a|| per layer (log scale); missing and reshaped ones marked
"""
from __future__ import annotations

import html
import math

import ipywidgets as widgets

import ckptlib
from ckptlib.analysis.scan import layer_of, num
from ckptlib.analysis.tensordiff import CHANGED, SAME, STATUSES

from .common import ErrorArea, guarded, png_image, set_png
from .plots import figure_png, new_figure

COLORS = {"same": "#55A868", "changed": "#DD8452", "only_in_a": "#8172B3", "only_in_b": "#64B5CD",
          "shape_changed": "#C44E52"}
NOT_SAME = "not same"


def layer_changes(result: "ckptlib.DiffResult") -> list[dict]:
    """One row per layer: ``||a - b|| / ||a||`` over its compared tensors (float64), and the statuses."""
    rows: dict = {}
    for t in result.tensors:
        row = rows.setdefault(layer_of(t.key), {"layer": layer_of(t.key), "sumsq_a": 0.0, "sumsq_diff": 0.0,
                                                 "statuses": {}})
        row["statuses"][t.status] = row["statuses"].get(t.status, 0) + 1
        if t.norm_a is not None:
            row["sumsq_a"] += t.norm_a ** 2
            row["sumsq_diff"] += t.norm_diff ** 2
    for row in rows.values():
        a, d = math.sqrt(row["sumsq_a"]), math.sqrt(row["sumsq_diff"])
        row["rel"] = 0.0 if d == 0 else (d / a if a else math.inf)
        row["status"] = next((s for s in STATUSES[::-1] if s in row["statuses"]), SAME)
    return list(rows.values())


def diff_figure(result: "ckptlib.DiffResult", max_layers: int = 60):
    """The relative change of each layer as bars (log scale). Layers whose values are all the same are
    green dots on the axis, infinite changes (``||a|| = 0``) triangles at the top, layers with missing or
    reshaped tensors and nothing compared crosses in their status colour."""
    rows = layer_changes(result)[:max_layers]
    names = [r["layer"] if len(r["layer"]) <= 32 else "…" + r["layer"][-31:] for r in rows]  # peft's are long
    fig = new_figure((8.0, 2.6 + 0.055 * max([len(n) for n in names] + [10])))
    ax = fig.add_subplot(1, 1, 1)
    moved = [r["rel"] for r in rows if 0 < r["rel"] < math.inf]
    floor, top = (min(moved) / 10, max(moved) * 10) if moved else (1e-8, 1.0)
    for i, r in enumerate(rows):
        color = COLORS[r["status"]]
        if 0 < r["rel"] < math.inf:
            ax.bar(i, r["rel"], color=color)
        elif r["rel"] == math.inf:
            ax.plot([i], [top], marker="^", color=color, markersize=8)
        elif r["status"] == SAME:
            ax.plot([i], [floor], marker="o", color=color, markersize=6)
        else:
            ax.plot([i], [floor], marker="x", color=color, markersize=8, markeredgewidth=2)
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, top * 2)
    ax.set_xlim(-0.6, max(len(rows), 1) - 0.4)
    ax.set_xticks(list(range(len(rows))))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("||a - b|| / ||a||", fontsize=8)
    from matplotlib.patches import Patch

    seen = [s for s in STATUSES if any(r["status"] == s for r in rows)]
    labels = {SAME: "same (dot on the axis)", CHANGED: "changed"}
    ax.legend(handles=[Patch(color=COLORS[s], label=labels.get(s, s.replace("_", " "))) for s in seen], fontsize=7,
              frameon=False, loc="upper right")
    ax.set_title(result.summary(), fontsize=8, loc="left", wrap=True)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def diff_table_html(result: "ckptlib.DiffResult", status: str = NOT_SAME, search: str = "") -> str:
    """The tensors as an HTML table (class ``ckpt-diff-table``), filtered by status (``"not same"``: every
    tensor that is not ``same``; ``"all"``) and by part of the name."""
    search = search.strip().lower()
    rows = []
    for t in result.tensors:
        if search not in t.key.lower() or not (status == "all" or t.status == status
                                               or (status == NOT_SAME and t.status != SAME)):
            continue
        shape = list(t.shape_a if t.shape_a is not None else t.shape_b)
        if t.status == "shape_changed":
            shape = f"{list(t.shape_a)} → {list(t.shape_b)}"
        extra = f" ({t.nonfinite} NaN/Inf on one side)" if t.nonfinite else ""
        rows.append(f"<tr><td><code>{html.escape(t.key)}</code></td><td style='color:{COLORS[t.status]}'><b>"
                    f"{t.status}</b></td><td>{html.escape(str(shape))}</td>"
                    f"<td style='text-align:right'>{num(t.max_abs_diff, 0).strip()}</td>"
                    f"<td style='text-align:right'>{num(t.rel_diff, 0).strip()}</td>"
                    f"<td style='text-align:right'>{t.changed:,}{extra}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("tensor", "status", "shape", "max |a-b|", "||a-b|| / ||a||",
                                              "elements changed"))
    empty = "<tr><td colspan=6><i>no tensor matches</i></td></tr>"
    return (f"<style>.ckpt-diff-table td, .ckpt-diff-table th {{padding:1px 8px}}</style>"
            f"<table class='ckpt-diff-table' style='border-collapse:collapse;font-size:12px'><thead><tr>{head}</tr>"
            f"</thead><tbody>{''.join(rows) or empty}</tbody></table>")


class DiffView(widgets.VBox):
    """A diff's summary, a status filter and search, the table of tensors, and :func:`diff_figure`."""

    def __init__(self, result: "ckptlib.DiffResult"):
        self.errors = ErrorArea()
        self.result = result
        ok = result.ok
        self.summary = widgets.HTML(
            f"<div class='ckpt-diff-summary' style='color:{'#2e7d32' if ok else '#b26a00'}'>"
            f"{'&#10004;' if ok else '&#9888;'} <b>A</b> {html.escape(result.a)}<br><b>B</b> {html.escape(result.b)}"
            f"<br>{html.escape(result.summary())}</div>")
        counts = result.counts
        options = [(f"not same ({len(result.tensors) - counts[SAME]})", NOT_SAME), (f"all ({len(result.tensors)})", "all")]
        options += [(f"{s.replace('_', ' ')} ({counts[s]})", s) for s in STATUSES if counts[s]]
        self.status = widgets.Dropdown(description="show", options=options,
                                       value=NOT_SAME if counts[SAME] < len(result.tensors) else "all")
        self.search = widgets.Text(description="search", placeholder="part of a tensor name")
        self.table = widgets.HTML()
        self.table.add_class("ckpt-diff")
        self.figure = png_image("ckpt-diff-figure")
        self.status.observe(self._on_filter, names="value")
        self.search.observe(self._on_filter, names="value")
        super().__init__([self.summary, widgets.HBox([self.status, self.search]), self.table, self.figure,
                          self.errors])
        self.add_class("ckpt-diff-view")
        self.render()
        set_png(self.figure, figure_png(diff_figure(result)))

    @property
    def changed(self) -> list[str]:
        """Names of the tensors whose values changed."""
        return [t.key for t in self.result.tensors if t.status == CHANGED]

    @guarded("filter")
    def _on_filter(self, change) -> None:
        self.render()

    def render(self) -> None:
        self.table.value = diff_table_html(self.result, self.status.value, self.search.value)


__all__ = ["DiffView", "diff_figure", "diff_table_html", "layer_changes"]
