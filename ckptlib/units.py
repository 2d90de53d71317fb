"""Sizes: parsing what users write (``"5GB"``, ``"2GiB"``) and printing byte counts. No I/O, no torch."""
from __future__ import annotations

import re
from typing import Union

KiB, MiB, GiB = 2**10, 2**20, 2**30

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": KiB, "MIB": MiB, "GIB": GiB, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """``"5GB"`` -> 5·10⁹ (decimal units, as huggingface_hub); ``KiB``/``MiB``/``GiB`` are binary; an int is bytes.

    Raises:
        ValueError: the text is not a size; the message says how to write one.
    """
    if isinstance(size, bool):
        raise ValueError(f"cannot read the size {size!r}; write it like 5GB, 500MB or 2GiB")
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read the size {size!r}; write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def human_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units, like the sizes users give)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # pragma: no cover - the loop always returns


__all__ = ["parse_size", "human_bytes", "KiB", "MiB", "GiB"]
