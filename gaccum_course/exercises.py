"""Checks for the lessons' exercises: one place, used by the notebooks and by the solutions' tests.

In a lesson::

    my_factor = 4
    check("00.2", my_factor)      # prints "correct!" or a hint, returns True/False

Each checker computes the right answer with the library (nothing is hard-coded that the
library could get wrong without a test noticing).
"""

from __future__ import annotations

import numpy as np

from .deep_dive_exercises import DEEP_DIVE_CHECKS
from .feedback import Feedback


def _unscaled_factor(answer) -> Feedback:
    from gaccum_lib.data import toy_regression
    from gaccum_lib.simulate import simulate

    problem = toy_regression()
    forgot = simulate(problem, "sum_of_means", grad_accum_steps=4, micro_batch_size=2, lr=0.02)
    full = simulate(problem, "full_batch", grad_accum_steps=4, micro_batch_size=2, lr=0.02)
    actual = forgot.final_weights[0] / full.final_weights[0]
    if abs(float(answer) - actual) < 1e-6:
        return Feedback(True, f"correct! the step is {actual:.0f}x larger: the gradients of GA means add up")
    return Feedback(False, "not quite: run the loop without the division and compare its weight with the full-batch "
                           "2.04 (the weight starts at 0, so each weight is the length of its step)")


def _equal_split_exact(answer) -> Feedback:
    from gaccum_lib.data import toy_regression
    from gaccum_lib.simulate import simulate

    problem = toy_regression()
    plain = simulate(problem, "mean_of_means", grad_accum_steps=3, micro_batch_size=3, lr=0.02)
    full = simulate(problem, "full_batch", grad_accum_steps=3, micro_batch_size=3, lr=0.02)
    if abs(float(answer) - plain.final_weights[0]) < 1e-4:
        return Feedback(True, f"correct! plain w = {plain.final_weights[0]:.4f}, full batch w = "
                              f"{full.final_weights[0]:.4f}: the 2-point micro-batch weighs as much as a 3-point one")
    default_lr = simulate(problem, "mean_of_means", grad_accum_steps=3, micro_batch_size=3).final_weights[0]
    if abs(float(answer) - default_lr) < 1e-4:
        return Feedback(False, "not quite: that is the weight at simulate's default learning rate; "
                               "the lesson's is 0.02")
    return Feedback(False, "not quite: check the learning rate you passed to simulate (the lesson's is 0.02), and "
                           "read the plain loop's final_weights")


def _no_zero_grad(answer) -> Feedback:
    import torch

    from gaccum_lib.data import toy_regression

    problem = toy_regression()
    model = problem.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    micro_batches = [problem.batch_of(ix) for ix in problem.micro_batch_indices(micro_batch_size=2)]
    for _ in range(2):  # two updates, no zero_grad() between them
        for x, y in micro_batches:
            (torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
        optimizer.step()
    weight = model.weight.item()
    if abs(float(answer) - weight) < 1e-4:
        return Feedback(True, f"correct! w = {weight:.4f}: .grad still held the first update's gradient, and the "
                              "second update added its own to it")
    return Feedback(False, "not quite: run the plain loop twice on one model and one optimizer, with no zero_grad() "
                           "in between, and read model.weight")


def _short_window_factor(answer) -> Feedback:
    """02.2: 22 points, micro-batches of 2, GA 4: the last window holds 3 micro-batches, whose losses need x 4/3."""
    import torch

    from gaccum_lib.data import toy_regression
    from gaccum_lib.sharding import split_windows
    from gaccum_lib.simulate import simulate

    factor, grad_accum_steps = float(answer), 4
    problem = toy_regression(num_points=22)
    windows = split_windows(problem.micro_batch_indices(2), grad_accum_steps)
    model = problem.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002)
    for window in windows:  # the plain accumulate() loop on one process: backward divides each mean by GA
        scale = factor if window is windows[-1] else 1.0
        for indices in window:
            x, y = problem.batch_of(indices)
            (torch.nn.functional.mse_loss(model(x), y) * scale / grad_accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = simulate(problem, "full_batch", grad_accum_steps=grad_accum_steps, micro_batch_size=2, lr=0.002)
    exact = grad_accum_steps / len(windows[-1])
    weight, target = model.weight.item(), float(full.final_weights[0])
    if abs(factor - exact) < 1e-4:
        return Feedback(True, f"correct! x {grad_accum_steps}/{len(windows[-1])}: the window's "
                              f"{len(windows[-1])} means are averaged over {len(windows[-1])}, not "
                              f"{grad_accum_steps}; final weight {weight:.5f}, full batch {target:.5f}")
    if abs(factor - exact) < 0.01:
        return Feedback(False, f"close: x {factor:g} ends at {weight:.5f}, the full batch at {target:.5f}; give the "
                               "factor exactly (as a fraction) or to 4 decimals")
    if abs(factor - 1 / exact) < 0.01:
        return Feedback(False, "not quite: the other way round; the short window's update is too small, so its "
                               "losses must grow")
    return Feedback(False, f"not quite: with x {factor:g} the loop ends at {weight:.5f}, the full batch at "
                           f"{target:.5f}; backward divides each of the window's micro-batch means by GA = 4")


def _naive_error_ga4(answer) -> Feedback:
    """03.1: the naive loop at GA 4, micro-batches of 2 on the 8 seed sequences: its largest weight difference."""
    from gaccum_lib.data import count_target_tokens, seed_sequences
    from gaccum_lib.simulate import simulate

    problem = seed_sequences(8)
    targets = [count_target_tokens(problem.batch_of(ix)["labels"]) for ix in problem.micro_batch_indices(2)]

    def error(ga):
        kwargs = dict(grad_accum_steps=ga, micro_batch_size=8 // ga, lr=0.08)
        naive, full = (simulate(problem, s, **kwargs).final_weights for s in ("mean_of_means", "full_batch"))
        return float(np.abs(naive - full).max())

    answer, actual = float(answer), error(4)
    if abs(answer - actual) < 5e-4:
        return Feedback(True, f"correct! {actual:.4f}: micro-batches of {', '.join(map(str, targets))} targets, "
                              f"between GA 2's {error(2):.4f} and GA 8's {error(8):.4f}")
    if abs(answer - error(2)) < 5e-4 or abs(answer - error(8)) < 5e-4:
        return Feedback(False, "not quite: that is another row of the table; run simulate with grad_accum_steps=4, "
                               "micro_batch_size=2")
    return Feedback(False, "not quite: simulate 'mean_of_means' and 'full_batch' with grad_accum_steps=4, "
                           "micro_batch_size=2, lr=0.08 and take the largest difference of their final weights")


def _equal_targets_order(answer) -> Feedback:
    from gaccum_lib.data import sequences_from_lengths
    from gaccum_lib.simulate import simulate

    order = [int(a) for a in answer]
    if sorted(order) != list(range(1, 9)):
        return Feedback(False, "use each length 1..8 exactly once")
    problem = sequences_from_lengths(order)
    gap = simulate(problem, "mean_of_means", grad_accum_steps=4, micro_batch_size=2).max_difference(
        simulate(problem, "full_batch", grad_accum_steps=4, micro_batch_size=2))
    pairs = [order[i] + order[i + 1] for i in range(0, 8, 2)]
    if gap < 1e-6:
        return Feedback(True, f"correct! targets per micro-batch {pairs}: naive equals the full batch ({gap:.0e})")
    return Feedback(False, f"not yet: targets per micro-batch {pairs}; naive misses the full batch by {gap:.1e}")


def _rank1_count_four_processes(answer) -> Feedback:
    from gaccum_lib.data import seed_sequences
    from gaccum_lib.simulate import simulate

    counts = simulate(seed_sequences(32), "token_normalised", grad_accum_steps=2, micro_batch_size=4,
                      num_processes=4).token_counts[0]
    if int(answer) == counts[1]:
        return Feedback(True, f"correct! local counts {counts.tolist()}, {counts.sum()} in total")
    return Feedback(False, "not quite: rank 1 gets micro-batches 1 and 5 (items 4-7 and 20-23); item i has length i+1")


def _missing_zero_grad_label(answer) -> Feedback:
    from gaccum_check import check_accumulation
    from gaccum_lib.data import count_target_tokens, seed_sequences

    problem = seed_sequences(16)
    batches = [problem.batch_of(ix) for ix in problem.micro_batch_indices(4)]

    def forgets_zero_grad(model, optimizer, micro_batches, loss_fn, ctx):
        total = ctx.all_reduce_sum(sum(count_target_tokens(b["labels"]) for b in micro_batches))
        for batch in micro_batches:
            loss_sum, _ = loss_fn(model, batch)
            ctx.backward(loss_sum * ctx.grad_accum_steps * ctx.num_processes / total)
        optimizer.step()

    labels = check_accumulation(forgets_zero_grad, problem.make_model, batches, problem.loss_sum_and_count).labels
    if str(answer).strip().lower() in {label.lower() for label in labels}:
        return Feedback(True, f"correct! '{answer}': the first update is right, the second adds the old gradient")
    return Feedback(False, "not quite: run the checker on your step and read report.labels")


def _targets_of_32_lines(answer) -> Feedback:
    from gaccum_lib.lm import tiny_lm

    problem = tiny_lm(32)
    right = problem.num_targets
    if int(answer) == right:
        return Feedback(True, f"correct! {sum(problem.lengths)} characters in 32 rows, one fewer target per row: "
                              f"{right}")
    if int(answer) == right + len(problem):
        return Feedback(False, "not quite: that counts the labels before the shift, one target too many per row")
    return Feedback(False, "not quite: a row of L characters (its newline included) gives L - 1 targets; "
                           "add them up over tiny_lm(32).lengths")


def _lm_accumulation_step(answer) -> Feedback:
    """The learner's own accumulation step for the capstone LM, judged against the full batch."""
    from gaccum_check import check_accumulation
    from gaccum_lib.lm import tiny_lm

    if not callable(answer):
        raise TypeError("give your function itself, my_accumulation_step(model, optimizer, micro_batches, loss_fn, "
                        f"ctx), not a {type(answer).__name__}")
    problem = tiny_lm(16)
    micro_batches = [problem.batch_of(ix) for ix in problem.micro_batch_indices(2)]  # 8 micro-batches of 2 rows
    report = check_accumulation(answer, problem.make_model, micro_batches, problem.loss_sum_and_count)
    if report:
        return Feedback(True, "correct! your step equals the full batch on 1 and 2 (simulated) processes, two windows "
                              "in a row: it is ready for train_causal_lm's loop")
    hints = {"mean of micro-batch means": "divide each micro-batch's summed loss by the window's count, not its own",
             "targets counted before the shift": "count labels[:, 1:], the targets after the shift",
             "token count not gathered across ranks": "ctx.all_reduce_sum(local count) is the whole update's N",
             "missing x num_processes": "DDP averages over the processes: multiply by ctx.num_processes",
             "loss divided by GA twice": "ctx.backward already divides by GA: multiply by ctx.grad_accum_steps"}
    if "gradient clipped" in report.labels and all(d.weight_distance <= d.allowed for d in report.details.values()):
        # gaccum_check reads a rescale after the all-reduce as a clip and judges the gradient before it
        return Feedback(False, "not quite what the exercise asks: your weights after the update equal the full "
                               "batch's, so dividing the gradients by N after the last backward works here, but the "
                               "check reads that division as a clip. Put N in each micro-batch's loss before its "
                               "backward, as train_causal_lm does")
    hint = next((h for label, h in hints.items() if label in report.labels), "compare with train_causal_lm's loop")
    return Feedback(False, f"not quite: {report}\nhint: {hint}")


CHECKS = {
    "00.2": _unscaled_factor,
    "01.1": _equal_split_exact,
    "01.2": _no_zero_grad,
    "02.2": _short_window_factor,
    "03.1": _naive_error_ga4,
    "03.2": _equal_targets_order,
    "04.1": _rank1_count_four_processes,
    "05.1": _targets_of_32_lines,
    "05.2": _lm_accumulation_step,
    "06.2": _missing_zero_grad_label,
    **DEEP_DIVE_CHECKS,
}


def register(exercise: str, checker) -> None:
    """Add a checker (lessons written later register theirs from their own module)."""
    CHECKS[exercise] = checker


def check(exercise: str, answer, *, quiet: bool = False) -> Feedback:
    """Check ``answer`` to ``exercise`` (e.g. ``"03.2"``); print and return the feedback."""
    if exercise not in CHECKS:
        raise ValueError(f"exercise must be one of {', '.join(sorted(CHECKS))}; got {exercise!r}")
    if answer is None:
        feedback = Feedback(False, "no answer yet: set the variable above and run this cell again")
    else:
        try:
            feedback = CHECKS[exercise](answer)
        except (TypeError, ValueError) as exc:
            feedback = Feedback(False, f"that answer cannot be checked: {exc}")
    if not quiet:
        print(feedback.message)
    return feedback
