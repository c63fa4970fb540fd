"""An explorer: controls -> compute -> draw, the plot redrawn in place on every change.

An :class:`Explorer` owns some controls, a ``compute(**values)`` function and a
``draw(result, figure)`` function. On every change it recomputes, redraws the figure and
puts the PNG into an ``ipywidgets.Image`` -- so the plot changes in place, the static site
keeps the last picture in the saved widget state, and a test can read everything from
:attr:`Explorer.state` (nbmake never sees widget output, and exceptions raised inside widget
callbacks never fail a cell on their own).

A plain ``draw`` function draws on a cleared figure every time. A :class:`Drawing` makes the
axes, lines, legend and loss surface once, and on a change only sets the new data of those
artists -- most of a redraw's time was making axes and ticks again -- so the lessons'
explorers (:mod:`gaccum_course.widgets`) answer a slider move in under 100 ms (``make bench``).

Bad values never break the widget: the error is shown under the controls, recorded in
``state.error``, and the last good plot stays. With ``strict=True`` (tests) it is re-raised.
"""

from __future__ import annotations

import hashlib
import html
import io
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import ipywidgets as widgets
import matplotlib
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from gaccum_lib._threads import single_thread

from ._canvas import ExplorerCanvas, png_bytes
from .style import RC

DPI = 72  # a widget answers in under 100 ms at this resolution (see `make bench`)


class Drawing:
    """A figure drawn once and then updated in place, for :class:`Explorer`.

    ``build(figure, result)`` makes the axes and artists for the first result and returns them
    (any object: the "parts"); ``update(parts, result)`` changes their data for every later
    result. A new figure (or :meth:`reset`) builds again. Called as ``drawing(result, figure)``,
    like a plain draw function.
    """

    def __init__(self, build, update):
        self._build, self._update = build, update
        self.figure = None
        self.parts = None
        self.builds = 0

    def __call__(self, result, figure) -> None:
        if self.figure is not figure:
            figure.clf()
            self.parts = self._build(figure, result)
            self.figure = figure
            self.builds += 1
        else:
            self._update(self.parts, result)

    def reset(self) -> None:
        """Build from scratch on the next call (a fresh draw)."""
        self.figure = self.parts = None


class _Memo:
    """The last few results of a function, keyed on its arguments (a slider moved back answers at once)."""

    def __init__(self, function, size: int = 64):
        self.function, self.size = function, size
        self.results: OrderedDict = OrderedDict()
        self.calls = 0  # how often the function itself ran, for tests

    def __call__(self, *args):
        if args in self.results:
            self.results.move_to_end(args)
            return self.results[args]
        self.calls += 1
        result = self.results[args] = self.function(*args)
        if len(self.results) > self.size:
            self.results.popitem(last=False)
        return result


@dataclass
class ExplorerState:
    """Everything an explorer did, for tests and benchmarks to read."""

    values: dict
    result: object = None
    error: str | None = None
    summary: str = ""
    refreshes: int = 0
    image_digest: str = ""
    compute_ms: list = field(default_factory=list)
    draw_ms: list = field(default_factory=list)

    @property
    def answer_ms(self) -> list:
        """Compute + redraw time of every refresh, in milliseconds."""
        return [c + d for c, d in zip(self.compute_ms, self.draw_ms, strict=True)]


class Explorer:
    """Controls -> compute -> draw, redrawn in place on every change."""

    def __init__(self, controls: dict, compute, draw, *, summarize=None, title: str = "",
                 figsize=(10, 4.4), strict: bool = False, button: str | None = None, busy: str = ""):
        if not controls:
            raise ValueError("controls must hold at least one widget")
        self.controls = dict(controls)
        self.compute = compute
        self.draw = draw
        self.summarize = summarize
        self.strict = strict
        self.figure = Figure(figsize=figsize, dpi=DPI)
        self.canvas = ExplorerCanvas(self.figure)  # one canvas (and renderer) for every redraw
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.message = widgets.HTML()
        self.caption = widgets.HTML()
        header = [widgets.HTML(f"<b>{html.escape(title)}</b>")] if title else []
        row = list(self.controls.values())
        # With a button, changes wait for a click (for slow computations such as real launches).
        self.button = widgets.Button(description=button, button_style="primary") if button else None
        self.busy = busy
        if self.button is not None:
            self.button.on_click(lambda _button: self.refresh())
            row.append(self.button)
        self.widget = widgets.VBox([*header, widgets.HBox(row, layout=widgets.Layout(flex_flow="row wrap")),
                                    self.message, self.image, self.caption])
        self.state = ExplorerState(values=self.values)
        self._holding = False
        if self.button is None:
            for control in self.controls.values():
                control.observe(self._on_change, names="value")
        self.refresh()

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _on_change(self, _change) -> None:
        if not self._holding:
            self.refresh()

    def set(self, **values) -> ExplorerState:
        """Set several controls at once (one recompute), as a learner moving sliders would."""
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ValueError(f"unknown control(s) {unknown}; this explorer has {sorted(self.controls)}")
        for name, value in values.items():
            _check_control_value(name, self.controls[name], value)
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._holding = False
        self.refresh()
        return self.state

    def refresh(self) -> None:
        with single_thread():
            self._refresh()

    def _refresh(self) -> None:
        values = self.values
        self.state.values = values
        if self.busy:
            self.message.value = f"<i>{html.escape(self.busy)}</i>"
        start = time.perf_counter()
        try:
            result = self.compute(**values)
        except (ValueError, TypeError, RuntimeError) as exc:
            self.state.error = f"{type(exc).__name__}: {exc}" if isinstance(exc, RuntimeError) else str(exc)
            self.message.value = f"<span style='color:#D55E00'>&#9888; {html.escape(str(exc))}</span>"
            if self.strict:
                raise
            return
        computed = time.perf_counter()
        # The suite's readable style whatever the kernel's rcParams are (the same picture in every notebook).
        with matplotlib.rc_context(RC):
            if not isinstance(self.draw, Drawing):
                self.figure.clf()
            self.draw(result, self.figure)
            self.image.value = self._png()
        drawn = time.perf_counter()
        self.state.result = result
        self.state.error = None
        self.message.value = ""
        self.state.summary = self.summarize(result) if self.summarize else ""
        self.caption.value = f"<i>{html.escape(self.state.summary)}</i>" if self.state.summary else ""
        self.state.refreshes += 1
        self.state.image_digest = hashlib.sha1(self.image.value).hexdigest()
        self.state.compute_ms.append((computed - start) * 1000)
        self.state.draw_ms.append((drawn - computed) * 1000)

    def pixels(self) -> np.ndarray:
        """The picture shown now, as an (height, width, 4) array of RGBA bytes."""
        return np.asarray(Image.open(io.BytesIO(self.image.value)).convert("RGBA"))

    def _png(self) -> bytes:
        """Render the figure on the explorer's own canvas and encode it as PNG."""
        self.canvas.draw()
        # The figure is opaque: its RGB, a quarter less to compress than RGBA, is the same picture.
        return png_bytes(np.asarray(self.canvas.buffer_rgba()))

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def _check_control_value(name: str, control, value) -> None:
    """Refuse what a slider would silently clamp, or a menu would reject with a bare TraitError."""
    if hasattr(control, "options"):
        options = [o[1] if isinstance(o, tuple) else o for o in control.options]
        if value not in options:
            raise ValueError(f"{name} must be one of {options}, got {value!r}")
        return
    if hasattr(control, "min") and hasattr(control, "max"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if isinstance(control, widgets.IntSlider) and value != int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if not control.min <= value <= control.max:
            raise ValueError(f"{name} must be in [{control.min}, {control.max}], got {value}")
