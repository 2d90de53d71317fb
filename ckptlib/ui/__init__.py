"""Notebook widgets for ckptlib (ipywidgets 8; needs the ``notebooks`` extra).

Built on ckptlib's public API (it may import every layer of ckptlib); nothing in the library imports this
package.

- :class:`CheckpointBrowser` — path box and folder list; recognises checkpoints, tags and ``latest``;
  summary, file table with sizes per rank and a bar chart, parameters, problems.
- :class:`LayoutView` — each rank's flat partition as a bar (parameters coloured, padding hatched);
  pick or search a parameter to see which ranks hold it, at which offsets.
- :class:`ExportWizard`, :class:`ReshardWizard` — options → plan (predicted memory and disk) → run in a
  worker thread (progress, live memory chart, Cancel) → verify → summary.
- :class:`MemoryMonitor` — the kernel's memory, live.
- :class:`HealthView` — what ``ckptlib.check`` found: per-layer norm bars, NaN/Inf marked, problems.
- :class:`DiffView` — what ``ckptlib.diff`` found: statuses, the table, the relative change per layer.
- :class:`AdapterView`, :class:`AdapterWizard` — a peft adapter: its modules, how far each moved, the Trainer's
  adapter file judged; export it, or merge it into its base (plan → preflight → run → verify → summary).
- :func:`refusals`, :func:`show_refusal` — a refusal in a notebook cell shown as ``ckpt`` prints it (the
  message and the hint, in a box), not raised; :func:`optimizer_groups_html` — each optimizer group with its own
  state keys and, for a DCP export, the torch optimizer and keys it becomes.

The figures are also available as plain functions (``layout_figure``, ``file_sizes_figure``,
``norms_figure``, ``diff_figure``), and the
path helpers (``find_path``, ``sample_checkpoint``) resolve notebook parameters robustly.
"""
from .browser import CheckpointBrowser
from .common import ErrorArea, WidgetObserver, find_path, notebook_setup, sample_checkpoint
from .diff_view import DiffView, diff_figure, diff_table_html
from .figures import file_sizes_figure, file_table_html, parameters_html, problems_html, summary_html, table_html
from .layout_pictures import (layout_figure, layout_panels, layout_picture, muon_picture, straddling, universal_picture,
                              where_html, where_is)
from .pictures import Picture, facts_in_html, picture_widget
from .gallery import mesh_pictures, partition_pictures
from .health_view import HealthView, health_table_html, norms_figure
from .layout_view import LayoutView
from .monitor import MemoryMonitor
from .plots import figure_png, memory_figure, new_figure, plot_memory
from .wizards import ExportWizard, ReshardWizard, checks_html
from .common import Refused, fits, refusal_html, refusals, show_refusal, tied_uses
from .migrate import held_line, optimizer_groups, optimizer_groups_html

__all__ = ["CheckpointBrowser", "LayoutView", "ExportWizard", "ReshardWizard", "MemoryMonitor", "ErrorArea",
           "WidgetObserver", "find_path", "notebook_setup", "sample_checkpoint", "file_sizes_figure", "file_table_html",
           "layout_figure", "layout_panels", "parameters_html", "problems_html", "summary_html", "table_html",
           "where_html", "where_is", "checks_html", "memory_figure", "plot_memory", "figure_png", "new_figure",
           "HealthView", "health_table_html", "norms_figure", "DiffView", "diff_figure", "diff_table_html",
           "layout_picture", "muon_picture", "universal_picture", "straddling", "Picture", "facts_in_html",
           "picture_widget"]
__all__ += ["refusals", "show_refusal", "refusal_html", "Refused", "fits", "tied_uses", "held_line",
            "optimizer_groups", "optimizer_groups_html"]
from .adapter_view import AdapterView, AdapterWizard, adapter_file_html, adapter_table_html, movement_picture
__all__ += ["AdapterView", "AdapterWizard", "adapter_file_html", "adapter_table_html", "movement_picture"]
