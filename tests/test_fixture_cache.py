"""The fixture factories' shared launch: judged by the files produced, retried once, renamed into place."""
import json

import pytest

from tests.fixtures.cache import build_launch, launch_done, read_fixtures


def _check(folder):
    return [] if (folder / "fixture.json").is_file() else [f"{folder.name}: fixture.json missing"]


def _writer(calls, good_from_attempt, rc):
    def launch(tmp, log):
        calls.append(tmp.name)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"attempt {len(calls)}\n")
        if len(calls) >= good_from_attempt:
            for n in ("a", "b"):
                (tmp / n / "ckpt").mkdir(parents=True)
                (tmp / n / "fixture.json").write_text(json.dumps({"name": n, "checkpoint_dir": "ckpt", "world": 1}))
                (tmp / n / "reference.pt").write_bytes(b"x")
        return rc

    return launch


@pytest.mark.parametrize("good_from_attempt,rc", [(1, 0), (2, None), (1, 1)])
def test_a_launch_is_judged_by_its_files_and_retried_once(tmp_path, good_from_attempt, rc):
    calls = []
    marker = tmp_path / "done-x.json"
    info = build_launch(tmp_path, "x", ["a", "b"], _writer(calls, good_from_attempt, rc), _check, marker,
                        {"world": 1}, "[test]", "x", verbose=False)
    assert len(calls) == good_from_attempt and info["attempt"] == good_from_attempt
    assert info["returncode"] == (-9 if rc is None else rc) and ("note" in info) == (rc != 0)
    assert json.loads(marker.read_text())["names"] == ["a", "b"] and launch_done(tmp_path, marker, ["b", "a"])
    assert not launch_done(tmp_path, marker, ["a"])
    assert [m["name"] for m in read_fixtures(tmp_path, lambda m: m["name"])] == ["a", "b"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_two_failed_attempts_raise_with_the_log_and_leave_nothing(tmp_path):
    calls = []
    with pytest.raises(RuntimeError, match="2 attempts") as e:
        build_launch(tmp_path, "x", ["a"], _writer(calls, 3, 1), _check, tmp_path / "done-x.json", {}, "[test]", "x",
                     verbose=False)
    assert "attempt 2" in str(e.value) and len(calls) == 2
    assert not (tmp_path / "done-x.json").exists() and not (tmp_path / "a").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
