"""Every notebook in notebooks/ runs headless (papermill, a real kernel) against ZeRO-1, 2 and 3
checkpoints made by DeepSpeed, and produces its figures."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.kernels import execute_notebook

pm = pytest.importorskip("papermill", reason="papermill is in the dev extra (bash scripts/setup.sh --dev)")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb"))
FIXTURES = ["z1_bf16_w3", "z2_fp32_w4", "z3_bf16_w2"]


def test_the_suite_is_there():
    assert NOTEBOOKS == ["00_start_here", "01_browse", "02_partition_layout", "03_export_weights", "04_reshard",
                         "05_health_and_diff", "06_migrate_to_fsdp"]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_has_parameters_cell(notebook):
    nb = json.loads((NOTEBOOK_DIR / f"{notebook}.ipynb").read_text())
    cells = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, "exactly one cell tagged 'parameters'"
    src = "".join(cells[0]["source"])
    assert "checkpoint_dir = " in src and "output_dir = " in src
    assert '"../samples/zero2_bf16_w2/ckpt"' in src


def _figure_cells(nb) -> list:
    """Code cells that draw a figure (their source calls a ``*_figure(`` function)."""
    return [c for c in nb.cells if c.cell_type == "code" and "_figure(" in c.source
            and not c.source.lstrip().startswith("from ckptlib.ui import LayoutView")]


#: widgets that draw a figure of their own (checked in a real browser by tests/test_browser.py)
VIEWS = ("CheckpointBrowser(", "LayoutView(", "HealthView(", "DiffView(")
#: the figure each view draws: a notebook that shows the view does not draw it again
DRAWN_BY = {"HealthView(": "norms_figure(", "DiffView(": "diff_figure(", "CheckpointBrowser(": "file_sizes_figure("}


def _view_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code" and any(v in c.source for v in VIEWS)]


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_each_figure_is_drawn_once(notebook):
    """A guided migration shows each step once: no figure call repeated, none a view in the notebook draws."""
    nb = nbformat.read(NOTEBOOK_DIR / f"{notebook}.ipynb", as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    calls = re.findall(r"\b(\w+_figure\([^)]*\))", source)
    assert len(calls) == len(set(calls)), calls
    for view, figure in DRAWN_BY.items():
        assert not (view in source and figure in source), f"{notebook} shows {view} and draws its {figure} again"


def _pngs(cell) -> int:
    return sum(1 for o in cell.get("outputs", []) if "image/png" in o.get("data", {}))


def _execute(notebook: str, checkpoint: Path, out_dir: Path, executed: Path, **parameters) -> None:
    execute_notebook(NOTEBOOK_DIR / f"{notebook}.ipynb", executed,
                     {"checkpoint_dir": str(checkpoint), "output_dir": str(out_dir), **parameters})


@pytest.fixture(scope="session")
def executed_notebooks(ds_fixtures, tmp_path_factory) -> dict:
    """Every notebook run on every fixture, two at a time (each in its own kernel): most of a run is
    a kernel starting and importing torch, so two overlap well even on two cores."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for fixture in FIXTURES:
            if fixture not in ds_fixtures:
                continue
            for notebook in NOTEBOOKS:
                work = tmp_path_factory.mktemp(f"{notebook}-{fixture}")
                out_dir, executed = work / "output", work / f"{notebook}.ipynb"
                future = pool.submit(_execute, notebook, ds_fixtures[fixture]["checkpoint_path"], out_dir, executed)
                jobs[notebook, fixture] = (future, out_dir, executed)
        return {key: (future.exception(), out_dir, executed) for key, (future, out_dir, executed) in jobs.items()}


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_runs_headless(notebook, fixture, fixture_by_name, executed_notebooks):
    fx = fixture_by_name(fixture)
    error, out_dir, executed = executed_notebooks[notebook, fixture]
    if error is not None:
        raise error
    nb = nbformat.read(executed, as_version=4)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    figure_cells, view_cells = _figure_cells(nb), _view_cells(nb)
    assert figure_cells or view_cells, "every notebook draws at least one figure (itself or in a view)"
    for c in figure_cells:
        assert _pngs(c) >= 1, f"no image/png output from:\n{c.source}"
    for c in view_cells:  # the live widget (its figure is looked at in Chromium)
        assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in c.get("outputs", [])), \
            f"no widget output from:\n{c.source}"
    # the parameters were used: the checkpoint opened is the fixture
    text = json.dumps([o for c in nb.cells for o in c.get("outputs", [])])
    assert str(fx["checkpoint_path"]) in text
    if notebook == "03_export_weights":
        assert (out_dir / "export" / "model.safetensors").is_file()
        assert "no adapter here: set adapter_checkpoint_dir" in text and not (out_dir / "adapter").exists()
    if notebook == "04_reshard":
        assert (out_dir / "reshard" / "latest").is_file()
    if notebook == "06_migrate_to_fsdp":  # written, verified, diffed all same, loaded by FSDP2 bit for bit
        assert (out_dir / "dcp" / ".metadata").is_file() and "verification failed" not in text
        assert " 0 changed, 0 only in A, 0 only in B, 0 shape changed" in text
        n = sum(1 for p in fx["parameters"] if p["trainable"] and not p["tied_to"])
        assert f"FSDP2 holds, bit for bit: {n} of {n} masters, {n} of {n} exp_avg, {n} of {n} exp_avg_sq" in text
    if notebook == "05_health_and_diff":  # healthy, the fp32 export the same, the bf16 one changed
        assert (out_dir / "diff-fp32" / "model.safetensors").is_file() and (out_dir / "diff-bf16").is_dir()
        assert "healthy: " in text and " 0 changed, 0 only in A, 0 only in B, 0 shape changed" in text
        assert "largest relative change" in text


@pytest.mark.parametrize("notebook", ["01_browse", "02_partition_layout"])
def test_notebooks_browse_a_universal_checkpoint(fixture_by_name, tmp_path, notebook):
    """Issue 32: notebooks 01 and 02 open a universal folder: it is named as one, its files are listed, and the
    layout notebook says there are no partitions and where each state of a parameter is (its zero/ files)."""
    import ckptlib

    fx = fixture_by_name("z2_bf16_w2")
    uni = ckptlib.write_universal(fx["checkpoint_path"], tmp_path / "uc").out / f"{fx['tag']}_universal"
    executed = tmp_path / f"{notebook}.ipynb"
    _execute(notebook, uni, tmp_path / "output", executed)
    nb = nbformat.read(executed, as_version=4)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    text = json.dumps([o for c in nb.cells for o in c.get("outputs", [])])
    if notebook == "01_browse":
        assert "universal_fragment" in text or "zero/" in text, text[:2000]
    else:
        assert "a universal checkpoint" in text and "every tensor whole" in text
        assert "zero/embed.weight/fp32.pt" in text and "zero/embed.weight/exp_avg.pt" in text
        assert sum(_pngs(c) for c in nb.cells) >= 1  # the figure says it in words
