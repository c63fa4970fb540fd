"""Plots for the lessons: weight trajectories, paths over loss contours, losses, distances.

Drawn in the suite's style (:mod:`gaccum_course.style`: the Okabe-Ito palette, a line style and
marker per strategy, no text under 10 pt). Every function draws on axes it is given (or makes
its own) and returns them, so tests can inspect what was drawn; the explorers draw the same
plots once and update them in place (:mod:`gaccum_course.live_plots`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .live_plots import DistanceFromReferencePlot, WeightPathPlot, WeightTrajectoriesPlot, weight_path_limits
from .style import (
    OKABE_ITO,
    RC,
    STYLES,
    _axes,
    _label_update_axes,
    _log2_x_at,
    _markevery,
    _styles_and_labels,
    apply_style,
    legend_below,
    powers_of_ten,
    style_for,
)

__all__ = [  # what the lessons import from here, the style and the draw-once plots included
    "OKABE_ITO", "RC", "STYLES", "apply_style", "legend_below", "powers_of_ten", "style_for",
    "DistanceFromReferencePlot", "WeightPathPlot", "WeightTrajectoriesPlot", "weight_path_limits",
    "plot_count_error", "plot_distance_from_reference", "plot_error_vs_ga", "plot_lengths", "plot_logged_losses",
    "plot_losses", "plot_memory", "plot_precision_vs_ga", "plot_weight_path", "plot_weight_trajectories",
]


def plot_weight_trajectories(trajectories: dict, ax=None, *, component_names=None, legend: bool = True):
    """Each weight after every optimizer update, one panel per weight, one line per strategy."""
    first = next(iter(trajectories.values()))
    num_weights = first.weights.shape[1]
    axes = np.atleast_1d(_axes(ax, ncols=num_weights, figsize=(5.2 * num_weights, 3.8)))
    WeightTrajectoriesPlot(axes, component_names=component_names).update(trajectories)
    if legend:
        axes[0].legend(loc="best")
    return axes


def plot_weight_path(problem, trajectories: dict, ax=None, *, resolution: int = 41, margin: float = 0.25,
                     legend: bool = True):
    """The path of the weights over the loss surface: contours for 2 weights, a loss curve for 1."""
    ax = _axes(ax, figsize=(6, 4.6))
    WeightPathPlot(ax, resolution=resolution, margin=margin).update(problem, trajectories)
    if legend:
        ax.legend(loc="best")
    return ax


def plot_losses(trajectories: dict, ax=None, *, legend: bool = True):
    """Mean loss per target of each update's window, before the update."""
    ax = _axes(ax)
    for t, (style, label) in zip(trajectories.values(), _styles_and_labels(trajectories), strict=True):
        ax.plot(np.arange(1, t.num_updates + 1), t.losses, label=label, markevery=_markevery(t.num_updates), **style)
    _label_update_axes(ax, "loss per target token", "training loss")
    if legend:
        ax.legend(loc="best")
    return ax


def plot_distance_from_reference(trajectories: dict, reference, ax=None, *, floor: float = 1e-9, legend: bool = True,
                                  tolerance: float = 1e-6):
    """Distance of each run's weights from the reference run after every update (log scale)."""
    ax = _axes(ax)
    DistanceFromReferencePlot(ax, floor=floor, tolerance=tolerance).update(trajectories, reference)
    if legend:
        ax.legend(loc="best")
    return ax


def plot_memory(table: dict, ax=None):
    """Peak memory of one update as the effective batch grows: bigger batch vs accumulation.

    Linear axes from 0, so that growth in proportion to the batch reads as a straight line; a grey
    band marks the weights and their gradients, the share that does not depend on the batch.
    """
    ax = _axes(ax)
    names = {"full_batch": "one big batch", "accumulation": "accumulation (fixed micro-batch)",
             "summed_loss": "micro-batches, one backward of the summed loss"}
    styles = {"full_batch": "full_batch", "accumulation": "token_normalised", "summed_loss": "mean_of_means"}
    first = next(iter(table.values()))[0]
    ax.axhspan(0, (first.parameters + first.gradients) / 2**20, color="0.88", zorder=0,
               label="weights + gradients (the same at every batch)")
    batches = [r.effective_batch for r in next(iter(table.values()))]
    for key, rows in table.items():
        ax.plot([r.effective_batch for r in rows], [r.peak / 2**20 for r in rows], label=names.get(key, key),
                **style_for(styles.get(key, key)))
    ax.set_xticks(batches)
    ax.set_xlim(0, 1.04 * max(batches))
    ax.set_ylim(0, None)
    ax.set_xlabel("effective batch size (examples per update)")
    ax.set_ylabel("peak memory of one update (MiB)")
    ax.set_title("memory: weights + gradients + activations")
    ax.legend(loc="lower right")  # over the band, clear of the lines
    return ax


# ----------------------------------------------------------------------------------------------
# Lesson 05: the naive error against GA, and how many targets each row carries.
# ----------------------------------------------------------------------------------------------


def plot_error_vs_ga(sweeps: dict, axes=None, *, floor: float = 1e-18, rounding: float | None = 1e-13,
                     legend: bool = True):
    """Each strategy's error vs GA, one line per sweep (e.g. 'one line per row', 'packed'), in two panels.

    ``sweeps`` maps a name to a result of :func:`error_vs_ga`. Left: a linear scale, where the
    naive error's growth shows. Right: a log scale, where the others show: exact zeros (GA = 1
    makes every strategy the full batch) are drawn at ``floor``, and a grey band up to
    ``rounding`` marks the float64 rounding level (``None``: no band). Returns both axes.
    """
    import matplotlib.ticker

    from gaccum_lib.strategies import LABELS

    if axes is None:
        import matplotlib.pyplot as plt

        apply_style()
        _, axes = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    linear, logarithmic = axes
    ga_values = sorted({g for sweep in sweeps.values() for g in sweep["ga"]})
    for k, (name, sweep) in enumerate(sweeps.items()):
        for s in (s for s in LABELS if s in sweep):
            style = style_for(s)
            if k:  # later sweeps: same colour, hollow markers, thinner
                style.update(markerfacecolor="white", linewidth=1.4, linestyle="-", alpha=0.9)
            linear.plot(sweep["ga"], sweep[s], label=f"{LABELS[s]}, {name}", markersize=7, **style)
            logarithmic.plot(sweep["ga"], np.maximum(sweep[s], floor), markersize=7, **style)
    for ax in axes:
        _log2_x_at(ax, ga_values)
        ax.set_xlabel("accumulation steps (same effective batch)")
        ax.set_ylabel("largest distance to full batch")
    logarithmic.set_yscale("log")
    logarithmic.yaxis.set_major_locator(matplotlib.ticker.LogLocator(numticks=8))
    logarithmic.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    powers_of_ten(logarithmic)
    if rounding is not None:
        logarithmic.axhspan(floor / 2, rounding, color="0.88", zorder=0)
        logarithmic.text(0.02, rounding / 3, "float64 rounding (an exact 0 is drawn at the bottom)", fontsize=10,
                         color="0.35", va="top", transform=logarithmic.get_yaxis_transform())
    highest = max(float(np.max(sweep[s])) for sweep in sweeps.values() for s in LABELS if s in sweep)
    linear.set_ylim(bottom=-0.05 * highest, top=1.5 * highest if highest > 0 else 1.0)  # room for the legend
    linear.set_title("linear scale: the naive error grows with GA")
    logarithmic.set_title("log scale: the others stay at rounding")
    if legend:
        linear.legend(loc="upper left", fontsize=10)
    return axes


def plot_lengths(problems: dict, ax=None):
    """Histogram of the targets per row of each problem (varied lines vs packed blocks)."""

    if ax is None:
        import matplotlib.pyplot as plt

        apply_style()
        _, ax = plt.subplots(figsize=(7, 3.6), layout="constrained")
    top = max(max(p.lengths) for p in problems.values())
    bins = np.arange(0, top + 5, 5)
    for k, (name, problem) in enumerate(problems.items()):
        style = style_for(f"lengths-{k}", k)
        ax.hist([n - 1 for n in problem.lengths], bins=bins, color=style["color"], alpha=0.75,
                hatch=["", "//"][k % 2], edgecolor="white", label=name)
    ax.set_xlabel("targets per row (after the shift)")
    ax.set_ylabel("rows")
    ax.set_title("how many targets each row carries")
    ax.legend(loc="best")
    return ax


# ----------------------------------------------------------------------------------------------
# Lesson 08: the logged loss, the Trainer's count against row length, bf16 against GA.
# ----------------------------------------------------------------------------------------------

# Lesson 08 names its loops by what they do; they are drawn in the styles of the strategies they are.
_LOOP_STYLES = {"full batch": "full_batch", "naive": "mean_of_means", "num_items_in_batch": "token_normalised"}


def plot_logged_losses(logged: dict, axes=None, *, reference: str = "full batch",
                       title: str = "the loss each loop logs"):
    """Left: the loss each loop logged at every update. Right: its gap to ``reference``'s log, where it shows."""
    if axes is None:
        apply_style()
        _, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    curves, gaps = axes
    for i, (name, losses) in enumerate(logged.items()):
        style = style_for(_LOOP_STYLES.get(name, name), i)
        updates = np.arange(1, len(losses) + 1)
        curves.plot(updates, losses, label=name, **style)
        if name != reference:
            gaps.plot(updates, np.asarray(losses) - np.asarray(logged[reference]), label=name, **style)
    gaps.axhline(0.0, color=OKABE_ITO["black"], linewidth=1)
    _label_update_axes(curves, "logged loss", title)
    _label_update_axes(gaps, f"logged loss - {reference}'s", f"the gap to the {reference}'s log")
    curves.legend(loc="best")
    return axes


def plot_count_error(lengths, scale: dict, ax=None):
    """The update the Trainer makes, as a fraction of the per-token one, against the row length."""
    ax = _axes(ax)
    for i, (name, values) in enumerate(scale.items()):
        ax.plot(lengths, values, label=name, markersize=8 - 2 * i, **style_for(f"count-{i}", i))
    _log2_x_at(ax, lengths)
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("update / per-token update")
    ax.set_title("the Trainer's count: 1 - 1/L of the update when it counts labels")
    ax.legend(loc="lower right")
    return ax


def plot_precision_vs_ga(ga_values, errors: dict, ax=None):
    """Relative error of the accumulated gradient against float64, per buffer dtype, as GA grows."""
    ax = _axes(ax)
    for i, (name, values) in enumerate(errors.items()):
        ax.plot(ga_values, values, label=f"gradients added in {name}", **style_for(f"precision-{i}", i))
    _log2_x_at(ax, ga_values)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("accumulation steps (the same rows in every window)")
    ax.set_ylabel("gradient error vs float64")
    ax.set_title("bf16 forward (autocast); where the gradients add up")
    ax.legend(loc="best")
    return ax
