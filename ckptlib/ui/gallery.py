"""Which pictures apply to a checkpoint, for the notebooks to show them without asking what kind it is.

- :func:`mesh_pictures` (01_browse): where its files sit: experts on expert-parallel ranks (AutoEP, DeepSpeed-MoE),
  the pipeline x tensor x data grid, a universal folder's states and what it lacks;
- :func:`partition_pictures` (02_partition_layout): the flat partitions of each group with the optimizer that steps
  it, and Muon's whole matrices at ZeRO-1/2.

Each returns :class:`~ckptlib.ui.pictures.Picture` objects (the facts ride along); :func:`show` displays them, or
says in one line why none applies. Metadata only.
"""
from __future__ import annotations

import html
from typing import Optional

import ckptlib

from .layout_pictures import layout_picture, muon_picture, straddling, universal_picture
from .mesh_figures import experts_picture, grid_picture
from .pictures import Picture


def mesh_pictures(ckpt: "ckptlib.Checkpoint") -> list[Picture]:
    """Where the files sit: experts x ep ranks, the pp x tp x dp grid, a universal folder's contents (those that
    apply, in that order)."""
    d = ckptlib.describe(ckpt)
    placed = d["placement"]
    out = []
    if placed.get("experts"):
        out.append(experts_picture(d))
    if placed.get("grid"):
        out.append(grid_picture(d))
    if placed.get("universal"):
        out.append(universal_picture(ckpt))
    return [p for p in out if p is not None]


def partition_pictures(ckpt: "ckptlib.Checkpoint", highlight: Optional[str] = None) -> list[Picture]:
    """The flat partitions with their optimizers (a parameter outlined: ``highlight``, by default one that straddles
    ranks), and Muon's whole matrices where a group keeps them."""
    out = [layout_picture(ckpt, highlight=highlight if highlight is not None else straddling(ckpt))]
    muon = muon_picture(ckpt)
    return out + ([muon] if muon is not None else [])


def why_none(ckpt: "ckptlib.Checkpoint") -> str:
    """One line: why :func:`mesh_pictures` has nothing for this checkpoint."""
    return (f"data parallel only ({ckpt.mesh.dp} ranks, one ZeRO set, no experts): every rank's files are in the "
            "table above")


def show(pictures: list, none: str = "") -> None:
    """Display each picture in a notebook cell, or ``none`` (one line) when there is none."""
    from IPython.display import HTML, display

    for p in pictures:
        display(p)
    if not pictures and none:
        display(HTML(f"<p class='ckpt-no-picture'>{html.escape(none)}</p>"))


__all__ = ["mesh_pictures", "partition_pictures", "why_none", "show"]
