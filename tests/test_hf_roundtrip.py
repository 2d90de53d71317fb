"""The Hugging Face round trip with real transformers and accelerate, nothing done by hand.

The fixtures are real HF Trainer and Accelerate runs with DeepSpeed ZeRO-2/3 bf16 at 2 ranks (tiny
Llama and GPT-2 built locally, tied and untied, a frozen embedding; tests/fixtures/hf, FINDINGS.md),
with references gathered from the live engines at every save.

- ``ckpt export checkpoint-N OUT`` -> ``AutoModelForCausalLM.from_pretrained(OUT)`` with no arguments
  loads fp32 weights bit-exact to the engine's masters, and generates; the tokenizer loads too.
- ``ckpt reshard checkpoint-N OUT --world-size M`` (and ``--universal``) ->
  ``Trainer.train(resume_from_checkpoint=OUT)`` at M ranks loads the exact state and its losses continue
  like resuming the original; Accelerate ``save_state`` -> reshard -> ``load_state`` likewise.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch  # noqa: E402

from ckptlib.cli import main as ckpt  # noqa: E402
from tests.fixtures.hf import factory  # noqa: E402

TRAINER = ["hf_llama_z2_w2", "hf_llama_z3_w2", "hf_gpt2_tied_z2_w2", "hf_gpt2_tied_z3_w2", "hf_llama_frozen_z2_w2",
           "hf_llama_frozen_z3_w2"]
CHECKPOINT = 1  # checkpoint-4 / checkpoint_1: the middle save, so that the original run has steps 5 and 6
# the spread between world sizes measured from scratch (FINDINGS.md (b)): the first resumed step agrees
# to about 1e-6, the next to about 1e-4 (bf16 reductions over other micro-batches)
FIRST_STEP_TOL, NEXT_STEP_TOL = 5e-6, 1e-3


@pytest.fixture(scope="session")
def hf_fixtures() -> dict:
    root = factory.ensure_fixtures(verbose=False)
    return {f["name"]: f for f in factory.list_fixtures(root)}


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = ckpt([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def reference(fx: dict, i: int = CHECKPOINT) -> dict:
    return torch.load(fx["reference_paths"][i], weights_only=False)


def assert_loaded_state_exact(loaded: dict, ref: dict) -> None:
    """What the client loaded (dumped by the fixture scripts) equals the engine's state at the save."""
    for key in ("fp32", "exp_avg", "exp_avg_sq", "lp"):
        assert set(loaded[key]) == set(ref[key]), key
        bad = [n for n in ref[key] if not same_bits(loaded[key][n], ref[key][n])]
        assert not bad, f"{key} differs for {bad}"
    assert loaded["step"] == ref["step"]


# ============================================================================================ export
@pytest.mark.parametrize("name", TRAINER)
def test_export_opens_with_from_pretrained_as_it_is(hf_fixtures, tmp_path, capsys, name):
    fx = hf_fixtures[name]
    out = tmp_path / "out"
    code, text, err = run_cli(capsys, "export", fx["checkpoint_paths"][CHECKPOINT], out)
    assert code == 0, err
    assert "copied for from_pretrained: chat_template.jinja, config.json (dtype float32), generation_config.json, " \
           "tokenizer.json, tokenizer_config.json" in err
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "tokenizer.json").read_bytes() == (fx["checkpoint_paths"][CHECKPOINT] / "tokenizer.json").read_bytes()

    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # no arguments at all
    assert model.dtype == torch.float32
    ref = reference(fx)
    state = model.state_dict()
    for n in ref["state_dict_names"]:
        want = ref["fp32"].get(n)
        if want is None:  # frozen: the 16-bit module weight, upcast
            want = ref["lp"][n].float()
        assert same_bits(state[n], want), n
    if fx["tied"]:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape == (1, ids.shape[1] + 4)


def test_export_in_bf16_says_bf16_in_its_config(hf_fixtures, tmp_path, capsys):
    fx = hf_fixtures["hf_llama_z2_w2"]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", fx["checkpoint_paths"][CHECKPOINT], out, "--dtype", "bf16")
    assert code == 0 and "config.json (dtype bfloat16)" in err
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    ref = reference(fx)
    assert all(same_bits(model.state_dict()[n], t.to(torch.bfloat16)) for n, t in ref["fp32"].items())


def test_no_hf_files_writes_the_weights_alone(hf_fixtures, tmp_path, capsys):
    fx = hf_fixtures["hf_llama_z2_w2"]
    code, _, err = run_cli(capsys, "export", fx["checkpoint_paths"][CHECKPOINT], tmp_path / "out", "--no-hf-files")
    assert code == 0 and "copied for from_pretrained" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_a_bare_deepspeed_save_dir_says_how_to_add_a_config(fixture_by_name, tmp_path, capsys):
    src = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    code, _, err = run_cli(capsys, "export", src, tmp_path / "out")
    assert code == 0
    assert f"no config.json beside the checkpoint ({src})" in err
    assert "model.config.save_pretrained(OUT)" in err and "--no-hf-files" in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_remote_code_named_by_auto_map_is_copied_with_what_it_imports(hf_fixtures, tmp_path, capsys):
    fx = hf_fixtures["hf_llama_z2_w2"]
    src = tmp_path / "checkpoint-4"
    shutil.copytree(fx["checkpoint_paths"][CHECKPOINT], src)
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyConfig",
                          "AutoModelForCausalLM": "someone/repo--modeling_tiny.TinyForCausalLM"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "configuration_tiny.py").write_text("class TinyConfig: ...\n")
    (src / "modeling_tiny.py").write_text("from .configuration_tiny import TinyConfig\nfrom .tiny_layers import X\n")
    (src / "tiny_layers.py").write_text("X = 1\n")
    (src / "unrelated.py").write_text("raise SystemExit('never copied, never run')\n")
    code, _, err = run_cli(capsys, "export", src, tmp_path / "out")
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"configuration_tiny.py", "modeling_tiny.py", "tiny_layers.py"} <= set(names)
    assert "unrelated.py" not in names
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"] == config["auto_map"]


# ============================================================================================ reshard
def _carried(src: Path, out: Path) -> list[str]:
    return sorted(p.name for p in src.iterdir() if p.is_file() and (out / p.name).is_file()
                  and (out / p.name).read_bytes() == p.read_bytes())


@pytest.mark.parametrize("name,world", [("hf_llama_z2_w2", 1), ("hf_llama_z2_w2", 3), ("hf_llama_z3_w2", 1),
                                        ("hf_gpt2_tied_z3_w2", 3)])
def test_trainer_resumes_from_the_reshard_at_another_size(hf_fixtures, tmp_path, capsys, name, world):
    fx = hf_fixtures[name]
    src = fx["checkpoint_paths"][CHECKPOINT]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "reshard", src, out, "--world-size", world)
    assert code == 0, err
    carried = _carried(src, out)
    for f in ("trainer_state.json", "scheduler.pt", "training_args.bin", "model.safetensors", "config.json",
              "tokenizer.json"):
        assert f in carried, f
    assert "carried over for the HF Trainer: " in err
    if world == 1:  # the Trainer's only RNG file at one rank is rng_state.pth: rank 0's
        assert (out / "rng_state.pth").read_bytes() == (src / "rng_state_0.pth").read_bytes()
        assert not list(out.glob("rng_state_*.pth")) and "RNG states of rank(s) 1 are not carried over" in err
    else:
        assert sorted(p.name for p in out.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
        assert "rank(s) 2 had no RNG state in the source" in err and "Didn't find an RNG file" in err
    assert f"per_device_train_batch_size={12 // world}" in err

    run = factory.resume_run(fx, out, world, steps=2, out_dir=tmp_path / "resume")
    assert run.get("finished"), run["errors"] or Path(run["log"]).read_text()[-3000:]
    assert_loaded_state_exact(torch.load(run["loaded"], weights_only=False), reference(fx))
    original = factory.original_losses(fx)
    assert sorted(run["losses"]) == [5, 6]
    assert abs(run["losses"][5] - original[5]) <= FIRST_STEP_TOL, (run["losses"], original)
    assert abs(run["losses"][6] - original[6]) <= NEXT_STEP_TOL, (run["losses"], original)


def test_trainer_resumes_from_a_universal_checkpoint(hf_fixtures, tmp_path, capsys):
    fx = hf_fixtures["hf_llama_z2_w2"]
    src = fx["checkpoint_paths"][CHECKPOINT]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "reshard", src, out, "--universal")
    assert code == 0, err
    assert 'load it with "checkpoint": {"load_universal": true} in the DeepSpeed config' in err
    assert {"trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"} <= set(_carried(src, out))
    run = factory.resume_run(fx, out, 3, steps=2, out_dir=tmp_path / "resume", universal=True)
    assert run.get("finished"), run["errors"] or Path(run["log"]).read_text()[-3000:]
    assert_loaded_state_exact(torch.load(run["loaded"], weights_only=False), reference(fx))
    original = factory.original_losses(fx)
    assert abs(run["losses"][5] - original[5]) <= FIRST_STEP_TOL
    assert abs(run["losses"][6] - original[6]) <= NEXT_STEP_TOL


@pytest.mark.parametrize("name,world", [("accel_llama_z2_w2", 3), ("accel_llama_z3_w2", 1)])
def test_accelerate_loads_the_reshard_at_another_size(hf_fixtures, tmp_path, capsys, name, world):
    fx = hf_fixtures[name]
    src = fx["checkpoint_paths"][CHECKPOINT]
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "reshard", src, out, "--world-size", world)
    assert code == 0, err
    assert "carried over for Accelerate: " in err
    assert "scheduler.bin" in _carried(src, out)
    assert sorted(p.name for p in out.glob("random_states_*.pkl")) == \
        [f"random_states_{r}.pkl" for r in range(min(world, 2))]
    if world > 2:
        assert "Could not load random states" in err
    state = factory.accel_load(fx, out, world, more_steps=2, out_dir=tmp_path / "load")
    assert_loaded_state_exact(state, reference(fx))
    original = factory.original_losses(fx)
    assert abs(state["losses"][5] - original[5]) <= FIRST_STEP_TOL, (state["losses"], original)
    assert abs(state["losses"][6] - original[6]) <= NEXT_STEP_TOL


# ============================================================================================ discovery
def test_an_accelerate_project_or_checkpoints_folder_is_recognised(hf_fixtures, capsys):
    fx = hf_fixtures["accel_llama_z2_w2"]
    newest = fx["checkpoint_paths"][-1]
    for given in (newest.parent, newest.parent.parent):  # project/checkpoints and project
        code, text, err = run_cli(capsys, "inspect", given, "--json")
        assert code == 0, err
        summary = json.loads(text)
        assert Path(summary["save_dir"]) == newest, summary["save_dir"]
