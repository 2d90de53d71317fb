"""The memory floor of ``ckpt export`` to safetensors, run as users run it (``python -m ckptlib`` under a
data-segment limit, ``ulimit -d``): it succeeds with 256 MiB, and below its floor it stops with one
message saying what it needs and what was left, exit code 2, no traceback, and nothing written.

The limits below the floor are the child interpreter's own data segment after importing the CLI plus
24 MiB: room for the interpreter's threads but not for the 48 MiB of streaming buffers (fp32, copied in
the kernel), nor for loading numpy with its OpenBLAS buffers (the casts to bf16/fp16).
"""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "zero2_bf16_w2" / "ckpt"
MIB = 2**20


def cli_data_segment() -> int:
    """VmData of a fresh interpreter that has imported the CLI (what the export starts from)."""
    code = ("import ckptlib.cli\n"
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmData:')))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout)


def export_under(limit: int, *args) -> subprocess.CompletedProcess:
    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    return subprocess.run([sys.executable, "-m", "ckptlib", "export", *map(str, args), "-q"], preexec_fn=cap,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def assert_one_memory_message(r: subprocess.CompletedProcess, out: Path, needs: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("  hint: "), r.stderr
    assert lines[0].startswith("ckpt export: error: ") and f"ran out of memory: {needs} needs about" in lines[0]
    assert "left under the data-segment limit (ulimit -d) of" in lines[0], lines[0]
    assert not out.exists() and not list(out.parent.glob(".*")), "something was left behind"


@pytest.mark.parametrize("name,dtype", [("z3_fp32_w2", "fp32"), ("z2_fp32_w2", "fp32"), ("sample", "fp32"),
                                        ("z3_fp32_w2", "bf16"), ("z2_bf16_w3", "fp16")])
def test_below_the_floor_the_export_stops_with_one_line_and_writes_nothing(fixture_by_name, tmp_path, name, dtype):
    """fp32 masters go file to file: the streaming buffers are what does not fit. Casts (to bf16/fp16, or the
    bf16 module weights of frozen parameters to fp32, as in the sample) need numpy first, which is refused
    before it is loaded (OpenBLAS would end the process when its buffers cannot be had)."""
    import ckptlib
    from ckptlib.execute.writers import needs_cast_kernels

    src = SAMPLE if name == "sample" else fixture_by_name(name)["checkpoint_path"]
    out = tmp_path / "out"
    casts = needs_cast_kernels(ckptlib.plan_export(src, out, dtype=dtype))
    assert casts == (name == "sample" or dtype != "fp32")
    r = export_under(cli_data_segment() + 24 * MIB, src, out, "--dtype", dtype)
    assert_one_memory_message(r, out, "loading numpy for the casts" if casts else "this export")


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_export_succeeds_with_a_256_mib_data_segment(fixture_by_name, tmp_path, dtype):
    src = fixture_by_name("z3_bf16_w2")["checkpoint_path"]
    r = export_under(256 * MIB, src, tmp_path / "capped", "--dtype", dtype)
    assert r.returncode == 0, r.stderr
    free = subprocess.run([sys.executable, "-m", "ckptlib", "export", str(src), str(tmp_path / "free"), "-q",
                           "--dtype", dtype], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert free.returncode == 0, free.stderr
    written = sorted(p.name for p in (tmp_path / "capped").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "free").iterdir()) and "model.safetensors" in written
    for name in written:
        assert (tmp_path / "capped" / name).read_bytes() == (tmp_path / "free" / name).read_bytes(), name


def bare_data_segment() -> int:
    """VmData of a fresh interpreter that has imported nothing of its own (Python's own floor)."""
    code = "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmData:')))"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


@pytest.mark.parametrize("command", ["python -m ckptlib", "ckpt"])
def test_too_little_memory_to_even_load_ckptlib_is_one_message_too(tmp_path, command):
    """From a little over a bare interpreter's data segment (below it Python itself cannot start: its
    ``site`` or ``runpy`` fail before any ckptlib code runs) up to the CLI's, the command stops with one
    message (the launcher's own when ckptlib's modules cannot be loaded, the CLI's once they are), exit
    code 2, no traceback, nothing written."""
    exe = [sys.executable, "-m", "ckptlib"] if command != "ckpt" else [str(Path(sys.executable).parent / "ckpt")]
    if command == "ckpt" and not Path(exe[0]).is_file():
        pytest.skip("the ckpt script is not installed beside this interpreter")
    # up to the CLI's data segment and on until its own guard answers: how far above ``import ckptlib.cli``
    # that is depends on whether the modules are compiled already (bytecode beside them, as pip leaves them)
    # or compiled now (this sandbox's PYTHONDONTWRITEBYTECODE=1), which takes memory of its own
    cli = cli_data_segment()
    low, high = bare_data_segment() + MIB, cli + 40 * MIB
    seen = set()
    for limit in range(low, high, MIB):
        if "cli" in seen and limit > cli + 5 * MIB:
            break
        out = tmp_path / f"out-{limit}"

        def cap(limit=limit):
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))

        r = subprocess.run([*exe, "export", str(SAMPLE), str(out), "-q"], preexec_fn=cap, capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and "Traceback" not in r.stderr, (limit, r.stderr[-2000:])
        assert len(lines) == 2 and lines[0].startswith("ckpt") and "out of memory" in lines[0], (limit, r.stderr)
        assert lines[1].startswith("  hint: ") and not out.exists(), (limit, r.stderr)
        seen.add("launcher" if "before ckptlib could run" in lines[0] else "cli")
    assert seen == {"launcher", "cli"}  # both guards were reached in the scan


def test_a_syntax_error_counts_as_out_of_memory_only_in_ckptlib_and_near_the_limit():
    """CPython's parser reports a failed allocation while it compiles a module as a SyntaxError (seen in the
    scan above: "expected ':'" in ckptlib/io/streaming.py, which compiles). Both guards (the launcher's and
    the CLI's) take such an error in one of ckptlib's files within 4 MiB of the data-segment limit for
    running out of memory; with room left, or in another file, a syntax error stays what it is."""
    code = """
import resource, sys
import ckptlib.io.streaming as mod
from ckptlib.__main__ import out_of_memory
from ckptlib.system.allocation import is_allocation_failure
own = SyntaxError("expected ':'", (mod.__file__, 1, 1, "def f"))
other = SyntaxError("expected ':'", ("/tmp/elsewhere.py", 1, 1, "def f"))
def judged():
    return [is_allocation_failure(own), out_of_memory(own), is_allocation_failure(other), out_of_memory(other)]
room = judged()
used = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmData:'))
resource.setrlimit(resource.RLIMIT_DATA, (used + 2 * 2**20, resource.getrlimit(resource.RLIMIT_DATA)[1]))
print(room, judged())
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == "[False, False, False, False] [True, True, False, False]".split(), r.stdout



@pytest.mark.parametrize("error,code", [(ImportError("libffi.so.8: failed to map segment from shared object"), 2),
                                        (OSError(12, "Cannot allocate memory"), 2), (MemoryError(), 2),
                                        (ImportError("No module named 'nowhere'"), 3), (OSError(5, "I/O error"), 3)])
def test_a_failed_allocation_outside_a_run_is_the_memory_message(monkeypatch, capsys, tmp_path, error, code):
    """Seen in CI under ``ulimit -d`` 11 MiB: a command's late ``import ctypes`` could not map libffi, and the CLI
    called that a bug (exit 3). Any failed allocation a command meets outside a run is the one memory message,
    exit code 2; an ImportError or OSError that is not one stays an internal error (exit 3)."""
    import importlib

    cli = importlib.import_module("ckptlib.cli.main")
    crash = importlib.import_module("ckptlib.cli.crash")

    def fails(args):
        raise error

    parser = cli.build_parser()
    for action in parser._subparsers._group_actions[0].choices.values():  # noqa: SLF001 - argparse's own tree
        action.set_defaults(func=fails)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setenv(crash.REPORT_DIR_ENV, str(tmp_path))
    assert cli.main(["inspect", str(SAMPLE)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    if code == 2:
        assert len(err) == 2 and err[0].startswith("ckpt inspect: error: ran out of memory (") and "hint" in err[1]
    else:
        assert len(err) == 1 and f"internal error ({type(error).__name__}: " in err[0], err
