"""A peft adapter checkpoint in a notebook: its modules, how far each moved, the Trainer's adapter file judged, and a
wizard that exports the adapter (or merges it into its base).

- :func:`adapter_table_html` — the modules (class ``ckpt-adapter-table``): method, r, alpha, scaling (the
  patterns that set them), the adapter's tensors, ``‖ΔW‖``, ``‖W‖`` and their ratio;
- :func:`movement_picture` — the movement figure as a :class:`~ckptlib.ui.pictures.Picture` (kind ``"adapter"``,
  its facts the per-module numbers);
- :func:`adapter_file_html` — the Trainer's ``adapter_model.safetensors`` judged, in a box coloured by what it holds
  (class ``ckpt-adapter-file`` and ``ckpt-adapter-file-<status>``);
- :class:`AdapterView` — the three together (a widget; as a cell's result it also carries them as HTML);
- :class:`AdapterWizard` — export the adapter as peft saves it, or merge it into the base: plan → preflight → run
  (progress, memory chart, Cancel) → verify → summary, as :class:`~ckptlib.ui.ExportWizard`.

The numbers come from :func:`ckptlib.analysis.adapter.module_rows` (metadata and the adapter's own small tensors;
the base's tensors streamed), the judgement from :func:`ckptlib.analysis.adapter.check_weights_file`.
"""
from __future__ import annotations

import html
import os
from typing import Optional, Union

import ipywidgets as widgets

import ckptlib
from ckptlib.analysis.adapter import COPY16, DIFFERENT, EMPTY, NAMES, SAME, describe_adapter, module_rows
from ckptlib.dtypes import OUTPUT_DTYPES
from ckptlib.units import human_bytes

from .common import ErrorArea, as_checkpoint, find_path, guarded
from .figures import table_html
from .pictures import Picture, picture_widget
from .plots import new_figure
from .wizards import ExportWizard

#: the box's colours by the file's status: (border and title, background)
FILE_COLORS = {SAME: ("#2e7d32", "#e8f5e9"), COPY16: ("#e65100", "#fff3e0"), EMPTY: ("#b71c1c", "#ffebee"),
               DIFFERENT: ("#b71c1c", "#ffebee"), NAMES: ("#b71c1c", "#ffebee"), "unreadable": ("#b71c1c", "#ffebee"),
               None: ("#555555", "#f5f5f5")}
#: what each status means for the user, in one sentence
FILE_MEANING = {
    SAME: "it holds the fp32 masters themselves: PeftModel.from_pretrained loads the trained adapter exactly",
    COPY16: "it holds 16-bit copies (each value the master rounded): loading it loses the masters' low bits; "
            "ckpt export --adapter writes the fp32 masters",
    EMPTY: "it holds NO trained weight: PeftModel.from_pretrained would load the untrained adapter; the trained one "
           "is only in the DeepSpeed checkpoint (ckpt export --adapter writes it)",
    DIFFERENT: "its values are not the masters' (an older save or another run): do not use it; ckpt export --adapter "
               "writes the masters",
    NAMES: "its tensors do not pair with the checkpoint's adapter: not this run's file",
    "unreadable": "it cannot be read as safetensors",
    None: "there is no adapter_model.safetensors beside the tag: ckpt export --adapter writes one",
}
METHOD_COLORS = {"LoRA": "#1565c0", "rsLoRA": "#6a1b9a", "DoRA": "#00838f", "DoRA + rsLoRA": "#2e7d32",
                 "modules_to_save": "#ef6c00", "bias": "#8d6e63"}
DORA_NOTE = ("for DoRA the norm is that of the change before the magnitude rescale (DoRA then scales each row of "
             "W + ΔW to its trained magnitude)")


def _num(x, fmt: str = ".4g") -> str:
    return "-" if x is None else format(x, fmt)


def adapter_line(d: dict) -> str:
    """``peft LoRA: r=4, alpha=8 (scaling 2); 8 tensors on q_proj, v_proj``: the adapter in one line."""
    if "refused" in d:
        return f"a peft adapter ckptlib cannot place: {d['refused']}"
    if not d.get("method"):
        return "a peft adapter without adapter_config.json beside the tag (method, r and alpha unknown)"
    targets = d["target_modules"] if isinstance(d["target_modules"], str) else ", ".join(d["target_modules"])
    return (f"peft {d['method']}: r={d['r']}, alpha={d['alpha']:g} (scaling {d['scaling']:g})"
            + ("; per-module r / alpha from rank_pattern / alpha_pattern" if d.get("rank_pattern") or
               d.get("alpha_pattern") else "")
            + f"; {d['tensors']} tensors on {targets}"
            + (f"; modules_to_save {', '.join(d['modules_to_save'])}" if d.get("modules_to_save") else ""))


def adapter_table_html(rows: list[dict]) -> str:
    """The modules as an HTML table (class ``ckpt-adapter-table``): one row per base tensor the adapter changes."""
    def patterns(p: dict) -> str:
        return "; ".join(f"{k} {v!r}" for k, v in p.items())

    return table_html([{"tensor": r["tensor"], "method": r["method"], "r": _num(r["r"], "d"),
                        "alpha": _num(r["alpha"], "g"), "scaling": _num(r["scaling"], ".6g"),
                        "patterns": patterns(r["patterns"]), "adapter tensors": ", ".join(r["tensors"]),
                        "‖ΔW‖": _num(r["delta_norm"]), "‖W‖": _num(r["base_norm"]), "‖ΔW‖/‖W‖": _num(r["ratio"])}
                       for r in rows], cls="ckpt-adapter-table")


def picture_facts(rows: list[dict]) -> list[dict]:
    """The facts the movement picture draws: per module its tensor, method, r, alpha, scaling, ``delta_norm``,
    ``base_norm`` and ``ratio`` (None where unknown)."""
    return [{k: r[k] for k in ("tensor", "module", "method", "r", "alpha", "scaling", "delta_norm", "base_norm",
                               "ratio")} for r in rows]


def movement_picture(rows: list[dict], max_rows: int = 60) -> Picture:
    """How far each module moved: a bar of ``‖scaling · B @ A‖_F`` (a ``modules_to_save`` weight or a trained bias:
    ``‖trained − base‖_F``) per module, coloured by method, and beside it ``‖ΔW‖ / ‖W‖`` when the base was given."""
    shown = [r for r in rows if r["delta_norm"] is not None][:max_rows]
    relative = any(r["ratio"] is not None for r in shown)
    fig = new_figure((9.0 if relative else 7.0, 1.0 + 0.22 * max(len(shown), 3)))
    names = [r["tensor"] for r in shown][::-1]
    colors = [METHOD_COLORS.get(r["method"], "#555555") for r in shown][::-1]
    panels = [("delta_norm", "‖ΔW‖_F (float64)")] + ([("ratio", "‖ΔW‖_F / ‖W‖_F of the base")] if relative else [])
    for i, (key, label) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        ax.barh(names, [r[key] or 0.0 for r in shown][::-1], color=colors)
        ax.tick_params(axis="y", labelsize=6)
        if i:
            ax.set_yticklabels([])
        ax.set_xlabel(label, fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    methods = sorted({r["method"] for r in shown})
    if len(methods) > 1:
        from matplotlib.patches import Patch

        fig.axes[0].legend(handles=[Patch(color=METHOD_COLORS.get(m, "#555555"), label=m) for m in methods],
                           fontsize=7, loc="lower right")
    fig.suptitle("how far each module moved" + (f" ({', '.join(methods)})" if methods else ": nothing to draw"),
                 fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    dora = any("DoRA" in r["method"] for r in rows)
    caption = ("‖ΔW‖ = ‖scaling · B·A‖_F of each LoRA module's change, from the two r × r Gram matrices in float64 "
               "(B·A never formed); a modules_to_save weight or trained bias: ‖trained − base‖_F"
               + ("; beside it, relative to ‖W‖_F of the base weight (read streamed)" if relative else
                  "; give the base folder for ‖W‖ and the ratio")
               + (f"; {DORA_NOTE}" if dora else "")
               + (f"; the first {max_rows} of {len(rows)} shown" if len(rows) > len(shown) else ""))
    return Picture(fig, "adapter", picture_facts(rows), html.escape(caption))


def adapter_file_html(f: Optional[dict]) -> str:
    """The Trainer's ``adapter_model.safetensors`` judged (``f`` from :func:`ckptlib.analysis.adapter.check_weights_file`,
    None: none beside the tag), in a box coloured by its status (class ``ckpt-adapter-file`` and
    ``ckpt-adapter-file-<status>``)."""
    status = f["status"] if f else None
    edge, back = FILE_COLORS.get(status, FILE_COLORS[DIFFERENT])
    slug = (status or "none").replace(" ", "-")
    if f:
        what = (f"<code>{html.escape(str(f['path']))}</code> ({human_bytes(f['bytes'])}, {f['tensors']} tensors"
                + (f", {html.escape(str(f['dtype']))}" if f.get("dtype") else "") + ")")
        head = html.escape(f"the Trainer's adapter file: {status.upper()}")
        detail = f"<div style='color:#333'>{html.escape(f['detail'])}</div>" if f.get("detail") else ""
    else:
        what, head, detail = "", html.escape("the Trainer's adapter file: NONE"), ""
    icon = "&#10004;" if status == SAME else "&#9888;"
    return (f"<div class='ckpt-adapter-file ckpt-adapter-file-{html.escape(slug)}' data-status='{html.escape(slug)}' "
            f"style='border:3px solid {edge};background:{back};padding:8px 12px;margin:6px 0;border-radius:4px'>"
            f"<div style='color:{edge};font-weight:bold;font-size:14px'>{icon} {head}</div>"
            f"<div>{what}</div><div>{html.escape(FILE_MEANING.get(status, ''))}</div>{detail}</div>")


class AdapterView(widgets.VBox):
    """A peft adapter checkpoint: the adapter in one line, the module table, the movement picture and the Trainer's
    adapter file judged. ``base``: the base model's folder (``‖W‖`` and the ratio then). A checkpoint that trains no
    adapter, or one ckptlib cannot place, is said in the error area (message and hint).

    Reads the adapter's factors, the Trainer's file and the masters it is compared with, and (with ``base``) each
    changed base tensor streamed."""

    def __init__(self, checkpoint: Union["ckptlib.Checkpoint", str, os.PathLike],
                 base: Union[str, os.PathLike, None] = None):
        self.errors = ErrorArea()
        self.checkpoint = as_checkpoint(checkpoint)
        self.base = find_path(base) if base is not None else None
        self.described: Optional[dict] = None
        self.rows: list = []
        self.picture: Optional[Picture] = None
        self.head = widgets.HTML()
        self.head.add_class("ckpt-adapter-head")
        self.table = widgets.HTML()
        self.table.add_class("ckpt-adapter-table-box")
        self.figure = picture_widget(cls="ckpt-adapter-figure")
        self.file_box = widgets.HTML()
        self.file_box.add_class("ckpt-adapter-file-box")
        super().__init__([self.head, self.file_box, self.table, self.figure, self.errors])
        self.add_class("ckpt-adapter-view")
        try:
            self.described = describe_adapter(self.checkpoint)
            if self.described is None:
                raise ckptlib.CkptError("the checkpoint trains no peft adapter", path=self.checkpoint.location.tag_dir,
                                        hint="open a Trainer checkpoint-N of a PeftModel run")
            if "refused" in self.described:
                raise ckptlib.CkptError(self.described["refused"],
                                        hint="export the full model layout instead (--no-adapter)")
            self.rows = module_rows(self.checkpoint, self.base)
            self.picture = movement_picture(self.rows)
        except ckptlib.CkptError as e:
            self.errors.show(e, "adapter")
        self.head.value = self.head_html()
        self.file_box.value = adapter_file_html(self.described["weights_file"]) \
            if self.described and "refused" not in self.described else ""
        self.table.value = adapter_table_html(self.rows) if self.rows else ""
        if self.picture is not None:
            self.figure.value = self.picture.html()

    def head_html(self) -> str:
        if not self.described or "refused" in self.described:
            return ""
        base = (f"; base <code>{html.escape(str(self.base))}</code>" if self.base is not None else
                "; no base folder given (‖W‖ and the ratio need it)")
        return (f"<div class='ckpt-adapter-line'><b>{html.escape(adapter_line(self.described))}</b>{base}</div>")

    def html(self) -> str:
        """Everything the view shows, as HTML (the picture with its facts)."""
        return "".join([self.head.value, self.file_box.value, self.table.value,
                        self.picture.html() if self.picture is not None else "", self.errors.message.value])

    def _repr_mimebundle_(self, **kwargs):  # the widget, and the same as HTML where no widget can show
        data = super()._repr_mimebundle_(**kwargs) or {}
        data["text/html"] = self.html()
        return data


class AdapterWizard(ExportWizard):
    """Export a peft adapter as peft saves it, or merge it into its base (``base``: the base model's folder), step by
    step: options → plan (predicted memory and disk) → run in a worker thread (progress, live memory chart, Cancel)
    → verify → summary. The merge's summary says how far the two ``--merge-on`` modes lie apart. A refusal (no
    adapter, a method whose merge ckptlib has not checked) is shown with its message and hint.

    Args:
        checkpoint: a :class:`ckptlib.Checkpoint` or a path.
        base: the base model's folder (the merge is offered with it).
        out: the adapter export's folder; merged: the merged model's.
        adapter_config: the adapter's ``adapter_config.json`` (path or dict; default: the one beside the tag).
    """

    kind = "adapter"

    def __init__(self, checkpoint, base: Union[str, os.PathLike, None] = None,
                 out: Union[str, os.PathLike] = "output/adapter", merged: Union[str, os.PathLike] = "output/merged",
                 adapter_config=None):
        self.base = find_path(base) if base is not None else None
        self.adapter_config = adapter_config
        self.paths = {"export": str(find_path(out, must_exist=False)), "merge": str(find_path(merged, must_exist=False))}
        super().__init__(checkpoint, self.paths["merge" if self.base is not None else "export"])

    def _options(self) -> list:
        choices = [("export the adapter", "export")] + ([("merge into the base", "merge")] if self.base else [])
        self.action = widgets.ToggleButtons(options=choices, value=choices[-1][1], description="what")
        self.dtype = widgets.ToggleButtons(options=list(OUTPUT_DTYPES), value="fp32", description="dtype",
                                           tooltip="the adapter's dtype (fp32: the masters as they are)")
        self.merge_on = widgets.ToggleButtons(options=["base-dtype", "fp32"], value="base-dtype",
                                              description="merge on",
                                              tooltip="base-dtype: on the base rounded to the run's dtype (the run's "
                                                      "own merge_and_unload()); fp32: on the fp32 base")
        self.base_note = widgets.HTML(f"base <code>{html.escape(str(self.base))}</code>" if self.base else
                                      "<i>no base given: AdapterWizard(ckpt, base=BASE_FOLDER) merges too</i>")
        self.action.observe(self._on_action, names="value")
        self._show_fields()
        return [self.action, self.dtype, self.merge_on, self.base_note]

    def _show_fields(self) -> None:
        merging = self.action.value == "merge"
        self.dtype.layout.display = "none" if merging else ""
        self.merge_on.layout.display = "" if merging else "none"

    @guarded("what")
    def _on_action(self, change) -> None:
        self.paths[change["old"]] = self.out.value
        self.out.value = self.paths[change["new"]]
        self._show_fields()

    def _make_plan(self):
        if self.action.value == "merge":
            return ckptlib.plan_merge(self.checkpoint, self.out.value, self.base, merge_on=self.merge_on.value,
                                      adapter_config=self.adapter_config, overwrite=self.overwrite.value,
                                      sync=self.sync.value)
        return ckptlib.plan_export(self.checkpoint, self.out.value, adapter=True, dtype=self.dtype.value,
                                   adapter_config=self.adapter_config, overwrite=self.overwrite.value,
                                   sync=self.sync.value)

    def _execute(self, plan, observer, cancel):
        if isinstance(plan, ckptlib.MergePlan):
            return ckptlib.merge_adapter(plan, observer=observer, cancel=cancel)
        return ckptlib.run(plan, observer=observer, cancel=cancel)

    def _summary_html(self, plan, result, ok: bool) -> str:
        text = super()._summary_html(plan, result, ok)
        if not isinstance(result, ckptlib.MergeResult):
            return text
        other = "fp32" if plan.merge_on == "base-dtype" else "base-dtype"
        row = (f"<tr class='ckpt-merge-gap'><th style='text-align:left;padding-right:1em'>--merge-on</th><td>"
               f"{html.escape(plan.merge_on)} (this run) and {other} lie up to <b>{result.mode_gap:.3g}</b> apart over "
               f"the {len(result.merged)} merged weights{' and biases' if result.biases else ''}</td></tr>")
        return text.replace("</table>", row + "</table>", 1)

    def _next_steps(self, result) -> str:
        if isinstance(result, ckptlib.MergeResult):
            code = ("from transformers import AutoModelForCausalLM\n"
                    f"model = AutoModelForCausalLM.from_pretrained({str(result.out)!r})")
        else:
            code = ("from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
                    f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {str(result.out)!r})")
        return f"<p>Next:</p><pre>{html.escape(code)}</pre>"


__all__ = ["AdapterView", "AdapterWizard", "adapter_table_html", "movement_picture", "adapter_file_html",
           "adapter_line", "picture_facts", "FILE_COLORS"]
