"""Plots: what they draw, and that they stay readable (palette, line styles, font sizes)."""

import itertools

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.text import Text

from gaccum_course import plots
from gaccum_course.style import _power_of_ten
from gaccum_course.widgets import (
    regression_explorer,
    schedule_explorer,
    trainer_count_explorer,
    variable_length_explorer,
)
from gaccum_lib import lm
from gaccum_lib.data import seed_sequences, toy_regression
from gaccum_lib.simulate import simulate

SMALLEST_PT = 10


def visible_texts(figure) -> list:
    return [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]


def assert_readable(figure):
    figure.canvas.draw()  # tick labels exist only once drawn
    small = [(t.get_text(), t.get_fontsize()) for t in visible_texts(figure) if t.get_fontsize() < SMALLEST_PT]
    assert small == [], f"text under {SMALLEST_PT} pt: {small[:5]}"


@pytest.fixture
def runs():
    problem = seed_sequences(16)
    kwargs = dict(grad_accum_steps=2, micro_batch_size=4, lr=0.08, epochs=2)
    return problem, {s: simulate(problem, s, **kwargs) for s in ("full_batch", "mean_of_means", "token_normalised")}


def test_strategy_styles_differ_in_colour_line_style_and_marker_and_use_the_okabe_ito_palette():
    palette = set(plots.OKABE_ITO.values())
    for a, b in itertools.combinations(plots.STYLES.values(), 2):
        assert a["color"] != b["color"] and a["linestyle"] != b["linestyle"] and a["marker"] != b["marker"]
    assert {s["color"] for s in plots.STYLES.values()} <= palette
    # Keys that are not strategies (sweeps, sizings) still get palette colours and four distinct dashes.
    fallback = [plots.style_for(f"other-{i}", i) for i in range(4)]
    assert {s["color"] for s in fallback} <= palette
    assert len({str(s["linestyle"]) for s in fallback}) == 4


def test_trajectory_plots_draw_one_styled_line_per_run(runs):
    problem, trajectories = runs
    plt.close("all")
    axes = plots.plot_weight_trajectories(trajectories)
    assert len(axes) == 2  # one panel per weight
    for ax in axes:
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == [t.label for t in trajectories.values()]
        assert [to_hex(line.get_color()) for line in lines] == [
            plots.STYLES[s]["color"].lower() for s in trajectories]
        assert ax.get_xlabel() == "optimizer update"
        # A run with 4 updates has 5 points: the start and after every update.
        assert all(len(line.get_xdata()) == trajectories["full_batch"].num_updates + 1 for line in lines)
    assert_readable(axes[0].figure)


def test_distance_plot_skips_the_reference_and_floors_exact_zeros(runs):
    _, trajectories = runs
    plt.close("all")
    reference = trajectories["full_batch"]
    ax = plots.plot_distance_from_reference(trajectories, reference, floor=1e-9)
    lines = [line for line in ax.get_lines() if line.get_label() in {t.label for t in trajectories.values()}]
    assert [line.get_label() for line in lines] == [trajectories[s].label for s in ("mean_of_means",
                                                                                    "token_normalised")]
    naive, token = (np.asarray(line.get_ydata()) for line in lines)
    assert naive[0] == token[0] == 1e-9  # the same start, drawn at the floor of the log axis
    np.testing.assert_allclose(naive[1:], trajectories["mean_of_means"].distance_from(reference)[1:], rtol=1e-12)
    assert naive.max() > 1e-3 and token.max() < 1e-6
    assert ax.get_yscale() == "log"
    assert_readable(ax.figure)


def test_weight_path_draws_contours_for_two_weights_and_a_curve_for_one(runs):
    problem, trajectories = runs
    plt.close("all")
    ax = plots.plot_weight_path(problem, trajectories)
    assert ax.collections, "no loss contours"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("w[0]", "w[1]")
    assert_readable(ax.figure)

    regression = toy_regression()
    one_weight = {s: simulate(regression, s, grad_accum_steps=4, micro_batch_size=2, lr=0.02)
                  for s in ("full_batch", "sum_of_means")}
    ax = plots.plot_weight_path(regression, one_weight)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("w", "loss")
    assert ax.get_lines()[0].get_label() == "loss over the whole data"
    with pytest.raises(ValueError, match="plot_weight_path draws 1 or 2 weights; these trajectories have 3"):
        fake = {"x": simulate(problem, "full_batch", grad_accum_steps=2, micro_batch_size=4, lr=0.08)}
        fake["x"].weights = np.zeros((3, 3))
        plots.plot_weight_path(problem, fake)


def test_capstone_plots_are_readable():
    plt.close("all")
    problem = lm.tiny_lm(16)
    sweep = lm.error_vs_ga(problem, (1, 2, 4), effective_batch=8)
    axes = plots.plot_error_vs_ga({"lines": sweep})
    assert_readable(axes[0].figure)
    ax = plots.plot_lengths({"lines": problem})
    assert_readable(ax.figure)


@pytest.mark.parametrize("make", [regression_explorer, variable_length_explorer, schedule_explorer,
                                  trainer_count_explorer],
                         ids=["regression", "variable_length", "schedule", "trainer_count"])
def test_widget_figures_use_the_suite_style_whatever_the_kernel_set(make):
    # A learner (or an earlier cell) shrank every font: the widget's picture must not change.
    with matplotlib.rc_context({"font.size": 6, "xtick.labelsize": 6, "ytick.labelsize": 6,
                                "axes.titlesize": 6, "axes.labelsize": 6, "legend.fontsize": 6}):
        shrunk = make(strict=True)
    default = make(strict=True)
    assert shrunk.state.image_digest == default.state.image_digest
    assert_readable(shrunk.figure)


def test_weight_trajectories_want_one_axes_per_weight(runs):
    _, trajectories = runs
    figure, (first, second, third) = plt.subplots(1, 3)
    with pytest.raises(ValueError, match=r"ax must hold one axes per weight \(2\), got 1"):
        plots.plot_weight_trajectories(trajectories, ax=first)
    assert list(plots.plot_weight_trajectories(trajectories, ax=[second, third])) == [second, third]
    plt.close(figure)


def test_a_legend_below_the_panels_hides_no_label(runs):
    problem, trajectories = runs
    for layout in ("constrained", None):
        figure, (path, *per_weight) = plt.subplots(1, 3, figsize=(15, 4.4), layout=layout)
        plots.plot_weight_path(problem, trajectories, ax=path, legend=False)
        plots.plot_weight_trajectories(trajectories, ax=per_weight, legend=False)
        plots.legend_below(figure, path)
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        legend_box = figure.legends[0].get_window_extent(renderer)
        for ax in (path, *per_weight):
            assert not legend_box.overlaps(ax.xaxis.label.get_window_extent(renderer)), (layout, ax.get_xlabel())
        plt.close(figure)


def test_lesson_08_plots_draw_what_they_are_given():
    logged = {"full batch": [3.9, 3.7], "naive": [3.8995, 3.71], "num_items_in_batch": [3.9, 3.7]}
    curves, gaps = plots.plot_logged_losses(logged)
    assert [line.get_label() for line in gaps.get_lines()[:2]] == ["naive", "num_items_in_batch"]
    assert np.allclose(gaps.get_lines()[0].get_ydata(), [-0.0005, 0.01])
    assert_readable(curves.figure)
    ax = plots.plot_count_error([4, 8], {"labels": [0.75, 0.875], "targets": [1.0, 1.0]})
    assert list(ax.get_lines()[0].get_ydata()) == [0.75, 0.875]
    assert_readable(ax.figure)
    ax = plots.plot_precision_vs_ga([1, 32], {"float32": [3e-3, 3e-3], "bf16": [3.4e-3, 6e-3]})
    assert [line.get_label() for line in ax.get_lines()] == ["gradients added in float32", "gradients added in bf16"]
    assert_readable(ax.figure)
    plt.close("all")


def test_the_style_and_the_drawn_once_plots_are_still_imported_from_plots():
    # The lessons import them from gaccum_course.plots (and the explorers from .widgets) since before the split.
    from gaccum_course import explorer, live_plots, style, widgets

    assert all(hasattr(plots, name) for name in plots.__all__)
    assert all(hasattr(widgets, name) for name in widgets.__all__)
    assert plots.WeightPathPlot is live_plots.WeightPathPlot and plots.legend_below is style.legend_below
    assert widgets.Explorer is explorer.Explorer and widgets.Drawing is explorer.Drawing


def test_log_axes_are_labelled_in_powers_of_ten_as_plain_text(runs):
    # Plain text with Unicode superscripts, not mathtext (a quarter of a log figure's drawing time).
    _, trajectories = runs
    ax = plots.plot_distance_from_reference(trajectories, trajectories["full_batch"], floor=1e-17, legend=False)
    ax.set_ylim(1e-16, 1e-4)
    ax.figure.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(label.startswith("10") and "$" not in label for label in labels)
    assert "10\u207b\u00b9\u2070" in labels  # 10^-10
    assert [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()] == []
    assert _power_of_ten(1.0) == "10\u2070" and _power_of_ten(100.0) == "10\u00b2"
    assert _power_of_ten(3e-5) == "3e-05"  # not a decade: the plain number
    with pytest.raises(ValueError, match="axis must be 'x' or 'y'"):
        plots.powers_of_ten(ax, axis="z")
    plt.close("all")
