"""Reading plain values out of unpickled trees defensively (a damaged file must not raise TypeError)."""
from __future__ import annotations

from typing import Any, Optional


def get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None as soon as a level is not a dict or lacks the key."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def as_int(v: Any) -> Optional[int]:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def as_str(v: Any) -> Optional[str]:
    return str(v) if v is not None else None


def plain(v: Any) -> Any:
    """A JSON-ready copy: dicts, lists, str, int, float, bool and None; anything else as its repr."""
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


__all__ = ["get", "as_int", "as_str", "plain"]
