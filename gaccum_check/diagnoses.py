"""What a failed :func:`~gaccum_lib.check.check_accumulation` was, by name.

Every known normalisation pitfall turns the window's per-micro-batch gradients into a
different averaged gradient, which :func:`candidate_gradients` computes exactly (each is a
weighted sum of the micro-batches' gradients). The gradient the user's loop handed to
``optimizer.step()`` is compared with each: a match names the pitfall, whatever optimizer
turns the gradient into an update afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from gaccum_lib.data import IGNORE_INDEX
from gaccum_lib.strategies import plain_backward_loss

from .ranks import processes_text

# Cosine above this: the gradient points the reference's way.
SAME_DIRECTION = 1.0 - 1e-6


@dataclass(frozen=True)
class Finding:
    """One diagnosis of one process count: ``label``, the numbers seen (``facts``) and what to do (``advice``).

    The report prints each label once, with the facts of every process count it holds for
    (once when they agree) and the advice once: "label: facts; advice".
    """

    label: str
    facts: str = ""
    advice: str = ""

    @property
    def text(self) -> str:
        return f"{self.label}: " + "; ".join(part for part in (self.facts, self.advice) if part)

# Known pitfalls: (short label, what to do). A diagnosis reads "label: explanation".
ISSUES = {
    "divided_twice": (
        "loss divided by GA twice",
        "the gradient is 1/GA of the reference; accelerator.backward (like ctx.backward) already divides the loss "
        "by gradient_accumulation_steps, so do not divide it by hand as well"),
    "not_divided": (
        "loss not divided by GA",
        "the gradient is GA times the reference; with a plain loss.backward() divide each micro-batch's loss by "
        "the number of accumulation steps (accelerator.backward does it for you)"),
    "mean_of_means": (
        "mean of micro-batch means",
        "each micro-batch's mean loss weighs the same however many targets it has, so with variable-length "
        "micro-batches the short ones count too much; sum the per-target losses and divide by the window's total "
        "target count (all micro-batches, all ranks)"),
    "count_not_gathered": (
        "token count not gathered across ranks",
        "each rank divides by its own target count; sum the count over the ranks first "
        "(accelerator.gather(count).sum(), here ctx.all_reduce_sum(count))"),
    "missing_world_scale": (
        "missing x num_processes",
        "the gradient is 1/num_processes of the reference; DDP averages the gradients over the ranks, so a loss "
        "divided by the global target count must be multiplied by num_processes"),
    "counted_before_shift": (
        "targets counted before the shift",
        "the gradient is (targets after the shift) / (targets before the shift) of the reference; the loss predicts "
        "token t + 1 at position t, so a row has one target fewer than it has labels that are not -100; count "
        "the shifted labels (labels[:, 1:] != -100), as the loss does"),
}


def candidate_gradients(grads, counts, shard_indices, grad_accum_steps, num_processes, counts_before_shift=None):
    """The averaged gradient each known pitfall hands ``optimizer.step()`` in this window: (issue keys, vector).

    ``counts_before_shift``: each micro-batch's labels that are not -100, when the loss shifts them
    (see :func:`counts_before_the_shift`); None when it does not.
    """
    total = sum(counts)
    ga, world = grad_accum_steps, num_processes

    def local_counts(per_batch):
        return [sum(per_batch[k] for k in shard) for shard in shard_indices]

    local = local_counts(counts)

    def averaged(strategy, local=local):
        g = np.zeros(grads.shape[1])
        for r, shard in enumerate(shard_indices):
            for k in shard:
                # plain_backward_loss is linear in the summed loss: with loss_sum=1 it is the micro-batch's weight.
                # A micro-batch without targets has a zero gradient whatever it is divided by (max(.., 1)).
                weight = plain_backward_loss(strategy, 1.0, max(counts[k], 1), window_terms=total,
                                             local_window_terms=max(local[r], 1), grad_accum_steps=ga,
                                             num_processes=world)
                g += weight * grads[k]
        return g / world  # DDP averages the ranks' gradients

    reference = grads.sum(axis=0) / total
    mean_of_means = averaged("mean_of_means")
    local_count = averaged("token_local_count")
    candidates = [(("divided_twice",), reference / ga), (("not_divided",), reference * ga),
                  (("missing_world_scale",), averaged("token_no_world_scale")),
                  (("mean_of_means",), mean_of_means), (("divided_twice", "mean_of_means"), mean_of_means / ga),
                  (("not_divided", "mean_of_means"), mean_of_means * ga),
                  (("count_not_gathered",), local_count),
                  (("count_not_gathered", "missing_world_scale"), local_count / world)]
    if counts_before_shift is not None:
        # The right loop with the normaliser counted before the shift: the reference scaled by after / before.
        shifted = reference * total / sum(counts_before_shift)
        candidates += [(("counted_before_shift",), shifted),
                       (("divided_twice", "counted_before_shift"), shifted / ga),
                       (("not_divided", "counted_before_shift"), shifted * ga),
                       (("missing_world_scale", "counted_before_shift"), shifted / world),
                       (("count_not_gathered", "counted_before_shift"),
                        averaged("token_local_count", local_counts(counts_before_shift)))]
    return candidates


def _integer_labels(batch):
    """The batch's ``"labels"`` as an integer tensor (lists of ints too), or None."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, list | tuple):
        try:
            labels = torch.as_tensor(labels)
        except (TypeError, ValueError, RuntimeError):  # ragged or not numbers
            return None
    if not isinstance(labels, torch.Tensor) or labels.ndim == 0 or labels.is_floating_point() \
            or labels.dtype == torch.bool:
        return None
    return labels


def counts_before_the_shift(micro_batches, counts) -> list[int] | None:
    """Each micro-batch's labels that are not -100, when the loss counts its targets after a causal shift.

    A causal-LM loss compares the logits at positions 0..T-2 with the labels at 1..T-1, so it
    counts ``labels[..., 1:] != -100``. Only when every micro-batch is a mapping with integer
    ``"labels"`` (a tensor or lists) and ``loss_fn`` counted exactly those shifted labels do we
    know the shift applies; and only when the two counts differ can counting before the shift
    change the update. None otherwise: the pitfall cannot be told apart here.
    """
    before = []
    for batch, count in zip(micro_batches, counts, strict=True):
        labels = _integer_labels(batch)
        if labels is None or int(labels[..., 1:].ne(IGNORE_INDEX).sum()) != count:
            return None
        before.append(int(labels.ne(IGNORE_INDEX).sum()))
    return before if sum(before) != sum(counts) else None


def simplest(matches) -> list[tuple[str, ...]]:
    """Drop an explanation when a simpler one (a subset of its issues) explains the same gradient."""
    sets = [set(m) for m in matches]
    return [m for m, s in zip(matches, sets, strict=True) if not any(o < s for o in sets)]


def issue_findings(explanations) -> list[Finding]:
    keys = {k for e in explanations for k in e}
    return [Finding(label, advice=text) for key, (label, text) in ISSUES.items() if key in keys]


def unexplained(ratio, cosine, ga, distance, precision=None) -> Finding:
    """A gradient no known pitfall gives: rounding of a lower precision, a wrong size, or something else."""
    if precision is not None and distance <= 4 * precision.floor:
        return Finding("lower-precision rounding",
                       f"the gradient is {distance:.2e} (relative) off the reference's, gradient ratio {ratio:.4g}, "
                       f"cosine {cosine:.6f}, more than the {precision.floor:.1e} that {precision.name}'s rounding "
                       "is allowed",
                       "a right loop rounds this much only on a deep model or a badly conditioned window; check the "
                       "loop without autocast (the normalisation does not depend on the precision)")
    if cosine >= SAME_DIRECTION:
        # Not necessarily a constant factor: on a model whose gradients all lie on one line (a 2-class
        # classifier without bias) any per-micro-batch weighting keeps the direction.
        return Finding("wrong update size",
                       f"the gradient points the reference's way but is {ratio:.4g} times its size "
                       f"({100 * abs(ratio - 1):.3g} % off)",
                       "no known pitfall gives exactly this; check what each micro-batch's loss is divided by (a "
                       "count that includes padding?), and that loss_fn returns the summed loss; if your step "
                       "clips the gradient, pass max_grad_norm= so that the reference clips it the same way")
    return Finding("no known pitfall matches", f"gradient ratio {ratio:.4g}, cosine {cosine:.4f} (GA={ga})",
                   "compare what each micro-batch feeds to backward with its summed loss / the window's total targets")


def nonfinite(counts) -> Finding:
    hint = (" A micro-batch has no targets (all labels -100): its own mean loss is 0 / 0, which is what a mean of "
            "micro-batch means divides by." if min(counts) == 0 else "")
    return Finding("non-finite gradient", f"optimizer.step() received NaN or inf.{hint}")


# --- what the events of a window say: zero_grad inside it, a step before its last backward ------------------


@dataclass(frozen=True)
class WindowShape:
    """Where a window's first optimizer.step() fell among its backward passes (from its B/Z/S events)."""

    backwards: int  # in the whole window
    before_step: int  # backward passes before the step
    kept: int  # ... of which no zero_grad came after: the gradient the step got
    zero_grads: int

    @classmethod
    def of(cls, events: str) -> WindowShape:
        before, _, _ = events.partition("S")
        return cls(backwards=events.count("B"), before_step=before.count("B"),
                   kept=before.rpartition("Z")[2].count("B"), zero_grads=events.count("Z"))


def zeroed_inside(shape: WindowShape, ga: int, last_alone: bool) -> Finding | None:
    """zero_grad() between the window's backward passes: the step gets only the ones after the last of them."""
    if shape.kept == 0 or shape.kept == shape.before_step:
        return None
    every = shape.kept == 1
    label = "zero_grad on every micro-batch" if every else "gradients zeroed inside the window"
    got = "the last micro-batch's alone" if every else f"the last {shape.kept} of {shape.before_step} backward passes"
    matched = " (it equals that micro-batch's gradient, normalised as the window's)" if last_alone else ""
    return Finding(label, f"optimizer.zero_grad() ran {shape.zero_grads} times in one window of GA={ga} micro-batches, "
                          f"between its backward passes, so optimizer.step() got {got}{matched}",
                   "accumulating needs the gradients of every micro-batch: call optimizer.zero_grad() once per "
                   "window, after optimizer.step() (or before the first backward)")


def zeroed_unseen(ga: int) -> Finding:
    """The step got the last micro-batch's gradient alone, with no optimizer.zero_grad() in the window."""
    return Finding("zero_grad on every micro-batch",
                   f"optimizer.step() got the last of the window's GA={ga} micro-batches' gradient alone (normalised "
                   "as the window's), with no optimizer.zero_grad() between them: something else zeroed the "
                   "gradients on every micro-batch (model.zero_grad(), p.grad = None?)",
                   "accumulating needs the gradients of every micro-batch: zero them once per window, after "
                   "optimizer.step()")


def step_too_early(shape: WindowShape) -> Finding | None:
    """optimizer.step() once, but before the window's last backward: the later ones wait for the next update."""
    if shape.before_step == 0 or shape.before_step == shape.backwards:
        return None
    later = shape.backwards - shape.before_step
    return Finding("off-by-one step boundary",
                   f"optimizer.step() ran after backward {shape.before_step} of {shape.backwards} in the window, so "
                   f"it got {shape.before_step} micro-batch(es)' gradient and the {later} after it are left for the "
                   "next update",
                   "step after the window's last micro-batch: `(i + 1) % GA == 0` with i counted from 0, or after the "
                   "loop over the window")


def batch_dependent(layers, distance, why_not, loop_right: bool) -> str:
    """The diagnosis of a model whose layers normalise by the batch: accumulation cannot equal the full batch."""
    measured = (f"here each micro-batch's gradient added up is {distance:.2g} (relative) from one forward over the "
                "whole window" if distance is not None else
                f"how far that is from one forward over the whole window is not measured: the micro-batches cannot "
                f"be concatenated ({why_not})")
    loop = ("your loop equals that accumulation (each micro-batch's gradient added up) on every process count "
            "checked" if loop_right else
            "the rest of the report compares your loop with that accumulation (each micro-batch's gradient added up)")
    return (f"batch-dependent layer: {', '.join(layers)} normalises each micro-batch by its own mean and variance, "
            f"so accumulation cannot equal the full batch, which normalises by the whole window's; {measured}; "
            f"{loop}. For accumulation to equal the full batch, normalise per sample (GroupNorm or LayerNorm), use "
            "BatchNorm in eval mode with frozen running statistics, or batch statistics synced over the whole "
            "window; to check the rest of your loop, build the model in eval mode for the check")


# --- the report's diagnosis: each label once ------------------------------------------------------------


def _ambiguity(explanations, where: str) -> list[str]:
    if len(explanations) < 2:
        return []
    names = " / ".join("+".join(e) for e in explanations)
    return [f"{where} several known pitfalls give this same gradient ({names}); check other process counts "
            "to tell them apart"]


def _merged(label: str, facts: dict, advice: str, all_counts) -> str:
    """One diagnosis line for a label, with the facts of each process count it holds for (once if they agree)."""
    counts = sorted(facts)
    where = ""
    if len(all_counts) > 1 and counts != sorted(all_counts):
        where = f" (only with {', '.join(map(str, counts))} process{'' if counts == [1] else 'es'})"
    distinct = set(facts.values())
    if len(distinct) == 1:
        said = distinct.pop()
    else:
        said = "; ".join(f"with {processes_text(p)}, {facts[p]}" for p in counts if facts[p])
    return f"{label}{where}: " + "; ".join(part for part in (said, advice) if part)


def diagnose(outcomes) -> tuple[list[str], list[str]]:
    """The report's diagnosis, each label once (with the process counts it holds for, when not all), and notes
    on ambiguity.

    Where one known pitfall explains every process count checked it is the diagnosis; otherwise each
    process count's own. Structural findings (how often the optimizer stepped, ranks that diverged, ...)
    come first.
    """
    all_counts = [o.num_processes for o in outcomes]
    found: dict[str, tuple[dict, str]] = {}  # label -> ({process count: facts}, advice)

    def add(finding: Finding, counts) -> None:
        facts, _ = found.setdefault(finding.label, ({}, finding.advice))
        for p in counts:
            facts.setdefault(p, finding.facts)

    notes: list[str] = []
    for o in outcomes:
        for finding in o.structural + o.clip:
            add(finding, [o.num_processes])
    compared = [o for o in outcomes if o.matches is not None]
    common = _common(compared) if any(o.judged_failed for o in compared) else []
    if common:
        # One explanation fits every process count: it is the diagnosis (e.g. missing x num_processes
        # matches 2 processes, and agrees with 1 process, where it makes no difference).
        for finding in issue_findings(common):
            add(finding, all_counts)
        notes += _ambiguity(common, "for every process count checked")
    else:
        for o in compared:
            if o.judged_failed:
                for finding in o.local:
                    add(finding, [o.num_processes])
                notes += _ambiguity(simplest(o.matches), f"with {processes_text(o.num_processes)}")
    return [_merged(label, facts, advice, all_counts) for label, (facts, advice) in found.items()], notes


def _common(compared):
    return simplest(sorted(set.intersection(*(set(o.matches) for o in compared))))


def limits(outcomes, counts) -> list[str]:
    """What this check could not tell, given its data and process counts."""
    notes = []
    if len(set(counts)) == 1:
        notes.append("every micro-batch has the same number of targets, so a mean-of-means loop gives the same update "
                     "as the reference here; check with variable-length micro-batches to test the normalisation")
    if max(o.num_processes for o in outcomes) == 1:
        notes.append("only 1 process checked: gathering the target count and the x num_processes correction are not "
                     "exercised; add num_processes=2")
    if all(o.grad_accum_steps == 1 for o in outcomes):
        notes.append("GA=1 for every process count: nothing is accumulated; pass more micro-batches")
    return notes
