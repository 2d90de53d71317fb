"""Export and reshard wizards: options → plan (predicted memory and disk) → run (progress, live memory,
Cancel) → verify → summary.

The run happens in a worker thread so the notebook stays responsive (a Cancel click reaches the kernel
only when no cell is running); cancelling sets the ``threading.Event`` passed to ckptlib as ``cancel=``,
and ckptlib then leaves nothing behind. The worker only sets widget values.

::

    from ckptlib.ui import ExportWizard
    wizard = ExportWizard("samples/zero2_bf16_w2/ckpt", out="output/export")
    wizard                          # pick options, click Plan, then Run
    wizard.wait()                   # (in a script or a test) until the run, verification and summary are done
"""
from __future__ import annotations

import html
import os
import threading
from pathlib import Path
from typing import Optional, Union

import ipywidgets as widgets

import ckptlib
from ckptlib.analysis.verify import Check, preflight, verify
from ckptlib.dtypes import OUTPUT_DTYPES
from ckptlib.errors import PipelineUnknownError
from ckptlib.system.memory import process_memory
from ckptlib.units import human_bytes

from .common import (PIPELINE_OPTIONS, ErrorArea, WidgetObserver, as_checkpoint, asked_options, find_path,
                     full_labels, guarded, option_example, tied_uses)
from .monitor import MemoryMonitor

STEPS = [("options", "1 · options"), ("planned", "2 · plan"), ("running", "3 · run"), ("verifying", "4 · verify"),
         ("done", "5 · summary")]


def checks_html(checks: list[Check]) -> str:
    rows = "".join(
        f"<tr><td>{'&#10004;' if c.ok else '&#10008;'}</td><td>{html.escape(c.what)}</td>"
        f"<td style='color:#555'>{html.escape(c.detail)}</td></tr>" for c in checks)
    ok = all(c.ok for c in checks)
    head = ("<b style='color:#2e7d32'>verified</b>" if ok else "<b style='color:#b71c1c'>verification FAILED</b>")
    return f"<div class='ckpt-verify'>{head}<table>{rows}</table></div>"


def value_widgets(ws: list) -> list:
    """The widgets holding a value the user sets (text, numbers, choices), inside boxes too."""
    out = []
    for w in ws:
        if isinstance(w, widgets.Box):
            out += value_widgets(list(w.children))
        elif isinstance(w, widgets.ValueWidget) and not isinstance(w, (widgets.HTML, widgets.Label)):
            out.append(w)
    return out


# ============================================================================================ the wizards
class _Wizard(widgets.VBox):
    kind = "run"

    def __init__(self, checkpoint, out):
        self.errors = ErrorArea()
        self.checkpoint: ckptlib.Checkpoint = as_checkpoint(checkpoint)
        self.plan = None
        self.result = None
        self.verification: list[Check] = []
        self.state = "options"
        self.thread: Optional[threading.Thread] = None
        self.cancel_event: Optional[threading.Event] = None
        self.observer: Optional[WidgetObserver] = None
        self.finished = threading.Event()
        self.finished.set()
        self._plan_used = False

        self.steps = widgets.HTML()
        self.out = widgets.Text(description="output", value=str(find_path(out, must_exist=False)),
                                layout=widgets.Layout(width="80%"))
        self.overwrite = widgets.Checkbox(value=False, description="replace the output folder if it is not empty",
                                          indent=False, layout=widgets.Layout(width="auto"))
        self.sync = widgets.Checkbox(value=True, indent=False, layout=widgets.Layout(width="auto"),
                                     description="on disk before it appears (survives a power cut; slower)",
                                     tooltip="untick to leave the writing to the kernel after the run, as torch.save "
                                             "and DeepSpeed do (ckpt --no-sync)")
        self.plan_button = widgets.Button(description="Plan", icon="list", button_style="info",
                                          tooltip="compute the plan from metadata (reads no tensor data)")
        self.plan_view = widgets.HTML()
        self.plan_view.add_class("ckpt-plan")
        self.verdict = widgets.HTML()
        self.verdict.add_class("ckpt-verdict")
        self.run_button = widgets.Button(description="Run", icon="play", button_style="success", disabled=True)
        self.cancel_button = widgets.Button(description="Cancel", icon="stop", button_style="danger", disabled=True)
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="progress",
                                              layout=widgets.Layout(width="60%"))
        self.status = widgets.HTML()
        self.status.add_class("ckpt-status")
        self.monitor = MemoryMonitor(show_button=False, title=f"memory of this kernel during the {self.kind}")
        self.verify_view = widgets.HTML()
        self.summary = widgets.HTML()
        self.summary.add_class("ckpt-summary-box")

        options = self._options()
        for w in value_widgets(options) + [self.out, self.overwrite, self.sync]:
            w.observe(self._on_option, names="value")
        self.plan_button.on_click(self._on_plan)
        self.run_button.on_click(self._on_run)
        self.cancel_button.on_click(self._on_cancel)
        ck = self.checkpoint
        head = widgets.HTML(f"<b>{self.kind}</b> <code>{html.escape(str(ck.location.tag_dir))}</code> "
                            f"(ZeRO-{ck.zero_stage}, {ck.dtype}, {ck.dp_world_size} ranks)")
        super().__init__([head, self.steps, *options, self.out, self.overwrite, self.sync, self.plan_button,
                          self.plan_view,
                          self.verdict, widgets.HBox([self.run_button, self.cancel_button]),
                          widgets.HBox([self.progress, self.status]), self.monitor, self.verify_view, self.summary,
                          self.errors])
        self.add_class(f"ckpt-{self.kind}-wizard")
        full_labels(self)  # "tensor ranks", not "tensor ra…"
        self._set_state("options")

    # ---------------------------------------------------------------- to override
    def _options(self) -> list:
        raise NotImplementedError

    def _make_plan(self):
        raise NotImplementedError

    def _execute(self, plan, observer, cancel):
        raise NotImplementedError

    def _verify(self, plan, result) -> list[Check]:
        raise NotImplementedError

    def _next_steps(self, result) -> str:
        return ""

    # ---------------------------------------------------------------- state
    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def _set_state(self, state: str) -> None:
        self.state = state
        order = [s for s, _ in STEPS]
        if state in order:
            at = order.index(state)
        else:  # cancelled or failed: where it stopped (running, or verifying once there is a result)
            at = order.index("verifying" if self.result is not None else "running")
        parts = []
        for i, (s, label) in enumerate(STEPS):
            style = "font-weight:bold;color:#1565c0" if i == at else ("color:#2e7d32" if i < at else "color:#999")
            parts.append(f"<span style='{style}'>{label}</span>")
        extra = {"cancelled": " &mdash; <b style='color:#e65100'>cancelled</b>",
                 "failed": " &mdash; <b style='color:#b71c1c'>failed</b>"}.get(state, "")
        self.steps.value = " &rarr; ".join(parts) + extra

    def wait(self, timeout: Optional[float] = None) -> str:
        """Wait until the run (with verification and summary) ends; returns the final state."""
        self.finished.wait(timeout)
        if self.thread is not None:
            self.thread.join(0 if not self.finished.is_set() else None)
        return self.state

    # ---------------------------------------------------------------- callbacks
    @guarded("options")
    def _on_option(self, change) -> None:
        if self.plan is not None and not self.running:
            self.plan = None
            self.run_button.disabled = True
            self.plan_view.value = "<i>options changed: plan again</i>"
            self.verdict.value = ""
            self._set_state("options")

    @guarded("plan")
    def _on_plan(self, _=None) -> None:
        if self.running:
            raise ckptlib.CkptError("a run is in progress", hint="cancel it or wait for it first")
        self.plan = None
        self.run_button.disabled = True
        self.plan_view.value = self.verdict.value = ""
        plan = self._make_plan()
        self.plan, self._plan_used = plan, False
        self.plan_view.value = f"<pre style='font-size:11px;line-height:1.3'>{html.escape(plan.describe())}</pre>"
        self.verdict.value = self._verdict_html(plan)
        self.run_button.disabled = False
        self._set_state("planned")

    def _verdict_html(self, plan) -> str:
        pre = preflight(plan)
        v = pre.memory
        color = {"ok": "#2e7d32", "tight": "#e65100", "no": "#b71c1c"}[v.level]
        icon = "&#10004;" if v.level == "ok" else "&#9888;"
        lines = [f"<div style='color:{color}'>{icon} memory: {html.escape(v.message)}</div>"]
        if pre.disk_free is not None:
            lines.append(f"<div style='color:{'#2e7d32' if pre.disk_ok else '#b71c1c'}'>"
                         f"{'&#10004;' if pre.disk_ok else '&#9888;'} disk: {html.escape(pre.disk_message)}</div>")
        out = Path(plan.out)
        if out.exists() and any(out.iterdir()):
            lines.append("<div style='color:#e65100'>&#9888; the output folder exists and is not empty: "
                         + ("it will be replaced" if plan.overwrite else "tick 'replace' or choose another folder")
                         + "</div>")
        return "".join(lines)

    @guarded("run")
    def _on_run(self, _=None) -> None:
        if self.running:
            return
        if self.plan is None:
            raise ckptlib.CkptError("there is no plan to run", hint="click 'Plan' first, then 'Run'")
        if self._plan_used:  # a plan is executed once; a second run gets a fresh one
            self.plan = self._make_plan()
        plan, self._plan_used = self.plan, True
        self.result, self.verification = None, []
        self.verify_view.value = self.summary.value = ""
        self.cancel_event = threading.Event()
        self.observer = WidgetObserver(self.progress, self.status)
        self.progress.value, self.progress.bar_style = 0.0, "info"
        self.status.value = "starting"
        self.monitor.reset()
        self.monitor.baseline = process_memory().anon
        self.monitor.predicted = plan.predicted_peak_bytes
        self.monitor.start()
        self.run_button.disabled = self.plan_button.disabled = True
        self.cancel_button.disabled = False
        self._set_state("running")
        self.finished.clear()
        self.thread = threading.Thread(target=self._work, args=(plan, self.cancel_event, self.observer),
                                       name=f"ckptlib-{self.kind}", daemon=True)
        self.thread.start()

    @guarded("cancel")
    def _on_cancel(self, _=None) -> None:
        if self.cancel_event is not None and self.running:
            self.cancel_event.set()
            self.cancel_button.disabled = True
            self.status.value = "cancelling at the next chunk&hellip;"

    # ---------------------------------------------------------------- the worker thread (sets values only)
    def _work(self, plan, cancel: threading.Event, observer: WidgetObserver) -> None:
        try:
            result = self._execute(plan, observer, cancel)
            self.result = result
            self._set_state("verifying")
            self.status.value = "verifying the output&hellip;"
            self.verification = checks = self._verify(plan, result)
            self.verify_view.value = checks_html(checks)
            ok = all(c.ok for c in checks)
            self.summary.value = self._summary_html(plan, result, ok)
            self.status.value = "done" if ok else "done, but verification failed"
            self._set_state("done" if ok else "failed")
        except ckptlib.Cancelled:
            self.status.value = ("<b>cancelled</b>: nothing was written (the output folder "
                                 f"<code>{html.escape(str(plan.out))}</code> was not created)")
            self._set_state("cancelled")
        except BaseException as e:  # shown in the widget, never lost
            self.errors.show(e, f"{self.kind} run")
            self.status.value = "failed (see below)"
            self._set_state("failed")
        finally:
            try:
                self.monitor.stop_later(1.0)  # a few samples after a short run, without holding anything up
            finally:
                self.cancel_button.disabled = True
                self.run_button.disabled = self.plan is None
                self.plan_button.disabled = False
                self.finished.set()

    def _summary_html(self, plan, result, ok: bool) -> str:
        mem = result.memory
        rate = human_bytes(result.bytes_written / result.seconds) + "/s" if result.seconds > 0 else "-"
        rows = [
            ("output", f"<code>{html.escape(str(result.out))}</code>"),
            ("written", f"{len(result.files)} file{'s' if len(result.files) != 1 else ''}, {human_bytes(result.bytes_written)} in {result.seconds:.2f} s "
                        f"({rate}); read {human_bytes(result.bytes_read)} of the checkpoint"),
            ("memory", (f"peak +{human_bytes(mem.peak_added)} over the start (measured), predicted "
                        f"{human_bytes(plan.predicted_peak_bytes)}" if mem else "not measured")),
            ("verified", "yes" if ok else "<b style='color:#b71c1c'>NO</b>"),
        ]
        body = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{k}</th><td>{v}</td></tr>"
                       for k, v in rows)
        return f"<div><b>Summary</b><table>{body}</table>{self._next_steps(result)}</div>"


class ExportWizard(_Wizard):
    """Export consolidated weights (and optimizer states) step by step.

    Args:
        checkpoint: a :class:`ckptlib.Checkpoint` or a path.
        out: the output folder (default ``output/export`` under the current folder).
        model_config: an AutoEP checkpoint's model config (``config.json``), as ``ckpt export --model-config``.
    """

    kind = "export"

    def __init__(self, checkpoint, out: Union[str, os.PathLike] = "output/export", model_config=None):
        self.model_config = model_config
        super().__init__(checkpoint, out)

    def _options(self) -> list:
        ck = self.checkpoint
        self.format = widgets.ToggleButtons(options=["safetensors", "torch"], value="safetensors",
                                            description="format")
        self.dtype = widgets.ToggleButtons(options=list(OUTPUT_DTYPES), value="fp32", description="dtype")
        self.max_shard_size = widgets.Text(value="5GB", description="shard size",
                                           tooltip="e.g. 5GB, 500MB, 2GiB")
        keys = list(ck.optimizer.state_keys) if ck.optimizer else []
        self.states = widgets.SelectMultiple(options=keys, value=(), description="also states", rows=max(2, len(keys)))
        self.exclude_frozen = widgets.Checkbox(value=False, description="leave out frozen parameters", indent=False)
        return [self.format, self.dtype, self.max_shard_size, self.states, self.exclude_frozen]

    def _make_plan(self):
        return ckptlib.plan_export(self.checkpoint, self.out.value, format=self.format.value, dtype=self.dtype.value,
                                   max_shard_size=self.max_shard_size.value.strip(), states=tuple(self.states.value),
                                   exclude_frozen=self.exclude_frozen.value, overwrite=self.overwrite.value,
                                   sync=self.sync.value, model_config=self.model_config)

    def _execute(self, plan, observer, cancel):
        return ckptlib.export(plan, observer=observer, cancel=cancel)

    def _verify(self, plan, result):
        return verify(plan, result.out).checks

    def _next_steps(self, result) -> str:
        if self.format.value == "safetensors":
            code = ("from safetensors.torch import load_file\n"
                    f"state_dict = load_file({str(result.out / result.files[0][0])!r})\n"
                    "model.load_state_dict(state_dict, strict=True)")
            if len(result.files) > 1:
                code = ("# sharded: transformers' from_pretrained reads the index, or load each shard\n"
                        f"# listed in {str(result.out)}/model.safetensors.index.json")
        else:
            code = (f"state_dict = torch.load({str(result.out / result.files[0][0])!r}, weights_only=True)\n"
                    "model.load_state_dict(state_dict, strict=True)")
        return f"<p>Next:</p><pre>{html.escape(code)}</pre>"


class ReshardWizard(_Wizard):
    """Reshard a checkpoint for another mesh (data-parallel size, and tensor, pipeline and expert sizes),
    step by step.

    A pipeline (``PipelineModule``) checkpoint records where its layers are, not how its module places them:
    when the new mesh could take them in more than one way, the plan is refused with ``ckpt``'s message and
    hint, and the pipeline fields appear (the split, the number of layer specs, the layers using a tied
    module: ``ckpt reshard --pp-partition``, ``--pp-layers``, ``--pp-tied``, read the same way). The fields the
    refusal asks for (:func:`asked_options`: a universal folder written by ``ds_to_universal`` does not say which
    layer builds a tied module, and asks for ``--pp-tied``) are marked and listed in ``asked``, with the hint's
    example as their placeholder (never as their value: the user says it).

    Args:
        checkpoint: a :class:`ckptlib.Checkpoint` or a path.
        out: the output folder (default ``output/reshard`` under the current folder).
        world_size: the initial data-parallel size (default: twice the current one).
        tp, pp, ep: the initial tensor, pipeline and expert sizes (default: the checkpoint's).
        pp_partition: ``"uniform"``, ``"parameters"`` or the stage boundaries ``"0,4,7"``; pp_layers: the
            number of layer specs; pp_tied: ``{key: [layer, ...]}`` or ``"KEY:I,J ..."`` (given: the pipeline
            fields show from the start).
        tp_rules: split rules for a checkpoint that records none (as :func:`ckptlib.plan_reshard`).
    """

    kind = "reshard"

    def __init__(self, checkpoint, out: Union[str, os.PathLike] = "output/reshard", world_size: Optional[int] = None,
                 tp: Optional[int] = None, pp: Optional[int] = None, ep: Optional[int] = None,
                 pp_partition: Optional[str] = None, pp_layers: Optional[int] = None,
                 pp_tied: Union[None, str, dict] = None, tp_rules=None):
        self._initial = {"dp": world_size, "tp": tp, "pp": pp, "ep": ep}
        if isinstance(pp_tied, dict):
            pp_tied = " ".join(f"{k}:{','.join(map(str, v))}" for k, v in pp_tied.items())
        self._pipeline_initial = (pp_partition or "", "" if pp_layers is None else str(pp_layers), pp_tied or "")
        self.tp_rules = tp_rules
        self.asked: list = []  # the pipeline options the last refusal asked for
        super().__init__(checkpoint, out)

    def _options(self) -> list:
        ck = self.checkpoint
        mesh = ck.mesh
        current = ck.partition_count or ck.dp_world_size or 1
        init = self._initial

        def size(key, now, label):
            return widgets.BoundedIntText(value=init[key] or now, min=1, max=4096, description=label)

        self.world_size = size("dp", 2 * current, "data ranks")
        self.tp = size("tp", mesh.tp, "tensor ranks")
        self.pp = size("pp", mesh.pp, "stages")
        self.ep = size("ep", mesh.ep, "expert ranks")
        self.world_note = widgets.HTML(f"currently pp={mesh.pp} tp={mesh.tp} dp={current} ep={mesh.ep}")
        split, layers, tied = self._pipeline_initial

        def wide():  # a layout of its own for each field: the one the refusal asks for gets a border
            return widgets.Layout(width="70%")

        self.pp_partition = widgets.Text(value=split, description="pipeline split", layout=wide(),
                                         placeholder="uniform, parameters, or the stage boundaries B0,B1,...,Bn",
                                         tooltip="how the PipelineModule places its layers (ckpt --pp-partition)")
        self.pp_layers = widgets.Text(value=layers, description="layer specs", layout=wide(),
                                      placeholder="the number of layer specs of the PipelineModule (if asked)",
                                      tooltip="ckpt --pp-layers")
        self.pp_tied = widgets.Text(value=tied, description="tied uses", layout=wide(),
                                    placeholder="KEY:I,J: the layers using the tied module KEY, first the one that "
                                                "builds it, e.g. embed:0,6 (several: separated by spaces)",
                                    tooltip="ckpt --pp-tied")
        self.pipeline_asks = widgets.HTML()
        self.pipeline_asks.add_class("ckpt-pipeline-asks")
        self.pipeline = widgets.VBox([
            widgets.HTML("<b>pipeline</b>: the checkpoint shows where its layers are, not how the PipelineModule "
                         "places them at another mesh; say it here as in your training script "
                         "(<code>partition_method</code>, or the stage boundaries), then Plan again"),
            self.pipeline_asks, self.pp_partition, self.pp_layers, self.pp_tied])
        self.pipeline.add_class("ckpt-pipeline-fields")
        self.pipeline.layout.display = "" if any(self._pipeline_initial) else "none"
        return [widgets.HBox([self.world_size, self.tp]), widgets.HBox([self.pp, self.ep]), self.world_note,
                self.pipeline]

    def pipeline_options(self) -> dict:
        """The pipeline fields as :func:`ckptlib.plan_reshard` takes them (empty fields left out), read as
        ``ckpt reshard`` reads ``--pp-partition``, ``--pp-layers`` and ``--pp-tied``."""
        out: dict = {}
        split, layers, tied = self.pp_partition.value.strip(), self.pp_layers.value.strip(), self.pp_tied.value.strip()
        if split:
            out["pp_partition"] = split
        if layers:
            try:
                out["pp_layers"] = int(layers)
            except ValueError:
                raise ckptlib.CkptError(f"--pp-layers {layers!r}: give the number of layer specs, a whole number",
                                        hint="leave 'layer specs' empty unless the refusal asks for it") from None
        if tied:
            out["pp_tied"] = tied_uses(tied)
        return out

    def _ask(self, exc: PipelineUnknownError) -> None:
        """Show the pipeline fields and mark those ``exc`` asks for (:func:`asked_options`)."""
        self.pipeline.layout.display = ""
        self.asked = asked_options(exc)
        fields = {"pp_partition": self.pp_partition, "pp_layers": self.pp_layers, "pp_tied": self.pp_tied}
        said = []
        for option, field in fields.items():
            asked = option in self.asked
            field.layout.border = "2px solid #e65100" if asked else None
            (field.add_class if asked else field.remove_class)("ckpt-asked")
            example = option_example(exc, option) if asked else ""
            if example:
                field.placeholder = f"e.g. {example} (the refusal's example: check it against your PipelineModule)"
            if asked:
                said.append(f"<b>{html.escape(field.description)}</b> (<code>{PIPELINE_OPTIONS[option]}</code>"
                            + (f", e.g. <code>{html.escape(example)}</code>" if example else "") + ")")
        self.pipeline_asks.value = ("<span style='color:#e65100'>&#9888; the refusal above asks for: "
                                    + ", ".join(said) + "</span>")

    def _answered(self) -> None:
        """A plan was made: nothing is asked any more."""
        self.asked = []
        self.pipeline_asks.value = ""
        for field in (self.pp_partition, self.pp_layers, self.pp_tied):
            field.layout.border = None
            field.remove_class("ckpt-asked")

    def _make_plan(self):
        mesh = self.checkpoint.mesh
        changed = {k: w.value for k, w, now in (("tp", self.tp, mesh.tp), ("pp", self.pp, mesh.pp),
                                                 ("ep", self.ep, mesh.ep)) if w.value != now}
        extra = {"tp_rules": self.tp_rules} if self.tp_rules is not None else {}
        try:
            plan = ckptlib.plan_reshard(self.checkpoint, self.out.value, self.world_size.value,
                                        overwrite=self.overwrite.value, sync=self.sync.value, **changed,
                                        **self.pipeline_options(), **extra)
        except PipelineUnknownError as e:
            self._ask(e)  # the mesh change needs (part of) the pipeline's description: ask for it
            raise
        self._answered()
        return plan

    def _execute(self, plan, observer, cancel):
        return ckptlib.reshard(plan, observer=observer, cancel=cancel)

    def _verify(self, plan, result):
        return verify(plan, result.out).checks

    def _next_steps(self, result) -> str:
        code = (f"# launch training at pp={self.pp.value} tp={self.tp.value} dp={self.world_size.value} "
                f"ep={self.ep.value}, then:\n"
                f"engine.load_checkpoint({str(result.out)!r})")
        return f"<p>Next:</p><pre>{html.escape(code)}</pre>"


__all__ = ["ExportWizard", "ReshardWizard", "checks_html"]
