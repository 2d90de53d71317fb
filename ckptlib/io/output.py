"""Atomic output folders: results appear complete, or not at all.

:class:`AtomicOutputDir` writes into a hidden temporary sibling of the destination
(``.<name>.ckptlib-tmp-<id>``) and renames it into place only when everything is written and (with
``sync``, the default) on disk: a killed run, a failure or a power cut never leaves a partial output under
the destination's name. Without ``sync`` the rename does not wait for the disk: still atomic for a run
that is killed or fails, but after a power cut in the seconds before the kernel has written the files
they may be incomplete.
A lock file next to the destination (``.<name>.ckptlib-lock``, ``flock``) keeps two runs from writing
the same destination; temporary siblings left by killed runs are removed by the next run. The source
checkpoint is protected: a destination inside the source (or a source inside a destination that
would be overwritten) is refused.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Optional

from ..errors import CkptError, OutputError

TMP_MARK = ".ckptlib-tmp-"
LOCK_SUFFIX = ".ckptlib-lock"


def _is_within(child: Path, parent: Path) -> bool:
    try:
        child.relative_to(parent)
        return True
    except ValueError:
        return False


def check_destination(out: Path, source: Optional[Path], overwrite: bool) -> None:
    """Refuse destinations that would touch the source or clobber data; raises :class:`OutputError`."""
    out = out.expanduser().resolve()
    if source is not None:
        src = source.resolve()
        if _is_within(out, src):
            raise OutputError("the output folder is inside the source checkpoint", path=out,
                              hint="choose an output folder outside the checkpoint; ckptlib never writes into it")
        if _is_within(src, out):
            raise OutputError("the source checkpoint is inside the output folder", path=out,
                              hint="choose an output folder that does not contain the checkpoint")
    if out.exists():
        if not out.is_dir():
            raise OutputError("the output path exists and is not a folder", path=out)
        if any(out.iterdir()) and not overwrite:
            raise OutputError("the output folder is not empty", path=out,
                              hint="choose another folder, or pass --overwrite (overwrite=True) to replace it")


class AtomicOutputDir:
    """Context manager: ``with AtomicOutputDir(out) as tmp: write into tmp`` → ``out`` appears on success.

    On an exception (or cancellation) the temporary folder is removed and ``out`` is untouched. After a
    kill -9 only the hidden temporary folder remains; it never looks like a finished output and the
    next run on the same destination removes it.
    """

    def __init__(self, out: str | os.PathLike, source: Optional[str | os.PathLike] = None, overwrite: bool = False,
                 sync: bool = True):
        self.out = Path(out).expanduser().resolve()
        self.sync = sync
        self.source = Path(source) if source is not None else None
        self.overwrite = overwrite
        self.tmp: Optional[Path] = None
        self._lock_fd: Optional[int] = None

    # ---------------------------------------------------------------- locking
    @property
    def lock_path(self) -> Path:
        return self.out.parent / f".{self.out.name}{LOCK_SUFFIX}"

    def _lock(self) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError("another ckptlib run is writing this output folder right now", path=self.out,
                              hint="wait for it to finish, or choose another output folder") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder released and removed it between our open and our flock
            os.close(fd)
            return self._lock()
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.unlink(self.lock_path)
            except OSError:
                pass
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def stale_temporaries(self) -> list[Path]:
        prefix = f".{self.out.name}{TMP_MARK}"
        return [p for p in self.out.parent.iterdir() if p.name.startswith(prefix)]

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> Path:
        check_destination(self.out, self.source, self.overwrite)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the output's parent folder ({e.strerror})", path=self.out.parent) from e
        self._lock()
        try:
            for stale in self.stale_temporaries():  # left by a killed run; we hold the lock, so not in use
                shutil.rmtree(stale, ignore_errors=True)
            self.tmp = self.out.parent / f".{self.out.name}{TMP_MARK}{os.urandom(4).hex()}"
            self.tmp.mkdir()
        except OSError as e:
            self._unlock()
            raise OutputError(f"cannot create a temporary folder next to the output ({e.strerror})",
                              path=self.out.parent) from e
        return self.tmp

    def commit(self) -> None:
        assert self.tmp is not None
        if self.sync:
            _fsync_tree(self.tmp)
        old = None
        if self.out.exists():
            if any(self.out.iterdir()):
                if not self.overwrite:  # appeared while we were writing
                    raise OutputError("the output folder became non-empty during the run", path=self.out)
                old = self.out.parent / f".{self.out.name}{TMP_MARK}old-{os.urandom(4).hex()}"
                os.rename(self.out, old)
            else:
                os.rmdir(self.out)
        os.rename(self.tmp, self.out)
        if self.sync:
            _fsync_dir(self.out.parent)
        self.tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.commit()
            else:
                self.abort()
        except BaseException:
            self.abort()
            raise
        finally:
            self._unlock()
        return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


@contextlib.contextmanager
def reporting_failures(out: Path, observer):
    """Around the writing of an output: an ``OSError`` (disk full, permissions) becomes one
    :class:`OutputError` naming ``out``; every failure is reported to ``observer.on_error`` and re-raised."""
    try:
        yield
    except OSError as e:
        if isinstance(e, CkptError):
            observer.on_error(e)
            raise
        err = OutputError(f"writing the output failed ({e.strerror or e}); nothing was created", path=out,
                          hint="check free space and permissions of the output location")
        observer.on_error(err)
        raise err from e
    except BaseException as e:
        observer.on_error(e)
        raise
