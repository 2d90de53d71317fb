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


def _message_figure(text: str, size=(6.4, 1.2)):
    fig = new_figure(size)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, wrap=True)
    return fig


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


# ============================================================================================ layout
def set_label(ckpt: "ckptlib.Checkpoint", mp: int) -> str:
    """"stage 1 · ", "tensor rank 1 · " or "" (one ZeRO set): how a panel names its set."""
    label = ckpt.set_label(mp)
    return f"{label} · " if label else ""


def layout_panels(ckpt: "ckptlib.Checkpoint") -> list[dict]:
    """The flat tensors a layout figure can show: one panel per ZeRO-1/2 parameter group, or per
    ZeRO-3 sub-group, of every ZeRO set (each pipeline stage, each tensor rank). Each: ``{"key",
    "label", "group", "length", "params", "set"}`` (``length`` = elements per rank)."""
    panels = []
    for mp, zs in ckpt.sets.items():
        prefix = set_label(ckpt, mp)
        for lay in zs.layouts:
            if hasattr(lay, "sub_group_sizes"):  # ZeRO-3
                for k, size in enumerate(lay.sub_group_sizes):
                    names = [s.name for s in lay.slots if s.sub_group == k]
                    panels.append({"key": (mp, k), "label": f"{prefix}sub-group {k}", "group": k, "length": size,
                                   "params": names, "layout": lay, "zero3": True, "set": mp})
            else:
                panels.append({"key": (mp, lay.group), "label": f"{prefix}group {lay.group}", "group": lay.group,
                               "length": lay.partition_size, "params": [s.name for s in lay.slots], "layout": lay,
                               "zero3": False, "set": mp})
    return panels


def panel_segments(panel: dict, rank: int) -> list:
    lay = panel["layout"]
    return lay.segments(rank, panel["group"]) if panel["zero3"] else lay.segments(rank)


def panel_of(ckpt: "ckptlib.Checkpoint", name: str) -> Optional[int]:
    """Index (into :func:`layout_panels`) of the panel that holds parameter ``name`` (its owner if tied)."""
    p = ckpt.param(name)
    if p.tied_to:
        p = ckpt.param(p.tied_to)
    for i, panel in enumerate(layout_panels(ckpt)):
        if p.name in panel["params"]:
            return i
    return None


def layout_figure(ckpt: "ckptlib.Checkpoint", panels: Optional[list[int]] = None, highlight: Optional[str] = None,
                  max_labels: int = 60, width: float = 9.0):
    """Each rank's flat partition as a horizontal bar: parameters coloured, padding hatched.

    ZeRO-1/2: one panel per parameter group (a parameter can run over two ranks). ZeRO-3: one panel per
    sub-group; every parameter has a chunk on every rank (padding at its end on the last ranks).
    ``highlight`` outlines one parameter (a tied alias highlights its owner) and fades the others.
    """
    all_panels = layout_panels(ckpt)
    if not all_panels and ckpt.universal is not None:
        return _message_figure("a universal checkpoint: every tensor whole in its own files (zero/<parameter>/), no "
                               "rank partitions; `ckpt reshard` writes those of N ranks")
    if not all_panels:
        return _message_figure(f"ZeRO stage {ckpt.zero_stage}: no partitioned flat tensors to show "
                               "(every rank holds everything)")
    chosen = [all_panels[i] for i in (panels if panels is not None else range(len(all_panels)))]
    target = None
    if highlight:
        p = ckpt.param(highlight)
        target = p.tied_to or p.name
    n = ckpt.layouts[0].world_size
    order = {p.name: i for i, p in enumerate(x for x in ckpt.parameters if not x.tied_to)}

    def color(name):
        return PALETTE[order[name] % len(PALETTE)] if name in order else param_color(name)

    heights = [0.55 + 0.42 * n for _ in chosen]
    fig = new_figure((width, sum(heights) + 0.9))
    grid = fig.add_gridspec(len(chosen), 1, height_ratios=heights)
    zero3 = chosen[0]["zero3"]
    for row, panel in enumerate(chosen):
        ax = fig.add_subplot(grid[row, 0])
        length = max(panel["length"], 1)
        labels = 0
        from matplotlib.colors import to_rgba

        for r in range(n):
            y = n - 1 - r
            pads, spans, faces, edges, widths = [], [], [], [], []
            segs = panel_segments(panel, r)
            thin = 0.5 if len(segs) <= 150 else 0.0  # white separators only while they can be seen
            for seg in segs:
                x0, w = seg.rank_start, seg.count
                if seg.is_padding:
                    pads.append((x0, w))
                    continue
                picked = seg.name == target
                spans.append((x0, w))
                faces.append(to_rgba(color(seg.name), 0.3 if target is not None and not picked else 0.95))
                edges.append("black" if picked else "white")
                widths.append(2.0 if picked else thin)
                if w / length > 0.06 and labels < max_labels:
                    labels += 1
                    ax.text(x0 + w / 2, y, _short(seg.name, w / length), ha="center", va="center", fontsize=7,
                            color="black", clip_on=True)
            # one collection per rank and kind: thousands of parameters draw in a blink
            if spans:
                ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=faces, edgecolors=edges, linewidths=widths)
            if pads:
                ax.broken_barh(pads, (y - 0.35, 0.7), facecolors=PADDING_COLOR, edgecolors="#888888", hatch="////",
                               linewidths=0.4)
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"rank {n - 1 - i}" for i in range(n)], fontsize=8)
        ax.set_xlim(0, length)
        ax.set_ylim(-0.6, n - 0.4)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{panel['label']}: {len(panel['params'])} parameters, {panel['length']:,} elements "
                     f"per rank", fontsize=9, loc="left")
        if row == len(chosen) - 1:
            ax.set_xlabel("element offset in the rank's flat fp32 tensor", fontsize=8)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=PADDING_COLOR, edgecolor="#888888", hatch="////", label="padding")]
    if target:
        handles.append(Patch(facecolor=color(target), edgecolor="black", linewidth=2, label=target))
    fig.legend(handles=handles, loc="upper right", fontsize=8, frameon=False)
    kind = "ZeRO-3: every parameter split into one chunk per rank" if zero3 else \
        f"ZeRO-{ckpt.zero_stage}: each group is one flat vector cut into {n} equal partitions"
    fig.suptitle(f"{ckpt.location.tag}: {kind}", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def _short(name: str, frac: float) -> str:
    room = max(4, int(frac * 110))
    return name if len(name) <= room else "…" + name[-(room - 1):]


def where_is(ckpt: "ckptlib.Checkpoint", name: str) -> list[dict]:
    """Which ranks hold parameter ``name`` and where: one row per piece (rank, file, group, offset in
    the rank's flat tensor, the parameter's elements there). Frozen parameters and stage 0 say where
    the value is stored instead."""
    p = ckpt.param(name)
    owner = ckpt.param(p.tied_to) if p.tied_to else p
    what = "sub-group" if ckpt.zero_stage == 3 else "group"
    rows = []
    for mp, zs in ckpt.sets.items():  # every set that holds it: its stage(s), or every tensor rank's shard
        if owner.name not in {q.name for q in zs.parameters}:
            continue
        files = {f.dp_rank: f.path.name for f in zs.files if f.kind == "optim_states"}
        where = {"set": set_label(ckpt, mp).rstrip(" ·")} if len(ckpt.sets) > 1 else {}
        for pc in zs.pieces(owner.name):
            rows.append({**where, "rank": pc.rank, "file": files.get(pc.rank, "?"), what: pc.group,
                         "offset": pc.rank_start, "elements": f"{pc.param_start}..{pc.param_start + pc.count}",
                         "count": pc.count})
    if not rows and ckpt.universal is not None:  # one file per state, each the whole tensor
        u = ckpt.main
        frags = u.fragments.get(owner.name, {}) if owner.trainable else {}
        out = [{"rank": "all", "file": frag.info.relpath, "group": owner.group if owner.trainable else "-",
                "offset": frag.start, "elements": f"0..{owner.numel}", "count": owner.numel}
               for key, frag in frags.items() if key != "step"]
        return out or [{"rank": "all", "file": "the model-states file(s)", "group": "-", "offset": "-",
                        "elements": f"0..{owner.numel}", "count": owner.numel}]
    if not rows:
        where = "the model-states file(s)" if not owner.trainable else "the model-states file (stage 0)"
        return [{"rank": "all", "file": where, "group": "-", "offset": "-", "elements": f"0..{owner.numel}",
                 "count": owner.numel}]
    return rows


def where_html(ckpt: "ckptlib.Checkpoint", name: str) -> str:
    p = ckpt.param(name)
    head = f"<b><code>{html.escape(name)}</code></b> {list(p.shape)}, {p.numel:,} elements"
    if p.tied_to:
        head += f" — tied to <code>{html.escape(p.tied_to)}</code> (stored once, there)"
    elif not p.trainable:
        head += " — frozen"
    return head + table_html(where_is(ckpt, name), cls="ckpt-where-table")


__all__ = ["file_rows", "bytes_per_rank", "file_sizes_figure", "file_table_html", "summary_html", "problems_html",
           "parameters_html", "table_html", "layout_panels", "panel_of", "layout_figure", "where_is", "where_html",
           "param_color"]
