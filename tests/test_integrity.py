"""Damaged checkpoints: problems are listed with the file and the likely cause; never a traceback."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckptlib


def _copy(fx, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(fx["checkpoint_path"], dst, symlinks=False)
    return dst, dst / fx["tag"]


def _inspect(path):
    r = subprocess.run([sys.executable, "-m", "ckptlib", "inspect", str(path), "--json"], capture_output=True, text=True)
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("name", ["z2_bf16_w3", "z3_fp32_w3"])
def test_missing_rank_file(fixture_by_name, tmp_path, name):
    fx = fixture_by_name(name)
    ckpt, tag = _copy(fx, tmp_path)
    victim = next(tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    victim.unlink()
    r = _inspect(ckpt)
    assert r.returncode == 1
    problems = json.loads(r.stdout)["problems"]
    assert any(f"missing {victim.name} (optimizer-state file of dp rank(s) 1" in p for p in problems), problems
    with ckptlib.open_checkpoint(ckpt) as ck, pytest.raises(ckptlib.IncompleteCheckpointError, match="problems"):
        ck.read_param("embed.weight")


def test_extra_rank_file_from_another_run(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w2")
    ckpt, tag = _copy(fx, tmp_path)
    other = fixture_by_name("z2_bf16_w3")["checkpoint_path"] / "global_step2"
    extra = next(other.glob("*zero_pp_rank_2_*optim_states.pt"))
    shutil.copy(extra, tag)
    problems = json.loads(_inspect(ckpt).stdout)["problems"]
    assert any(f"extra {extra.name} (optimizer-state file of dp rank(s) 2)" in p for p in problems), problems
    assert not any("rank 2 group" in p for p in problems), problems  # no follow-on noise about the extra rank


def test_rank_file_of_another_world_size(fixture_by_name, tmp_path):
    fx = fixture_by_name("z2_bf16_w2")
    ckpt, tag = _copy(fx, tmp_path)
    other = fixture_by_name("z2_bf16_w3")["checkpoint_path"] / "global_step2"
    src = next(other.glob("*zero_pp_rank_1_*optim_states.pt"))
    shutil.copy(src, next(tag.glob("*zero_pp_rank_1_*optim_states.pt")))
    problems = json.loads(_inspect(ckpt).stdout)["problems"]
    assert any("do not add up" in p and "rank 1" in p for p in problems), problems
    assert any(p.startswith(f"global_step2/{src.name} (dp rank 1) group") for p in problems), problems  # the file


def test_truncated_rank_file(fixture_by_name, tmp_path):
    fx = fixture_by_name("z3_bf16_w2")
    ckpt, tag = _copy(fx, tmp_path)
    victim = next(tag.glob("*zero_pp_rank_1_*optim_states.pt"))
    victim.write_bytes(victim.read_bytes()[:-5000])
    r = _inspect(ckpt)
    problems = json.loads(r.stdout)["problems"]
    assert any(victim.name in p and ("truncated" in p or "damaged" in p) for p in problems), problems


def test_latest_naming_a_missing_tag(fixture_by_name, tmp_path):
    ckpt, tag = _copy(fixture_by_name("z1_fp32_w2"), tmp_path)
    (ckpt / "latest").write_text("global_step999")
    r = _inspect(ckpt)
    assert r.returncode == 2 and "global_step999" in r.stderr and "--tag" in r.stderr


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "missing"):
        r = _inspect(path)
        assert r.returncode == 2 and str(path) in r.stderr


# ============================================================================================ rank identity
def _cli(*args):
    r = subprocess.run([sys.executable, "-m", "ckptlib", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r


def _mix(tag, a: Path, b: Path, how: str, resave: bool) -> list[str]:
    """Put rank file ``a`` where ``b`` is (``duplicate``), or swap them (``swap``); with ``resave`` the moved
    files are written again under their new names (ckptlib's writer, bytes unchanged): the archive inside
    then names the file it is, and only the partition metadata and the CRC-32s can tell."""
    from ckptlib.io.torchzip import open_torch_file
    from ckptlib.io.torchzip.writer import save

    moves = {b: a} if how == "duplicate" else {b: a, a: b}
    data = {dst: src.read_bytes() for dst, src in moves.items()}
    for dst, raw in data.items():
        dst.write_bytes(raw)
        if resave:
            tmp = dst.with_suffix(".tmp.pt")
            dst.rename(tmp)
            save(open_torch_file(tmp).obj, dst)
            tmp.unlink()
    return sorted(p.name for p in moves)


@pytest.mark.parametrize("name", ["z1_bf16_w3", "z2_fp32_w3", "z3_bf16_w3", "bf16opt_w3"])
@pytest.mark.parametrize("how", ["swap", "duplicate"])
@pytest.mark.parametrize("resave", [False, True], ids=["as_copied", "resaved"])
def test_swapped_and_duplicated_rank_files_are_refused(fixture_by_name, tmp_path, name, how, resave):
    if resave and how == "swap" and name.startswith("z3"):
        pytest.skip("ZeRO-3 records nothing per rank: two swapped files re-saved under their new names are "
                    "indistinguishable from the real ones (docs/safety.md)")
    fx = fixture_by_name(name)
    ckpt, tag = _copy(fx, tmp_path)
    files = sorted(tag.glob("*optim_states.pt"))
    named = _mix(tag, files[0], files[1], how, resave)
    out = tmp_path / "out"
    for args in (["export", ckpt, out], ["reshard", ckpt, out, "--world-size", "2"],
                 ["reshard", ckpt, out, "--universal"]):
        r = _cli(*args)
        assert r.returncode == 2, (args[0], r.stdout, r.stderr)
        assert "do not all hold the partitions their names say" in r.stderr, r.stderr
        assert all(n in r.stderr for n in (named if how == "swap" or not resave else named[1:])), (named, r.stderr)
        assert not out.exists()
    r = _cli("check", ckpt, "--json")
    assert r.returncode == 1, r.stderr
    problems = json.loads(r.stdout)["problems"]
    assert any(p["file"].endswith(named[-1]) for p in problems), problems


def test_the_real_files_pass_the_identity_checks(fixture_by_name):
    from ckptlib.deepspeed.exactness import findings

    for name in ("z1_bf16_w3", "z2_fp32_w3", "z3_bf16_w3", "bf16opt_w3", "z2_align_w3", "z1_roundrobin_w3",
                 "z3_subgroup_w3", "z2_bf16_w4", "hf_trainer_w2"):
        with ckptlib.open_checkpoint(fixture_by_name(name)["checkpoint_path"]) as ck:
            assert findings(ck) == [], name


# ============================================================================================ CRC-32
def _flip_in_tensor_data(tag: Path) -> tuple[Path, str]:
    """Flip one bit inside rank 1's fp32 partition (tensor data, not metadata); the file and its zip entry."""
    from ckptlib.io.torchzip import open_torch_file

    f = next(tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with open_torch_file(f) as tf:
        osd = tf.obj["optimizer_state_dict"]
        h = (osd.get("single_partition_of_fp32_groups") or osd.get("fp32_flat_groups"))[0]
        at, entry = h.byte_offset(3) + 1, f"{tf.archive_name}/data/{h.storage.key}"
    raw = bytearray(f.read_bytes())
    raw[at] ^= 0x04
    f.write_bytes(bytes(raw))
    return f, entry


@pytest.mark.parametrize("name", ["z2_bf16_w3", "z3_fp32_w2"])
def test_a_flipped_bit_in_tensor_data_is_found_by_its_crc(fixture_by_name, tmp_path, name):
    ckpt, tag = _copy(fixture_by_name(name), tmp_path)
    f, entry = _flip_in_tensor_data(tag)
    for args in (["check", ckpt, "--states", "--json"], ["check", ckpt, "--json"]):
        r = _cli(*args)
        assert r.returncode == 1, r.stderr
        crc = [p for p in json.loads(r.stdout)["problems"] if p["tensor"] == "zip entry"]
        assert len(crc) == 1 and crc[0]["file"].endswith(f.name) and entry in crc[0]["what"], crc
    out = tmp_path / "out"
    for args in (["export", ckpt, out], ["reshard", ckpt, out, "--world-size", "3"], ["reshard", ckpt, out, "--universal"],
                 ["export", ckpt, out, "--verify-crc"]):  # checked by default (issue 40); --verify-crc: the default
        r = _cli(*args)
        assert r.returncode == 2 and f.name in r.stderr and entry in r.stderr and "CRC-32" in r.stderr, r.stderr
        assert not out.exists()
    assert _cli("export", ckpt, out, "--no-verify-crc").returncode == 0  # unchecked: the damage is copied
    r = _cli("export", fixture_by_name(name)["checkpoint_path"], tmp_path / "clean", "--plan")
    assert r.returncode == 0 and "checks the CRC-32 of the" in r.stdout, r.stdout


def test_a_damaged_pickle_is_refused_by_its_crc(fixture_by_name, tmp_path):
    """A changed byte inside a pickle can still unpickle (a number, a name): its CRC-32 is checked on opening."""
    ckpt, tag = _copy(fixture_by_name("z2_bf16_w2"), tmp_path)
    f = tag / "mp_rank_00_model_states.pt"
    raw = bytearray(f.read_bytes())
    at = raw.index(b"ds_version")  # a key inside data.pkl: still a valid pickle once changed
    raw[at] = ord("D")
    f.write_bytes(bytes(raw))
    r = _cli("inspect", ckpt)
    assert r.returncode == 2 and f.name in r.stderr and "CRC-32" in r.stderr, r.stderr
