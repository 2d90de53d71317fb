"""The checkpoint browser: a path box and a folder list that recognise checkpoints, then what is in one.

::

    from ckptlib.ui import CheckpointBrowser
    browser = CheckpointBrowser("samples/zero2_bf16_w2/ckpt")
    browser                      # in a notebook cell
    browser.checkpoint           # the opened ckptlib.Checkpoint (None until one is found)
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Union

import ipywidgets as widgets

import ckptlib
from ckptlib.deepspeed.discovery import Detected, detect

from . import figures
from .common import ErrorArea, find_path, guarded, png_image, set_png
from .plots import figure_png

UP = ".."


def label(d: Detected) -> str:
    """How the folder list shows a folder: an icon and what it is."""
    name = d.path.name or str(d.path)
    if d.kind == "checkpoint":
        extra = f"latest → {d.latest}" if d.latest else f"{len(d.tags)} tag(s), no latest"
        return f"📦 {name}/   checkpoint ({extra})"
    if d.kind == "tag":
        return f"🏷 {name}/   tag folder"
    if d.kind == "training-output":
        return f"🗂 {name}/   {len(d.checkpoints)} checkpoint-N folders"
    return f"📁 {name}/"


class CheckpointBrowser(widgets.VBox):
    """Browse folders, recognise DeepSpeed checkpoints, and show one: summary, files (table and bar
    chart of bytes per rank), parameters and the problems found.

    Selecting a folder in the list goes into it; ``..`` goes up. When the path is a checkpoint (or a tag
    folder, or a training output folder), it is opened (metadata only) and shown; its tags are offered.
    ``on_open(callback)`` registers ``callback(checkpoint)`` for when a checkpoint is opened.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None):
        self.errors = ErrorArea()
        self.checkpoint: Optional[ckptlib.Checkpoint] = None
        self.facts: Optional[dict] = None  # ckptlib.describe() of the checkpoint shown
        self.detected: Optional[Detected] = None
        self._callbacks: list[Callable] = []
        self._busy = False

        self.path = widgets.Text(description="path", continuous_update=False,
                                 layout=widgets.Layout(width="70%"))
        self.open_button = widgets.Button(description="Open", icon="folder-open", button_style="primary",
                                          tooltip="open the checkpoint at this path")
        self.up_button = widgets.Button(description="Up", icon="arrow-up", tooltip="parent folder")
        self.folders = widgets.Select(options=[], rows=8, layout=widgets.Layout(width="95%"))
        self.folders.add_class("ckpt-folder-list")
        self.found = widgets.HTML()
        self.tag = widgets.Dropdown(description="tag", options=[], layout=widgets.Layout(width="40%"))
        self.summary = widgets.HTML()
        self.file_table = widgets.HTML()
        self.file_table.add_class("ckpt-files")
        self.chart = png_image("ckpt-file-chart")
        self.params = widgets.HTML()
        self.problems = widgets.HTML()
        self.problems.add_class("ckpt-problems-box")
        self.details = widgets.Tab(children=[
            self.summary, widgets.VBox([self.file_table, self.chart]), self.params, self.problems])
        for i, title in enumerate(["Summary", "Files", "Parameters", "Problems"]):
            self.details.set_title(i, title)
        self.details.layout.display = "none"

        self.open_button.on_click(self._on_open_click)
        self.up_button.on_click(self._on_up)
        self.path.observe(self._on_path, names="value")
        self.folders.observe(self._on_folder, names="value")
        self.tag.observe(self._on_tag, names="value")
        super().__init__([widgets.HBox([self.path, self.open_button, self.up_button]), self.folders, self.found,
                          self.tag, self.details, self.errors])
        self.add_class("ckpt-browser")
        self.path.value = str(find_path(path, must_exist=False) if path is not None else Path.cwd())

    # ---------------------------------------------------------------- callbacks
    def on_open(self, callback: Callable[["ckptlib.Checkpoint"], None]) -> None:
        """Call ``callback(checkpoint)`` whenever a checkpoint is opened."""
        self._callbacks.append(callback)

    @guarded("path")
    def _on_path(self, change) -> None:
        self.refresh()

    @guarded("open")
    def _on_open_click(self, _=None) -> None:
        self.refresh()

    @guarded("up")
    def _on_up(self, _=None) -> None:
        self.path.value = str(Path(self.path.value).parent)

    @guarded("folder list")
    def _on_folder(self, change) -> None:
        if self._busy or change["new"] is None:
            return
        target = Path(self.path.value) / change["new"] if change["new"] != UP else Path(self.path.value).parent
        self.path.value = str(target.resolve())

    @guarded("tag")
    def _on_tag(self, change) -> None:
        if self._busy or not change["new"] or self.checkpoint is None:
            return
        if change["new"] != self.checkpoint.location.tag:
            self._open(self.checkpoint.location.save_dir, tag=change["new"])

    # ---------------------------------------------------------------- work
    def refresh(self) -> None:
        """List the folders at the path, detect what it is, and open it if it is a checkpoint."""
        path = Path(self.path.value).expanduser()
        if not path.exists():
            self._list([])
            self.found.value = f"<span style='color:#b71c1c'>no such folder: <code>{path}</code></span>"
            self._show(None)
            return
        if path.is_file():
            path = path.parent
        entries = []
        try:
            for e in sorted(os.scandir(path), key=lambda e: e.name):
                if e.is_dir() and not e.name.startswith("."):
                    entries.append((label(detect(e.path)), e.name))
        except OSError as e:
            raise ckptlib.CkptError(f"cannot list this folder ({e.strerror})", path=path) from None
        self._list([(f"⬆ {UP}", UP)] + entries)
        self.detected = d = detect(path)
        if d.kind == "folder":
            n = sum(1 for label, _ in entries if label.startswith(("📦", "🏷", "🗂")))
            self.found.value = ("no checkpoint here" + (f"; {n} below (marked 📦 🏷 🗂)" if n else "")
                                + " &mdash; pick a folder")
            self._show(None)
            return
        self.found.value = {"checkpoint": "a DeepSpeed checkpoint", "tag": "a tag folder",
                            "training-output": "a training output folder (the newest checkpoint-N is used)"}[d.kind]
        self._open(path)

    def _list(self, options) -> None:
        self._busy = True
        try:
            self.folders.options = options
            self.folders.value = None
        finally:
            self._busy = False

    def _open(self, path: Path, tag: Optional[str] = None) -> None:
        try:
            ck = ckptlib.open_checkpoint(path, tag=tag)
        except ckptlib.UnsafeCheckpointError:
            self._show(None)
            raise
        except ckptlib.CkptError as e:  # expected while browsing: say why, in place
            self.found.value = f"<span style='color:#b71c1c'>not readable as a checkpoint: {_esc(str(e))}</span>"
            self._show(None)
            return
        self._show(ck)

    def _show(self, ck: Optional["ckptlib.Checkpoint"]) -> None:
        if self.checkpoint is not None and self.checkpoint is not ck:
            self.checkpoint.close()
        self.checkpoint = ck
        if ck is None:
            self.details.layout.display = "none"
            self._busy = True
            self.tag.options = []
            self._busy = False
            self.tag.layout.display = "none"
            return
        loc = ck.location
        self._busy = True
        try:
            self.tag.options = [(t + ("  (latest)" if t == loc.latest else ""), t) for t in loc.tags]
            self.tag.value = loc.tag
        finally:
            self._busy = False
        self.tag.layout.display = "" if len(loc.tags) > 1 else "none"
        self.facts = d = ckptlib.describe(ck)  # the one summary: what `ckpt inspect` says, every tab from it
        self.summary.value = figures.summary_html(d)
        self.file_table.value = figures.file_table_html(d)
        set_png(self.chart, figure_png(figures.file_sizes_figure(d)))
        self.params.value = figures.parameters_html(d)
        self.problems.value = figures.problems_html(d)
        self.details.set_title(3, f"Problems ({len(d['problems'])})" if d["problems"] else "Problems")
        self.details.layout.display = ""
        if d["problems"]:
            self.details.selected_index = 3
        for cb in self._callbacks:
            cb(ck)


def _esc(text: str) -> str:
    import html

    return html.escape(text).replace("\n", "<br>")
