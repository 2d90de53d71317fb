"""What the benchmarks share: their arguments, the commands they time, import baselines and the table.

Every benchmark runs each tool in its own process, sampled by :mod:`procmon`; these helpers only build
the commands and the arguments the same way everywhere:

- :func:`parser`: ``checkpoints``, ``--rounds``, ``--work``, ``--json`` and ``--before SRC`` (also run
  ckptlib from another source tree in the same rounds, to measure a change);
- :func:`work_folder`: ``--work`` or a temporary folder beside the first checkpoint, removed at the end
  (outputs are GBs);
- :func:`ckpt` (``python -P -m ckptlib``: with ``-P`` the working folder is not put first on ``sys.path``,
  so ``PYTHONPATH`` decides which ckptlib runs), :func:`zero_to_fp32`, :func:`ds_to_universal`: the
  commands of ckptlib and of DeepSpeed's tools;
- :func:`baseline`: a process that only imports what a tool imports (what "over import baseline"
  subtracts); :func:`import_baselines` and :func:`print_baselines` measure and show those of a run's tools;
- :func:`fresh_output`: an emptied output folder, page cache dropped, before each timed run;
- :func:`ratio`, :func:`mib`, :func:`table`: the markdown output.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procmon import RunStats, drop_caches, run  # noqa: E402

PY = sys.executable
MIB = 2**20
#: what each tool imports before it does any work (the import baselines)
IMPORTS = {
    "export": "ckptlib.cli, ckptlib.export, ckptlib.execute, tqdm",
    "reshard": "ckptlib.cli, ckptlib.reshard, tqdm",
    "analysis": "ckptlib.cli, ckptlib.analysis.health, ckptlib.analysis.tensordiff, ckptlib.analysis.scan, tqdm, numpy",
    "zero_to_fp32": "torch, deepspeed, safetensors, huggingface_hub",
    "ds_to_universal": "torch, deepspeed, deepspeed.checkpoint.ds_to_universal",
}


def parser(doc: str, rounds: int = 3, checkpoints: str = "+") -> argparse.ArgumentParser:
    """The arguments every checkpoint benchmark takes (``checkpoints`` is argparse's ``nargs``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs=checkpoints, type=Path)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--work", type=Path, default=None, help="where outputs go (default: a temporary folder, removed)")
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    ap.add_argument("--before", type=Path, default=None, help="also run ckptlib from this source tree")
    return ap


@contextlib.contextmanager
def work_folder(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """``args.work`` (kept), or a temporary folder on the checkpoints' file system (removed at the end)."""
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        yield args.work
        return
    first = args.checkpoints[0] if isinstance(args.checkpoints, list) else args.checkpoints
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=Path(first).resolve().parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def before_env(args: argparse.Namespace, env: Optional[dict] = None) -> Optional[dict]:
    """The environment that runs ckptlib from ``--before SRC`` (None without ``--before``)."""
    if args.before is None:
        return None
    return dict(env or os.environ, PYTHONPATH=str(args.before.resolve()))


def bytecode_as_installed(*trees: Optional[Path]) -> None:
    """Run the tools as ``pip install`` leaves them: ckptlib's modules compiled to bytecode beside their
    sources (pip compiles a package when it installs it; DeepSpeed's and torch's are compiled so in the
    venv), and ``PYTHONDONTWRITEBYTECODE`` cleared for the processes started from here. Without this, a
    sandbox that sets that variable (this one does) makes every ckpt run compile its modules again: 0.2 s
    of a 0.25 s start-up here, a fifth of a small conversion's copy floor. ``trees``: other source trees
    whose ``ckptlib`` is compiled too (``--before SRC``)."""
    import compileall
    import importlib.util

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    spec = importlib.util.find_spec("ckptlib")
    if spec is not None and spec.origin:
        compileall.compile_dir(str(Path(spec.origin).parent), quiet=1)
    for tree in trees:
        if tree is not None:
            compileall.compile_dir(str(Path(tree) / "ckptlib"), quiet=1)


def ckpt(*args) -> list[str]:
    """``python -P -m ckptlib ARGS`` (see the module's docstring for ``-P``)."""
    return [PY, "-P", "-m", "ckptlib", *map(str, args)]


def tag_of(checkpoint: Path) -> str:
    return (Path(checkpoint) / "latest").read_text().strip()


def zero_to_fp32(checkpoint: Path, out: Path) -> list[str]:
    """DeepSpeed's converter, to safetensors: the script the engine saved beside the checkpoint (else the
    same script from the installed DeepSpeed)."""
    script = Path(checkpoint) / "zero_to_fp32.py"
    head = [PY, str(script)] if script.is_file() else [PY, "-m", "deepspeed.utils.zero_to_fp32"]
    return [*head, str(checkpoint), str(out), "--safe_serialization"]


def ds_to_universal(checkpoint: Path, out: Path) -> list[str]:
    """DeepSpeed's universal converter (its way to change the data-parallel size), into ``out/<tag>_universal``."""
    tag = tag_of(checkpoint)
    return [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(Path(checkpoint) / tag),
            "--output_folder", str(Path(out) / f"{tag}_universal")]


def baseline(tool: str, env: Optional[dict] = None, tree: bool = False, launcher: Sequence[str] = (),
             sleep: float = 0.5) -> RunStats:
    """A process (under ``launcher`` if given, e.g. torchrun) that only imports what ``tool`` imports
    (:data:`IMPORTS` or a comma-separated module list), then sleeps ``sleep`` seconds (long enough to be
    sampled at its peak; 0 to time the start-up)."""
    code = f"import {IMPORTS.get(tool, tool)}; import time; time.sleep({sleep})"
    if launcher:
        script = Path(tempfile.mkdtemp(prefix="ckptlib-idle-")) / "idle.py"
        script.write_text(code + "\n")
        try:
            return run([*launcher, str(script)], env=env, tree=tree)
        finally:
            shutil.rmtree(script.parent, ignore_errors=True)
    return run([PY, "-c", code], env=env, tree=tree)


def import_baselines(tools: dict, env: Optional[dict] = None) -> dict:
    """{label: peak RssAnon of the tool's import baseline} for ``tools`` {label: tool, or (tool, keyword
    arguments of :func:`baseline`)}, measured in that order."""
    out = {}
    for label, tool in tools.items():
        tool, kwargs = (tool, {}) if isinstance(tool, str) else tool
        out[label] = baseline(tool, env=env, **kwargs).peak_anon
    return out


def print_baselines(bases: dict, note: str = "", what: str = "RssAnon") -> None:
    """The line ``import baselines (RssAnon): ckptlib 250 MiB, DeepSpeed 400 MiB`` (``note`` appended)."""
    print(f"import baselines ({what}): " + ", ".join(f"{label} {v / MIB:.0f} MiB" for label, v in bases.items())
          + note)


def fresh_output(out: Path, make: bool = True) -> Path:
    """``out`` emptied (made again when ``make``; else the tool makes it) and the page cache dropped (when
    allowed): what every timed run starts from."""
    shutil.rmtree(out, ignore_errors=True)
    if make:
        out.mkdir()
    drop_caches()
    return out


def check_ok(st: RunStats, what: str, ok_codes: Sequence[int] = (0,)) -> RunStats:
    """``st`` if its exit code is expected; else print the end of its output and stop the benchmark."""
    if st.returncode not in ok_codes:
        print(st.stdout[-2000:], st.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{what} exited {st.returncode}")
    return st


def ratio(mine: float, anchor: Optional[float]) -> str:
    """`` (0.42x)`` of ``mine`` over ``anchor`` (empty without a positive anchor)."""
    return f" ({mine / anchor:.2f}x)" if anchor and anchor > 0 else ""


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.0f} MiB"


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(args: argparse.Namespace, raw) -> None:
    if getattr(args, "json", None):
        args.json.write_text(json.dumps(raw, indent=2, default=str))


__all__ = ["PY", "MIB", "IMPORTS", "parser", "work_folder", "before_env", "bytecode_as_installed", "ckpt", "tag_of",
           "zero_to_fp32", "ds_to_universal", "baseline", "import_baselines", "print_baselines", "fresh_output",
           "check_ok", "ratio", "mib", "table", "write_json"]
