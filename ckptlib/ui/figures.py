"""Figures and tables of a checkpoint, from its metadata only (nothing here reads tensor data).

Each ``*_figure`` function returns a matplotlib ``Figure`` drawn on an Agg canvas (no pyplot): as the
last expression of a notebook cell it shows as a PNG, and :func:`ckptlib.system.memory.figure_png` turns it
into bytes for an ``ipywidgets.Image``. The tables are plain lists of dicts, and HTML for widgets.
"""
from __future__ import annotations

import html
import os
import zlib
from typing import Optional

import ckptlib
from ckptlib.analysis.summary import closing, file_lines, parameter_kind, summary_rows, where
from ckptlib.deepspeed.files import FRAGMENT, natural_key
from ckptlib.units import human_bytes

from .plots import new_figure

PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
           "#CCB974", "#64B5CD", "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B",
           "#E377C2", "#7F7F7F", "#BCBD22", "#17BECF"]
PADDING_COLOR = "#EEEEEE"
KIND_COLORS = {"model_states": "#4C72B0", "optim_states": "#DD8452"}


def param_color(name: str, ckpt: Optional["ckptlib.Checkpoint"] = None) -> str:
    """A colour per parameter: by its place in the model (neighbours differ) when ``ckpt`` is given,
    else from its name. The same in every figure of a checkpoint."""
    if ckpt is not None:
        names = [p.name for p in ckpt.parameters if not p.tied_to]
        if name in names:
            return PALETTE[names.index(name) % len(PALETTE)]
    return PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


# ============================================================================================ files
def _summary(ckpt) -> dict:
    """:func:`ckptlib.describe` of a checkpoint, or the dict itself."""
    return ckpt if isinstance(ckpt, dict) else ckptlib.describe(ckpt)


def file_rows(ckpt) -> list[dict]:
    """One row per file of the tag folder: name, kind, where in the mesh, bytes (of a checkpoint or its
    :func:`ckptlib.describe` dict)."""
    return [{"file": os.path.basename(f["path"]), "kind": f["kind"], "where": where(f), "dp_rank": f["dp_rank"],
             "bytes": f["bytes"]} for f in _summary(ckpt)["files"]]


def bytes_per_rank(ckpt) -> dict:
    """``{rank or "shared": {kind: bytes}}``: what each rank's files weigh (a rank named by its place in the
    mesh, ``"stage 1 dp 0"``, when there are stages or tensor ranks)."""
    d = _summary(ckpt)
    several = d["pp_world_size"] > 1 or d["tp_world_size"] > 1 or d["parallelism"] != "data_parallel"
    out: dict = {}
    for f in d["files"]:
        key = f["dp_rank"] if f["dp_rank"] is not None else "shared"
        if several and f["dp_rank"] is not None and (f["stage"] is not None or f["tp_rank"] is not None):
            key = f"stage {f['stage']} dp {f['dp_rank']}" if f["stage"] is not None else \
                f"tp {f['tp_rank']} dp {f['dp_rank']}"
        out.setdefault(key, {})
        out[key][f["kind"]] = out[key].get(f["kind"], 0) + f["bytes"]
    return out


def file_sizes_figure(ckpt):
    """Bar chart: bytes per data-parallel rank, stacked by file kind (shared files in their own bar)."""
    d = _summary(ckpt)
    per = bytes_per_rank(d)
    keys = sorted((k for k in per if k != "shared"), key=lambda k: natural_key(str(k))) + \
        (["shared"] if "shared" in per else [])
    kinds = sorted({k for v in per.values() for k in v}, key=lambda k: (k not in KIND_COLORS, k))
    fig = new_figure((max(3.6, 1.0 + 0.7 * len(keys)), 2.8))
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"rank {k}" if isinstance(k, int) else k for k in keys]
    bottom = [0.0] * len(keys)
    scale, unit = _unit(max((sum(v.values()) for v in per.values()), default=1))
    for i, kind in enumerate(kinds):
        vals = [per[k].get(kind, 0) / scale for k in keys]
        ax.bar(labels, vals, bottom=bottom, label=kind.replace("_", " "),
               color=KIND_COLORS.get(kind, PALETTE[(i + 4) % len(PALETTE)]))
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(f"{d['tag']}: {len(d['files'])} files, {human_bytes(d['total_bytes'])}", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(kinds))
    ax.margins(y=0.15)
    fig.tight_layout()
    return fig


def _unit(n: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if n >= scale:
            return scale, unit
    return 1.0, "bytes"


def file_table_html(ckpt) -> str:
    """The files as an HTML table (class ``ckpt-file-table``), with a total per rank and overall: every line of
    ``ckpt inspect``'s file list."""
    d = _summary(ckpt)
    rows = []
    fragments = [f for f in d["files"] if f["kind"] == FRAGMENT]
    for f in d["files"]:
        if f["kind"] == FRAGMENT and len(fragments) > 200:
            continue  # a large universal folder: the fragments summed in one line below
        rows.append(f"<tr><td><code>{html.escape(f['path'])}</code></td><td>{html.escape(f['kind'])}</td>"
                    f"<td>{html.escape(where(f))}</td><td style='text-align:right'>{human_bytes(f['bytes'])}</td></tr>")
    if len(fragments) > 200:
        rows.append(f"<tr><td colspan='4'>{html.escape(file_lines(d)[-1].strip())}</td></tr>")
    per = bytes_per_rank(d)
    ranks = ", ".join(f"{'rank ' if isinstance(k, int) else ''}{k}: {human_bytes(sum(v.values()))}" for k, v in sorted(
        ((k, v) for k, v in per.items() if k != "shared"), key=lambda kv: natural_key(str(kv[0]))))
    return ("<table class='ckpt-file-table' style='border-collapse:collapse'>"
            "<thead><tr><th style='text-align:left'>file</th><th style='text-align:left'>kind</th>"
            "<th>where</th><th>size</th></tr></thead><tbody>" + "".join(rows) + "</tbody>"
            f"<tfoot><tr><td colspan='3'><b>{len(d['files'])} files</b> ({html.escape(ranks)})</td>"
            f"<td style='text-align:right'><b>{human_bytes(d['total_bytes'])}</b></td></tr></tfoot></table>")


def summary_html(ckpt) -> str:
    """Every row of ``ckpt inspect``'s summary (:func:`ckptlib.analysis.summary.summary_rows`) as a table (class
    ``ckpt-summary``), then its notes, what cannot be read, the problems and hints (:func:`closing`): the same
    facts as the command's text, from the same dict."""
    d = _summary(ckpt)
    body = "".join(f"<tr><th style='text-align:left;padding-right:1em;vertical-align:top'>{html.escape(k)}</th>"
                   f"<td>{html.escape(v)}</td></tr>" for k, v in summary_rows(d))
    colors = {"problem": "#b71c1c", "cannot read values": "#b71c1c", "hint": "#555", "ok": "#2e7d32", "read": "#777"}
    ends = "".join(f"<li class='ckpt-summary-{kind.replace(' ', '-')}' style='color:{colors.get(kind, '#333')}'>"
                   + ("" if kind in ("ok", "read") else f"<b>{html.escape(kind)}:</b> ") + f"{html.escape(text)}</li>"
                   for kind, text in closing(d))
    return (f"<table class='ckpt-summary'>{body}</table>"
            f"<ul class='ckpt-summary-notes' style='margin-top:6px'>{ends}</ul>")


def problems_html(ckpt) -> str:
    """The problems ``ckpt inspect`` lists (what opening found, and every rank file that does not hold what its
    name says), with the hint, or that there are none."""
    d = _summary(ckpt)
    problems = d["problems"]
    if not problems:
        return "<div class='ckpt-problems ckpt-ok' style='color:#2e7d32'>&#10004; no problems found</div>"
    items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
    return (f"<div class='ckpt-problems' style='color:#b71c1c'><b>{len(problems)} problem(s) found:</b>"
            f"<ul>{items}</ul>Values read from this checkpoint cannot be trusted until they are fixed."
            + (f"<div style='color:#555'><b>hint:</b> {html.escape(d['repair_hint'])}</div>" if d["repair_hint"] else "")
            + "</div>")


def parameters_html(ckpt, limit: int = 200) -> str:
    """The parameters and buffers as ``ckpt inspect`` lists them (name, shape, elements, kind), the first ``limit``."""
    d = _summary(ckpt)
    replicated = set(d["replicated"])
    rows = []
    items = [(p["name"], p["shape"], f"{p['numel']:,}", parameter_kind(p, replicated)) for p in d["parameters"]]
    items += [(b["name"], b["shape"], "", f"buffer {b['dtype']}" + (", replicated" if b["name"] in replicated else ""))
              for b in d["buffers"]]
    for name, shape, numel, kind in items[:limit]:
        rows.append(f"<tr><td><code>{html.escape(name)}</code></td><td>{shape}</td>"
                    f"<td style='text-align:right'>{numel}</td><td>{html.escape(kind)}</td></tr>")
    more = f"<p>... and {len(items) - limit} more</p>" if len(items) > limit else ""
    return ("<table class='ckpt-param-table'><thead><tr><th style='text-align:left'>parameter</th><th>shape</th>"
            "<th>elements</th><th style='text-align:left'>kind</th></tr></thead><tbody>" + "".join(rows)
            + "</tbody></table>" + more)


def table_html(rows: list[dict], cls: str = "ckpt-table") -> str:
    """A list of dicts as a small HTML table."""
    if not rows:
        return "<i>nothing</i>"
    heads = list(rows[0])
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in heads)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(h, '')))}</td>" for h in heads) + "</tr>"
                   for r in rows)
    return f"<table class='{cls}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


__all__ = ["file_rows", "bytes_per_rank", "file_sizes_figure", "file_table_html", "summary_html", "problems_html",
           "parameters_html", "table_html", "param_color", "PALETTE", "PADDING_COLOR"]
