"""The figures of lessons 10 (FSDP2's gradient memory) and 11 (the RL losses' drift) draw the data they are
given, and label only the ticks that mean something."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gaccum_course.deep_dive_plots import plot_fsdp_gradient_memory, plot_rl_drift  # noqa: E402

ROWS = [{"loss_type": t, "grad_accum_steps": g, "num_processes": p, "distance": d}
        for p in (1, 2) for g in (1, 2, 4, 8)
        for t, d in (("grpo", 0.0), ("bnpo", 0.1 * g * p))]


def _minor_labels(ax):
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]


def test_rl_drift_draws_each_loss_type_per_process_count_with_exact_ones_at_the_floor():
    axes = plot_rl_drift(ROWS, floor=1e-9)
    assert [ax.get_title() for ax in axes] == ["1 process", "2 processes"]
    for ax, p in zip(axes, (1, 2), strict=True):
        lines = {line.get_label(): line for line in ax.get_lines()}
        np.testing.assert_array_equal(lines["bnpo"].get_xdata(), [1, 2, 4, 8])
        np.testing.assert_allclose(lines["bnpo"].get_ydata(), [0.1 * g * p for g in (1, 2, 4, 8)])
        np.testing.assert_array_equal(lines["grpo"].get_ydata(), [1e-9] * 4)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
        assert _minor_labels(ax) == []  # no 3x10^0 and the like between the GA values
    plt.close("all")


def test_fsdp_memory_draws_the_rule_and_the_measurements():
    sizes, measured = {8: 100, 16: 400}, {8: (100, 52), 16: (400, 201)}
    ax = plot_fsdp_gradient_memory(sizes, measured)
    lines = ax.get_lines()
    np.testing.assert_array_equal(lines[0].get_ydata(), [100, 400])  # sync off: the whole gradient
    np.testing.assert_allclose(lines[1].get_ydata(), [50, 200])  # sync on, P=2: half
    np.testing.assert_array_equal(lines[-2].get_ydata(), [100, 400])  # measured, unsharded
    np.testing.assert_array_equal(lines[-1].get_ydata(), [52, 201])  # measured, sharded
    assert [t.get_text() for t in ax.get_xticklabels()] == ["100", "400"]  # each size labelled
    assert _minor_labels(ax) == []
    plt.close("all")


def test_the_figures_refuse_data_they_cannot_draw():
    with pytest.raises(ValueError, match="rows must hold at least one row"):
        plot_rl_drift([])
    with pytest.raises(ValueError, match="the same, non-empty, keys"):
        plot_fsdp_gradient_memory({8: 100}, {16: (100, 50)})
