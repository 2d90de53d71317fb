"""Reading a checkpoint needs neither DeepSpeed nor anything it pickled."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(r"""
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "deepspeed" or name.startswith("deepspeed."):
                raise ImportError("deepspeed is blocked in this test")
    sys.meta_path.insert(0, Block())
    try:
        import deepspeed
    except ImportError:
        pass
    else:
        raise SystemExit("deepspeed imported although blocked")
    import torch, ckptlib
    ckpt_dir, ref_file = sys.argv[1], sys.argv[2]
    ref = torch.load(ref_file, weights_only=True)
    ck = ckptlib.open_checkpoint(ckpt_dir)
    assert not ck.problems, ck.problems
    n = 0
    for name, want in ref["fp32"].items():
        assert torch.equal(ck.read_param(name), want), name
        for key, st in ref["optim"].get(name, {}).items():
            assert torch.equal(ck.read_state(name, key), st.float()), (name, key)
        n += 1
    assert "deepspeed" not in sys.modules
    print("OK", n)
""")


def test_reading_works_where_import_deepspeed_fails(fixture_by_name):
    for name in ("z2_fp16_w2", "z3_bf16_w3", "bf16opt_w2"):
        fx = fixture_by_name(name)
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(fx["checkpoint_path"]), str(fx["path"] / "reference.pt")],
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
