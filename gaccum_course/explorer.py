"""An explorer: controls -> compute -> draw, the plot redrawn in place on every change.

An :class:`Explorer` owns some controls, a ``compute(**values)`` function and a
``draw(result, figure)`` function. On every change it recomputes, redraws the figure and
puts the PNG into an ``ipywidgets.Image`` -- so the plot changes in place, the static site
keeps the last picture in the saved widget state, and a test can read everything from
:attr:`Explorer.state` (nbmake never sees widget output, and exceptions raised inside widget
callbacks never fail a cell on their own).

A plain ``draw`` function draws on a cleared figure every time. A :class:`Drawing` makes the
axes, lines, legend and loss surface once, and on a change only sets the new data of those
artists; it names the artists that move at every change, and the explorer draws only those
and what changed around them (:class:`_Layers`: Matplotlib's blitting, an axes at a time), so
the lessons' explorers (:mod:`gaccum_course.widgets`) answer a slider move in under 100 ms
(``make bench``). Everything is drawn with Matplotlib's own Agg canvas and encoded by Pillow.

Bad values never break the widget: the error is shown under the controls, recorded in
``state.error``, and the last good plot stays. With ``strict=True`` (tests) it is re-raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import io
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import ipywidgets as widgets
import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from PIL import Image

from gaccum_lib._threads import single_thread

from .style import RC

DPI = 72  # a widget answers in under 100 ms at this resolution (see `make bench`)
# zlib's fastest: an explorer's PNG is 47-50 KB in 7.4 ms, and 51 KB in 11.1 ms at Pillow's default (6)
PNG_COMPRESS_LEVEL = 1


class Drawing:
    """A figure drawn once and then updated in place, for :class:`Explorer`.

    ``build(figure, result)`` makes the axes and artists for the first result and returns them
    (any object: the "parts"); ``update(parts, result)`` changes their data for every later
    result. A new figure (or :meth:`reset`) builds again. Called as ``drawing(result, figure)``,
    like a plain draw function.

    ``moving(parts)``, if given, returns the artists whose data changes at every update (the
    lines, a moving label). They are made animated (Matplotlib's blitting): the figure's
    ordinary draw leaves them out and the explorer draws them on top of the rest, so that a
    change that moves only them draws nothing else again (an artist returned once stays
    animated). An update should leave the rest as it was, limits included, where nothing about
    it changed: setting an axes' limits, even to the ones it has, marks it stale, and a stale
    axes is drawn again.
    """

    def __init__(self, build, update, moving=None):
        self._build, self._update, self._moving = build, update, moving
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
        for artist in self.moving():  # new ones too (an update may make its lines again)
            artist.set_animated(True)

    def moving(self) -> list:
        """The artists that move at every update (drawn over the rest), in the order to draw them."""
        if self._moving is None or self.parts is None:
            return []
        return list(self._moving(self.parts))

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
        self.canvas = FigureCanvasAgg(self.figure)  # one canvas (and renderer) for every redraw
        self.layers = _Layers(self.canvas)  # what a Drawing's figure looked like, to draw only what changed
        self._encoded = None  # the last picture and its PNG
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
        if isinstance(self.draw, Drawing):
            self.layers.draw(self.draw.moving())
        else:  # a figure drawn anew every time: nothing to keep
            self.canvas.draw()
        rgba = np.asarray(self.canvas.buffer_rgba())
        if self._encoded is not None and np.array_equal(rgba, self._encoded[0]):
            return self._encoded[1]  # the same picture (a slider moved back and forth): encoded already
        # Opaque: its RGB (a quarter less to compress) is the picture. (canvas.print_png would draw it again.)
        out = io.BytesIO()
        Image.fromarray(rgba[:, :, :3]).save(out, format="png", compress_level=PNG_COMPRESS_LEVEL)
        self._encoded = (rgba.copy(), out.getvalue())
        return self._encoded[1]

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


class _Layers:
    """Draws a :class:`Drawing`'s figure by Matplotlib's blitting, an axes at a time.

    A picture is put together from 1. the background: the figure without its axes (patch,
    legends, texts; ``canvas.draw()`` with the axes set animated meanwhile) and the axes' titles
    (``figure.draw_artist``), kept with ``canvas.copy_from_bbox`` and drawn again when the canvas
    changed size, an axes moved, or one of those artists is stale (Matplotlib's ``Artist.stale``:
    changed since it was last drawn); 2. each axes without its title and animated artists (its
    frame: patch, grid, ticks, labels, loss surface), pasted with ``canvas.restore_region`` from
    the last picture where the axes is not stale, drawn again (``figure.draw_artist``) where it
    is; 3. the moving artists (:meth:`Drawing.moving`), drawn over everything.

    Matplotlib draws the axes before a figure's legend, each axes over the ones before it, and a
    title over its axes' ticks; that order matters only where they share pixels. So the pixels
    an axes painted (those that changed when it was drawn; its box: them and the axes' box) must
    be apart from the background's and the other axes' boxes. Where they are not (a legend over
    an axes, tick labels reaching the next axes), the picture is Matplotlib's blitting of the
    whole figure (``canvas.draw()``, the moving artists over it), pasted while nothing but the
    moving artists changes (``figure.stale``). A title that Matplotlib places itself (``set_title``
    without ``y``: lifted over an offset text) moves when its axes is drawn: found so, it is drawn
    with its axes from then on. What does not mark an artist stale (a text inside a legend
    changed) is not seen, as a Matplotlib window would not see it either; a figure with a layout
    engine or subfigures is drawn whole.
    """

    def __init__(self, canvas):
        self.canvas = canvas
        self.background = None  # (canvas size, dpi, axes' places; titles; region; pixels its artists painted)
        self.frames: dict = {}  # axes -> (box, region, the pixels it painted in its box) in the last picture
        self.titles_placed = set()  # axes whose title Matplotlib places (drawn with the axes)
        self.whole = None  # (canvas size and dpi, the figure drawn whole) while layers' pixels meet

    def draw(self, moving: list) -> None:
        canvas, figure = self.canvas, self.canvas.figure
        axes = [ax for ax in figure.axes if ax.get_visible() and not ax.get_animated()]
        if figure.get_layout_engine() is not None or figure.subfigs:
            canvas.draw()
            return self._draw_moving(moving)
        size = (*canvas.get_width_height(physical=True), figure.dpi)
        if self.whole is not None and self.whole[0] == size and not figure.stale:
            canvas.restore_region(self.whole[1])  # the whole figure as last drawn: only the moving artists changed
            return self._draw_moving(moving)
        self.whole = None
        self.titles_placed &= set(axes)
        titles = [ax.title for ax in axes if ax not in self.titles_placed and ax.title.get_visible()
                  and ax.title.get_text()]
        # The titles, and what the figure's artists may be placed by: its size, and its axes' places.
        key = (*size, *(tuple(ax.bbox.bounds) for ax in axes))
        others = [a for a in figure.get_children() if a not in figure.axes]
        if (self.background is None or self.background[:2] != (key, titles)
                or any(a.stale for a in others + titles)):
            self._draw_background(key, titles, figure, others)
        canvas.restore_region(self.background[2])
        self.frames = {ax: frame for ax, frame in self.frames.items() if ax in axes}
        with _left_out(titles):
            for ax in axes:
                if ax not in self.frames or ax.stale:
                    self.frames[ax] = self._draw_frame(ax)
                else:
                    canvas.restore_region(self.frames[ax][1])
        placed = {title.axes for title in titles if title.stale}  # moved by Matplotlib as its axes was drawn
        painted = self.background[3]
        frames = [(self.frames[ax][0], self.frames[ax][2]) for ax in axes]
        if placed or any(_meet(a, b) for i, a in enumerate(frames) for b in frames[i + 1:]) or \
                any((painted[y0:y1, x0:x1] & mask).any() for (x0, y0, x1, y1), mask in frames):
            self.titles_placed |= placed
            self.frames.clear()
            canvas.draw()
            if not placed:  # (placed titles: in layers again next time, with their axes)
                self.whole = (size, canvas.copy_from_bbox(figure.bbox))
        return self._draw_moving(moving)

    def _draw_moving(self, moving: list) -> None:
        for artist in moving:
            self.canvas.figure.draw_artist(artist)

    def _pixels(self) -> np.ndarray:
        """The canvas's pixels, one uint32 per RGBA pixel, rows from the top (a view)."""
        return np.asarray(self.canvas.buffer_rgba()).view(np.uint32)[:, :, 0]

    def _draw_background(self, key, titles, figure, others) -> None:
        # The figure's patch alone, then with its other artists and the titles: the pixels those paint.
        with _left_out([*figure.axes, *(artist for artist in others if artist is not figure.patch)]):
            self.canvas.draw()
        bare = self._pixels().copy()
        with _left_out(figure.axes):
            self.canvas.draw()
        for title in titles:
            figure.draw_artist(title)
        painted = self._pixels() != bare
        self.background = (key, titles, self.canvas.copy_from_bbox(figure.bbox), painted)
        self.frames.clear()  # they hold the old background's pixels

    def _draw_frame(self, ax) -> tuple:
        """Draw the axes (its animated artists left out): its box, its pixels there, those it painted."""
        before = self._pixels().copy()
        self.canvas.figure.draw_artist(ax)
        changed = self._pixels() != before
        rows, columns = np.flatnonzero(changed.any(axis=1)), np.flatnonzero(changed.any(axis=0))
        (height, width), box = changed.shape, ax.bbox  # the axes' box (display: y upwards) in the buffer's pixels
        x0, y0 = max(math.floor(box.x0), 0), max(height - math.ceil(box.y1), 0)
        x1, y1 = min(math.ceil(box.x1), width), min(height - math.floor(box.y0), height)
        if rows.size:
            x0, y0 = min(x0, columns[0]), min(y0, rows[0])
            x1, y1 = max(x1, columns[-1] + 1), max(y1, rows[-1] + 1)
        region = self.canvas.copy_from_bbox(Bbox.from_extents(x0, height - y1, x1, height - y0))
        return (x0, y0, x1, y1), region, changed[y0:y1, x0:x1]


@contextlib.contextmanager
def _left_out(artists):
    """The artists set animated meanwhile: a figure's draw leaves them out."""
    changed = [artist for artist in artists if not artist.get_animated()]
    for artist in changed:
        artist.set_animated(True)
    try:
        yield
    finally:
        for artist in changed:
            artist.set_animated(False)


def _meet(a: tuple, b: tuple) -> bool:
    """Whether of two frames (box x0, y0, x1, y1; the pixels painted in it) one painted in the other's box."""
    (ax0, ay0, ax1, ay1), a_painted, (bx0, by0, bx1, by1), b_painted = *a, *b
    x0, y0, x1, y1 = max(ax0, bx0), max(ay0, by0), min(ax1, bx1), min(ay1, by1)
    return x0 < x1 and y0 < y1 and bool(a_painted[y0 - ay0:y1 - ay0, x0 - ax0:x1 - ax0].any()
                                        or b_painted[y0 - by0:y1 - by0, x0 - bx0:x1 - bx0].any())


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
