"""Executing plans: one runner for export, reshard and universal, in threads, processes or under torchrun.

May import: :mod:`ckptlib.analysis` (verification after a run) and every layer below it.
"""
from .distributed import run_distributed
from .runner import RunResult, run

__all__ = ["run", "run_distributed", "RunResult"]
