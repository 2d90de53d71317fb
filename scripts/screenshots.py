#!/usr/bin/env python
"""Take the README's screenshots of the notebooks in a real browser (Debian's headless Chromium).

    .venv/bin/python scripts/screenshots.py            # writes docs/notebook-*.png

Needs the dev extra (playwright) and /usr/bin/chromium (apt-get install -y chromium). Each notebook is
opened in JupyterLab (served from a temporary copy), all its cells are run on the bundled sample
checkpoint, and the widgets are used as a person would (tabs, search, Plan, Run) before the picture.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.jupyterlab_driver import chromium, chromium_missing_reason, errors_in_page, jupyterlab, open_and_run_all  # noqa: E402

DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def cell(page, text: str):
    return page.locator(".jp-CodeCell").filter(has_text=text).last


def shot(page, locator, name: str) -> None:
    locator.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    locator.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(500)
    path = DOCS / name
    page.screenshot(path=str(path))
    print("wrote", path.relative_to(ROOT))


def run_wizard(page, wizard, timeout_ms=120_000) -> None:
    wizard.get_by_role("button", name="Plan").click()
    wizard.locator(".ckpt-plan pre").wait_for(timeout=timeout_ms)
    wizard.get_by_role("button", name="Run").click()
    wizard.locator(".ckpt-summary-box").filter(has_text="Summary").wait_for(timeout=timeout_ms)
    page.wait_for_timeout(2500)  # the memory chart samples on for a second after a short run


def main() -> int:
    reason = chromium_missing_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    DOCS.mkdir(exist_ok=True)
    with jupyterlab(NOTEBOOKS) as lab, chromium(1400, 1050) as page:
        open_and_run_all(page, lab, "00_start_here.ipynb")
        assert not errors_in_page(page), errors_in_page(page)
        shot(page, cell(page, "format_text(ckpt)"), "notebook-00-start.png")

        open_and_run_all(page, lab, "01_browse.ipynb")
        browser = page.locator(".ckpt-browser")
        browser.get_by_role("tab", name="Files").click()
        browser.locator("table.ckpt-file-table").wait_for()
        shot(page, cell(page, "CheckpointBrowser(checkpoint_dir)"), "notebook-01-browse.png")

        open_and_run_all(page, lab, "02_partition_layout.ipynb")
        view = page.locator(".ckpt-layout-view")
        view.locator(".ckpt-param-search input").fill("fc1")
        view.locator(".ckpt-param-select select").select_option("fc1.weight")
        view.locator(".ckpt-where table").wait_for()
        page.wait_for_timeout(1000)
        shot(page, cell(page, "LayoutView(ckpt)"), "notebook-02-layout.png")

        page.set_viewport_size({"width": 1400, "height": 1560})  # the wizards are tall
        open_and_run_all(page, lab, "03_export_weights.ipynb")
        wizard = page.locator(".ckpt-export-wizard")
        wizard.scroll_into_view_if_needed()
        run_wizard(page, wizard)
        shot(page, wizard, "notebook-03-export.png")

        open_and_run_all(page, lab, "04_reshard.ipynb")
        wizard = page.locator(".ckpt-reshard-wizard")
        wizard.scroll_into_view_if_needed()
        run_wizard(page, wizard)
        shot(page, wizard, "notebook-04-reshard.png")
    pictures()
    return 0


def element(page, locator, name: str) -> None:
    """A picture of one element (a figure and its caption)."""
    locator.scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    path = DOCS / name
    locator.screenshot(path=str(path))
    print("wrote", path.relative_to(ROOT))


#: (family of tests/families.py, notebook, what to picture, file): issue 38's pictures on real checkpoints
PICTURES = [("muon-z2", "02_partition_layout.ipynb", "figure.ckpt-picture-groups", "notebook-02-groups.png"),
            ("muon-z2", "02_partition_layout.ipynb", "figure.ckpt-picture-muon", "notebook-02-muon.png"),
            ("autoep-z2", "01_browse.ipynb", "figure.ckpt-picture-experts", "notebook-01-experts.png"),
            ("3d", "01_browse.ipynb", "figure.ckpt-picture-grid", "notebook-01-grid.png"),
            ("universal-ds-pipeline", "01_browse.ipynb", "figure.ckpt-picture-universal", "notebook-01-universal.png"),
            ("peft", "03_export_weights.ipynb", ".ckpt-adapter-view", "notebook-03-adapter.png")]


def pictures() -> None:
    """The pictures of issue 38, each on a real checkpoint of its family (the test fixtures: built on first use)."""
    import json
    import tempfile

    from tests.families import _fixture, family_checkpoints

    work = Path(tempfile.mkdtemp(prefix="ckptlib-shots-"))
    paths = family_checkpoints(work, only={f for f, *_ in PICTURES})
    for family in dict.fromkeys(f for f, *_ in PICTURES):
        folder = work / family
        folder.mkdir()
        todo = [(nb, sel, name) for f, nb, sel, name in PICTURES if f == family]
        for nb in dict.fromkeys(nb for nb, _, _ in todo):
            params = {"checkpoint_dir": str(paths[family]), "output_dir": str(work / "output" / family)}
            if family == "peft":
                fx = _fixture("tests.fixtures.peft.factory", "peft_lora_qv_z3")
                params.update(adapter_checkpoint_dir=str(fx["checkpoint_path"]), adapter_base_dir=str(fx["base_path"]))
            book = json.loads((ROOT / "notebooks" / nb).read_text())
            for c in book["cells"]:
                if "parameters" in c.get("metadata", {}).get("tags", []):
                    c["source"] = ["".join(c["source"]) + "\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                                       for k, v in params.items())]
            (folder / nb).write_text(json.dumps(book))
        with jupyterlab([folder / nb for nb in dict.fromkeys(nb for nb, _, _ in todo)]) as lab, \
                chromium(1400, 1050) as page:
            for nb in dict.fromkeys(nb for nb, _, _ in todo):
                open_and_run_all(page, lab, nb)
                assert not errors_in_page(page), errors_in_page(page)
                for _, sel, name in (t for t in todo if t[0] == nb):
                    element(page, page.locator(sel).first, name)


if __name__ == "__main__":
    sys.exit(main())
