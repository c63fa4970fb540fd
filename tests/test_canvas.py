"""The explorers' canvas (gaccum_course._canvas): its shortcuts must leave plain Agg's pixels.

It works out each axis's ticks once per draw, places titles without measuring where nothing can
sit above the axes, pastes an axis or a legend whose state and the pixels under it did not
change, and encodes its own PNG. Below: that the shortcuts are taken (pasting when only lines
change), that they are not where taking them would be wrong (ticks on top, an offset text, a
changed axis or legend, a text under it), and that the pixels are plain Agg's in every case.
"""

import matplotlib
import matplotlib.axis
import matplotlib.legend
import numpy as np
import pytest
from matplotlib.figure import Figure
from plain_agg import plain_agg_pixels

from gaccum_course import _canvas
from gaccum_course._canvas import ExplorerCanvas
from gaccum_course.style import RC


def explorer_canvas(figure) -> np.ndarray:
    with matplotlib.rc_context(RC):
        canvas = ExplorerCanvas(figure)
        canvas.draw()
        return np.asarray(canvas.buffer_rgba()).copy()


def two_panels():
    """Two panels and a legend below, as an explorer draws them (the suite's style: grid lines on)."""
    figure = Figure(figsize=(8, 4), dpi=72)
    with matplotlib.rc_context(RC):
        left, right = figure.subplots(1, 2)
    figure.subplots_adjust(bottom=0.3)
    for ax in (left, right):
        ax.plot([0, 1, 2], [1, 3, 2], label="a")
        ax.plot([0, 1, 2], [2, 1, 3], label="b")
        ax.set_title("a title")
        ax.set_xlabel("x")
        ax.set_ylabel("y")
    figure.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=2)
    return figure, left, right


@pytest.mark.parametrize("case", ["plain", "ticks on top", "x label on top", "offset text", "low title",
                                  "twin axes", "log axis"])
def test_titles_and_ticks_come_out_where_plain_agg_puts_them(case):
    figure, left, right = two_panels()
    if case == "ticks on top":
        left.xaxis.tick_top()
    elif case == "x label on top":
        left.xaxis.set_label_position("top")
    elif case == "offset text":  # a "+1e5" above the y tick labels: Matplotlib lifts a left title over it
        left.lines[0].set_ydata([100_000.0, 100_000.3, 100_000.5])
        left.lines[1].set_ydata([100_000.1, 100_000.2, 100_000.4])
        left.relim()
        left.autoscale_view()
        left.set_title("a title on the left", loc="left")
    elif case == "low title":  # a pad smaller than the title's descent: Matplotlib lifts it
        left.set_title("a title with descenders: gjpqy", pad=0)
    elif case == "twin axes":
        left.twiny().set_xlabel("a top label")
    elif case == "log axis":
        right.set_yscale("log")
    np.testing.assert_array_equal(explorer_canvas(figure), plain_agg_pixels(figure))
    if case == "offset text":  # the case is what it says: there is an offset text
        assert left.yaxis.get_offset_text().get_text()


def test_after_a_draw_the_axes_are_plain_matplotlib_again():
    figure, left, right = two_panels()
    explorer_canvas(figure)
    for ax in (left, right):
        assert "_update_title_position" not in vars(ax)
        for axis in (ax.xaxis, ax.yaxis):
            assert not {"_update_ticks", "_get_ticklabel_bboxes"} & set(vars(axis))


def drawn_twice(change, monkeypatch):
    """An explorer's canvas drawing a figure, ``change(...)`` made, and drawing it again; plain Agg's too.

    Also returns how often the legend was drawn (not pasted) and how often an axis was.
    """
    figure, left, right = two_panels()
    canvas = ExplorerCanvas(figure)
    legend = figure.legends[0]
    draws = {"legend": 0, "axis": 0}
    for kind, cls in (("legend", matplotlib.legend.Legend), ("axis", matplotlib.axis.Axis)):
        original = cls.draw
        monkeypatch.setattr(cls, "draw", lambda self, renderer, kind=kind, original=original: (
            draws.__setitem__(kind, draws[kind] + 1), original(self, renderer))[1])
    with matplotlib.rc_context(RC):
        canvas.draw()
        change(figure, left, right, legend)
        canvas.draw()
    drawn = dict(draws)
    monkeypatch.undo()
    return np.asarray(canvas.buffer_rgba()).copy(), plain_agg_pixels(figure), drawn


def test_a_legend_and_axes_are_pasted_when_only_the_lines_change(monkeypatch):
    def move_lines(figure, left, right, legend):
        left.lines[0].set_ydata([3, 1, 2])  # inside the axes, limits kept
    ours, plain, drawn = drawn_twice(move_lines, monkeypatch)
    np.testing.assert_array_equal(ours, plain)
    assert drawn == {"legend": 1, "axis": 4}  # drawn once, pasted the second time


def test_an_axis_whose_limits_change_is_drawn_again(monkeypatch):
    def widen(figure, left, right, legend):
        left.set_ylim(0, 5)
    ours, plain, drawn = drawn_twice(widen, monkeypatch)
    np.testing.assert_array_equal(ours, plain)
    # The left y axis is drawn again, and the right one where its box (its labels between the
    # panels) reaches over the left panel's new grid lines; the x axes are pasted.
    assert drawn["legend"] == 1 and 4 + 1 <= drawn["axis"] <= 4 + 2


@pytest.mark.parametrize("change", ["text under it", "its text", "its place", "a handle hidden", "over it"])
def test_a_legend_is_drawn_again_when_it_or_what_lies_under_it_changes(change, monkeypatch):
    def make_change(figure, left, right, legend):
        if change == "text under it":
            figure.text(0.5, 0.05, "under the legend", ha="center", zorder=1)
        elif change == "its text":
            legend.get_texts()[0].set_text("a, renamed")
        elif change == "its place":
            legend.set_bbox_to_anchor((0.5, 0.1), transform=figure.transFigure)
        elif change == "a handle hidden":
            legend.legend_handles[1].set_visible(False)
        elif change == "over it":  # drawn after the legend, over it: the legend itself is pasted
            figure.text(0.5, 0.05, "over the legend", ha="center", zorder=10)
    ours, plain, drawn = drawn_twice(make_change, monkeypatch)
    np.testing.assert_array_equal(ours, plain)
    assert drawn["legend"] == (1 if change == "over it" else 2)


@pytest.mark.parametrize("change", ["tick parameters", "grid off", "label text", "label size",
                                    "one tick label's colour", "a tick mark hidden", "moved axes"])
def test_an_axis_is_drawn_again_when_it_changes(change, monkeypatch):
    def make_change(figure, left, right, legend):
        if change == "tick parameters":
            left.tick_params(labelsize=7)
        elif change == "grid off":
            left.grid(False)
        elif change == "label text":
            left.set_xlabel("another x")
        elif change == "label size":  # not marked stale by Matplotlib
            left.xaxis.label.set_fontsize(20)
        elif change == "one tick label's colour":  # not marked stale by Matplotlib either
            left.xaxis.get_major_ticks()[1].label1.set_color("red")
        elif change == "a tick mark hidden":
            left.xaxis.get_major_ticks()[1].tick1line.set_visible(False)
        elif change == "moved axes":
            left.set_position([0.1, 0.4, 0.3, 0.4])
    ours, plain, drawn = drawn_twice(make_change, monkeypatch)
    np.testing.assert_array_equal(ours, plain)
    assert drawn["axis"] > 4


def test_without_matplotlibs_tick_internals_draws_are_plain(monkeypatch):
    monkeypatch.setattr(_canvas, "_TICK_INTERNALS", False)
    figure, left, right = two_panels()
    during_draw = []
    original = matplotlib.axis.Axis.draw
    monkeypatch.setattr(matplotlib.axis.Axis, "draw", lambda self, renderer: (
        during_draw.append(set(vars(self)) & {"_update_ticks", "_get_ticklabel_bboxes", "draw"}),
        original(self, renderer))[1])
    np.testing.assert_array_equal(explorer_canvas(figure), plain_agg_pixels(figure))
    assert len(during_draw) == 8 and not any(during_draw)  # neither shadowed nor pasted, in both draws


def test_the_explorers_png_decodes_to_the_canvas_pixels():
    import io

    from PIL import Image

    figure, left, right = two_panels()
    rgba = explorer_canvas(figure)
    data = _canvas.png_bytes(rgba)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.format == "PNG" and decoded.mode == "RGB" and decoded.size == (rgba.shape[1], rgba.shape[0])
    np.testing.assert_array_equal(np.asarray(decoded), rgba[:, :, :3])
    assert len(data) < rgba.nbytes / 10  # compressed, not stored
