"""Import an old DeepSpeed release on this CPU machine beside torch 2.13 (used by old_generate.py only).

The shims (see /work/shared/docs/old-deepspeed-on-cpu.md), applied only when listed in the
``CKPTLIB_DS_PATCHES`` environment variable (releases.py says which release needs which):

(a) torch 2.13 no longer has ``torch.distributed.elastic.agent.server.api.log`` and
    ``_get_socket_with_port``, which DeepSpeed <= 0.13 imports at start-up: define them.
(b) With ``DS_ACCELERATOR=cpu``, releases before 0.14 import Intel's ``intel_extension_for_pytorch`` and
    ``oneccl_bindings_for_pytorch``: put empty stand-in modules in ``sys.modules``.
(c) ``deepspeed.comm.ccl.build_ccl_op`` returns None, so ``init_distributed`` does not try to build the
    oneCCL op ("Didn't find CCL_ROOT"); gloo is used.

Always: the shared-memory comm op is not built (``deepspeed.comm.torch.build_shm_op``, where it exists;
it would JIT-compile for a minute) and the CPU accelerator reports bf16/fp16 support, as the 0.19.8
generator does.
"""
from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import types

import torch


def patches() -> list[str]:
    return [p for p in os.environ.get("CKPTLIB_DS_PATCHES", "").split(",") if p]


def _patch_a() -> None:
    api = importlib.import_module("torch.distributed.elastic.agent.server.api")
    if not hasattr(api, "log"):
        api.log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if not hasattr(api, "_get_socket_with_port"):
        def _get_socket_with_port() -> socket.socket:
            """A listening TCP socket on a free local port (what the removed torch helper returned)."""
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("localhost", 0))
            s.listen(0)
            return s

        api._get_socket_with_port = _get_socket_with_port


def _patch_b() -> None:
    for name in ("intel_extension_for_pytorch", "oneccl_bindings_for_pytorch"):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__version__ = "0.0.0+ckptlib-stub"
            mod.__file__ = f"<ckptlib stub for {name}>"
            sys.modules[name] = mod


def import_deepspeed():
    wanted = patches()
    if "a" in wanted:
        _patch_a()
    if "b" in wanted:
        _patch_b()
    import deepspeed

    if "c" in wanted:
        importlib.import_module("deepspeed.comm.ccl").build_ccl_op = lambda *a, **k: None
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    acc = deepspeed.accelerator.get_accelerator()
    acc.is_fp16_supported = lambda: True
    acc.is_bf16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    return deepspeed
