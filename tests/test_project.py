"""The project's own files stay consistent: environment.yml follows pyproject.toml; notebooks are clean."""
import json
import re
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
