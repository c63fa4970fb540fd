"""Check your own gradient-accumulation loop against the full-batch step.

:func:`check_accumulation` runs *your* loop for one optimizer update over a window of
micro-batches, on one process and on N simulated processes (:mod:`.ranks`), and compares it
with the full-batch reference: the same optimizer stepping once on the mean loss over every
target of the window, from the same initial weights. Two things are compared, each as a
distance *relative* to the reference, so the verdict does not depend on the learning rate or
the size of the weights:

* the gradient your loop hands ``optimizer.step()`` (after DDP's averaging), against the
  full batch's mean gradient: optimizer-independent, so a normalisation error shows even under
  Adam, which is nearly blind to the gradient's scale;
* the weights after each of two consecutive windows, against the reference optimizer's:
  what the optimizer did with it (one step per window, no state carried over).

A distance passes when it is at most ``tol`` plus a floor for the rounding of the model's
dtype (a few ``eps`` of the weights' or gradients' size). When the result matches a known
pitfall the report names it (:mod:`.diagnoses`). Three verdicts: *passed*, *failed* (with a
diagnosis) and *inconclusive*, where the check cannot judge: the model is not deterministic,
or autocast's rounding allows 5 % or more, so a 5 % error could not be told from a pass. The
report is truthy only when the check passed, so ``assert check_accumulation(...)`` works in a test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from gaccum_lib._checks import check_float
from gaccum_lib._threads import single_thread

from . import diagnoses
from .inputs import build_model, check_callable, check_micro_batches, check_process_counts, trainable
from .judge import ProcessCheck, judge, run_processes
from .ranks import AccumulationCheckError, PlainSGD, StepContext, flat, processes_text
from .reference import LOOSEST, Reference, batch_dependent_layers, full_batch_distance, nondeterminism, reference

__all__ = ["AccumulationCheckError", "AccumulationReport", "ProcessCheck", "StepContext", "check_accumulation",
           "check_invariance", "check_script_invariance", "check_trainer_invariance"]
_INVARIANCE = ("check_invariance", "check_script_invariance", "check_trainer_invariance")


def __getattr__(name: str):
    # The invariance checks launch real processes (Accelerate, transformers): imported when first asked for.
    if name in _INVARIANCE:
        from . import invariance_runs

        return getattr(invariance_runs, name)
    raise AttributeError(f"module 'gaccum_check' has no attribute {name!r}")



HEADLINE = {"passed": "passed", "failed": "FAILED", "inconclusive": "INCONCLUSIVE"}


@dataclass(frozen=True, eq=False, repr=False)
class AccumulationReport:
    """What :func:`check_accumulation` found: ``verdict`` is "passed", "failed" or "inconclusive".

    Truthy only when it passed. ``diagnosis`` lists what is wrong, each as ``"label: explanation"``
    (the label says which process counts, when not all); ``cannot_judge`` why there is no verdict;
    ``notes`` what this check could not tell. ``relative_distance`` is the largest relative
    distance found (gradient or weights); ``update_ratio`` and ``details`` (a
    :class:`ProcessCheck` each) are keyed by process count.
    """

    verdict: str
    tol: float
    relative_distance: float
    update_ratio: dict[int, float]
    details: dict[int, ProcessCheck]
    diagnosis: tuple[str, ...]
    notes: tuple[str, ...] = ()
    # With a batch-dependent layer: how far the accumulated gradient (each micro-batch's, added up) is from
    # one forward over the whole window, relative; None when there is none or the window cannot be concatenated.
    full_batch_distance: float | None = None
    cannot_judge: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.verdict == "passed"

    @property
    def passed(self) -> bool:
        return self.verdict == "passed"

    @property
    def labels(self) -> tuple[str, ...]:
        """The short label (before the first colon, without "(only with N processes)") of what decided the verdict:
        each diagnosis when it failed, each reason when inconclusive; each once."""
        said = self.cannot_judge if self.verdict == "inconclusive" else self.diagnosis
        return tuple(dict.fromkeys(re.sub(r" \(only with [^)]*\)$", "", d.split(":", 1)[0]) for d in said))

    @property
    def failed_process_counts(self) -> tuple[int, ...]:
        return tuple(p for p, d in self.details.items() if d.verdict == "failed")

    def __repr__(self) -> str:
        # One line, diagnosis labels first: pytest shows about the first 120 characters of the
        # repr when a plain `assert report` fails.
        head = HEADLINE[self.verdict]
        said = self.cannot_judge if self.verdict == "inconclusive" else self.diagnosis
        if said:  # the labels with the process counts they hold for
            head += ": " + "; ".join(dict.fromkeys(d.split(":", 1)[0] for d in said))
        parts = [head] + [f"{processes_text(d.num_processes)} GA={d.grad_accum_steps}: gradient "
                          f"{d.gradient_distance:.1e}, weights {d.weight_distance:.1e}" for d in self.details.values()]
        return "AccumulationReport(" + " | ".join(parts + [f"tol {self.tol:g}"]) + ")"

    def __str__(self) -> str:
        lines = [f"check_accumulation {HEADLINE[self.verdict]} (relative tol {self.tol:g}, largest "
                 f"relative distance {self.relative_distance:.3e})"]
        if self.cannot_judge:  # first: it is why there is no verdict
            lines += ["cannot judge:"] + [f"  - {d}" for d in self.cannot_judge]
        lines += [f"  {d.summary()}" for d in self.details.values()]
        if self.diagnosis:
            lines += ["diagnosis:"] + [f"  - {d}" for d in self.diagnosis]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# What the whole report says beyond each process count.
# ----------------------------------------------------------------------------------------------


def _batch_dependence(ref: Reference, runs, make_model, known, micro_batches, loss_fn, outcomes):
    """(the diagnosis, the distance to one forward over the whole window) when the model normalises by the batch."""
    layers = list(dict.fromkeys(ref.batch_dependent + [layer for run in runs
                                                       for layer in batch_dependent_layers(run.ranks.models[0])]))
    if not layers:
        return None, None
    distance, why_not = full_batch_distance(make_model, known, ref.w0, micro_batches, loss_fn, ref.mean_grads[0])
    loop_right = all(o.check.passed for o in outcomes)
    return diagnoses.batch_dependent(layers, distance, why_not, loop_right), distance


def _precision_note(outcomes) -> list[str]:
    lowered = [o for o in outcomes if o.precision is not None and o.check.cannot_judge is None]
    if not lowered:
        return []
    measured = ", ".join(f"{o.check.gradient_distance:.1e} with {processes_text(o.num_processes)}" for o in lowered)
    return [f"lower-precision rounding: {lowered[0].precision.describe()}; measured {measured}. A pitfall that changes "
            f"the gradient by less than {lowered[0].precision.floor:.1e} cannot be told from rounding here: the "
            "normalisation does not depend on the precision, so check the loop without autocast to see one. Each "
            "update is compared with the reference optimizer's step on your own gradient (Adam turns the rounding "
            "of small gradient entries into large per-weight differences)"]


def _clip_note(ref: Reference, outcomes) -> list[str]:
    if not ref.clip_binds() or all(o.before_clip_seen for o in outcomes):
        return []
    return [f"max_grad_norm={ref.max_grad_norm:g} clips the full batch's gradient (norm "
            f"{float(np.linalg.norm(ref.mean_grads[0])):.4g}), and after a plain loss.backward() the check does not "
            "see your gradient before the clip: a loop whose gradient has the right direction but the wrong size is "
            "clipped to the same norm and passes; use ctx.backward in the step, or check also with a max_grad_norm "
            "that does not bind"]


# ----------------------------------------------------------------------------------------------
# The public function.
# ----------------------------------------------------------------------------------------------


def check_accumulation(step, make_model, micro_batches, loss_fn, *, num_processes=(1, 2), make_optimizer=None,
                       lr: float | None = None, tol: float = 1e-4,
                       max_grad_norm: float | None = None) -> AccumulationReport:
    """Run your accumulation ``step`` and the full-batch reference from the same weights; report.

    ``step(model, optimizer, micro_batches, loss_fn, ctx)`` is your loop for ONE optimizer
    update over this rank's share of the window: forward and backward each micro-batch, then
    ``optimizer.step()`` and ``optimizer.zero_grad()``. ``ctx`` is a :class:`StepContext`
    (``rank``, ``num_processes``, ``grad_accum_steps``, ``all_reduce_sum``, ``backward``, ``no_sync``).

    ``make_model()`` builds a fresh model with deterministic weights (called once for the
    reference and once per simulated rank). ``micro_batches`` is the whole window, a list of
    ``P x GA`` micro-batches, dealt to the P ranks as Accelerate does (rank r gets r, r+P, ...);
    every rank gets fresh copies of its micro-batches in every window. ``loss_fn(model, batch)``
    returns ``(summed_loss_tensor, number_of_targets)``.

    ``make_optimizer(params)`` builds the optimizer (e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-3)``);
    the reference steps the same kind of optimizer once per window on the full batch's mean
    gradient, with the settings (lr, ...) your optimizer has when each window begins. Without it,
    plain SGD with learning rate ``lr`` (default 0.1). ``max_grad_norm``: the max_norm your step
    clips the gradient to (after the all-reduce); the reference clips the full batch's the same way.

    ``tol`` is relative (at most 0.01): the gradient handed to ``optimizer.step()`` and each
    window's update must be within ``tol`` (plus the dtype's rounding floor) of the reference's,
    measured as |difference| / |reference| over all weights. Returns an :class:`AccumulationReport`.
    """
    check_callable("step", step, "step(model, optimizer, micro_batches, loss_fn, ctx)")
    check_callable("make_model", make_model, "make_model() returning a torch.nn.Module")
    check_callable("loss_fn", loss_fn, "loss_fn(model, batch) returning (summed_loss_tensor, number_of_targets)")
    micro_batches = check_micro_batches(micro_batches)
    process_counts = check_process_counts(num_processes, len(micro_batches))
    tol = check_float("tol", tol, minimum=0.0, exclusive_minimum=True, maximum=0.01)
    if max_grad_norm is not None:
        max_grad_norm = check_float("max_grad_norm", max_grad_norm, minimum=0.0, exclusive_minimum=True)
    if make_optimizer is None:
        lr = check_float("lr", 0.1 if lr is None else lr, minimum=0.0, exclusive_minimum=True, maximum=1e3)
        make_optimizer = lambda params: PlainSGD(params, lr)  # noqa: E731 -- the default, like the user's would be
    else:
        check_callable("make_optimizer", make_optimizer, "make_optimizer(params) returning an optimizer")
        if lr is not None:
            raise ValueError("lr applies to the default SGD only; with make_optimizer set the learning rate there")

    # Tiny models: intra-op threads that spin for a core only slow the ranks down (restored afterwards).
    with single_thread():
        known: dict = {}
        reference_model = build_model(make_model, known)
        w0 = flat(trainable(reference_model))
        models = {p: [build_model(make_model, known, w0) for _ in range(p)] for p in process_counts}
        # The reference first: it checks the arguments. (Run in threads beside the user's runs, as tried
        # before, the check of tiny_lm(16) took 111 ms against 106 ms one after the other: its kernels are
        # too small for torch's release of the GIL to pay for the threads.)
        ref = reference(reference_model, make_optimizer, micro_batches, loss_fn, max_grad_norm)
        runs = [run_processes(step, ms, make_optimizer, micro_batches, loss_fn) for ms in models.values()]
        ref.before_shift = diagnoses.counts_before_the_shift(micro_batches, ref.counts)
        ref.step_second_windows([run.ranks.records[1][0].settings for run in runs])
        outcomes = [judge(run, ref, tol) for run in runs]
        problem = None if all(o.check.passed for o in outcomes) else nondeterminism(ref.model, micro_batches, loss_fn)
        if problem is not None:  # nothing the step did can be judged
            return AccumulationReport(verdict="inconclusive", tol=tol, relative_distance=float("nan"),
                                      update_ratio={}, details={}, diagnosis=(), cannot_judge=(problem,))
        dependence, full_distance = _batch_dependence(ref, runs, make_model, known, micro_batches, loss_fn, outcomes)
    details = {o.num_processes: o.check for o in outcomes}
    diagnosis, ambiguity = diagnoses.diagnose(outcomes)
    if dependence is not None:
        diagnosis.insert(0, dependence)
    notes = ambiguity + diagnoses.limits(outcomes, ref.counts) + _precision_note(outcomes) + _clip_note(ref, outcomes)
    coarse = max(d.allowed for d in details.values())
    if coarse > LOOSEST:
        notes.append(f"at this learning rate and dtype the weights can only be compared to within {coarse:.0%} "
                     "(rounding of the weights is that large next to the update); the verdict on the normalisation "
                     "rests on the gradient handed to optimizer.step()")
    distances = [x for d in details.values() for x in (d.gradient_distance, d.weight_distance)]
    verdicts = {d.verdict for d in details.values()}
    verdict = "failed" if "failed" in verdicts or dependence is not None else \
        "inconclusive" if "inconclusive" in verdicts else "passed"
    cannot_judge = _merged_reasons(details) if verdict == "inconclusive" else ()
    if verdict == "failed":
        notes += [d.cannot_judge for d in details.values() if d.cannot_judge]
    return AccumulationReport(
        verdict=verdict, tol=tol, relative_distance=float(np.nanmax(distances)),
        update_ratio={p: d.update_ratio for p, d in details.items()}, details=details, diagnosis=tuple(diagnosis),
        notes=tuple(notes), full_batch_distance=full_distance, cannot_judge=cannot_judge)


def _merged_reasons(details) -> tuple[str, ...]:
    """Each reason for no verdict once (the first process count's text), with the counts it holds for when not all."""
    found: dict[str, tuple[list, str]] = {}
    for p, d in details.items():
        if d.cannot_judge:
            found.setdefault(d.cannot_judge.split(":", 1)[0], ([], d.cannot_judge))[0].append(p)
    reasons = []
    for label, (counts, text) in found.items():
        where = "" if len(counts) == len(details) else \
            f" (only with {', '.join(map(str, counts))} process{'' if counts == [1] else 'es'})"
        reasons.append(label + where + text[len(label):])
    return tuple(reasons)
