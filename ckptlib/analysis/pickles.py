"""What ``ckpt inspect --globals`` shows: every global each pickle of a checkpoint names, and which ones
ckptlib refuses, found without running, building or importing any of them.

It needs no readable checkpoint: the files are found by their names (:func:`ckptlib.deepspeed.locate`), and
each torch file's pickle is decoded opcode by opcode (:mod:`ckptlib.io.torchzip.globalscan`), so a
checkpoint that ``inspect`` refuses (a pickle asking for ``os.system``, a class of the training code) can
be sorted out: which file, which global.

Memory: one pickle at a time.
"""
from __future__ import annotations

import os
from typing import Optional

from ..deepspeed import files as fnames
from ..deepspeed.discovery import locate
from ..deepspeed.fileset import list_files
from ..errors import CkptError
from ..io.torchzip.globalscan import pickle_globals


def globals_report(path: str | os.PathLike, tag: Optional[str] = None) -> dict:
    """``{"tag_dir", "files": [{"path", "globals": [{"global", "count", "allowed"}], "error"}], "refused":
    [global names ckptlib does not load]}`` for every torch file of the checkpoint's tag folder."""
    location = locate(path, tag)
    out, refused = [], []
    for f in list_files(location):
        if f.kind == fnames.OTHER and not f.path.name.endswith((".pt", ".bin", ".pth")):
            continue
        entry: dict = {"path": f.relpath, "globals": [], "error": None}
        try:
            for g in pickle_globals(f.path):
                entry["globals"].append(g.to_dict())
                if not g.allowed and g.to_dict()["global"] not in refused:
                    refused.append(g.to_dict()["global"])
        except (CkptError, OSError) as e:
            entry["error"] = getattr(e, "message", None) or str(e)
        out.append(entry)
    return {"tag_dir": str(location.tag_dir), "files": out, "refused": refused}


def format_globals(report: dict) -> str:
    """The text form: per file, each global (``REFUSED`` where ckptlib does not load it), then a verdict."""
    lines = [f"globals named by the pickles of {report['tag_dir']} (decoded, none run):"]
    for f in report["files"]:
        lines.append(f"  {f['path']}")
        if f["error"]:
            lines.append(f"      cannot be read: {f['error']}")
        for g in f["globals"]:
            lines.append(f"      {'allowed' if g['allowed'] else 'REFUSED':<8} {g['global']}"
                         + (f"  (x{g['count']})" if g["count"] > 1 else ""))
    if report["refused"]:
        lines.append(f"ckptlib refuses {len(report['refused'])} global(s): {', '.join(report['refused'])}; nothing "
                     "was run. If the file is a checkpoint you trust, report them so that inert stand-ins can be added")
    else:
        lines.append("every global named is one ckptlib loads (as an inert stand-in or a tensor rebuild)")
    return "\n".join(lines)


__all__ = ["globals_report", "format_globals"]
