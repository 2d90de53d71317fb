"""The notebook widgets (ckptlib.ui), driven headless: set values, click buttons, cancel a run, and see
failing callbacks reported in the widget."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

widgets = pytest.importorskip("ipywidgets", reason="ipywidgets is in the notebooks extra")
pytest.importorskip("matplotlib")

import ckptlib  # noqa: E402
from ckptlib import ui  # noqa: E402
from ckptlib.system.memory import MemoryReport  # noqa: E402
from ckptlib.ui import CheckpointBrowser, ExportWizard, LayoutView, MemoryMonitor, ReshardWizard  # noqa: E402
from ckptlib.ui.pictures import facts_in_html  # noqa: E402
from ckptlib.ui.common import WidgetObserver  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "zero2_bf16_w2" / "ckpt"
PNG = b"\x89PNG\r\n\x1a\n"


def leftovers(parent: Path) -> list[str]:
    """Anything an interrupted run could leave next to its output."""
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


# ============================================================================================ browser
def test_browser_opens_the_sample_and_shows_files_chart_and_problems():
    b = CheckpointBrowser(SAMPLE)
    ck = b.checkpoint
    assert ck is not None and ck.zero_stage == 2 and not b.errors.errors
    for f in ck.files:
        assert f.path.name in b.file_table.value
    assert "ckpt-file-table" in b.file_table.value and "rank 1" in b.file_table.value
    assert bytes(b.chart.value).startswith(PNG)
    assert "no problems" in b.problems.value
    assert "ZeRO stage" in b.summary.value and "embed.weight" in b.params.value
    assert b.details.layout.display == ""


def test_browser_navigates_folders_and_detects_what_they_are(tmp_path):
    out = tmp_path / "run"
    shutil.copytree(SAMPLE, out / "checkpoint-5")
    shutil.copytree(SAMPLE, out / "checkpoint-10")
    (out / "logs").mkdir()
    b = CheckpointBrowser(tmp_path)
    assert b.checkpoint is None and "no checkpoint here" in b.found.value
    labels = dict((v, k) for k, v in b.folders.options)
    assert labels["run"].startswith("🗂") and "2 checkpoint-N" in labels["run"]
    b.folders.value = "run"                                  # go into it: a training output folder
    assert Path(b.path.value) == out
    assert "training output" in b.found.value and b.checkpoint is not None
    assert b.checkpoint.location.save_dir.name == "checkpoint-10"  # the newest
    labels = dict((v, k) for k, v in b.folders.options)
    assert labels["checkpoint-5"].startswith("📦") and "latest → global_step2" in labels["checkpoint-5"]
    assert labels["logs"].startswith("📁")
    b.folders.value = "checkpoint-5"
    assert b.checkpoint.location.save_dir.name == "checkpoint-5"
    b.folders.value = "global_step2"                         # a tag folder
    assert "tag folder" in b.found.value and b.checkpoint.location.tag == "global_step2"
    b.up_button.click()
    b.up_button.click()
    assert Path(b.path.value) == out
    b.path.value = str(tmp_path / "nowhere")
    assert b.checkpoint is None and "no such folder" in b.found.value
    assert not b.errors.errors


def test_browser_offers_the_tags_and_opens_the_one_picked(tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(SAMPLE, save)
    shutil.copytree(save / "global_step2", save / "global_step1")
    b = CheckpointBrowser(save)
    assert b.checkpoint.location.tag == "global_step2"                   # latest
    assert dict(b.tag.options)["global_step2  (latest)"] == "global_step2"
    assert b.tag.layout.display == ""
    b.tag.value = "global_step1"
    assert b.checkpoint.location.tag == "global_step1" and not b.errors.errors


def test_browser_lists_problems(tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(SAMPLE, save)
    (save / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    b = CheckpointBrowser(save)
    assert b.checkpoint.problems
    assert "problem(s) found" in b.problems.value and "dp rank(s) 1" in b.problems.value
    assert b.details.selected_index == 3 and b.details.get_title(3).startswith("Problems (")


def test_browser_shows_a_failing_callback_in_the_widget(monkeypatch):
    b = CheckpointBrowser(SAMPLE)
    assert b.errors.layout.display == "none"

    def boom(*a, **k):
        raise RuntimeError("the disk caught fire")

    monkeypatch.setattr(ckptlib, "open_checkpoint", boom)
    b.open_button.click()
    assert b.errors.errors and "the disk caught fire" in b.errors.message.value
    assert b.errors.layout.display == ""
    assert any("RuntimeError" in o.get("text", "") for o in b.errors.details.outputs)  # the traceback too
    monkeypatch.undo()
    b.open_button.click()                                     # still usable; the error area clears
    assert b.checkpoint is not None and b.errors.layout.display == "none"


def test_browser_reports_errors_of_a_user_callback():
    b = CheckpointBrowser(SAMPLE)
    b.on_open(lambda ck: 1 / 0)
    b.open_button.click()
    assert "ZeroDivisionError" in b.errors.message.value


# ============================================================================================ layout view
def test_layout_view_search_pick_and_where(fixture_by_name):
    fx = fixture_by_name("z3_bf16_w2")
    v = LayoutView(fx["checkpoint_path"])
    assert v.picture.png.startswith(PNG) and "ckpt-picture-groups" in v.figure.value
    assert len(v.panels) >= 1
    # the picture's facts are in the widget's model: each sub-group with the optimizer that steps it
    (kind, facts), = facts_in_html(v.figure.value)
    assert kind == "groups" and [(p["label"], p["optimizer"]) for p in facts["panels"]] == \
        [("sub-group 0", "Adam/AdamW"), ("sub-group 1", "Adam/AdamW")] and facts["highlight"] is None
    v.search.value = "fc1"
    names = [n for _, n in v.param.options if n]
    assert names and all("fc1" in n for n in names)
    before = v.figure.value
    v.param.value = "fc1.weight"
    assert v.figure.value != before and facts_in_html(v.figure.value)[0][1]["highlight"] == "fc1.weight"
    assert v.where.value.count("<tr>") == 1 + 2                 # a chunk on each of the 2 ranks
    assert "fc1.weight" in v.where.value and "optim_states.pt" in v.where.value
    v.search.value = "no-such-parameter"
    assert [n for _, n in v.param.options if n] == [] and v.param.value == ""
    assert not v.errors.errors


def test_layout_view_switches_to_the_group_of_the_picked_parameter():
    v = LayoutView(SAMPLE)
    groups = {i: p["parameters"] for i, p in enumerate(v.panels)}
    assert len(groups) == 2
    v.group.value = 1
    target = groups[0][0]
    v.select(target)
    assert v.group.value == 0 and target in v.where.value
    v.select("head.weight")                                   # a tied alias: its owner's pieces
    assert "tied to" in v.where.value and "embed.weight" in v.where.value
    v.select("frozen.weight")
    assert "frozen" in v.where.value and "model-states" in v.where.value
    with pytest.raises(KeyError):
        v.select("nope")


# ============================================================================================ export wizard
def test_export_wizard_plan_run_verify_summary(tmp_path):
    out = tmp_path / "out" / "export"
    w = ExportWizard(SAMPLE, out=out)
    assert w.run_button.disabled and w.state == "options"
    w.dtype.value = "bf16"
    w.states.value = ("exp_avg",)
    w.plan_button.click()
    assert w.state == "planned" and not w.run_button.disabled
    assert "model.safetensors" in w.plan_view.value and "exp_avg/model.safetensors" in w.plan_view.value
    assert "memory: fits" in w.verdict.value and "disk:" in w.verdict.value
    w.format.value = "torch"                                   # changing an option invalidates the plan
    assert w.plan is None and w.run_button.disabled and "plan again" in w.plan_view.value
    w.plan_button.click()
    assert "pytorch_model.bin" in w.plan_view.value
    w.run_button.click()
    assert w.wait(60) == "done", (w.status.value, w.errors.message.value)
    assert (out / "pytorch_model.bin").is_file() and (out / "exp_avg" / "pytorch_model.bin").is_file()
    assert w.verification and all(c.ok for c in w.verification)
    every = next(c for c in w.verification if "every tensor equals the checkpoint" in c.what)
    assert every.detail == f"{len(w.plan.tensors)} of {len(w.plan.tensors)}" and len(w.plan.tensors) > 20
    assert "verified" in w.verify_view.value and "Summary" in w.summary.value and "predicted" in w.summary.value
    assert isinstance(w.result.memory, MemoryReport)
    assert w.progress.value == 1.0 and w.progress.bar_style == "success"
    assert w.cancel_button.disabled and not w.run_button.disabled
    assert w.monitor.idle.wait(60)                             # the chart samples on for about a second
    assert not w.monitor.sampler.running
    assert len(w.monitor.sampler.history) >= 3
    assert bytes(w.monitor.image.value).startswith(PNG)               # the live chart was drawn
    assert not w.errors.errors


def test_export_wizard_cancel_leaves_nothing(tmp_path, monkeypatch):
    parent = tmp_path / "out"
    out = parent / "export"
    gate, inside = threading.Event(), threading.Event()
    real = WidgetObserver.on_tensor

    def slow(self, name):  # hold the run inside its first tensor until the test has clicked Cancel
        inside.set()
        gate.wait(20)
        real(self, name)

    monkeypatch.setattr(WidgetObserver, "on_tensor", slow)
    w = ExportWizard(SAMPLE, out=out)
    w.plan_button.click()
    w.run_button.click()
    assert inside.wait(20)
    assert w.running and w.state == "running" and not w.cancel_button.disabled and w.run_button.disabled
    assert not out.exists()                                    # written into a hidden sibling meanwhile
    assert any(".ckptlib-tmp-" in n for n in leftovers(parent))
    w.cancel_button.click()
    assert "cancelling" in w.status.value
    gate.set()
    assert w.wait(20) == "cancelled"
    assert not out.exists()
    assert leftovers(parent) == []                             # no temporary folder, no lock file
    assert "cancelled" in w.status.value and "nothing was written" in w.status.value
    assert w.progress.bar_style == "warning" and not w.errors.errors
    assert not w.running
    # a second run of the same wizard (a fresh plan) completes
    monkeypatch.undo()
    w.run_button.click()
    assert w.wait(60) == "done" and (out / "model.safetensors").is_file()


def test_export_wizard_shows_bad_options_in_the_widget(tmp_path):
    w = ExportWizard(SAMPLE, out=tmp_path / "o")
    w.max_shard_size.value = "lots"
    w.plan_button.click()
    assert w.plan is None and w.run_button.disabled
    assert "cannot read the size" in w.errors.message.value and w.errors.layout.display == ""


def test_export_wizard_shows_a_failing_run_in_the_widget(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("writer exploded")

    w = ExportWizard(SAMPLE, out=tmp_path / "o")
    w.plan_button.click()
    monkeypatch.setattr(ckptlib, "export", broken)
    w.run_button.click()
    assert w.wait(20) == "failed"
    assert "writer exploded" in w.errors.message.value and "failed" in w.status.value
    assert w.cancel_button.disabled and not w.running


def test_wizard_warns_when_the_predicted_peak_does_not_fit(tmp_path, monkeypatch):
    from ckptlib.system import memory

    monkeypatch.setattr(memory, "system_memory", lambda: memory.SystemMemory(
        total=2**30, available=2**30, cgroup_limit=64 * 2**20, cgroup_usage=40 * 2**20))
    w = ExportWizard(SAMPLE, out=tmp_path / "o")
    w.plan_button.click()
    assert "does NOT fit" in w.verdict.value and "cgroup limit" in w.verdict.value
    assert "#b71c1c" in w.verdict.value                        # shown as a warning, in red
    assert not w.run_button.disabled                           # the user decides; the warning stands


def test_export_wizard_refuses_a_non_empty_output(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    w = ExportWizard(SAMPLE, out=out)
    w.plan_button.click()
    assert "not empty" in w.verdict.value
    w.run_button.click()
    assert w.wait(20) == "failed"
    assert "not empty" in w.errors.message.value and (out / "precious.txt").read_text() == "keep me"


# ============================================================================================ reshard wizard
@pytest.mark.parametrize("fixture, target", [("z3_bf16_w2", 3), ("z1_bf16_w3", 2)])
def test_reshard_wizard_runs_and_verifies(fixture, target, fixture_by_name, tmp_path):
    fx = fixture_by_name(fixture)
    out = tmp_path / "rs"
    w = ReshardWizard(fx["checkpoint_path"], out=out)
    assert w.world_size.value == 2 * fx["world_size"]
    w.world_size.value = target
    assert w.sync.value is True
    w.sync.value = False                                       # left to the kernel: the same bytes, sooner
    w.plan_button.click()
    assert f"-&gt; {target} data-parallel ranks" in w.plan_view.value
    assert w.plan.sync is False and "not synced" in w.plan_view.value
    w.run_button.click()
    assert w.wait(60) == "done", (w.status.value, w.errors.message.value)
    assert all(c.ok for c in w.verification), w.verification
    assert ckptlib.open_checkpoint(out).partition_count == target
    assert "engine.load_checkpoint" in w.summary.value


def test_reshard_wizard_cancel_leaves_nothing(tmp_path, monkeypatch):
    parent = tmp_path / "out"
    out = parent / "rs"
    gate, inside = threading.Event(), threading.Event()

    def slow(self, name):
        inside.set()
        gate.wait(20)

    monkeypatch.setattr(WidgetObserver, "on_file", slow)
    w = ReshardWizard(SAMPLE, out=out, world_size=3)
    w.plan_button.click()
    w.run_button.click()
    assert inside.wait(20)
    w.cancel_button.click()
    gate.set()
    assert w.wait(20) == "cancelled"
    assert not out.exists() and leftovers(parent) == []


# ============================================================================================ memory monitor
def test_memory_monitor_toggle_samples_and_draws():
    m = MemoryMonitor(interval=0.05, redraw_every=0.1)
    assert "this kernel" in m.label.value and "available" in m.label.value
    m.toggle.value = True
    assert m.sampler.running
    deadline = time.monotonic() + 20  # 0.15 s when the machine is idle; a loaded one may starve the thread for long
    while len(m.sampler.history) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    m.toggle.value = False  # draws the chart once more
    assert not m.sampler.running
    assert len(m.sampler.history) >= 3
    assert bytes(m.image.value).startswith(PNG)
    assert "peak" in m.label.value


def test_widget_observer_throttles_and_finishes():
    bar, status = widgets.FloatProgress(min=0, max=1), widgets.HTML()
    o = WidgetObserver(bar, status, hz=1.0)
    o.on_start(None)
    o.on_file("model.safetensors")
    o.on_bytes(10, 100)
    o.on_bytes(50, 100)                # within the same second: skipped
    assert bar.value == 0.1
    o.on_bytes(100, 100)               # the last one always shows
    assert bar.value == 1.0 and "model.safetensors" in status.value
    o.on_error(ckptlib.Cancelled("x"))
    assert bar.bar_style == "warning"


def test_ui_is_built_on_the_public_api_only():
    """ckptlib.ui imports only public names (no leading underscore) from ckptlib."""
    import ast

    for path in (ROOT / "ckptlib" / "ui").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptlib"):
                assert not any(a.name.startswith("_") for a in node.names), (path, node.module)
                assert not any(part.startswith("_") for part in node.module.split(".")), (path, node.module)
    assert set(ui.__all__) >= {"CheckpointBrowser", "LayoutView", "ExportWizard", "ReshardWizard"}


# ============================================================================================ finishing
MESH = "pp2_tp2_dp2_z1_bf16"  # a real DeepSpeed PipelineModule checkpoint: pp 2 x tp 2 x dp 2


def described(widget) -> list:
    """Every widget with a description inside ``widget`` (itself included)."""
    out = [widget] if getattr(widget, "description", "") else []
    for child in getattr(widget, "children", ()):
        out += described(child)
    return out


@pytest.mark.parametrize("make", [lambda out: ExportWizard(SAMPLE, out=out),
                                  lambda out: ReshardWizard(SAMPLE, out=out)], ids=["export", "reshard"])
def test_wizard_labels_get_the_room_they_need(make, tmp_path):
    """ipywidgets gives a description a fixed width and cuts the rest ("tensor ra…"): every field of the
    wizards has its label at its own width."""
    w = make(tmp_path / "o")
    fields = described(w)
    assert len(fields) >= 6
    for f in fields:
        style = getattr(f, "style", None)
        if style is not None and style.has_trait("description_width"):
            assert style.description_width == "initial", f.description
    if isinstance(w, ReshardWizard):
        assert {"tensor ranks", "expert ranks", "pipeline split"} <= {f.description for f in fields}


def test_no_empty_image_before_a_run(tmp_path):
    w = ReshardWizard(SAMPLE, out=tmp_path / "rs", world_size=3)
    image = w.monitor.image
    assert image.layout.display == "none" and not bytes(image.value)  # nothing drawn: nothing shown
    w.plan_button.click()
    assert image.layout.display == "none"
    w.run_button.click()
    assert w.wait(60) == "done", w.errors.message.value
    assert w.monitor.idle.wait(60)
    assert bytes(image.value).startswith(PNG) and image.layout.display == ""  # the chart of the run
    m = MemoryMonitor(show_button=False)
    assert m.image.layout.display == "none"


def test_reshard_wizard_asks_for_the_pipeline_and_passes_it_to_the_plan(parallel_fixtures, tmp_path, monkeypatch):
    """A pipeline change the checkpoint does not decide is refused; the pipeline fields then appear, and what
    the user types there reaches plan_reshard as ckpt reshard reads --pp-partition and --pp-tied."""
    fx = parallel_fixtures[MESH]
    out = tmp_path / "rs"
    seen = []
    real = ckptlib.plan_reshard
    monkeypatch.setattr(ckptlib, "plan_reshard", lambda *a, **k: seen.append(k) or real(*a, **k))
    w = ReshardWizard(fx["checkpoint_path"], out=out, world_size=2)
    assert w.pipeline.layout.display == "none"                  # not needed so far: not shown
    w.pp.value = 3
    w.plan_button.click()
    assert w.plan is None and w.run_button.disabled
    assert isinstance(w.errors.errors[-1], ckptlib.errors.PipelineUnknownError)
    assert "several pipelines" in w.errors.message.value and "--pp-partition" in w.errors.message.value
    assert w.pipeline.layout.display == ""                      # now it is
    w.pp_partition.value = "0,3,5,7"
    w.pp_tied.value = "embed:0,6"
    w.plan_button.click()
    assert w.plan is not None, w.errors.message.value
    assert seen[-1]["pp_partition"] == "0,3,5,7" and seen[-1]["pp_tied"] == {"embed": [0, 6]} and seen[-1]["pp"] == 3
    assert "boundaries [0, 3, 5, 7]" in " ".join(w.plan.notes)
    w.run_button.click()
    assert w.wait(120) == "done", (w.status.value, w.errors.message.value)
    assert all(c.ok for c in w.verification), w.verification
    mesh = ckptlib.open_checkpoint(out).mesh
    assert (mesh.pp, mesh.tp) == (3, 2)


def test_reshard_wizard_reads_the_pipeline_fields_as_the_cli_does(tmp_path):
    from ckptlib.reshard.stages import parse_partition

    w = ReshardWizard(SAMPLE, out=tmp_path / "rs", pp_partition="parameters", pp_layers=9,
                      pp_tied={"embed": [0, 8]})
    assert w.pipeline.layout.display == ""                      # given: shown from the start
    assert w.pipeline_options() == {"pp_partition": "parameters", "pp_layers": 9, "pp_tied": {"embed": [0, 8]}}
    w.pp_partition.value, w.pp_layers.value, w.pp_tied.value = " 0,4,7 ", "", "embed:0,6; head:2,5 x:1"
    assert w.pipeline_options() == {"pp_partition": "0,4,7", "pp_tied": {"embed": [0, 6], "head": [2, 5], "x": [1]}}
    assert parse_partition(w.pipeline_options()["pp_partition"]) == (None, [0, 4, 7])
    w.pp_partition.value, w.pp_tied.value = "", ""
    assert w.pipeline_options() == {}
    w.pp_layers.value = "seven"
    w.plan_button.click()
    assert w.plan is None and "--pp-layers &#x27;seven&#x27;" in w.errors.message.value
    w.pp_layers.value, w.pp_tied.value = "", "embed"            # the CLI's own words for a bad --pp-tied
    w.plan_button.click()
    assert "--pp-tied &#x27;embed&#x27;: give KEY:LAYER,LAYER" in w.errors.message.value


def test_reshard_wizard_shows_a_refusal_as_the_cli_does(parallel_fixtures, tmp_path, capsys):
    """The message and the hint ``ckpt reshard`` prints, each in its place; no traceback; the pipeline fields
    stay hidden for a refusal they cannot help."""
    import html

    from ckptlib.cli import main

    fx = parallel_fixtures[MESH]
    for args, needs_pipeline in ((["--tp", "3"], False), (["--pp", "3"], True)):
        assert main(["reshard", str(fx["checkpoint_path"]), str(tmp_path / "cli"), "--world-size", "2", *args]) == 2
        err = capsys.readouterr().err
        head, _, hint = err.strip().partition("\n  hint: ")
        message = head.removeprefix("ckpt reshard: error: ")
        assert message != head and hint
        w = ReshardWizard(fx["checkpoint_path"], out=tmp_path / "o", world_size=2)
        {"--tp": w.tp, "--pp": w.pp}[args[0]].value = int(args[1])
        w.plan_button.click()
        shown = w.errors.message.value
        assert "class='ckpt-error-message'" in shown and f"white-space:pre-wrap'>{html.escape(message)}</div>" in shown
        assert f"<b>hint:</b> {html.escape(hint)}</div>" in shown
        assert "Traceback" not in shown and w.errors.details.outputs == ()
        assert w.errors.layout.display == "" and w.plan is None
        assert (w.pipeline.layout.display == "") is needs_pipeline


def test_reshard_wizard_plans_again_when_a_size_changes(tmp_path):
    w = ReshardWizard(SAMPLE, out=tmp_path / "rs", world_size=3)
    w.plan_button.click()
    assert w.plan is not None
    w.world_size.value = 4                                     # inside a box: still an option of the plan
    assert w.plan is None and w.run_button.disabled and "plan again" in w.plan_view.value


def test_reshard_wizard_marks_the_fields_a_refusal_asks_for(parallel_fixtures, tmp_path):
    """A refusal that names no option (its default hint: the whole description) asks for every pipeline field; a
    plan made clears the marks. (ds_to_universal's folders, which ask for --pp-tied alone:
    tests/test_notebook_refusals.py.)"""
    w = ReshardWizard(parallel_fixtures[MESH]["checkpoint_path"], out=tmp_path / "rs", world_size=2)
    w.pp.value = 3
    w.plan_button.click()
    assert "several pipelines" in w.errors.message.value
    assert w.asked == ["pp_partition", "pp_layers", "pp_tied"]
    assert all("ckpt-asked" in f._dom_classes for f in (w.pp_partition, w.pp_layers, w.pp_tied))
    assert "pipeline split" in w.pipeline_asks.value and "--pp-tied" in w.pipeline_asks.value
    w.pp_partition.value, w.pp_tied.value = "0,3,5,7", "embed:0,6"
    w.plan_button.click()
    assert w.plan is not None and w.asked == [] and w.pipeline_asks.value == ""
    assert not any("ckpt-asked" in f._dom_classes or f.layout.border for f in (w.pp_partition, w.pp_layers, w.pp_tied))


def test_a_notebook_cell_shows_a_refusal_as_the_cli_does(tmp_path, capsys, monkeypatch):
    """``with refusals(...)``: one of ckptlib's errors is shown (the message and the hint ``ckpt`` prints, in a box)
    and not raised; anything else (a bug) is raised and nothing is shown. ``fits`` shows a plan that does not fit as
    a refusal."""
    import dataclasses
    import html

    import IPython.display

    from ckptlib.cli import main
    from ckptlib.ui import fits, refusal_html, refusals

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(o.data for o in objs))
    assert main(["reshard", str(SAMPLE), str(tmp_path / "cli"), "--world-size", "2", "--tp", "2"]) == 2
    head, _, hint = capsys.readouterr().err.strip().partition("\n  hint: ")
    message = head.removeprefix("ckpt reshard: error: ")
    assert message != head and hint
    with refusals("plan") as refused:
        ckptlib.plan_reshard(SAMPLE, tmp_path / "rs", 2, tp=2)
    assert isinstance(refused.error, ckptlib.UnsupportedCheckpointError) and refused
    assert shown == [refusal_html(refused.error, "plan")]
    box = shown[0]
    assert box.startswith("<div class='ckpt-refusal' data-error='UnsupportedCheckpointError'")
    assert "&#9888; plan: error" in box and f"white-space:pre-wrap'>{html.escape(message)}</div>" in box
    assert f"<b>hint:</b> {html.escape(hint)}</div>" in box and not (tmp_path / "rs").exists()
    with pytest.raises(ZeroDivisionError):
        with refusals("a bug"):
            1 / 0
    with refusals() as refused:
        plan = ckptlib.plan_reshard(SAMPLE, tmp_path / "rs", 3)
    assert not refused and refused.error is None and len(shown) == 1
    pre = ckptlib.preflight(plan)
    assert pre.ok and fits(pre) and len(shown) == 1
    assert not fits(dataclasses.replace(pre, disk_free=0)) and len(shown) == 2
    assert "not enough memory or disk for this run (disk: does NOT fit" in shown[1] and "<b>hint:</b>" in shown[1]
