"""Plots for the lessons: weight trajectories, paths over loss contours, losses, distances.

Accessible by default: the Okabe-Ito colour-blind-safe palette, a distinct line style and
marker per strategy (so the plots also read in grey), 12 pt text and none under 10 pt. Every
function draws on axes it is given (or makes its own) and returns them, so widgets can
redraw in place and tests can inspect what was drawn.
"""

from __future__ import annotations

from functools import lru_cache

import matplotlib
import matplotlib.layout_engine
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import torch

# Okabe & Ito (2008): distinguishable with every common colour-vision deficiency.
OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "purple": "#CC79A7",
}

STYLES = {
    "full_batch": dict(color=OKABE_ITO["black"], linestyle="-", marker="o", linewidth=2.4),
    "mean_of_means": dict(color=OKABE_ITO["vermillion"], linestyle="--", marker="s", linewidth=2.0),
    "sum_of_means": dict(color=OKABE_ITO["purple"], linestyle="-.", marker="^", linewidth=2.0),
    "token_normalised": dict(color=OKABE_ITO["sky"], linestyle=":", marker="D", linewidth=2.6),
    "token_local_count": dict(color=OKABE_ITO["orange"], linestyle=(0, (5, 2, 1, 2)), marker="v", linewidth=2.0),
    "token_no_world_scale": dict(color=OKABE_ITO["green"], linestyle=(0, (1, 1)), marker="P", linewidth=2.0),
}
_FALLBACK = [OKABE_ITO[c] for c in ("blue", "orange", "green", "purple", "yellow")]

RC = {
    "font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 11,
    "xtick.labelsize": 11, "ytick.labelsize": 11, "figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3,
}


def apply_style() -> None:
    """Readable defaults for every figure of the session."""
    plt.rcParams.update(RC)


def style_for(key: str, index: int = 0) -> dict:
    """Line style for a strategy name; other keys get distinct palette colours and dashes."""
    if key in STYLES:
        return dict(STYLES[key])
    dashes = ["-", "--", "-.", ":"]
    return dict(color=_FALLBACK[index % len(_FALLBACK)], linestyle=dashes[index % 4], marker="o", linewidth=2.0)


def _axes(ax, ncols=1, figsize=(7, 4)):
    if ax is not None:
        return ax
    apply_style()
    fig, axes = plt.subplots(1, ncols, figsize=figsize, layout="constrained")
    return axes


def _styles_and_labels(trajectories: dict) -> list:
    """(style, label) per trajectory, in order.

    A key that is the trajectory's strategy gets the strategy's fixed style and label; any
    other key (e.g. "plain: loss / GA") is the label, still drawn in the strategy's style.
    A strategy drawn twice (simulator and real run) gets a palette style the second time.
    """
    out, used = [], set()
    for i, (key, t) in enumerate(trajectories.items()):
        label = t.label if key == t.strategy else str(key)
        style = style_for(t.strategy, i) if t.strategy not in used else style_for(f"other-{i}", i)
        used.add(t.strategy)
        out.append((style, label))
    return out


def _label_update_axes(ax, ylabel: str, title: str) -> None:
    """Axes whose x is the optimizer update: whole-number ticks only."""
    ax.set_xlabel("optimizer update")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def legend_below(figure, ax, ncol: int = 3) -> None:
    """One legend for the whole figure, under the panels, where it hides no data."""
    handles, labels = ax.get_legend_handles_labels()
    if isinstance(figure.get_layout_engine(), matplotlib.layout_engine.ConstrainedLayoutEngine):
        # Constrained layout makes room itself (and ignores subplots_adjust).
        figure.legend(handles, labels, loc="outside lower center", ncol=ncol, frameon=False)
        return
    figure.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
    figure.subplots_adjust(bottom=0.26, wspace=0.3)


def _log2_x_at(ax, ticks) -> None:
    """A base-2 log x axis labelled at exactly ``ticks`` (GA values, row lengths), as plain numbers."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(list(ticks)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _markevery(n: int) -> int:
    return max(1, n // 12)


def plot_weight_trajectories(trajectories: dict, ax=None, *, component_names=None, legend: bool = True):
    """Each weight after every optimizer update, one panel per weight, one line per strategy."""
    first = next(iter(trajectories.values()))
    num_weights = first.weights.shape[1]
    names = component_names or ([f"w[{i}]" for i in range(num_weights)] if num_weights > 1 else ["w"])
    axes = np.atleast_1d(_axes(ax, ncols=num_weights, figsize=(5.2 * num_weights, 3.8)))
    if len(axes) != num_weights:
        raise ValueError(f"ax must hold one axes per weight ({num_weights}), got {len(axes)}")
    for panel, (axis, name) in enumerate(zip(axes, names, strict=True)):
        for t, (style, label) in zip(trajectories.values(), _styles_and_labels(trajectories), strict=True):
            steps = np.arange(len(t.weights))
            axis.plot(steps, t.weights[:, panel], label=label, markevery=_markevery(len(steps)), markersize=6, **style)
        _label_update_axes(axis, name, f"{name} after each update")
    if legend:
        axes[0].legend(loc="best")
    return axes


@lru_cache(maxsize=32)
def _loss_grid(spec_key, lo0, hi0, lo1, hi1, resolution):
    """Mean loss over the whole dataset on a resolution x resolution grid of the two weights."""
    from torch.func import functional_call, vmap

    from gaccum_lib.data import make_problem

    problem = make_problem(dict(spec_key))
    model = problem.make_model()
    batch = problem.collate(list(problem.examples))
    (name, param), = model.named_parameters()
    a = np.linspace(lo0, hi0, resolution)
    b = np.linspace(lo1, hi1, resolution)
    w0, w1 = np.meshgrid(a, b)
    grid_weights = torch.tensor(np.stack([w0.ravel(), w1.ravel()], axis=1), dtype=param.dtype)

    def mean_loss(flat):
        # The model called with these weights instead of its own: one batched pass for the grid.
        call = lambda inputs: functional_call(model, {name: flat.view_as(param)}, (inputs,))
        total, count = problem.loss_sum_and_count(call, batch)
        return total / count

    with torch.no_grad():
        losses = vmap(mean_loss)(grid_weights)
    return a, b, losses.double().numpy().reshape(resolution, resolution)


def _spec_key(spec: dict):
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in spec.items()))


def plot_weight_path(problem, trajectories: dict, ax=None, *, resolution: int = 41, margin: float = 0.25,
                     legend: bool = True):
    """The path of the weights over the loss surface: contours for 2 weights, a loss curve for 1."""
    ax = _axes(ax, figsize=(6, 4.6))
    all_w = np.concatenate([t.weights for t in trajectories.values()])
    lo, hi = all_w.min(axis=0), all_w.max(axis=0)
    pad = np.maximum((hi - lo) * margin, 0.05)
    lo, hi = lo - pad, hi + pad
    if all_w.shape[1] == 1:
        ws = np.linspace(lo[0], hi[0], 200)
        model = problem.make_model()
        losses = []
        with torch.no_grad():
            for w in ws:
                torch.nn.utils.vector_to_parameters(torch.tensor([w], dtype=torch.float32), model.parameters())
                losses.append(problem.full_loss(model))
        ax.plot(ws, losses, color="0.6", linewidth=1.5, label="loss over the whole data")
        for t, (style, label) in zip(trajectories.values(), _styles_and_labels(trajectories), strict=True):
            ys = np.interp(t.weights[:, 0], ws, losses)
            ax.plot(t.weights[:, 0], ys, label=label, markersize=7, **style)
        ax.set_xlabel("w")
        ax.set_ylabel("loss")
    elif all_w.shape[1] == 2:
        a, b, grid = _loss_grid(_spec_key(problem.spec), lo[0], hi[0], lo[1], hi[1], resolution)
        contours = ax.contour(a, b, grid, levels=14, colors="0.55", linewidths=0.8)
        ax.clabel(contours, fontsize=10, fmt="%.2f")
        for t, (style, label) in zip(trajectories.values(), _styles_and_labels(trajectories), strict=True):
            ax.plot(t.weights[:, 0], t.weights[:, 1], label=label, markevery=_markevery(len(t.weights)),
                    markersize=6, **style)
        start = next(iter(trajectories.values())).weights[0]
        ax.annotate("start", start, textcoords="offset points", xytext=(6, 6), fontsize=11)
        ax.set_xlabel("w[0]")
        ax.set_ylabel("w[1]")
    else:
        raise ValueError(f"plot_weight_path draws 1 or 2 weights; these trajectories have {all_w.shape[1]}")
    ax.set_title("path of the weights over the loss")
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
    for t, (style, label) in zip(trajectories.values(), _styles_and_labels(trajectories), strict=True):
        if t is reference:
            continue
        distance = np.maximum(t.distance_from(reference), floor)
        ax.semilogy(np.arange(len(distance)), distance, label=label, markevery=_markevery(len(distance)), **style)
    # Decades only: minor ticks on a log axis cost more to draw than the data (widget speed).
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(numticks=8))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    # The suite's "equal" (float32 rounding after a few updates is ~1e-7, float64's ~1e-15).
    ax.axhline(tolerance, color="0.5", linewidth=1, linestyle="--")
    ax.text(0.99, tolerance * 1.4, f"{tolerance:.0e}: tolerance for equal", fontsize=10, color="0.35", ha="right",
            transform=ax.get_yaxis_transform())
    _label_update_axes(ax, "distance to full batch", "how far from the full-batch run")
    if legend:
        ax.legend(loc="best")
    return ax


def plot_memory(table: dict, ax=None):
    """Peak memory of one update as the effective batch grows: bigger batch vs accumulation."""
    ax = _axes(ax)
    names = {"full_batch": "one big batch", "accumulation": "accumulation (fixed micro-batch)",
             "summed_loss": "micro-batches, one backward of the summed loss"}
    styles = {"full_batch": "full_batch", "accumulation": "token_normalised", "summed_loss": "mean_of_means"}
    for key, rows in table.items():
        batches = [r.effective_batch for r in rows]
        ax.plot(batches, [r.peak / 2**20 for r in rows], label=names.get(key, key), **style_for(styles.get(key, key)))
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("effective batch size (examples per update)")
    ax.set_ylabel("peak memory of one update (MiB)")
    ax.set_title("memory: weights + gradients + activations")
    ax.legend(loc="best")
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
