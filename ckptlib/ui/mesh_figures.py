"""Pictures of a parallel mesh: experts on expert-parallel ranks, and the pipeline x tensor x data grid of files.

Each function takes a :class:`~ckptlib.Checkpoint` or the dict :func:`ckptlib.describe` gives (its ``placement``)
and returns a :class:`~ckptlib.ui.pictures.Picture` whose facts are exactly
:func:`ckptlib.analysis.meshmap.experts` / :func:`~ckptlib.analysis.meshmap.grid` (None where the picture does not
apply; the figure then says so). The figures stay legible at 64 experts or 8 stages: experts are drawn in rows of
consecutive ids, the grid's cells summarise their tensors and data ranks; the facts stay complete. Metadata only.
"""
from __future__ import annotations

import html
import math
import os
import re
from typing import Any, Optional

from ckptlib.analysis import meshmap

from .figures import PALETTE
from .pictures import Picture
from .plots import new_figure

MAX_ROWS = 16      # expert rows per panel (consecutive experts of one ep rank share a row beyond it)
MAX_PANELS = 4     # MoE layers drawn side by side (the others are placed by the same rule; the facts list them)
MAX_COLUMNS = 8    # ep-rank columns over all panels
EMPTY, EDGE = "#F3F3F3", "#666666"


def _facts(src: Any, key: str) -> Optional[dict]:
    """``key``'s facts from a Checkpoint (computed), ``describe()``'s dict, its ``placement`` dict, or the facts."""
    if not isinstance(src, dict):
        return getattr(meshmap, key)(src)
    if "placement" in src:
        return (src["placement"] or {}).get(key)
    if "groups" in src or "whole_matrices" in src:
        return src.get(key)
    return src or None


def _blank(kind: str, text: str) -> Picture:
    fig = new_figure((6.4, 0.9))
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=10)
    return Picture(fig, kind, None, html.escape(text))


def _base(path: Optional[str]) -> str:
    """A file's name without the folder and DeepSpeed's common tail."""
    if not path:
        return "—"
    name = os.path.basename(path)
    for tail in ("_mp_rank_00_model_states.pt", "-model_states.pt", "_model_states.pt", "_optim_states.pt", ".pt"):
        if name.endswith(tail):
            return name[:-len(tail)]
    return name


def _span(ids: list, width: int = 0) -> str:
    """``[0, 1, 2, 5]`` -> ``"0–2, 5"`` (``width``: numbers zero-padded to it)."""
    ids, out, i = sorted(ids), [], 0
    f = (lambda n: f"{n:0{width}d}") if width else str
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(f(ids[i]) if i == j else f"{f(ids[i])}–{f(ids[j])}")
        i = j + 1
    return ", ".join(out)


def _fit(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:max(1, chars - 1)] + "…"


# ============================================================================================== experts
def _rows(layer: dict) -> list[list[dict]]:
    """The layer's experts in rows: one expert each, or consecutive experts of one ep rank beyond MAX_ROWS."""
    experts = layer["experts"]
    per = max(1, math.ceil(len(experts) / MAX_ROWS))
    rows, run = [], []
    for x in experts:
        if run and (x["ep_rank"] != run[-1]["ep_rank"] or len(run) == per or x["expert"] != run[-1]["expert"] + 1):
            rows.append(run)
            run = []
        run.append(x)
    return rows + ([run] if run else [])


def _cell_text(run: list[dict], fmt: str, chars: int) -> str:
    ids = [x["expert"] for x in run]
    if fmt == meshmap.UNIVERSAL:
        files = sorted({z["file"] for x in run for z in x.get("zero", []) if z["key"] == "fp32"})
        where = f"zero/ ({len(files)} fp32 file{'s' if len(files) != 1 else ''})"
    elif run[0]["file"]:
        base = _base(run[0]["file"])
        where = base if len(run) == 1 else base.rsplit("_", 1)[0] + "_{" + _span(ids) + "}"
    else:
        where = "in partitions of " + ", ".join(_rank_file(f) for f in
                                               sorted({s["file"] for x in run for s in x["state_files"]}))
    state = sorted({r["data_rank"] for x in run for r in x["replicas"] if r["elements"]})
    lines = [_fit(where, chars)]
    if fmt == meshmap.UNIVERSAL:
        lines.append("every tensor whole; no rank files")
    elif state:
        lines.append(_fit("state: dp " + ", ".join(map(str, state)), chars))
    elif run[0]["state_files"]:
        lines.append(_fit("state: " + _base(run[0]["state_files"][0]["file"]), chars))
    return "\n".join(lines)


def experts_picture(src: Any) -> Picture:
    """Experts x ep ranks for each MoE layer (up to :data:`MAX_PANELS` side by side): a column per expert-parallel
    rank, headed with the data ranks of its expert-data-parallel group; a row per expert (or per run of
    consecutive experts of one ep rank when there are more than :data:`MAX_ROWS`); the cell of the ep rank that
    holds it names the file of its 16-bit weights (ZeRO-3: the partitions that hold it; a universal folder: its
    ``zero/`` files) and, as small boxes, each replica (data rank) of its expert-data-parallel group, filled where
    that replica's optimizer file holds part of its state. Facts: :func:`ckptlib.analysis.meshmap.experts`."""
    from matplotlib.patches import Rectangle

    facts = _facts(src, "experts")
    if not facts:
        return _blank("experts", "not a mixture of experts: no expert placement to show")
    ep, layers = max(1, facts["ep"]), facts["layers"]
    panels = max(1, min(len(layers), MAX_PANELS, MAX_COLUMNS // ep))
    shown = layers[:panels]
    nrows = max(len(_rows(L)) for L in shown)
    colw = 2.2 if ep <= 4 else 1.9
    fig = new_figure((min(18.0, 1.3 + panels * (ep * colw + 0.3)), 1.5 + 0.5 * nrows))
    font = 7 if nrows <= 12 else 6.5
    chars = int(colw * 72 / (font * 0.62))
    for pi, layer in enumerate(shown):
        ax = fig.add_subplot(1, panels, pi + 1)
        rows = _rows(layer)
        for i, run in enumerate(rows):
            e = run[0]["ep_rank"]
            for col in range(ep):
                held = col == e
                color = PALETTE[col % len(PALETTE)] if held else EMPTY
                ax.add_patch(Rectangle((col, i), 1, 1, facecolor=color, alpha=0.35 if held else 1.0,
                                       edgecolor="white", linewidth=1.0))
            ax.text(e + 0.5, i + 0.38, _cell_text(run, facts["format"], chars), ha="center", va="center",
                    fontsize=font, clip_on=True)
            reps = run[0]["replicas"]
            if 0 < len(reps) <= 8:
                w = 0.9 / len(reps)
                for k, r in enumerate(reps):
                    has = any(x["replicas"][k]["elements"] for x in run if k < len(x["replicas"]))
                    ax.add_patch(Rectangle((e + 0.05 + k * w, i + 0.72), w * 0.9, 0.2, linewidth=0.6,
                                           facecolor=PALETTE[e % len(PALETTE)] if has else "white", edgecolor=EDGE))
                    ax.text(e + 0.05 + (k + 0.45) * w, i + 0.82, str(r["data_rank"]), ha="center", va="center",
                            fontsize=max(5.0, font - 1.5))
        heads = []
        for er in facts["ep_ranks"]:
            d = er["data_ranks"]
            heads.append(f"ep {er['ep_rank']}" + (f"\ndp {_span(d)}" if d else ""))
        ax.set_xticks([c + 0.5 for c in range(ep)])
        ax.set_xticklabels(heads[:ep] + [f"ep {c}" for c in range(len(heads), ep)], fontsize=font + 1)
        ax.xaxis.tick_top()
        ax.set_yticks([i + 0.5 for i in range(len(rows))])
        ax.set_yticklabels([("expert " if len(r) == 1 else "experts ") + _span([x["expert"] for x in r])
                            for r in rows], fontsize=font + 0.5)
        ax.set_xlim(0, ep)
        ax.set_ylim(max(len(rows), 1), 0)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"MoE layer {layer['layer']}: {layer['module']} ({layer['num_experts']} experts, "
                     f"{layer['num_local']} per ep rank)", fontsize=font + 1.5, pad=24)
    more = f"; {len(layers) - panels} more layer(s) placed by the same rule (in the facts)" if len(layers) > panels else ""
    kind = "AutoEP" if facts["kind"] == meshmap.AUTOEP else "DeepSpeed-MoE"
    stage = facts["zero_stage"]
    fig.suptitle(f"{facts['tag']}: {kind}, ep {facts['ep']} x expert-data-parallel {facts['edp']}"
                 + (f" (ZeRO-{stage})" if stage is not None else "") + more, fontsize=9.5, x=0.01, ha="left")
    fig.tight_layout()
    return Picture(fig, "experts", facts, _experts_caption(facts))


def _experts_caption(f: dict) -> str:
    kind = "AutoEP" if f["kind"] == meshmap.AUTOEP else "DeepSpeed-MoE"
    where = {meshmap.PER_EXPERT_FILES: "each expert's 16-bit weights in its own file "
                                       "(<code>layer_L_expert_G_mp_rank_XX_model_states.pt</code>)",
             meshmap.ZERO3_PARTITIONED: "no per-expert files: the experts live only in the fp32 partitions of their "
                                        "expert-data-parallel group's <code>zero_pp_rank_*</code> optimizer files",
             meshmap.UNIVERSAL: "a universal folder: every expert whole in <code>zero/</code>"}[f["format"]]
    n = sum(len(L["experts"]) for L in f["layers"])
    return (f"<b>{kind}</b>, ep {f['ep']} x expert-data-parallel {f['edp']} over {f['dp']} data ranks, "
            f"{len(f['layers'])} MoE layer(s), {n} experts: {where}. {html.escape(f['rank_rule'])}. "
            "The small boxes in a cell are the expert's replicas (data ranks of its expert-data-parallel group), "
            "filled where that rank's optimizer file holds part of its state.")


# ============================================================================================== grid
def _cell_lines(cell: dict, big: bool) -> list[str]:
    ms = [os.path.basename(m) for m in cell["model_states"]]
    lines = [ms[0] + (f" (+{len(ms) - 1} more)" if len(ms) > 1 else "") if ms else "no model-states file"]
    if cell["layers"]:
        ids = [x["layer"] for x in cell["layers"]]
        tail = f"-model_{cell['tp_rank']:02d}" if cell["tp_rank"] is not None else ""
        lines.append(f"layers {_span(ids)}: layer_" + ("{" + _span(ids, 2) + "}" if len(ids) > 1 else f"{ids[0]:02d}")
                     + tail)
    split = [t for t in cell["tensors"] if not t["whole"]]
    rep = [t for t in cell["tensors"] if t["replicated"]]
    if split:
        dims: dict = {}
        for t in split:
            dims[t["dim"]] = dims.get(t["dim"], 0) + 1
        lines.append("split: " + ", ".join(f"{n} on dim {d}" if d is not None else f"{n} in pieces"
                                           for d, n in sorted(dims.items(), key=lambda kv: str(kv[0])))
                     + (f"; {len(rep)} replicated" if rep else ""))
        if not big:
            for t in split[:3]:
                if t["range"] is not None:
                    lines.append(f"  {t['name']} [{t['range'][0]}:{t['range'][1]}) of {t['shape'][t['dim']]}")
    elif cell["tensors"]:
        lines.append(f"{len(cell['tensors'])} tensors whole" + (f" ({len(rep)} also on other ranks)" if rep else ""))
    return lines


def _rank_file(path: Optional[str]) -> str:
    """``bf16_zero_pp_rank_3_mp_rank_01_optim_states.pt`` -> ``bf16_zero_pp_rank_3`` (the cell names the mp rank)."""
    return re.sub(r"_mp_rank_\d+$", "", _base(path)) if path else "no file"


def _data_text(data: list, chars: int) -> list[str]:
    if len(data) > 4:
        sizes = sorted({d["elements"] for d in data})
        files = [d["file"] for d in data if d["file"]]
        ranks = _span([d["dp_rank"] for d in data])
        name = re.sub(r"\d+$", "{" + ranks + "}", _rank_file(files[0])) if files else "no file"
        return [_fit(f"dp {ranks}: {name}, {sizes[0]:,}" + (f"–{sizes[-1]:,}" if len(sizes) > 1 else "")
                     + " el each", chars)]
    return [_fit(f"dp {d['dp_rank']}: {_rank_file(d['file'])}" + (f" · {d['elements']:,} el" if d["partitions"] else ""),
                 chars) for d in data]


def grid_picture(src: Any) -> Picture:
    """The pipeline x tensor x data grid: a row per stage, a column per tensor rank; each cell names its model-states
    file, the layer files it holds (pipeline) and how its tensors are split (tensor parallel: how many on each dim,
    how many replicated, the first slices), with a box per data rank naming its optimizer-states file and the
    elements of its partitions (more than 4 data ranks: one summary line). Facts:
    :func:`ckptlib.analysis.meshmap.grid`."""
    from matplotlib.patches import Rectangle

    facts = _facts(src, "grid")
    if not facts:
        return _blank("grid", "neither pipeline nor tensor parallel: no pp x tp x dp grid to show")
    stages = sorted({c["stage"] for c in facts["cells"]}, key=lambda s: -1 if s is None else s)
    tps = sorted({c["tp_rank"] for c in facts["cells"]}, key=lambda t: -1 if t is None else t)
    big = len(stages) * len(tps) > 8
    cw = 3.6 if len(tps) <= 2 else max(1.9, 14.0 / len(tps))
    font = 7 if not big else 6
    chars = int(cw * 72 / (font * 0.62))
    ndata = max((len(c["data"]) if len(c["data"]) <= 4 else 1 for c in facts["cells"]), default=1)
    nlines = max((len(_cell_lines(c, big)) for c in facts["cells"]), default=1) + 1
    ch = (nlines + ndata) * 0.16 + 0.3
    fig = new_figure((min(18.0, 1.0 + cw * len(tps)), 0.9 + ch * len(stages)))
    ax = fig.add_subplot(1, 1, 1)
    for c in facts["cells"]:
        x, y = tps.index(c["tp_rank"]), stages.index(c["stage"])
        color = PALETTE[(c["stage"] or 0) % len(PALETTE)]
        ax.add_patch(Rectangle((x + 0.02, y + 0.02), 0.96, 0.96, facecolor=color, alpha=0.18, edgecolor=EDGE))
        head = c["label"] or "the one set"
        text = [f"{head} (mp_rank_{c['mp_rank']:02d})"] + [_fit(s, chars) for s in _cell_lines(c, big)]
        ax.text(x + 0.05, y + 0.06, "\n".join(text), ha="left", va="top", fontsize=font, clip_on=True,
                linespacing=1.25)
        data = _data_text(c["data"], chars - 2)
        top = 1 - 0.06 - len(data) * (0.9 / (nlines + len(data)))
        h = (0.94 - top) / max(len(data), 1)
        for k, line in enumerate(data):
            ax.add_patch(Rectangle((x + 0.05, y + top + k * h), 0.9, h * 0.9, facecolor="white", edgecolor=color,
                                   linewidth=0.8))
            ax.text(x + 0.08, y + top + (k + 0.45) * h, line, ha="left", va="center", fontsize=font - 0.5,
                    clip_on=True)
    ax.set_xlim(0, len(tps))
    ax.set_ylim(len(stages), 0)
    ax.set_xticks([i + 0.5 for i in range(len(tps))])
    ax.set_xticklabels(["" if t is None else f"tensor rank {t}" for t in tps], fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([i + 0.5 for i in range(len(stages))])
    ax.set_yticklabels(["" if s is None else f"stage {s}" for s in stages], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    fig.suptitle(f"{facts['tag']}: pp {facts['pp']} x tp {facts['tp']} x dp {facts['dp']}"
                 + (f" (ZeRO-{facts['zero_stage']})" if facts["zero_stage"] is not None else ""),
                 fontsize=9.5, x=0.01, ha="left")
    fig.tight_layout()
    return Picture(fig, "grid", facts, _grid_caption(facts))


def _grid_caption(f: dict) -> str:
    layers = f["layers"]
    split = sum(1 for c in f["cells"] for t in c["tensors"] if not t["whole"])
    text = (f"<b>{html.escape(f['kind'].replace('_', ' '))}</b>: {f['pp']} stage(s) x {f['tp']} tensor rank(s) x "
            f"{f['dp']} data rank(s), {len(f['cells'])} model-parallel sets. {html.escape(f['rank_rule'])}.")
    if layers:
        text += f" {len(layers)} layer file(s), each held by the stage shown."
    if split:
        text += f" {split} tensor slices (dim and range per tensor rank in the facts)."
    for note in f["notes"]:
        text += " " + html.escape(note) + "."
    return text


__all__ = ["experts_picture", "grid_picture", "MAX_ROWS", "MAX_PANELS"]
