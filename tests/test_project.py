"""The project's own files stay consistent: environment.yml follows pyproject.toml; notebooks are clean."""
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _split(req: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    return m.group(1).lower().replace("_", "-"), m.group(2).replace(" ", "")


def _env_entries() -> dict[str, str]:
    out = {}
    in_deps = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        line = line.split("#", 1)[0].rstrip()
        if not line.startswith(" ") and line:
            in_deps = line.startswith("dependencies:")
            continue
        line = line.strip()
        if in_deps and line.startswith("- ") and not line.endswith(":"):
            item = line[2:].strip()
            if item.startswith("-e") or item in ("pip",) or item.startswith("python="):
                continue
            name, spec = _split(item)
            out[name] = spec
    return out


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted += extra
    env = _env_entries()
    for req in wanted:
        name, spec = _split(req)
        assert name in env, f"{name} is in pyproject.toml but not in environment.yml"
        assert env[name] == spec, f"{name}: pyproject says {spec!r}, environment.yml says {env[name]!r}"
    assert set(env) <= {_split(r)[0] for r in wanted}, "environment.yml lists packages pyproject.toml lacks"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in ci


def test_notebooks_are_committed_without_outputs():
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        assert not any(c.get("outputs") or c.get("execution_count") for c in cells if c["cell_type"] == "code"), nb


README = ROOT / "README.md"
SAMPLE = ROOT / "samples" / "zero2_bf16_w2" / "ckpt"
GUIDES = ["export", "reshard", "huggingface", "dcp", "check-diff", "notebooks", "distributed", "safety"]


def _code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(heading above it, lines)`` of every fenced ``bash`` block."""
    out, heading, block = [], "", None
    for line in text.splitlines():
        if block is None and line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif block is None and line.startswith("```bash"):
            block = []
        elif block is not None and line.startswith("```"):
            out.append((heading, block))
            block = None
        elif block is not None:
            block.append(line)
    return out


def _links(path: Path) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()) if "://" not in m]


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    first = _code_blocks(text)[0][1]  # the two commands for a fresh machine come first
    assert first[0].startswith("bash scripts/demo.sh") and first[1].startswith("bash scripts/test.sh")
    linked = set(_links(README))
    for guide in GUIDES:
        assert f"docs/{guide}.md" in linked, f"docs/{guide}.md is not linked from the README"


def test_every_relative_link_of_the_docs_resolves():
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for link in _links(page):
            assert (page.parent / link).exists(), f"{page.relative_to(ROOT)} links {link}, which does not exist"


def test_the_readme_commands_run(tmp_path):
    """The six commands of the README, as written there, on the bundled sample (exit 0: healthy, and the
    export diffs as the same). The sample has one tag: average takes three copies of it, whose average is
    the export itself, bit for bit."""
    (heading, lines), = [b for b in _code_blocks(README.read_text()) if b[0] == "The six commands"]
    commands = [line.split("#", 1)[0].split() for line in lines if line.startswith("ckpt ")]
    assert [c[1] for c in commands] == ["inspect", "export", "reshard", "check", "diff", "average"]
    names = {"CKPT": str(SAMPLE), "EXPORT": str(tmp_path / "export"), "RESHARDED": str(tmp_path / "resharded"),
             "AVERAGED": str(tmp_path / "averaged")}
    for i in (1, 2, 3):
        shutil.copytree(SAMPLE, tmp_path / f"run{i}" / "ckpt")
        names[f"TAG{i}"] = str(tmp_path / f"run{i}" / "ckpt")
    commands.append(["ckpt", "diff", "AVERAGED", "EXPORT"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for cmd in commands:
        args = [names.get(a, a) for a in cmd[1:]]
        r = subprocess.run([sys.executable, "-m", "ckptlib", *args], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        assert r.stdout.strip() and "Traceback" not in r.stderr
    assert (tmp_path / "export" / "model.safetensors").is_file() and (tmp_path / "resharded" / "latest").is_file()
    assert (tmp_path / "averaged" / "model.safetensors").is_file()
