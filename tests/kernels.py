"""Notebooks executed headless by the tests (papermill, a real kernel), each kernel talking over Unix sockets in a
folder of its own.

Over TCP, jupyter_client picks free ports by binding and closing them, and the kernel binds them again a moment
later: kernels started at the same time (two per pytest worker, two workers) can be handed the same port, and the
one that loses dies at once ("Kernel died before replying to kernel_info", jupyter_client#154; seen here with three
workers). A socket file in a private folder cannot be taken by another kernel.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def _kernel_manager_in(folder: str) -> type:
    from jupyter_client.manager import AsyncKernelManager

    class IpcKernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.transport = "ipc"
            self.ip = str(Path(folder) / "kernel")  # sockets kernel-1 ... kernel-5 (short: a socket path has 107 bytes)

    return IpcKernelManager


def execute_notebook(notebook: Path, executed: Path, parameters: dict) -> None:
    """Run ``notebook`` with ``parameters`` (papermill) into ``executed``, from the notebook's folder, 180 s per cell
    at most; the kernel is stopped at once at the end (torch makes a graceful exit slow)."""
    import papermill as pm

    folder = tempfile.mkdtemp(prefix="ckptlib-kernel-")
    try:
        pm.execute_notebook(str(notebook), str(executed), parameters=parameters, kernel_name="python3",
                            cwd=str(Path(notebook).parent), progress_bar=False, log_output=False,
                            execution_timeout=180, shutdown_kernel="immediate",
                            kernel_manager_class=_kernel_manager_in(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
