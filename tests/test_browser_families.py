"""Issue 38 in a real browser: every notebook (00-06) runs in JupyterLab in Debian's headless Chromium, with no error
output, on real checkpoints of Muon (ZeRO-2, 3 ranks), AutoEP (Mixtral, ep 2 x expert-data-parallel 2), a peft
adapter (LoRA, ZeRO-3, with its base), a universal folder (DeepSpeed's ds_to_universal of a pipeline) and a
pp 2 x tp 2 x dp 2 mesh; the new pictures' facts are read from the page (``figure.ckpt-picture[data-facts]``) and
checked against the checkpoint. Two notebooks run at a time (two pages, two kernels). Screenshots in test-artifacts/.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import contextlib

from tests.jupyterlab_driver import CHROMIUM, CHROMIUM_ARGS, ROOT, chromium_missing_reason, jupyterlab

reason = chromium_missing_reason()
if reason:
    pytest.skip(reason, allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra (bash scripts/setup.sh --dev)")
pytest.importorskip("jupyterlab", reason="jupyterlab is in the notebooks extra")

ARTIFACTS = ROOT / "test-artifacts"
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
FAMILIES = ("muon-z2", "autoep-z2", "peft", "universal-ds-pipeline", "3d")


@contextlib.contextmanager
def two_pages(width: int = 1400, height: int = 1000):
    """Two Playwright pages of one Chromium context (two notebooks at a time)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            pages = [context.new_page(), context.new_page()]
            for page in pages:
                page.set_default_timeout(60_000)
            yield pages
        finally:
            browser.close()


def _with_parameters(src: Path, dst: Path, parameters: dict) -> None:
    """``src`` with its parameters cell given ``parameters`` (as a user sets them), written to ``dst``."""
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            cell["source"] = ["".join(cell["source"]) + "\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                                        for k, v in parameters.items())]
    dst.write_text(json.dumps(nb))


def _start(page, lab, notebook: str) -> None:
    page.goto(lab.url(notebook, workspace=Path(notebook).stem.replace("_", "-")))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.wait_for_function(
        """(name) => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                   const k = w && w.context && w.context.path.endsWith(name) && w.sessionContext
                             && w.sessionContext.session && w.sessionContext.session.kernel;
                   return !!k && k.status === 'idle'; }""", arg=notebook, timeout=120_000)
    page.evaluate("window.jupyterapp.shell.collapseLeft()")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def _wait(page, timeout_ms: int = 240_000) -> None:
    page.wait_for_function(
        """() => { const w = window.jupyterapp.shell.currentWidget;
                   const cells = w.content.widgets.filter(c => c.model.type === 'code');
                   const k = w.sessionContext.session && w.sessionContext.session.kernel;
                   return !!k && cells.length > 0 && cells.every(c => c.model.executionCount)
                          && k.status === 'idle'; }""", timeout=timeout_ms)


def _errors(page) -> list:
    return page.eval_on_selector_all(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']", "els => els.map(e => e.innerText)")


def _pictures(page) -> dict:
    found: dict = {}
    for kind, facts in page.eval_on_selector_all(
            "figure.ckpt-picture", "els => els.map(e => [e.dataset.kind, e.dataset.facts])"):
        found.setdefault(kind, []).append(json.loads(facts))
    return found


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    from tests.families import family_checkpoints

    return family_checkpoints(tmp_path_factory.mktemp("browser-families"), only=FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_notebook_runs_in_chromium(checkpoints, family, tmp_path):
    import ckptlib

    ARTIFACTS.mkdir(exist_ok=True)
    path = checkpoints[family]
    parameters = {"checkpoint_dir": str(path), "output_dir": str(tmp_path / "output")}
    extra = {}
    if family == "peft":
        from tests.families import _fixture

        fx = _fixture("tests.fixtures.peft.factory", "peft_lora_qv_z3")
        extra["03_export_weights.ipynb"] = {"adapter_checkpoint_dir": str(fx["checkpoint_path"]),
                                            "adapter_base_dir": str(fx["base_path"])}
    if family == "autoep-z2":  # an AutoEP checkpoint records no model class: the export takes the model's config
        extra["03_export_weights.ipynb"] = {"model_config": str(path.parents[0] / "hf_config" / "config.json")}
    folder = tmp_path / "notebooks"
    folder.mkdir()
    for name in NOTEBOOKS:
        _with_parameters(ROOT / "notebooks" / name, folder / name, {**parameters, **extra.get(name, {})})
    with ckptlib.open_checkpoint(path) as ck:
        facts = json.loads(json.dumps(ckptlib.describe(ck), default=str))
    seen: dict = {}
    with jupyterlab([folder / n for n in NOTEBOOKS]) as lab, two_pages() as (first, second):
        for a, b in zip(NOTEBOOKS[0::2], NOTEBOOKS[1::2] + [None]):
            pages = [(first, a)] + ([(second, b)] if b else [])
            for page, name in pages:
                _start(page, lab, name)
            for page, name in pages:
                _wait(page)
                assert not _errors(page), (name, _errors(page))
                seen[name] = _pictures(page)
                if name in ("01_browse.ipynb", "02_partition_layout.ipynb", "03_export_weights.ipynb"):
                    page.screenshot(path=str(ARTIFACTS / f"{family}-{Path(name).stem}.png"), full_page=True)
    placed = facts["placement"]
    browse, layout = seen["01_browse.ipynb"], seen["02_partition_layout.ipynb"]
    for kind in ("experts", "grid", "universal"):  # 01: where the files sit, as the summary places them
        assert browse.get(kind, [None])[0] == (placed[kind] or None), kind
    groups = layout.get("groups", [{}])[0].get("panels", [])
    assert [(g["label"], g["optimizer"], g["keys"]) for g in groups] == \
        [(g["label"], g["optimizer"], g["keys"]) for g in placed["groups"]]
    if family == "muon-z2":  # whole matrices per rank, a straddling one held whole by both ranks
        muon = layout["muon"][0]["groups"]
        assert muon == placed["whole_matrices"]
        assert any(m["straddles"] for g in muon for r in g["ranks"] for m in r["matrices"])
    if family == "autoep-z2":
        experts = browse["experts"][0]
        assert experts["ep"] == 2 and experts["edp"] == 2
    if family == "3d":
        grid = browse["grid"][0]
        assert (grid["pp"], grid["tp"], grid["dp"]) == (2, 2, 2)
    if family == "universal-ds-pipeline":
        assert browse["universal"][0]["absent"]  # its buffers: ds_to_universal copies no layer files
    if family == "peft":
        adapter = seen["03_export_weights.ipynb"].get("adapter")
        assert adapter, list(seen["03_export_weights.ipynb"])
    shutil.rmtree(tmp_path / "output", ignore_errors=True)
