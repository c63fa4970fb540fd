"""The suite's style: the palette, a line style and marker per strategy, and the helpers every plot shares.

Accessible by default: the Okabe-Ito colour-blind-safe palette, a distinct line style and
marker per strategy (so the plots also read in grey), 12 pt text and none under 10 pt.
:mod:`gaccum_course.plots` draws with it (and re-exports its public names).
"""

from __future__ import annotations

import math

import matplotlib
import matplotlib.layout_engine
import matplotlib.pyplot as plt
import matplotlib.ticker

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
    room_for_legend_below(figure)


def room_for_legend_below(figure) -> None:
    """The panels' room for :func:`legend_below`, made before it is called.

    For what places itself for the axes' size when it is drawn (contour labels): drawn after,
    it fits the final layout, as it does after a figure's first draw (the explorers).
    """
    if not isinstance(figure.get_layout_engine(), matplotlib.layout_engine.ConstrainedLayoutEngine):
        figure.subplots_adjust(bottom=0.26, wspace=0.3)


def _log2_x_at(ax, ticks) -> None:
    """A base-2 log x axis labelled at exactly ``ticks`` (GA values, row lengths), as plain numbers."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(list(ticks)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


_SUPERSCRIPTS = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")


def _power_of_ten(value: float, _position=None) -> str:
    exponent = math.log10(value) if value > 0 else math.nan
    if not math.isfinite(exponent) or abs(exponent - round(exponent)) > 1e-9:
        return f"{value:g}"
    return "10" + str(round(exponent)).translate(_SUPERSCRIPTS)


def powers_of_ten(ax, axis: str = "y") -> None:
    """Label a log axis's major ticks (``axis``: "x" or "y") 10⁻¹⁵, 10⁻¹², ... in plain text; no minor labels.

    Call it after setting the log scale (``set_yscale`` resets formatters), with ticks at decades
    (``LogLocator``): a major tick between decades is labelled as a plain number (3e-05), and an axis
    spanning less than a decade may be left with one label. Matplotlib's own labels are mathtext,
    laid out as a formula at every draw: on the lessons' log panels that took a quarter of a figure's
    drawing (lesson 05's two-by-two panels, 800 -> 590 ms). Unicode superscripts look nearly the same.
    """
    if axis not in ("x", "y"):
        raise ValueError(f"axis must be 'x' or 'y', got {axis!r}")
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_formatter(matplotlib.ticker.FuncFormatter(_power_of_ten))
    target.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _markevery(n: int) -> int:
    return max(1, n // 12)

