"""Real-browser tests: JupyterLab on 127.0.0.1, Debian's headless Chromium driven by Playwright; open a
notebook, run all cells, then find (and use) its widgets in the page: 01_browse's file table and chart,
04_reshard's wizard (a tp 2 -> 1 reshard through its own fields), 05_health_and_diff's views. The
screenshots are kept in test-artifacts/ (git-ignored)."""
from __future__ import annotations


import pytest

from tests.jupyterlab_driver import ROOT, chromium, chromium_missing_reason, errors_in_page, jupyterlab, open_and_run_all

reason = chromium_missing_reason()
if reason:
    pytest.skip(reason, allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra (bash scripts/setup.sh --dev)")
pytest.importorskip("jupyterlab", reason="jupyterlab is in the notebooks extra")

ARTIFACTS = ROOT / "test-artifacts"


def test_01_browse_in_jupyterlab_in_chromium():
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "01_browse.png"
    with jupyterlab([ROOT / "notebooks" / "01_browse.ipynb"]) as lab, chromium(1400, 1000) as page:
        try:
            open_and_run_all(page, lab, "01_browse.ipynb")
            assert not errors_in_page(page)
            # the live widget rendered (a kernel-backed view, not the "CheckpointBrowser(...)" text)
            browser = page.locator(".ckpt-browser")
            browser.wait_for(state="visible", timeout=30_000)
            assert "global_step2" in browser.inner_text()
            # clicking its Files tab shows the file table and the bar chart
            browser.get_by_role("tab", name="Files").click()
            table = browser.locator("table.ckpt-file-table")
            table.wait_for(state="visible", timeout=15_000)
            text = table.inner_text()
            assert "mp_rank_00_model_states.pt" in text and "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in text
            chart = browser.locator(".ckpt-file-chart")
            assert chart.evaluate("img => img.naturalWidth") > 100
            # the file table as cell output too (the notebook's record of the migration)
            assert page.locator(".jp-OutputArea-output table.ckpt-file-table").count() == 2  # widget + output
            browser.scroll_into_view_if_needed()
        finally:
            page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


def test_05_health_and_diff_in_jupyterlab_in_chromium(parallel_fixtures, tmp_path):
    """On a tensor-parallel checkpoint: the health view (per-layer norm bars, its norms figure) and the diff
    view (the table, its figure) render as live widgets, and each figure is drawn once."""
    import json

    import ckptlib

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "05_health_and_diff.png"
    ckpt = parallel_fixtures["tp2_dp2_z1_bf16"]["checkpoint_path"]
    health, changed = ckptlib.check(ckpt, states=True), None
    nb = json.loads((ROOT / "notebooks" / "05_health_and_diff.ipynb").read_text())
    for cell in nb["cells"]:  # the notebook as a user runs it on their checkpoint: checkpoint_dir set
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cell["source"] = [line.replace('"../samples/zero2_bf16_w2/ckpt"', json.dumps(str(ckpt)))
                              .replace('output_dir = "output"', f"output_dir = {json.dumps(str(tmp_path))}")
                              for line in cell["source"]]
    notebook = tmp_path / "05_health_and_diff.ipynb"
    notebook.write_text(json.dumps(nb))
    with jupyterlab([notebook]) as lab, chromium(1400, 1000) as page:
        try:
            open_and_run_all(page, lab, "05_health_and_diff.ipynb")
            assert not errors_in_page(page)
            view = page.locator(".ckpt-health-view")
            view.wait_for(state="visible", timeout=30_000)
            assert f"healthy: {len(health.tensors)} tensors" in view.inner_text()
            table = view.locator("table.ckpt-health-table")
            assert table.locator(".ckpt-norm-bar").count() > 10
            some = health.tensors[0].key
            assert some in table.inner_text()
            norms = view.locator("img.ckpt-norms-figure")
            assert norms.evaluate("img => img.naturalWidth") > 400
            norms.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "05_health_and_diff-health.png"))
            diff = page.locator(".ckpt-diff-view")
            diff.scroll_into_view_if_needed()
            # the bf16 export of the checkpoint: every floating tensor changed by the rounding
            changed = ckptlib.diff(ckpt, tmp_path / "diff-bf16").counts["changed"]
            assert changed > 0 and f"{changed} changed" in diff.inner_text()
            assert "ckpt-diff-table" in diff.inner_html()
            figure = diff.locator("img.ckpt-diff-figure")
            figure.wait_for(state="visible", timeout=15_000)
            assert figure.evaluate("img => img.naturalWidth") > 400
            # each figure once: in its view, and in no cell output besides
            assert page.locator("img.ckpt-diff-figure").count() == 1
            assert page.locator("img.ckpt-norms-figure").count() == 1
            assert page.locator(".jp-RenderedImage img").count() == 0
            figure.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "05_health_and_diff-diff.png"))
        finally:
            page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


def test_04_reshard_wizard_finishes_a_tensor_change_in_chromium(parallel_fixtures, tmp_path):
    """Notebook 04 on a pp 2 x tp 2 x dp 2 PipelineModule checkpoint: the wizard's labels are whole, no
    empty image shows before a run, and tp 2 -> 1 is planned, run and verified through its own fields."""
    import json

    import ckptlib

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "04_reshard-wizard.png"
    src = parallel_fixtures["pp2_tp2_dp2_z1_bf16"]["checkpoint_path"]
    nb = json.loads((ROOT / "notebooks" / "04_reshard.ipynb").read_text())
    for cell in nb["cells"]:  # the notebook as a user runs it on their checkpoint: checkpoint_dir set
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cell["source"] = [line.replace('"../samples/zero2_bf16_w2/ckpt"', json.dumps(str(src)))
                              .replace('output_dir = "output"', f"output_dir = {json.dumps(str(tmp_path))}")
                              for line in cell["source"]]
    notebook = tmp_path / "04_reshard.ipynb"
    notebook.write_text(json.dumps(nb))
    out = tmp_path / "reshard-wizard"
    with jupyterlab([notebook]) as lab, chromium(1400, 1000) as page:
        try:
            open_and_run_all(page, lab, "04_reshard.ipynb")
            assert not errors_in_page(page)
            wizard = page.locator(".ckpt-reshard-wizard")
            wizard.wait_for(state="visible", timeout=30_000)
            wizard.scroll_into_view_if_needed()
            # every label whole: its text fits its box ("tensor ranks", not "tensor ra…")
            labels = wizard.locator(".widget-label, .widget-label-basic").evaluate_all(
                "els => els.filter(e => e.offsetParent !== null)"
                "          .map(e => [e.innerText.trim(), e.scrollWidth, e.clientWidth])")
            texts = {t for t, _, _ in labels}
            assert {"data ranks", "tensor ranks", "stages", "expert ranks", "output"} <= texts, labels
            cut = [(t, sw, cw) for t, sw, cw in labels if t and sw > cw]
            assert not cut, cut
            # no image before there is something to draw
            chart = wizard.locator("img.ckpt-memory-chart")
            assert chart.count() == 1 and not chart.is_visible()

            def field(label: str):
                return wizard.locator(".widget-inline-hbox").filter(
                    has=page.locator(".widget-label", has_text=label)).locator("input")

            def set_value(label: str, value: str):
                box = field(label)
                box.fill(value)
                box.press("Enter")

            def plan_it():  # click Plan; wait for the plan or for a refusal
                wizard.get_by_role("button", name="Plan").click()
                page.wait_for_function(
                    """el => el.querySelector('.ckpt-plan').innerText.includes('tp=1')
                             || el.querySelector('.ckpt-error-area').offsetParent !== null""",
                    arg=wizard.element_handle(), timeout=30_000)

            set_value("tensor ranks", "1")
            set_value("data ranks", "2")
            field("tensor ranks").scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "04_reshard-wizard-fields.png"))
            plan_it()
            pipeline = wizard.locator(".ckpt-pipeline-fields")
            if pipeline.is_visible():  # the mesh change needs the pipeline's split: say it, plan again
                assert wizard.locator(".ckpt-error-hint").inner_text().startswith("hint:")
                set_value("pipeline split", "uniform")
                plan_it()
            plan = wizard.locator(".ckpt-plan")
            assert "pp=2 tp=2 dp=2 -> pp=2 tp=1 dp=2" in plan.inner_text(), wizard.inner_text()
            wizard.get_by_role("button", name="Run").click()
            verified = wizard.locator(".ckpt-verify")
            verified.wait_for(state="visible", timeout=120_000)
            assert verified.inner_text().startswith("verified"), verified.inner_text()
            assert "yes" in wizard.locator(".ckpt-summary-box").inner_text()
            assert not wizard.locator(".ckpt-error-area").is_visible()
            chart.wait_for(state="visible", timeout=30_000)  # the run's memory chart, once there is one
            assert chart.evaluate("img => img.naturalWidth") > 100
            wizard.scroll_into_view_if_needed()
        finally:
            page.screenshot(path=str(shot), full_page=True)
    resharded = ckptlib.open_checkpoint(out)
    assert (resharded.mesh.pp, resharded.mesh.tp, resharded.partition_count) == (2, 1, 2)
    check = ckptlib.verify(ckptlib.plan_reshard(src, tmp_path / "unused", 2, tp=1), out)  # ckptlib's own word too
    assert check.ok, check.describe()
    assert shot.stat().st_size > 10_000
