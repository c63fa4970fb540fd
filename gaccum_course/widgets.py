"""Interactive explorers for the lessons: sliders that recompute and redraw a plot in place.

An :class:`Explorer` owns some controls, a ``compute(**values)`` function and a
``draw(result, figure)`` function. On every change it recomputes, redraws the figure and
puts the PNG into an ``ipywidgets.Image`` -- so the plot changes in place, the static site
keeps the last picture in the saved widget state, and a test can read everything from
:attr:`Explorer.state` (nbmake never sees widget output, and exceptions raised inside widget
callbacks never fail a cell on their own).

Bad values never break the widget: the error is shown under the controls, recorded in
``state.error``, and the last good plot stays. With ``strict=True`` (tests) it is re-raised.
"""

from __future__ import annotations

import hashlib
import html
import io
import time
from dataclasses import dataclass, field

import ipywidgets as widgets
import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gaccum_lib._threads import single_thread
from gaccum_lib.simulate import simulate

from . import plots

DPI = 72  # a widget answers in well under 200 ms at this resolution (see `make bench`)


@dataclass
class ExplorerState:
    """Everything an explorer did, for tests and benchmarks to read."""

    values: dict
    result: object = None
    error: str | None = None
    summary: str = ""
    refreshes: int = 0
    image_digest: str = ""
    compute_ms: list = field(default_factory=list)
    draw_ms: list = field(default_factory=list)

    @property
    def answer_ms(self) -> list:
        """Compute + redraw time of every refresh, in milliseconds."""
        return [c + d for c, d in zip(self.compute_ms, self.draw_ms, strict=True)]


class Explorer:
    """Controls -> compute -> draw, redrawn in place on every change."""

    def __init__(self, controls: dict, compute, draw, *, summarize=None, title: str = "",
                 figsize=(10, 4.4), strict: bool = False, button: str | None = None, busy: str = ""):
        if not controls:
            raise ValueError("controls must hold at least one widget")
        self.controls = dict(controls)
        self.compute = compute
        self.draw = draw
        self.summarize = summarize
        self.strict = strict
        self.figure = Figure(figsize=figsize, dpi=DPI)
        FigureCanvasAgg(self.figure)
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.message = widgets.HTML()
        self.caption = widgets.HTML()
        header = [widgets.HTML(f"<b>{html.escape(title)}</b>")] if title else []
        row = list(self.controls.values())
        # With a button, changes wait for a click (for slow computations such as real launches).
        self.button = widgets.Button(description=button, button_style="primary") if button else None
        self.busy = busy
        if self.button is not None:
            self.button.on_click(lambda _button: self.refresh())
            row.append(self.button)
        self.widget = widgets.VBox([*header, widgets.HBox(row, layout=widgets.Layout(flex_flow="row wrap")),
                                    self.message, self.image, self.caption])
        self.state = ExplorerState(values=self.values)
        self._holding = False
        if self.button is None:
            for control in self.controls.values():
                control.observe(self._on_change, names="value")
        self.refresh()

    @property
    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def _on_change(self, _change) -> None:
        if not self._holding:
            self.refresh()

    def set(self, **values) -> ExplorerState:
        """Set several controls at once (one recompute), as a learner moving sliders would."""
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ValueError(f"unknown control(s) {unknown}; this explorer has {sorted(self.controls)}")
        for name, value in values.items():
            _check_control_value(name, self.controls[name], value)
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._holding = False
        self.refresh()
        return self.state

    def refresh(self) -> None:
        with single_thread():
            self._refresh()

    def _refresh(self) -> None:
        values = self.values
        self.state.values = values
        if self.busy:
            self.message.value = f"<i>{html.escape(self.busy)}</i>"
        start = time.perf_counter()
        try:
            result = self.compute(**values)
        except (ValueError, TypeError, RuntimeError) as exc:
            self.state.error = f"{type(exc).__name__}: {exc}" if isinstance(exc, RuntimeError) else str(exc)
            self.message.value = f"<span style='color:#D55E00'>&#9888; {html.escape(str(exc))}</span>"
            if self.strict:
                raise
            return
        computed = time.perf_counter()
        buffer = io.BytesIO()
        # The suite's readable style whatever the kernel's rcParams are (the same picture in every notebook).
        with matplotlib.rc_context(plots.RC):
            self.figure.clf()
            self.draw(result, self.figure)
            # Fast PNG compression: a few more KB per image, half the encoding time of the default.
            self.figure.savefig(buffer, format="png", dpi=DPI, pil_kwargs={"compress_level": 1})
        self.image.value = buffer.getvalue()
        drawn = time.perf_counter()
        self.state.result = result
        self.state.error = None
        self.message.value = ""
        self.state.summary = self.summarize(result) if self.summarize else ""
        self.caption.value = f"<i>{html.escape(self.state.summary)}</i>" if self.state.summary else ""
        self.state.refreshes += 1
        self.state.image_digest = hashlib.sha1(self.image.value).hexdigest()
        self.state.compute_ms.append((computed - start) * 1000)
        self.state.draw_ms.append((drawn - computed) * 1000)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def _check_control_value(name: str, control, value) -> None:
    """Refuse what a slider would silently clamp, or a menu would reject with a bare TraitError."""
    if hasattr(control, "options"):
        options = [o[1] if isinstance(o, tuple) else o for o in control.options]
        if value not in options:
            raise ValueError(f"{name} must be one of {options}, got {value!r}")
        return
    if hasattr(control, "min") and hasattr(control, "max"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if isinstance(control, widgets.IntSlider) and value != int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if not control.min <= value <= control.max:
            raise ValueError(f"{name} must be in [{control.min}, {control.max}], got {value}")


# ----------------------------------------------------------------------------------------------
# Explorers used by the lessons.
# ----------------------------------------------------------------------------------------------

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

    def compute(grad_accum_steps, lr, epochs):
        if 8 % grad_accum_steps:
            raise ValueError(f"grad_accum_steps must divide the 8 points (1, 2, 4 or 8), got {grad_accum_steps}")
        kwargs = dict(grad_accum_steps=grad_accum_steps, micro_batch_size=8 // grad_accum_steps, lr=lr,
                      epochs=epochs)
        return {"full batch": simulate(problem, "full_batch", **kwargs),
                "plain: loss / GA": simulate(problem, "mean_of_means", **kwargs),
                "forgot / GA": simulate(problem, "sum_of_means", **kwargs)}

    def draw(result, figure):
        left, right = figure.subplots(1, 2)
        plots.plot_weight_path(problem, result, ax=left, legend=False)
        plots.plot_weight_trajectories(result, ax=right, legend=False)
        right.axhline(2.0, color="0.5", linewidth=1)
        plots.legend_below(figure, right)

    def summarize(result):
        full, plain, forgot = (result[k].final_weights[0] for k in result)
        updates = result["full batch"].num_updates
        return (f"After {updates} update{'s' if updates != 1 else ''}: full batch w = {full:.4f}, "
                f"plain accumulation w = {plain:.4f}, forgetting / GA w = {forgot:.4g} (target 2).")

    controls = {"grad_accum_steps": widgets.Dropdown(options=[1, 2, 4, 8], value=4, description="GA"),
                "lr": _fslider("learning rate", 0.02, 0.002, 0.03, 0.002, readout_format=".3f"),
                "epochs": _slider("epochs", 3, 1, 10)}
    return Explorer(controls, compute, draw, summarize=summarize, strict=strict,
                    title="Toy regression: accumulate with and without / GA")


def variable_length_explorer(*, strict: bool = False, num_sequences: int = 64) -> Explorer:
    """Lessons 3 and 4: naive vs token-normalised on a corpus with a length spread, N simulated ranks."""
    from gaccum_lib.data import sequence_corpus

    def compute(grad_accum_steps, micro_batch_size, num_processes, spread, lr, epochs):
        problem = sequence_corpus(num_sequences, mean_length=8.0, spread=spread)
        kwargs = dict(grad_accum_steps=grad_accum_steps, micro_batch_size=micro_batch_size,
                      num_processes=num_processes, lr=lr, epochs=epochs)
        trajectories = {s: simulate(problem, s, **kwargs) for s in ("full_batch", "mean_of_means", "token_normalised")}
        return problem, trajectories

    def draw(result, figure):
        problem, trajectories = result
        left, right = figure.subplots(1, 2)
        plots.plot_weight_path(problem, trajectories, ax=left, legend=False)
        plots.plot_distance_from_reference(trajectories, trajectories["full_batch"], ax=right, legend=False)
        plots.legend_below(figure, left)

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
                "epochs": _slider("epochs (number of updates)", 1, 1, 4)}
    return Explorer(controls, compute, draw, summarize=summarize, strict=strict,
                    title="Variable-length sequences: naive vs token-normalised")


def launch_explorer(*, strict: bool = False) -> Explorer:
    """Lesson 04: the seed's 2-process experiment in real processes (gaccum_lib.launch) next to the simulator."""
    from gaccum_lib.accelerate_runs import real_run
    from gaccum_lib.data import seed_sequences
    from gaccum_lib.launch import choose_device, cpu_process_limit, gpu_count

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
                       color=plots.style_for(["token_normalised", "mean_of_means", "full_batch"][i])["color"],
                       edgecolor="white", label=label if w == 0 and ranks.size else None)
        ax.set_xticks([r * 4 + w * 1.3 + 0.4 for r in ranks for w in range(2)],
                      [f"rank {r}\nw[{w}]" for r in ranks for w in range(2)])
        ax.set_ylabel("final weight")
        ax.set_title(f"{real.source}: final weights per rank")
        plots.legend_below(figure, ax)

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

    def draw(result, figure):
        ax = figure.subplots()
        labels = {"updates": "sized in the steps Accelerate takes (right)",
                  "micro_batches": "sized in micro-batches: len(loader)",
                  "sharded_updates": "sized from the sharded loader"}
        styles = {"updates": "token_normalised", "micro_batches": "mean_of_means",
                  "sharded_updates": "token_local_count"}
        for sizing, lrs in result.items():
            ax.plot(np.arange(1, len(lrs) + 1), lrs, label=labels[sizing], **plots.style_for(styles[sizing]),
                    markevery=max(1, len(lrs) // 12))
        ax.set_xlabel("optimizer update")
        ax.set_ylabel("learning rate")
        ax.set_title(f"linear decay from {peak_lr} to 0 over the training, {num_batches} batches per epoch")
        plots.legend_below(figure, ax, ncol=2)

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
    return Explorer(controls, compute, draw, summarize=summarize, strict=strict, figsize=(10, 4.2),
                    title="Sizing a schedule under accumulation")


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

    def draw(result, figure):
        ax = figure.subplots()
        steps = np.arange(1, updates + 1)
        ax.bar(steps, result["fraction"], color=plots.OKABE_ITO["vermillion"], alpha=0.8,
               label="GPT2LMHeadModel, default count (labels)")
        ax.axhline(1.0, **dict(plots.style_for("token_normalised"), marker=None),
                   label="LlamaForCausalLM, or loss_type set (targets)")
        ax.set_ylim(min(0.5, float(result["fraction"].min()) - 0.05), 1.02)
        ax.set_xlabel("optimizer update")
        ax.set_ylabel("update / per-token update")
        ax.set_title("what the Trainer's count leaves of each update")
        plots.legend_below(figure, ax, ncol=2)

    def summarize(result):
        fraction = result["fraction"]
        return (f"rows of about {result['mean_length']} tokens: each update is {fraction.min():.3f} to "
                f"{fraction.max():.3f} of the per-token one (1 - 1/L = {1 - 1 / result['mean_length']:.3f}); "
                f"first window: {result['targets'][0]} targets, {result['labels'][0]} labels counted")

    controls = {"mean_length": _slider("row length", 20, 4, 256),
                "spread": _fslider("spread", 0.8, 0.0, 1.0, 0.1),
                "grad_accum_steps": _slider("GA", 8, 1, 32)}
    return Explorer(controls, compute, draw, summarize=summarize, strict=strict, figsize=(10, 4.2),
                    title="The Trainer's count for GPT-2: row length and GA")
