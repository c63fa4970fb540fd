"""The simulated processes of :func:`~gaccum_lib.check.check_accumulation`: threads with DDP's timing.

One thread per rank, each with its own model, its own copies of the micro-batches Accelerate
would give that rank, and its own optimizer. The ranks meet at a barrier at every
collective call, so a rank that raises cannot leave the others waiting: the barrier is
aborted and the error comes back with its rank.

Gradients are averaged over the ranks where DDP averages them: at the end of every
``ctx.backward()`` that is not inside ``ctx.no_sync(model)``. Whatever the step does between
that backward and ``optimizer.step()`` (clipping, logging a gradient norm) therefore sees
the averaged gradient, as it would under DDP. A plain ``loss.backward()`` (not through
``ctx``) outside ``no_sync`` is averaged at the latest at ``optimizer.step()``.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from gaccum_lib.simulate import mean_over_ranks

# The user's step runs for two windows in a row: one window cannot show that gradients (or
# any other state) leak from one optimizer update into the next.
WINDOWS = 2
# A toy step takes milliseconds; a rank that waits this long at a collective call waits for
# a rank that will never come (it is stuck in the user's code).
COLLECTIVE_TIMEOUT_S = 60.0
# How long the caller waits for a rank to come back from step (a rank stuck outside a collective call).
JOIN_TIMEOUT_S = 2 * COLLECTIVE_TIMEOUT_S


class AccumulationCheckError(RuntimeError):
    """The checked ``step`` raised, hung, or the ranks made different collective calls."""


class _CollectiveError(AccumulationCheckError):
    """Raised inside a rank when the collective call it takes part in cannot complete."""


def processes_text(num_processes: int) -> str:
    return f"{num_processes} process" + ("" if num_processes == 1 else "es")


class Collective:
    """Links the rank threads: every collective call deposits a value, waits for all ranks, combines.

    The combining runs as the barrier's action, once, in the last rank to arrive while the
    others wait; every rank reads the result before it can deposit its next value, so one
    result slot suffices.
    """

    def __init__(self, num_processes: int):
        self._ops: list = [None] * num_processes
        self._values: list = [None] * num_processes
        self._combine_fn: Callable | None = None
        self._result = None
        self.failure: str | None = None  # why a collective call could not complete
        self._barrier = threading.Barrier(num_processes, action=self._combine, timeout=COLLECTIVE_TIMEOUT_S)

    def _combine(self) -> None:
        ops = list(self._ops)
        if len(set(ops)) > 1:
            calls = ", ".join(f"rank {r} {op}" for r, op in enumerate(ops))
            self.failure = (f"the ranks made different collective calls at the same point ({calls}); every rank "
                            "must call ctx.backward(), ctx.all_reduce_sum() and optimizer.step() the same number "
                            "of times in the same order, or a real multi-process run hangs")
        else:
            try:
                self._result = self._combine_fn(list(self._values))
            except (TypeError, ValueError) as exc:
                self.failure = f"{ops[0]}: {exc}"
        if self.failure is not None:
            raise _CollectiveError(self.failure)  # breaks the barrier: every waiting rank is released at once

    def exchange(self, rank: int, op: str, value, combine: Callable):
        self._ops[rank], self._values[rank] = op, value
        self._combine_fn = combine  # same function on every rank when the ops agree
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            if self.failure is not None:
                raise _CollectiveError(self.failure) from None
            raise
        return self._result

    def abort(self) -> None:
        self._barrier.abort()


def _sum_values(values):
    if all(isinstance(v, torch.Tensor) for v in values):
        shapes = [tuple(v.shape) for v in values]
        if len(set(shapes)) > 1:
            raise ValueError(f"the ranks passed tensors of different shapes {shapes}; they must match")
        return torch.stack(values).sum(dim=0)
    if any(isinstance(v, torch.Tensor) for v in values):
        kinds = [type(v).__name__ for v in values]
        raise TypeError(f"some ranks passed a tensor and others a number ({kinds}); pass the same kind on every rank")
    if all(isinstance(v, numbers.Integral) for v in values):
        return sum(int(v) for v in values)
    return float(sum(float(v) for v in values))


class _Rank:
    """One rank's model, gradient bookkeeping and collectives."""

    def __init__(self, rank: int, model, collective: Collective):
        self.rank, self.collective = rank, collective
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.in_no_sync = False
        self.unsynced = False  # a backward outside no_sync added gradients since the last all-reduce
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_accumulated)

    def _grad_accumulated(self, _param) -> None:
        if not self.in_no_sync:
            self.unsynced = True

    def sync(self) -> None:
        """DDP's all-reduce: every rank's gradients become their average over the ranks."""
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        means = self.collective.exchange(self.rank, "gradient all-reduce", grads, mean_over_ranks)
        with torch.no_grad():
            for p, mean in zip(self.params, means, strict=True):
                if mean is not None:
                    p.grad = mean.clone() if p.grad is None else p.grad.copy_(mean)
        self.unsynced = False


class StepContext:
    """What the checked ``step`` knows about where it runs: an ``Accelerator`` in miniature.

    ``rank``, ``num_processes`` and ``grad_accum_steps`` (micro-batches per rank in the window);
    :meth:`all_reduce_sum` is ``accelerator.gather(x).sum()``; :meth:`backward` is
    ``accelerator.backward(loss)`` on a DDP model: it divides the loss by ``grad_accum_steps``
    and, outside :meth:`no_sync`, averages the gradients over the ranks at its end.
    """

    __slots__ = ("_rank", "grad_accum_steps", "num_processes", "rank")

    def __init__(self, rank: _Rank, num_processes: int, grad_accum_steps: int):
        self._rank = rank
        self.rank = rank.rank
        self.num_processes = num_processes
        self.grad_accum_steps = grad_accum_steps

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, value):
        """The sum of ``value`` over all ranks (an int, a float or a tensor; a tensor comes back detached)."""
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"ctx.all_reduce_sum(value): value must be an int, a float or a tensor, "
                            f"got {type(value).__name__}")
        total = self._rank.collective.exchange(self.rank, "ctx.all_reduce_sum()", value, _sum_values)
        # Each rank gets its own tensor: one rank changing it in place must not change another's.
        return total.clone() if isinstance(total, torch.Tensor) else total

    def backward(self, loss: torch.Tensor) -> None:
        """``accelerator.backward(loss)``: backward of ``loss / grad_accum_steps``, then DDP's all-reduce."""
        (loss / self.grad_accum_steps).backward()
        if not self._rank.in_no_sync:
            self._rank.sync()

    @contextlib.contextmanager
    def no_sync(self, model=None):
        """``accelerator.no_sync(model)``: backward passes inside it skip the all-reduce."""
        previous, self._rank.in_no_sync = self._rank.in_no_sync, True
        try:
            yield
        finally:
            self._rank.in_no_sync = previous

    def __repr__(self) -> str:
        return (f"StepContext(rank={self.rank}, num_processes={self.num_processes}, "
                f"grad_accum_steps={self.grad_accum_steps})")


class PlainSGD:
    """``p -= lr * grad``: torch's SGD without momentum, written out because the first ``torch.optim``
    optimizer of a process imports torch's compiler stack (about a second)."""

    def __init__(self, params, lr: float):
        self.param_groups = [{"params": list(params), "lr": lr}]

    def step(self) -> None:
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = None if set_to_none else p.grad.detach().zero_()


class RankOptimizer:
    """The optimizer ``step`` receives: the chosen optimizer, counting its calls and recording the
    gradient it is handed (after DDP's averaging, if a plain backward left some pending)."""

    def __init__(self, inner, rank: _Rank):
        self._inner, self._rank = inner, rank
        self.step_calls = self.zero_grad_calls = 0
        self.gradients: list[np.ndarray] = []

    @property
    def param_groups(self):
        return self._inner.param_groups

    def __getattr__(self, name):  # state, state_dict(), ... of the real optimizer
        return getattr(self._inner, name)

    def step(self, closure=None) -> None:
        if closure is not None:
            raise TypeError("optimizer.step(closure): the checked optimizer takes no closure; call step() "
                            "after the window's backward passes")
        self.step_calls += 1
        if self._rank.unsynced:
            self._rank.sync()
        self.gradients.append(flat_grads(self._rank.params))
        self._inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls += 1
        self._inner.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"RankOptimizer(rank={self._rank.rank}, {self._inner!r})"


def flat(params) -> np.ndarray:
    """All parameters as one float64 vector (a copy)."""
    return np.concatenate([p.detach().cpu().double().reshape(-1).numpy() for p in params])


def flat_grads(params) -> np.ndarray:
    return np.concatenate([np.zeros(p.numel()) if p.grad is None else p.grad.detach().cpu().double().reshape(-1).numpy()
                           for p in params])


def run_ranks(step, models, shards, loss_fn, make_optimizer, grad_accum_steps):
    """Run ``step`` on every rank for each window, each with fresh copies of its micro-batches.

    Returns weights[window, rank], the gradient each rank handed ``optimizer.step()`` in each
    window (None where it did not step exactly once), and the step and zero_grad counts.
    """
    num_processes = len(models)
    collective = Collective(num_processes)
    ranks = [_Rank(r, models[r], collective) for r in range(num_processes)]
    optimizers = [RankOptimizer(make_optimizer(ranks[r].params), ranks[r]) for r in range(num_processes)]
    weights = np.zeros((WINDOWS, num_processes, sum(p.numel() for p in ranks[0].params)))
    gradients = [[None] * num_processes for _ in range(WINDOWS)]
    steps = np.zeros((WINDOWS, num_processes), dtype=np.int64)
    zero_grads = np.zeros((WINDOWS, num_processes), dtype=np.int64)
    errors: list = [None] * num_processes
    reached = [0] * num_processes
    # Set when the caller gives up on a stuck rank: the rank stops at its next chance instead of running on
    # (a daemon thread still in torch code when the interpreter exits aborts the whole process).
    cancelled = threading.Event()

    def worker(rank: int) -> None:
        ctx = StepContext(ranks[rank], num_processes, grad_accum_steps)
        optimizer = optimizers[rank]
        try:
            for window in range(WINDOWS):
                if cancelled.is_set():
                    return
                reached[rank] = window
                optimizer.step_calls = optimizer.zero_grad_calls = 0
                optimizer.gradients = []
                # Fresh copies: a loop that edits its batches (pops labels, shifts in place) works as in training.
                step(models[rank], optimizer, copy.deepcopy(shards[rank]), loss_fn, ctx)
                # Every rank must come back from step at the same point of the collective sequence.
                collective.exchange(rank, "returned from step", None, lambda values: None)
                weights[window, rank] = flat(ranks[rank].params)
                steps[window, rank], zero_grads[window, rank] = optimizer.step_calls, optimizer.zero_grad_calls
                if len(optimizer.gradients) == 1:
                    gradients[window][rank] = optimizer.gradients[0]
        except BaseException as exc:  # noqa: BLE001 -- anything the user's code raises goes back to the caller
            errors[rank] = exc
            collective.abort()  # release the ranks waiting at the barrier: no deadlock

    threads = [threading.Thread(target=worker, args=(r,), name=f"check_accumulation rank {r}", daemon=True)
               for r in range(num_processes)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for rank, t in enumerate(threads):
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            cancelled.set()
            collective.abort()
            raise AccumulationCheckError(
                f"rank {rank} of {num_processes} has not returned from step after {JOIN_TIMEOUT_S:g} s "
                f"(window {reached[rank] + 1}); is it stuck in a loop or waiting for something?")
    _raise_rank_errors(errors, collective, num_processes, reached)
    return weights, gradients, steps, zero_grads


def _raise_rank_errors(errors, collective, num_processes, reached) -> None:
    # The user's own exception first: the other ranks' errors are only its consequences.
    for rank, exc in enumerate(errors):
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError | _CollectiveError):
            raise AccumulationCheckError(
                f"step raised {type(exc).__name__} on rank {rank} of {num_processes} "
                f"(window {reached[rank] + 1} of {WINDOWS}): {exc}") from exc
    if collective.failure is not None:
        raise AccumulationCheckError(f"with {processes_text(num_processes)}: {collective.failure}")
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AccumulationCheckError(
                f"rank {rank} of {num_processes} waited more than {COLLECTIVE_TIMEOUT_S:g} s at a collective "
                "call (ctx.backward(), optimizer.step() or ctx.all_reduce_sum()) that another rank never "
                "reached") from exc
