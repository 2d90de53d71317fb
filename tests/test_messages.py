"""What a new user reads: every hint names the file or the checkpoint to use instead; memory exhaustion is
one line; the command line's version, quiet mode, plan estimates, tables and help.

Each message is checked by its text, on copies of real checkpoints (HF Trainer runs and DeepSpeed's own)
damaged the way they get damaged: a save cut short, a file not copied, one left over from another run.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import ckptlib
from ckptlib.cli import main as ckpt

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = ckpt([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="session")
def trainer_output() -> Path:
    """The output folder of a real HF Trainer run (checkpoint-2, -4, -6 with DeepSpeed ZeRO-2 bf16, 2 ranks)."""
    from tests.fixtures.hf import factory

    return factory.get_fixture("hf_llama_z2_w2")["output_path"]


@pytest.fixture
def output_copy(trainer_output, tmp_path) -> Path:
    out = tmp_path / "output"
    out.mkdir()
    for name in ("checkpoint-4", "checkpoint-6"):
        shutil.copytree(trainer_output / name, out / name)
    return out


def truncate(path: Path, keep: int = 100_000) -> None:
    data = path.read_bytes()[:keep]
    path.write_bytes(data)


# ============================================================================================ hints
def test_a_broken_newest_checkpoint_names_the_older_one(output_copy, tmp_path, capsys):
    truncate(next((output_copy / "checkpoint-6" / "global_step6").glob("*rank_1_*optim_states.pt")))
    older = output_copy / "checkpoint-4"
    for given in (output_copy, output_copy / "checkpoint-6"):
        code, _, err = run_cli(capsys, "export", given, tmp_path / "out")
        assert code == 2 and "Traceback" not in err
        assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in err and "damaged or truncated" in err
        assert f"hint: restore the files named from a copy, or use the older checkpoint {older}" in err
        assert "use another tag" not in err
    code, text, _ = run_cli(capsys, "inspect", output_copy)
    assert code == 1 and f"hint: restore the files named from a copy, or use the older checkpoint {older}" in text
    assert not (tmp_path / "out").exists()


def test_when_every_optimizer_file_is_broken_both_are_named(output_copy, tmp_path, capsys):
    tag = output_copy / "checkpoint-6" / "global_step6"
    for f in tag.glob("*optim_states.pt"):
        truncate(f)
    code, _, err = run_cli(capsys, "inspect", output_copy)
    assert code == 2
    assert "none of the 2 optimizer-state files can be read: bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt (" in err
    assert "; bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt (" in err
    assert f"or use the older checkpoint {output_copy / 'checkpoint-4'}" in err


def test_a_checkpoint_holding_only_model_safetensors_says_so(output_copy, capsys):
    for c in ("checkpoint-4", "checkpoint-6"):
        shutil.rmtree(output_copy / c / f"global_step{c[-1]}")
        (output_copy / c / "latest").unlink()
    code, _, err = run_cli(capsys, "inspect", output_copy)
    assert code == 2
    assert "none of the 2 checkpoint folders here holds a DeepSpeed checkpoint" in err
    assert "checkpoint-6 holds only Hugging Face weights (model.safetensors)" in err
    assert "save_only_model" in err and "no checkpoint-N folders" not in err
    code, _, err = run_cli(capsys, "inspect", output_copy / "checkpoint-6")
    assert code == 2 and "this folder holds Hugging Face weights (model.safetensors) but no DeepSpeed checkpoint" in err


def test_the_newest_checkpoint_without_deepspeed_files_is_skipped_with_a_note(output_copy, capsys):
    shutil.rmtree(output_copy / "checkpoint-6" / "global_step6")
    (output_copy / "checkpoint-6" / "latest").unlink()
    code, text, _ = run_cli(capsys, "inspect", output_copy)
    assert code == 0
    assert "using checkpoint-4" in text and "note: checkpoint-6 holds no DeepSpeed checkpoint" in text


def test_a_missing_rank_file_is_named(fixture_by_name, tmp_path, capsys):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_by_name("z2_bf16_w4")["checkpoint_path"], src)
    (src / "global_step2" / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    code, text, _ = run_cli(capsys, "inspect", src)
    assert code == 1
    assert "missing bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt (optimizer-state file of dp rank(s) 3; the " \
           "checkpoint was saved by 4 ranks)" in text
    code, _, err = run_cli(capsys, "reshard", src, tmp_path / "out", "--world-size", 2)
    assert code == 2 and "missing bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt" in err


def test_a_zero3_missing_model_states_file_is_named(fixture_by_name, tmp_path, capsys):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_by_name("z3_fp32_w3")["checkpoint_path"], src)
    (src / "global_step2" / "zero_pp_rank_2_mp_rank_00_model_states.pt").unlink()
    code, text, _ = run_cli(capsys, "inspect", src)
    assert code == 1 and "missing zero_pp_rank_2_mp_rank_00_model_states.pt (model-states file of dp rank(s) 2" in text


def test_an_extra_rank_file_is_named(fixture_by_name, tmp_path, capsys):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_by_name("z2_bf16_w2")["checkpoint_path"], src)
    other = fixture_by_name("z2_bf16_w3")["checkpoint_path"] / "global_step2"
    shutil.copy(other / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt", src / "global_step2")
    code, text, _ = run_cli(capsys, "inspect", src)
    assert code == 1
    assert "extra bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt (optimizer-state file of dp rank(s) 2): the " \
           "checkpoint has 2 partitions" in text and "move it out of the tag folder" in text


def test_another_tag_is_named_when_there_is_no_older_checkpoint(fixture_by_name, tmp_path, capsys):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_by_name("z2_bf16_w2")["checkpoint_path"], src)
    shutil.copytree(src / "global_step2", src / "global_step1")
    truncate(src / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 5000)
    code, _, err = run_cli(capsys, "export", src, tmp_path / "out")
    assert code == 2 and "hint: restore the files named from a copy, or use another tag: --tag global_step1" in err
    shutil.rmtree(src / "global_step1")
    code, _, err = run_cli(capsys, "export", src, tmp_path / "out")
    assert code == 2 and "there is no older checkpoint or other tag beside it" in err


# ============================================================================================ memory
def test_running_out_of_memory_is_one_line(fixture_by_name, tmp_path):
    """Below the floor (a data-segment limit the streaming buffers do not fit in) the export stops with
    one message saying what it needs and what was left, and writes nothing."""
    src = fixture_by_name("z2_bf16_w2")["checkpoint_path"]
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import resource, sys
        import torch, ckptlib, ckptlib.cli, ckptlib.execute  # everything a run imports
        from ckptlib.system.memory import _read_status
        used = _read_status()["VmData"]
        resource.setrlimit(resource.RLIMIT_DATA, (used + 24 * 2**20, resource.getrlimit(resource.RLIMIT_DATA)[1]))
        sys.exit(ckptlib.cli.main(["export", {str(src)!r}, {str(out)!r}, "-q"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("  hint: "), r.stderr
    assert "ran out of memory: this export needs about" in lines[0]
    assert "left under the data-segment limit (ulimit -d) of" in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_a_memory_verdict_counts_the_process_limits():
    from ckptlib.system.memory import SystemMemory, memory_verdict

    system = SystemMemory(total=8 << 30, available=6 << 30, data_limit=300 << 20, data_used=280 << 20)
    assert system.headroom == 20 << 20 and "ulimit -d" in system.bound_by
    verdict = memory_verdict(50 << 20, system)
    assert not verdict.fits and "left under the data-segment limit (ulimit -d)" in verdict.message


# ============================================================================================ command line
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        ckpt(["--version"])
    assert e.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"ckpt (ckptlib) {version}" and ckptlib.__version__ == version


@pytest.mark.parametrize("args", [["export"], ["reshard", "--world-size", "3"], ["reshard", "--universal"]])
def test_quiet_prints_nothing(trainer_output, tmp_path, args):
    src = trainer_output / "checkpoint-4"
    r = subprocess.run([sys.executable, "-m", "ckptlib", args[0], str(src), str(tmp_path / "out"), *args[1:], "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr
    assert (tmp_path / "out").is_dir()


@pytest.mark.parametrize("args", [["export"], ["export", "--format", "torch", "--states", "exp_avg"],
                                  ["export", "--max-shard-size", "300KB"], ["reshard", "--world-size", "3"],
                                  ["reshard", "--universal"]])
def test_plan_sizes_are_the_files_sizes(trainer_output, tmp_path, capsys, args):
    src = trainer_output / "checkpoint-4"
    out = tmp_path / "out"
    code, text, _ = run_cli(capsys, args[0], src, out, *args[1:], "--plan", "--json")
    assert code == 0
    plan = json.loads(text)
    code, text, _ = run_cli(capsys, args[0], src, out, *args[1:])
    assert code == 0
    on_disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    assert plan["file_bytes"] == on_disk, (plan["file_bytes"], on_disk)
    for f in plan["files"]:
        assert (out / f["name"]).stat().st_size == f["bytes"], f["name"]
    assert f"{on_disk:,} bytes" in text  # "wrote N files, <exact bytes> bytes to ..."
    if args[0] == "reshard":
        assert plan["read_bytes"] <= plan["file_bytes"]


def test_plan_text_says_what_is_read_from_where(trainer_output, tmp_path, capsys):
    code, text, _ = run_cli(capsys, "reshard", trainer_output / "checkpoint-4", tmp_path / "out", "--universal",
                            "--plan")
    assert code == 0
    assert "reads 3.1 MB of the 3.1 MB in the tag folder global_step4 (+ " in text
    assert " of other files copied as they are)" in text
    size = [line for line in text.splitlines() if "zero/optimizer_state.pt" in line][0].split()[-2:]
    assert size[1] == "KB" and float(size[0]) > 1, size  # its pickle, not "0 B"


def test_inspect_tables_stay_aligned_with_long_names(trainer_output, capsys):
    code, text, _ = run_cli(capsys, "inspect", trainer_output)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("parameter "))
    rows = lines[head:lines.index("", head)]
    assert len(rows) > 20
    assert len({line.index("[") if "[" in line else line.index("shape") for line in rows}) == 1, rows
    files = [line for line in lines if line.startswith("  global_step6/") or line.startswith("  bf16_")]
    assert len({len(line.split("  ")[1]) for line in files}) <= 1


def test_help_shows_defaults_and_every_option_is_explained(capsys):
    commands = ckptlib.cli.build_parser()._subparsers._group_actions[0].choices
    assert {"inspect", "export", "reshard"} <= set(commands)
    for command, parser in commands.items():
        with pytest.raises(SystemExit):
            ckpt([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # help wraps at the terminal width
        for a in parser._actions:
            assert a.help, f"ckpt {command} {a.option_strings or a.dest} has no help text"
        if command == "export":
            assert "(default: safetensors)" in text and "(default: fp32)" in text and "(default: 5GB)" in text
            assert "--no-hf-files" in text and "(default: True)" not in text


def test_no_traceback_for_a_missing_path(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptlib", "export", str(tmp_path / "nope"), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120, env={**os.environ})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no such file or folder" in r.stderr


def test_when_every_optimizer_file_is_broken_or_missing_each_is_named(output_copy, capsys):
    tag = output_copy / "checkpoint-6" / "global_step6"
    files = sorted(tag.glob("*optim_states.pt"))
    files[0].unlink()
    truncate(files[1])
    code, _, err = run_cli(capsys, "inspect", output_copy / "checkpoint-6")
    assert code == 2 and "Traceback" not in err
    assert f"{files[1].name} (" in err and f"missing: {files[0].name}" in err, err
