"""Changing a checkpoint's mesh two ways, side by side on the real fixtures, in one run:

- **ckptlib**: ``ckpt reshard CKPT OUT --tp/--pp/--ep/--dp``, then ``engine.load_checkpoint(OUT)`` at the new
  mesh (no universal mode);
- **DeepSpeed's route**: ``ds_to_universal`` (``--inject_missing_state`` where the checkpoint records no
  ``universal_checkpoint_info``), then ``load_checkpoint`` with ``"load_universal": true`` at the new mesh.

For each: whether it works, the conversion's wall time, peak RssAnon (process tree) and temporary disk, and
what the loaded engine holds against the live source engine's reference: fp32 masters, Adam moments, 16-bit
weights, buffers and the step (for ZeRO-3, every sub-group's).

    python bench/mesh_route.py                       # every case (about 20 minutes on 2 cores)
    python bench/mesh_route.py --only "3D tp 2->1"   # some
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIB, PY, ckpt, table  # noqa: E402
from procmon import run  # noqa: E402

#: label -> (fixture, target mesh, ckpt reshard arguments beyond the sizes)
CASES = {
    "3D tp 2->1": ("pp2_tp2_dp1_z1_bf16", {"pp": 2, "tp": 1, "dp": 1}, []),
    "3D pp 2->1": ("pp2_tp2_dp1_z1_bf16", {"pp": 1, "tp": 2, "dp": 1}, []),
    "3D dp 1->2": ("pp2_tp2_dp1_z1_bf16", {"pp": 2, "tp": 2, "dp": 2}, []),
    "3D pp, tp 2->1, dp 1->2": ("pp2_tp2_dp1_z1_bf16", {"pp": 1, "tp": 1, "dp": 2}, []),
    "3D ZeRO-0 fp32 pp, tp 2->1": ("pp2_tp2_dp1_z0_fp32", {"pp": 1, "tp": 1, "dp": 1}, []),
    "PipelineModule pp 2->1": ("pp2_dp1_z1_bf16", {"pp": 1, "tp": 1, "dp": 2}, []),
    "PipelineModule pp 1->2": ("pp1_dp2_z1_bf16", {"pp": 2, "tp": 1, "dp": 1},
                               ["--pp-partition", "0,3,6", "--pp-tied", "embed:0,5"]),
    "Megatron tp 2->1": ("tp2_dp2_z1_bf16", {"pp": 1, "tp": 1, "dp": 2}, []),
    "Megatron tp 1->2": ("tp1_dp2_z1_bf16", {"pp": 1, "tp": 2, "dp": 1}, ["--tp-rules", "{rules}"]),
    "MoE ep 2->1": ("moe_ep2_z1_bf16", {"ep": 1, "dp": 2}, []),
    "MoE ep 1->2": ("moe_ep1_z2_bf16", {"ep": 2, "dp": 2}, []),
    "AutoTP tp 2->1 ZeRO-1": ("autotp_tp2_dp1_z1_bf16", {"tp": 1, "dp": 1}, []),
    "AutoTP tp 2->1 ZeRO-3": ("autotp_tp2_dp2_z3_bf16", {"tp": 1, "dp": 2}, []),
    "AutoTP tp 2->4 ZeRO-1": ("autotp_tp2_dp1_z1_bf16", {"tp": 4, "dp": 1}, ["--model-config", "{config}"]),
    "AutoTP tp 2->4 ZeRO-3": ("autotp_tp2_dp1_z3_bf16", {"tp": 4, "dp": 1}, ["--model-config", "{config}"]),
}


def fixtures() -> dict:
    from tests.fixtures.hf_parallel import factory as hf_factory
    from tests.fixtures.mesh import factory as mesh_factory
    from tests.fixtures.parallel import factory as par_factory

    out = {}
    for f in (par_factory, hf_factory, mesh_factory):
        for fx in f.list_fixtures(f.ensure_fixtures(verbose=False)):
            out[fx["name"]] = fx
    return out


def convert(cmd: list, out: Path) -> dict:
    st = run(cmd, env=dict(os.environ, DS_ACCELERATOR="cpu"), tree=True, watch_dir=str(out), interval=0.01)
    final = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() else 0
    return {"ok": st.returncode == 0, "wall": st.wall, "anon": st.peak_anon, "temp": max(0, st.peak_disk - final),
            "error": (st.stderr.strip().splitlines() or [""])[-1][:160] if st.returncode else ""}


def ds_route(fx: dict, work: Path) -> tuple[dict, Path]:
    src = work / "ds-src"
    shutil.copytree(fx["checkpoint_path"], src)
    tag = fx["tag"]
    args = [] if fx.get("has_universal_info") or fx["kind"] == "autotp" else ["--inject_missing_state"]
    cmd = [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src / tag), "--output_folder",
           str(src / f"{tag}_universal"), *args]
    res = convert(cmd, src)
    if res["ok"]:
        (src / "latest_universal").write_text(f"{tag}_universal")
    return res, src


def holds(fx: dict, loaded: dict) -> str:
    import torch

    ref = torch.load(fx["path"] / "reference.pt", weights_only=True)
    out = []
    rows = (fx.get("vocab_info") or {}).get("original_vocab_size")
    vocab = set(fx.get("vocab") or [])

    def same(a, b, name):
        return a is not None and a.shape == b.shape and torch.equal(a, b)

    masters = all(same(loaded["params"].get(n), w, n) for n, w in ref["params"].items())
    real = all(same(loaded["params"].get(n)[:rows] if n in vocab and rows else loaded["params"].get(n),
                    w[:rows] if n in vocab and rows else w, n) for n, w in ref["params"].items())
    moments = all(same(loaded["states"][k].get(n), w, n) for k in ("exp_avg", "exp_avg_sq")
                  for n, w in ref["states"][k].items())
    out.append("masters" if masters else ("masters (padding rows zeroed)" if real else "masters WRONG"))
    out.append("moments" if moments else "moments WRONG/padding")
    m16 = loaded.get("module16") or {}
    if m16:
        out.append("16-bit" if all(same(m16.get(n), w, n) for n, w in ref["module16"].items()) else "16-bit WRONG")
    bufs = ref.get("buffers") or {}
    if bufs:
        got = loaded.get("buffers") or {}
        out.append("buffers" if all(same(got.get(n), w, n) for n, w in bufs.items()) else "buffers NOT restored")
    out.append("step" if loaded["step"] == ref["step"] else f"step {loaded['step']} (want {ref['step']})")
    return ", ".join(out)


def load(fx: dict, mesh: dict, ckpt_dir: Path, universal: bool, work: Path, name: str) -> dict:
    if fx["kind"] == "autotp":
        from tests.fixtures.hf_parallel.load_check import run_load_checks

        job = {"name": name, "fixture_dir": str(fx["path"]), "checkpoint_dir": str(ckpt_dir), "tag": None,
               "universal": universal, "tp": mesh.get("tp")}
        return run_load_checks([job], mesh.get("tp", fx["tp"]) * mesh["dp"], work / f"load-{name}")[name]
    from tests.fixtures.mesh.check import mesh_job, run_mesh_loads

    job, world = mesh_job(fx["path"], checkpoint_dir=ckpt_dir, universal=universal, name=name, **mesh)
    return run_mesh_loads([job], world, work / f"load-{name}")[name]


HEADER = ["case", "route", "conversion wall", "peak RssAnon", "temporary disk", "at the new mesh"]


def run_cases(only: Optional[list], work: Path) -> list[tuple]:
    """Every case of :data:`CASES` (or those ``only`` names), both routes, in ``work``: one row of
    :data:`HEADER` per case and route."""
    fxs = fixtures()
    rows = []
    for label, (name, mesh, extra) in CASES.items():
        if only and label not in only:
            continue
        fx = fxs[name]
        case = work / label.replace(" ", "_").replace(">", "").replace(",", "")
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir(parents=True)
        rules = fx["path"] / "tp_rules.json"
        sizes = [a for k, v in mesh.items() for a in (f"--{k}", str(v))]
        if "{config}" in extra:  # the model's config.json (AutoTP's key-value heads), as the HF Trainer saves it
            (case / "config.json").write_text(json.dumps(dict(fx["model_config"], model_type="llama")))
        extra = [a.replace("{rules}", str(rules)).replace("{config}", str(case / "config.json")) for a in extra]
        if rules.is_file() and "--tp-rules" not in extra:
            extra += ["--tp-rules", str(rules)]
        out = case / "ckpt"
        ours = convert(ckpt("reshard", fx["checkpoint_path"], out, *sizes, *extra, "-q"), case)
        ours_load = load(fx, mesh, out, False, case, "ckpt") if ours["ok"] else {"error": ours["error"]}
        ds, ds_dir = ds_route(fx, case)
        ds_load = load(fx, mesh, ds_dir, True, case, "ds") if ds["ok"] else {"error": ds["error"]}
        for who, conv, res in (("ckpt reshard", ours, ours_load), ("ds_to_universal + load_universal", ds, ds_load)):
            if "error" in res:
                what = f"fails: {res['error'][:150]}"
            else:
                what = "loads; " + holds(fx, res["loaded"])
            rows.append((label, who, f"{conv['wall']:.1f} s" if conv["ok"] else "-", f"{conv['anon'] / MIB:.0f} MiB",
                         f"{conv['temp'] / MIB:.1f} MiB", what))
            print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="ckptlib-mesh-route-"))
    rows = run_cases(args.only, work)
    print()
    print(table(HEADER, rows))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
