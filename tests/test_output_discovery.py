"""Atomic output folders and finding checkpoints, on hand-made folders (no DeepSpeed needed)."""
from __future__ import annotations

import pytest

from ckptlib.deepspeed.discovery import detect, locate
from ckptlib.errors import NotACheckpointError, OutputError
from ckptlib.io.output import LOCK_SUFFIX, TMP_MARK, AtomicOutputDir


# ============================================================================================ output folders
def test_output_appears_only_when_committed(tmp_path):
    out = tmp_path / "out"
    with AtomicOutputDir(out) as tmp:
        (tmp / "a.txt").write_text("x")
        assert not out.exists() and tmp.name.startswith(f".out{TMP_MARK}")
        assert (tmp_path / f".out{LOCK_SUFFIX}").exists()
    assert (out / "a.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock, no temporary folder


def test_a_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with AtomicOutputDir(out) as tmp:
            (tmp / "a.txt").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_refusals_and_overwrite(tmp_path):
    src = tmp_path / "ckpt"
    (src / "tag").mkdir(parents=True)
    with pytest.raises(OutputError, match="inside the source"):
        AtomicOutputDir(src / "tag" / "out", source=src).__enter__()
    with pytest.raises(OutputError, match="source checkpoint is inside"):
        AtomicOutputDir(tmp_path, source=src, overwrite=True).__enter__()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "old").write_text("keep")
    with pytest.raises(OutputError, match="not empty"):
        AtomicOutputDir(busy).__enter__()
    with AtomicOutputDir(busy, overwrite=True) as tmp:
        (tmp / "new").write_text("n")
    assert sorted(p.name for p in busy.iterdir()) == ["new"]
    (tmp_path / "file").write_text("f")
    with pytest.raises(OutputError, match="not a folder"):
        AtomicOutputDir(tmp_path / "file").__enter__()


def test_a_second_writer_is_refused_and_stale_temporaries_are_removed(tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / f".out{TMP_MARK}dead1234"
    stale.mkdir()
    first = AtomicOutputDir(out)
    first.__enter__()
    assert not stale.exists()  # left by a killed run: removed under the lock
    with pytest.raises(OutputError, match="another ckptlib run"):
        AtomicOutputDir(out).__enter__()
    first.__exit__(None, None, None)
    assert out.is_dir()


# ============================================================================================ discovery
def _tag(folder, *names):
    folder.mkdir(parents=True)
    for n in names or ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (folder / n).write_bytes(b"")
    return folder


def test_locate_a_save_dir_a_tag_and_the_latest_tag(tmp_path):
    save = tmp_path / "run"
    for t in ("global_step2", "global_step10", "global_step9"):
        _tag(save / t)
    (save / "latest").write_text("global_step9\n")
    loc = locate(save)
    assert (loc.tag, loc.tags, loc.latest) == ("global_step9", ["global_step2", "global_step9", "global_step10"],
                                               "global_step9")
    assert locate(save, tag="global_step2").tag == "global_step2"
    assert locate(save / "global_step10").tag == "global_step10"          # a tag folder given
    assert locate(save / "global_step10" / "mp_rank_00_model_states.pt").tag == "global_step10"  # a file in it
    (save / "latest").unlink()
    loc = locate(save)
    assert loc.tag == "global_step10" and "natural order" in loc.notes[0]  # 10 after 9: natural, not text order


def test_locate_the_newest_hf_checkpoint(tmp_path):
    out = tmp_path / "output"
    for n in (5, 40, 100):
        _tag(out / f"checkpoint-{n}" / f"global_step{n}")
        (out / f"checkpoint-{n}" / "latest").write_text(f"global_step{n}")
    (out / "checkpoint-7").mkdir()  # not a DeepSpeed checkpoint: skipped
    loc = locate(out)
    assert loc.save_dir.name == "checkpoint-100" and len(loc.checkpoints) == 4
    assert detect(out).kind == "training-output" and detect(out).checkpoints[-1] == "checkpoint-100"


def test_detect_says_what_a_folder_is_the_way_locate_sees_it(tmp_path):
    save = tmp_path / "run"
    _tag(save / "step10")
    _tag(save / "step9")
    assert detect(save).kind == "checkpoint" and detect(save).tags == ["step9", "step10"]
    assert detect(save / "step9").kind == "tag"
    (tmp_path / "empty").mkdir()
    assert detect(tmp_path / "empty").kind == "folder"


@pytest.mark.parametrize("setup,match", [
    (lambda p: None, "no such file"),
    (lambda p: p.mkdir(), "no DeepSpeed checkpoint here"),
    (lambda p: (_tag(p / "global_step1"), (p / "latest").write_text("global_step2")), "'latest' names the tag"),
])
def test_locate_refuses_with_one_clear_message(tmp_path, setup, match):
    p = tmp_path / "x"
    setup(p)
    with pytest.raises(NotACheckpointError, match=match):
        locate(p)
