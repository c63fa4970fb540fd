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
pitfall the report names it (:mod:`.diagnoses`). The report is truthy only when the check
passed, so ``assert check_accumulation(...)`` works in a test.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from gaccum_lib._checks import check_float
from gaccum_lib._threads import single_thread
from gaccum_lib.sharding import shard_batches

from . import diagnoses
from .ranks import WINDOWS, AccumulationCheckError, PlainSGD, StepContext, processes_text, run_ranks
from .reference import (
    FLOOR_EPS,
    LOOSEST,
    build_model,
    check_callable,
    check_micro_batches,
    check_process_counts,
    reference,
)

__all__ = ["AccumulationCheckError", "AccumulationReport", "ProcessCheck", "StepContext", "check_accumulation"]



@dataclass(frozen=True)
class ProcessCheck:
    """The check with one number of processes. Distances are relative to the reference."""

    num_processes: int
    grad_accum_steps: int
    passed: bool
    gradient_distance: float  # |gradient handed to step - full batch's| / |full batch's|, worst window
    weight_distance: float  # |update - reference update| / |reference update|, worst window and rank
    allowed: float  # tol + the dtype's rounding floor, for the weights
    update_ratio: float  # the gradient's projection on the reference's, over its squared norm
    cosine: float
    optimizer_steps: int
    rank_spread: float  # largest distance between two ranks' weights, relative to the reference update
    matches: tuple[str, ...]
    diagnosis: tuple[str, ...]
    reference_weights: np.ndarray = field(repr=False)
    user_weights: np.ndarray = field(repr=False)

    def summary(self) -> str:
        status = "passed" if self.passed else "FAILED"
        return (f"{processes_text(self.num_processes)} (GA={self.grad_accum_steps}): {status}  gradient off by "
                f"{self.gradient_distance:.2e}, weights by {self.weight_distance:.2e} (relative; allowed "
                f"{self.allowed:.1e})  gradient ratio {self.update_ratio:.4g}  cosine {self.cosine:.6f}  "
                f"optimizer.step() x{self.optimizer_steps} per window")


@dataclass(frozen=True, eq=False, repr=False)
class AccumulationReport:
    """What :func:`check_accumulation` found. Truthy only when it passed.

    ``diagnosis`` lists what is wrong, each as ``"label: explanation"`` (the label says which
    process counts, when not all); ``notes`` say what this check could not tell.
    ``relative_distance`` is the largest relative distance found (gradient or weights);
    ``update_ratio`` and ``details`` (a :class:`ProcessCheck` each) are keyed by process count.
    """

    passed: bool
    tol: float
    relative_distance: float
    update_ratio: dict[int, float]
    details: dict[int, ProcessCheck]
    diagnosis: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.passed

    @property
    def labels(self) -> tuple[str, ...]:
        """The short label of each diagnosis (before its first colon, without "(only with N processes)"), each once."""
        return tuple(dict.fromkeys(re.sub(r" \(only with [^)]*\)$", "", d.split(":", 1)[0]) for d in self.diagnosis))

    @property
    def failed_process_counts(self) -> tuple[int, ...]:
        return tuple(p for p, d in self.details.items() if not d.passed)

    def __repr__(self) -> str:
        # One line, diagnosis labels first: pytest shows about the first 120 characters of the
        # repr when a plain `assert report` fails.
        head = "passed" if self.passed else "FAILED"
        if self.diagnosis:  # the labels with the process counts they hold for
            head += ": " + "; ".join(dict.fromkeys(d.split(":", 1)[0] for d in self.diagnosis))
        parts = [head] + [f"{processes_text(d.num_processes)} GA={d.grad_accum_steps}: gradient "
                          f"{d.gradient_distance:.1e}, weights {d.weight_distance:.1e}" for d in self.details.values()]
        return "AccumulationReport(" + " | ".join(parts + [f"tol {self.tol:g}"]) + ")"

    def __str__(self) -> str:
        lines = [f"check_accumulation {'passed' if self.passed else 'FAILED'} (relative tol {self.tol:g}, largest "
                 f"relative distance {self.relative_distance:.3e})"]
        lines += [f"  {d.summary()}" for d in self.details.values()]
        if self.diagnosis:
            lines += ["diagnosis:"] + [f"  - {d}" for d in self.diagnosis]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# One process count: run, measure, diagnose.
# ----------------------------------------------------------------------------------------------


@dataclass
class _Outcome:
    num_processes: int
    grad_accum_steps: int
    first_failed: bool
    structural: list
    matches: list | None  # None: not comparable (the optimizer did not step exactly once)
    check: ProcessCheck | None = None


def _distance(a, b, floor) -> float:
    return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), floor)


def _check_processes(step, make_model, make_optimizer, micro_batches, loss_fn, num_processes, tol, ref, known):
    ga = len(micro_batches) // num_processes
    shards = shard_batches([[k] for k in range(len(micro_batches))], num_processes, 1)
    shard_indices = [[mb[0] for mb in shard] for shard in shards]
    models = [build_model(make_model, known, ref["w0"]) for _ in range(num_processes)]
    rank_batches = [[micro_batches[k] for k in shard] for shard in shard_indices]
    weights, gradients, steps, zero_grads = run_ranks(step, models, rank_batches, loss_fn, make_optimizer, ga)
    if int(steps.min()) == 0:
        window, rank = (int(i) for i in np.argwhere(steps == 0)[0])
        raise ValueError(f"step never called optimizer.step() (rank {rank} of {num_processes}, window {window + 1}); "
                         "it must make one optimizer update over its micro-batches: forward and backward each one, "
                         "then optimizer.step() and optimizer.zero_grad() on the optimizer it is given")

    w0, ref_weights, eps = ref["w0"], ref["weights"], ref["eps"]
    updates = np.diff(np.concatenate([w0[None], ref_weights]), axis=0)  # the reference update of each window
    # Rounding floor: a few eps of the weights' size (the update is added to them in the model's dtype).
    floors = [FLOOR_EPS * eps * float(np.linalg.norm(ref_weights[w])) for w in range(WINDOWS)]
    allowed = [tol + floors[w] / float(np.linalg.norm(updates[w])) for w in range(WINDOWS)]
    previous = np.concatenate([np.broadcast_to(w0, weights[0].shape)[None], weights[:-1]])
    # Each window's update compared with the reference update from where this run stood.
    window_dist = np.array([max(_distance(weights[w, r] - previous[w, r], updates[w], 1e-300)
                                for r in range(num_processes)) for w in range(WINDOWS)])
    spread = max(float(np.linalg.norm(weights[w, r] - weights[w, 0])) / float(np.linalg.norm(updates[w]))
                 for w in range(WINDOWS) for r in range(num_processes))
    most_steps = int(steps.max())
    user_grad = gradients[0][0]
    grad_allowed = tol + ref["gradient_floor"]
    if user_grad is not None and np.all(np.isfinite(user_grad)):
        g_ref = ref["mean_grads"][0]
        grad_dist = _distance(user_grad, g_ref, 1e-300)
        ratio = float(user_grad @ g_ref) / float(g_ref @ g_ref)
        norm = float(np.linalg.norm(user_grad))
        cosine = float(user_grad @ g_ref) / (norm * float(np.linalg.norm(g_ref))) if norm > 0 else 0.0
        first_failed = grad_dist > grad_allowed or window_dist[0] > allowed[0]
    else:
        grad_dist, ratio, cosine = float("inf") if user_grad is not None else float("nan"), float("nan"), float("nan")
        first_failed = True

    structural = []
    if user_grad is not None and not np.all(np.isfinite(user_grad)):
        structural.append(diagnoses.nonfinite(ref["counts"]))
    if most_steps > 1:
        label = "optimizer stepped on every micro-batch" if most_steps == ga else \
            f"optimizer stepped {most_steps} times per window"
        structural.append(f"{label}: optimizer.step() ran {most_steps} times in one window of GA={ga} micro-batches "
                          "but must run once, after the window's last backward; an optimizer not prepared by "
                          "Accelerate steps on every micro-batch")
    if spread > allowed[0]:
        structural.append(f"ranks diverged: the replicas ended up {spread:.3e} (relative to the update) apart; "
                          "their gradients were not averaged before the step (no_sync on the last micro-batch?) or "
                          "something changed the weights differently on each rank")
    if most_steps == 1 and not first_failed and window_dist[1] > allowed[1]:
        hint = ("optimizer.zero_grad() was never called, so the second window adds onto the first window's gradients"
                if int(zero_grads.max()) == 0 else "gradients or other state of the first window leak into the second")
        structural.append(f"state carried over between windows: the first update matches the reference but the "
                          f"second does not; {hint}")
    if (most_steps == 1 and grad_dist <= grad_allowed and window_dist[0] > allowed[0] and spread <= allowed[0]):
        structural.append(f"right gradient, wrong update: optimizer.step() got the full batch's gradient, but the "
                          f"update is {window_dist[0]:.3g} (relative) off the reference optimizer's; was the learning "
                          "rate or another optimizer setting changed, or the weights edited outside the step?")
    if first_failed and user_grad is not None and not np.any(user_grad):
        structural.append("no update: the gradient handed to optimizer.step() is 0; were the gradients zeroed "
                          "before optimizer.step(), or does the loss not reach the parameters?")

    matches = None
    if most_steps == 1 and user_grad is not None and np.all(np.isfinite(user_grad)):
        candidates = diagnoses.candidate_gradients(ref["grads"], ref["counts"], shard_indices, ga, num_processes,
                                                   ref["before_shift"])
        matches = [keys for keys, g in candidates if _distance(user_grad, g, 1e-300) <= grad_allowed]
    local = []
    if first_failed and matches is not None and np.any(user_grad) and not structural:
        local = diagnoses.issue_texts(diagnoses.simplest(matches)) if matches else \
            diagnoses.unexplained(ratio, cosine, ga)
    # A later window is compared only when the first was right: otherwise it starts from other weights.
    later = [w for w in range(1, WINDOWS) if not first_failed and gradients[w][0] is not None]
    grad_dist = max([grad_dist] + [_distance(gradients[w][0], ref["mean_grads"][w], 1e-300) for w in later])
    weight_dist = float(window_dist[0] if first_failed else window_dist.max())
    passed = (not first_failed and most_steps == 1 and spread <= allowed[0] and weight_dist <= max(allowed)
              and grad_dist <= grad_allowed)
    check = ProcessCheck(
        num_processes=num_processes, grad_accum_steps=ga, passed=passed, gradient_distance=grad_dist,
        weight_distance=weight_dist, allowed=max(allowed), update_ratio=ratio, cosine=cosine,
        optimizer_steps=most_steps, rank_spread=spread,
        matches=tuple("+".join(m) for m in diagnoses.simplest(matches)) if first_failed and matches else (),
        diagnosis=tuple(structural + local), reference_weights=ref_weights[0].copy(), user_weights=weights[0, 0].copy())
    return _Outcome(num_processes, ga, first_failed, structural, matches, check)


# ----------------------------------------------------------------------------------------------
# The public function.
# ----------------------------------------------------------------------------------------------


def check_accumulation(step, make_model, micro_batches, loss_fn, *, num_processes=(1, 2), make_optimizer=None,
                       lr: float | None = None, tol: float = 1e-4) -> AccumulationReport:
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
    gradient. Without it, plain SGD with learning rate ``lr`` (default 0.1).

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
    if make_optimizer is None:
        lr = check_float("lr", 0.1 if lr is None else lr, minimum=0.0, exclusive_minimum=True, maximum=1e3)
        make_optimizer = lambda params: PlainSGD(params, lr)  # noqa: E731 -- the default, like the user's would be
    else:
        check_callable("make_optimizer", make_optimizer, "make_optimizer(params) returning an optimizer")
        if lr is not None:
            raise ValueError("lr applies to the default SGD only; with make_optimizer set the learning rate there")

    with single_thread():  # tiny models: threads that spin for a core only slow the ranks down
        known: dict = {}
        ref = reference(make_model, make_optimizer, micro_batches, loss_fn, known)
        if ref["problem"] is not None:
            return AccumulationReport(passed=False, tol=tol, relative_distance=float("nan"), update_ratio={},
                                      details={}, diagnosis=(ref["problem"],))
        ref["before_shift"] = diagnoses.counts_before_the_shift(micro_batches, ref["counts"])
        outcomes = [_check_processes(step, make_model, make_optimizer, micro_batches, loss_fn, p, tol, ref, known)
                    for p in process_counts]
    details = {o.num_processes: o.check for o in outcomes}
    diagnosis, ambiguity = diagnoses.diagnose(outcomes)
    notes = ambiguity + diagnoses.limits(outcomes, ref["counts"])
    coarse = max(d.allowed for d in details.values())
    if coarse > LOOSEST:
        notes.append(f"at this learning rate and dtype the weights can only be compared to within {coarse:.0%} "
                     "(rounding of the weights is that large next to the update); the verdict on the normalisation "
                     "rests on the gradient handed to optimizer.step()")
    distances = [x for d in details.values() for x in (d.gradient_distance, d.weight_distance)]
    return AccumulationReport(
        passed=all(d.passed for d in details.values()), tol=tol, relative_distance=float(np.nanmax(distances)),
        update_ratio={p: d.update_ratio for p, d in details.items()}, details=details, diagnosis=tuple(diagnosis),
        notes=tuple(notes))
