"""A corpus of broken and hostile inputs, each run through `ckpt inspect`, `ckpt export` and `ckpt reshard`.

For every case: a non-zero exit (for inspect: exit 1 with the problem listed, or exit 2), one message
that names the file (or folder) and says what to do, no traceback, the source's bytes unchanged, and
nothing finished-looking left behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptlib.cli import main
from ckptlib.io.torchzip import open_torch_file
from ckptlib.io.torchzip.writer import NewTensor, save
from tests.hostile import marker_payload, write_torch_zip


def run_cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def tree_hash(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def copy_fixture(fx, dst: Path) -> Path:
    shutil.copytree(fx["checkpoint_path"], dst)
    return dst


def optim(tag_dir: Path, rank: int) -> Path:
    return next(tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


# ------------------------------------------------------------------------------------------- the cases
def case_truncated_zip(fx, d):
    f = optim(d / "global_step2", 1)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d, [f.name, "truncated"]


def case_zero_byte_file(fx, d):
    f = optim(d / "global_step2", 1)
    f.write_bytes(b"")
    return d, [f.name, "empty"]


def case_random_bytes(fx, d):
    f = d / "global_step2" / "mp_rank_00_model_states.pt"
    f.write_bytes(os.urandom(5000))
    return d, [f.name, "not a torch checkpoint"]


def case_missing_rank_file(fx, d):
    victim = optim(d / "global_step2", 2)
    victim.unlink()
    return d, [f"missing {victim.name}", "dp rank(s) 2"]


def case_extra_rank_file_from_another_run(fx, d, other=None):
    src = other["checkpoint_path"] / "global_step2"
    shutil.copy(optim(src, 3), d / "global_step2")
    return d, [f"extra {optim(src, 3).name}", "dp rank(s) 3", "move it out of the tag folder"]


def case_latest_names_a_missing_tag(fx, d):
    (d / "latest").write_text("global_step9")
    return d, ["global_step9", "--tag"]


def case_legacy_torch_file(fx, d):
    """A legacy-format file is read like a zip one (issue 32): what it holds is judged, here an empty state."""
    f = optim(d / "global_step2", 0)
    torch.save({"optimizer_state_dict": {}}, f, _use_new_zipfile_serialization=False)
    return d, [f.name, "partition_count"]


def case_folder_without_checkpoint(fx, d):
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    (d / "sub").mkdir()
    return d, ["no DeepSpeed checkpoint here"]


def case_empty_folder(fx, d):
    d.mkdir()
    return d, ["no DeepSpeed checkpoint here"]


def _hostile(kind):
    def case(fx, d):
        f = optim(d / "global_step2", 0)
        write_torch_zip(f, marker_payload(d.parent / "marker")[kind])
        return d, [f.name, "does not load"]
    case.__name__ = f"case_hostile_{kind}"
    return case


def case_hostile_build_on_allowed_class(fx, d):
    # OrderedDict() then BUILD with a state naming dunder methods: applied to the instance, never called
    def u(text):
        return b"X" + len(text).to_bytes(4, "little") + text.encode()
    pkl = b"\x80\x02ccollections\nOrderedDict\n)R}" + u("__reduce__") + u("evil") + b"sb."
    f = d / "global_step2" / "mp_rank_00_model_states.pt"
    write_torch_zip(f, pkl)
    return d, [f.name, "'module'"]


def case_nvme_offload(fx, d):
    for r in range(fx["world_size"]):
        f = optim(d / "global_step2", r)
        obj = open_torch_file(f).obj
        flats = obj["optimizer_state_dict"]["fp32_flat_groups"]
        obj["optimizer_state_dict"]["fp32_flat_groups"] = [NewTensor.from_tensor(torch.empty(0)) for _ in flats]
        save(obj, f.with_suffix(".tmp"))
        f.with_suffix(".tmp").replace(f)
    (d / "global_step2" / "offloaded_tensors" / "rank00").mkdir(parents=True)
    return d, ["offloaded_tensors", "swap file"]  # swapped sub-groups without their swap files (NVMe reading landed)


def case_moe_expert_files(fx, d):
    tag = d / "global_step2"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "layer_0_expert_0_mp_rank_00_model_states.pt")
    return d, ["layer_0_expert_0_mp_rank_00_model_states.pt", "holds no tensors of expert 0", "another run"]


def case_pipeline_layer_files(fx, d):
    tag = d / "global_step2"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "layer_01-model_states.pt")
    return d, ["layer_01-model_states.pt", "pipeline layer file", "another run"]


CASES = [case_truncated_zip, case_zero_byte_file, case_random_bytes, case_missing_rank_file,
         case_extra_rank_file_from_another_run, case_latest_names_a_missing_tag, case_legacy_torch_file,
         case_folder_without_checkpoint, case_empty_folder,
         *[_hostile(k) for k in ("os_system_reduce", "builtins_eval", "stack_global", "nested_in_dict",
                                 "newobj_popen")],
         case_hostile_build_on_allowed_class, case_nvme_offload, case_moe_expert_files, case_pipeline_layer_files]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_broken_input(case, fixture_by_name, tmp_path):
    fx = fixture_by_name("z3_bf16_w2" if case is case_nvme_offload else "z2_bf16_w3")
    d = tmp_path / "ckpt"
    if case in (case_folder_without_checkpoint, case_empty_folder):
        path, words = case(fx, d)
    else:
        copy_fixture(fx, d)
        extra = {"other": fixture_by_name("z2_bf16_w4")} if case is case_extra_rank_file_from_another_run else {}
        path, words = case(fx, d, **extra)
    before = tree_hash(path)
    messages = {}
    for cmd in (["inspect", path], ["export", path, tmp_path / "out"],
                ["reshard", path, tmp_path / "out", "--world-size", "2"]):
        code, out, err = run_cli(*cmd)
        text = err if code == 2 else out
        if cmd[0] == "inspect" and code == 1:  # the problem is listed
            problems = json.loads(run_cli("inspect", path, "--json")[1])["problems"]
            text = "\n".join(problems)
            assert problems
        else:
            assert code == 2, (cmd[0], code, out, err)
            assert err.count("error:") == 1 and "hint:" in err, err
        assert "Traceback" not in out + err
        for w in words:
            assert w in text, (cmd[0], w, text)
        messages[cmd[0]] = text.strip().splitlines()[0]
        assert not (tmp_path / "out").exists() and not any(p.name.startswith(".out.") for p in tmp_path.iterdir())
    assert tree_hash(path) == before, "the source was modified"
    assert not (tmp_path / "marker").exists()


def test_output_inside_the_source_is_refused(fixture_by_name, tmp_path):
    d = copy_fixture(fixture_by_name("z2_bf16_w2"), tmp_path / "ckpt")
    before = tree_hash(d)
    for cmd in (["export", d, d / "global_step2" / "out"], ["reshard", d, d / "out", "--world-size", "3"],
                ["export", d, tmp_path, "--overwrite"]):
        code, out, err = run_cli(*cmd)
        assert code == 2 and ("inside the source" in err or "source checkpoint is inside" in err), err
        assert "hint:" in err
    assert tree_hash(d) == before


def test_tags_of_different_world_sizes_side_by_side(fixture_by_name, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copytree(fixture_by_name("z2_bf16_w2")["checkpoint_path"] / "global_step2", d / "global_step2")
    shutil.copytree(fixture_by_name("z3_fp32_w3")["checkpoint_path"] / "global_step2", d / "global_step3")
    (d / "latest").write_text("global_step3")
    a = json.loads(run_cli("inspect", d, "--json", "--tag", "global_step2")[1])
    b = json.loads(run_cli("inspect", d, "--json")[1])
    assert (a["dp_world_size"], a["zero_stage"], b["dp_world_size"], b["zero_stage"]) == (2, 2, 3, 3)
    assert run_cli("export", d, tmp_path / "e2", "--tag", "global_step2")[0] == 0
    assert run_cli("export", d, tmp_path / "e3")[0] == 0
    assert run_cli("reshard", d, tmp_path / "r2", "--tag", "global_step2", "--world-size", "3")[0] == 0
    assert (tmp_path / "r2" / "latest").read_text() == "global_step2"


FULL_DISK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from ckptlib.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("cmd", ["export", "export-torch", "reshard"])
def test_full_disk(fixture_by_name, tmp_path, cmd):
    fx = fixture_by_name("large_w2")
    src = fx["checkpoint_path"]
    before = tree_hash(src)
    args = {"export": ["export", src, tmp_path / "out"], "export-torch": ["export", src, tmp_path / "out", "--format",
                                                                         "torch"],
            "reshard": ["reshard", src, tmp_path / "out", "--world-size", "3"]}[cmd]
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(2_000_000), *map(str, args), "-q"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "File too large" in r.stderr or "No space" in r.stderr, r.stderr
    assert "nothing was created" in r.stderr and "hint:" in r.stderr and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []
    assert tree_hash(src) == before


# ------------------------------------------------------------------------------- cases of issue 21
def _edit(f: Path, change) -> None:
    """Rewrite torch file ``f`` with its object tree changed by ``change`` (ckptlib's writer; bytes of the
    tensors unchanged, the archive named after ``f``)."""
    obj = open_torch_file(f).obj
    change(obj)
    tmp = f.with_name(f.stem + ".tmp.pt")
    save(obj, tmp, archive=f.stem)
    tmp.replace(f)


def case_latest_is_a_link_to_a_system_file(fx, d):
    (d / "latest").unlink()
    (d / "latest").symlink_to("/etc/passwd")
    return d, ["latest", "symbolic link", "--tag"]


def case_latest_with_control_characters(fx, d):
    (d / "latest").write_bytes(b"global_step2\x1b[2J\x07")
    return d, ["latest", "\\x1b[2J\\x07", "does not hold a tag name"]


def case_zip_entry_name_not_utf8(fx, d):
    f = optim(d / "global_step2", 1)
    raw = bytearray(f.read_bytes())
    cd = raw.rfind(b"PK\x01\x02")  # the last central directory entry: flip a byte of its name
    raw[cd + 46 + 3] = 0xFF
    f.write_bytes(bytes(raw))
    return d, [f.name, "not valid UTF-8"]


def case_param_shapes_of_another_run(fx, d):
    f = d / "global_step2" / "mp_rank_00_model_states.pt"
    _edit(f, lambda obj: obj["param_shapes"][0].popitem())
    return d, ["not of one save", "param_alignment_paddings"]


def case_fragment_outside_its_storage(fx, d):
    f = optim(d / "global_step2", 1)

    def reach(obj):
        t = obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
        t.storage_offset = t.storage.numel - t.shape[0] + 5
    _edit(f, reach)
    return d, [f.name, "reaches element", "storage"]


def case_missing_optimizer_state(fx, d):
    f = optim(d / "global_step2", 1)
    _edit(f, lambda obj: obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0].pop("exp_avg_sq"))
    return d, [f.name, "exp_avg_sq"]


def case_damaged_fragment_address(fx, d):
    f = optim(d / "global_step2", 1)

    def damage(obj):
        mapping = obj["optimizer_state_dict"]["param_slice_mappings"][0]
        mapping[next(iter(mapping))] = 7
    _edit(f, damage)
    return d, [f.name, "param_slice_mappings"]


def case_big_endian_tensors(fx, d):
    import zipfile

    f = optim(d / "global_step2", 0)
    src = f.with_name("src.zip")
    f.rename(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
        for info in zin.infolist():
            z.writestr(info.filename, b"big" if info.filename.endswith("/byteorder") else zin.read(info.filename))
    src.unlink()
    return d, [f.name, "'big'-endian"]


def case_swapped_rank_files(fx, d):
    a, b = optim(d / "global_step2", 0), optim(d / "global_step2", 1)
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)
    return d, [a.name, b.name, "saved as"]


MORE = [case_latest_is_a_link_to_a_system_file, case_latest_with_control_characters, case_zip_entry_name_not_utf8,
        case_param_shapes_of_another_run, case_fragment_outside_its_storage, case_missing_optimizer_state,
        case_damaged_fragment_address, case_big_endian_tensors, case_swapped_rank_files]


@pytest.mark.parametrize("case", MORE, ids=[c.__name__[5:] for c in MORE])
def test_issue21_inputs_are_one_message_naming_the_file(case, fixture_by_name, tmp_path):
    """Each of these was a traceback, a raw terminal echo or a silent exit 0 (issue 21): now every command
    that cannot be exact says so in one message naming the file (exit 2), or lists it as a problem (inspect,
    check: exit 1); nothing is written, the source is unchanged, no control character reaches the terminal."""
    d = copy_fixture(fixture_by_name("z2_bf16_w3"), tmp_path / "ckpt")
    path, words = case(None, d)
    before = tree_hash(path)
    out = tmp_path / "out"
    for cmd in (["inspect", path], ["export", path, out], ["reshard", path, out, "--world-size", "2"],
                ["reshard", path, out, "--universal"], ["check", path, "--states"]):
        code, stdout, err = run_cli(*cmd)
        assert code in (1, 2), (cmd[0], code, stdout, err)
        assert "Traceback" not in stdout + err and "\x1b" not in stdout + err and "root:" not in stdout + err
        text = err if code == 2 else stdout
        if code == 2:
            assert err.count("error:") == 1 and "hint:" in err, err
        else:
            assert cmd[0] in ("inspect", "check"), (cmd[0], stdout)
        for w in words:
            assert w in text, (cmd[0], w, text)
        assert not out.exists()
    assert tree_hash(path) == before
