"""Check your own gradient-accumulation loop against the full-batch step.

:func:`check_accumulation` runs *your* loop for one optimizer update over a window of
micro-batches -- on one process and on N simulated processes -- and compares the weights
it ends with to one SGD step on the mean loss over every target of the window (the
full-batch reference), starting from the same initial weights. It returns an
:class:`AccumulationReport`: passed or not within ``tol``, the largest weight difference,
the ratio of your update to the reference, and a diagnosis when the result matches a
known pitfall. The report is truthy only when the check passed, so ``assert
check_accumulation(...)`` works in a test.

How the N processes are simulated, in one Python process:

* one thread per rank, each with its own model built by ``make_model`` and the
  micro-batches Accelerate's prepared DataLoader would give that rank
  (:func:`gaccum_lib.sharding.shard_batches`: rank r gets micro-batches r, r+P, r+2P, ...);
* the optimizer your step receives is plain SGD whose ``step()`` first averages the ranks'
  gradients -- what DDP's all-reduce has done by the time the optimizer steps;
* ``ctx.all_reduce_sum(x)`` returns the sum of ``x`` over the ranks, as
  ``accelerator.gather(x).sum()`` does.

The ranks meet at a barrier at each collective call, so a rank that raises cannot leave
the others waiting: the barrier is aborted and the error comes back with its rank.

Your step runs for two consecutive windows (the same micro-batches twice): the first
update is what the report compares; the second catches state carried over from one
window into the next, such as a missing ``optimizer.zero_grad()``.

The optimizer is plain SGD, so an update is ``-lr`` times the gradient: every known
pitfall then gives an update that can be computed exactly from each micro-batch's
gradient (:func:`gaccum_lib.strategies.plain_backward_loss`), and the report says which
one yours matches.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ._checks import check_float, check_int
from .data import IGNORE_INDEX
from .sharding import shard_batches
from .strategies import plain_backward_loss

# The user's step runs for two windows in a row: one window cannot show that gradients (or
# any other state) leak from one optimizer update into the next.
_WINDOWS = 2
# A toy step takes milliseconds; a rank that waits this long at a collective call waits for
# a rank that will never come (it is stuck in the user's code).
_COLLECTIVE_TIMEOUT_S = 60.0
# How long the caller waits for a rank to come back from step (a rank stuck outside a collective call).
_JOIN_TIMEOUT_S = 2 * _COLLECTIVE_TIMEOUT_S
_MAX_PROCESSES = 64
# Cosine above this: the update points the reference's way (float32 weights, float64 maths).
_SAME_DIRECTION = 1.0 - 1e-6

# Known pitfalls: (short label, what to do). A diagnosis reads "label: explanation".
_ISSUES = {
    "divided_twice": (
        "loss divided by GA twice",
        "the update is 1/GA of the reference; accelerator.backward (like ctx.backward) already divides the loss by "
        "gradient_accumulation_steps, so do not divide it by hand as well",
    ),
    "not_divided": (
        "loss not divided by GA",
        "the update is GA times the reference; with a plain loss.backward() divide each micro-batch's loss by the "
        "number of accumulation steps (accelerator.backward does it for you)",
    ),
    "mean_of_means": (
        "mean of micro-batch means",
        "each micro-batch's mean loss weighs the same however many targets it has, so with variable-length "
        "micro-batches the short ones count too much; sum the per-target losses and divide by the window's total "
        "target count (all micro-batches, all ranks)",
    ),
    "count_not_gathered": (
        "token count not gathered across ranks",
        "each rank divides by its own target count; sum the count over the ranks first "
        "(accelerator.gather(count).sum(), here ctx.all_reduce_sum(count))",
    ),
    "missing_world_scale": (
        "missing x num_processes",
        "the update is 1/num_processes of the reference; DDP averages the gradients over the ranks, so a loss "
        "divided by the global target count must be multiplied by num_processes",
    ),
    "counted_before_shift": (
        "targets counted before the shift",
        "the update is (targets after the shift) / (targets before the shift) of the reference; the loss predicts "
        "token t + 1 at position t, so a row has one target fewer than it has labels that are not -100; count "
        "the shifted labels (labels[:, 1:] != -100), as the loss does",
    ),
}


class AccumulationCheckError(RuntimeError):
    """The checked ``step`` raised, hung, or the ranks made different collective calls."""


class _CollectiveError(AccumulationCheckError):
    """Raised inside a rank when the collective call it takes part in cannot complete."""


# ----------------------------------------------------------------------------------------------
# The simulated processes: a barrier-based collective, the context and the optimizer wrapper.
# ----------------------------------------------------------------------------------------------


class _Collective:
    """Links the rank threads: every collective call deposits a value, waits for all ranks, combines.

    The combining runs as the barrier's action, once, in the last rank to arrive while the
    others wait, so it needs no lock; every rank reads the result before it can deposit its
    next value, so one result slot suffices.
    """

    def __init__(self, num_processes: int):
        self._ops: list = [None] * num_processes
        self._values: list = [None] * num_processes
        self._combine_fn: Callable | None = None
        self._result = None
        self.failure: str | None = None  # why a collective call could not complete
        self._barrier = threading.Barrier(num_processes, action=self._combine, timeout=_COLLECTIVE_TIMEOUT_S)

    def _combine(self) -> None:
        ops = list(self._ops)
        if len(set(ops)) > 1:
            calls = ", ".join(f"rank {r} {op}" for r, op in enumerate(ops))
            self.failure = (f"the ranks made different collective calls at the same point ({calls}); every rank "
                            "must call ctx.all_reduce_sum() and optimizer.step() the same number of times in the "
                            "same order, or a real multi-process run hangs")
        else:
            try:
                self._result = self._combine_fn(list(self._values))
            except (TypeError, ValueError) as exc:
                self.failure = f"{ops[0]}: {exc}"
        if self.failure is not None:
            # Raising in the action breaks the barrier: every waiting rank is released at once.
            raise _CollectiveError(self.failure)

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
        total = values[0].clone()
        for v in values[1:]:
            total = total + v
        return total
    if any(isinstance(v, torch.Tensor) for v in values):
        kinds = [type(v).__name__ for v in values]
        raise TypeError(f"some ranks passed a tensor and others a number ({kinds}); pass the same kind on every rank")
    if all(isinstance(v, numbers.Integral) for v in values):
        return sum(int(v) for v in values)
    return float(sum(float(v) for v in values))


def _mean_gradients(per_rank):
    """The average of each parameter's gradient over the ranks (a missing gradient counts as zero)."""
    means = []
    for grads in zip(*per_rank, strict=True):
        present = [g for g in grads if g is not None]
        if not present:
            means.append(None)
            continue
        filled = [g if g is not None else torch.zeros_like(present[0]) for g in grads]
        means.append(torch.stack(filled).mean(dim=0))
    return means


def _nothing(values):
    return None


class StepContext:
    """What the checked ``step`` knows about where it runs: an ``Accelerator`` in miniature.

    ``rank``, ``num_processes`` and ``grad_accum_steps`` (micro-batches per rank in the window);
    :meth:`all_reduce_sum` is ``accelerator.gather(x).sum()``; :meth:`backward` is
    ``accelerator.backward(loss)``, which divides the loss by ``grad_accum_steps``.
    """

    __slots__ = ("_collective", "grad_accum_steps", "num_processes", "rank")

    def __init__(self, rank: int, num_processes: int, grad_accum_steps: int, collective: _Collective):
        self.rank = rank
        self.num_processes = num_processes
        self.grad_accum_steps = grad_accum_steps
        self._collective = collective

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
        total = self._collective.exchange(self.rank, "ctx.all_reduce_sum()", value, _sum_values)
        # Each rank gets its own tensor: one rank changing it in place must not change another's.
        return total.clone() if isinstance(total, torch.Tensor) else total

    def backward(self, loss: torch.Tensor) -> None:
        """``accelerator.backward(loss)``: backward of ``loss / grad_accum_steps``."""
        (loss / self.grad_accum_steps).backward()

    def __repr__(self) -> str:
        return (f"StepContext(rank={self.rank}, num_processes={self.num_processes}, "
                f"grad_accum_steps={self.grad_accum_steps})")


class _SimulatedSGD:
    """The optimizer ``step`` receives: plain SGD whose ``step()`` first averages the gradients over the ranks.

    Averaging before the update is what DDP's all-reduce has done by the time the optimizer
    steps. The update is torch's SGD without momentum or weight decay (``p -= lr * grad``),
    written out so the check does not build a ``torch.optim`` optimizer: the first one in a
    process imports torch's compiler stack, about a second. It counts the calls, so the
    report can tell an optimizer that steps on every micro-batch, or a loop that never zeroes
    the gradients. ``param_groups`` is there for loops that read or set the learning rate.
    """

    def __init__(self, params, lr: float, rank: int, collective: _Collective):
        self.param_groups = [{"params": params, "lr": lr}]
        self._rank = rank
        self._collective = collective
        self.step_calls = 0
        self.zero_grad_calls = 0

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def step(self, closure=None) -> None:
        if closure is not None:
            raise TypeError("optimizer.step(closure): the checked optimizer takes no closure; call step() "
                            "after the window's backward passes")
        self.step_calls += 1
        params = self._params()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        means = self._collective.exchange(self._rank, "optimizer.step()", grads, _mean_gradients)
        with torch.no_grad():
            for p, g in zip(params, means, strict=True):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls += 1
        for p in self._params():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def __repr__(self) -> str:
        return f"SimulatedSGD(rank={self._rank}, lr={self.param_groups[0]['lr']:g})"


# ----------------------------------------------------------------------------------------------
# The report.
# ----------------------------------------------------------------------------------------------


def _processes_text(num_processes: int) -> str:
    return f"{num_processes} process" + ("" if num_processes == 1 else "es")


@dataclass(frozen=True, eq=False)
class ProcessCheck:
    """The result for one number of simulated processes.

    ``max_weight_diff``: largest absolute difference to the reference over both windows and
    every rank. ``update_ratio``: the first update projected on the reference update, over the
    reference update's squared norm (1 when right, 1/GA when divided twice ...);
    ``norm_ratio`` and ``cosine`` compare size and direction. ``optimizer_steps``: the most
    ``optimizer.step()`` calls one rank made in one window. ``rank_spread``: the largest
    weight difference between ranks. ``matches``: the known pitfalls whose update equals the
    first update within ``tol`` (``+`` joins two at once). ``reference_weights`` and
    ``user_weights`` are the weights after the first update (rank 0's).
    """

    num_processes: int
    grad_accum_steps: int
    passed: bool
    max_weight_diff: float
    update_ratio: float
    norm_ratio: float
    cosine: float
    optimizer_steps: int
    rank_spread: float
    matches: tuple[str, ...]
    diagnosis: tuple[str, ...]
    reference_weights: np.ndarray = field(repr=False)
    user_weights: np.ndarray = field(repr=False)

    def summary(self) -> str:
        status = "passed" if self.passed else "FAILED"
        return (f"{_processes_text(self.num_processes)} (GA={self.grad_accum_steps}): {status}  "
                f"max weight diff {self.max_weight_diff:.3e}  update ratio {self.update_ratio:.4g}  "
                f"norm ratio {self.norm_ratio:.4g}  cosine {self.cosine:.6f}  "
                f"optimizer.step() x{self.optimizer_steps} per window")


@dataclass(frozen=True, eq=False, repr=False)
class AccumulationReport:
    """What :func:`check_accumulation` found. Truthy only when it passed.

    ``diagnosis`` lists what is wrong, each as ``"label: explanation"``; ``notes`` say what
    this check could not tell (e.g. equal-length micro-batches hide the mean-of-means bug).
    ``update_ratio`` and ``norm_ratio`` are keyed by the number of processes, as is
    ``details`` (a :class:`ProcessCheck` each).
    """

    passed: bool
    tol: float
    lr: float
    max_weight_diff: float
    update_ratio: dict[int, float]
    norm_ratio: dict[int, float]
    details: dict[int, ProcessCheck]
    diagnosis: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.passed

    @property
    def labels(self) -> tuple[str, ...]:
        """The short label of each diagnosis (the text before its first colon)."""
        return tuple(d.split(":", 1)[0] for d in self.diagnosis)

    def __repr__(self) -> str:
        # One line, diagnosis labels first: pytest shows about the first 120 characters of the
        # repr when a plain `assert report` fails.
        head = "passed" if self.passed else "FAILED"
        if self.diagnosis:
            head += ": " + "; ".join(dict.fromkeys(self.labels))  # a label once, even if per process count
        parts = [head]
        for d in self.details.values():
            parts.append(f"{_processes_text(d.num_processes)} GA={d.grad_accum_steps}: "
                         f"max diff {d.max_weight_diff:.1e}, ratio {d.update_ratio:.4g}")
        parts.append(f"tol {self.tol:g}")
        return "AccumulationReport(" + " | ".join(parts) + ")"

    def __str__(self) -> str:
        lines = [f"check_accumulation {'passed' if self.passed else 'FAILED'} (tol {self.tol:g}, lr {self.lr:g}, "
                 f"max weight diff {self.max_weight_diff:.3e})"]
        lines += [f"  {d.summary()}" for d in self.details.values()]
        if self.diagnosis:
            lines.append("diagnosis:")
            lines += [f"  - {d}" for d in self.diagnosis]
        if self.notes:
            lines.append("notes:")
            lines += [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Argument checks, models, weights and gradients.
# ----------------------------------------------------------------------------------------------


def _check_callable(name: str, value, signature: str) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be a callable {signature}, got {type(value).__name__}")


def _check_micro_batches(micro_batches) -> list:
    if not isinstance(micro_batches, list | tuple):
        raise TypeError(f"micro_batches must be a list or tuple of micro-batches (the whole window, e.g. "
                        f"list(dataloader)), got {type(micro_batches).__name__}")
    if len(micro_batches) == 0:
        raise ValueError("micro_batches must hold at least 1 micro-batch (the whole window), got 0")
    return list(micro_batches)


def _check_process_counts(num_processes, num_micro_batches: int) -> tuple[int, ...]:
    counts = num_processes if isinstance(num_processes, tuple | list) else (num_processes,)
    if len(counts) == 0:
        raise ValueError("num_processes must be a positive int or a non-empty tuple of them, got an empty tuple")
    counts = tuple(check_int("num_processes", p, minimum=1, maximum=_MAX_PROCESSES) for p in counts)
    if len(set(counts)) != len(counts):
        raise ValueError(f"num_processes must not repeat a process count, got {counts}")
    for p in counts:
        if num_micro_batches % p:
            raise ValueError(f"micro_batches holds {num_micro_batches} micro-batches, which num_processes={p} does "
                             f"not divide: the window must hold num_processes x GA micro-batches (GA per rank)")
    return counts


def _build_model(make_model) -> nn.Module:
    model = make_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_model() must return a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("make_model() built a model with no trainable parameter (none has requires_grad=True); "
                         "the check compares weights, so it needs at least 1")
    return model


def _flat(params) -> np.ndarray:
    """All parameters as one float64 vector (a copy)."""
    return np.concatenate([p.detach().cpu().double().reshape(-1).numpy() for p in params])


def _flat_grads(params) -> np.ndarray:
    return np.concatenate([
        np.zeros(p.numel()) if p.grad is None else p.grad.detach().cpu().double().reshape(-1).numpy()
        for p in params
    ])


def _load(params, vector: np.ndarray) -> None:
    start = 0
    with torch.no_grad():
        for p in params:
            chunk = torch.from_numpy(vector[start:start + p.numel()]).reshape(p.shape)
            p.copy_(chunk)
            start += p.numel()


def _checked_loss(output, k: int):
    where = f"loss_fn(model, micro_batches[{k}])"
    if not isinstance(output, tuple | list) or len(output) != 2:
        raise TypeError(f"{where} must return (summed_loss_tensor, number_of_targets), got {type(output).__name__}")
    loss, count = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise TypeError(f"{where}[0] must be a floating-point tensor with 1 element (the summed loss), "
                        f"got {type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    if not loss.requires_grad:
        raise ValueError(f"{where}[0] does not depend on the model's parameters (requires_grad=False); compute it "
                         "from model(...) with autograd on")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError(f"{where}[0] is not finite ({float(loss.detach())}); the loss must be a finite number")
    if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point() \
            and count.dtype != torch.bool:
        count = int(count)
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"{where}[1] (the number of targets) must be an int, got {type(count).__name__}")
    if count < 0:
        raise ValueError(f"{where}[1] (the number of targets) must be >= 0, got {count}")
    return loss.reshape(()), int(count)


def _micro_batch_gradients(model, params, micro_batches, loss_fn):
    """Each micro-batch's gradient of its summed loss, and its number of targets."""
    grads = np.zeros((len(micro_batches), sum(p.numel() for p in params)))
    counts = []
    with torch.enable_grad():  # the caller may be inside torch.no_grad()
        for k, batch in enumerate(micro_batches):
            for p in params:
                p.grad = None
            loss, count = _checked_loss(loss_fn(model, batch), k)
            loss.backward()
            grads[k] = _flat_grads(params)
            counts.append(count)
    for p in params:
        p.grad = None
    return grads, counts


def _reference(make_model, micro_batches, loss_fn, lr, tol):
    """Initial weights, per-micro-batch gradients, target counts, and the full-batch weights after each window."""
    model = _build_model(make_model)
    params = list(model.parameters())
    w0 = _flat(params)
    grads, counts = _micro_batch_gradients(model, params, micro_batches, loss_fn)
    total = sum(counts)
    if total == 0:
        raise ValueError("loss_fn counts 0 targets in the whole window (micro_batches): there is no loss to "
                         "normalise; the window needs at least 1 target")
    weights = [w0 + (-lr * grads.sum(axis=0) / total)]
    largest = float(np.max(np.abs(weights[0] - w0)))
    if largest <= tol:
        raise ValueError(f"the reference update is at most {largest:.3e} per weight, not above tol={tol:g}: no loop "
                         "could be told from one that does nothing. Lower tol, raise lr, or use micro_batches / "
                         "make_model whose loss has a gradient at the initial weights")
    for _ in range(_WINDOWS - 1):
        _load(params, weights[-1])
        later, _ = _micro_batch_gradients(model, params, micro_batches, loss_fn)
        weights.append(weights[-1] - lr * later.sum(axis=0) / total)
    return model, w0, grads, counts, np.stack(weights)


def _rank_models(make_model, num_processes, w0, known_params):
    models = []
    for r in range(num_processes):
        model = _build_model(make_model)
        params = list(model.parameters())
        if any(id(p) in known_params for p in params):
            raise ValueError("make_model() returned a model that shares parameters with an earlier one; it must "
                             "build a fresh model on every call (one per simulated rank and one for the reference)")
        known_params.update({id(p): p for p in params})
        w = _flat(params)
        if w.shape != w0.shape or not np.array_equal(w, w0):
            diff = "a different number of weights" if w.shape != w0.shape else \
                f"weights up to {np.max(np.abs(w - w0)):.3e} apart"
            raise ValueError(f"make_model() built different initial weights on different calls (rank {r} of "
                             f"{num_processes}: {diff}); it must build the same deterministic weights every time, "
                             "e.g. seed inside it with torch.manual_seed")
        models.append(model)
    return models


# ----------------------------------------------------------------------------------------------
# Running the user's step on N simulated ranks.
# ----------------------------------------------------------------------------------------------


def _run_ranks(step, models, shards, loss_fn, lr, grad_accum_steps):
    """Run ``step`` on every rank for each window; weights[window, rank], step and zero_grad counts."""
    num_processes = len(models)
    collective = _Collective(num_processes)
    params = [list(m.parameters()) for m in models]
    optimizers = [_SimulatedSGD(params[r], lr, r, collective) for r in range(num_processes)]
    size = sum(p.numel() for p in params[0])
    weights = np.zeros((_WINDOWS, num_processes, size))
    steps = np.zeros((_WINDOWS, num_processes), dtype=np.int64)
    zero_grads = np.zeros((_WINDOWS, num_processes), dtype=np.int64)
    errors: list = [None] * num_processes
    windows_reached = [0] * num_processes

    def worker(rank: int) -> None:
        ctx = StepContext(rank, num_processes, grad_accum_steps, collective)
        optimizer = optimizers[rank]
        try:
            for window in range(_WINDOWS):
                windows_reached[rank] = window
                optimizer.step_calls = optimizer.zero_grad_calls = 0
                step(models[rank], optimizer, list(shards[rank]), loss_fn, ctx)
                # Every rank must come back from step at the same point of the collective sequence.
                collective.exchange(rank, "returned from step", None, _nothing)
                weights[window, rank] = _flat(params[rank])
                steps[window, rank] = optimizer.step_calls
                zero_grads[window, rank] = optimizer.zero_grad_calls
        except BaseException as exc:  # noqa: BLE001 -- anything the user's code raises goes back to the caller
            errors[rank] = exc
            collective.abort()  # release the ranks waiting at the barrier: no deadlock

    threads = [threading.Thread(target=worker, args=(r,), name=f"check_accumulation rank {r}", daemon=True)
               for r in range(num_processes)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for rank, t in enumerate(threads):
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise AccumulationCheckError(
                f"rank {rank} of {num_processes} has not returned from step after {_JOIN_TIMEOUT_S:g} s "
                f"(window {windows_reached[rank] + 1}); is it stuck in a loop or waiting for something?")
    _raise_rank_errors(errors, collective, num_processes, windows_reached)
    return weights, steps, zero_grads


def _raise_rank_errors(errors, collective, num_processes, windows_reached) -> None:
    # The user's own exception first: the other ranks' errors are only its consequences.
    for rank, exc in enumerate(errors):
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError | _CollectiveError):
            raise AccumulationCheckError(
                f"step raised {type(exc).__name__} on rank {rank} of {num_processes} "
                f"(window {windows_reached[rank] + 1} of {_WINDOWS}): {exc}") from exc
    if collective.failure is not None:
        raise AccumulationCheckError(f"with {_processes_text(num_processes)}: {collective.failure}")
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AccumulationCheckError(
                f"rank {rank} of {num_processes} waited more than {_COLLECTIVE_TIMEOUT_S:g} s at a collective "
                "call (optimizer.step() or ctx.all_reduce_sum()) that another rank never reached") from exc


# ----------------------------------------------------------------------------------------------
# Comparing and diagnosing.
# ----------------------------------------------------------------------------------------------


def _candidate_updates(grads, counts, shard_indices, grad_accum_steps, num_processes, lr, counts_before_shift=None):
    """The first update each known pitfall gives on this window: (issue keys, update vector).

    ``counts_before_shift``: each micro-batch's labels that are not -100, when the loss shifts them
    (see :func:`_counts_before_shift`); None when it does not.
    """
    total = sum(counts)
    ga, world = grad_accum_steps, num_processes

    def local_counts(per_batch):
        return [sum(per_batch[k] for k in shard) for shard in shard_indices]

    local = local_counts(counts)

    def update(strategy, local=local):
        g = np.zeros(grads.shape[1])
        for r, shard in enumerate(shard_indices):
            for k in shard:
                # plain_backward_loss is linear in the summed loss: with loss_sum=1 it is the micro-batch's weight.
                weight = plain_backward_loss(strategy, 1.0, counts[k], window_terms=total, local_window_terms=local[r],
                                             grad_accum_steps=ga, num_processes=world)
                g += weight * grads[k]
        return -lr * g / world  # DDP averages the ranks' gradients

    reference = -lr * grads.sum(axis=0) / total
    candidates = [(("divided_twice",), reference / ga), (("not_divided",), reference * ga),
                  (("missing_world_scale",), update("token_no_world_scale"))]
    if min(counts) >= 1:  # a micro-batch without targets has no mean loss
        mean_of_means = update("mean_of_means")
        candidates += [(("mean_of_means",), mean_of_means),
                       (("divided_twice", "mean_of_means"), mean_of_means / ga),
                       (("not_divided", "mean_of_means"), mean_of_means * ga)]
    if min(local) >= 1:
        local_count = update("token_local_count")
        candidates += [(("count_not_gathered",), local_count),
                       (("count_not_gathered", "missing_world_scale"), local_count / world)]
    if counts_before_shift is not None:
        # The right loop with the normaliser counted before the shift: the reference scaled by after / before.
        shifted = reference * total / sum(counts_before_shift)
        candidates += [(("counted_before_shift",), shifted),
                       (("divided_twice", "counted_before_shift"), shifted / ga),
                       (("not_divided", "counted_before_shift"), shifted * ga),
                       (("missing_world_scale", "counted_before_shift"), shifted / world)]
        local_before = local_counts(counts_before_shift)
        if min(local_before) >= 1:
            candidates.append((("count_not_gathered", "counted_before_shift"),
                               update("token_local_count", local_before)))
    return candidates


def _counts_before_shift(micro_batches, counts) -> list[int] | None:
    """Each micro-batch's labels that are not -100, when the loss counts its targets after a causal shift.

    A causal-LM loss compares the logits at positions 0..T-2 with the labels at 1..T-1, so it
    counts ``labels[..., 1:] != -100``. Only when every micro-batch is a mapping with integer
    ``"labels"`` and ``loss_fn`` counted exactly those shifted labels do we know the shift applies
    (a token classifier counts every label); and only when the two counts differ can counting
    before the shift change the update. None otherwise: the pitfall cannot be told apart here.
    """
    before = []
    for batch, count in zip(micro_batches, counts, strict=True):
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor) or labels.ndim == 0 or labels.is_floating_point() \
                or labels.dtype == torch.bool:
            return None
        if int(labels[..., 1:].ne(IGNORE_INDEX).sum()) != count:
            return None
        before.append(int(labels.ne(IGNORE_INDEX).sum()))
    return before if sum(before) != sum(counts) else None


def _simplest(matches) -> list[tuple[str, ...]]:
    """Drop an explanation when a simpler one (a subset of its issues) explains the same update."""
    sets = [set(m) for m in matches]
    return [m for m, s in zip(matches, sets, strict=True) if not any(o < s for o in sets)]


def _issue_texts(explanations) -> list[str]:
    keys = {k for e in explanations for k in e}
    return [f"{label}: {text}" for key, (label, text) in _ISSUES.items() if key in keys]


@dataclass
class _Outcome:
    """One process count's numbers before they become a :class:`ProcessCheck`."""

    num_processes: int
    grad_accum_steps: int
    first_failed: bool
    structural: list
    matches: list | None  # None: not comparable (the optimizer did not step exactly once)
    check: ProcessCheck | None = None


def _check_processes(step, make_model, micro_batches, loss_fn, num_processes, lr, tol, ref, known_params):
    w0, grads, counts, counts_before_shift, reference = ref
    ga = len(micro_batches) // num_processes
    shards = shard_batches([[k] for k in range(len(micro_batches))], num_processes, 1)
    shard_indices = [[mb[0] for mb in shard] for shard in shards]
    models = _rank_models(make_model, num_processes, w0, known_params)
    rank_batches = [[micro_batches[k] for k in shard] for shard in shard_indices]
    weights, steps, zero_grads = _run_ranks(step, models, rank_batches, loss_fn, lr, ga)

    if int(steps.min()) == 0:
        window, rank = (int(i) for i in np.argwhere(steps == 0)[0])
        raise ValueError(f"step never called optimizer.step() (rank {rank} of {num_processes}, window {window + 1}); "
                         "it must make one optimizer update over its micro-batches: forward and backward each one, "
                         "then optimizer.step() and optimizer.zero_grad() on the optimizer it is given")

    diffs = np.abs(weights - reference[:, None, :])  # window, rank, weight
    window_diff = diffs.max(axis=(1, 2))
    max_diff = float(window_diff.max())
    spread = float(np.max(np.abs(weights - weights[:, :1, :])))
    most_steps = int(steps.max())
    user_delta, ref_delta = weights[0, 0] - w0, reference[0] - w0
    ref_sq = float(ref_delta @ ref_delta)
    user_norm = float(np.linalg.norm(user_delta))
    ratio = float(user_delta @ ref_delta) / ref_sq
    norm_ratio = user_norm / ref_sq ** 0.5
    cosine = float(user_delta @ ref_delta) / (user_norm * ref_sq ** 0.5) if user_norm > 0 else 0.0
    # Rank 0's first update is the one compared with the pitfalls; other ranks differing is "ranks diverged".
    first_failed = bool(np.max(np.abs(weights[0, 0] - reference[0])) > tol)

    structural = []
    if most_steps > 1:
        label = "optimizer stepped on every micro-batch" if most_steps == ga else \
            f"optimizer stepped {most_steps} times per window"
        structural.append(f"{label}: optimizer.step() ran {most_steps} times in one window of GA={ga} micro-batches "
                          "but must run once, after the window's last backward; an optimizer not prepared by "
                          "Accelerate steps on every micro-batch")
    if spread > tol:
        structural.append(f"ranks diverged: the replicas ended up to {spread:.3e} apart; something changed the weights "
                          "differently on each rank outside the averaged optimizer.step() (a rank-dependent update, "
                          "learning rate or weight edit)")
    if most_steps == 1 and window_diff[0] <= tol < max_diff:
        hint = ("optimizer.zero_grad() was never called, so the second window adds onto the first window's gradients"
                if int(zero_grads.max()) == 0 else
                "gradients or other state of the first window leak into the second")
        structural.append(f"state carried over between windows: the first update matches the reference but the "
                          f"second does not; {hint}")
    if first_failed and user_norm == 0.0:
        structural.append("no update: the weights did not change; were the gradients zeroed before "
                          "optimizer.step(), or does the loss not reach the parameters?")

    matches = None
    if most_steps == 1:
        candidates = _candidate_updates(grads, counts, shard_indices, ga, num_processes, lr, counts_before_shift)
        matches = [issues for issues, delta in candidates if float(np.max(np.abs(user_delta - delta))) <= tol]

    local = []
    if first_failed and matches is not None and user_norm > 0.0:
        local = _issue_texts(_simplest(matches)) if matches else _unexplained(ratio, norm_ratio, cosine, ga)
    passed = max_diff <= tol and most_steps == 1 and spread <= tol
    check = ProcessCheck(
        num_processes=num_processes, grad_accum_steps=ga, passed=passed, max_weight_diff=max_diff,
        update_ratio=ratio, norm_ratio=norm_ratio, cosine=cosine, optimizer_steps=most_steps, rank_spread=spread,
        matches=tuple("+".join(m) for m in _simplest(matches)) if first_failed and matches else (),
        diagnosis=tuple(structural + local),
        reference_weights=reference[0].copy(), user_weights=weights[0, 0].copy(),
    )
    return _Outcome(num_processes, ga, first_failed, structural, matches, check)


def _unexplained(ratio, norm_ratio, cosine, ga) -> list[str]:
    if cosine >= _SAME_DIRECTION:
        # Not necessarily a constant factor: on a model whose gradients all lie on one line (a 2-class
        # classifier without bias) any per-micro-batch weighting keeps the direction.
        return [f"wrong update size: the update points the reference's way but is {ratio:.4g} times its size, and "
                "no known pitfall gives exactly this; check what each micro-batch's loss is divided by (a count "
                "that includes padding?)"]
    # The report adds "(with N processes)" when this holds for some process counts only.
    return [f"no known pitfall matches: update ratio {ratio:.4g}, norm ratio {norm_ratio:.4g}, cosine {cosine:.4f} "
            f"(GA={ga}); compare what each micro-batch feeds to backward with its summed loss / the window's total "
            "targets"]


def _ambiguity(explanations, where: str) -> list[str]:
    if len(explanations) < 2:
        return []
    names = " / ".join("+".join(e) for e in explanations)
    return [f"{where} several known pitfalls give this same update ({names}); check other process counts "
            "to tell them apart"]


def _diagnose(outcomes: list[_Outcome]) -> tuple[list[str], list[str]]:
    """The report's diagnosis (what holds for every process count, else each count's own) and notes on ambiguity."""
    all_counts = [o.num_processes for o in outcomes]
    found: dict[str, list[int]] = {}  # diagnosis text -> process counts it came from
    notes: list[str] = []

    def add(text, num_processes):
        found.setdefault(text, []).append(num_processes)

    for o in outcomes:
        for text in o.structural:
            # Merge by label: the numbers in the explanation may differ per process count.
            label = text.split(":", 1)[0]
            same = next((t for t in found if t.split(":", 1)[0] == label), text)
            add(same, o.num_processes)

    compared = [o for o in outcomes if o.matches is not None]
    if any(o.first_failed for o in compared):
        common = _simplest(sorted(set.intersection(*(set(o.matches) for o in compared))))
        if common:
            # One explanation fits every process count: it is the diagnosis (e.g. missing x num_processes
            # matches 2 processes, and agrees with 1 process, where it makes no difference).
            for text in _issue_texts(common):
                found.setdefault(text, list(all_counts))
            notes += _ambiguity(common, "for every process count checked")
        else:
            for o in compared:
                if o.first_failed:
                    for text in o.check.diagnosis:
                        if text not in o.structural:
                            add(text, o.num_processes)
                    notes += _ambiguity(_simplest(o.matches), f"with {_processes_text(o.num_processes)}")

    diagnosis = []
    for text, counts in found.items():
        if len(all_counts) > 1 and sorted(set(counts)) != sorted(all_counts):
            where = ", ".join(str(p) for p in sorted(set(counts)))
            text = f"{text} (with {where} process{'' if set(counts) == {1} else 'es'})"
        diagnosis.append(text)
    return diagnosis, notes


def _notes(outcomes: list[_Outcome], counts: list[int]) -> list[str]:
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


# ----------------------------------------------------------------------------------------------
# The public function.
# ----------------------------------------------------------------------------------------------


def check_accumulation(step, make_model, micro_batches, loss_fn, *, num_processes=(1, 2), lr: float = 0.1,
                       tol: float = 1e-6) -> AccumulationReport:
    """Run your accumulation ``step`` and the full-batch reference from the same weights; report.

    ``step(model, optimizer, micro_batches, loss_fn, ctx)`` is your loop for ONE optimizer
    update over this rank's share of the window: forward and backward each micro-batch, then
    ``optimizer.step()`` and ``optimizer.zero_grad()``. ``ctx`` is a :class:`StepContext`
    (``rank``, ``num_processes``, ``grad_accum_steps``, ``all_reduce_sum``, ``backward``).

    ``make_model()`` builds a fresh model with deterministic weights (called once for the
    reference and once per simulated rank). ``micro_batches`` is the whole window, a list of
    ``P x GA`` micro-batches, dealt to the P ranks as Accelerate does (rank r gets r, r+P, ...).
    ``loss_fn(model, batch)`` returns ``(summed_loss_tensor, number_of_targets)``; the
    reference is one SGD step (learning rate ``lr``) on the sum of every micro-batch's summed
    loss divided by the window's total number of targets. When each micro-batch is a mapping
    whose integer ``"labels"`` ``loss_fn`` counts after a causal shift (``labels[..., 1:]``, as
    a language model's loss does), a normaliser counted before the shift is diagnosed too.

    ``num_processes`` is one process count or a tuple of them; the check passes when, for
    each, every rank's weights equal the reference within ``tol`` (largest absolute
    difference) after each of two consecutive windows, with exactly one ``optimizer.step()``
    per window. Returns an :class:`AccumulationReport`, truthy only when it passed.
    """
    _check_callable("step", step, "step(model, optimizer, micro_batches, loss_fn, ctx)")
    _check_callable("make_model", make_model, "make_model() returning a torch.nn.Module")
    _check_callable("loss_fn", loss_fn, "loss_fn(model, batch) returning (summed_loss_tensor, number_of_targets)")
    micro_batches = _check_micro_batches(micro_batches)
    process_counts = _check_process_counts(num_processes, len(micro_batches))
    lr = check_float("lr", lr, minimum=0.0, exclusive_minimum=True, maximum=1e3)
    tol = check_float("tol", tol, minimum=0.0, exclusive_minimum=True, maximum=1.0)

    ref_model, w0, grads, counts, reference = _reference(make_model, micro_batches, loss_fn, lr, tol)
    counts_before_shift = _counts_before_shift(micro_batches, counts)
    # Keyed by id, holding the parameters themselves: a freed model's id could be reused by a new one.
    known_params = {id(p): p for p in ref_model.parameters()}
    ref = (w0, grads, counts, counts_before_shift, reference)
    outcomes = [_check_processes(step, make_model, micro_batches, loss_fn, p, lr, tol, ref, known_params)
                for p in process_counts]
    details = {o.num_processes: o.check for o in outcomes}
    passed = all(d.passed for d in details.values())
    diagnosis, ambiguity = _diagnose(outcomes)
    return AccumulationReport(
        passed=passed, tol=tol, lr=lr, max_weight_diff=max(d.max_weight_diff for d in details.values()),
        update_ratio={p: d.update_ratio for p, d in details.items()},
        norm_ratio={p: d.norm_ratio for p, d in details.items()},
        details=details, diagnosis=tuple(diagnosis), notes=tuple(ambiguity + _notes(outcomes, counts)),
    )
