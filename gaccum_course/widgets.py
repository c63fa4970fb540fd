"""The lessons' explorers: sliders over a simulation, the plot redrawn in place.

Each ``*_explorer`` function returns an :class:`~gaccum_course.explorer.Explorer` whose
``compute`` runs the simulator (remembered: a slider moved back answers at once) and whose
:class:`~gaccum_course.explorer.Drawing` draws the figure once and then only updates it
(:mod:`gaccum_course.live_plots`), drawing again only the artists that move and the axes
that changed. A test reads what it did from ``explorer.state``.
"""

from __future__ import annotations

from types import SimpleNamespace

import ipywidgets as widgets
import matplotlib.ticker
import numpy as np

from gaccum_lib.simulate import simulate

from .explorer import DPI, Drawing, Explorer, ExplorerState, _Memo
from .live_plots import DistanceFromReferencePlot, WeightPathPlot, WeightTrajectoriesPlot, _autoscale, _set_limits
from .style import OKABE_ITO, legend_below, room_for_legend_below, style_for

# Points per side of the loss grid behind the variable-length explorer's weight path (the other
# explorers' paths have one weight: a curve). Its loss surfaces are smooth (straight contours):
# 15 x 15 draws contours that look like 41 x 41's, and evaluating a grid (every weight pair over
# the whole data, for limits or data not among the 32 last seen) takes 12 ms instead of 82.
EXPLORER_GRID = 15
# Points of the loss curve behind the regression explorer's path (one weight): a parabola, drawn
# alike with 100 points as with 200, each a pass over the data (10 ms instead of 20 for new limits).
EXPLORER_CURVE = 100

# Intervals between labelled ticks on a linear axis, at most (Matplotlib's choice: 8 or 9 on these
# panels): tick labels are most of an axes' drawing, and an explorer draws an axes again whenever
# its limits change. 6 takes about a quarter off that drawing, and still labels every other update
# of 12 or a span of 120 every 25 (log axes keep a label a decade).
EXPLORER_TICKS = 6
# A title's distance from its axes (points) that leaves room for an offset text (the "1e7" over the
# y tick labels, 11 points high): Matplotlib's 6, plus the 12 it lifts a title by over one.
OFFSET_TEXT_PAD = 18

__all__ = ["DPI", "Drawing", "Explorer", "ExplorerState", "launch_explorer", "regression_explorer",
           "schedule_explorer", "trainer_count_explorer", "variable_length_explorer"]


def _few_ticks(figure) -> None:
    """At most :data:`EXPLORER_TICKS` intervals between major ticks on the figure's linear axes."""
    for ax in figure.axes:
        for axis in (ax.xaxis, ax.yaxis):
            locator = axis.get_major_locator()
            if isinstance(locator, matplotlib.ticker.MaxNLocator):  # AutoLocator is one too
                locator.set_params(nbins=EXPLORER_TICKS)


def _title_on_top(*axes, pad: float | None = None) -> None:
    """Each axes' title at its top, where Matplotlib puts it when nothing is there to lift it over.

    Placed so (``y`` given), a title stays where it is while its axes changes, and the explorer
    draws it once (:class:`~gaccum_course.explorer.Drawing`); Matplotlib would lay out the y tick
    labels again at every draw to look for an offset text ("1e7") or ticks on top to lift it
    over. For axes that never have them (a log axis, limits of a few units), or with ``pad``
    (points) room for an offset text kept under the title all the time: :data:`OFFSET_TEXT_PAD`.
    """
    for ax in axes:
        ax.set_title(ax.get_title(), y=1.0, pad=pad)


def _slider(description, value, minimum, maximum, step=1, **kwargs):
    style = {"description_width": "initial"}
    return widgets.IntSlider(value=value, min=minimum, max=maximum, step=step, description=description,
                             continuous_update=False, style=style, **kwargs)


def _fslider(description, value, minimum, maximum, step, **kwargs):
    return widgets.FloatSlider(value=value, min=minimum, max=maximum, step=step, description=description,
                               continuous_update=False, style={"description_width": "initial"}, **kwargs)


def regression_explorer(*, strict: bool = False) -> Explorer:
    """Lesson 1: the toy regression with and without dividing by GA, over several epochs."""
    from gaccum_lib.data import toy_regression

    problem = toy_regression()

    @_Memo
    def run(strategy, grad_accum_steps, lr, epochs):
        return simulate(problem, strategy, grad_accum_steps=grad_accum_steps,
                        micro_batch_size=8 // grad_accum_steps, lr=lr, epochs=epochs)

    def compute(grad_accum_steps, lr, epochs):
        if 8 % grad_accum_steps:
            raise ValueError(f"grad_accum_steps must divide the 8 points (1, 2, 4 or 8), got {grad_accum_steps}")
        return {label: run(strategy, grad_accum_steps, lr, epochs) for label, strategy in
                (("full batch", "full_batch"), ("plain: loss / GA", "mean_of_means"), ("forgot / GA", "sum_of_means"))}

    def build(figure, result):
        left, right = figure.subplots(1, 2)
        parts = SimpleNamespace(path=WeightPathPlot(left, snap=True, curve_points=EXPLORER_CURVE),
                                weights=WeightTrajectoriesPlot(right))
        update(parts, result)
        right.axhline(2.0, color="0.5", linewidth=1)
        legend_below(figure, right)
        _few_ticks(figure)
        _title_on_top(left, right, pad=OFFSET_TEXT_PAD)  # forgetting / GA reaches losses of 1e23, w of 1e10
        return parts

    def update(parts, result):
        parts.path.update(problem, result)
        parts.weights.update(result)

    def moving(parts):
        return [*parts.path.moving, *parts.weights.moving]

    def summarize(result):
        full, plain, forgot = (result[k].final_weights[0] for k in result)
        updates = result["full batch"].num_updates
        return (f"After {updates} update{'s' if updates != 1 else ''}: full batch w = {full:.4f}, "
                f"plain accumulation w = {plain:.4f}, forgetting / GA w = {forgot:.4g} (target 2).")

    controls = {"grad_accum_steps": widgets.Dropdown(options=[1, 2, 4, 8], value=4, description="GA"),
                "lr": _fslider("learning rate", 0.02, 0.002, 0.03, 0.002, readout_format=".3f"),
                "epochs": _slider("epochs", 3, 1, 10)}
    explorer = Explorer(controls, compute, Drawing(build, update, moving), summarize=summarize, strict=strict,
                        title="Toy regression: accumulate with and without / GA")
    explorer.simulations = run
    return explorer


def variable_length_explorer(*, strict: bool = False, num_sequences: int = 64) -> Explorer:
    """Lessons 3 and 4: naive vs token-normalised on a corpus with a length spread, N simulated ranks."""
    from gaccum_lib.data import sequence_corpus

    @_Memo
    def corpus(spread):  # the data (and its loss surface) depend on the spread only
        return sequence_corpus(num_sequences, mean_length=8.0, spread=spread)

    @_Memo
    def run(strategy, grad_accum_steps, micro_batch_size, num_processes, spread, lr, epochs):
        return simulate(corpus(spread), strategy, grad_accum_steps=grad_accum_steps, micro_batch_size=micro_batch_size,
                        num_processes=num_processes, lr=lr, epochs=epochs)

    def compute(grad_accum_steps, micro_batch_size, num_processes, spread, lr, epochs):
        problem = corpus(spread)
        trajectories = {s: run(s, grad_accum_steps, micro_batch_size, num_processes, spread, lr, epochs)
                        for s in ("full_batch", "mean_of_means", "token_normalised")}
        return problem, trajectories

    def build(figure, result):
        left, right = figure.subplots(1, 2)
        room_for_legend_below(figure)  # first: the contours' labels are placed for the panels' final size
        parts = SimpleNamespace(path=WeightPathPlot(left, snap=True, resolution=EXPLORER_GRID),
                                distance=DistanceFromReferencePlot(right))
        update(parts, result)
        legend_below(figure, left)
        _few_ticks(figure)
        _title_on_top(left, right)  # weights of a few tenths (snapped limits), and a log axis
        return parts

    def update(parts, result):
        problem, trajectories = result
        parts.path.update(problem, trajectories)
        parts.distance.update(trajectories, trajectories["full_batch"])

    def moving(parts):
        return [*parts.path.moving, *parts.distance.moving]

    def summarize(result):
        _, t = result
        full = t["full_batch"]
        naive = t["mean_of_means"].distance_from(full).max()
        token = t["token_normalised"].distance_from(full).max()
        return (f"{full.num_updates} updates of {int(full.window_tokens.mean())} targets on average; "
                f"largest distance from the full batch: naive {naive:.2e}, token-normalised {token:.2e}.")

    controls = {"grad_accum_steps": _slider("GA", 4, 1, 8),
                "micro_batch_size": _slider("micro-batch", 2, 1, 4),
                "num_processes": _slider("processes (simulated)", 1, 1, 4),
                "spread": _fslider("length spread", 0.75, 0.0, 1.0, 0.05),
                "lr": _fslider("learning rate", 0.05, 0.01, 0.1, 0.01),
                # More passes over the same data: more updates, and more room for the naive run to drift.
                "epochs": _slider("epochs", 1, 1, 4)}
    explorer = Explorer(controls, compute, Drawing(build, update, moving), summarize=summarize, strict=strict,
                        title="Variable-length sequences: naive vs token-normalised")
    explorer.simulations, explorer.corpora = run, corpus
    return explorer


def launch_explorer(*, strict: bool = False) -> Explorer:
    """Lesson 04: the seed's 2-process experiment in real processes (gaccum_launch.launch) next to the simulator."""
    from gaccum_launch import choose_device, cpu_process_limit, gpu_count
    from gaccum_lib.accelerate_runs import real_run
    from gaccum_lib.data import seed_sequences

    def compute(num_processes, strategy):
        problem = seed_sequences(8 * num_processes)  # the seed sizes the data as 4 x GA x processes
        kwargs = dict(grad_accum_steps=2, micro_batch_size=4, num_processes=num_processes, lr=0.08)
        real = real_run(problem, strategy, **kwargs)
        return {"device": choose_device(num_processes), "real": real,
                "simulated": simulate(problem, strategy, **kwargs),
                "full_batch": simulate(problem, "full_batch", **kwargs)}

    def draw(result, figure):
        ax = figure.subplots()
        real = result["real"]
        ranks = np.arange(real.num_processes)
        for i, (label, values, hatch) in enumerate((
                ("real processes, each rank", real.rank_final_weights, ""),
                ("simulator, each rank", result["simulated"].rank_final_weights, "//"),
                ("full batch", np.repeat(result["full_batch"].final_weights[None], len(ranks), axis=0), ".."))):
            for w in range(values.shape[1]):
                ax.bar(ranks * 4 + w * 1.3 + i * 0.4, values[:, w], width=0.38, hatch=hatch,
                       color=style_for(["token_normalised", "mean_of_means", "full_batch"][i])["color"],
                       edgecolor="white", label=label if w == 0 and ranks.size else None)
        ax.set_xticks([r * 4 + w * 1.3 + 0.4 for r in ranks for w in range(2)],
                      [f"rank {r}\nw[{w}]" for r in ranks for w in range(2)])
        ax.set_ylabel("final weight")
        ax.set_title(f"{real.source}: final weights per rank")
        legend_below(figure, ax)

    def summarize(result):
        real, sim = result["real"], result["simulated"]
        agree = real.max_difference(sim)
        same = float(np.ptp(real.rank_final_weights, axis=0).max()) == 0.0
        counts = real.token_counts[0].tolist()
        return (f"{real.num_processes} real process(es) on {result['device'].upper()}: local targets {counts}, "
                f"total {sum(counts)}; every rank has the same weights: {'yes' if same else 'NO'}; "
                f"largest difference to the simulator {agree:.1e}.")

    limit = max(gpu_count(), 2) if gpu_count() >= 2 else min(4, cpu_process_limit())
    controls = {"num_processes": _slider("processes (real)", 2, 1, limit),
                "strategy": widgets.Dropdown(options=[("token-normalised", "token_normalised"),
                                                      ("naive", "mean_of_means")], value="token_normalised",
                                             description="strategy")}
    return Explorer(controls, compute, draw, summarize=summarize, strict=strict, figsize=(10, 4.2),
                    title="A real multi-process launch (real Accelerate, gloo or NCCL)",
                    button="Launch for real", busy="launching processes... (about a second each time)")


def schedule_explorer(*, strict: bool = False, num_batches: int = 96, peak_lr: float = 0.1) -> Explorer:
    """Lesson 09: the learning rate of each update with a linear decay sized three ways."""
    from gaccum_lib import schedule

    def compute(grad_accum_steps, num_processes, epochs):
        return {sizing: schedule.lr_per_update(sizing, num_batches, grad_accum_steps, num_processes, epochs, peak_lr)
                for sizing in ("updates", "micro_batches", "sharded_updates")}

    labels = {"updates": "sized in the steps Accelerate takes (right)",
              "micro_batches": "sized in micro-batches: len(loader)",
              "sharded_updates": "sized from the sharded loader"}
    styles = {"updates": "token_normalised", "micro_batches": "mean_of_means", "sharded_updates": "token_local_count"}

    def build(figure, result):
        ax = figure.subplots()
        lines = {sizing: ax.plot([], [], label=labels[sizing], **style_for(styles[sizing]))[0]
                 for sizing in result}
        parts = SimpleNamespace(ax=ax, lines=lines)
        update(parts, result)
        ax.set_xlabel("optimizer update")
        ax.set_ylabel("learning rate")
        ax.set_title(f"linear decay from {peak_lr} to 0 over the training, {num_batches} batches per epoch")
        _title_on_top(ax)  # learning rates from 0 to peak_lr
        legend_below(figure, ax, ncol=2)
        _few_ticks(figure)
        return parts

    def update(parts, result):
        for sizing, lrs in result.items():
            parts.lines[sizing].set_data(np.arange(1, len(lrs) + 1), lrs)
            parts.lines[sizing].set_markevery(max(1, len(lrs) // 12))
        _autoscale(parts.ax)

    def summarize(result):
        right, slow, early = result["updates"], result["micro_batches"], result["sharded_updates"]
        zero_from = int(np.argmax(early == 0)) + 1 if (early == 0).any() else None
        text = (f"{len(right)} updates. Sized in updates the last one uses lr {right[-1]:.4f}; sized in "
                f"micro-batches it still uses {slow[-1]:.4f}")
        return text + (f"; sized from the sharded loader the lr is 0 from update {zero_from} on." if zero_from
                       else "; with one process the sharded loader is the whole loader.")

    controls = {"grad_accum_steps": _slider("GA", 4, 1, 8),
                "num_processes": _slider("processes", 2, 1, 4),
                "epochs": _slider("epochs", 2, 1, 4)}
    return Explorer(controls, compute, Drawing(build, update, lambda parts: parts.lines.values()),
                    summarize=summarize, strict=strict, figsize=(10, 4.2), title="Sizing a schedule under accumulation")


def trainer_count_explorer(*, strict: bool = False, rows_per_micro_batch: int = 2, updates: int = 8) -> Explorer:
    """Lesson 08: how much of each update GPT-2's Trainer count leaves, against row length, spread and GA.

    The Trainer counts every label of a GPT2LMHeadModel's window (lesson 08 measures it), the loss
    averages over the targets after the shift: each update is ``targets / labels`` of the right one.
    """
    from gaccum_lib.data import corpus_lengths

    def compute(mean_length, spread, grad_accum_steps):
        rows = rows_per_micro_batch * grad_accum_steps
        lengths = np.asarray(corpus_lengths(rows * updates, float(mean_length), float(spread)))
        lengths = np.maximum(lengths, 2).reshape(updates, rows)  # a row needs 2 tokens to hold a target
        labels, targets = lengths.sum(axis=1), (lengths - 1).sum(axis=1)
        return {"fraction": targets / labels, "labels": labels, "targets": targets, "mean_length": mean_length}

    def build(figure, result):
        ax = figure.subplots()
        steps = np.arange(1, updates + 1)
        bars = ax.bar(steps, result["fraction"], color=OKABE_ITO["vermillion"], alpha=0.8,
                      label="GPT2LMHeadModel, default count (labels)")
        line = ax.axhline(1.0, **dict(style_for("token_normalised"), marker=None),
                          label="LlamaForCausalLM, or loss_type set (targets)")
        # Grid lines and ticks under the bars (Matplotlib puts grid lines over patches by default), as
        # the explorer draws them: the bars move, and are drawn over the rest of the axes, then what
        # Matplotlib draws over them (the line at 1, the frame around the axes).
        ax.set_axisbelow(True)
        parts = SimpleNamespace(ax=ax, bars=bars, over_bars=[line, *ax.spines.values()])
        update(parts, result)
        ax.set_xlabel("optimizer update")
        ax.set_ylabel("update / per-token update")
        ax.set_title("what the Trainer's count leaves of each update")
        _title_on_top(ax)  # fractions from 0.5 to 1
        legend_below(figure, ax, ncol=2)  # (all the ticks: only the bars move, the axes are drawn once)
        return parts

    def update(parts, result):
        for bar, fraction in zip(parts.bars, result["fraction"], strict=True):
            bar.set_height(fraction)
        # The updates (x) are the same 1..updates every time: only the y range follows the data.
        _set_limits(parts.ax, y=(min(0.5, float(result["fraction"].min()) - 0.05), 1.02))

    def summarize(result):
        fraction = result["fraction"]
        return (f"rows of about {result['mean_length']} tokens: each update is {fraction.min():.3f} to "
                f"{fraction.max():.3f} of the per-token one (1 - 1/L = {1 - 1 / result['mean_length']:.3f}); "
                f"first window: {result['targets'][0]} targets, {result['labels'][0]} labels counted")

    controls = {"mean_length": _slider("row length", 20, 4, 256),
                "spread": _fslider("spread", 0.8, 0.0, 1.0, 0.1),
                "grad_accum_steps": _slider("GA", 8, 1, 32)}
    return Explorer(controls, compute, Drawing(build, update, lambda parts: [*parts.bars, *parts.over_bars]),
                    summarize=summarize, strict=strict, figsize=(10, 4.2),
                    title="The Trainer's count for GPT-2: row length and GA")
