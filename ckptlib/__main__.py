"""``python -m ckptlib`` and the ``ckpt`` command's entry point: :func:`ckptlib.cli.main` behind a last
guard for memory so short that Python cannot even load ckptlib's modules, or build the usual message.

The CLI itself says how much memory a run needs when it runs out (one line and a hint, exit code 2).
Under a data-segment limit (``ulimit -d``) of a few MiB, Python still starts but fails while importing;
this module is loaded first, holds its message ready, and writes it with one system call, so that even
then the user gets one line and exit code 2, never a traceback.
"""
import errno
import os

MESSAGE = (b"ckpt: error: ran out of memory before ckptlib could run or say how much it needs: Python could not "
           b"load its modules under this process's memory limit (ulimit -d, the cgroup or the machine)\n"
           b"  hint: raise the limit; ckpt needs about 16 MB to start, 80 MB for an fp32 export and 130 MB for one "
           b"that casts (`ckpt export --plan` says how much a run needs)\n")


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is the failure of an allocation: a MemoryError, an OSError ENOMEM (e.g. listing a
    folder while importing), an ImportError of a shared library that could not be mapped, or a SyntaxError
    in one of ckptlib's own modules within 4 MiB of the data-segment limit (CPython's parser reports a failed
    allocation so). The import-time part of :func:`ckptlib.system.allocation.is_allocation_failure`, kept
    here because that module's own imports (errors, memory, units) are what fails under the memory this
    guard is for."""
    if isinstance(e, MemoryError):
        return True
    if isinstance(e, OSError):
        return e.errno == errno.ENOMEM
    if isinstance(e, SyntaxError):
        return _own_file(e.filename) and _near_data_limit()
    return isinstance(e, ImportError) and "failed to map segment" in str(e)


def _own_file(path) -> bool:
    return bool(path) and os.path.abspath(path).startswith(os.path.dirname(os.path.abspath(__file__)) + os.sep)


def _near_data_limit() -> bool:
    """Less than 4 MiB left under ``ulimit -d`` (VmData from ``/proc/self/status``)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    try:
        with open("/proc/self/status", "rb") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmData:"))
    except (OSError, StopIteration, ValueError):
        return True  # cannot even read it: as short as can be
    return limit - used < 4 * 2**20


def main() -> int:
    """Run the ``ckpt`` command line; returns its exit code."""
    try:
        import resource  # noqa: F401 - first, while there is room: the CLI's memory messages read the limits

        from .cli.main import main as cli_main

        return cli_main()
    except (MemoryError, OSError, ImportError, SyntaxError) as e:
        if not out_of_memory(e):
            raise
        try:
            os.write(2, MESSAGE)
        except OSError:
            pass
        return 2


__all__ = ["main", "MESSAGE", "out_of_memory"]

if __name__ == "__main__":
    import sys

    sys.exit(main())
