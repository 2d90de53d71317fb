"""The seed's promise at scale (issue 33): export and reshard a ZeRO-3 bf16 checkpoint larger than the page
cache under a 512 MiB data limit, against the disk's own rate and against DeepSpeed's ``zero_to_fp32``.

    python bench/scale_bench.py --make --cgroup --dd-write-size 10   # write the 30 GB checkpoint, run all, delete it
    python bench/scale_bench.py --make --layers 9 --steps reshard --cgroup --extend "why"   # 25.3 GB, added
    python bench/scale_bench.py --checkpoint DIR --steps dd,export --keep

The checkpoint is synthetic (DeepSpeed cannot train a model this size here): ``make_synthetic_checkpoint.py
--fill random`` writes DeepSpeed's exact format with real tensor bytes (its format is proven by DeepSpeed's
own loader in ``tests/test_synthetic_fill.py``). Default model: Llama-2-7B's layer shapes (hidden 4096, 32
heads, intermediate 11008), 11 layers and a 35,000-token vocabulary, 2.51 B parameters at 8 ranks: 30.2 GB.

Steps (``--steps``, in this order; every heavy one holds ``--lock`` (flock, shared with the other
benchmarks) and starts with the page cache dropped):

- ``dd``: the disk's own rates: every checkpoint file read with ``dd iflag=direct`` (the same bytes the tools
  read), and a write of ``--dd-write-size`` (default: the size of the checkpoint, less if the disk cannot hold
  it with ``--margin`` free) with ``conv=fdatasync`` and with ``oflag=direct``, the faster taken;
- ``export``: ``ckpt export`` (fp32 safetensors) under ``ulimit -d`` of ``--limit-mib``; then its output
  checked: ``ckpt diff`` against the checkpoint (every tensor, exact), and a spot check independent of
  ckptlib (windows across every rank boundary of six tensors against the generator's values);
- ``reshard``: ``ckpt reshard --world-size --to-dp`` under the same limit; then ``ckpt diff --states``
  against the checkpoint (every master and optimizer state, exact); skipped, saying so, when the disk
  cannot hold the output with ``--margin`` free (then ``--make --layers 9 --steps reshard --extend WHY`` runs
  it on a smaller checkpoint of the same generator and adds it to the same JSON and line);
- ``zero_to_fp32``: DeepSpeed's converter under ``ulimit -d`` of the limit, in a memory cgroup of the limit
  (with ``--cgroup``), and without a limit but in a cgroup of ``--z2f-limit-gib`` as a safety net (an OOM
  kill stays inside it): exit code, error, wall time, peak memory.

``--cgroup`` also runs each ckpt step in a memory cgroup of ``--limit-mib`` (v1 ``memory.limit_in_bytes`` or v2
``memory.max``; page cache included) when the machine allows one. Every output is deleted after its step;
the checkpoint at the end unless ``--keep``. Memory is sampled from /proc (``procmon``): RssAnon, VmRSS.
Writes the figures to ``--json`` (default ``.bench-work/results/scale.json``) and prints ONE markdown line.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from common import MIB, bytecode_as_installed, ckpt, zero_to_fp32  # noqa: E402
from procmon import drop_caches, du, run  # noqa: E402

import make_synthetic_checkpoint as synth  # noqa: E402

GB = 1e9
DROP = True  # drop the page cache before each timed run (--no-drop: a smoke run beside other benchmarks)
MODEL = dict(layers=11, hidden=4096, intermediate=11008, vocab=35000, heads=32, kv_heads=32)


# ============================================================================================ helpers
@contextlib.contextmanager
def bench_lock(path: Path):
    """Hold ``path`` as ``flock(1)`` does (the other benchmarks take the same lock)."""
    with open(path, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.perf_counter() - t0
        if waited > 1:
            print(f"  (waited {waited:.0f} s for {path})", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def limited(cmd: list, data_kib: int | None, cgroup: Path | None = None) -> list:
    """``cmd`` under ``ulimit -d data_kib`` (and in ``cgroup``), through bash, which then execs it."""
    pre = ""
    if cgroup is not None:
        pre += f"echo $$ > {cgroup}/cgroup.procs && "
    if data_kib is not None:
        pre += f"ulimit -d {data_kib} && "
    return ["bash", "-c", pre + 'exec "$@"', "bash", *map(str, cmd)]


def make_cgroup(limit: int, name: str = "ckpt") -> tuple[Path | None, str]:
    """A memory cgroup limited to ``limit`` bytes (page cache included; over it the kernel reclaims the
    cache, then OOM-kills inside the cgroup only), or None and why not."""
    base = Path("/sys/fs/cgroup")
    try:
        if (base / "memory").is_dir():  # v1
            cg = base / "memory" / f"ckptlib-scale-{name}-{os.getpid()}"
            cg.mkdir(exist_ok=True)
            (cg / "memory.limit_in_bytes").write_text(str(limit))
            return cg, "cgroup v1 memory.limit_in_bytes"
        if (base / "cgroup.controllers").is_file() and "memory" in (base / "cgroup.controllers").read_text():
            cg = base / f"ckptlib-scale-{name}-{os.getpid()}"
            cg.mkdir(exist_ok=True)
            (cg / "memory.max").write_text(str(limit))
            return cg, "cgroup v2 memory.max"
    except OSError as e:
        return None, f"no cgroup: {e}"
    return None, "no memory cgroup controller"


def cgroup_peak(cg: Path) -> int | None:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        with contextlib.suppress(OSError, ValueError):
            return int((cg / name).read_text())
    return None


def reset_cgroup_peak(cg: Path | None) -> None:
    if cg is not None:
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            with contextlib.suppress(OSError):
                (cg / name).write_text("0")


def cgroup_oom_kills(cg: Path) -> int | None:
    """OOM kills inside the cgroup so far (v1 memory.oom_control, v2 memory.events)."""
    for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
        with contextlib.suppress(OSError, ValueError):
            for ln in (cg / name).read_text().splitlines():
                k, _, v = ln.partition(" ")
                if k == key:
                    return int(v)
    return None


def remove_cgroup(cg: Path | None) -> None:
    if cg is not None:
        with contextlib.suppress(OSError):
            cg.rmdir()


def drop() -> bool:
    return drop_caches() if DROP else False


def timed(cmd: list, what: str, out: Path | None = None) -> dict:
    """Run ``cmd`` with the page cache dropped first; wall, I/O, memory, the output's size, the exit code."""
    dropped = drop()
    st = run(cmd, tree=True, interval=0.02)
    written = du(str(out)) if out is not None and out.exists() else 0
    res = {"what": what, "cmd": " ".join(map(str, cmd)), "returncode": st.returncode, "wall_s": round(st.wall, 2),
           "cpu_s": round(st.cpu, 1), "read_bytes": st.read_bytes, "rchar": st.rchar, "written_bytes": written,
           "read_MBps": round(st.read_bytes / st.wall / 1e6, 1), "write_MBps": round(written / st.wall / 1e6, 1),
           "peak_anon_bytes": st.peak_anon, "peak_rss_bytes": st.peak_rss, "cache_dropped": dropped,
           "stderr_tail": st.stderr.strip().splitlines()[-3:] if st.returncode else []}
    print(f"  {what}: exit {st.returncode}, {st.wall:.1f} s, read {st.read_bytes / GB:.2f} GB "
          f"({res['read_MBps']:.0f} MB/s), wrote {written / GB:.2f} GB ({res['write_MBps']:.0f} MB/s), "
          f"peak RssAnon {st.peak_anon / MIB:.0f} MiB, VmRSS {st.peak_rss / MIB:.0f} MiB", flush=True)
    if st.returncode:
        print("    " + "\n    ".join(res["stderr_tail"]), flush=True)
    return res


def rank_files(checkpoint: Path) -> list[Path]:
    tag = (checkpoint / "latest").read_text().strip()
    return sorted(p for p in (checkpoint / tag).iterdir() if p.is_file())


# ============================================================================================ steps
def step_dd(args, ck: Path, work: Path, out: dict) -> None:
    files = rank_files(ck)
    total = sum(f.stat().st_size for f in files)
    with bench_lock(args.lock):
        drop()
        t0 = time.perf_counter()
        for f in files:
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"], check=True)
        t_read = time.perf_counter() - t0
    size = args.dd_write_size or total
    room = free_bytes(work) - int(args.margin * GB)
    note = ""
    if size > room:
        size, note = max(room, 0) // (16 * MIB) * 16 * MIB, f"write size cut to {max(room, 0) / GB:.1f} GB to keep {args.margin:g} GB free"
    count = size // (16 * MIB)
    target = work / "dd-write.bin"
    writes = {}
    for how in ("conv=fdatasync", "oflag=direct") if count else ():  # through the cache and synced, or direct
        with bench_lock(args.lock):
            drop()
            t0 = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", how, "status=none"],
                           check=True)
            writes[how] = round(count * 16 * MIB / (time.perf_counter() - t0) / 1e6, 1)
            target.unlink()
    out["dd"] = {"read_bytes": total, "read_s": round(t_read, 2), "read_MBps": round(total / t_read / 1e6, 1),
                 "write_bytes": count * 16 * MIB, "write_MBps_each": writes, "write_MBps": max(writes.values(), default=0),
                 "note": note, "how": "dd iflag=direct bs=16M of every checkpoint file; dd if=/dev/zero bs=16M "
                                      "conv=fdatasync and oflag=direct, the faster taken as the disk's write rate"}
    print(f"  dd: read {total / GB:.1f} GB at {out['dd']['read_MBps']:.0f} MB/s, write {count * 16 * MIB / GB:.1f} GB "
          f"at {writes} MB/s {note}", flush=True)


def spot_check_export(export: Path, seed: int, ranks: int) -> dict:
    """Windows of 1,024 elements across every rank boundary (and the ends) of six tensors of the export,
    against the generator's own values (:func:`synth.param_bits`): no ckptlib code in the comparison."""
    import numpy as np
    from safetensors import safe_open

    params = synth.llama_params(**MODEL)
    index = {n: (i, s) for i, (n, s, _) in enumerate(params)}
    last = MODEL["layers"] - 1
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             f"model.layers.{last // 2}.mlp.down_proj.weight", f"model.layers.{last}.post_attention_layernorm.weight",
             "model.norm.weight", "lm_head.weight"]
    where = {}
    for f in sorted(export.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                where[k] = f
    checked = windows = 0
    for n in names:
        i, shape = index[n]
        numel = math.prod(shape)
        part, w = -(-numel // ranks), min(1024, numel)
        starts = sorted({0, numel - w, *(max(0, min(numel - w, r * part - w // 2)) for r in range(1, ranks))})
        with safe_open(str(where[n]), "np") as h:
            sl = h.get_slice(n)
            for a in starts:
                want = synth.param_bits(seed, i, synth.MASTER, a, w).view(np.float32)
                if len(shape) == 1:
                    got = sl[a:a + w]
                else:  # the rows holding the window
                    cols = shape[-1]
                    r0 = a // cols
                    got = sl[r0:(a + w - 1) // cols + 1].reshape(-1)[a - r0 * cols:a - r0 * cols + w]
                if got.dtype != np.float32 or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                    raise SystemExit(f"spot check: {n} elements {a}..{a + w - 1} differ from the generator's values")
                checked += w
                windows += 1
    return {"tensors": len(names), "windows": windows, "elements": checked, "ok": True}


def verify(cmd: list, what: str) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    res = {"cmd": " ".join(map(str, cmd)), "returncode": r.returncode, "ok": r.returncode == 0,
           "seconds": round(time.perf_counter() - t0, 1), "tail": (r.stdout + r.stderr).strip().splitlines()[-2:]}
    print(f"  {what}: {'OK' if res['ok'] else 'FAILED'} ({res['seconds']} s) {res['tail'][-1:] }", flush=True)
    return res


def step_export(args, ck: Path, work: Path, out: dict, cgroup) -> None:
    dest = work / "export"
    shutil.rmtree(dest, ignore_errors=True)
    runs = {}
    modes = [("ulimit", None)] + ([("cgroup", cgroup)] if cgroup is not None else [])
    for mode, cg in modes:
        with bench_lock(args.lock):
            reset_cgroup_peak(cg)
            cmd = limited(ckpt("export", ck, dest, "-q"), args.limit_mib * 1024, cg)
            res = timed(cmd, f"ckpt export ({mode})", dest)
            if cg is not None:
                res["cgroup_peak_bytes"] = cgroup_peak(cg)
        runs[mode] = res
        if res["returncode"] == 0 and mode == "ulimit":
            res["verify_diff"] = verify(ckpt("diff", ck, dest, "-q"), "ckpt diff checkpoint export")
            res["spot_check"] = spot_check_export(dest, args.seed, args.ranks)
            print(f"  spot check: {res['spot_check']}", flush=True)
        shutil.rmtree(dest, ignore_errors=True)
    out["export"] = runs


def step_reshard(args, ck: Path, work: Path, out: dict, cgroup) -> None:
    dest = work / "reshard"
    shutil.rmtree(dest, ignore_errors=True)
    need = du(str(ck)) + int(args.margin * GB)
    if free_bytes(work) < need:
        why = (f"skipped: the output ({du(str(ck)) / GB:.1f} GB) does not fit with {args.margin:g} GB left free "
               f"({free_bytes(work) / GB:.1f} GB free)")
        print(f"  reshard {why}", flush=True)
        out["reshard"] = {"skipped": why}
        return
    runs = {}
    modes = [("ulimit", None)] + ([("cgroup", cgroup)] if cgroup is not None else [])
    for mode, cg in modes:
        with bench_lock(args.lock):
            reset_cgroup_peak(cg)
            cmd = limited(ckpt("reshard", ck, dest, "--world-size", args.to_dp, "-q"), args.limit_mib * 1024, cg)
            res = timed(cmd, f"ckpt reshard {args.ranks}->{args.to_dp} ({mode})", dest)
            if cg is not None:
                res["cgroup_peak_bytes"] = cgroup_peak(cg)
        runs[mode] = res
        if res["returncode"] == 0 and mode == "ulimit":
            res["verify_diff"] = verify(ckpt("diff", ck, dest, "--states", "-q"), "ckpt diff --states checkpoint reshard")
        shutil.rmtree(dest, ignore_errors=True)
    out["reshard"] = runs


def step_zero_to_fp32(args, ck: Path, work: Path, out: dict) -> None:
    """DeepSpeed's converter under ``ulimit -d`` of the limit, in a memory cgroup of the limit (page cache
    included: its mmap of the rank files is allowed, what it keeps is not), and "without the limit": no
    ulimit, in a cgroup of ``--z2f-limit-gib`` only so that the machine keeps working (an OOM kill there is
    reported; ``ulimit -d`` cannot be that safety net: it counts the rank files' private mmaps, 30 GB)."""
    dest = work / "zero_to_fp32"
    runs = {}
    big = args.z2f_limit_gib * 2**30
    plans = [(f"ulimit -d {args.limit_mib} MiB", args.limit_mib * 1024, None)]
    cgs = []
    if args.cgroup:
        small_cg, _ = make_cgroup(args.limit_mib * MIB, "z2f-small")
        big_cg, how = make_cgroup(big, "z2f-big")
        cgs = [small_cg, big_cg]
        if small_cg is not None:
            plans.append((f"cgroup {args.limit_mib} MiB", None, small_cg))
        plans.append((f"no limit (cgroup {args.z2f_limit_gib} GiB as a safety net)", None, big_cg) if big_cg is not None
                     else (f"ulimit -d {args.z2f_limit_gib} GiB (no cgroup: {how})", big // 1024, None))
    else:
        plans.append((f"ulimit -d {args.z2f_limit_gib} GiB", big // 1024, None))
    try:
        for label, kib, cg in plans:
            shutil.rmtree(dest, ignore_errors=True)
            if free_bytes(work) < du(str(ck)) // 3 + int(args.margin * GB):
                runs[label] = {"skipped": f"{free_bytes(work) / GB:.1f} GB free: no room for its fp32 output"}
                continue
            with bench_lock(args.lock):
                reset_cgroup_peak(cg)
                kills = cgroup_oom_kills(cg) if cg is not None else None
                res = timed(limited(zero_to_fp32(ck, dest), kib, cg), f"zero_to_fp32, {label}", dest)
                if cg is not None:
                    res["cgroup_peak_bytes"] = cgroup_peak(cg)
                    after = cgroup_oom_kills(cg)
                    res["cgroup_oom_kills"] = (after - kills) if after is not None and kills is not None else None
            err = [ln for ln in res["stderr_tail"] if ln.strip()]
            res["outcome"] = ("ok" if res["returncode"] == 0 else
                              "OOM-killed in its cgroup" if res.get("cgroup_oom_kills") else
                              "killed (signal %d)" % -res["returncode"] if res["returncode"] < 0 else
                              (err[-1][:300] if err else f"exit {res['returncode']}"))
            runs[label] = res
            shutil.rmtree(dest, ignore_errors=True)
    finally:
        for cg in cgs:
            remove_cgroup(cg)
    out["zero_to_fp32"] = runs


# ============================================================================================ report
def line(out: dict) -> str:
    """The one markdown line of the benchmarks page."""
    c, d = out["checkpoint"], out.get("dd", {})
    lim = f"{out['limit_mib']} MiB"
    parts = [f"**{c['bytes'] / GB:.1f} GB ZeRO-3 bf16** ({c['parameters'] / 1e9:.2f} B params, dp {c['ranks']}, "
             f"synthetic, {c['bytes'] / out['machine']['ram_bytes']:.1f}x RAM), `ulimit -d` {lim}, "
             + ("page cache dropped before each run:" if DROP else "page cache NOT dropped:")]

    def vs(rate, anchor):
        return f" ({rate / anchor:.2f}x dd)" if anchor else ""

    for tool in ("export", "reshard"):
        r, where = out.get(tool, {}), ""
        if not r.get("ulimit"):  # not run on this checkpoint: on a smaller one of the same generator (--extend)?
            for extra in out.get("extra_runs", []):
                if (extra.get(tool) or {}).get("ulimit"):
                    e = extra["checkpoint"]
                    r, where = extra[tool], (f" on a {e['bytes'] / GB:.1f} GB checkpoint of the same generator "
                                             f"({e['parameters'] / 1e9:.2f} B params, dp {e['ranks']}, "
                                             f"{e['bytes'] / out['machine']['ram_bytes']:.2f}x RAM; {extra[tool].get('skip_note', '')})")
                    break
        if "skipped" in r:
            parts.append(f"{tool} not run ({r['skipped']});")
            continue
        u = r.get("ulimit")
        if not u:
            continue
        ok = "verified" if (u.get("verify_diff") or {}).get("ok") else "NOT verified"
        floor = ((u["read_bytes"] / (d["read_MBps"] * 1e6) + u["written_bytes"] / (d["write_MBps"] * 1e6))
                 if d.get("read_MBps") and d.get("write_MBps") else 0)
        u["dd_floor_s"] = round(floor, 1)
        cg = (r.get("cgroup") or {})
        cgs = (f", {cg['wall_s']:.0f} s in a {lim} memory cgroup (page cache included)" if cg.get("returncode") == 0
               else f", exit {cg['returncode']} in a {lim} memory cgroup" if cg else "")
        parts.append(f"`ckpt {tool}`{where} {u['wall_s']:.0f} s"
                     + (f" ({u['wall_s'] / floor:.2f}x dd's {floor:.0f} s for the same bytes)" if floor else "")
                     + f", read {u['read_bytes'] / GB:.1f} GB at {u['read_MBps']:.0f} MB/s{vs(u['read_MBps'], d.get('read_MBps'))}, "
                     f"wrote {u['written_bytes'] / GB:.1f} GB at {u['write_MBps']:.0f} MB/s{vs(u['write_MBps'], d.get('write_MBps'))}, "
                     f"peak {u['peak_anon_bytes'] / MIB:.0f} MiB RssAnon{cgs}, {ok};")
    z = out.get("zero_to_fp32")
    if z:
        bits = []
        for label, r in z.items():
            if "skipped" in r:
                bits.append(f"{label}: not run ({r['skipped']})")
            elif r["returncode"] == 0:
                bits.append(f"{label}: ok in {r['wall_s']:.0f} s, peak {r['peak_anon_bytes'] / 2**30:.1f} GiB RssAnon, "
                            f"{r['peak_rss_bytes'] / 2**30:.1f} GiB RSS")
            else:
                bits.append(f"{label}: fails after {r['wall_s']:.0f} s at {r['peak_anon_bytes'] / 2**30:.1f} GiB RssAnon "
                            f"({r['outcome'][:110]})")
        parts.append("`zero_to_fp32` " + "; ".join(bits) + ".")
    if d:
        parts.append(f"dd: read {d['read_MBps']:.0f} MB/s, write {d['write_MBps']:.0f} MB/s.")
    return " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=REPO / ".bench-work" / "scale" / "z3_bf16_30g")
    ap.add_argument("--make", action="store_true", help="write the checkpoint first (replaced if it exists)")
    ap.add_argument("--ranks", type=int, default=8, help="the checkpoint's data-parallel size (with --make)")
    for k, v in MODEL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v, help=f"the model's {k} (default {v})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--to-dp", type=int, default=6, help="the reshard's new data-parallel size")
    ap.add_argument("--steps", default="dd,export,reshard,zero_to_fp32")
    ap.add_argument("--limit-mib", type=int, default=512, help="ulimit -d of every ckpt run and of zero_to_fp32's first")
    ap.add_argument("--z2f-limit-gib", type=int, default=20, help="zero_to_fp32's safety limit (ulimit -d)")
    ap.add_argument("--cgroup", action="store_true", help="also run each ckpt step in a memory cgroup of --limit-mib")
    ap.add_argument("--dd-write-size", type=float, default=None, help="GB (default: the checkpoint's size)")
    ap.add_argument("--margin", type=float, default=10.0, help="GB of disk to keep free")
    ap.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"))
    ap.add_argument("--no-drop", action="store_true", help="leave the page cache (a smoke run; the figures mean little)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint at the end")
    ap.add_argument("--json", type=Path, default=REPO / ".bench-work" / "results" / "scale.json")
    ap.add_argument("--extend", default=None, metavar="WHY",
                    help="add this run to the --json file's extra_runs (e.g. a reshard on a smaller checkpoint when "
                         "the disk cannot hold the big one's output; WHY says so in the line) instead of replacing it")
    args = ap.parse_args(argv)
    global DROP
    DROP = not args.no_drop
    if args.dd_write_size:
        args.dd_write_size = int(args.dd_write_size * GB)
    MODEL.update({k: getattr(args, k) for k in MODEL})
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    ck = args.checkpoint.resolve()
    work = ck.parent / "work"
    work.mkdir(parents=True, exist_ok=True)
    bytecode_as_installed()
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "limit_mib": args.limit_mib, "steps": steps,
                 "machine": {"ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                             "cores": os.cpu_count(), "python": platform.python_version(),
                             "free_disk_bytes_at_start": free_bytes(work)}}
    if args.make:
        with bench_lock(args.lock):
            print(f"making {ck} ...", flush=True)
            made = synth.make(ck, 3, args.ranks, 1000, "random", args.seed, **MODEL)
        out["make"] = {k: made[k] for k in ("seconds", "apparent_bytes", "allocated_bytes", "files")}
        print(f"  made {made['apparent_bytes'] / GB:.1f} GB in {made['seconds']:.0f} s", flush=True)
    params = synth.llama_params(**MODEL)
    out["checkpoint"] = {"path": str(ck), "bytes": du(str(ck)), "files": len(rank_files(ck)), "ranks": args.ranks,
                         "parameters": sum(math.prod(s) for _, s, _ in params), "tensors": len(params),
                         "model": dict(MODEL), "seed": args.seed, "generator": "bench/make_synthetic_checkpoint.py --fill random"}
    cg, cg_how = make_cgroup(args.limit_mib * MIB) if args.cgroup else (None, "not asked")
    out["cgroup"] = cg_how
    print(f"checkpoint {ck}: {out['checkpoint']['bytes'] / GB:.1f} GB in {out['checkpoint']['files']} files, "
          f"RAM {out['machine']['ram_bytes'] / GB:.1f} GB, {free_bytes(work) / GB:.1f} GB free; cgroup: {cg_how}", flush=True)
    try:
        for s in steps:
            print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True)
            if s == "dd":
                step_dd(args, ck, work, out)
            elif s == "export":
                step_export(args, ck, work, out, cg)
            elif s == "reshard":
                step_reshard(args, ck, work, out, cg)
            elif s == "zero_to_fp32":
                step_zero_to_fp32(args, ck, work, out)
            else:
                raise SystemExit(f"unknown step {s!r}")
            args.json.parent.mkdir(parents=True, exist_ok=True)
            partial = args.json.with_suffix(".partial.json") if args.extend else args.json
            partial.write_text(json.dumps(out, indent=1, default=str))  # after every step: partial results survive
    finally:
        remove_cgroup(cg)
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(ck, ignore_errors=True)
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.extend:
        for tool in ("export", "reshard"):
            if isinstance(out.get(tool), dict):
                out[tool]["skip_note"] = args.extend
        base = json.loads(args.json.read_text()) if args.json.is_file() else dict(out, extra_runs=[])
        base.setdefault("extra_runs", []).append(out)
        out = base
    out["markdown"] = line(out)
    args.json.write_text(json.dumps(out, indent=1, default=str))
    print()
    print(out["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
