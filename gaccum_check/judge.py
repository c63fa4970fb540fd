"""One process count of :func:`~gaccum_check.check_accumulation`: run the user's step, judge it.

The gradient handed to ``optimizer.step()`` and the weights after each window are compared with
the reference; what is off is explained by a known pitfall where one fits (:mod:`.diagnoses`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from gaccum_lib.sharding import shard_batches

from . import diagnoses
from .ranks import WINDOWS, RankRun, processes_text, run_ranks
from .reference import FLOOR_EPS, LOOSEST, Precision, Reference, clipped, lowered_precision


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
    cannot_judge: str | None = None  # why there is no verdict (then passed is False, and nothing was found wrong)

    @property
    def verdict(self) -> str:
        return "passed" if self.passed else "inconclusive" if self.cannot_judge else "failed"

    def summary(self) -> str:
        status = {"passed": "passed", "failed": "FAILED", "inconclusive": "INCONCLUSIVE"}[self.verdict]
        return (f"{processes_text(self.num_processes)} (GA={self.grad_accum_steps}): {status}  gradient off by "
                f"{self.gradient_distance:.2e}, weights by {self.weight_distance:.2e} (relative; allowed "
                f"{self.allowed:.1e})  gradient ratio {self.update_ratio:.4g}  cosine {self.cosine:.6f}  "
                f"optimizer.step() x{self.optimizer_steps} per window")




# ----------------------------------------------------------------------------------------------
# One process count: run it, then judge it against the reference.
# ----------------------------------------------------------------------------------------------


@dataclass
class _Run:
    num_processes: int
    grad_accum_steps: int
    shard_indices: list
    ranks: RankRun


@dataclass
class _Outcome:
    num_processes: int
    grad_accum_steps: int
    first_failed: bool
    judged_failed: bool  # the gradient the pitfalls are matched against (the one before a clip, if seen) is off
    structural: list  # Findings that explain a failure by themselves (how often the optimizer stepped, ...)
    clip: list  # Findings about a clip after the sync: the accumulation before it is still judged
    local: list  # Findings on this process count's own gradient: a known pitfall, or none
    matches: list | None  # None: not comparable (the optimizer did not step exactly once)
    precision: Precision | None
    before_clip_seen: bool  # the check saw the gradient before the step's clip (ctx.backward), or there was none
    check: ProcessCheck | None = None


def _distance(a, b) -> float:
    return float(np.linalg.norm(a - b)) / max(float(np.linalg.norm(b)), 1e-300)


def _ratio_and_cosine(g, ref) -> tuple[float, float]:
    """g projected on ref over ref's squared norm (1 when right), and the cosine between them."""
    ratio = float(g @ ref) / float(ref @ ref)
    norm = float(np.linalg.norm(g))
    return ratio, float(g @ ref) / (norm * float(np.linalg.norm(ref))) if norm > 0 else 0.0


def run_processes(step, models, make_optimizer, micro_batches, loss_fn) -> _Run:
    """The user's step on ``len(models)`` simulated ranks, each window dealt to them as Accelerate does."""
    num_processes = len(models)
    ga = len(micro_batches) // num_processes
    shards = shard_batches([[k] for k in range(len(micro_batches))], num_processes, 1)
    shard_indices = [[mb[0] for mb in shard] for shard in shards]
    rank_batches = [[micro_batches[k] for k in shard] for shard in shard_indices]
    ranks = run_ranks(step, models, rank_batches, loss_fn, make_optimizer, ga)
    steps = ranks.steps
    if int(steps.min()) == 0:
        window, rank = (int(i) for i in np.argwhere(steps == 0)[0])
        raise ValueError(f"step never called optimizer.step() (rank {rank} of {num_processes}, window {window + 1}); "
                         "it must make one optimizer update over its micro-batches: forward and backward each one, "
                         "then optimizer.step() and optimizer.zero_grad() on the optimizer it is given")
    return _Run(num_processes, ga, shard_indices, ranks)


def _target_weights(ref: Reference, first, second, precision) -> np.ndarray:
    """The weights each window's update is compared with.

    The full batch's, with the optimizer settings each window began with; under lower precision the
    reference optimizer's step on the run's own gradient instead (its rounding would swamp Adam's update).
    """
    usable = [r.gradient if r.gradient is not None and np.all(np.isfinite(r.gradient)) else None
              for r in (first, second)]
    if precision is None or usable[0] is None:
        return ref.weights(second.settings)
    return ref.replay([usable[0], ref.handed(1) if usable[1] is None else usable[1]],
                      [first.settings, second.settings])


def _compare_weights(weights, w0, target, eps, tol):
    """Each window's update against the target's from where the run stood (worst rank), the allowed distance
    (tol + the rounding of adding an update to weights this size), and the ranks' spread."""
    updates = np.diff(np.concatenate([w0[None], target]), axis=0)
    sizes = [max(float(np.linalg.norm(u)), 1e-300) for u in updates]
    allowed = [tol + FLOOR_EPS * eps * float(np.linalg.norm(target[w])) / sizes[w] for w in range(WINDOWS)]
    previous = np.concatenate([np.broadcast_to(w0, weights[0].shape)[None], weights[:-1]])
    ranks = range(weights.shape[1])
    window_dist = np.array([max(_distance(weights[w, r] - previous[w, r], updates[w]) for r in ranks)
                            for w in range(WINDOWS)])
    spread = max(float(np.linalg.norm(weights[w, r] - weights[w, 0])) / sizes[w] for w in range(WINDOWS) for r in ranks)
    return window_dist, allowed, spread


def _clip_after_sync(record, ref: Reference, g, grad_dist, grad_allowed):
    """A clip the step applied between the all-reduce and optimizer.step(): (the gradient before it, findings).

    Seen when the step scaled the synced gradient down, keeping its direction (``ctx.backward`` loops: the
    check keeps the gradient each all-reduce left), or edited it after a plain backward on one process
    (then only the clipped gradient is known). Without ``max_grad_norm`` it is named and the step's gradient
    fails; with it, the gradient before the clip is judged against the unclipped full batch as well.
    """
    if g is None or not record.edited or not np.all(np.isfinite(g)):
        return None, []
    handed, full = ref.handed(0), ref.mean_grads[0]
    norm, full_norm = float(np.linalg.norm(g)), float(np.linalg.norm(full))
    before = record.before_edit
    if before is not None:
        factor, cosine = _ratio_and_cosine(g, before)
        if cosine < diagnoses.SAME_DIRECTION or factor > 1 - grad_allowed:
            return None, []  # not a clip: the edit is judged as part of the gradient
        if ref.max_grad_norm is None and grad_dist <= grad_allowed:
            return None, []  # a division after the all-reduce that lands on the full batch: a normalisation
        if ref.max_grad_norm is not None and abs(norm - ref.max_grad_norm) > grad_allowed * ref.max_grad_norm:
            return None, []  # scaled to some other norm than the clip's (a normalisation after the sync?)
        what = f"your step scaled the gradient by {factor:.4g} after the all-reduce, to norm {norm:.4g}"
        off = _distance(before, full)
        state = "before the clip it equals the full batch's" if off <= grad_allowed else \
            f"before the clip it is {off:.3g} (relative) off the full batch's"
    else:
        _, cosine = _ratio_and_cosine(g, handed)
        if ref.max_grad_norm is not None or grad_dist <= grad_allowed or cosine < diagnoses.SAME_DIRECTION \
                or norm >= float(np.linalg.norm(handed)):
            return None, []
        what = f"your step edited the gradient after the last backward: optimizer.step() got its direction at norm " \
               f"{norm:.4g}"
        state = "the check cannot see it before the edit with a plain loss.backward() (ctx.backward keeps it)"
    if ref.max_grad_norm is None:
        return before, [diagnoses.Finding(
            "gradient clipped", f"{what} (the full batch's gradient has norm {full_norm:.4g}); {state}",
            f"the full batch is clipped too: pass max_grad_norm={norm:.4g} (your clip's max_norm) to "
            "check_accumulation so that its reference clips the full batch's gradient the same way")]
    if grad_dist > grad_allowed:
        return before, [diagnoses.Finding(
            "gradient clipped", f"{what}, where the full batch clipped to max_grad_norm={ref.max_grad_norm:g} has "
                                f"norm {float(np.linalg.norm(handed)):.4g}; {state}",
            "clip to the max_grad_norm given here, after the all-reduce, once per window")]
    return before, []


def _not_clipped(ref: Reference, g, grad_dist, grad_allowed) -> list:
    """max_grad_norm clips the full batch, but the step handed optimizer.step() the unclipped gradient."""
    if g is None or not ref.clip_binds() or grad_dist <= grad_allowed or \
            _distance(g, ref.mean_grads[0]) > grad_allowed:
        return []
    return [diagnoses.Finding(
        "gradient not clipped", f"max_grad_norm={ref.max_grad_norm:g} clips the full batch's gradient (norm "
                                f"{float(np.linalg.norm(ref.mean_grads[0])):.4g}), but optimizer.step() got it "
                                "unclipped",
        "clip after the all-reduce, before optimizer.step(): torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "max_grad_norm)")]


def _last_alone(ref: Reference, g, shard_indices, kept: int, grad_allowed) -> bool:
    """Whether g is the gradient of each rank's last ``kept`` micro-batches alone, normalised as the window's."""
    if g is None or kept < 1:
        return False
    alone = sum(ref.grads[k] for shard in shard_indices for k in shard[-kept:]) / sum(ref.counts)
    return _distance(g, clipped(alone, ref.max_grad_norm)) <= grad_allowed


def _settings_change(record) -> str:
    """'lr 0.1 when the window began, 0.2 at optimizer.step()' for each setting the step changed, or ''."""
    if record.settings_at_step is None:
        return ""
    changes = []
    for before, after in zip(record.settings, record.settings_at_step, strict=False):
        for key, value in after.items():
            if key in before and repr(before[key]) != repr(value):
                changes.append(f"{key} {_setting_text(before[key])} when the window began, {_setting_text(value)} "
                               "at optimizer.step()")
    return "; ".join(dict.fromkeys(changes))


def _setting_text(value) -> str:
    if hasattr(value, "numel") and value.numel() == 1:
        value = float(value)
    return f"{value:g}" if isinstance(value, float) else repr(value)


SETTINGS_ADVICE = ("the reference follows the settings the optimizer has when each window begins (a scheduler "
                   "stepped after optimizer.step() sets them), so change them after optimizer.step()")


def _structural(run: _Run, ref: Reference, g, first_failed, grad_dist, grad_allowed, window_dist, allowed, spread):
    """Findings that explain a failure by themselves, from how the step ran rather than from the gradient's value."""
    ga, records = run.grad_accum_steps, run.ranks.records
    first, second = records[0][0], records[1][0]
    most_steps = int(run.ranks.steps.max())
    Finding = diagnoses.Finding
    found = []
    if first.edited_before_sync:
        found.append(Finding(
            "gradient edited before the all-reduce",
            advice="your step changes the gradient between a plain loss.backward() and optimizer.step() (a clip?); "
                   "under DDP that backward already averaged the gradient over the ranks, but in this check a plain "
                   "backward is averaged only at optimizer.step(), so the edit saw each rank's own gradient: call "
                   "ctx.backward(loss) (accelerator.backward) in the step you check"))
    if g is not None and not np.all(np.isfinite(g)):
        found.append(diagnoses.nonfinite(ref.counts))
    if most_steps > 1:
        label = "optimizer stepped on every micro-batch" if most_steps == ga else \
            f"optimizer stepped {most_steps} times per window"
        found.append(Finding(label, f"optimizer.step() ran {most_steps} times in one window of GA={ga} micro-batches",
                             "it must run once, after the window's last backward; an optimizer not prepared by "
                             "Accelerate steps on every micro-batch"))
    shape = diagnoses.WindowShape.of(first.events)
    if most_steps == 1:
        last_alone = _last_alone(ref, g, run.shard_indices, shape.kept, grad_allowed)
        found += [f for f in (diagnoses.zeroed_inside(shape, ga, last_alone), diagnoses.step_too_early(shape)) if f]
        # Zeroed by something other than optimizer.zero_grad(), when the last micro-batch alone is told apart
        # from the full batch / GA (equal micro-batches: the loss divided by GA twice gives the same).
        last = functools.partial(_last_alone, ref, shard_indices=run.shard_indices, kept=1, grad_allowed=grad_allowed)
        if first_failed and shape.kept == shape.before_step > 1 and last(g) and not last(ref.mean_grads[0] / ga):
            found.append(diagnoses.zeroed_unseen(ga))  # zeroed by something other than optimizer.zero_grad()
    if spread > allowed[0]:
        found.append(Finding("ranks diverged", f"the replicas ended up {spread:.3e} (relative to the update) apart",
                             "their gradients were not averaged before the step (no_sync on the last micro-batch?) or "
                             "something changed the weights differently on each rank"))
    if most_steps == 1 and not first_failed and window_dist[1] > allowed[1]:
        zero_grads = sum(r.zero_grads for window in records for r in window)
        changed = _settings_change(second)
        hint = (f"the optimizer's settings changed inside the step ({changed}); {SETTINGS_ADVICE}" if changed else
                "optimizer.zero_grad() was never called, so the second window adds onto the first window's gradients"
                if zero_grads == 0 else "gradients or other state of the first window leak into the second")
        found.append(Finding("state carried over between windows",
                             advice=f"the first update matches the reference but the second does not; {hint}"))
    if most_steps == 1 and grad_dist <= grad_allowed and window_dist[0] > allowed[0] and spread <= allowed[0]:
        changed = _settings_change(first)
        found.append(Finding(
            "right gradient, wrong update",
            f"optimizer.step() got the full batch's gradient, but the update is {window_dist[0]:.3g} (relative) off "
            "the reference optimizer's" + (f"; the optimizer's settings changed inside the step: {changed}"
                                          if changed else ""),
            SETTINGS_ADVICE if changed else "was the learning rate or another optimizer setting changed, or the "
                                            "weights edited outside the step?"))
    if first_failed and g is not None and not np.any(g):
        where = ("optimizer.zero_grad() ran after the window's last backward, before optimizer.step()"
                 if shape.before_step and not shape.kept else "")
        found.append(Finding("no update", "the gradient handed to optimizer.step() is 0" + (f": {where}" if where
                                                                                           else ""),
                             "were the gradients zeroed before optimizer.step(), or does the loss not reach the "
                             "parameters?"))
    return found


def judge(run: _Run, ref: Reference, tol: float) -> _Outcome:
    """Compare one process count's run with the reference: gradient, updates, ranks; then name what is wrong."""
    p, ga, records = run.num_processes, run.grad_accum_steps, run.ranks.records
    first, second = records[0][0], records[1][0]  # rank 0's: every rank made the same calls
    precision = lowered_precision(run.ranks.autocast, ref.param_dtypes, ref.cancellation)
    grad_allowed = tol + ref.gradient_floor + (precision.floor if precision is not None else 0.0)
    most_steps = int(run.ranks.steps.max())
    target = _target_weights(ref, first, second, precision)
    window_dist, allowed, spread = _compare_weights(run.ranks.weights, ref.w0, target, ref.eps, tol)

    g, handed = first.gradient, ref.handed(0)
    finite = g is not None and bool(np.all(np.isfinite(g)))
    if finite:
        grad_dist = _distance(g, handed)
        ratio, cosine = _ratio_and_cosine(g, handed)
    else:
        grad_dist, ratio, cosine = float("inf") if g is not None else float("nan"), float("nan"), float("nan")
    before, clip = _clip_after_sync(first, ref, g, grad_dist, grad_allowed)
    # The accumulation is judged before the step's clip when the check saw it there, against the unclipped full batch.
    judged, judged_ref = (before, ref.mean_grads[0]) if before is not None else (g, handed)
    judged_dist = _distance(judged, judged_ref) if finite else grad_dist
    judged_failed = finite and judged_dist > grad_allowed
    first_failed = not finite or grad_dist > grad_allowed or judged_dist > grad_allowed or window_dist[0] > allowed[0]

    structural = _structural(run, ref, g, first_failed, grad_dist, grad_allowed, window_dist, allowed, spread)
    structural += _not_clipped(ref, g, grad_dist, grad_allowed)
    # Where the rounding allowed is this large, a loop within it is not known to be right: no verdict.
    too_coarse = precision is not None and grad_allowed >= LOOSEST

    matches = None
    if most_steps == 1 and finite:
        candidates = diagnoses.candidate_gradients(ref.grads, ref.counts, run.shard_indices, ga, p, ref.before_shift)
        if before is None and ref.max_grad_norm is not None:  # the step's gradient is clipped: so are the pitfalls'
            candidates = [(keys, clipped(c, ref.max_grad_norm)) for keys, c in candidates]
        matches = [keys for keys, c in candidates if _distance(judged, c) <= grad_allowed]
    local = []
    if judged_failed and matches is not None and np.any(judged) and not structural:
        if matches:
            local = diagnoses.issue_findings(diagnoses.simplest(matches))
        else:
            local = [diagnoses.unexplained(*_ratio_and_cosine(judged, judged_ref), ga, judged_dist, precision)]
    # A later window is compared only when the first was right: otherwise it starts from other weights.
    later = [w for w in range(1, WINDOWS) if not first_failed and records[w][0].gradient is not None]
    grad_dist = max([grad_dist, judged_dist] + [_distance(records[w][0].gradient, ref.handed(w)) for w in later])
    weight_dist = float(window_dist[0] if first_failed else window_dist.max())
    passed = (not first_failed and most_steps == 1 and spread <= allowed[0] and weight_dist <= max(allowed)
              and grad_dist <= grad_allowed and not structural)
    cannot_judge = None
    if passed and too_coarse:
        passed, cannot_judge = False, (
            f"lower-precision rounding: {precision.describe()}: rounding alone could move the gradient by "
            f"{grad_allowed:.0%} (measured {grad_dist:.1e}); the check cannot tell a 5 % error from a pass at this "
            "precision; check the loop without autocast (the normalisation does not depend on the precision)")
    findings = structural + clip + local
    check = ProcessCheck(
        num_processes=p, grad_accum_steps=ga, passed=passed, gradient_distance=grad_dist,
        weight_distance=weight_dist, allowed=max(allowed), update_ratio=ratio, cosine=cosine,
        optimizer_steps=most_steps, rank_spread=spread,
        matches=tuple("+".join(m) for m in diagnoses.simplest(matches)) if judged_failed and matches else (),
        diagnosis=tuple(f.text for f in findings), reference_weights=target[0].copy(),
        user_weights=run.ranks.weights[0, 0].copy(), cannot_judge=cannot_judge)
    before_clip_seen = before is not None or not first.edited
    return _Outcome(p, ga, first_failed, judged_failed, structural, clip, local, matches, precision, before_clip_seen,
                    check)
