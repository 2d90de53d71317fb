"""`ckpt inspect --json` is right on every fixture, and reads almost nothing."""
import json
import os
import subprocess
import sys

import ckptlib


def _inspect_json(path, *extra):
    """``ckpt inspect --json`` in this process (the CLI's own entry point, without interpreter start-up)."""
    import contextlib
    import io

    from ckptlib.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["inspect", str(path), "--json", *extra])
    assert code == 0
    return json.loads(buf.getvalue())


def test_inspect_runs_as_a_module_and_console_script(fixture_by_name):
    fx = fixture_by_name("z2_bf16_w2")
    for cmd in ([sys.executable, "-m", "ckptlib"], [str(__import__("pathlib").Path(sys.executable).parent / "ckpt")]):
        r = subprocess.run([*cmd, "inspect", str(fx["checkpoint_path"]), "--json"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["zero_stage"] == 2


def _ref_step(fx):
    import torch

    return int(torch.load(fx["path"] / "reference.pt", weights_only=True)["step"])


def test_inspect_json_is_right(ds_fixture):
    fx = ds_fixture
    d = _inspect_json(fx["checkpoint_path"])
    assert d["zero_stage"] == fx["zero_stage"]
    assert d["dp_world_size"] == fx["world_size"] and d["mp_world_size"] == 1
    assert d["dtype"] == fx["dtype"]
    assert d["tag"] == fx["tag"] and d["tags"] == fx["tags"]
    assert d["deepspeed_version"] == fx["deepspeed_version"]
    assert d["problems"] == []
    assert d["optimizer"]["state_keys"] == ["exp_avg", "exp_avg_sq"] and d["optimizer"]["step"] == _ref_step(fx)
    want = [p for p in fx["parameters"] if not (fx["exclude_frozen"] and not p["trainable"])]
    got = {p["name"]: p for p in d["parameters"]}
    assert sorted(got) == sorted(p["name"] for p in want)
    for p in want:
        g = got[p["name"]]
        assert g["shape"] == p["shape"] and g["trainable"] == p["trainable"] and g["tied_to"] == p["tied_to"], p
        assert g["numel"] == __import__("math").prod(p["shape"])
    assert [(b["name"], b["shape"], b["dtype"]) for b in d["buffers"]] == [
        (b["name"], b["shape"], b["dtype"]) for b in fx["buffers"]]
    tag_dir = fx["checkpoint_path"] / fx["tag"]
    on_disk = {f"{fx['tag']}/{n}": os.path.getsize(tag_dir / n) for n in os.listdir(tag_dir)}
    assert {f["path"]: f["bytes"] for f in d["files"]} == on_disk
    kinds = {f["kind"] for f in d["files"]}
    assert "model_states" in kinds and (("optim_states" in kinds) == (fx["zero_stage"] > 0))
    ranks = sorted(f["dp_rank"] for f in d["files"] if f["kind"] == "optim_states")
    assert ranks == (list(range(fx["world_size"])) if fx["zero_stage"] > 0 else [])


def test_inspect_text_runs_and_names_everything(fixture_by_name):
    fx = fixture_by_name("z3_bf16_w2")
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(fx["checkpoint_path"])],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for word in ("ZeRO stage  3", "bf16", "dp=2", "embed.weight", "tied to embed.weight", "frozen", "problems: none"):
        assert word in r.stdout


def test_inspect_reads_under_one_percent(fixture_by_name):
    fx = fixture_by_name("large_w2")
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        ckptlib.describe(ck)
        assert ck.total_bytes > 20_000_000
        assert ck.stats.bytes_read < 0.01 * ck.total_bytes, (ck.stats.bytes_read, ck.total_bytes)


def test_hf_trainer_layouts(fixture_by_name, tmp_path):
    fx = fixture_by_name("hf_trainer_w2")
    ckpt_dir = fx["checkpoint_path"]  # .../checkpoint-4, holding latest and two tags
    d = _inspect_json(ckpt_dir)
    assert d["tag"] == "global_step4" and d["tags"] == ["global_step2", "global_step4"]
    assert _inspect_json(ckpt_dir, "--tag", "global_step2")["optimizer"]["step"] == 2
    # the tag folder itself
    assert _inspect_json(ckpt_dir / "global_step2")["tag"] == "global_step2"
    # a training output folder with several checkpoint-N: the newest is used
    out = tmp_path / "output"
    out.mkdir()
    for n in (2, 10, 4):
        os.symlink(ckpt_dir, out / f"checkpoint-{n}")
    d = _inspect_json(out)
    assert d["save_dir"].endswith("checkpoint-10") and len(d["checkpoints"]) == 3
