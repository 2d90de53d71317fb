"""A picture: a figure and the facts it draws, together.

Every picture the notebooks show is drawn from facts that :func:`ckptlib.describe` (or another analysis of the
library) states; a :class:`Picture` keeps those facts beside the figure so that nothing but pixels is lost on
the way to the page:

- as a notebook cell's result it shows as HTML, ``<figure class="ckpt-picture" data-kind="..." data-facts="{json}">``
  around the PNG and a caption in words, with the PNG itself beside (``image/png``) for whatever cannot show
  HTML; papermill keeps both in the executed notebook;
- in a widget it is an :func:`picture_widget` (an ``ipywidgets.HTML`` holding the same ``<figure>``), so the facts
  are in the page's DOM (``figure.ckpt-picture[data-kind=muon]``) and in the widget's model.

Tests read the facts back (:func:`facts_in_html`) and check them against the checkpoint, not only that a figure
exists.
"""
from __future__ import annotations

import base64
import html
import json
import re
from typing import Any, Optional

import ipywidgets as widgets

from .plots import figure_png


class Picture:
    """A matplotlib figure (``figure``), what kind of picture it is (``kind``: ``"groups"``, ``"muon"``,
    ``"experts"``, ``"grid"``, ``"universal"``, ``"adapter"``...), the JSON-ready ``facts`` it draws, and a
    ``caption`` in words. The PNG is rendered once, on first use."""

    def __init__(self, figure, kind: str, facts: Any, caption: str = ""):
        self.figure, self.kind, self.facts, self.caption = figure, kind, facts, caption
        self._png: Optional[bytes] = None

    @property
    def png(self) -> bytes:
        if self._png is None:
            self._png = figure_png(self.figure) if self.figure is not None else b""
        return self._png

    def html(self) -> str:
        """``<figure class="ckpt-picture ckpt-picture-KIND" data-kind data-facts>``: the PNG inline, the caption."""
        facts = html.escape(json.dumps(self.facts, separators=(",", ":"), default=str), quote=True)
        img = (f"<img src='data:image/png;base64,{base64.b64encode(self.png).decode()}' alt='{html.escape(self.kind)}' "
               "style='max-width:100%;height:auto'>" if self.png else "")
        caption = f"<figcaption style='font-size:12px;color:#333'>{self.caption}</figcaption>" if self.caption else ""
        return (f"<figure class='ckpt-picture ckpt-picture-{html.escape(self.kind)}' data-kind='{html.escape(self.kind)}' "
                f"data-facts=\"{facts}\" style='margin:4px 0'>{img}{caption}</figure>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = {"text/html": self.html(), "text/plain": f"<{self.kind} picture: {_plain(self.caption)}>"}
        if self.png:
            data["image/png"] = base64.b64encode(self.png).decode()
        return data

    def __repr__(self) -> str:
        return f"Picture({self.kind!r})"


def _plain(text: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", text or ""))


def picture_widget(picture: Optional[Picture] = None, cls: str = "") -> widgets.HTML:
    """An ``ipywidgets.HTML`` showing ``picture`` (or nothing until :func:`set_picture`); ``cls`` a CSS class to
    find it by."""
    w = widgets.HTML(layout=widgets.Layout(max_width="100%"))
    w.add_class("ckpt-picture-box")
    if cls:
        w.add_class(cls)
    if picture is not None:
        set_picture(w, picture)
    return w


def set_picture(w: widgets.HTML, picture: Optional[Picture]) -> None:
    """Show ``picture`` in ``w`` (None: nothing). Safe from any thread (it only sets the value)."""
    w.value = picture.html() if picture is not None else ""


_FIGURE = re.compile(r"<figure class='ckpt-picture[^']*' data-kind='([^']+)' data-facts=\"([^\"]*)\"")


def facts_in_html(text: str) -> list[tuple[str, Any]]:
    """``[(kind, facts)]`` of every picture in ``text`` (a cell's HTML output, a widget's value), in order."""
    return [(html.unescape(k), json.loads(html.unescape(f))) for k, f in _FIGURE.findall(text)]


__all__ = ["Picture", "picture_widget", "set_picture", "facts_in_html"]
