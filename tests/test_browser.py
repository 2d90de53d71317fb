"""One real-browser test: JupyterLab on 127.0.0.1, Debian's headless Chromium driven by Playwright; open
01_browse, run all cells, find the file table and the layout figure in the page. The screenshot is kept
in test-artifacts/ (git-ignored)."""
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
