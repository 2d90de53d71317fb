"""`pip install ckptlib` brings no torch, and the six commands work there.

The test builds ckptlib's wheel from this source tree, makes a fresh venv and installs the wheel into it
with its dependencies (numpy, safetensors, tqdm: from the package index or pip's cache), under a
constraint that makes pip fail rather than fetch torch. In that venv, on checkpoints DeepSpeed wrote
(ZeRO-2 bf16, ZeRO-3 fp16, Megatron-style tensor parallel), the ``ckpt`` script runs inspect, export
(safetensors, torch format, bf16), reshard (and ``--universal``), average, check and diff; every output is byte for
byte what the development venv (with torch) writes. What needs torch says so in one line.
"""
from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HINT = "pip install 'ckptlib[torch]'"


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A venv holding ckptlib's wheel and its declared dependencies only; its ``bin`` folder."""
    work = tmp_path_factory.mktemp("no-torch")
    wheels = work / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, ROOT])
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("ckptlib-*.whl")
    made = _run([sys.executable, "-m", "venv", work / "venv"])
    assert made.returncode == 0, made.stderr
    venv_bin = work / "venv" / "bin"
    forbid = work / "no-torch.txt"
    forbid.write_text("torch<0\n")  # anything that asks for torch makes the install fail instead of fetching it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    got = _run([venv_bin / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", forbid, wheel],
               env=env)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    listed = _run([venv_bin / "python", "-m", "pip", "list", "--format", "freeze"], env=env)
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "torch" not in names and {"ckptlib", "numpy", "safetensors", "tqdm"} <= names, names
    return venv_bin


def _clean_env() -> dict:
    """The environment without this tree on PYTHONPATH: the venv runs its installed ckptlib."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _same_tree(a: Path, b: Path) -> list[str]:
    """Files that differ between two output folders (or are only in one)."""
    fa = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    fb = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    if fa != fb:
        return sorted(set(fa) ^ set(fb))
    return [f for f in fa if not filecmp.cmp(a / f, b / f, shallow=False)]


def test_no_torch_in_the_venv(bare_venv):
    r = _run([bare_venv / "python", "-c", "import torch"], env=_clean_env())
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr


def _commands(ckpt: Path, out: Path) -> list[tuple[str, list, int]]:
    """(output folder or '', arguments of ckpt, expected exit code)."""
    return [
        ("", ["inspect", ckpt], 0),
        ("", ["inspect", ckpt, "--json"], 0),
        ("export", ["export", ckpt, out / "export", "--verify"], 0),
        ("export-torch-bf16", ["export", ckpt, out / "export-torch-bf16", "--format", "torch", "--dtype", "bf16"], 0),
        ("export-states", ["export", ckpt, out / "export-states", "--states", "exp_avg,exp_avg_sq",
                           "--max-shard-size", "20KB"], 0),
        ("reshard", ["reshard", ckpt, out / "reshard", "--world-size", "3", "--verify"], 0),
        ("universal", ["reshard", ckpt, out / "universal", "--universal"], 0),
        # the checkpoint and its reshard, averaged: each element 0.5 x + 0.5 x in float64, rounded to fp32 (= x)
        ("average", ["average", ckpt, out / "reshard", out / "average", "--verify"], 0),
        ("", ["diff", ckpt, out / "average"], 0),
        ("", ["check", ckpt, "--states"], 0),
        ("", ["diff", ckpt, out / "export"], 0),
        ("", ["diff", ckpt, out / "reshard", "--states"], 0),
        ("", ["diff", ckpt, out / "export-torch-bf16"], 1),  # bf16 rounding: changed tensors, exit 1
    ]


@pytest.mark.parametrize("name", ["z2_bf16_w2", "z3_fp16_w3", "tp2_dp2_z1_bf16"])
def test_the_six_commands_without_torch(name, bare_venv, fixture_by_name, parallel_fixtures, tmp_path):
    fx = parallel_fixtures[name] if name in parallel_fixtures else fixture_by_name(name)
    ckpt = Path(fx["checkpoint_path"])
    bare, full = tmp_path / "bare", tmp_path / "full"
    bare.mkdir()
    for _folder, args, code in _commands(ckpt, bare):
        r = _run([bare_venv / "ckpt"] + args + ["-q"] * (args[0] != "inspect"), env=_clean_env())
        assert r.returncode == code, f"{' '.join(map(str, args))}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr, r.stderr
        if args[0] == "inspect":
            assert "dp" in r.stdout, r.stdout
    # the same conversions in the development venv (torch installed) write the same bytes
    full.mkdir()
    for folder, args, _code in _commands(ckpt, full):
        if folder:
            r = _run([sys.executable, "-m", "ckptlib"] + args + ["-q"], env=dict(os.environ, PYTHONPATH=str(ROOT)))
            assert r.returncode == 0, r.stderr[-2000:]
            assert not _same_tree(bare / folder, full / folder), f"{folder}: the venv without torch wrote other bytes"


def test_what_needs_torch_says_so_in_one_line(bare_venv, fixture_by_name):
    ckpt = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    script = ("import ckptlib, sys\n"
              "ck = ckptlib.open_checkpoint(sys.argv[1])\n"
              "try:\n"
              "    ck.read_param(ck.parameters[0].name)\n"
              "except ckptlib.CkptError as e:\n"
              "    print(e)\n")
    r = _run([bare_venv / "python", "-c", script, ckpt], env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert "needs torch, which is not installed" in r.stdout and INSTALL_HINT in r.stdout, r.stdout
    env = dict(_clean_env(), RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", LOCAL_RANK="0")
    r = _run([bare_venv / "ckpt", "export", ckpt, bare_venv.parent.parent / "dist-out", "--distributed"], env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--distributed" in r.stderr and "needs torch" in r.stderr and INSTALL_HINT in r.stderr, r.stderr
    assert not (bare_venv.parent.parent / "dist-out").exists()
