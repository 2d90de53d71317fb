"""The safe reader never runs code from a checkpoint and explains what it refuses."""
import os
import subprocess
import sys

import pytest
import torch

from ckptlib import UnsafeCheckpointError, UnsupportedCheckpointError, IncompleteCheckpointError
from ckptlib.io.torchzip import open_torch_file
from tests.hostile import marker_payload, write_torch_zip

PAYLOADS = sorted(marker_payload(__import__("pathlib").Path("/x")))


@pytest.mark.parametrize("kind", PAYLOADS)
def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path, kind):
    marker = tmp_path / "marker"
    f = write_torch_zip(tmp_path / "evil.pt", marker_payload(marker)[kind])
    with pytest.raises(UnsafeCheckpointError) as e:
        open_torch_file(f)
    assert str(f) in str(e.value) and "nothing from the file was run" in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["os_system_reduce", "stack_global", "nested_in_dict"])
def test_control_the_payload_is_real(tmp_path, kind):
    """Without the restricted unpickler the same bytes do run code (so the test above can fail)."""
    marker = tmp_path / "marker"
    data = marker_payload(marker)[kind]
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({data!r})"], check=False)
    assert marker.exists()


def test_hostile_file_inside_a_checkpoint_is_refused_by_the_cli(tmp_path):
    marker = tmp_path / "marker"
    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    write_torch_zip(tag / "mp_rank_00_model_states.pt", marker_payload(marker)["os_system_reduce"])
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(tmp_path / "ckpt")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "mp_rank_00_model_states.pt" in r.stderr and "os.system" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not marker.exists()


def test_legacy_torch_file_is_read(tmp_path):
    """torch's legacy serialization is read like a zip file (issue 32; tests/test_legacy.py)."""
    f = tmp_path / "old.pt"
    torch.save({"w": torch.ones(3)}, f, _use_new_zipfile_serialization=False)
    with open_torch_file(f) as tf:
        assert tf.format == "legacy" and torch.equal(tf.obj["w"].read(), torch.ones(3))


@pytest.mark.parametrize("content", [b"", b"\x00" * 100, os.urandom(4096)])
def test_garbage_files_give_clear_errors(tmp_path, content):
    f = tmp_path / "bad.pt"
    f.write_bytes(content)
    with pytest.raises(IncompleteCheckpointError) as e:
        open_torch_file(f)
    assert str(f) in str(e.value)


def test_truncated_zip_is_reported(tmp_path):
    f = tmp_path / "t.pt"
    torch.save({"w": torch.arange(1000.0)}, f)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(IncompleteCheckpointError, match="damaged or truncated"):
        open_torch_file(f)


def test_tensor_handles_read_ranges_without_reading_everything(tmp_path):
    f = tmp_path / "t.pt"
    big = torch.arange(1_000_000, dtype=torch.float32)
    torch.save({"a": big, "view": big[10:20], "bf": torch.arange(7, dtype=torch.bfloat16), "i": torch.tensor([2**40])}, f)
    tf = open_torch_file(f)
    assert tf.stats.bytes_read < 10_000
    h = tf.obj["a"]
    assert h.shape == (1_000_000,) and h.dtype == torch.float32
    before = tf.stats.bytes_read
    assert torch.equal(h.read_flat(500_000, 10), big[500_000:500_010])
    assert tf.stats.bytes_read - before == 40
    assert torch.equal(tf.obj["view"].read(), big[10:20])
    assert torch.equal(tf.obj["bf"].read(), torch.arange(7, dtype=torch.bfloat16))
    assert tf.obj["i"].read().item() == 2**40
    out = torch.empty(5)
    assert tf.obj["a"].read_flat(3, 5, out=out) is out and out.tolist() == [3, 4, 5, 6, 7]


def test_inspect_globals_names_what_each_pickle_asks_for_without_running_it(tmp_path):
    marker = tmp_path / "marker"
    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("global_step1")
    write_torch_zip(tag / "mp_rank_00_model_states.pt", marker_payload(marker)["stack_global"])
    write_torch_zip(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker_payload(marker)["newobj_popen"])
    torch.save({"w": torch.ones(2)}, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(tmp_path / "ckpt"), "--globals"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert "REFUSED  posix.system" in r.stdout and "REFUSED  subprocess.Popen" in r.stdout
    assert "allowed  torch._utils._rebuild_tensor_v2" in r.stdout
    assert "global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt" in lines[5] or any(
        "zero_pp_rank_1" in line for line in lines)
    assert "refuses 2 global(s): posix.system, subprocess.Popen" in r.stdout
    assert not marker.exists()
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(tmp_path / "ckpt"), "--globals", "--json"],
                       capture_output=True, text=True)
    import json

    report = json.loads(r.stdout)
    assert report["refused"] == ["posix.system", "subprocess.Popen"] and not marker.exists()


def test_big_endian_tensor_bytes_are_refused(tmp_path):
    import zipfile

    f = tmp_path / "a.pt"
    torch.save({"w": torch.arange(4.0)}, f)
    g = tmp_path / "b.pt"
    with zipfile.ZipFile(f) as zin, zipfile.ZipFile(g, "w", zipfile.ZIP_STORED) as z:
        for info in zin.infolist():
            z.writestr(info.filename, b"big" if info.filename.endswith("/byteorder") else zin.read(info.filename))
    assert open_torch_file(f).obj["w"].read().tolist() == [0, 1, 2, 3]
    with pytest.raises(UnsupportedCheckpointError, match="'big'-endian"):
        open_torch_file(g)


def test_internal_errors_are_one_line_and_exit_3(tmp_path, monkeypatch, capsys):
    """A bug in ckptlib (here: a planner that raises a plain exception) is exit code 3, one line asking for a
    report, the traceback in a file; a finding stays 1 and a clean error 2."""
    import ckptlib.analysis.summary as summary
    from ckptlib.cli import main
    from ckptlib.cli.crash import REPORT_DIR_ENV

    tag = tmp_path / "ckpt" / "global_step1"
    tag.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}, "buffer_names": [], "param_shapes": None},
               tag / "mp_rank_00_model_states.pt")

    def broken(ckpt):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(summary, "format_text", broken)
    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    code = main(["inspect", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 3 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "internal error (ZeroDivisionError: a bug)" in err and "please report it" in err
    crash = list(tmp_path.glob("ckpt-internal-error-*.txt"))
    assert len(crash) == 1 and str(crash[0]) in err
    text = crash[0].read_text()
    assert "Traceback" in text and "ZeroDivisionError: a bug" in text and "ckpt inspect" in text
