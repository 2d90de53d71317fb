"""Issue 38: the notebooks show what the library knows, for every family of checkpoint (tests/families.py).

- One summary: ``ckpt inspect``'s text is made from ``ckpt inspect --json`` alone (the JSON, round-tripped, gives
  the same text), and the browser's Summary, Files and Parameters tabs state every fact of that text.
- 01_browse and 02_partition_layout executed with papermill on each family state what inspect states (each group's
  optimizer and state keys, Muon's whole-matrix layout, experts per ep rank, the mesh, bf16 masters), their
  pictures carry facts that agree with the checkpoint, and no cell has error output.
"""
from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.families import FAMILIES, UNIVERSAL, family_checkpoints

ROOT = Path(__file__).resolve().parents[1]
ALL = list(FAMILIES) + list(UNIVERSAL)


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> dict:
    return family_checkpoints(tmp_path_factory.mktemp("families"))


def _text(markup: str) -> str:
    """What a person reads in HTML: tags dropped, entities resolved, runs of blanks as one."""
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", markup))).strip()


def _squash(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip()


@pytest.mark.parametrize("family", ALL)
def test_inspect_text_comes_from_its_json_and_every_tab_states_it(families, family):
    check_tabs(families[family], family)


def check_tabs(path: Path, family: str = "") -> None:
    """``ckpt inspect``'s text is what ``format_text`` makes of ``ckpt inspect --json``, and the browser's Summary, Files
    and Parameters tabs state every line of it."""
    import ckptlib
    from ckptlib.analysis.summary import closing, file_lines, parameter_lines, summary_rows
    from ckptlib.analysis.summary import format_text
    from ckptlib.ui import CheckpointBrowser

    out = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(path), "--json"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)  # what `ckpt inspect --json` printed: the one source
    text = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(path)], capture_output=True, text=True,
                          cwd=ROOT).stdout
    assert format_text(d) == text.rstrip("\n")  # the text is the JSON's: nothing in it that the JSON does not hold
    with ckptlib.open_checkpoint(path) as ck:
        assert json.loads(json.dumps(ckptlib.describe(ck), default=str))["placement"] == d["placement"]

    b = CheckpointBrowser(path)
    assert not b.errors.errors and b.checkpoint is not None
    summary, files, params = _text(b.summary.value), _text(b.file_table.value), _text(b.params.value)
    for label, value in summary_rows(d):  # every row of the summary, label and text
        assert _squash(f"{label} {value}") in summary, (label, value)
    for kind, value in closing(d):
        if kind != "read":
            assert _squash(value) in summary, (kind, value)
    for line in file_lines(d)[1:]:  # every file: name, size, kind, where in the mesh
        if "zero/<parameter>/" in line:
            continue
        name, size, unit, kind, *where = line.split()
        assert f"{name} {kind} {' '.join(where)} {size} {unit}".replace("  ", " ").strip() in files, line
    for line in parameter_lines(d)[1:200]:  # every parameter and buffer: name, shape, elements, kind
        assert _squash(line) in params, line
    # the facts each family is about, in the Summary tab
    expect = {"muon-z2": "momentum_buffer (bf16, whole matrices per rank)", "autoep-z2": "ep rank 1: experts 2-3",
              "autoep-z3": "ep rank 0: experts 0-1", "3d": "pipeline, 2 stages x 2 tensor ranks",
              "pipeline": "pipeline, 2 stages", "autotp": "tensor parallel, 2 tensor ranks",
              "deepspeed-moe": "expert parallel 2", "universal-ckptlib": "universal every tensor whole",
              "universal-ds-pipeline": "written by ds_to_universal", "peft": "adapter peft LoRA: r=4 alpha=8",
              "cpu-lion": "stepping Lion", "adafactor": "stepping Adafactor", "legacy": "legacy serialization",
              "sgd": "stepping SGD with momentum", "rmsprop": "stepping RMSprop", "adagrad": "stepping Adagrad",
              "cpu-adagrad": "stepping DeepSpeed CPU Adagrad", "bf16-optimizer": "(BF16_Optimizer)",
              "bf16-masters": "masters bf16: the optimizer's master weights themselves are bf16"}
    if family in expect:
        assert expect[family] in summary, (family, summary[:3000])


# ------------------------------------------------------------------------------------------------ 01 and 02 run
NOTEBOOKS = ("01_browse", "02_partition_layout")


@pytest.fixture(scope="session")
def executed_families(families, tmp_path_factory) -> dict:
    """01 and 02 executed with papermill on every family, two kernels at a time: ``{(notebook, family): (error,
    executed notebook path)}``."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_notebooks import _execute

    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for family, path in families.items():
            for notebook in NOTEBOOKS:
                work = tmp_path_factory.mktemp(f"{notebook}-{family}")
                executed = work / f"{notebook}.ipynb"
                jobs[notebook, family] = (pool.submit(_execute, notebook, path, work / "output", executed), executed)
        return {key: (future.exception(), executed) for key, (future, executed) in jobs.items()}


def _outputs(executed: Path) -> list:
    nb = json.loads(executed.read_text())
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def _html(outputs: list) -> str:
    return "\n".join("".join(o.get("data", {}).get("text/html", "")) for o in outputs)


def _pictures(outputs: list) -> dict:
    from ckptlib.ui.pictures import facts_in_html

    found: dict = {}
    for kind, facts in facts_in_html(_html(outputs)):
        found.setdefault(kind, []).append(facts)
    return found


def _describe(path) -> dict:
    import ckptlib

    with ckptlib.open_checkpoint(path) as ck:
        return json.loads(json.dumps(ckptlib.describe(ck), default=str))


@pytest.mark.parametrize("family", ALL)
def test_01_browse_states_what_inspect_states(families, executed_families, family):
    error, executed = executed_families["01_browse", family]
    if error is not None:
        raise error
    check_01(executed, families[family])


def check_01(executed: Path, path: Path) -> None:
    """01 run on ``path``: no error output, the summary's every row and closing line, where the files sit."""
    from ckptlib.analysis.summary import closing, summary_rows

    outputs = _outputs(executed)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    d = _describe(path)
    shown = _text(_html(outputs))
    for label, value in summary_rows(d):
        assert _squash(f"{label} {value}") in shown, (label, value)
    for kind, value in closing(d):
        if kind not in ("read",):
            assert _squash(value) in shown, (kind, value)
    pictures = _pictures(outputs)
    placed = d["placement"]
    for kind in ("experts", "grid", "universal"):
        if placed[kind]:
            assert pictures.get(kind) == [placed[kind]], (kind, list(pictures))
        else:
            assert kind not in pictures
    if not any(placed[k] for k in ("experts", "grid", "universal")):
        assert "data parallel only" in shown


@pytest.mark.parametrize("family", ALL)
def test_02_partition_layout_draws_each_group_with_its_optimizer(families, executed_families, family):
    error, executed = executed_families["02_partition_layout", family]
    if error is not None:
        raise error
    check_02(executed, families[family], family)


def check_02(executed: Path, path: Path, family: str = "") -> None:
    """02 run on ``path``: no error output; each group drawn with the optimizer that steps it and its keys; Muon's
    whole matrices where a group keeps them, each rank's file holding exactly the matrices drawn."""
    outputs = _outputs(executed)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    d = _describe(path)
    pictures = _pictures(outputs)
    groups = pictures["groups"][0]["panels"]
    placed = d["placement"]["groups"]
    assert len(groups) == len(placed)
    for drawn, fact in zip(groups, placed):  # each group titled with the optimizer that steps it and its keys
        assert {k: drawn[k] for k in ("label", "optimizer", "family", "keys", "step", "parameters")} == \
            {k: fact[k] for k in ("label", "optimizer", "family", "keys", "step", "parameters")}
        numel = {p["name"]: p["numel"] for p in d["parameters"]}
        if all(n in numel for n in fact["parameters"]) and d["parallelism"] == "data_parallel" and not d["num_experts"]:
            # each element of the group's parameters lies on exactly one rank, padding apart
            assert sum(r["elements"] for r in drawn["rows"]) == sum(numel[n] for n in fact["parameters"])
    shown = _text(_html(outputs))
    for fact in placed:
        assert not fact["optimizer"] or re.search(re.escape(fact["label"]) + r"\s*:\s*" + re.escape(fact["optimizer"]),
                                                  shown), fact["label"]
    whole = d["placement"]["whole_matrices"]
    if whole:
        muon = pictures["muon"][0]["groups"]
        assert muon == whole
        for g in muon:
            for r in g["ranks"]:  # the file holds exactly the whole matrices drawn for the rank
                assert r["stored"] == r["length"] == sum(m["numel"] for m in r["matrices"])
    else:
        assert "muon" not in pictures
    if family == "muon-z2":  # the bullet's case: a matrix straddling two partitions, held whole by both
        straddling = [m for g in whole for r in g["ranks"] for m in r["matrices"] if m["straddles"]]
        assert straddling and all(len(m["ranks"]) >= 2 for m in straddling)
        assert "held whole by two ranks" in shown
