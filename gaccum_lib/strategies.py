"""How each accumulation strategy scales a micro-batch's loss before ``backward``.

Notation for one optimizer step (a *window*): ``GA`` micro-batches on each of ``P``
processes; micro-batch k on rank r has summed loss ``S`` over its ``n`` loss terms
(target tokens); ``N`` is the number of terms in the whole window, all ranks together.

The full-batch step minimises ``sum(S) / N``. Strategies differ in what they feed to
``backward`` for each micro-batch. Two conventions exist, and both are given here:

* :func:`plain_backward_loss` -- for ``loss.backward()`` in plain PyTorch, where the
  gradients of the ``P`` ranks are then *averaged* (as DDP does).
* :func:`accelerate_backward_loss` -- for ``accelerator.backward(loss)``, which itself
  divides the loss by ``GA``; so these are the plain ones multiplied by ``GA``.

Strategies:

``full_batch``
    The reference: one step on the whole window, loss ``sum(S) / N``.
``mean_of_means``
    What the plain loop does (each micro-batch's *mean* loss ``S / n``, divided by ``GA``).
    Exact when every micro-batch has the same ``n`` (the toy regression); with
    variable-length sequences it is the *naive* version: short sequences weigh too much.
``sum_of_means``
    The same, but forgetting to divide by ``GA``: a step ``GA`` times too large.
``token_normalised``
    ``S / N`` with ``N`` counted over the whole window on every rank; times ``P`` because
    DDP averages over ranks. Equals the full batch up to rounding.
``token_local_count``
    Pitfall: like ``token_normalised`` but ``N`` is the rank's own count (not gathered).
``token_no_world_scale``
    Pitfall: the global ``N`` but without the ``x P`` correction (a step ``P`` times too small).
"""

from __future__ import annotations

from ._checks import check_choice, check_int

STRATEGIES = ("full_batch", "mean_of_means", "sum_of_means", "token_normalised")
PITFALL_STRATEGIES = ("token_local_count", "token_no_world_scale")
ALL_STRATEGIES = STRATEGIES + PITFALL_STRATEGIES

# Human-readable labels used in plots, tables and widget menus.
LABELS = {
    "full_batch": "full batch (reference)",
    "mean_of_means": "naive: mean of micro-batch means",
    "sum_of_means": "forgot to divide by GA",
    "token_normalised": "token-normalised",
    "token_local_count": "token count not gathered",
    "token_no_world_scale": "missing x num_processes",
}


def check_strategy(strategy: str, *, allow_full_batch: bool = True) -> str:
    choices = ALL_STRATEGIES if allow_full_batch else tuple(s for s in ALL_STRATEGIES if s != "full_batch")
    return check_choice("strategy", strategy, choices)


def _check_window(strategy, num_terms, window_terms, local_window_terms, grad_accum_steps, num_processes):
    check_strategy(strategy, allow_full_batch=False)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("num_processes", num_processes, minimum=1)
    check_int("num_terms", num_terms, minimum=0)
    if strategy in ("mean_of_means", "sum_of_means") and num_terms == 0:
        raise ValueError("a micro-batch has num_terms=0 (no target token): its mean loss is undefined; "
                         "every micro-batch needs at least 1 target for the mean-of-means strategies")
    if strategy == "token_local_count":
        check_int("local_window_terms", local_window_terms, minimum=1)
    elif strategy.startswith("token") and check_int("window_terms", window_terms, minimum=0) == 0:
        raise ValueError("window_terms=0: the window has no target token on any rank, so there is "
                         "nothing to normalise by; window_terms must be >= 1")


def plain_backward_loss(
    strategy: str,
    loss_sum,
    num_terms: int,
    *,
    window_terms: int,
    local_window_terms: int,
    grad_accum_steps: int,
    num_processes: int = 1,
):
    """The loss of one micro-batch to pass to a plain ``backward()`` (gradients averaged over ranks).

    ``loss_sum`` is the summed per-term loss of the micro-batch and ``num_terms`` its number of
    terms; ``window_terms`` is N (whole window, every rank), ``local_window_terms`` this rank's
    share of it.
    """
    _check_window(strategy, num_terms, window_terms, local_window_terms, grad_accum_steps, num_processes)
    ga, world = grad_accum_steps, num_processes
    if strategy == "mean_of_means":
        return loss_sum / num_terms / ga
    if strategy == "sum_of_means":
        return loss_sum / num_terms
    if strategy == "token_normalised":
        return loss_sum * world / window_terms
    if strategy == "token_local_count":
        return loss_sum * world / local_window_terms
    return loss_sum / window_terms  # token_no_world_scale


def accelerate_backward_loss(strategy: str, loss_sum, num_terms: int, **window):
    """The same losses for ``accelerator.backward``, which divides by ``grad_accum_steps`` itself.

    Takes :func:`plain_backward_loss`'s keyword arguments. Whatever the strategy, the loss is the
    plain-backward loss times GA: the division is undone.
    """
    loss = plain_backward_loss(strategy, loss_sum, num_terms, **window)  # checks the arguments first
    return loss * window["grad_accum_steps"]
