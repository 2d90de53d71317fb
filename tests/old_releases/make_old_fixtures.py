"""Make the committed old-release fixtures: real checkpoints written by DeepSpeed 0.10.3 ... 0.16.9.

Run by hand (or in a slow job), NOT in CI; CI only reads the committed result (tests/test_old_releases.py):

    python tests/old_releases/make_old_fixtures.py                 # every release in releases.py
    python tests/old_releases/make_old_fixtures.py 0.12.6 0.16.9   # some
    options: --venv-root DIR (default $CKPTLIB_OLD_DS_ROOT or /tmp/ckptlib-old-releases)
             --keep-staging   keep the raw launch output (with the zero_to_fp32.py copies)
             --skip-install   use the venvs as they are (fail if a version differs from the pins)

For each release it

1. makes a throw-away venv ``<venv-root>/venv-<version>``: ``pip install torch==2.13.0`` (the local CPU
   wheel), then ``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==<version> <pins>`` with a
   constraint that keeps torch at 2.13.0 (never another torch);
2. launches ``torchrun --standalone --nproc_per_node W tests/old_releases/old_generate.py`` in that venv
   for W = 2 and 3 (the configurations of old_generate.CONFIGS for W), which trains FixtureNet two steps
   with the release's own engine and saves, gathering the reference (fp32 masters, Adam moments, step,
   frozen 16-bit weights, buffers) from the live engine, checked against the 16-bit weights;
3. copies each checkpoint (without the zero_to_fp32.py copy, which nothing here needs), its
   ``reference.pt`` and ``fixture.json`` into ``tests/data/old_releases/<version>/<config>/`` and writes
   ``tests/data/old_releases/<version>/manifest.json``: the exact versions (deepspeed, torch, numpy,
   pydantic, python), pins, patches, commands and timings.

Nothing is written under tests/data until a release's launches all succeeded; its old folder is then
replaced as a whole.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from tests.old_releases.releases import LAUNCH_ENV, RELEASES, TORCH  # noqa: E402

DATA = REPO / "tests" / "data" / "old_releases"
GENERATOR = HERE / "old_generate.py"
WORLDS = (2, 3)
LAUNCH_TIMEOUT = 1200  # seconds per torchrun launch (normal: 30-90 s)
DROP = {"zero_to_fp32.py"}  # copies of the release's converter: 30-40 KB each, not needed by any test


def log(msg: str) -> None:
    print(f"[make_old_fixtures {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list, env: dict | None = None, log_file: Path | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    shown = " ".join(str(c) for c in cmd)
    log(f"$ {shown}")
    if log_file is None:
        subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, check=True)
    else:
        with open(log_file, "w") as fh:
            fh.write(f"# {shown}\n")
            fh.flush()
            try:
                r = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                   timeout=LAUNCH_TIMEOUT)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"timed out after {LAUNCH_TIMEOUT}s: {shown}\nlog {log_file}") from None
        if r.returncode != 0:
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
            raise SystemExit(f"command failed (exit {r.returncode}): {shown}\nlog {log_file}:\n{tail}")
    return time.perf_counter() - t0


def installed(py: Path) -> dict:
    code = ("import json, importlib.metadata as m, sys\n"
            "out = {'python': sys.version.split()[0]}\n"
            "for p in ('deepspeed', 'torch', 'numpy', 'pydantic', 'pydantic-core', 'py-cpuinfo', 'hjson',"
            " 'psutil', 'ninja', 'packaging', 'setuptools'):\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: out[p] = None\n"
            "print(json.dumps(out))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def pin_of(pins: list, name: str) -> str | None:
    for p in pins:
        if p.split("==")[0].strip().lower() == name:
            return p.split("==")[1].strip() if "==" in p else None
    return None


def check_versions(version: str, got: dict) -> list:
    spec = RELEASES[version]
    bad = []
    if got.get("deepspeed") != version:
        bad.append(f"deepspeed {got.get('deepspeed')} != {version}")
    if (got.get("torch") or "").split("+")[0] != TORCH:
        bad.append(f"torch {got.get('torch')} != {TORCH}")
    for name in ("numpy", "pydantic"):
        want = pin_of(spec["pins"], name)
        if want and got.get(name) != want:
            bad.append(f"{name} {got.get(name)} != {want}")
    return bad


def install_commands(version: str) -> list:
    """The commands that make a release's venv (as recorded in its manifest)."""
    return [f"python3.11 -m venv venv-{version}",
            f"venv-{version}/bin/python -m pip install torch=={TORCH} wheel",
            f"DS_BUILD_OPS=0 venv-{version}/bin/python -m pip install --no-build-isolation -c constraints-torch.txt "
            f"deepspeed=={version} {' '.join(RELEASES[version]['pins'])}".rstrip() + f"   # constraints: torch=={TORCH}"]


def make_venv(version: str, root: Path, skip_install: bool, fresh: bool = False) -> tuple[Path, dict, list]:
    venv = root / f"venv-{version}"
    py = venv / "bin" / "python"
    commands, timings = [], {}
    record = venv / "ckptlib-install.json"
    if fresh and not skip_install:
        shutil.rmtree(venv, ignore_errors=True)
    if not skip_install:
        if not py.exists():
            cmd = [sys.executable, "-m", "venv", venv]
            timings["venv"] = round(run(cmd), 1)
            commands.append(" ".join(map(str, cmd)))
        pip = [py, "-m", "pip", "--disable-pip-version-check", "-q"]
        constraints = root / "constraints-torch.txt"
        constraints.write_text(f"torch=={TORCH}\n")
        cur = installed(py)
        if (cur.get("torch") or "").split("+")[0] != TORCH:
            cmd = pip + ["install", f"torch=={TORCH}", "wheel"]
            timings["torch"] = round(run(cmd), 1)
            commands.append(" ".join(map(str, cmd[2:])))
        if check_versions(version, cur) or not cur.get("deepspeed"):
            env = dict(os.environ, DS_BUILD_OPS="0")
            cmd = pip + ["install", "--no-build-isolation", "-c", constraints, f"deepspeed=={version}",
                         *RELEASES[version]["pins"]]
            timings["deepspeed"] = round(run(cmd, env=env), 1)
            commands.append("DS_BUILD_OPS=0 " + " ".join(map(str, cmd[2:])))
    if timings:
        record.write_text(json.dumps({"install_seconds": timings, "commands": commands}, indent=1))
    elif record.is_file():  # made earlier by this script: report that install
        timings = json.loads(record.read_text()).get("install_seconds", {})
    got = installed(py)
    bad = check_versions(version, got)
    if bad:
        raise SystemExit(f"venv {venv}: {'; '.join(bad)}")
    return py, {"installed": got, "install_seconds": timings}, commands


def generate(version: str, py: Path, stage_dir: Path) -> dict:
    spec = RELEASES[version]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(LAUNCH_ENV)
    env["PYTHONPATH"] = str(REPO)
    env["CKPTLIB_DS_PATCHES"] = ",".join(spec["patches"])
    env["CKPTLIB_DS_NO_GRAD_STEP"] = "1" if spec["no_grad_step"] else "0"
    env["PYTHONUNBUFFERED"] = "1"
    out = {}
    for w in WORLDS:
        log_file = stage_dir / f"launch-w{w}.log"
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc_per_node", str(w),
               GENERATOR, "--out", stage_dir]
        secs = run(cmd, env=env, log_file=log_file, cwd=REPO)
        out[f"w{w}"] = {"seconds": round(secs, 1),
                        "command": ("DS_ACCELERATOR=cpu LOCAL_SIZE=1 OMP_NUM_THREADS=1 "
                                    f"CKPTLIB_DS_PATCHES={env['CKPTLIB_DS_PATCHES']} "
                                    f"CKPTLIB_DS_NO_GRAD_STEP={env['CKPTLIB_DS_NO_GRAD_STEP']} "
                                    f"PYTHONPATH=. venv-{version}/bin/python -m torch.distributed.run --standalone "
                                    f"--nnodes 1 --nproc_per_node {w} tests/old_releases/old_generate.py --out STAGING")}
        log(f"{version} w{w}: {secs:.1f}s")
    return out


def collect(version: str, stage_dir: Path, info: dict) -> Path:
    """Copy the fixtures (minus DROP) into tests/data/old_releases/<version>/, atomically per release."""
    configs = sorted(p.name for p in stage_dir.iterdir() if (p / "fixture.json").is_file())
    if not configs:
        raise SystemExit(f"{stage_dir}: no fixtures were made")
    tmp = DATA / f".{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dropped = {}
    for name in configs:
        src = stage_dir / name
        meta = json.loads((src / "fixture.json").read_text())
        for p in sorted(src.rglob("*")):
            rel = p.relative_to(src)
            if p.is_dir():
                continue
            if p.name in DROP:
                dropped[f"{name}/{rel}"] = p.stat().st_size
                continue
            dst = tmp / name / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dst)
        meta["extras"]["files"] = [f for f in meta["extras"]["files"] if Path(f).name not in DROP]
        (tmp / name / "fixture.json").write_text(json.dumps(meta, indent=1))
    manifest = {
        "deepspeed": info["installed"]["deepspeed"],
        "torch": info["installed"]["torch"],
        "numpy": info["installed"]["numpy"],
        "pydantic": info["installed"]["pydantic"],
        "python": info["installed"]["python"],
        "installed": info["installed"],
        "pins": RELEASES[version]["pins"],
        "patches": RELEASES[version]["patches"],
        "no_grad_step": RELEASES[version]["no_grad_step"],
        "launch_env": LAUNCH_ENV,
        "install_commands": install_commands(version),
        "install_seconds": info["install_seconds"],
        "launches": info["launches"],
        "configs": configs,
        "dropped_files": dropped,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "made_by": "tests/old_releases/make_old_fixtures.py",
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    final = DATA / version
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("versions", nargs="*", default=list(RELEASES))
    ap.add_argument("--venv-root", type=Path,
                    default=Path(os.environ.get("CKPTLIB_OLD_DS_ROOT", "/tmp/ckptlib-old-releases")))
    ap.add_argument("--keep-staging", action="store_true")
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--install-only", action="store_true", help="make the venvs, generate nothing")
    ap.add_argument("--fresh", action="store_true", help="delete and remake the venvs first")
    args = ap.parse_args(argv)
    unknown = [v for v in args.versions if v not in RELEASES]
    if unknown:
        raise SystemExit(f"unknown releases {unknown}; known: {list(RELEASES)}")
    args.venv_root.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for version in args.versions:
        t0 = time.perf_counter()
        py, info, commands = make_venv(version, args.venv_root, args.skip_install, args.fresh)
        info["commands"] = commands
        log(f"{version}: venv ready ({info['installed']})")
        if args.install_only:
            continue
        stage = args.venv_root / f"staging-{version}"
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        info["launches"] = generate(version, py, stage)
        final = collect(version, stage, info)
        if not args.keep_staging:
            shutil.rmtree(stage, ignore_errors=True)
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        log(f"{version}: {final.relative_to(REPO)} ({size / 1e6:.2f} MB) in {time.perf_counter() - t0:.0f}s")
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) if DATA.exists() else 0
    log(f"done in {time.perf_counter() - t_all:.0f}s; tests/data/old_releases holds {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
