"""The explorers: state a test can read, plots that change, errors that are clear and survivable."""

import io

import ipywidgets
import matplotlib
import matplotlib.axes
import matplotlib.legend
import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image

from gaccum_course.style import RC
from gaccum_course.widgets import (
    Drawing,
    Explorer,
    launch_explorer,
    regression_explorer,
    schedule_explorer,
    trainer_count_explorer,
    variable_length_explorer,
)


def test_moving_a_slider_recomputes_and_redraws():
    explorer = variable_length_explorer(strict=True)
    before = explorer.state.image_digest
    explorer.controls["grad_accum_steps"].value = 8  # what a learner's slider does
    assert explorer.state.refreshes == 2
    assert explorer.state.image_digest != before
    assert explorer.state.values["grad_accum_steps"] == 8
    _, runs = explorer.state.result
    assert runs["token_normalised"].grad_accum_steps == 8


def test_set_changes_several_controls_with_one_recompute():
    explorer = variable_length_explorer(strict=True)
    explorer.set(grad_accum_steps=2, micro_batch_size=4, spread=0.0)
    assert explorer.state.refreshes == 2
    _, runs = explorer.state.result
    assert runs["mean_of_means"].max_difference(runs["full_batch"]) < 1e-6  # spread 0: naive exact


def test_values_outside_a_slider_are_refused_not_clamped():
    explorer = variable_length_explorer(strict=True)
    with pytest.raises(ValueError, match=r"grad_accum_steps must be in \[1, 8\], got 9"):
        explorer.set(grad_accum_steps=9)
    with pytest.raises(TypeError, match="micro_batch_size must be an int, got 2.5"):
        explorer.set(micro_batch_size=2.5)
    with pytest.raises(ValueError, match=r"unknown control\(s\) \['gradient_steps'\]"):
        explorer.set(gradient_steps=2)
    with pytest.raises(ValueError, match=r"grad_accum_steps must be one of \[1, 2, 4, 8\], got 3"):
        regression_explorer(strict=True).set(grad_accum_steps=3)
    assert explorer.state.refreshes == 1 and explorer.state.error is None


def test_a_compute_error_is_shown_and_the_widget_keeps_working():
    calls = []

    def compute(n):
        calls.append(n)
        if n == 3:
            raise ValueError("n must not be 3 (a demonstration)")
        return n

    import ipywidgets

    explorer = Explorer({"n": ipywidgets.IntSlider(value=1, min=1, max=5)}, compute,
                        lambda result, figure: figure.subplots().plot([0, result]))
    good = explorer.state.image_digest
    explorer.controls["n"].value = 3
    assert explorer.state.error == "n must not be 3 (a demonstration)"
    assert "n must not be 3" in explorer.message.value
    assert explorer.state.image_digest == good  # the last good plot stays
    explorer.controls["n"].value = 4
    assert explorer.state.error is None and explorer.message.value == ""
    assert explorer.state.result == 4 and explorer.state.image_digest != good
    assert calls == [1, 3, 4]


def test_strict_mode_reraises_for_tests():
    import ipywidgets

    explorer = Explorer({"n": ipywidgets.IntSlider(value=1, min=1, max=5)},
                        lambda n: 1 / 0 if n == 2 else n, lambda r, f: f.subplots(), strict=True)
    with pytest.raises(ZeroDivisionError):
        explorer.set(n=2)


def test_regression_explorer_claims():
    explorer = regression_explorer(strict=True)
    for ga in (1, 2, 4, 8):
        result = explorer.set(grad_accum_steps=ga, epochs=1).result
        full, plain, forgot = (result[k].final_weights[0] for k in ("full batch", "plain: loss / GA", "forgot / GA"))
        assert abs(plain - full) < 1e-6 and abs(forgot / full - ga) < 1e-5
    assert explorer.state.summary.startswith("After 1 update:")


def test_schedule_explorer_shows_the_three_sizings():
    explorer = schedule_explorer(strict=True)
    lrs = explorer.set(num_processes=4, grad_accum_steps=4, epochs=2).result
    assert set(lrs) == {"updates", "micro_batches", "sharded_updates"}
    assert (lrs["sharded_updates"] == 0).any() and not (lrs["updates"] == 0).any()


def test_trainer_count_explorer_is_one_minus_one_over_the_row_length():
    explorer = trainer_count_explorer(strict=True)
    for length in (4, 100):
        fraction = explorer.set(mean_length=length, spread=0.0, grad_accum_steps=4).result["fraction"]
        assert len(fraction) == 8 and np.allclose(fraction, 1 - 1 / length, rtol=0, atol=1e-12)
    varied = explorer.set(mean_length=20, spread=1.0, grad_accum_steps=1).result["fraction"]
    assert varied.min() < 0.95 < varied.max() < 1.0  # windows of different lengths lose different shares
    assert "first window:" in explorer.state.summary
    with pytest.raises(ValueError, match="mean_length"):
        explorer.set(mean_length=1)


@pytest.mark.real
def test_launch_explorer_runs_real_processes_on_click():
    explorer = launch_explorer(strict=True)
    first = explorer.state.result["real"]
    assert "MULTI_CPU" in first.source and first.token_counts.tolist() == [[52, 84]]
    explorer.controls["num_processes"].value = 3  # nothing happens until the button is pressed
    assert explorer.state.refreshes == 1
    explorer.button.click()
    real = explorer.state.result["real"]
    assert explorer.state.refreshes == 2 and real.num_processes == 3
    assert real.max_difference(explorer.state.result["simulated"]) < 1e-6
    assert np.ptp(real.rank_final_weights, axis=0).max() == 0.0


def test_epochs_control_sets_the_number_of_updates():
    explorer = variable_length_explorer(strict=True)
    _, one = explorer.state.result
    _, three = explorer.set(epochs=3).result
    assert three["token_normalised"].num_updates == 3 * one["token_normalised"].num_updates
    assert explorer.state.summary.startswith(f"{three['full_batch'].num_updates} updates")


# Draw once, then update (issue 23): for each explorer a move A, a move B, changing data and limits.
MOVES = {
    "regression": (regression_explorer, dict(grad_accum_steps=1, epochs=1),
                   dict(grad_accum_steps=8, lr=0.01, epochs=5)),
    "variable_length": (variable_length_explorer, dict(grad_accum_steps=8, spread=0.0),
                        dict(num_processes=3, spread=1.0, micro_batch_size=1, epochs=2)),
    "schedule": (schedule_explorer, dict(grad_accum_steps=8), dict(num_processes=1, epochs=4)),
    "trainer_count": (trainer_count_explorer, dict(mean_length=128), dict(mean_length=4, spread=0.0,
                                                                          grad_accum_steps=32)),
}


def drawn_afresh_at(make, values) -> Explorer:
    """An explorer whose figure was built from scratch with ``values`` (no earlier picture under it)."""
    explorer = make(strict=True)
    explorer.set(**values)
    explorer.draw.reset()
    explorer.refresh()
    assert explorer.draw.builds == 2
    return explorer


@pytest.mark.parametrize("name", MOVES)
def test_a_slider_move_updates_the_figure_without_building_it_again(name):
    make, a, b = MOVES[name]
    explorer = make(strict=True)
    figure, first = explorer.figure, explorer.pixels()
    axes, legends = list(figure.axes), list(figure.legends)
    lines = [list(ax.get_lines()) for ax in axes]
    explorer.set(**a)
    explorer.set(**b)
    assert explorer.draw.builds == 1 and explorer.state.refreshes == 3
    assert explorer.figure is figure and len(figure.axes) == len(axes)
    assert all(now is then for now, then in zip(figure.axes, axes, strict=True))
    assert all(now is then for now, then in zip(figure.legends, legends, strict=True))
    assert [list(ax.get_lines()) for ax in axes] == lines  # the same line objects, new data
    moved = explorer.pixels()
    assert (moved != first).any()
    # The same picture as a figure drawn where the controls are from scratch: nothing of the first
    # picture's or of A's lines, limits, ticks or surface stays.
    np.testing.assert_array_equal(moved, drawn_afresh_at(make, explorer.values).pixels())


def test_a_control_that_leaves_the_data_as_it_was_reuses_the_simulations():
    explorer = variable_length_explorer(strict=True)
    first, runs, corpora = explorer.pixels(), explorer.simulations.calls, explorer.corpora.calls
    assert (runs, corpora) == (3, 1)
    explorer.set(grad_accum_steps=8)  # three new runs on the same corpus
    assert (explorer.simulations.calls, explorer.corpora.calls) == (runs + 3, corpora)
    explorer.set(grad_accum_steps=4)  # back where it was: nothing simulated again
    assert (explorer.simulations.calls, explorer.corpora.calls) == (runs + 3, corpora)
    assert explorer.state.refreshes == 3 and explorer.draw.builds == 1
    np.testing.assert_array_equal(explorer.pixels(), first)

    regression = regression_explorer(strict=True)
    calls = regression.simulations.calls
    regression.set(grad_accum_steps=2)
    regression.set(grad_accum_steps=4)
    assert regression.simulations.calls == calls + 3


def test_a_bad_value_in_a_drawn_once_explorer_shows_the_error_and_keeps_the_last_picture():
    explorer = regression_explorer()  # not strict: as in a notebook
    compute = explorer.compute

    def refusing_seven(**values):
        if values["epochs"] == 7:
            raise ValueError("epochs must not be 7 (a demonstration)")
        return compute(**values)

    explorer.compute = refusing_seven
    explorer.set(epochs=5)
    last, summary = explorer.pixels(), explorer.state.summary
    explorer.set(epochs=7)
    assert explorer.state.error == "epochs must not be 7 (a demonstration)"
    assert "epochs must not be 7" in explorer.message.value
    np.testing.assert_array_equal(explorer.pixels(), last)
    assert explorer.state.summary == summary and explorer.draw.builds == 1
    explorer.set(epochs=2)  # and the next good value draws as if the error never was
    assert explorer.state.error is None and explorer.message.value == ""
    np.testing.assert_array_equal(explorer.pixels(), drawn_afresh_at(regression_explorer, dict(epochs=2)).pixels())


def matplotlibs_blitting(explorer) -> np.ndarray:
    """The explorer's figure as Matplotlib's own Agg canvas blits it: drawn whole, the moving artists over it."""
    figure = explorer.figure
    canvas = FigureCanvasAgg(figure)  # the figure's canvas from now on (the explorer's is left behind)
    with matplotlib.rc_context(RC):
        canvas.draw()
        for artist in explorer.draw.moving():
            figure.draw_artist(artist)
    return np.asarray(canvas.buffer_rgba()).copy()


@pytest.mark.parametrize("name", MOVES)
def test_the_picture_is_matplotlibs_own_after_slider_moves(name):
    make, a, b = MOVES[name]
    explorer = make(strict=True)
    explorer.set(**a)
    explorer.set(**b)  # some axes pasted from the last picture, some drawn again
    assert type(explorer.canvas) is FigureCanvasAgg
    shown = explorer.pixels()
    np.testing.assert_array_equal(shown[:, :, :3], np.asarray(explorer.canvas.buffer_rgba())[:, :, :3])
    assert (shown[:, :, 3] == 255).all()  # opaque: the PNG holds its RGB
    np.testing.assert_array_equal(shown, matplotlibs_blitting(explorer))


@pytest.mark.parametrize("make", [schedule_explorer, trainer_count_explorer])
def test_where_nothing_lies_over_the_moving_artists_the_picture_is_matplotlibs_ordinary_draw(make):
    # The Trainer count's bars move: its grid lines go under them, and what Matplotlib draws over
    # them (the line at 1, the frame around the axes) moves with them.
    explorer = make(strict=True)
    explorer.set(grad_accum_steps=1)
    saved = io.BytesIO()
    with matplotlib.rc_context(RC):
        explorer.figure.savefig(saved, format="png", dpi=explorer.figure.dpi)  # animated artists too
    np.testing.assert_array_equal(explorer.pixels(), np.asarray(Image.open(saved).convert("RGBA")))


def test_the_png_is_a_compressed_png_of_the_picture():
    explorer = trainer_count_explorer(strict=True)
    picture = Image.open(io.BytesIO(explorer.image.value))
    assert picture.format == "PNG" and picture.mode == "RGB"
    width, height = explorer.canvas.get_width_height()
    assert picture.size == (width, height) and len(explorer.image.value) < width * height * 3 / 10


def spy_on_draws(monkeypatch) -> list:
    """Every axes and figure legend Matplotlib draws from now on, in order."""
    drawn = []
    for cls in (matplotlib.axes.Axes, matplotlib.legend.Legend):
        original = cls.draw
        monkeypatch.setattr(cls, "draw", lambda self, renderer, original=original: (
            drawn.append(self), original(self, renderer))[1])
    return drawn


def test_a_move_draws_again_only_the_axes_that_changed(monkeypatch):
    explorer = variable_length_explorer(strict=True)
    path, distance = explorer.figure.axes
    limits = path.get_xlim(), path.get_ylim()
    drawn = spy_on_draws(monkeypatch)
    explorer.set(grad_accum_steps=8)  # new paths on the same loss surface, and new distances
    assert (path.get_xlim(), path.get_ylim()) == limits
    assert drawn == [distance]  # the paths drawn over the path panel's last picture; the legend kept
    drawn.clear()
    explorer.set(grad_accum_steps=4)
    explorer.set(grad_accum_steps=4)  # the same values again
    assert drawn == [distance]
    monkeypatch.undo()
    np.testing.assert_array_equal(explorer.pixels(), drawn_afresh_at(variable_length_explorer,
                                                                     explorer.values).pixels())


def two_panels(figure, result):
    """A Drawing's build for the next tests: two panels, moving lines, a legend below."""
    left, right = figure.subplots(1, 2)
    figure.subplots_adjust(bottom=0.3)
    lines = []
    for ax in (left, right):
        lines += ax.plot([0, 1, 2], [1, 3, 2], label="a") + ax.plot([0, 1, 2], [2, 1, 3], label="b")
        ax.set_xlabel("x")
        ax.set_ylabel("y")
    left.set_title("a title", y=1.0)  # drawn once, with the background
    right.set_title("a title placed by Matplotlib")  # drawn with its axes
    figure.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=2)
    parts = {"lines": lines, "left": left, "right": right, "legend": figure.legends[0]}
    change(parts, result)
    return parts


def change(parts, result):
    """Move the lines (each result), and make the change the result names (once)."""
    for i, line in enumerate(parts["lines"]):
        line.set_ydata(np.array([1.0, 3.0, 2.0]) + 0.1 * i + 0.05 * result["n"])
    left, legend, figure = parts["left"], parts["legend"], parts["left"].get_figure(root=True)
    what = result["what"]
    if parts.get("made") == what:
        return
    parts["made"] = what
    if what == "limits":
        left.set_ylim(0, 5)
    elif what == "titles":
        left.set_title("another title", y=1.0)
        parts["right"].set_title("another title placed by Matplotlib")
    elif what == "tick parameters":
        left.tick_params(labelsize=14)
    elif what == "grid off":
        left.grid(False)
    elif what == "legend moved":
        legend.set_bbox_to_anchor((0.5, 0.1), transform=figure.transFigure)
    elif what == "figure text":
        figure.text(0.02, 0.02, "a note")
    elif what == "legend over the axes":  # Matplotlib draws it over them: pasting must not hide it
        legend.set_bbox_to_anchor((0.5, 0.5), transform=figure.transFigure)
    elif what == "axes moved":
        left.set_position([0.1, 0.4, 0.3, 0.4])


def two_panel_explorer(what, *, n=0, now="nothing"):
    """An explorer of :func:`two_panels` whose changes are "nothing" and ``what``, at ``n`` and ``now``."""
    controls = {"n": ipywidgets.IntSlider(value=n, min=0, max=5),
                "what": ipywidgets.Dropdown(options=["nothing", what], value=now)}
    return Explorer(controls, lambda n, what: {"n": n, "what": what},
                    Drawing(two_panels, change, lambda parts: parts["lines"]), strict=True)


@pytest.mark.parametrize("what", ["limits", "titles", "tick parameters", "grid off", "legend moved", "figure text",
                                  "legend over the axes", "axes moved"])
def test_whatever_changes_the_picture_is_the_one_drawn_afresh(what, monkeypatch):
    explorer = two_panel_explorer(what)
    explorer.set(n=1)
    drawn = spy_on_draws(monkeypatch)
    explorer.set(n=2)  # only the lines move: neither axes nor the legend drawn again
    assert drawn == []
    explorer.set(what=what, n=3)
    assert drawn  # something was drawn again
    np.testing.assert_array_equal(explorer.pixels(), two_panel_explorer(what, n=3, now=what).pixels())
    drawn.clear()
    explorer.set(n=4)  # only the lines again: pasted, layer by layer or the whole figure
    assert drawn == []
    monkeypatch.undo()
    shown = explorer.pixels()
    np.testing.assert_array_equal(shown, two_panel_explorer(what, n=4, now=what).pixels())
    np.testing.assert_array_equal(shown, matplotlibs_blitting(explorer))


def test_where_layers_overlap_the_whole_figure_is_blitted_until_something_else_changes(monkeypatch):
    explorer = two_panel_explorer("legend over the axes", now="legend over the axes")
    explorer.set(n=1)  # (the first picture found the right title placed by Matplotlib: with its axes now)
    drawn = spy_on_draws(monkeypatch)
    explorer.set(n=2)
    assert drawn == []  # the whole figure as last drawn, the lines over it
    explorer.figure.axes[0].set_ylim(-5, 9)  # a change outside the lines: drawn again
    explorer.set(n=3)
    assert explorer.figure.legends[0] in drawn
    monkeypatch.undo()
    np.testing.assert_array_equal(explorer.pixels(), matplotlibs_blitting(explorer))
