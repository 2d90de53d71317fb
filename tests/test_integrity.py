"""Damaged checkpoints: problems are listed with the file and the likely cause; never a traceback."""
import json
import shutil
import subprocess
import sys

import pytest

import ckptlib


def _copy(fx, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], dst, symlinks=False)
    return dst, dst / fx["tag"]


def _inspect(path):
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(path), "--json"], capture_output=True, text=True)
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("name", ["z2_bf16_w3", "z3_fp32_w3"])
def test_missing_rank_file(fixture_by_name, tmp_path, name):
    fx = fixture_by_name(name)
    ckpt, tag = _copy(fx, tmp_path)
    victim = next(tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    victim.unlink()
    r = _inspect(ckpt)
    assert r.returncode == 1
    problems = json.loads(r.stdout)["problems"]
    assert any(f"missing {victim.name} (optimizer-state file of dp rank(s) 1" in p for p in problems), problems
    with ckptlib.open_checkpoint(ckpt) as ck, pytest.raises(ckptlib.IncompleteCheckpointError, match="problems"):
        ck.read_param("embed.weight")


def test_extra_rank_file_from_another_run(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w2")
    ckpt, tag = _copy(fx, tmp_path)
    other = fixture_by_name("z2_bf16_w3")["checkpoint_path"] / "global_step2"
    extra = next(other.glob("*zero_pp_rank_2_*optim_states.pt"))
    shutil.copy(extra, tag)
    problems = json.loads(_inspect(ckpt).stdout)["problems"]
    assert any(f"extra {extra.name} (optimizer-state file of dp rank(s) 2)" in p for p in problems), problems
    assert not any("rank 2 group" in p for p in problems), problems  # no follow-on noise about the extra rank


def test_rank_file_of_another_world_size(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w2")
    ckpt, tag = _copy(fx, tmp_path)
    other = fixture_by_name("z2_bf16_w3")["checkpoint_path"] / "global_step2"
    src = next(other.glob("*zero_pp_rank_1_*optim_states.pt"))
    shutil.copy(src, next(tag.glob("*zero_pp_rank_1_*optim_states.pt")))
    problems = json.loads(_inspect(ckpt).stdout)["problems"]
    assert any("do not add up" in p and "rank 1" in p for p in problems), problems


def test_truncated_rank_file(fixture_by_name, tmp_path):
    fx = fixture_by_name("z3_bf16_w2")
    ckpt, tag = _copy(fx, tmp_path)
    victim = next(tag.glob("*zero_pp_rank_1_*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-5000])
    r = _inspect(ckpt)
    problems = json.loads(r.stdout)["problems"]
    assert any(victim.name in p and ("truncated" in p or "damaged" in p) for p in problems), problems


def test_latest_naming_a_missing_tag(fixture_by_name, tmp_path):
    ckpt, tag = _copy(fixture_by_name("z1_fp32_w2"), tmp_path)
    (ckpt / "latest").write_text("global_step999")
    r = _inspect(ckpt)
    assert r.returncode == 2 and "global_step999" in r.stderr and "--tag" in r.stderr


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        r = _inspect(path)
        assert r.returncode == 2 and str(path) in r.stderr
