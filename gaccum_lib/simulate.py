"""Train with any strategy on N simulated processes, in one Python process.

The simulator keeps one model replica per rank, feeds each rank the micro-batches
Accelerate's prepared DataLoader would give it (:mod:`gaccum_lib.sharding`), runs every
rank's forward and backward with the strategy's loss, then averages the gradients over
the ranks -- exactly what DDP's all-reduce does -- and steps every replica. With
``num_processes=1`` it is simply the single-process training loop.

``tests/test_real_runs.py`` checks it against real Accelerate runs in real processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ._checks import check_float, check_int
from ._threads import single_thread
from .data import Problem
from .sharding import plan_windows
from .strategies import LABELS, check_strategy, plain_backward_loss


def flat_weights(model: torch.nn.Module) -> np.ndarray:
    """All parameters of ``model`` as one float64 vector (a copy)."""
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().double().cpu().numpy().copy()


@dataclass
class Trajectory:
    """What one training run did, update by update.

    ``weights[0]`` are the initial weights and ``weights[u + 1]`` the weights after update
    ``u`` (rank 0's; :attr:`rank_final_weights` has every rank's final weights).
    ``losses[u]`` is the mean loss per target over update ``u``'s whole window, measured
    before the update (the same definition for every strategy, so curves compare).
    ``token_counts[u, r]`` is the number of targets rank ``r`` saw in update ``u``.
    """

    strategy: str
    grad_accum_steps: int
    num_processes: int
    micro_batch_size: int
    lr: float
    weights: np.ndarray
    losses: np.ndarray
    token_counts: np.ndarray
    rank_final_weights: np.ndarray
    source: str = "simulator"
    extras: dict = field(repr=False, default_factory=dict)

    @property
    def label(self) -> str:
        return LABELS.get(self.strategy, self.strategy)

    @property
    def initial_weights(self) -> np.ndarray:
        return self.weights[0]

    @property
    def final_weights(self) -> np.ndarray:
        return self.weights[-1]

    @property
    def num_updates(self) -> int:
        return len(self.losses)

    @property
    def window_tokens(self) -> np.ndarray:
        """Targets per update, all ranks together (the N of token normalisation)."""
        return self.token_counts.sum(axis=1)

    def max_difference(self, other: Trajectory) -> float:
        """Largest absolute weight difference to ``other`` over the whole trajectory."""
        if self.weights.shape != other.weights.shape:
            raise ValueError(f"trajectories differ in shape: {self.weights.shape} vs {other.weights.shape}")
        return float(np.max(np.abs(self.weights - other.weights)))

    def distance_from(self, reference: Trajectory) -> np.ndarray:
        """Euclidean distance of the weights to ``reference`` after every update."""
        if self.weights.shape != reference.weights.shape:
            raise ValueError(f"trajectories differ in shape: {self.weights.shape} vs {reference.weights.shape}")
        return np.linalg.norm(self.weights - reference.weights, axis=1)


def check_training_args(problem, grad_accum_steps, micro_batch_size, num_processes, lr, epochs):
    if not isinstance(problem, Problem):
        raise TypeError(f"problem must be a gaccum_lib Problem (e.g. seed_sequences()), got {type(problem).__name__}")
    check_int("grad_accum_steps", grad_accum_steps, minimum=1, maximum=4096)
    check_int("micro_batch_size", micro_batch_size, minimum=1, maximum=len(problem))
    check_int("num_processes", num_processes, minimum=1, maximum=1024)
    check_float("lr", lr, minimum=0.0, exclusive_minimum=True, maximum=1e3)
    check_int("epochs", epochs, minimum=1, maximum=10_000)


def simulate(problem: Problem, strategy: str, *, grad_accum_steps: int, micro_batch_size: int, num_processes: int = 1,
             lr: float = 0.08, epochs: int = 1, even_batches: bool = True) -> Trajectory:
    """Train ``problem`` from its initial weights with ``strategy``; return the :class:`Trajectory`.

    One epoch is one pass over the data in order; each optimizer update consumes
    ``grad_accum_steps`` micro-batches of ``micro_batch_size`` examples on each of
    ``num_processes`` simulated ranks (the last window may be shorter). The optimizer is
    plain SGD with learning rate ``lr``.
    """
    check_strategy(strategy)
    check_training_args(problem, grad_accum_steps, micro_batch_size, num_processes, lr, epochs)
    with single_thread():
        return _simulate(problem, strategy, grad_accum_steps, micro_batch_size, num_processes, lr, epochs,
                         even_batches)


def _simulate(problem, strategy, grad_accum_steps, micro_batch_size, num_processes, lr, epochs, even_batches):
    plan = plan_windows(problem.micro_batch_indices(micro_batch_size), micro_batch_size=micro_batch_size,
                        grad_accum_steps=grad_accum_steps, num_processes=num_processes, even_batches=even_batches)

    if strategy == "full_batch":
        replicas = [problem.make_model()]  # every rank would hold the same model: one is enough
    else:
        replicas = [problem.make_model() for _ in range(num_processes)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in replicas]
    # Collate once: the same micro-batches come back every epoch.
    batches = {tuple(mb): problem.batch_of(mb) for window in plan for rank_mbs in window for mb in rank_mbs}

    weights = [flat_weights(replicas[0])]
    losses, counts = [], []
    for _ in range(epochs):
        for u, window in enumerate(plan):
            local_terms = [sum(problem.count_targets(batches[tuple(mb)]) for mb in rank_mbs) for rank_mbs in window]
            window_terms = sum(local_terms)
            if window_terms == 0:
                raise ValueError(f"update {u} has no target token in its window (all labels are padding); "
                                 "every window needs at least 1 target")
            if strategy == "full_batch":
                loss_value = _full_batch_step(problem, replicas[0], optimizers[0], window)
            else:
                loss_value = _accumulated_step(problem, strategy, replicas, optimizers, window, batches,
                                               local_terms, grad_accum_steps)
            losses.append(loss_value / window_terms)
            counts.append(local_terms)
            weights.append(flat_weights(replicas[0]))

    rank_final = np.stack([flat_weights(m) for m in replicas])
    if strategy == "full_batch":
        rank_final = np.repeat(rank_final, num_processes, axis=0)
    return Trajectory(
        strategy=strategy, grad_accum_steps=grad_accum_steps, num_processes=num_processes,
        micro_batch_size=micro_batch_size, lr=float(lr), weights=np.stack(weights),
        losses=np.asarray(losses), token_counts=np.asarray(counts, dtype=np.int64),
        rank_final_weights=rank_final,
    )


def _full_batch_step(problem, model, optimizer, window) -> float:
    """One step on every example of the window at once (duplicates from even_batches included)."""
    indices = [i for rank_mbs in window for mb in rank_mbs for i in mb]
    loss_sum, num_terms = problem.loss_sum_and_count(model, problem.batch_of(indices))
    optimizer.zero_grad()
    (loss_sum / num_terms).backward()
    optimizer.step()
    return float(loss_sum.detach())


def _accumulated_step(problem, strategy, replicas, optimizers, window, batches, local_terms, grad_accum_steps):
    num_processes = len(replicas)
    window_terms = sum(local_terms)
    loss_total = 0.0
    for rank, (model, rank_mbs) in enumerate(zip(replicas, window, strict=True)):
        optimizers[rank].zero_grad()
        for mb in rank_mbs:
            loss_sum, num_terms = problem.loss_sum_and_count(model, batches[tuple(mb)])
            loss = plain_backward_loss(strategy, loss_sum, num_terms, window_terms=window_terms,
                                       local_window_terms=local_terms[rank], grad_accum_steps=grad_accum_steps,
                                       num_processes=num_processes)
            loss.backward()
            loss_total += float(loss_sum.detach())
    _all_reduce_mean(replicas)
    for optimizer in optimizers:
        optimizer.step()
    return loss_total


def mean_over_ranks(per_rank_grads) -> list:
    """DDP's all-reduce: each parameter's gradient averaged over the ranks (a missing one counts as zero).

    ``per_rank_grads[r]`` lists rank ``r``'s gradients, one per parameter (``None`` when it has none).
    """
    means = []
    for grads in zip(*per_rank_grads, strict=True):
        present = [g for g in grads if g is not None]
        filled = [g if g is not None else torch.zeros_like(present[0]) for g in grads] if present else None
        means.append(torch.stack(filled).mean(dim=0) if filled else None)
    return means


def _all_reduce_mean(replicas) -> None:
    """Replace every replica's gradients by their average over replicas."""
    if len(replicas) == 1:
        return
    params = [list(m.parameters()) for m in replicas]
    for group, mean in zip(zip(*params, strict=True), mean_over_ranks([[p.grad for p in ps] for ps in params]),
                           strict=True):
        for p in group:
            p.grad.copy_(mean)


def compare_strategies(problem: Problem, strategies=("full_batch", "mean_of_means", "token_normalised"),
                       **kwargs) -> dict[str, Trajectory]:
    """:func:`simulate` each strategy with the same arguments; a dict keyed by strategy."""
    return {s: simulate(problem, s, **kwargs) for s in strategies}
