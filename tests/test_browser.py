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
            # the file table as cell output, and the layout figure (an image/png output) at the end
            assert page.locator(".jp-OutputArea-output table.ckpt-file-table").count() == 2  # widget + output
            layout_cell = page.locator(".jp-CodeCell").filter(has_text="layout_figure(ckpt)").last
            figure = layout_cell.locator(".jp-RenderedImage img")
            figure.scroll_into_view_if_needed()
            figure.wait_for(state="visible", timeout=15_000)
            assert figure.evaluate("img => img.naturalWidth") > 400
            page.screenshot(path=str(ARTIFACTS / "01_browse-layout.png"))
            browser.scroll_into_view_if_needed()
        finally:
            page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


def test_05_health_and_diff_in_jupyterlab_in_chromium():
    """The health view (per-layer norm bars) and the diff view (its figure) render as live widgets."""
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "05_health_and_diff.png"
    with jupyterlab([ROOT / "notebooks" / "05_health_and_diff.ipynb"]) as lab, chromium(1400, 1000) as page:
        try:
            open_and_run_all(page, lab, "05_health_and_diff.ipynb")
            assert not errors_in_page(page)
            health = page.locator(".ckpt-health-view")
            health.wait_for(state="visible", timeout=30_000)
            assert "healthy: 35 tensors" in health.inner_text()
            table = health.locator("table.ckpt-health-table")
            assert table.locator("tr.ckpt-layer-row").count() == 8 + 7  # layers of the masters, then of the states
            assert table.locator(".ckpt-norm-bar").count() > 30 and "embed.weight" in table.inner_text()
            health.screenshot(path=str(ARTIFACTS / "05_health_and_diff-health.png"))
            health.get_by_placeholder("part of a tensor name").fill("fc1")
            health.get_by_placeholder("part of a tensor name").press("Enter")
            page.wait_for_function("() => !document.querySelector('.ckpt-health-table').innerText"
                                   ".includes('embed.weight')", timeout=15_000)
            view = page.locator(".ckpt-diff-view")
            view.scroll_into_view_if_needed()
            assert "12 changed" in view.inner_text() and "fc1.weight" in view.locator("table.ckpt-diff-table").inner_text()
            figure = view.locator("img.ckpt-diff-figure")
            figure.wait_for(state="visible", timeout=15_000)
            assert figure.evaluate("img => img.naturalWidth") > 400
            page.screenshot(path=str(ARTIFACTS / "05_health_and_diff-diff.png"))
        finally:
            page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
