"""The metadata path and the safetensors export never import torch.

``ckpt inspect`` (text and JSON), ``export --plan``, ``reshard --plan`` and ``reshard --universal --plan``
read pickles through the restricted unpickler, whose torch globals (``torch.Size``, ``torch.device``,
dtypes, ``torch.FloatStorage``, the rebuild functions) resolve to ckptlib's own stand-ins; an export to
safetensors (fp32, and cast to bf16/fp16 by ckptlib.io.casting) streams raw bytes. Each case runs the CLI
in a fresh interpreter and asserts that ``torch`` is not in ``sys.modules`` at the end; the stack of the
first torch import, if there was one, is in the failure message.
"""
from __future__ import annotations

import collections
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "zero2_bf16_w2" / "ckpt"

#: runs ckptlib.cli.main for each argv in sys.argv[1] (JSON), then reports the exit codes and whether (and from
#: where) torch was imported; the watcher only records, it never changes what an import does
CHILD = r"""
import sys, traceback
first = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch" and not first:
            first.append("".join(traceback.format_stack(limit=25)))
        return None
sys.meta_path.insert(0, Watch())
import contextlib, io, json
from ckptlib.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        codes.append(main(argv))
    if codes[-1] != 0:
        print(err.getvalue(), file=sys.stderr)
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules, "first": first[:1]}))
"""


def run_cli_without_torch(commands: list[list[str]]) -> dict:
    """Run ``commands`` (argv lists) in one fresh interpreter; assert each exits 0 and torch was never imported."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps([[str(a) for a in c] for c in commands])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0] * len(commands), (report["codes"], proc.stderr[-3000:])
    assert not report["torch"], "torch was imported:\n" + "".join(report["first"])
    return report


def metadata_commands(ckpt: Path, out: Path, extra: tuple = ()) -> list[list]:
    return [["inspect", ckpt, "--json", *extra], ["inspect", ckpt, *extra],
            ["export", ckpt, out / "e", "--plan", *extra], ["export", ckpt, out / "e", "--plan", "--json", *extra],
            ["reshard", ckpt, out / "r", "--plan", "--world-size", "3", *extra],
            ["reshard", ckpt, out / "u", "--plan", "--universal", "--json", *extra]]


def export_commands(ckpt: Path, out: Path, extra: tuple = ()) -> list[list]:
    return [["export", ckpt, out / "fp32", "-q", "--states", "exp_avg", *extra],
            ["export", ckpt, out / "bf16", "-q", "--dtype", "bf16", *extra],
            ["export", ckpt, out / "fp16", "-q", "--dtype", "fp16", "--max-shard-size", "4KB", *extra]]


def test_bundled_sample_metadata_and_safetensors_export_import_no_torch(tmp_path):
    run_cli_without_torch(metadata_commands(SAMPLE, tmp_path) + export_commands(SAMPLE, tmp_path))
    assert (tmp_path / "bf16" / "model.safetensors").is_file()
    assert (tmp_path / "fp16" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", ["z1_fp16_w2", "z2_bf16_w3", "z3_fp32_w2", "z3_subgroup_w3", "bf16opt_w2"])
def test_data_parallel_fixtures_import_no_torch(fixture_by_name, tmp_path, name):
    fx = fixture_by_name(name)
    run_cli_without_torch(metadata_commands(fx["checkpoint_path"], tmp_path)
                          + export_commands(fx["checkpoint_path"], tmp_path))


@pytest.mark.parametrize("name", ["pp2_dp2_z1_bf16", "tp2_dp2_z2_fp32", "tp2_dp2_z1_bf16_noinfo",
                                  "autotp_tp2_dp2_z3_bf16"])
def test_pipeline_and_tensor_parallel_fixtures_import_no_torch(parallel_fixtures, tmp_path, name):
    fx = parallel_fixtures[name]
    rules = Path(fx["path"]) / "tp_rules.json"
    extra = ("--tp-rules", rules) if rules.is_file() else ()
    run_cli_without_torch(metadata_commands(Path(fx["checkpoint_path"]), tmp_path, extra)
                          + export_commands(Path(fx["checkpoint_path"]), tmp_path, extra))


def test_exports_made_without_torch_equal_torch_casts_of_the_masters(fixture_by_name, tmp_path):
    """What the torch-free run wrote is what torch makes of the fp32 masters (read back with safetensors)."""
    import torch
    from safetensors.torch import load_file

    import ckptlib

    fx = fixture_by_name("z2_bf16_w3")
    run_cli_without_torch(export_commands(fx["checkpoint_path"], tmp_path))
    ck = ckptlib.open_checkpoint(fx["checkpoint_path"])
    full = load_file(tmp_path / "fp32" / "model.safetensors")
    half = load_file(tmp_path / "bf16" / "model.safetensors")
    fp16 = {}
    for f in json.loads((tmp_path / "fp16" / "model.safetensors.index.json").read_text())["weight_map"].values():
        fp16.update(load_file(tmp_path / "fp16" / f))
    for p in ck.parameters:
        want = ck.read_param(p.tied_to or p.name)
        assert torch.equal(full[p.name].view(torch.int32), want.view(torch.int32)), p.name
        assert torch.equal(half[p.name].view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), p.name
        assert torch.equal(fp16[p.name].view(torch.int16), want.to(torch.float16).view(torch.int16)), p.name


# ------------------------------------------------------------------------------ the unpickler's stand-ins
def test_torch_globals_resolve_to_standins_equal_to_torch_values(tmp_path):
    import torch

    from ckptlib.io.torchzip import open_torch_file
    from ckptlib.io.torchzip.standins import TorchDevice, TorchDType, TorchSize
    from ckptlib.io.torchzip.writer import save

    obj = collections.OrderedDict(
        shapes=[collections.OrderedDict(w=torch.Size([3, 4]))], device=torch.device("cpu"),
        cuda=torch.device("cuda", 1), dtypes=[torch.bfloat16, torch.float32, torch.float8_e4m3fn],
        bf=torch.arange(6, dtype=torch.bfloat16), half=torch.ones(2, dtype=torch.float16),
        step=torch.tensor(7.0), n=torch.tensor(2**40))
    torch.save(obj, tmp_path / "a.pt")
    with open_torch_file(tmp_path / "a.pt") as tf:
        tree = tf.obj
        size, dev, cuda, dts = tree["shapes"][0]["w"], tree["device"], tree["cuda"], tree["dtypes"]
        assert type(size) is TorchSize and size == torch.Size([3, 4]) and size.numel() == 12
        assert type(dev) is TorchDevice and dev == torch.device("cpu") and str(cuda) == "cuda:1"
        assert all(type(d) is TorchDType for d in dts) and dts == [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
        assert tree["bf"].dtype_name == "bfloat16" and tree["half"].dtype_name == "float16"
        assert tree["step"].item() == 7.0 and tree["n"].item() == 2**40
        assert pickle.loads(pickle.dumps(tree["shapes"])) == tree["shapes"]
        assert pickle.loads(pickle.dumps(dts))[0] is dts[0]
        save(tree, tmp_path / "b.pt")  # written back under torch's own names
    back = torch.load(tmp_path / "b.pt", weights_only=True)
    assert type(back["shapes"][0]["w"]) is torch.Size and back["shapes"][0]["w"] == torch.Size([3, 4])
    assert back["device"] == torch.device("cpu") and back["cuda"] == torch.device("cuda", 1)
    assert back["dtypes"] == [torch.bfloat16, torch.float32, torch.float8_e4m3fn]
    assert torch.equal(back["bf"], obj["bf"]) and torch.equal(back["half"], obj["half"])


def test_the_standins_keep_the_unpickler_restricted():
    """Calling the stand-ins from a pickle only ever makes values: ``torch.Size`` of something that is not
    a list of ints is refused, and a dtype name is not callable."""
    import io

    from ckptlib.io.torchzip.unpickler import SafeUnpickler

    def load(raw: bytes):
        return SafeUnpickler(io.BytesIO(raw), lambda *a: None, "x.pkl").load()

    assert load(b"\x80\x02ctorch\nSize\n](K\x02K\x03e\x85R.") == (2, 3)
    with pytest.raises(TypeError):
        load(b"\x80\x02ctorch\nSize\n](ctorch\ndevice\nX\x03\x00\x00\x00cpu\x85Re\x85R.")
    with pytest.raises(TypeError):
        load(b"\x80\x02ctorch\nbfloat16\nX\x01\x00\x00\x00x\x85R.")


LOADED = r"""
import json, sys
from ckptlib.cli import main
code = main([a for a in sys.argv[1:]])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def test_an_fp32_export_loads_only_what_it_uses(fixture_by_name, tmp_path):
    """The package's names load on first use: an fp32 export of fp32 masters (copied inside the kernel, one
    process) never loads check, diff, verification or reshard code, worker processes, the read-ahead pool
    or the cast kernels."""
    src = fixture_by_name("z3_fp32_w2")["checkpoint_path"]
    proc = subprocess.run([sys.executable, "-c", LOADED, "export", str(src), str(tmp_path / "o"), "-q"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and (tmp_path / "o" / "model.safetensors").is_file()
    loaded = set(report["modules"])
    assert "ckptlib.export.plan" in loaded and "ckptlib.execute.runner" in loaded  # the watcher sees real imports
    unused = {"ckptlib.analysis.health", "ckptlib.analysis.tensordiff", "ckptlib.analysis.verify", "ckptlib.analysis.compare", "ckptlib.reshard",
              "ckptlib.execute.processes", "multiprocessing", "concurrent.futures", "torch", "numpy"}
    assert not unused & loaded, sorted(unused & loaded)


def test_the_progress_bar_is_loaded_only_where_it_shows(fixture_by_name, tmp_path):
    """Off a terminal the bar would draw nothing (tqdm's ``disable=None``), so tqdm is not even imported; on a
    terminal (a pseudo-terminal as stderr) the bar is drawn."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    src = fixture_by_name("z3_fp32_w2")["checkpoint_path"]
    proc = subprocess.run([sys.executable, "-c", LOADED, "export", str(src), str(tmp_path / "piped")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and "tqdm" not in report["modules"]
    assert "it/s" not in proc.stderr and "B/s" not in proc.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns (tqdm reads them)
    try:
        proc = subprocess.run([sys.executable, "-c", LOADED, "export", str(src), str(tmp_path / "shown")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=follower, text=True, timeout=300)
        os.close(follower)
        drawn = b""
        while True:
            try:
                part = os.read(leader, 65536)
            except OSError:  # the other end is closed: all read
                break
            if not part:
                break
            drawn += part
    finally:
        os.close(leader)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and "tqdm" in report["modules"]
    assert b"export" in drawn and b"100%" in drawn, drawn[-500:]


def test_api_functions_keep_their_names_beside_submodules_of_the_same_name():
    """``ckptlib.export``, ``.reshard`` and ``.verify`` are functions, also once the submodules of those
    names are imported (the import system records submodules as attributes of the package)."""
    code = ("import ckptlib, ckptlib.analysis.verify, ckptlib.export.plan, ckptlib.reshard.universal, inspect\n"
            "names = ['export', 'reshard', 'verify', 'check', 'diff', 'run', 'open_checkpoint', 'CkptError']\n"
            "assert all(callable(getattr(ckptlib, n)) and not inspect.ismodule(getattr(ckptlib, n)) for n in names)\n"
            "from ckptlib import *\n"
            "assert set(ckptlib.__all__) <= set(dir(ckptlib)) and plan_export and TensorSet\n"
            "import sys; assert sys.modules['ckptlib.analysis.verify'].verify is ckptlib.verify\n"
            "try:\n    ckptlib.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_check_diff_and_verification_import_no_torch(fixture_by_name, tmp_path):
    """``ckpt check`` (statistics, saved 16-bit weights, steps), ``ckpt diff`` and ``--verify`` stream through
    numpy windows: no torch either, on fp16 and bf16 checkpoints, for exports in both formats and reshards."""
    commands = []
    for name in ("z2_fp16_w2", "z3_bf16_w3"):
        src, out = fixture_by_name(name)["checkpoint_path"], tmp_path / name
        commands += [["check", src], ["check", src, "--states", "--json"],
                     ["export", src, out / "st", "-q", "--verify"],
                     ["export", src, out / "half", "-q", "--dtype", "bf16", "--verify"],
                     ["export", src, out / "pt", "-q", "--format", "torch", "--verify"],
                     ["reshard", src, out / "rs", "--world-size", "3", "-q", "--verify"],
                     ["diff", src, out / "st"], ["diff", out / "st", out / "pt"], ["diff", src, out / "rs"],
                     ["diff", out / "st", out / "half", "--rtol", "0.01", "--json"]]  # fp32 vs bf16: within 1%
    run_cli_without_torch(commands)
