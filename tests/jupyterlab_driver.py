"""Drive a real JupyterLab in Debian's headless Chromium with Playwright (no browser download).

Used by tests/test_browser.py and scripts/screenshots.py. JupyterLab runs on 127.0.0.1 on a free port
with a random token, in its own process group, with its settings, workspaces and runtime files in a
temporary folder; notebooks are served from a copy, so autosave never touches the repository's files.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A running JupyterLab: ``url(path)`` gives the address of a notebook (token included)."""

    def __init__(self, root: Path, port: int, token: str, proc: subprocess.Popen, log: Path):
        self.root, self.port, self.token, self.proc, self.log = root, port, token, proc, log

    def url(self, path: str = "", workspace: Optional[str] = None) -> str:
        """The address of ``path`` in Lab; ``workspace`` names a workspace of its own (nothing else open)."""
        ws = f"workspaces/{workspace}/" if workspace else ""
        return f"http://127.0.0.1:{self.port}/lab/{ws}tree/{path}?token={self.token}"


@contextlib.contextmanager
def jupyterlab(notebooks: list[Path], startup_timeout: float = 90.0) -> Iterator[Lab]:
    """Serve copies of ``notebooks`` with JupyterLab; stop it (its whole process group) afterwards."""
    work = Path(tempfile.mkdtemp(prefix="ckptlib-lab-"))
    root = work / "notebooks"
    root.mkdir()
    for nb in notebooks:
        shutil.copy2(nb, root / nb.name)
    settings = work / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"), JUPYTER_RUNTIME_DIR=str(work / "runtime"),
               JUPYTER_CONFIG_DIR=str(work / "config"), PYTHONUNBUFFERED="1")
    port, token = free_port(), secrets.token_hex(16)
    log = work / "lab.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.expose_app_in_browser=True",
           "--KernelManager.transport=ipc"]  # each kernel's sockets are files in the runtime folder (tests/kernels.py)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield Lab(root, port, token, proc, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator:
    """A Playwright page in Debian's Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()


def open_and_run_all(page, lab: Lab, notebook: str, timeout_ms: int = 120_000) -> None:
    """Open ``notebook`` in Lab, wait for its kernel, run all cells and wait until they have run."""
    page.goto(lab.url(notebook, workspace=Path(notebook).stem.replace("_", "-")))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_ms)
    page.wait_for_function(
        """(name) => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
                   const k = w && w.context && w.context.path.endsWith(name) && w.sessionContext
                             && w.sessionContext.session && w.sessionContext.session.kernel;
                   return !!k && k.status === 'idle'; }""", arg=notebook, timeout=timeout_ms)
    with contextlib.suppress(Exception):  # more room for the notebook
        page.evaluate("window.jupyterapp.shell.collapseLeft()")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # every code cell has an execution count and the kernel is idle again
    page.wait_for_function(
        """() => { const w = window.jupyterapp.shell.currentWidget;
                   const cells = w.content.widgets.filter(c => c.model.type === 'code');
                   const k = w.sessionContext.session && w.sessionContext.session.kernel;
                   return !!k && cells.length > 0 && cells.every(c => c.model.executionCount)
                          && k.status === 'idle'; }""",
        timeout=timeout_ms)


def errors_in_page(page) -> list[str]:
    return page.eval_on_selector_all(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                     "els => els.map(e => e.innerText)")


def chromium_missing_reason() -> Optional[str]:
    if not Path(CHROMIUM).exists():
        return (f"Debian's Chromium is not installed ({CHROMIUM} is missing): "
                "`apt-get install -y chromium` (.ci/run does this in CI)")
    return None
