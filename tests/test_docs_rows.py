"""The support tables stay honest (issue 40): README.md's "What it reads and writes" table and docs/support.md name
tests, test functions and fixtures; each must exist.

- every ``tests/...`` path either page names (a link or a backticked path) exists; a link's text that names a test
  file names the file it points to; every row of README's table names at least one test file in "tested in";
- every backticked test name in docs/support.md is a test function of tests/ (``[...]`` ids aside; ``*`` a pattern);
- every backticked fixture name in docs/support.md (``{a,b}`` expanded, ``*`` a pattern; ``0.10.3/z1_fp32_w3``: an
  old-release fixture) is one that some fixture factory's generator defines.

Nothing is built: the factories are asked for their generators' names (they import torch, not DeepSpeed), and the
old-release fixtures are the committed folders. A self-test feeds each check a broken link, an unknown test and an
unknown fixture, so that none of them can pass on anything.
"""
from __future__ import annotations

import fnmatch
import importlib
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SUPPORT = ROOT / "docs" / "support.md"
OLD_RELEASES = ROOT / "tests" / "data" / "old_releases"

#: a segment of a fixture name that says stage, world or mesh size (``z2``, ``w3``, ``dp2``, ``ep1``, ...)
SIZE_SEGMENT = re.compile(r"^(z[0-3]|w\d+|dp\d+|ep\d+|tp\d+|pp\d+|sp\d+)$")
#: fixture families whose names carry no such segment (tests/fixtures/peft, nvme, hf, average)
FAMILY_PREFIXES = ("peft_", "nvme_", "accel_", "hf_llama", "hf_gpt2", "avg_")
NAME_CHARS = re.compile(r"^[A-Za-z0-9_{},*]+$")
OLD_ID = re.compile(r"^(\d+\.\d+\.\d+)/([A-Za-z0-9_{},*]+)$")
TEST_NAME = re.compile(r"^(test_[A-Za-z0-9_*]+)(?:\[([^\]]*)\])?$")
TESTS_PATH = re.compile(r"(?<![\w/.])tests/[A-Za-z0-9_./-]*")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


# ------------------------------------------------------------------------------------------------ what exists
@lru_cache(maxsize=None)
def fixture_names() -> frozenset:
    """Every fixture name the factories' generators define (their spec lists; nothing is built)."""
    names: set = set()
    from tests.fixtures import factory as main

    for world in (1, 2, 3, 4):
        names.update(main.expected_names(world))
    for family in ("parallel", "mesh", "optim", "autoep", "bf16_masters", "average"):
        mod = importlib.import_module(f"tests.fixtures.{family}.factory")
        for _world, launched in mod.launches().values():
            names.update(launched)
    for family in ("hf_parallel", "legacy"):
        mod = importlib.import_module(f"tests.fixtures.{family}.factory")
        names.update(n for launch in mod.launches() for n in launch.names)
    from tests.fixtures.hf import factory as hf
    from tests.fixtures.nvme import generate as nvme
    from tests.fixtures.peft import factory as peft

    names.update(hf.FIXTURES)
    names.update(peft.FIXTURES)
    names.update(peft.TF4_FIXTURES)
    names.update(s.name for s in nvme.all_specs())
    return frozenset(names)


def old_release_ids() -> frozenset:
    """``version/name`` of every committed old-release fixture (tests/test_old_releases.py's ids)."""
    return frozenset(f"{d.parent.name}/{d.name}" for d in OLD_RELEASES.glob("*/*") if (d / "fixture.json").is_file())


@lru_cache(maxsize=None)
def defined_tests() -> frozenset:
    found = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        found.update(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), re.M))
    return frozenset(found)


# ------------------------------------------------------------------------------------------------ reading the pages
def expand(pattern: str) -> list[str]:
    """``a{b,c}d{e,f}`` -> ``[abde, abdf, acde, acdf]`` (nested braces too)."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        raise ValueError(f"unbalanced braces in {pattern!r}")
    inner, parts, depth, last = pattern[start + 1:end], [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(inner[last:i])
            last = i + 1
    parts.append(inner[last:])
    head, tail = pattern[:start], pattern[end + 1:]
    return [x for part in parts for x in expand(head + part + tail)]


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def fixture_like(name: str) -> bool:
    """A backticked word that names a fixture: the factories' naming (a stage, world or mesh segment, or a family
    prefix); words like ``exclude_frozen_parameters`` or ``legacy_stage1`` are not."""
    if not NAME_CHARS.match(name) or "_" not in name:
        return False
    return any(SIZE_SEGMENT.match(seg) for x in expand(name) for seg in x.split("_")) or name.startswith(FAMILY_PREFIXES)


def unknown_fixtures(text: str, known: frozenset, old: frozenset) -> list[str]:
    """The fixture names ``text`` gives in backticks (``test_x[fixture]`` ids too) that no factory defines."""
    words = []
    for word in backticked(text):
        m = TEST_NAME.match(word)
        words.append(m.group(2) if m and m.group(2) else word.strip("[]"))
    bad = []
    for word in filter(None, words):
        m = OLD_ID.match(word)
        if m:
            bad += [w for w in (f"{m.group(1)}/{x}" for x in expand(m.group(2))) if not fnmatch.filter(old, w)]
        elif fixture_like(word):
            bad += [w for w in expand(word) if not fnmatch.filter(known, w)]
    return bad


def unknown_tests(text: str, known: frozenset) -> list[str]:
    bad = []
    for word in backticked(text):
        m = TEST_NAME.match(word)
        if m and not fnmatch.filter(known, m.group(1)):
            bad.append(word)
    return bad


def missing_paths(text: str, base: Path) -> list[str]:
    """``tests/...`` paths the page names (links resolved from ``base``, the page's folder; backticked paths and
    bare ones from the repository) that do not exist; a link whose text names a test file but points elsewhere."""
    bad = []
    for label, target in LINK.findall(text):
        target = target.split("#")[0]
        if "tests/" not in target or target.startswith(("http:", "https:")):
            continue
        path = (base / target).resolve()
        if not path.exists():
            bad.append(target)
        elif re.fullmatch(r"test_\w+", label) and label != path.stem:
            bad.append(f"[{label}]({target})")
    for found in TESTS_PATH.findall(LINK.sub(" ", text)):
        if not (ROOT / found.rstrip(".")).exists():
            bad.append(found)
    return bad


def readme_table(text: str) -> list[list[str]]:
    """The rows (cells) of README's "What it reads and writes" table."""
    section = text.split("## What it reads and writes", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


# ------------------------------------------------------------------------------------------------ the pages
def test_every_test_file_the_pages_name_exists():
    bad = {page.name: missing_paths(page.read_text(), page.parent) for page in (README, SUPPORT)}
    assert not any(bad.values()), bad


def test_every_row_of_the_readme_table_names_its_tests():
    rows = readme_table(README.read_text())
    assert len(rows) >= 15, len(rows)
    for cells in rows:
        assert len(cells) == 6, cells[0]
        linked = re.findall(r"\]\((tests/test_\w+\.py)\)", cells[-1])
        assert linked, f"no test file named for: {cells[0]}"


def test_every_test_name_in_support_md_is_a_test():
    bad = unknown_tests(SUPPORT.read_text(), defined_tests())
    assert not bad, bad


def test_every_fixture_support_md_names_is_one_a_factory_defines():
    text = SUPPORT.read_text()
    named = [w for w in backticked(text) if fixture_like(w) or OLD_ID.match(w)]
    assert len(named) > 100, len(named)  # the check sees the tables' names
    bad = unknown_fixtures(text, fixture_names(), old_release_ids())
    assert not bad, bad


def test_the_checks_catch_a_broken_link_an_unknown_test_and_an_unknown_fixture():
    known, old = fixture_names(), old_release_ids()
    assert {"muon_z1_bf16_w2", "pp2_dp1_z1_bf16_act", "peft_gpt2_lora_z3", "nvme_all_fp32_adamw"} <= known
    assert expand("muon_z{1,2,3}_{bf16,fp32}_w{2,3}") == [f"muon_z{z}_{d}_w{w}" for z in (1, 2, 3)
                                                         for d in ("bf16", "fp32") for w in (2, 3)]
    assert expand("moe_ep{1,2}_{z0_fp32,z1_bf16}") == ["moe_ep1_z0_fp32", "moe_ep1_z1_bf16", "moe_ep2_z0_fp32",
                                                       "moe_ep2_z1_bf16"]
    good = ("`muon_z{1,2,3}_{bf16,fp32}_w{2,3}`, `autotp_tp2_dp{1,2}_*`, `0.10.3/z1_fp32_w3`, `legacy_stage1`, "
            "`exclude_frozen_parameters`, `test_read_is_bit_exact[0.12.6/z1_bf16_w3]`, `[rmsprop_z3_bf16_w2]`")
    assert unknown_fixtures(good, known, old) == []
    bad = "`muon_z{1,4}_bf16_w2`, `autotp_tp3_dp{1,2}_*`, `0.10.3/z4_fp32_w3`, `test_x[sgd_z9_bf16_w2]`, `peft_lora_q`"
    assert unknown_fixtures(bad, known, old) == ["muon_z4_bf16_w2", "autotp_tp3_dp1_*", "autotp_tp3_dp2_*",
                                                 "0.10.3/z4_fp32_w3", "sgd_z9_bf16_w2", "peft_lora_q"]
    tests = defined_tests()
    assert unknown_tests("`test_read_is_bit_exact[ID]`, `test_inspect_*`", tests) == []
    assert unknown_tests("`test_no_such_thing[ID]`", tests) == ["test_no_such_thing[ID]"]
    page = ("| x | [test_export](tests/test_export.py), [test_gone](tests/test_gone.py) |\n"
            "[test_reshard](tests/test_export.py) and `tests/test_nothing_here.py`, `tests/fixtures/peft/`")
    assert missing_paths(page, ROOT) == ["tests/test_gone.py", "[test_reshard](tests/test_export.py)",
                                         "tests/test_nothing_here.py"]
    assert missing_paths("[dcp](../tests/test_dcp_export.py)", ROOT / "docs") == []

