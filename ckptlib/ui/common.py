"""Pieces every widget uses: an error area, a callback guard, a progress observer, path resolution; and how a
notebook cell shows a refusal.

Rules the widgets follow (see ``docs`` of ipywidgets on threads and on output from callbacks):

- every callback (``on_click``, ``observe``) runs under :func:`guarded`: an exception is shown in the
  widget's :class:`ErrorArea` (message and traceback), never lost in the kernel log;
- worker and sampler threads only *set widget values* (``.value``, ``append_stderr``); they never
  ``print`` and never enter an ``Output`` context.

A notebook cell shows a refusal as ``ckpt`` prints it, the message and the hint in a box (:func:`refusal_html`,
the same parts the :class:`ErrorArea` shows), never as a traceback: ``with refusals("plan"): plan = ...`` shows
one of ckptlib's errors raised inside and goes on (``plan`` keeps its value from before, and the cells after it
skip what needs it); any other exception, a bug, is raised as usual.
"""
from __future__ import annotations

import contextlib
import functools
import html
import os
import re
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Union

import ipywidgets as widgets

import ckptlib
from ckptlib.errors import PipelineUnknownError, message_and_hint
from ckptlib.reshard.stages import parse_tied
from ckptlib.units import human_bytes


class ErrorArea(widgets.VBox):
    """Where a widget shows what went wrong: a red message (HTML) and the traceback (an ``Output``).

    ``show(exc)`` may be called from any thread. ``errors`` keeps the exceptions shown (for tests and
    for the curious).
    """

    def __init__(self):
        self.message = widgets.HTML(value="")
        self.details = widgets.Output(layout=widgets.Layout(max_height="240px", overflow="auto"))
        self.errors: list[BaseException] = []
        super().__init__([self.message, self.details])
        self.add_class("ckpt-error-area")
        self.layout.display = "none"

    def show(self, exc: BaseException, context: str = "") -> None:
        """Show ``exc``: one of ckptlib's errors as ``ckpt`` prints it, its message and its hint
        (:func:`ckptlib.errors.message_and_hint`) and nothing more; any other exception (a bug) with
        its traceback."""
        self.errors.append(exc)
        ours = isinstance(exc, ckptlib.CkptError)
        self.message.value = error_parts_html(exc, context)
        self.details.outputs = ()
        if not ours:  # ckptlib's own errors say all there is to say
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.details.append_stderr(tb)
        self.layout.display = ""

    def clear(self) -> None:
        self.message.value = ""
        self.details.outputs = ()
        self.layout.display = "none"

    @property
    def text(self) -> str:
        """The message shown (HTML stripped of nothing; for tests)."""
        return self.message.value


def error_parts_html(exc: BaseException, context: str = "") -> str:
    """``exc`` in HTML as ``ckpt`` says it: a head (``&#9888; context: error``), the message and the hint, each in
    its own ``div`` (``ckpt-error-message``, ``ckpt-error-hint``), from :func:`ckptlib.errors.message_and_hint`; any
    other exception (a bug): its type as the head, its text, no hint."""
    ours = isinstance(exc, ckptlib.CkptError)
    kind = "error" if ours else type(exc).__name__
    where = f"{html.escape(context)}: " if context else ""
    if ours:
        what, hint = message_and_hint(exc)
    else:
        what, hint = str(exc) or type(exc).__name__, None
    hint_html = (f"<div class='ckpt-error-hint' style='color:#555'><b>hint:</b> {html.escape(hint)}</div>"
                 if hint else "")
    return (f"<div style='color:#b71c1c;white-space:pre-wrap'><b>&#9888; {where}{kind}</b></div>"
            f"<div class='ckpt-error-message' style='color:#b71c1c;white-space:pre-wrap'>"
            f"{html.escape(what)}</div>{hint_html}")


def refusal_html(exc: BaseException, context: str = "") -> str:
    """A refusal in a box that cannot be missed (``div.ckpt-refusal``): :func:`error_parts_html` inside, the error's
    class name in ``data-error``."""
    return (f"<div class='ckpt-refusal' data-error='{html.escape(type(exc).__name__)}' style='border:1px solid "
            f"#e57373;border-left:5px solid #b71c1c;background:#fff5f5;padding:6px 10px;margin:6px 0'>"
            f"{error_parts_html(exc, context)}</div>")


def show_refusal(exc: BaseException, context: str = "") -> None:
    """Show ``exc`` in the notebook cell that runs this, as :func:`refusal_html` (an HTML output, kept in the saved
    notebook)."""
    from IPython.display import HTML, display

    display(HTML(refusal_html(exc, context)))


class Refused:
    """What :func:`refusals` caught: ``error`` (None: nothing was refused); true when something was."""

    def __init__(self):
        self.error: Optional[ckptlib.CkptError] = None

    def __bool__(self) -> bool:
        return self.error is not None


@contextlib.contextmanager
def refusals(context: str = ""):
    """``with refusals("plan") as refused: plan = ckptlib.plan_reshard(...)``: one of ckptlib's errors raised inside
    (a refusal, a cancel, memory or output trouble: a :class:`ckptlib.CkptError`) is shown with :func:`show_refusal`
    and not raised, so that the notebook goes on; ``refused.error`` holds it. Anything else (a bug) is raised."""
    refused = Refused()
    try:
        yield refused
    except ckptlib.CkptError as e:
        refused.error = e
        show_refusal(e, context)


def fits(pre) -> bool:
    """Whether a :class:`~ckptlib.analysis.verify.Preflight` says the plan fits this machine; when it does not, a
    refusal box says what does not fit (memory, disk) and what to do, and False is returned."""
    if pre.ok:
        return True
    short = ([f"memory: {pre.memory.message}"] if not pre.memory.fits else []) + \
        ([f"disk: {pre.disk_message}"] if not pre.disk_ok else [])
    show_refusal(ckptlib.CkptError("not enough memory or disk for this run (" + "; ".join(short) + ")",
                                   hint="free memory or disk, or point output_dir at a disk with room; the steps "
                                        "below are skipped"), "will it fit")
    return False


def guarded(context: str = "") -> Callable:
    """Decorator for a widget method used as a callback: exceptions go to ``self.errors`` (an
    :class:`ErrorArea`) instead of vanishing. The error area is cleared when the callback starts."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            self.errors.clear()
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:
                self.errors.show(e, context or fn.__name__.strip("_").replace("_", " "))
                return None

        return wrapper

    return deco


class WidgetObserver(ckptlib.Observer):
    """A :class:`ckptlib.Observer` that moves a progress bar and a status label (from the worker thread;
    it only sets values). Updates are throttled to ``hz`` per second."""

    def __init__(self, progress: widgets.FloatProgress, status: widgets.HTML, hz: float = 10.0):
        self.progress, self.status = progress, status
        self.min_gap = 1.0 / hz
        self._last = 0.0
        self.file = ""
        self.tensors = 0
        self.started = threading.Event()
        self.finished = False

    def on_start(self, plan):
        self.progress.value = 0.0
        self.progress.bar_style = "info"
        self.status.value = "started"
        self.started.set()

    def on_file(self, name):
        self.file = name
        self._status()

    def on_tensor(self, name):
        self.tensors += 1

    def on_bytes(self, done, total):
        now = time.monotonic()
        if now - self._last >= self.min_gap or done >= total:
            self._last = now
            self.progress.value = done / total if total else 1.0
            self._status(done, total)

    def _status(self, done: Optional[int] = None, total: Optional[int] = None):
        text = f"writing <code>{html.escape(self.file)}</code>"
        if done is not None:
            text += f" &mdash; {human_bytes(done)} of {human_bytes(total)}"
        self.status.value = text

    def on_finish(self, result):
        self.finished = True
        self.progress.value = 1.0
        self.progress.bar_style = "success"

    def on_error(self, error):
        self.progress.bar_style = "warning" if isinstance(error, ckptlib.Cancelled) else "danger"


# ============================================================================================ pipeline questions
#: the pipeline fields of the reshard wizard: plan_reshard's argument and the ``ckpt reshard`` option it is
PIPELINE_OPTIONS = {"pp_partition": "--pp-partition", "pp_layers": "--pp-layers", "pp_tied": "--pp-tied"}


def tied_uses(value: Union[None, str, dict]) -> Optional[dict]:
    """``pp_tied`` as :func:`ckptlib.plan_reshard` takes it, ``{key: [layer, ...]}``, from a notebook parameter or a
    field: None or empty: None; a dict as it is; a string ``"KEY:I,J"`` (several separated by spaces or ``;``) read
    as ``ckpt reshard --pp-tied`` reads it."""
    if value is None or isinstance(value, dict):
        return value or None
    items = [t for t in re.split(r"[\s;]+", str(value).strip()) if t]
    return parse_tied(items) if items else None


def asked_options(exc: BaseException) -> list:
    """The pipeline options (:data:`PIPELINE_OPTIONS` keys) a :class:`~ckptlib.errors.PipelineUnknownError` asks
    for: those its message names and, when it has a hint of its own, those its hint names (a refusal that needs the
    tied modules' layers says ``--pp-tied``); a refusal naming none asks for the whole description, as its default
    hint does."""
    what, hint = message_and_hint(exc)
    said = what + ("" if hint == PipelineUnknownError.default_hint else " " + (hint or ""))
    named = [k for k, flag in PIPELINE_OPTIONS.items() if re.search(re.escape(flag) + r"\b", said)]
    return named or list(PIPELINE_OPTIONS)


def option_example(exc: BaseException, option: str) -> str:
    """The example value a refusal's hint gives for ``option`` (``"e.g. --pp-tied embed:0,5"``: ``"embed:0,5"``);
    "" when it gives none."""
    _, hint = message_and_hint(exc)
    m = re.search(r"e\.g\.\s+" + re.escape(PIPELINE_OPTIONS[option]) + r"\s+(\S+)", hint or "")
    return m.group(1).rstrip(".,;)") if m else ""


# ============================================================================================ paths
def repo_root() -> Optional[Path]:
    """The source tree ckptlib runs from (with ``samples/``), when it runs from one."""
    root = Path(ckptlib.__file__).resolve().parents[1]
    return root if (root / "samples").is_dir() else None


SAMPLE = "samples/zero2_bf16_w2/ckpt"


def find_path(path: Union[str, os.PathLike], must_exist: bool = True) -> Path:
    """Resolve a path given in a notebook robustly: as given (absolute, or relative to the current
    folder), else relative to a parent of the current folder, else relative to ckptlib's source tree's
    ``notebooks/`` or the tree itself (so ``../samples/...`` finds the bundled sample wherever the
    kernel runs). Returns the first that exists; with
    ``must_exist=False`` a path that exists nowhere is returned relative to the current folder."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p.resolve()
    here = Path.cwd()
    candidates = [parent / p for parent in list(here.parents)[:3]]
    root = repo_root()
    if root is not None:  # a path written relative to notebooks/ (or to the source tree)
        candidates += [root / "notebooks" / p, root / p]
    for c in candidates:
        if c.exists():
            return c.resolve()
    if must_exist:
        raise FileNotFoundError(f"{path}: not found here ({here}), in its parents, or in {root}")
    return (here / p).resolve()


def sample_checkpoint() -> Path:
    """The bundled sample checkpoint (ZeRO-2, bf16, 2 ranks)."""
    return find_path(SAMPLE)


def notebook_setup(checkpoint_dir: Union[str, os.PathLike],
                   output_dir: Union[str, os.PathLike] = "output") -> tuple["ckptlib.Checkpoint", Path]:
    """What every notebook does first: resolve its ``checkpoint_dir`` and ``output_dir`` parameters (see
    :func:`find_path`) and open the checkpoint (metadata only). Returns ``(checkpoint, output_dir)``."""
    try:
        found = find_path(checkpoint_dir)
    except FileNotFoundError as e:  # said as ckpt says it (a refusal, not a traceback)
        raise ckptlib.NotACheckpointError(str(e), hint="set checkpoint_dir in the notebook's first cell to the folder "
                                                        "given to engine.save_checkpoint, a tag folder or an HF "
                                                        "checkpoint-N folder") from None
    ckpt = ckptlib.open_checkpoint(found)
    return ckpt, find_path(output_dir, must_exist=False)


def as_checkpoint(checkpoint: Union["ckptlib.Checkpoint", str, os.PathLike]) -> "ckptlib.Checkpoint":
    if isinstance(checkpoint, ckptlib.Checkpoint):
        return checkpoint
    return ckptlib.open_checkpoint(find_path(checkpoint))


def png_image(cls: str) -> widgets.Image:
    """An ``Image`` widget for PNGs, with a CSS class to find it by; hidden until :func:`set_png` gives it
    something to draw (an empty image would show as a blank box)."""
    img = widgets.Image(format="png", layout=widgets.Layout(max_width="100%", height="auto", display="none"))
    img.add_class(cls)
    return img


def set_png(img: widgets.Image, png: bytes) -> None:
    """Show ``png`` at its own size (shrunk to fit, never stretched). Safe from any thread."""
    if png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) >= 24:
        width = int.from_bytes(png[16:20], "big")
        if img.layout.width != f"{width}px":
            img.layout.width = f"{width}px"
    img.value = png
    if png and img.layout.display == "none":
        img.layout.display = ""


def full_labels(widget: widgets.Widget) -> widgets.Widget:
    """Give every description of ``widget`` and the widgets inside it the room its text needs (ipywidgets
    cuts a label longer than its fixed width to "tensor ra…" otherwise); returns ``widget``."""
    style = getattr(widget, "style", None)
    if style is not None and style.has_trait("description_width"):
        style.description_width = "initial"
    for child in getattr(widget, "children", ()):
        full_labels(child)
    return widget
