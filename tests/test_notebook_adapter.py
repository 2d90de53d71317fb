"""Notebook 03's peft adapter section on a real Trainer + DeepSpeed peft run (tests/fixtures/peft), and its widgets
(ckptlib.ui.adapter_view) driven in-process: the module table, the movement picture's facts against torch's own
computation from the live engine's masters, the Trainer's adapter file judged, the export and the merge (plan ->
preflight -> run -> verify), the adapter wizard (run, cancel, refusals)."""
from __future__ import annotations

import json
import math
import shutil
import threading
from pathlib import Path

import pytest

pm = pytest.importorskip("papermill", reason="papermill is in the dev extra (bash scripts/setup.sh --dev)")
nbformat = pytest.importorskip("nbformat")
torch = pytest.importorskip("torch")
pytest.importorskip("ipywidgets")
pytest.importorskip("peft")

import ckptlib  # noqa: E402
from ckptlib.kinds import adapters as A  # noqa: E402
from ckptlib.ui import AdapterView, AdapterWizard  # noqa: E402
from ckptlib.ui.common import WidgetObserver  # noqa: E402
from ckptlib.ui.pictures import facts_in_html  # noqa: E402
from tests.kernels import execute_notebook  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_export_weights.ipynb"


def _execute(out_dir: Path, executed: Path, **parameters) -> None:
    execute_notebook(NOTEBOOK, executed, {"checkpoint_dir": str(ROOT / "samples" / "zero2_bf16_w2" / "ckpt"),
                                          "output_dir": str(out_dir), **parameters})


def _reference(fx) -> dict:
    return torch.load(fx["reference_paths"][-1], weights_only=False)


def _movement(fx) -> dict:
    """``{base tensor: (‖scaling · B @ A‖_F, ‖W‖_F)}`` of every LoRA module, computed here with torch in float64 from
    the live engine's masters (the fixture's reference) and the base model's weights, as peft defines them."""
    from safetensors.torch import load_file

    cfg = json.loads((fx["checkpoint_path"] / A.CONFIG_FILE).read_text())
    assert not cfg.get("rank_pattern") and not cfg.get("alpha_pattern") and not cfg.get("use_rslora")
    scaling = cfg["lora_alpha"] / cfg["r"]
    masters = _reference(fx)["fp32"]
    base = load_file(fx["base_path"] / "model.safetensors")
    out = {}
    for name, a in masters.items():
        if ".lora_A." not in name:
            continue
        b = masters[name.replace(".lora_A.", ".lora_B.")]
        module = name[len(A.PREFIX):name.index(".lora_A.")]
        w = base[module + ".weight"]
        out[module + ".weight"] = (scaling * torch.linalg.norm(b.double() @ a.double()).item(),
                                   torch.linalg.norm(w.double()).item())
    return out


def test_notebook_03_exports_and_merges_a_peft_adapter(peft_fixtures, tmp_path):
    """Notebook 03 with ``adapter_checkpoint_dir`` and ``adapter_base_dir`` set to a real Trainer + DeepSpeed peft run
    (LoRA on q/v, ZeRO-3, tests/fixtures/peft): it states the method, r and alpha; shows the module table and the
    movement picture, whose facts are torch's own ‖scaling·B·A‖_F of the live masters (and ‖W‖_F of the base); judges
    the Trainer's adapter file (the 16-bit copy); ``output/adapter`` is what ``PeftModel.from_pretrained`` loads with
    no key warning, every tensor the live engine's fp32 master under peft's name; ``output/merged`` (a merge plan,
    run, verified) is peft's own ``merge_and_unload()`` (base in bf16, as the run trained) bit for bit."""
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fx = peft_fixtures["peft_lora_qv_z3"]
    out_dir, executed = tmp_path / "output", tmp_path / "03_export_weights.ipynb"
    _execute(out_dir, executed, adapter_checkpoint_dir=str(fx["checkpoint_path"]),
             adapter_base_dir=str(fx["base_path"]))
    nb = nbformat.read(executed, as_version=4)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    text = json.dumps([o for c in nb.cells for o in c.get("outputs", [])])
    assert "a peft LoRA adapter (r=4, alpha=8): 8 tensors" in text and "merged 4 weights" in text
    assert str(out_dir / "adapter" / "adapter_model.safetensors") in text
    assert "no adapter here" not in text and "predicted peak memory" in text and "apart here" in text
    assert text.count("verified") >= 3 and "verification FAILED" not in text  # the export, the adapter, the merge

    # the view: method, r, alpha; the table; the picture and its facts; the Trainer's file judged
    view = [c for c in nb.cells if c.cell_type == "code" and "AdapterView(" in c.source]
    assert len(view) == 1
    shown = "".join(o["data"].get("text/html", "") for o in view[0].outputs if "data" in o)
    assert "application/vnd.jupyter.widget-view+json" in json.dumps(view[0].outputs)  # the live widget too
    assert "peft LoRA: r=4, alpha=8 (scaling 2)" in shown
    assert "class='ckpt-adapter-table'" in shown
    movement = _movement(fx)
    for tensor in movement:
        assert f"<td>{tensor}</td>" in shown, tensor
    pictures = facts_in_html(shown)
    assert [k for k, _ in pictures] == ["adapter"]
    facts = {f["tensor"]: f for f in pictures[0][1]}
    assert set(facts) == set(movement) and len(facts) == 4
    for tensor, (delta, norm) in movement.items():
        f = facts[tensor]
        assert (f["method"], f["r"], f["alpha"], f["scaling"]) == ("LoRA", 4, 8.0, 2.0)
        assert math.isclose(f["delta_norm"], delta, rel_tol=1e-9), (tensor, f, delta)
        assert math.isclose(f["base_norm"], norm, rel_tol=1e-9) and math.isclose(f["ratio"], delta / norm, rel_tol=1e-9)
    assert "class='ckpt-adapter-file ckpt-adapter-file-16-bit-copy-of-the-masters'" in shown
    assert "adapter file: 16-BIT COPY OF THE MASTERS" in shown and "16-bit copies" in shown
    wizard = [c for c in nb.cells if c.cell_type == "code" and "AdapterWizard(" in c.source]
    assert len(wizard) == 1 and "application/vnd.jupyter.widget-view+json" in json.dumps(wizard[0].outputs)

    ref = _reference(fx)
    assert load_file(out_dir / "adapter" / "adapter_model.safetensors").keys() == ref["peft_fp32"].keys()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fx["base_path"]), out_dir / "adapter")
    assert not [w for w in caught if "key" in str(w.message).lower()]
    params = dict(model.named_parameters())
    for name, master in ref["fp32"].items():
        assert params[name].dtype == torch.float32 and torch.equal(params[name].detach(), master), name

    base = AutoModelForCausalLM.from_pretrained(fx["base_path"], dtype=torch.bfloat16)
    theirs = PeftModel.from_pretrained(base, out_dir / "adapter").merge_and_unload().state_dict()
    mine = load_file(out_dir / "merged" / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for k, v in mine.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, theirs[k]), k


# ============================================================================================ the view
def test_adapter_view_shows_modules_movement_and_the_trainer_file(peft_fixtures, tmp_path):
    """DoRA with per-module r and alpha and trained biases: every module in the table with its pattern; the picture's
    facts are the view's rows (DoRA: the change before the magnitude rescale, said in the caption); without a base no
    ‖W‖; the Trainer's file is judged in its box: the 16-bit copy (amber), then an empty file (red) and the fp32
    masters (green); a checkpoint that trains no adapter is said with a hint, not raised."""
    from safetensors.torch import save_file

    fx = peft_fixtures["peft_dora_bias_all_z2"]
    view = AdapterView(fx["checkpoint_path"], base=fx["base_path"])
    assert not view.errors.errors
    assert "peft DoRA: r=4, alpha=8 (scaling 2); per-module r / alpha" in view.head.value
    assert "ckpt-adapter-table" in view.table.value and "alpha_pattern &#x27;k_proj&#x27;" in view.table.value
    rows = {r["tensor"]: r for r in view.rows}
    assert len(rows) == 22 and rows["model.layers.0.self_attn.v_proj.weight"]["r"] == 2
    assert rows["model.layers.0.self_attn.k_proj.weight"]["scaling"] == 3.0
    assert rows["model.layers.0.mlp.up_proj.bias"]["method"] == "bias"
    (kind, facts), = facts_in_html(view.figure.value)
    assert kind == "adapter" and [f["tensor"] for f in facts] == list(rows)
    assert all(f["delta_norm"] > 0 and f["base_norm"] > 0 for f in facts)
    assert "before the magnitude rescale" in view.figure.value
    assert facts_in_html(view.html())[0][1] == facts
    assert "ckpt-adapter-file-16-bit-copy-of-the-masters" in view.file_box.value and "#e65100" in view.file_box.value

    ck = tmp_path / "checkpoint-4"
    shutil.copytree(fx["checkpoint_path"], ck)
    save_file({}, ck / A.WEIGHTS_FILE)
    empty = AdapterView(ck)
    assert "ckpt-adapter-file-empty" in empty.file_box.value and "#b71c1c" in empty.file_box.value
    assert "untrained adapter" in empty.file_box.value
    assert all(r["base_norm"] is None and r["ratio"] is None for r in empty.rows)
    assert "give the base folder" in empty.figure.value
    save_file(_reference(fx)["peft_fp32"], ck / A.WEIGHTS_FILE)
    assert "ckpt-adapter-file-the-fp32-masters" in AdapterView(ck).file_box.value

    plain = AdapterView(ROOT / "samples" / "zero2_bf16_w2" / "ckpt")
    assert "trains no peft adapter" in plain.errors.message.value and "hint:" in plain.errors.message.value
    assert plain.picture is None and not plain.table.value


# ============================================================================================ the wizard
def test_adapter_wizard_merges_then_exports(peft_fixtures, tmp_path):
    """Merge: plan (the merge plan's memory) -> run -> verified -> summary with the gap between the two --merge-on
    modes; then the adapter export from the same wizard, loaded by peft."""
    fx = peft_fixtures["peft_lora_all_z3"]
    w = AdapterWizard(fx["checkpoint_path"], base=fx["base_path"], out=tmp_path / "adapter", merged=tmp_path / "merged")
    assert w.action.value == "merge" and w.out.value == str(tmp_path / "merged")
    w.merge_on.value = "fp32"
    w.plan_button.click()
    assert w.state == "planned" and "14 weights merged" in w.plan_view.value and "memory: fits" in w.verdict.value
    w.run_button.click()
    assert w.wait(120) == "done", (w.status.value, w.errors.message.value)
    assert isinstance(w.result, ckptlib.MergeResult) and w.result.dtype == "float32"
    assert all(c.ok for c in w.verification) and len(w.verification) >= 5
    assert "ckpt-merge-gap" in w.summary.value and f"{w.result.mode_gap:.3g}" in w.summary.value
    assert 1e-5 < w.result.mode_gap < 1e-2 and "from_pretrained" in w.summary.value
    assert (tmp_path / "merged" / "model.safetensors").is_file()

    w.action.value = "export"
    assert w.out.value == str(tmp_path / "adapter") and w.plan is None
    w.dtype.value = "bf16"
    w.plan_button.click()
    w.run_button.click()
    assert w.wait(120) == "done", (w.status.value, w.errors.message.value)
    assert (tmp_path / "adapter" / A.WEIGHTS_FILE).is_file() and "PeftModel.from_pretrained" in w.summary.value
    assert "ckpt-merge-gap" not in w.summary.value and not w.errors.errors


def test_adapter_wizard_cancel_leaves_nothing_and_shows_refusals(peft_fixtures, tmp_path, monkeypatch):
    fx = peft_fixtures["peft_dora_z2"]
    parent = tmp_path / "out"
    gate, inside = threading.Event(), threading.Event()
    real = WidgetObserver.on_tensor

    def slow(self, name):  # hold the run inside its first tensor until the test has clicked Cancel
        inside.set()
        gate.wait(20)
        real(self, name)

    monkeypatch.setattr(WidgetObserver, "on_tensor", slow)
    w = AdapterWizard(fx["checkpoint_path"], base=fx["base_path"], merged=parent / "merged")
    w.plan_button.click()
    w.run_button.click()
    assert inside.wait(20) and w.running
    w.cancel_button.click()
    gate.set()
    assert w.wait(20) == "cancelled" and "nothing was written" in w.status.value
    assert sorted(p.name for p in parent.iterdir()) == [] and not w.errors.errors
    monkeypatch.undo()

    emb = peft_fixtures["peft_lora_emb_z2"]
    raw = json.loads((emb["checkpoint_path"] / A.CONFIG_FILE).read_text())
    w = AdapterWizard(emb["checkpoint_path"], base=emb["base_path"], merged=tmp_path / "x",
                      adapter_config=dict(raw, use_dora=True))
    w.plan_button.click()
    assert w.plan is None and w.run_button.disabled
    assert "config sets use_dora, but model.embed_tokens has no DoRA magnitude" in w.errors.message.value
    assert "hint:" in w.errors.message.value and "give the adapter_config.json the run saved" in w.errors.message.value
    assert "Traceback" not in w.errors.message.value
    alone = AdapterWizard(emb["checkpoint_path"], out=tmp_path / "a")
    assert [v for _, v in alone.action.options] == ["export"] and "no base given" in alone.base_note.value
