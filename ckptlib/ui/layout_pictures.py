"""Pictures of where the fp32 partitions lie: each rank's flat tensors with the optimizer of each group, Muon's
whole matrices at ZeRO-1/2, and a universal folder's states. Metadata only (nothing here reads tensor data).

Each ``*_picture`` function returns a :class:`~ckptlib.ui.pictures.Picture`: the figure and the facts it draws
(from :mod:`ckptlib.analysis.placement`, the ``placement`` of ``ckpt inspect --json``, and the checkpoint's own
pieces, :meth:`~ckptlib.deepspeed.zeroset.ZeroSet.pieces`, the same the reader uses), so that a test or a reader of
the page finds every fact drawn.
"""
from __future__ import annotations

import html
from typing import Optional

import ckptlib
from ckptlib.analysis import placement
from ckptlib.kinds.optimizers import WHOLE_PARAMS

from .figures import PADDING_COLOR, PALETTE, table_html
from .pictures import Picture
from .plots import new_figure

#: facts list every segment of every row only up to this many (a large ZeRO-3 model has one per parameter and
#: rank); beyond it, each row gives its counts and the figure still draws them all
MAX_SEGMENT_FACTS = 4000


def _display(local: str) -> str:
    """An AutoEP ep rank's stacked experts ``...experts.w1@ep1`` as ``...experts.w1 (ep 1)``."""
    base, sep, ep = local.partition("@ep")
    return f"{base} (ep {ep})" if sep else local


def _model_names(ckpt: "ckptlib.Checkpoint") -> dict:
    """``{(mp, set-local name): the model's name}`` of every trainable parameter's blocks."""
    out = {}
    view = ckpt.view
    for p in ckpt.parameters:
        if p.tied_to:
            continue
        if view is None:
            out[(ckpt.main.mp, p.name)] = p.name
            continue
        for b in view.blocks.get(p.name, ()):
            if isinstance(b.source, tuple) and len(b.source) == 2:
                out.setdefault(b.source, p.name)
    return out


def layout_panels(ckpt: "ckptlib.Checkpoint") -> list[dict]:
    """The flat tensors a layout picture shows: :func:`ckptlib.analysis.placement.groups` (each group or sub-group
    of every ZeRO set, with its optimizer and state keys), each with ``rows``: per data rank that holds part of it,
    its ``segments`` ``[start, count, name]`` in its flat tensor, from the checkpoint's own pieces (an AutoEP expert
    group's rows are the ranks of each ep rank's expert-data group). Gaps are padding."""
    panels = placement.groups(ckpt)
    at = {(p["set"], p["group"]): p for p in panels}
    for p in panels:
        p["rows"] = {}
    names = _model_names(ckpt)
    for mp, zs in ckpt.sets.items():
        for q in zs.parameters:
            if not q.trainable or q.tied_to:
                continue
            for pc in zs.pieces(q.name):
                panel = at.get((mp, pc.group))
                if panel is None:
                    continue
                label = names.get((mp, q.name)) or q.name
                shown = _display(q.name) if "@ep" in q.name else label
                panel["rows"].setdefault(pc.rank, []).append([pc.rank_start, pc.count, shown, label])
    for p in panels:
        p["rows"] = [{"rank": r, "segments": sorted(segs)} for r, segs in sorted(p["rows"].items())]
    return panels


def panel_of(ckpt: "ckptlib.Checkpoint", name: str, panels: Optional[list] = None) -> Optional[int]:
    """Index (into :func:`layout_panels`) of the first panel that holds parameter ``name`` (its owner if tied)."""
    p = ckpt.param(name)
    target = p.tied_to or p.name
    for i, panel in enumerate(panels if panels is not None else layout_panels(ckpt)):
        if any(s[3] == target for row in panel["rows"] for s in row["segments"]):
            return i
    return None


def _keys_text(panel: dict) -> str:
    keys = ", ".join(k["key"] + (" (whole matrices)" if k["layout"] == WHOLE_PARAMS else "") for k in panel["keys"])
    return f"{panel['optimizer'] or 'no optimizer state'}" + (f": {keys}" if keys else "")


def layout_picture(ckpt: "ckptlib.Checkpoint", panels: Optional[list[int]] = None, highlight: Optional[str] = None,
                   max_labels: int = 60, width: float = 9.0) -> Picture:
    """Each rank's flat partition of each group as a horizontal bar: parameters coloured, padding hatched, each group
    titled with the optimizer that steps it and the state keys it keeps (a Muon group's ``momentum_buffer`` marked
    "whole matrices": see :func:`muon_picture`).

    ZeRO-1/2: one panel per parameter group (a parameter can run over two ranks). ZeRO-3: one panel per sub-group;
    every parameter has a chunk on every rank of its group. ``highlight`` outlines one parameter (a tied alias
    highlights its owner) and fades the others. The facts: each shown panel of :func:`layout_panels`, and the
    highlighted parameter."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    all_panels = layout_panels(ckpt)
    tag = ckpt.location.tag
    if not all_panels:
        text = ("a universal checkpoint: every tensor whole in its own files (zero/<parameter>/), no rank partitions; "
                "`ckpt reshard` writes those of N ranks" if ckpt.universal is not None else
                f"ZeRO stage {ckpt.zero_stage}: no partitioned flat tensors to show (every rank holds everything)")
        fig = new_figure((6.4, 1.2))
        fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, wrap=True)
        return Picture(fig, "groups", {"tag": tag, "zero_stage": ckpt.zero_stage, "panels": [], "why": text},
                       html.escape(text))
    chosen = [all_panels[i] for i in (panels if panels is not None else range(len(all_panels)))]
    target = None
    if highlight:
        p = ckpt.param(highlight)
        target = p.tied_to or p.name
    order = {p.name: i for i, p in enumerate(x for x in ckpt.parameters if not x.tied_to)}

    def color(name):
        return PALETTE[order[name] % len(PALETTE)] if name in order else PALETTE[hash(name) % len(PALETTE)]

    heights = [0.75 + 0.42 * max(1, len(panel["rows"])) for panel in chosen]
    fig = new_figure((width, sum(heights) + 0.9))
    grid = fig.add_gridspec(len(chosen), 1, height_ratios=heights)
    for row_i, panel in enumerate(chosen):
        ax = fig.add_subplot(grid[row_i, 0])
        length = max(panel["elements_per_rank"], 1)
        rows = panel["rows"]
        n = max(1, len(rows))
        labels = 0
        for i, row in enumerate(rows):
            y = n - 1 - i
            spans, faces, edges, widths, pads = [], [], [], [], []
            thin = 0.5 if len(row["segments"]) <= 150 else 0.0
            end = 0
            for start, count, shown, name in row["segments"]:
                if start > end:
                    pads.append((end, start - end))
                end = max(end, start + count)
                picked = name == target
                spans.append((start, count))
                faces.append(to_rgba(color(name), 0.3 if target is not None and not picked else 0.95))
                edges.append("black" if picked else "white")
                widths.append(2.0 if picked else thin)
                if count / length > 0.06 and labels < max_labels:
                    labels += 1
                    ax.text(start + count / 2, y, _short(shown, count / length), ha="center", va="center",
                            fontsize=7, clip_on=True)
            if end < length:
                pads.append((end, length - end))
            if spans:
                ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=faces, edgecolors=edges, linewidths=widths)
            if pads:
                ax.broken_barh(pads, (y - 0.35, 0.7), facecolors=PADDING_COLOR, edgecolors="#888888", hatch="////",
                               linewidths=0.4)
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"rank {rows[n - 1 - i]['rank']}" if rows else "" for i in range(n)], fontsize=8)
        ax.set_xlim(0, length)
        ax.set_ylim(-0.6, n - 0.4)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{panel['label']} — {_keys_text(panel)}"
                     + (f"; step {panel['step']}" if panel["step"] is not None else "")
                     + f" — {len(panel['parameters'])} parameters, {panel['elements_per_rank']:,} elements per rank",
                     fontsize=9, loc="left")
        if row_i == len(chosen) - 1:
            ax.set_xlabel("element offset in the rank's flat master tensor", fontsize=8)
    handles = [Patch(facecolor=PADDING_COLOR, edgecolor="#888888", hatch="////", label="padding")]
    if target:
        handles.append(Patch(facecolor=color(target), edgecolor="black", linewidth=2, label=target))
    fig.legend(handles=handles, loc="upper right", fontsize=8, frameon=False)
    zero3 = chosen[0]["zero3"]
    kind = ("ZeRO-3: every parameter split into one chunk per rank" if zero3 else
            f"ZeRO-{ckpt.zero_stage}: each group is one flat vector cut into equal partitions")
    fig.suptitle(f"{tag}: {kind}", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    facts = {"tag": tag, "zero_stage": ckpt.zero_stage, "panels": [_panel_facts(p) for p in chosen],
             "highlight": target}
    caption = "; ".join(f"<b>{html.escape(p['label'])}</b>: {html.escape(_keys_text(p))}" for p in chosen)
    return Picture(fig, "groups", facts, caption)


def _panel_facts(panel: dict) -> dict:
    out = {k: v for k, v in panel.items() if k != "rows"}
    total = sum(len(r["segments"]) for r in panel["rows"])
    out["rows"] = [{"rank": r["rank"], "elements": sum(s[1] for s in r["segments"]), "parameters": len(r["segments"]),
                    **({"segments": [s[:3] for s in r["segments"]]} if total <= MAX_SEGMENT_FACTS else {})}
                   for r in panel["rows"]]
    return out


layout_figure = layout_picture  # the name the notebooks have called it by


def _short(name: str, frac: float) -> str:
    room = max(4, int(frac * 110))
    return name if len(name) <= room else "…" + name[-(room - 1):]


# ============================================================================================ Muon
def muon_picture(ckpt: "ckptlib.Checkpoint") -> Optional[Picture]:
    """Muon at ZeRO-1/2 (a state kept per whole matrix): for each rank, its flat partition of the group and, beside
    it, the whole matrices its ``momentum_buffer`` holds; a matrix that straddles two partitions is held whole by
    both ranks, marked on both (red outline, hatched). The facts: :func:`ckptlib.analysis.placement.whole_matrices`.
    None where no group keeps such a state."""
    from matplotlib.patches import Patch

    groups = placement.whole_matrices(ckpt)
    if not groups:
        return None
    order = {p.name: i for i, p in enumerate(x for x in ckpt.parameters if not x.tied_to)}

    def color(name):
        return PALETTE[order.get(name, hash(name)) % len(PALETTE)]

    nrows = sum(len(g["ranks"]) for g in groups)
    fig = new_figure((9.5, 0.9 + 1.05 * nrows + 0.5 * len(groups)))
    grid = fig.add_gridspec(len(groups), 1, height_ratios=[len(g["ranks"]) + 0.6 for g in groups])
    for gi, g in enumerate(groups):
        ax = fig.add_subplot(grid[gi, 0])
        n = len(g["ranks"])
        longest = max([r["length"] for r in g["ranks"]] + [g["partition"], 1])
        ticks, labels = [], []
        for i, r in enumerate(g["ranks"]):
            y = (n - 1 - i) * 1.0
            start, end = r["partition"]
            # the rank's flat partition: the slice of each matrix that lies in it
            for m in r["matrices"]:
                lo, hi = max(m["offset"], start), min(m["offset"] + m["numel"], end)
                if hi > lo:
                    ax.broken_barh([(lo - start, hi - lo)], (y + 0.08, 0.32), facecolors=color(m["name"]),
                                   edgecolors="white", linewidths=0.4)
            # its momentum: every matrix it touches, whole
            for m in r["matrices"]:
                ax.broken_barh([(m["state_offset"], m["numel"])], (y - 0.42, 0.4), facecolors=color(m["name"]),
                               edgecolors="#C62828" if m["straddles"] else "white",
                               linewidths=1.6 if m["straddles"] else 0.4, hatch="xx" if m["straddles"] else None)
                if m["numel"] / longest > 0.08:
                    ax.text(m["state_offset"] + m["numel"] / 2, y - 0.22, _short(m["name"], m["numel"] / longest),
                            ha="center", va="center", fontsize=6.5)
            ax.axvline(0, color="#999", linewidth=0.5)
            ticks += [y + 0.24, y - 0.22]
            labels += [f"rank {r['rank']} partition [{start:,}, {end:,})",
                       f"rank {r['rank']} {g['key']}: {r['length']:,}" + (f" (file: {r['stored']:,})"
                                                                          if r["stored"] is not None else "")]
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xlim(0, longest * 1.02)
        ax.set_ylim(-0.6, n - 0.4)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{g['label']} ({g['optimizer']}): each rank keeps the whole {g['key']} of every matrix\n"
                     f"its partition of {g['partition']:,} elements touches", fontsize=9, loc="left")
    ax.set_xlabel("elements (a partition from its start; a momentum buffer from its start)", fontsize=8)
    fig.legend(handles=[Patch(facecolor="#dddddd", edgecolor="#C62828", hatch="xx", linewidth=1.6,
                              label="straddles a partition boundary: held whole by both ranks")],
               loc="upper right", fontsize=8, frameon=False)
    fig.suptitle(f"{ckpt.location.tag}: Muon at ZeRO-{ckpt.zero_stage}: whole matrices per rank", fontsize=10,
                 x=0.01, ha="left")
    fig.tight_layout()
    straddling = sorted({m["name"] for g in groups for r in g["ranks"] for m in r["matrices"] if m["straddles"]})
    caption = (f"{len(groups)} group(s) keep <code>{html.escape(groups[0]['key'])}</code> per whole matrix: a rank holds "
               "more than its partition" + (f"; held whole by two ranks: {html.escape(', '.join(straddling))}"
                                           if straddling else "; no matrix straddles a partition boundary"))
    return Picture(fig, "muon", {"tag": ckpt.location.tag, "groups": groups}, caption)


# ============================================================================================ universal
def universal_picture(ckpt: "ckptlib.Checkpoint", limit: int = 60) -> Optional[Picture]:
    """A universal folder: its parameters (rows) with the states each holds (columns: ``fp32`` the master, the
    optimizer's keys, ``step``), its frozen parameters and buffers with where their value is, and what it lacks
    (red): the facts of :func:`ckptlib.analysis.placement.universal`. The first ``limit`` rows drawn (the facts
    list all). None for a native checkpoint."""
    u = placement.universal(ckpt)
    if u is None:
        return None
    keys = u["keys"] + ["step"]
    rows = [(p["name"], {k: k in p["states"] or (k == "step" and p["step"] is not None) for k in keys}, "trainable")
            for p in u["parameters"]]
    rows += [(f["name"], {"value": f["file"] is not None}, "frozen") for f in u["frozen"]]
    rows += [(b["name"], {"value": b["file"] is not None}, "buffer") for b in u["buffers"]]
    cols = keys + ["value"]
    shown = rows[:limit]
    fig = new_figure((2.2 + 0.9 * len(cols), 0.9 + 0.22 * max(1, len(shown))))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, held, kind) in enumerate(shown):
        y = len(shown) - 1 - i
        for j, c in enumerate(cols):
            if c not in held:
                continue
            ok = held[c]
            ax.add_patch(_cell(j, y, "#55A868" if ok else "#C62828", kind))
            if not ok:
                ax.text(j, y, "✗", ha="center", va="center", fontsize=8, color="white")
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(-0.5, max(1, len(shown)) - 0.5)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, fontsize=8, rotation=30, ha="right")
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([f"{n} ({k})" if k != "trainable" else n for n, _, k in reversed(shown)], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_title(f"{ckpt.location.tag}: what the universal folder holds (green) and lacks (red)"
                 + (f"; first {limit} of {len(rows)} tensors" if len(rows) > limit else ""), fontsize=9, loc="left")
    fig.tight_layout()
    lacks = u["absent"]
    caption = (f"{len(u['parameters'])} parameters with {', '.join(u['keys'])}"
               + (f"; {len(u['frozen'])} frozen parameters" if u["frozen"] else "")
               + (f"; {len(u['buffers'])} buffers" if u["buffers"] else "")
               + ("; <b style='color:#b71c1c'>lacks:</b> " + html.escape("; ".join(lacks)) if lacks else
                  "; it lacks nothing the model needs"))
    return Picture(fig, "universal", u, caption)


def _cell(x, y, color, kind):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.42, y - 0.4), 0.84, 0.8, facecolor=color, edgecolor="white",
                     alpha=0.95 if kind == "trainable" else 0.7)


# ============================================================================================ where
def where_is(ckpt: "ckptlib.Checkpoint", name: str) -> list[dict]:
    """Which ranks hold parameter ``name`` and where: one row per piece (rank, file, group, offset in the rank's flat
    tensor, the parameter's elements there), over every block the model joins it from (each stage or tensor rank
    that holds it, each ep rank's experts). Frozen parameters, stage 0 and universal folders say where the value
    is stored instead."""
    p = ckpt.param(name)
    owner = ckpt.param(p.tied_to) if p.tied_to else p
    what = "sub-group" if ckpt.zero_stage == 3 else "group"
    view = ckpt.view
    sources = ([s for b in view.blocks.get(owner.name, ()) for s in (b.source, *b.replicas) if isinstance(s, tuple)]
               if view is not None else [(ckpt.main.mp, owner.name)])  # a tied module's copy on another stage too
    rows = []
    for mp, local in dict.fromkeys(sources):
        zs = ckpt.sets.get(mp)
        if zs is None or local not in {q.name for q in zs.parameters}:
            continue
        files = {f.dp_rank: f.path.name for f in zs.files if f.kind == "optim_states"}
        where = {"set": ckpt.set_label(mp)} if len(ckpt.sets) > 1 else {}
        if "@ep" in local:  # an AutoEP ep rank's stacked experts
            where["ep rank"] = int(local.rpartition("@ep")[2])
        for pc in zs.pieces(local):
            rows.append({**where, "rank": pc.rank, "file": files.get(pc.rank, "?"), what: pc.group,
                         "offset": pc.rank_start, "elements": f"{pc.param_start}..{pc.param_start + pc.count}",
                         "count": pc.count})
    if not rows and ckpt.universal is not None:  # one file per state, each the whole tensor
        frags = ckpt.main.fragments.get(owner.name, {}) if owner.trainable else {}
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


def straddling(ckpt: "ckptlib.Checkpoint") -> Optional[str]:
    """A trainable parameter held by more than one rank (the largest such), else the largest trainable one; None
    where nothing is trainable."""
    trainable = [p for p in ckpt.parameters if p.trainable and not p.tied_to]
    if not trainable:
        return None
    split = [p for p in trainable if len({r["rank"] for r in where_is(ckpt, p.name)}) > 1]
    return max(split or trainable, key=lambda p: p.numel).name


__all__ = ["layout_panels", "panel_of", "layout_picture", "layout_figure", "muon_picture", "universal_picture",
           "where_is", "where_html", "straddling", "MAX_SEGMENT_FACTS"]
