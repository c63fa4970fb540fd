"""What the invariance check says about a comparison that differs: the texts of its diagnoses.

Each function turns what :func:`gaccum_check.invariance.compare_runs` measured (update counts,
the first update's gradient ratio and cosine, the first update that differs) into the name of a
known pitfall and what to change.
"""

from __future__ import annotations

import math

import torch


def relative(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """|a - b| / scale; 0 or inf when scale is 0 (equal, or not)."""
    return float((a - b).norm()) / scale if scale > 0 else (0.0 if torch.equal(a, b) else math.inf)


def near(value: float, target: float, tol: float) -> bool:
    return abs(value - target) <= tol * max(1.0, abs(target))


def update_count_text(updates: int, reference_updates: int, k: int, p: int) -> str:
    if updates >= k * reference_updates - k and k > 1:
        return (f"optimizer stepped on every micro-batch: {updates} updates where the full batch made "
                f"{reference_updates}; it must step once per window of GA={k} micro-batches (an optimizer stepped "
                "outside accelerator.accumulate, or not prepared by Accelerate)")
    if updates < reference_updates:
        return (f"updates dropped: {updates} updates where the full batch made {reference_updates}; a window "
                f"that holds fewer than GA={k} micro-batches (the end of an epoch whose micro-batches GA does not "
                "divide) was never stepped, or its gradient carried into the next epoch's first update")
    return (f"extra updates: {updates} updates where the full batch made {reference_updates}; a step boundary is "
            "off (stepping when i % GA == 0 instead of (i + 1) % GA == 0?)")


AMBIGUOUS_HALF = "loss divided by GA twice, or missing x num_processes"
MISSING_PROCESSES_TEXT = ("missing x num_processes: the gradient is 1/{p} of the full batch's; a loss divided by the "
                          "window's total target count must be multiplied by num_processes, because DDP averages "
                          "over processes")


def first_gradient_text(ratio: float, cosine: float, k: int, p: int) -> str:
    same_way = cosine > 1 - 1e-4
    if same_way and k > 1 and k == p and near(ratio, 1 / k, 1e-3):  # judge() tells them apart with 1 process
        return (f"{AMBIGUOUS_HALF}: the first update's gradient is 1/{k} = {ratio:.4g} of the full batch's, and "
                f"here GA = processes = {k}; check 1 process too to tell them apart")
    if same_way and k > 1 and near(ratio, 1 / k, 1e-3):
        return (f"loss divided by GA twice: the first update's gradient is 1/GA = {ratio:.4g} of the full batch's; "
                "accelerator.backward already divides by gradient_accumulation_steps")
    if same_way and k > 1 and near(ratio, k, 1e-3):
        return (f"loss not divided by GA: the first update's gradient is GA = {ratio:.4g} times the full batch's; "
                "the micro-batches' losses are added up, not averaged over the window")
    if same_way and p > 1 and near(ratio, 1 / p, 1e-3):
        return MISSING_PROCESSES_TEXT.format(p=p)
    if same_way and p > 1 and near(ratio, p, 1e-3):
        return (f"x num_processes twice: the gradient is {p} times the full batch's; the loss was scaled by "
                "num_processes where nothing averages it away")
    if same_way:
        return (f"wrong update size: the first update's gradient points the full batch's way but is {ratio:.4g} "
                "times its size, a ratio no plain factor (GA, processes) explains; check what each micro-batch's loss "
                "is divided by: its own target count (mean of micro-batch means; on a model this small the "
                "direction hardly changes) or a count that includes padding")
    return (f"micro-batches weighted unequally: the first update's gradient points another way than the full batch's "
            f"(cosine {cosine:.6f}, ratio {ratio:.4g}); each micro-batch (or each process) is normalised by its own "
            "target count, e.g. the mean loss of every micro-batch (mean of micro-batch means), instead of dividing "
            "every summed loss by the update's total target count")


def later_update_text(run, reference, update: int, count: int, tol: float) -> str:
    ours, ref = run.ranks[0], reference.ranks[0]
    u = update - 1
    same_start = relative(ours["before"][u], ref["before"][u],
                           float((ref["before"][u] - ref["before"][0]).norm()) or 1.0) <= tol
    gradient_right = same_start and relative(ours["gradients"][u], ref["gradients"][u],
                                              float(ref["gradients"][u].norm())) <= tol
    if gradient_right:
        return (f"learning rate differs from update {update} on: the gradient is the full batch's but the step is "
                "not; a scheduler stepped per micro-batch, or sized in micro-batches instead of updates (lesson 09)")
    if update == count:
        return (f"last update differs: updates 1-{update - 1} match, the last does not; the final window is shorter "
                "than GA micro-batches and its loss is still divided by GA (or by a count of full windows)")
    return (f"state carried over between updates: updates 1-{update - 1} match, update {update} does not; "
            "optimizer.zero_grad() missing, or a window's count or loss leaks into the next")
