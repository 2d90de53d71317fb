"""The layout view: each rank's flat partition as a bar, and where a chosen parameter lives.

::

    from ckptlib.ui import LayoutView
    view = LayoutView(ckpt)        # a ckptlib.Checkpoint or a path
    view.select("fc1.weight")      # or pick it / search it in the widget
"""
from __future__ import annotations

import os
from typing import Optional, Union

import ipywidgets as widgets

import ckptlib

from . import layout_pictures as pictures
from .common import ErrorArea, as_checkpoint, guarded
from .pictures import picture_widget, set_picture

ALL = -1


class LayoutView(widgets.VBox):
    """Matplotlib picture of the partition layout, with a parameter picker.

    - *show*: all groups (ZeRO-1/2 parameter groups, ZeRO-3 sub-groups) or one;
    - *search*: type part of a name; the list below shows the matches;
    - picking a parameter outlines its pieces in the figure (when one group is shown, the parameter's
      group) and lists which ranks hold it, in which file, at which offset, which of its elements.
    """

    def __init__(self, checkpoint: Union["ckptlib.Checkpoint", str, os.PathLike]):
        self.errors = ErrorArea()
        self.checkpoint = as_checkpoint(checkpoint)
        ck = self.checkpoint
        self.panels = pictures.layout_panels(ck)
        self.names = [p.name for p in ck.parameters]
        self.title = widgets.HTML()
        self.group = widgets.Dropdown(description="show", layout=widgets.Layout(width="45%"))
        self.group.options = [("all groups", ALL)] + [(f"{p['label']}: {p['optimizer'] or '-'} ({len(p['parameters'])} parameters)", i)
                                                      for i, p in enumerate(self.panels)]
        self.group.value = ALL
        self.search = widgets.Text(description="search", placeholder="part of a parameter name",
                                   continuous_update=True, layout=widgets.Layout(width="45%"))
        self.param = widgets.Select(description="parameter", options=[("(none)", "")] + [(n, n) for n in self.names],
                                    value="", rows=7, layout=widgets.Layout(width="60%"))
        self.param.add_class("ckpt-param-select")
        self.search.add_class("ckpt-param-search")
        self.figure = picture_widget(cls="ckpt-layout-figure")  # the picture and its facts (data-facts)
        self.picture = None
        self.where = widgets.HTML()
        self.where.add_class("ckpt-where")
        self.group.observe(self._on_group, names="value")
        self.search.observe(self._on_search, names="value")
        self.param.observe(self._on_param, names="value")
        super().__init__([self.title, widgets.HBox([self.group, self.search]), self.param, self.figure, self.where,
                          self.errors])
        self.add_class("ckpt-layout-view")
        loc = ck.location
        self.title.value = (f"<b>{loc.tag}</b>: a universal checkpoint (from ZeRO-{ck.zero_stage}, "
                            f"{ck.dp_world_size} ranks): every tensor whole in its own files, no partitions"
                            if ck.universal is not None else
                            f"<b>{loc.tag}</b>: ZeRO-{ck.zero_stage}, {ck.dp_world_size} ranks, "
                            f"{len(self.panels)} flat tensor(s) per rank. Coloured: parameters; hatched: padding.")
        self.render()

    @property
    def selected(self) -> Optional[str]:
        return self.param.value or None

    def select(self, name: str) -> None:
        """Pick parameter ``name`` (as if clicked)."""
        if name not in self.names:
            raise KeyError(f"no parameter named {name!r}")
        if name not in [v for _, v in self.param.options]:
            self.search.value = ""
        self.param.value = name

    @guarded("group")
    def _on_group(self, change) -> None:
        self.render()

    @guarded("search")
    def _on_search(self, change) -> None:
        text = change["new"].strip().lower()
        matches = [n for n in self.names if text in n.lower()]
        current = self.param.value
        self.param.options = [("(none)", "")] + [(n, n) for n in matches]
        self.param.value = current if current in matches else (matches[0] if len(matches) == 1 else "")

    @guarded("parameter")
    def _on_param(self, change) -> None:
        name = change["new"]
        if name:
            i = pictures.panel_of(self.checkpoint, name, self.panels)
            if i is not None and self.group.value not in (ALL, i):
                self.group.value = i  # renders through _on_group
            self.where.value = pictures.where_html(self.checkpoint, name)
        else:
            self.where.value = ""
        self.render()

    def render(self) -> None:
        """Draw the figure for the current choices into the image."""
        g = self.group.value
        panels = None if g == ALL else [g]
        self.picture = pictures.layout_picture(self.checkpoint, panels=panels, highlight=self.selected)
        set_picture(self.figure, self.picture)
