"""Notebooks 04, 05 and 06 on inputs ckptlib refuses, and on optimizers other than Adam (issue 38).

A refusal is shown as ``ckpt`` prints it, its message and its hint in a box (``div.ckpt-refusal``), and the notebook
goes on with no error output: 06 with ``optimizer=True`` on a DeepSpeed CPU Lion checkpoint (no torch optimizer keeps
Lion's state) then exports the weights alone, which FSDP2 loads bit for bit; 04 on a universal folder written by
DeepSpeed's ``ds_to_universal`` from a ``PipelineModule`` checkpoint (it does not say which layer builds the tied
module) skips its steps, and with ``pp_tied`` set reshards and verifies. 05 and 06 name the checkpoint's own state
keys (Muon's ``momentum_buffer``, SGD's, CPU Adagrad's ``exp_avg_sq`` that torch's Adagrad calls ``sum``), read from
the table's ``data-facts``. The reshard wizard asks for ``pp_tied`` when the plan's refusal needs it.

Every notebook is executed once (papermill, as tests/test_notebooks.py does), two at a time, in a module fixture;
a wrong checkpoint_dir is refused in the same way.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from tests.test_notebooks import _execute, nbformat

widgets = pytest.importorskip("ipywidgets", reason="ipywidgets is in the notebooks extra")

import ckptlib  # noqa: E402
from ckptlib.ui import ReshardWizard  # noqa: E402

PIPELINE = "pp2_dp2_z1_bf16"   # a PipelineModule checkpoint: 2 stages, the tied embedding on layers 0 and 5
TIED = "embed:0,5"
#: (notebook, fixture, parameters) of each execution; fixture "ds-universal": ds_to_universal's folder of PIPELINE;
#: "missing": a checkpoint_dir that exists nowhere
RUNS = {
    "06-lion": ("06_migrate_to_fsdp", "cpu_lion_z2_bf16_w2", {}),
    "06-muon": ("06_migrate_to_fsdp", "muon_z2_bf16_w2", {}),
    "06-cpu-adagrad": ("06_migrate_to_fsdp", "cpu_adagrad_z2_bf16_w2", {}),
    "05-muon": ("05_health_and_diff", "muon_z1_bf16_w3", {}),
    "05-sgd": ("05_health_and_diff", "sgd_z2_bf16_w2", {}),
    "05-missing": ("05_health_and_diff", "missing", {}),
    "04-refused": ("04_reshard", "ds-universal", {}),
    "04-pp-tied": ("04_reshard", "ds-universal", {"pp_tied": TIED}),
}


@pytest.fixture(scope="module")
def ds_universal(parallel_fixtures, tmp_path_factory) -> Path:
    """The universal folder DeepSpeed 0.19.8's ds_to_universal writes from the pipeline checkpoint."""
    from tests.fixtures.universal import ds_to_universal

    fx = parallel_fixtures[PIPELINE]
    save = ds_to_universal({PIPELINE: fx}, tmp_path_factory.mktemp("ds-universal"))[PIPELINE]
    return save / f"{fx['tag']}_universal"


class Run:
    """One executed notebook: its outputs, as text and by kind."""

    def __init__(self, source: Path, out_dir: Path, executed: Path, error):
        self.source, self.out_dir, self.error = source, out_dir, error
        self.nb = nbformat.read(executed, as_version=4) if executed.exists() else None
        outputs = [o for c in (self.nb.cells if self.nb else []) for o in c.get("outputs", [])]
        self.errors = [o for o in outputs if o.get("output_type") == "error"]
        self.html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
        self.streams = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
        self.text = json.dumps(outputs)

    def check_ran(self):
        if self.error is not None:
            raise self.error
        assert not self.errors, [(e["ename"], e["evalue"]) for e in self.errors]

    @property
    def refusals(self) -> list[str]:
        return [h for h in self.html if "class='ckpt-refusal'" in h]

    def table(self) -> list[dict]:
        """The rows of the optimizer groups table (its data-facts)."""
        found = [re.search(r"<table class='ckpt-optimizer-groups' data-facts=\"([^\"]*)\"", h) for h in self.html]
        found = [json.loads(html.unescape(m.group(1))) for m in found if m]
        assert len(found) == 1, len(found)
        return found[0]


@pytest.fixture(scope="module")
def runs(optim_fixtures, ds_universal, tmp_path_factory) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for key, (notebook, fixture, params) in RUNS.items():
            source = {"ds-universal": ds_universal, "missing": Path("no/such/checkpoint")}.get(fixture) \
                or optim_fixtures[fixture]["checkpoint_path"]
            work = tmp_path_factory.mktemp(key)
            out_dir, executed = work / "output", work / f"{notebook}.ipynb"
            jobs[key] = (pool.submit(_execute, notebook, source, out_dir, executed, **params), source, out_dir,
                         executed)
        return {key: Run(source, out_dir, executed, future.exception())
                for key, (future, source, out_dir, executed) in jobs.items()}


def cli_refusal(capsys, *args) -> tuple[str, str]:
    """(message, hint) as ``ckpt`` prints a refusal of ``args`` (exit code 2)."""
    from ckptlib.cli import main

    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    head, _, hint = err.partition("\n  hint: ")
    message = re.sub(r"^ckpt \w+: error: ", "", head)
    assert message != head and hint, err
    return message, hint


def assert_shows(box: str, message: str, hint: str) -> None:
    assert f"white-space:pre-wrap'>{html.escape(message)}</div>" in box, box
    assert f"<b>hint:</b> {html.escape(hint)}</div>" in box, box
    assert "Traceback" not in box


# ============================================================================================ 06
def test_06_shows_the_lion_refusal_and_exports_the_weights_alone(runs, optim_fixtures, tmp_path, capsys):
    run = runs["06-lion"]
    run.check_ran()
    message, hint = cli_refusal(capsys, "export", run.source, tmp_path / "cli", "--format", "dcp", "--optimizer")
    assert "Lion" in message and "torch has no Lion optimizer" in message
    assert len(run.refusals) == 1
    assert_shows(run.refusals[0], message, hint)
    rows = run.table()
    assert rows and all(r["optimizer"] == "lion" and r["torch"] is None and r["torch_groups"] is None for r in rows)
    assert all("torch has no Lion optimizer" in r["not_torch"] for r in rows)
    # it went on: the weights alone, written, verified, diffed all same, loaded by FSDP2 bit for bit
    assert "the export goes on without the optimizer state" in run.streams
    assert (run.out_dir / "dcp" / ".metadata").is_file() and "verification FAILED" not in run.text
    assert " 0 changed, 0 only in A, 0 only in B, 0 shape changed" in run.streams
    n = sum(1 for p in optim_fixtures["cpu_lion_z2_bf16_w2"]["parameters"] if p["trainable"] and not p["tied_to"])
    assert f"FSDP2 holds, bit for bit: {n} of {n} masters\n" in run.streams
    assert "steps 2 to 5 are skipped" not in run.streams


def test_06_names_torch_muon_and_adamw_for_a_muon_run(runs):
    run = runs["06-muon"]
    run.check_ran()
    assert not run.refusals
    rows = run.table()
    by_family = {}
    for r in rows:
        by_family.setdefault(r["optimizer"], []).append(r)
    assert set(by_family) == {"muon", "adam"}
    (muon,) = by_family["muon"]
    assert [k["key"] for k in muon["keys"]] == ["momentum_buffer"] and muon["keys"][0]["layout"] == "whole parameters"
    assert muon["torch"] == "Muon" and muon["torch_keys"] == {"momentum_buffer": "momentum_buffer"}
    assert {c for _, c in muon["torch_groups"]} == {"Muon"}
    for r in by_family["adam"]:
        assert r["torch"] == "AdamW" and r["torch_keys"] == {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                                                             "step": "step"}
        assert {c for _, c in r["torch_groups"]} == {"AdamW"}
    shown = next(h for h in run.html if "ckpt-optimizer-groups" in h)
    assert "torch.optim.Muon" in shown and "torch.optim.AdamW" in shown
    muon_params = muon["parameters"]
    adam_params = sum(r["parameters"] for r in by_family["adam"])
    assert (f"{adam_params} of {adam_params} exp_avg, {adam_params} of {adam_params} exp_avg_sq, "
            f"{muon_params} of {muon_params} momentum_buffer" in run.streams), run.streams
    assert re.search(r"^Muon \[", run.streams, re.M) and re.search(r"^AdamW \[", run.streams, re.M)


def test_06_carries_cpu_adagrads_exp_avg_sq_as_torch_adagrads_sum(runs):
    run = runs["06-cpu-adagrad"]
    run.check_ran()
    assert not run.refusals
    rows = run.table()
    assert rows and all(r["optimizer"] == "cpu_adagrad" and r["torch"] == "Adagrad" for r in rows)
    assert all(r["torch_keys"] == {"exp_avg_sq": "sum", "step": "step"} for r in rows)
    shown = next(h for h in run.html if "ckpt-optimizer-groups" in h)
    assert "exp_avg_sq → sum" in shown and "torch.optim.Adagrad" in shown
    n = sum(r["parameters"] for r in rows)
    assert f"{n} of {n} exp_avg_sq" in run.streams and re.search(r"^Adagrad \[", run.streams, re.M)


# ============================================================================================ 05
@pytest.mark.parametrize("key,keys", [("05-muon", {"momentum_buffer", "exp_avg", "exp_avg_sq"}),
                                      ("05-sgd", {"momentum_buffer"})])
def test_05_speaks_of_the_checkpoints_own_state_keys(runs, key, keys):
    run = runs[key]
    run.check_ran()
    assert not run.refusals
    rows = run.table()
    assert {k["key"] for r in rows for k in r["keys"]} == keys
    if key == "05-sgd":  # no Adam vocabulary anywhere
        assert all(r["optimizer"] == "sgd" for r in rows) and "exp_avg" not in run.text
    else:  # Muon's matrices keep momentum_buffer; only its Adam groups keep Adam's moments
        for r in rows:
            assert [k["key"] for k in r["keys"]] == (["momentum_buffer"] if r["optimizer"] == "muon"
                                                     else ["exp_avg", "exp_avg_sq"]), r
    ckpt = ckptlib.open_checkpoint(run.source)
    said = next(line for line in run.streams.splitlines() if line.startswith("exported the fp32 masters"))
    assert said == "exported the fp32 masters and the states " + ", ".join(ckpt.optimizer.state_keys)
    for k in keys:  # every state exported, and the export all same as the checkpoint
        assert (run.out_dir / "diff-fp32" / k / "model.safetensors").is_file(), k
    first = next(line for line in run.streams.splitlines() if " same, " in line)
    total = int(first.split()[0])
    assert first.startswith(f"{total} tensors: {total} same, 0 changed, 0 only in A, 0 only in B, 0 shape changed")
    assert "healthy: " in run.streams


def test_05_shows_a_checkpoint_dir_that_is_not_there(runs):
    """A wrong checkpoint_dir is a refusal too: the box (NotACheckpointError, the path and what to set), a line
    saying the rest is skipped, and no error output."""
    run = runs["05-missing"]
    run.check_ran()
    assert len(run.refusals) == 1 and "data-error='NotACheckpointError'" in run.refusals[0]
    assert "no/such/checkpoint: not found here" in run.refusals[0] and "<b>hint:</b> set checkpoint_dir" in run.refusals[0]
    assert "the steps below are skipped: there is no checkpoint" in run.streams
    assert not (run.out_dir / "diff-fp32").exists()


# ============================================================================================ 04
def test_04_shows_the_pp_tied_question_and_goes_on(runs, tmp_path, capsys):
    run = runs["04-refused"]
    run.check_ran()
    message, hint = cli_refusal(capsys, "reshard", run.source, tmp_path / "cli", "--world-size", "3")
    assert "tied module 'embed'" in message and f"--pp-tied {TIED}" in hint
    assert len(run.refusals) == 1 and "data-error='PipelineUnknownError'" in run.refusals[0]
    assert_shows(run.refusals[0], message, hint)
    assert "steps 2 to 5 are skipped" in run.streams
    assert not (run.out_dir / "reshard").exists()
    assert "ReshardWizard(" in run.text   # the wizard is there, to ask


def test_04_with_pp_tied_reshards_and_verifies(runs):
    run = runs["04-pp-tied"]
    run.check_ran()
    assert not run.refusals and "steps 2 to 5 are skipped" not in run.streams
    out = run.out_dir / "reshard"
    assert (out / "latest").is_file()
    checks = next(h for h in run.html if "class='ckpt-verify'" in h)
    assert checks.startswith("<div class='ckpt-verify'><b style='color:#2e7d32'>verified</b>") and "&#10008;" not in checks
    resharded = ckptlib.open_checkpoint(out)
    assert (resharded.mesh.pp, resharded.mesh.dp) == (2, 3) and not resharded.problems


# ============================================================================================ the wizard asks
def test_the_reshard_wizard_asks_for_pp_tied(ds_universal, tmp_path):
    """On ds_to_universal's pipeline folder the plan is refused with the --pp-tied question: the wizard shows it as
    ``ckpt`` does, marks the tied-uses field (the hint's example as its placeholder, never its value) and not the
    others; with the field filled the plan is made, run and verified, and nothing is asked any more."""
    w = ReshardWizard(ds_universal, out=tmp_path / "rs", world_size=2)
    assert w.pipeline.layout.display == "none" and w.asked == []
    w.plan_button.click()
    assert w.plan is None and isinstance(w.errors.errors[-1], ckptlib.errors.PipelineUnknownError)
    assert "tied module &#x27;embed&#x27;" in w.errors.message.value and "--pp-tied embed:" in w.errors.message.value
    assert w.pipeline.layout.display == "" and w.asked == ["pp_tied"]
    assert "ckpt-asked" in w.pp_tied._dom_classes and w.pp_tied.layout.border
    assert "ckpt-asked" not in w.pp_partition._dom_classes and not w.pp_partition.layout.border
    assert w.pp_tied.value == "" and TIED in w.pp_tied.placeholder
    assert "tied uses" in w.pipeline_asks.value and "--pp-tied" in w.pipeline_asks.value
    w.pp_tied.value = TIED
    w.plan_button.click()
    assert w.plan is not None, w.errors.message.value
    assert w.asked == [] and w.pipeline_asks.value == "" and "ckpt-asked" not in w.pp_tied._dom_classes
    w.run_button.click()
    assert w.wait(120) == "done", (w.status.value, w.errors.message.value)
    assert w.verification and all(c.ok for c in w.verification), w.verification
    assert ckptlib.open_checkpoint(tmp_path / "rs").mesh.dp == 2


def test_the_wizard_asks_what_each_pipeline_refusal_names(ds_universal, tmp_path):
    """A --pp-tied naming a layer of its own is refused with the --pp-tied question again; the notebooks' pp_tied
    parameter is read as the CLI reads --pp-tied (a string or a dict)."""
    from ckptlib.ui import tied_uses

    w = ReshardWizard(ds_universal, out=tmp_path / "rs", world_size=2, pp_tied="embed:3,5")
    assert w.pipeline.layout.display == ""                      # given: shown from the start
    w.plan_button.click()
    assert w.plan is None and "layer 3 is a layer of its own" in w.errors.message.value
    assert w.asked == ["pp_tied"] and w.pp_tied.value == "embed:3,5"
    assert tied_uses(TIED) == {"embed": [0, 5]} == tied_uses({"embed": [0, 5]})
    assert tied_uses(None) is None and tied_uses(" ") is None
    with pytest.raises(ckptlib.CkptError, match="give KEY:LAYER,LAYER"):
        tied_uses("embed")
