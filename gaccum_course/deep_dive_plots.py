"""The figures of deep dives 10 and 11: FSDP2's gradient memory under accumulation (10), the RL losses' drift (11).

Drawn in the style of :mod:`gaccum_course.plots` (Okabe-Ito colours, a line style and marker
per series, text of 11 pt and more); each function returns its axes so a test can read what
was drawn.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from .plots import OKABE_ITO, apply_style, legend_below, powers_of_ten

LOSS_STYLES = {
    "grpo": dict(color=OKABE_ITO["blue"], linestyle="-", marker="o"),
    "bnpo": dict(color=OKABE_ITO["vermillion"], linestyle="--", marker="s"),
    "dr_grpo": dict(color=OKABE_ITO["green"], linestyle="-.", marker="^"),
    "dapo": dict(color=OKABE_ITO["black"], linestyle=":", marker="D"),
}


def plot_fsdp_gradient_memory(sizes: dict, measured: dict, *, process_counts=(2, 4, 8)):
    """Gradient elements one process holds between micro-batches, against the model's size.

    ``sizes`` maps a label (the width) to the model's number of weights; ``measured`` maps the
    same labels to ``(unsharded, sharded)`` elements measured on 2 processes: after a window's
    first micro-batch (sync off) and after its last (sync on). Lines: the rule (sync off: the
    whole gradient, whatever P; sync on: 1/P of it), markers: the measurement. The x axis labels
    each model size.
    """
    if set(sizes) != set(measured) or not sizes:
        raise ValueError("sizes and measured must have the same, non-empty, keys (one per model size)")
    apply_style()
    _, ax = plt.subplots(figsize=(7, 4.4), layout="constrained")
    weights = sorted(sizes.values())
    ax.plot(weights, weights, color=OKABE_ITO["vermillion"], linestyle="--", linewidth=2,
            label="sync off between micro-batches (any P): the whole gradient")
    for p, style in zip(process_counts, ("-", "-.", ":"), strict=False):
        ax.plot(weights, [n / p for n in weights], color=OKABE_ITO["blue"], linestyle=style, linewidth=2,
                label=f"sync on every micro-batch, P={p}: a 1/{p} shard")
    ax.plot([sizes[k] for k in sizes], [measured[k][0] for k in sizes], "s", color=OKABE_ITO["vermillion"],
            markersize=8, label="measured, P=2: after a first micro-batch (sync off)")
    ax.plot([sizes[k] for k in sizes], [measured[k][1] for k in sizes], "o", color=OKABE_ITO["blue"],
            markersize=8, label="measured, P=2: after a last micro-batch (sync on)")
    ax.set(xscale="log", yscale="log", xlabel="weights in the model",
           ylabel="gradient elements held per process",
           title="FSDP2: what accumulating without sync costs in memory")
    ax.set_xticks(weights, [f"{n:,}" for n in weights])  # each model size, not only the powers of ten between
    ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks (3x10^2, 4x10^2, ...) run together
    legend_below(ax.figure, ax, ncol=2)
    return ax


def plot_rl_drift(rows: list[dict], *, floor: float = 1e-9):
    """Each loss type's distance from its own full batch against GA, one panel per process count.

    ``rows`` are :func:`gaccum_lib.rl_losses.distance_table`'s. Distances below ``floor`` (exact
    but for float32 rounding, or 0) are drawn at the floor.
    """
    if not rows:
        raise ValueError("rows must hold at least one row of distance_table()")
    apply_style()
    counts = sorted({r["num_processes"] for r in rows})
    figure, axes = plt.subplots(1, len(counts), figsize=(5.4 * len(counts), 4.2), layout="constrained",
                                sharey=True, squeeze=False)
    for ax, p in zip(axes[0], counts, strict=True):
        for loss_type in dict.fromkeys(r["loss_type"] for r in rows):
            mine = sorted((r["grad_accum_steps"], r["distance"]) for r in rows
                          if r["loss_type"] == loss_type and r["num_processes"] == p)
            ax.plot([g for g, _ in mine], [max(d, floor) for _, d in mine], linewidth=2, label=loss_type,
                    **LOSS_STYLES.get(loss_type, {}))
        ax.set(xscale="log", yscale="log", xlabel="GA (micro-batches per update)",
               title=f"{p} process{'' if p == 1 else 'es'}")
        ax.set_xticks(sorted({r["grad_accum_steps"] for r in rows}), [str(g) for g in
                      sorted({r["grad_accum_steps"] for r in rows})])
        ax.xaxis.set_minor_formatter(NullFormatter())  # only the GA values above are labelled
        powers_of_ten(ax)
    axes[0][0].set_ylabel("distance from its own full batch")
    legend_below(figure, axes[0][0], ncol=4)
    return axes[0]
