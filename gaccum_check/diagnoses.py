"""What a failed :func:`~gaccum_lib.check.check_accumulation` was, by name.

Every known normalisation pitfall turns the window's per-micro-batch gradients into a
different averaged gradient, which :func:`candidate_gradients` computes exactly (each is a
weighted sum of the micro-batches' gradients). The gradient the user's loop handed to
``optimizer.step()`` is compared with each: a match names the pitfall, whatever optimizer
turns the gradient into an update afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from gaccum_lib.data import IGNORE_INDEX
from gaccum_lib.strategies import plain_backward_loss

from .ranks import processes_text

# Cosine above this: the gradient points the reference's way.
SAME_DIRECTION = 1.0 - 1e-6

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


def issue_texts(explanations) -> list[str]:
    keys = {k for e in explanations for k in e}
    return [f"{label}: {text}" for key, (label, text) in ISSUES.items() if key in keys]


def unexplained(ratio, cosine, ga) -> list[str]:
    if cosine >= SAME_DIRECTION:
        # Not necessarily a constant factor: on a model whose gradients all lie on one line (a 2-class
        # classifier without bias) any per-micro-batch weighting keeps the direction.
        return [f"wrong update size: the gradient points the reference's way but is {ratio:.4g} times its size "
                f"({100 * abs(ratio - 1):.3g} % off), and no known pitfall gives exactly this; check what each "
                "micro-batch's loss is divided by (a count that includes padding?), and that loss_fn returns the "
                "summed loss"]
    return [f"no known pitfall matches: gradient ratio {ratio:.4g}, cosine {cosine:.4f} (GA={ga}); compare what "
            "each micro-batch feeds to backward with its summed loss / the window's total targets"]


def nonfinite(counts) -> str:
    hint = (" A micro-batch has no targets (all labels -100): its own mean loss is 0 / 0, which is what a mean of "
            "micro-batch means divides by." if min(counts) == 0 else "")
    return f"non-finite gradient: optimizer.step() received NaN or inf.{hint}"


def _ambiguity(explanations, where: str) -> list[str]:
    if len(explanations) < 2:
        return []
    names = " / ".join("+".join(e) for e in explanations)
    return [f"{where} several known pitfalls give this same gradient ({names}); check other process counts "
            "to tell them apart"]


def diagnose(outcomes) -> tuple[list[str], list[str]]:
    """The report's diagnosis (what holds for every process count, else each count's own, marked with its
    process counts) and notes on ambiguity."""
    all_counts = [o.num_processes for o in outcomes]
    found: dict[str, list[int]] = {}  # diagnosis text -> process counts it came from

    def add(text, num_processes, by_label=False):
        label = text.split(":", 1)[0]  # structural: merge by label, the numbers may differ per count
        same = next((t for t in found if t.split(":", 1)[0] == label), text) if by_label else text
        found.setdefault(same, []).append(num_processes)

    notes: list[str] = []
    for o in outcomes:
        for text in o.structural:
            add(text, o.num_processes, by_label=True)
    compared = [o for o in outcomes if o.matches is not None]
    common = _common(compared) if any(o.first_failed for o in compared) else []
    if common:
        # One explanation fits every process count: it is the diagnosis (e.g. missing x num_processes
        # matches 2 processes, and agrees with 1 process, where it makes no difference).
        for text in issue_texts(common):
            found.setdefault(text, list(all_counts))
        notes += _ambiguity(common, "for every process count checked")
    else:
        for o in compared:
            if o.first_failed:
                for text in o.check.diagnosis:
                    if text not in o.structural:
                        add(text, o.num_processes)
                notes += _ambiguity(simplest(o.matches), f"with {processes_text(o.num_processes)}")
    diagnosis = []
    for text, counts in found.items():
        if len(all_counts) > 1 and sorted(set(counts)) != sorted(all_counts):
            where = ", ".join(str(p) for p in sorted(set(counts)))
            label, _, rest = text.partition(":")
            text = f"{label} (only with {where} process{'' if set(counts) == {1} else 'es'}):{rest}"
        diagnosis.append(text)
    return diagnosis, notes


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
