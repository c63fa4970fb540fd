"""Plots drawn once and updated in place: what the explorers (:mod:`gaccum_course.widgets`) draw.

Each class makes its lines, labels and loss surface on the first ``update`` and afterwards only
changes the lines' data and the limits, so axes, ticks and legend handles stay the same
objects (a slider move answers without building a figure again). Its ``moving`` artists are
those whose data changes at every update; limits are set only when they change (setting
them marks the axes stale even when they are the same), so an explorer draws the moving
artists over the axes' last picture where nothing else changed (:class:`~gaccum_course.explorer.Drawing`).
The functions of :mod:`gaccum_course.plots` draw a plot once with the same classes.
"""

from __future__ import annotations

from functools import lru_cache

import matplotlib.ticker
import numpy as np
import torch

from .style import _label_update_axes, _markevery, _styles_and_labels, powers_of_ten


def _trajectory_key(trajectories: dict) -> tuple:
    """What decides the lines' styles and labels: the same key, the same lines (only their data changes)."""
    return tuple((t.strategy, label) for t, (_, label) in zip(trajectories.values(), _styles_and_labels(trajectories),
                                                              strict=True))


def _autoscale(ax) -> None:
    """The limits a fresh plot of the axes' lines would get (their data changed in place).

    Worked out again only where the data's extent changed: from the same extent Matplotlib
    gives the same limits, and setting them (even the same ones) marks the axes stale.
    """
    extent = ax.dataLim.get_points().copy()
    ax.relim()
    if not np.array_equal(extent, ax.dataLim.get_points()):
        ax.autoscale_view()


def _set_limits(ax, x=None, y=None) -> None:
    """Set the axes' x and y limits (pairs; None: kept), those that differ from the present ones only."""
    if x is not None and tuple(ax.get_xlim()) != tuple(x):
        ax.set_xlim(*x)
    if y is not None and tuple(ax.get_ylim()) != tuple(y):
        ax.set_ylim(*y)


class WeightTrajectoriesPlot:
    """:func:`~gaccum_course.plots.plot_weight_trajectories` drawn once and updated in place (what the explorers use).

    The first :meth:`update` makes the lines and labels; later ones change the lines' data and
    the limits only, so axes, ticks and legend handles stay the same objects.
    """

    def __init__(self, axes, *, component_names=None):
        self.axes = list(np.atleast_1d(axes))
        self.component_names = component_names
        self.lines: list[list] = []  # per panel, one line per trajectory
        self._key = None

    def update(self, trajectories: dict):
        first = next(iter(trajectories.values()))
        num_weights = first.weights.shape[1]
        if len(self.axes) != num_weights:
            raise ValueError(f"ax must hold one axes per weight ({num_weights}), got {len(self.axes)}")
        key = (num_weights, _trajectory_key(trajectories))
        if key != self._key:
            names = self.component_names or ([f"w[{i}]" for i in range(num_weights)] if num_weights > 1 else ["w"])
            for line in (line for lines in self.lines for line in lines):
                line.remove()
            styled = _styles_and_labels(trajectories)
            self.lines = []
            for axis, name in zip(self.axes, names, strict=True):
                self.lines.append([axis.plot([], [], label=label, markersize=6, **style)[0] for style, label in styled])
                _label_update_axes(axis, name, f"{name} after each update")
            self._key = key
        for panel, (axis, lines) in enumerate(zip(self.axes, self.lines, strict=True)):
            for line, t in zip(lines, trajectories.values(), strict=True):
                line.set_data(np.arange(len(t.weights)), t.weights[:, panel])
                line.set_markevery(_markevery(len(t.weights)))
            _autoscale(axis)
        return self.axes

    @property
    def moving(self) -> list:
        """The lines (their data changes at every update)."""
        return [line for lines in self.lines for line in lines]


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


def _loss_curve_of(problem, lo: float, hi: float, points: int):
    """Mean loss over the whole dataset at ``points`` values of the one weight, from lo to hi."""
    ws = np.linspace(lo, hi, points)
    model = problem.make_model()
    losses = []
    with torch.no_grad():
        for w in ws:
            torch.nn.utils.vector_to_parameters(torch.tensor([w], dtype=torch.float32), model.parameters())
            losses.append(problem.full_loss(model))
    return ws, np.asarray(losses)


@lru_cache(maxsize=32)
def _loss_curve(spec_key, lo: float, hi: float, points: int):
    from gaccum_lib.data import make_problem

    return _loss_curve_of(make_problem(dict(spec_key)), lo, hi, points)


def _spec_key(spec: dict):
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in spec.items()))


def _nice_step(span: float) -> float:
    """The smallest of 1, 2, 5 x 10^k at least ``span``."""
    if not np.isfinite(span) or span <= 0:
        return 1.0
    power = 10.0 ** np.floor(np.log10(span))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= span * (1 - 1e-12)))


def weight_path_limits(trajectories: dict, *, margin: float = 0.25, snap: bool = False):
    """(lo, hi) per weight of the path plot: the weights' range, a margin each side.

    ``snap``: widened to a round step (an eighth of the range or more), so that small changes
    of the paths keep the same limits -- and the loss surface drawn for them (the explorers).
    """
    all_w = np.concatenate([t.weights for t in trajectories.values()])
    lo, hi = all_w.min(axis=0), all_w.max(axis=0)
    pad = np.maximum((hi - lo) * margin, 0.05)
    lo, hi = lo - pad, hi + pad
    if snap:
        steps = np.array([_nice_step(s / 8) for s in hi - lo])
        lo, hi = np.round(np.floor(lo / steps) * steps, 12), np.round(np.ceil(hi / steps) * steps, 12)
    return lo, hi


class WeightPathPlot:
    """:func:`~gaccum_course.plots.plot_weight_path` drawn once and updated in place (what the explorers use).

    The loss surface behind the paths (contours for 2 weights, a curve for 1) is recomputed and
    redrawn only when the problem or the limits change; with ``snap=True`` the limits move in
    round steps (:func:`weight_path_limits`), so most changes of the paths keep it. ``resolution``:
    points per side of the contours' grid; ``curve_points``: points of the curve.
    """

    CURVE_POINTS = 200

    def __init__(self, ax, *, resolution: int = 41, margin: float = 0.25, snap: bool = False,
                 curve_points: int = CURVE_POINTS):
        self.ax, self.resolution, self.margin, self.snap = ax, resolution, margin, snap
        self.curve_points = curve_points
        self.curve = None  # 1 weight: the loss over the whole data
        self.contours = None  # 2 weights: the loss contours (with their labels)
        self.lines: list = []
        self.start = None
        self.background_key = None
        self.background_draws = 0  # how often the surface was (re)drawn, for tests
        self._key = None

    def _background(self, problem, lo, hi):
        key = (_spec_key(problem.spec) if problem.spec else id(problem), *map(float, lo), *map(float, hi))
        if key == self.background_key:
            return
        self.background_draws += 1
        if len(lo) == 1:
            if problem.spec:
                ws, losses = _loss_curve(key[0], float(lo[0]), float(hi[0]), self.curve_points)
            else:
                ws, losses = _loss_curve_of(problem, float(lo[0]), float(hi[0]), self.curve_points)
            self.curve.set_data(ws, losses)
        else:
            if self.contours is not None:
                self.contours.remove()
            a, b, grid = _loss_grid(_spec_key(problem.spec), *map(float, (lo[0], hi[0], lo[1], hi[1])),
                                    self.resolution)
            # Under the paths however often it is redrawn (contour lines share the lines' zorder 2 by default).
            self.contours = self.ax.contour(a, b, grid, levels=14, colors="0.55", linewidths=0.8, zorder=1.9)
            # Every other level labelled: readable, and placing a label costs more than drawing a line.
            self.ax.clabel(self.contours, self.contours.levels[::2], fontsize=10, fmt="%.2f")
        self.background_key = key

    def _build(self, dims: int, trajectories: dict) -> None:
        ax = self.ax
        for artist in (self.curve, self.contours, self.start, *self.lines):
            if artist is not None:
                artist.remove()
        self.curve = self.contours = self.start = self.background_key = None
        if dims == 1:
            (self.curve,) = ax.plot([], [], color="0.6", linewidth=1.5, label="loss over the whole data")
        styled = _styles_and_labels(trajectories)
        extra = dict(markersize=7) if dims == 1 else dict(markersize=6)
        self.lines = [ax.plot([], [], label=label, **extra, **style)[0] for style, label in styled]
        if dims == 2:
            self.start = ax.annotate("start", (0, 0), textcoords="offset points", xytext=(6, 6), fontsize=11)
        ax.set_xlabel("w" if dims == 1 else "w[0]")
        ax.set_ylabel("loss" if dims == 1 else "w[1]")
        ax.set_title("path of the weights over the loss")

    def update(self, problem, trajectories: dict):
        dims = next(iter(trajectories.values())).weights.shape[1]
        if dims not in (1, 2):
            raise ValueError(f"plot_weight_path draws 1 or 2 weights; these trajectories have {dims}")
        key = (dims, _trajectory_key(trajectories))
        if key != self._key:
            self._build(dims, trajectories)
            self._key = key
        lo, hi = weight_path_limits(trajectories, margin=self.margin, snap=self.snap)
        if dims == 2:
            # The surface's extent, as a contour plot autoscales (tight): the paths lie inside. Set
            # before the contours are labelled, which places the labels for the limits it finds.
            _set_limits(self.ax, (lo[0], hi[0]), (lo[1], hi[1]))
        self._background(problem, lo, hi)
        if dims == 1:
            ws, losses = self.curve.get_data()
            for line, t in zip(self.lines, trajectories.values(), strict=True):
                line.set_data(t.weights[:, 0], np.interp(t.weights[:, 0], ws, losses))
            _autoscale(self.ax)
        else:
            for line, t in zip(self.lines, trajectories.values(), strict=True):
                line.set_data(t.weights[:, 0], t.weights[:, 1])
                line.set_markevery(_markevery(len(t.weights)))
            self.start.xy = tuple(next(iter(trajectories.values())).weights[0])
        return self.ax

    @property
    def moving(self) -> list:
        """The paths and the "start" label (the loss surface changes with the limits only)."""
        return [*self.lines, *([self.start] if self.start is not None else [])]


class DistanceFromReferencePlot:
    """:func:`~gaccum_course.plots.plot_distance_from_reference` drawn once and updated in place (the explorers)."""

    def __init__(self, ax, *, floor: float = 1e-9, tolerance: float = 1e-6):
        self.ax, self.floor, self.tolerance = ax, floor, tolerance
        self.lines: list = []
        self._key = None
        self._framed = False

    def _frame(self) -> None:
        ax, tolerance = self.ax, self.tolerance
        # Decades only: minor ticks on a log axis cost more to draw than the data (widget speed).
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(numticks=8))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        powers_of_ten(ax)
        # The suite's "equal" (float32 rounding after a few updates is ~1e-7, float64's ~1e-15).
        ax.axhline(tolerance, color="0.5", linewidth=1, linestyle="--")
        # Under the line, which the limits keep in view: over it, the label left the axes (into the
        # title) whenever every distance was under the tolerance.
        ax.text(0.99, tolerance / 1.4, f"{tolerance:.0e}: tolerance for equal", fontsize=10, color="0.35", ha="right",
                va="top", transform=ax.get_yaxis_transform())
        _label_update_axes(ax, "distance to full batch", "how far from the full-batch run")
        self._framed = True

    def update(self, trajectories: dict, reference):
        drawn = [(t, style, label) for t, (style, label) in
                 zip(trajectories.values(), _styles_and_labels(trajectories), strict=True) if t is not reference]
        key = tuple((t.strategy, label) for t, _, label in drawn)
        if key != self._key:
            for line in self.lines:
                line.remove()
            if not self._framed:
                self.ax.set_yscale("log")
            self.lines = [self.ax.plot([], [], label=label, **style)[0] for _, style, label in drawn]
            if not self._framed:
                self._frame()
            self._key = key
        for line, (t, _, _) in zip(self.lines, drawn, strict=True):
            distance = np.maximum(t.distance_from(reference), self.floor)
            line.set_data(np.arange(len(distance)), distance)
            line.set_markevery(_markevery(len(distance)))
        _autoscale(self.ax)
        return self.ax

    @property
    def moving(self) -> list:
        """The lines (their data changes at every update)."""
        return list(self.lines)
