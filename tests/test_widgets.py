"""The explorers: state a test can read, plots that change, errors that are clear and survivable."""

import numpy as np
import pytest
from matplotlib.backends.backend_agg import RendererAgg
from plain_agg import plain_agg_pixels

from gaccum_course import _canvas
from gaccum_course.widgets import (
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


# The explorers' canvas remembers how it drew text (gaccum_course._canvas): the pixels must be plain Agg's.
@pytest.mark.parametrize("name", MOVES)
def test_the_explorers_canvas_draws_the_pixels_of_plain_agg(name):
    make, a, b = MOVES[name]
    explorer = make(strict=True)
    explorer.set(**a)
    explorer.set(**b)  # text drawn again from the caches, much of it elsewhere (new ticks, limits, labels)
    assert isinstance(explorer.canvas.get_renderer(), _canvas._TextCachingRenderer) == _canvas._TEXT_CACHE
    np.testing.assert_array_equal(explorer.pixels(), plain_agg_pixels(explorer.figure))


def test_without_matplotlibs_internals_the_explorers_draw_with_plain_agg(monkeypatch):
    assert _canvas.text_internals_available() == _canvas._TEXT_CACHE
    explorer = variable_length_explorer(strict=True)
    explorer.set(spread=1.0)
    cached = explorer.pixels()
    monkeypatch.setattr(_canvas, "_TEXT_CACHE", False)
    explorer.refresh()
    assert type(explorer.canvas.get_renderer()) is RendererAgg
    np.testing.assert_array_equal(explorer.pixels(), cached)
    monkeypatch.delattr(RendererAgg, "_prepare_font")  # a Matplotlib without one of them
    assert not _canvas.text_internals_available()
