"""Every conversion beside the machine's copy floor and beside DeepSpeed's tool, in one run.

    python bench/floor_bench.py .bench-work/z2_bf16_w4 .bench-work/z3_bf16_w4 --rounds 3
    python bench/floor_bench.py CKPT --only export "reshard 4->2"      # some conversions only

The floor of a conversion is a plain ``cp -r OUT COPY && sync`` of the very output it wrote: the time this
machine takes to read those bytes and put them on disk. Everything runs with a warm page cache (its inputs
read once just before, outstanding writes synced untimed), alternating: per round and checkpoint, DeepSpeed's
tools once each, then every conversion followed by the copy of its output. A conversion is within the goal
when its median is at most 1.5 times its floor's. ``check`` and ``diff`` write nothing: their rows give the
read rate (bytes through read/pread/copy_file_range per second, after the import baseline's start-up)
beside export's in the same run.

To add a conversion (the DCP export, a mesh reshard), append one :class:`Conversion` to :data:`CONVERSIONS`:
its label, the ckptlib arguments as a function of ``(checkpoint, out, info)`` (``info``: the checkpoint's
``dp``/``tp``/``pp`` sizes), the key of DeepSpeed's tool in :data:`ANCHORS` (or None), and ``applies`` to
run it only on checkpoints it fits; the table gets its row.
"""
from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (PY, baseline, before_env, bytecode_as_installed, check_ok, ckpt, ds_to_universal, mib, parser, table,  # noqa: E402
                    work_folder, write_json, zero_to_fp32)
from dcp_bench import HAND as HAND_DCP  # noqa: E402
from procmon import run, warm_cache  # noqa: E402

HERE = Path(__file__).resolve().parent
GOAL = 1.5


@dataclass
class Conversion:
    label: str
    args: Callable          # (checkpoint, out, info) -> ckpt arguments
    anchor: Optional[str]   # key of ANCHORS, or None
    writes: bool = True     # False: a read-only command (check, diff): no copy floor, a read rate instead
    applies: Callable = lambda info: True


@dataclass
class Anchor:
    label: str
    command: Callable       # (checkpoint, out, exported) -> command
    ok_codes: tuple = (0,)


ANCHORS = {
    "zero_to_fp32": Anchor("zero_to_fp32.py --safe_serialization", lambda c, o, e: zero_to_fp32(c, o)),
    "ds_to_universal": Anchor("ds_to_universal", lambda c, o, e: ds_to_universal(c, o)),
    "ds-check": Anchor("get_fp32_state_dict_from_zero_checkpoint + torch statistics",
                       lambda c, o, e: [PY, str(HERE / "ds_check_diff.py"), "check", str(c)]),
    "dcp-hand": Anchor("get_fp32_state_dict_from_zero_checkpoint + dcp.save (model only)",
                       lambda c, o, e: [PY, "-P", "-c", HAND_DCP, str(c), str(o / "dcp")]),
    "ds-diff": Anchor("get_fp32_state_dict_from_zero_checkpoint + torch.equal with the export",
                      lambda c, o, e: [PY, str(HERE / "ds_check_diff.py"), "diff", str(c), str(e)]),
}

#: the first conversion's output is what diff compares with (an fp32 safetensors export)
CONVERSIONS = [
    Conversion("export", lambda c, o, i: ["export", c, o], "zero_to_fp32"),
    Conversion("export --format torch", lambda c, o, i: ["export", c, o, "--format", "torch"], "zero_to_fp32"),
    Conversion("export --dtype bf16", lambda c, o, i: ["export", c, o, "--dtype", "bf16"], "zero_to_fp32"),
    Conversion("export --format dcp", lambda c, o, i: ["export", c, o, "--format", "dcp"], "dcp-hand"),
    Conversion("export --format dcp --optimizer", lambda c, o, i: ["export", c, o, "--format", "dcp", "--optimizer"],
               "dcp-hand"),
    Conversion("reshard dp/2", lambda c, o, i: ["reshard", c, o, "--world-size", i["dp"] // 2], "ds_to_universal",
               applies=lambda i: i["dp"] >= 2),
    Conversion("reshard dp*3/4", lambda c, o, i: ["reshard", c, o, "--world-size", i["dp"] * 3 // 4], "ds_to_universal",
               applies=lambda i: i["dp"] >= 4),
    Conversion("reshard --universal", lambda c, o, i: ["reshard", c, o, "--universal"], "ds_to_universal"),
    Conversion("reshard --tp 1", lambda c, o, i: ["reshard", c, o, "--tp", 1], "ds_to_universal",
               applies=lambda i: i["tp"] == 2),
    Conversion("reshard --pp 1", lambda c, o, i: ["reshard", c, o, "--pp", 1], "ds_to_universal",
               applies=lambda i: i["pp"] == 2),
    Conversion("reshard --tp 1 --pp 1", lambda c, o, i: ["reshard", c, o, "--tp", 1, "--pp", 1], "ds_to_universal",
               applies=lambda i: i["tp"] == 2 and i["pp"] == 2),
    Conversion("check", lambda c, o, i: ["check", c], "ds-check", writes=False),
    Conversion("check --states", lambda c, o, i: ["check", c, "--states"], None, writes=False),
    Conversion("diff CKPT EXPORT", lambda c, o, i: ["diff", c, o.parent / "export"], "ds-diff", writes=False),
]


def info_of(checkpoint: Path) -> dict:
    import ckptlib

    with ckptlib.open_checkpoint(checkpoint) as ck:
        mesh = ck.mesh
        return {"dp": ck.dp_world_size, "tp": getattr(mesh, "tp", 1), "pp": getattr(mesh, "pp", 1)}


def label(conv: Conversion, info: dict) -> str:
    if conv.label == "reshard dp/2":
        return f"reshard {info['dp']}->{info['dp'] // 2}"
    if conv.label == "reshard dp*3/4":
        return f"reshard {info['dp']}->{info['dp'] * 3 // 4}"
    return conv.label


def settle(*warm) -> None:
    """Before a timed run: outstanding writes on disk, then ``warm`` read into the page cache."""
    subprocess.run(["sync"], check=True)
    warm_cache(*warm)


def copy_floor(out: Path, copy: Path):
    """``cp -r out copy && sync``, timed, with ``out`` in the page cache."""
    shutil.rmtree(copy, ignore_errors=True)
    settle(out)
    return check_ok(run(["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", str(out), str(copy)]), f"cp -r {out}")


def _error_line(stderr: str) -> str:
    """The exception line of a traceback (else the last line), shortened."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return ((errors or lines or ["?"])[-1])[:100]


def measure(checkpoints: list, convs: list, rounds: int, work: Path, before: Optional[Path] = None,
            no_anchors: bool = False, env_before: Optional[dict] = None) -> tuple[list, dict]:
    """The run: per checkpoint and round, the import baselines, every conversion of ``convs`` that applies (each
    followed by its copy floor; and again from ``before``'s tree when given), then DeepSpeed's tools.

    Returns ``(results, baselines)``: per checkpoint ``{"checkpoint": Path, "info": sizes, "convs": [...]}``,
    each conversion ``{"conv": Conversion, "label", "runs": [RunStats], "floors": [RunStats], "before": [...],
    "anchor": Anchor key or None, "ds": [RunStats or None], "failed": error line or None, "out_bytes"}``;
    ``baselines``: ``{"export"|"analysis": [RunStats]}`` (a process that only imports, per round)."""
    base = {k: [] for k in ("export", "analysis")}
    results = []
    for checkpoint in checkpoints:
        info = info_of(checkpoint)
        mine = [c for c in convs if c.applies(info)]
        anchors = [] if no_anchors else sorted({c.anchor for c in mine if c.anchor})
        res = {c.label: [] for c in mine}
        befores = {c.label: [] for c in mine}  # the same conversions from --before SRC
        floors = {c.label: [] for c in mine if c.writes}
        ds = {a: [] for a in anchors}
        failed = {}
        out_bytes = {}
        source = checkpoint / (checkpoint / "latest").read_text().strip()
        for r in range(rounds):
            for k in base:
                settle()
                base[k].append(baseline(k, sleep=0))
            for c in mine:  # ckptlib first: diff compares with this round's export
                out = work / f"{checkpoint.name}" / c.label.replace(" ", "_").replace("/", "_")
                if c.label == "export":
                    out = work / checkpoint.name / "export"
                shutil.rmtree(out, ignore_errors=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                settle(source)
                st = check_ok(run(ckpt(*c.args(checkpoint, out, info), "-q")), f"ckpt {c.label}", (0,))
                res[c.label].append(st)
                note = ""
                if c.writes:
                    fl = copy_floor(out, work / "floor-copy")
                    floors[c.label].append(fl)
                    out_bytes[c.label] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
                    note = f", floor {fl.wall:.2f} s (CPU {fl.cpu:.2f} s; {st.wall / fl.wall:.2f}x)"
                    shutil.rmtree(work / "floor-copy", ignore_errors=True)
                    if c.label != "export":
                        shutil.rmtree(out, ignore_errors=True)
                print(f"  {checkpoint.name} round {r + 1} ckpt {label(c, info)}: {st.wall:.2f} s (CPU {st.cpu:.2f} s)"
                      f"{note}, "
                      f"read {mib(st.rchar)}", flush=True)
                if before:  # right after, into the same output folder (diff reads this round's export)
                    shutil.rmtree(out, ignore_errors=True)
                    settle(source)
                    sb = check_ok(run(ckpt(*c.args(checkpoint, out, info), "-q"), env=env_before),
                                  f"ckpt {c.label} (before)", (0,))
                    befores[c.label].append(sb)
                    if c.writes and c.label != "export":
                        shutil.rmtree(out, ignore_errors=True)
                    print(f"  {checkpoint.name} round {r + 1} ckpt {label(c, info)} (before): {sb.wall:.2f} s"
                          f" (CPU {sb.cpu:.2f} s)", flush=True)
            exported = work / checkpoint.name / "export"
            for a in anchors:
                out = work / checkpoint.name / f"ds-{a}"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir(parents=True)
                settle(source)
                st = run(ANCHORS[a].command(checkpoint, out, exported), tree=True)
                shutil.rmtree(out, ignore_errors=True)
                if st.returncode not in ANCHORS[a].ok_codes:  # DeepSpeed's tool fails on this checkpoint
                    ds[a].append(None)
                    failed[a] = _error_line(st.stderr)
                    print(f"  {checkpoint.name} round {r + 1} {ANCHORS[a].label}: FAILED: {failed[a]}", flush=True)
                    continue
                ds[a].append(st)
                print(f"  {checkpoint.name} round {r + 1} {ANCHORS[a].label}: {st.wall:.2f} s", flush=True)
            shutil.rmtree(work / checkpoint.name / "export", ignore_errors=True)
        results.append({"checkpoint": checkpoint, "info": info, "convs": [
            {"conv": c, "label": label(c, info), "runs": res[c.label], "floors": floors.get(c.label, []),
             "before": befores[c.label], "anchor": c.anchor if c.anchor in ds else None,
             "ds": ds.get(c.anchor, []), "failed": failed.get(c.anchor), "out_bytes": out_bytes.get(c.label)}
            for c in mine]})
    return results, base


def med(runs: list, key: str = "wall") -> float:
    """The median of ``key`` over ``runs`` (RunStats)."""
    return statistics.median(getattr(s, key) for s in runs)


def figures(result: dict, base: dict) -> list[dict]:
    """The medians of one checkpoint's conversions (``result``: an item of :func:`measure`'s results): per
    conversion ``label``, ``writes``, ``wall``, ``cpu``, ``out_bytes``, ``floor`` (None for read-only
    commands), ``anchor`` (its label, or None), ``ds_wall`` (None when not run or failed), ``failed`` (the
    tool's error line), ``peak`` and ``ds_peak`` (largest peak RssAnon over the rounds, the tool's over its
    process tree), ``rate`` (bytes read per second after start-up: read/pread/copy_file_range bytes and wall
    time, both less the import baseline's), ``startup`` (the import baseline's wall time), ``before``."""
    b_an = {k: (med(v), med(v, "rchar")) for k, v in base.items()}
    out = []
    for c in result["convs"]:
        runs, conv = c["runs"], c["conv"]
        wall = med(runs)
        bw, br = b_an["export" if conv.writes else "analysis"]
        done = [s for s in c["ds"] if s is not None]
        out.append({"label": c["label"], "writes": conv.writes, "wall": wall, "cpu": med(runs, "cpu"),
                    "out_bytes": c["out_bytes"], "floor": med(c["floors"]) if c["floors"] else None,
                    "anchor_key": conv.anchor, "anchor": ANCHORS[conv.anchor].label if conv.anchor else None,
                    "ran_anchor": c["anchor"] is not None, "failed": c["failed"],
                    "ds_wall": med(done) if done and not c["failed"] else None,
                    "peak": max(s.peak_anon for s in runs), "ds_peak": max(s.peak_anon for s in done) if done else None,
                    "rate": (med(runs, "rchar") - br) / max(wall - bw, 1e-3), "startup": bw,
                    "before": {"wall": med(c["before"]), "cpu": med(c["before"], "cpu")} if c["before"] else None})
    return out


def rows(name: str, figs: list[dict], before: Optional[Path] = None) -> list[list]:
    """The rows of this script's table for one checkpoint's :func:`figures`."""
    out = []
    export_rate = next((f["rate"] for f in figs if f["label"] == "export"), None)
    for f in figs:
        vs_ds = ""
        if f["anchor"] is None or not f["ran_anchor"]:
            anchor = "none" if f["anchor"] is None else "not run"
        elif f["failed"]:
            anchor = f"{f['anchor']}: fails ({f['failed']})"
        else:
            anchor = f"{f['anchor']}: {f['ds_wall']:.2f} s"
            vs_ds = f"{f['wall'] / f['ds_wall']:.2f}x"
        peak = mib(f["peak"]) + (f" / {mib(f['ds_peak'])}" if f["ds_peak"] else "")
        if f["writes"]:
            verdict = "yes" if f["wall"] <= GOAL * f["floor"] else "**no**"
            out.append([name, f["label"], f"{f['wall']:.2f} s", f"{f['cpu']:.2f} s", mib(f["out_bytes"]),
                        f"{f['floor']:.2f} s", f"**{f['wall'] / f['floor']:.2f}x**", verdict, anchor, vs_ds,
                        f"{f['rate'] / 2**20:.0f} MiB/s", peak])
        else:
            vs = f" ({f['rate'] / export_rate:.2f}x export's)" if export_rate else ""
            out.append([name, f["label"], f"{f['wall']:.2f} s", f"{f['cpu']:.2f} s", "", "", "", "", anchor, vs_ds,
                        f"{f['rate'] / 2**20:.0f} MiB/s{vs}", peak])
    for f in figs:
        if f["before"]:
            ratio = f"**{f['before']['wall'] / f['floor']:.2f}x**" if f["writes"] else ""
            out.append([name, f"{f['label']} (before: {before})", f"{f['before']['wall']:.2f} s",
                        f"{f['before']['cpu']:.2f} s", "", "", ratio, "", "", "", "", ""])
    return out


def select(only: Optional[list]) -> list:
    """The conversions ``--only`` names: a label picks itself; another word picks the conversions it starts."""
    labels = {c.label for c in CONVERSIONS}
    return [c for c in CONVERSIONS if not only or c.label in only
            or (c.label.split()[0] in only and c.label.split()[0] not in labels)]


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", help="labels of the conversions to run (default: all)")
    ap.add_argument("--no-anchors", action="store_true", help="leave out DeepSpeed's tools (ckpt and floors only)")
    args = ap.parse_args()
    bytecode_as_installed(args.before)
    with work_folder(args, "ckptlib-floor-") as work:
        results, base = measure(args.checkpoints, select(args.only), args.rounds, work, before=args.before,
                                no_anchors=args.no_anchors, env_before=before_env(args))
    lines, raw = [], {}
    for result in results:
        name = result["checkpoint"].name
        rws = rows(name, figures(result, base), args.before)
        lines += rws
        raw[name] = {"info": result["info"], "rows": rws}
    print()
    print("import baselines (median): " + ", ".join(f"{k} {statistics.median(s.wall for s in v):.2f} s"
                                                     for k, v in base.items()))
    print(table(["checkpoint", "conversion", "ckpt (median)", "ckpt CPU user+sys", "output", "copy floor: cp -r + sync (median)",
                 "ckpt / floor", f"within {GOAL}x", "DeepSpeed's tool (median)", "ckpt / DeepSpeed",
                 "read rate after start-up", "peak RssAnon: ckpt / DeepSpeed's tool"], lines))
    write_json(args, raw)
    return 0 if all(r[7] != "**no**" for r in lines) else 1  # the (before) rows have no verdict


if __name__ == "__main__":
    sys.exit(main())
