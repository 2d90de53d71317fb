"""Running out of memory: recognising a failed allocation (Python's, the OS's or torch's allocator) and
turning it into one :class:`~ckptlib.errors.OutOfMemoryError` that says how much a plan needs and how much
was left, under which limit (:func:`ckptlib.system.memory.system_memory`: the machine, the cgroup, ``ulimit -d``
and ``ulimit -v``). Memory: none.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional, Union

from ..errors import CkptError, OutOfMemoryError
from ..units import human_bytes
from .memory import SystemMemory, system_memory

#: what torch's CPU allocator and the OS say when an allocation fails; a thread that cannot get its stack
#: (Python: "can't start new thread"); a shared library whose segments cannot be mapped (an ImportError)
_ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "defaultcpuallocator", "out of memory",
                      "can't start new thread", "failed to map segment")


def is_allocation_failure(error: Union[BaseException, str]) -> bool:
    """Whether ``error`` (an exception, or its text from a worker process) is a failed memory allocation:
    a ``MemoryError``, ``ENOMEM``, or torch's allocator giving up."""
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, OSError) and error.errno == 12:  # ENOMEM
        return True
    if isinstance(error, SyntaxError):
        return compile_ran_out(error)
    text = str(error).lower()
    return (isinstance(error, (str, RuntimeError, ImportError))) and any(s in text for s in _ALLOCATION_FAILED)


#: ckptlib's own sources (the package folder)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: how close to its memory limit a process is when a compile's failed allocation shows as a SyntaxError
COMPILE_ROOM_BYTES = 4 * 2**20


def compile_ran_out(error: SyntaxError) -> bool:
    """Whether a ``SyntaxError`` is CPython's compiler running out of memory on one of ckptlib's own modules
    (imported late, by a command). Under a data-segment limit its parser reports a failed allocation as a
    syntax error: measured, ``expected ':'`` at a ``def`` line of ``ckptlib/io/streaming.py`` (a file that
    compiles) under ``ulimit -d`` 10,192 KiB. So: a file of this package, and less than
    :data:`COMPILE_ROOM_BYTES` left; any other syntax error is what it says."""
    path = os.path.abspath(getattr(error, "filename", None) or "")
    return path.startswith(_PACKAGE + os.sep) and system_memory().headroom < COMPILE_ROOM_BYTES


@contextlib.contextmanager
def translating_allocation_failures(plan: Any, path: Any = None):
    """Around a run: a failed allocation becomes one :class:`~ckptlib.errors.OutOfMemoryError` saying how
    much ``plan`` needs (its ``predicted_peak_bytes``) and how much was left."""
    try:
        yield
    except CkptError as e:
        if isinstance(e, OutOfMemoryError) or not is_allocation_failure(e.message):
            raise
        raise OutOfMemoryError(out_of_memory_message(plan.predicted_peak_bytes, f"this {plan.action}"),
                               path=path) from None
    except (MemoryError, RuntimeError, OSError, ImportError, SyntaxError) as e:
        if not is_allocation_failure(e):
            raise
        raise OutOfMemoryError(out_of_memory_message(plan.predicted_peak_bytes, f"this {plan.action}"),
                               path=path) from None


def out_of_memory_message(needed: int, what: str = "the run", system: Optional[SystemMemory] = None) -> str:
    """``"ran out of memory: the run needs about 58.7 MB, 3.1 MB was left under ..."``."""
    system = system or system_memory()
    return (f"ran out of memory: {what} needs about {human_bytes(needed)}, and {human_bytes(system.headroom)} "
            f"was {system.bound_by}")


__all__ = ["is_allocation_failure", "translating_allocation_failures", "out_of_memory_message"]
