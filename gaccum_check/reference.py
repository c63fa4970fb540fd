"""The full-batch reference of :func:`~gaccum_lib.check.check_accumulation`, and its arguments' checks.

The reference is the chosen optimizer stepping once per window on the full batch's mean
gradient (every micro-batch's summed-loss gradient, added up, over the window's targets),
from the same initial weights as the user's loop. Before it is computed, two inputs that
would make every comparison meaningless are caught: a model that is not deterministic (the
check returns that as its diagnosis) and a ``loss_fn`` that returns a mean, not a sum (refused).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from gaccum_lib._checks import check_int

from .ranks import WINDOWS, flat, flat_grads

MAX_PROCESSES = 64
# A relative tolerance or rounding floor at or above this could not tell a 5 % error from a pass.
LOOSEST = 0.05
# Rounding floor, in units of the dtype's eps times the size of what is compared.
FLOOR_EPS = 4.0


# ----------------------------------------------------------------------------------------------


def check_callable(name: str, value, signature: str) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be a callable {signature}, got {type(value).__name__}")


def check_micro_batches(micro_batches) -> list:
    if not isinstance(micro_batches, list | tuple):
        raise TypeError(f"micro_batches must be a list or tuple of micro-batches (the whole window, e.g. "
                        f"list(dataloader)), got {type(micro_batches).__name__}")
    if len(micro_batches) == 0:
        raise ValueError("micro_batches must hold at least 1 micro-batch (the whole window), got 0")
    return list(micro_batches)


def check_process_counts(num_processes, num_micro_batches: int) -> tuple[int, ...]:
    counts = num_processes if isinstance(num_processes, tuple | list) else (num_processes,)
    if len(counts) == 0:
        raise ValueError("num_processes must be a positive int or a non-empty tuple of them, got an empty tuple")
    counts = tuple(check_int("num_processes", p, minimum=1, maximum=MAX_PROCESSES) for p in counts)
    if len(set(counts)) != len(counts):
        raise ValueError(f"num_processes must not repeat a process count, got {counts}")
    for p in counts:
        if num_micro_batches % p:
            raise ValueError(f"micro_batches holds {num_micro_batches} micro-batches, which num_processes={p} does "
                             f"not divide: the window must hold num_processes x GA micro-batches (GA per rank)")
    return counts


def build_model(make_model, known_params: dict, w0=None) -> nn.Module:
    model = make_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_model() must return a torch.nn.Module, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("make_model() built a model with no trainable parameter (none has requires_grad=True); "
                         "the check compares weights, so it needs at least 1")
    if any(id(p) in known_params for p in params):
        raise ValueError("make_model() returned a model that shares parameters with an earlier one; it must "
                         "build a fresh model on every call (one per simulated rank and one for the reference)")
    known_params.update({id(p): p for p in params})  # holding them: a freed model's id could be reused
    if w0 is not None:
        w = flat(params)
        if w.shape != w0.shape or not np.array_equal(w, w0):
            diff = "a different number of weights" if w.shape != w0.shape else \
                f"weights up to {np.max(np.abs(w - w0)):.3e} apart"
            raise ValueError(f"make_model() built different initial weights on different calls ({diff}); it must "
                             "build the same deterministic weights every time, e.g. seed inside it with "
                             "torch.manual_seed")
    return model


def _checked_loss(output, k: int):
    where = f"loss_fn(model, micro_batches[{k}])"
    if not isinstance(output, tuple | list) or len(output) != 2:
        raise TypeError(f"{where} must return (summed_loss_tensor, number_of_targets), got {type(output).__name__}")
    loss, count = output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise TypeError(f"{where}[0] must be a floating-point tensor with 1 element (the summed loss), "
                        f"got {type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    if not loss.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{where}[0] does not depend on the model's parameters (requires_grad=False); compute it "
                         "from model(...) with autograd on")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError(f"{where}[0] is not finite ({float(loss.detach())}); the loss must be a finite number")
    if isinstance(count, torch.Tensor) and count.numel() == 1 and not count.is_floating_point() \
            and count.dtype != torch.bool:
        count = int(count)
    if isinstance(count, bool) or not isinstance(count, int | np.integer):
        raise TypeError(f"{where}[1] (the number of targets) must be an int, got {type(count).__name__}")
    if count < 0:
        raise ValueError(f"{where}[1] (the number of targets) must be >= 0, got {count}")
    return loss.reshape(()), int(count)


def _gradients(model, params, micro_batches, loss_fn):
    """Each micro-batch's gradient of its summed loss (from a fresh copy of it), and its number of targets."""
    grads = np.zeros((len(micro_batches), sum(p.numel() for p in params)))
    counts = []
    with torch.enable_grad():  # the caller may be inside torch.no_grad()
        for k, batch in enumerate(micro_batches):
            for p in params:
                p.grad = None
            loss, count = _checked_loss(loss_fn(model, copy.deepcopy(batch)), k)
            loss.backward()
            grads[k] = flat_grads(params)
            counts.append(count)
    for p in params:
        p.grad = None
    return grads, counts


def _doubled(batch):
    """The micro-batch with every row twice, when it is a mapping of tensors sharing their first dimension."""
    if not isinstance(batch, Mapping) or not batch or not all(isinstance(v, torch.Tensor) and v.ndim
                                                               for v in batch.values()):
        return None
    if len({v.shape[0] for v in batch.values()}) != 1:
        return None
    return {k: torch.cat([v, v]) for k, v in batch.items()}


def _refuse_misleading_inputs(model, micro_batches, loss_fn) -> str | None:
    """A ValueError for a loss_fn that returns a mean; the diagnosis for a model that is not deterministic."""
    with torch.no_grad():
        first, count = _checked_loss(loss_fn(model, copy.deepcopy(micro_batches[0])), 0)
        again, _ = _checked_loss(loss_fn(model, copy.deepcopy(micro_batches[0])), 0)
        if not torch.equal(first, again):
            return (f"model is not deterministic: two identical forward passes of micro-batch 0 gave losses "
                    f"{float(first):.10g} and {float(again):.10g}, so no two runs can be compared; dropout in train "
                    "mode or unseeded randomness? Build the model with model.eval() (or dropout 0) for the check")
        doubled = _doubled(micro_batches[0])
        if doubled is not None and count > 0:
            twice, twice_count = _checked_loss(loss_fn(model, doubled), 0)
            if twice_count == 2 * count and float(first) != 0.0 and abs(float(twice) - float(first)) <= \
                    1e-5 * abs(float(first)):
                raise ValueError(f"loss_fn returns the mean loss, not the summed loss: micro-batch 0 with every row "
                                 f"twice gives the same loss ({float(first):.6g}) for twice the targets "
                                 f"({count} -> {twice_count}); return the sum (reduction='sum') and the count")
    return None


def reference(make_model, make_optimizer, micro_batches, loss_fn, known_params):
    """Initial weights, the first window's per-micro-batch gradients and counts, and the reference optimizer's
    gradients and weights over the windows (or a non-determinism diagnosis)."""
    model = build_model(make_model, known_params)
    params = [p for p in model.parameters() if p.requires_grad]
    w0 = flat(params)
    problem = _refuse_misleading_inputs(model, micro_batches, loss_fn)
    grads, counts = _gradients(model, params, micro_batches, loss_fn)
    total = sum(counts)
    if total == 0:
        raise ValueError("loss_fn counts 0 targets in the whole window (micro_batches): there is no loss to "
                         "normalise; the window needs at least 1 target")
    if not np.any(grads.sum(axis=0)):
        raise ValueError("the full-batch gradient is exactly 0 at the initial weights: no loop could be told from "
                         "one that does nothing; use micro_batches / make_model whose loss has a gradient")
    optimizer = make_optimizer(params)
    mean_grads, weights, window_grads = [], [], grads
    for _ in range(WINDOWS):
        mean_grads.append(window_grads.sum(axis=0) / total)
        start = 0
        for p in params:  # hand the optimizer the full batch's mean gradient
            p.grad = torch.from_numpy(mean_grads[-1][start:start + p.numel()]).reshape(p.shape).to(p.dtype)
            start += p.numel()
        optimizer.step()
        weights.append(flat(params))
        window_grads, _ = _gradients(model, params, micro_batches, loss_fn)
    eps = max(torch.finfo(p.dtype).eps for p in params)
    # Summing the micro-batches' gradients in the model's dtype rounds by up to eps times the sum of their sizes.
    gradient_floor = FLOOR_EPS * eps * float(np.linalg.norm(np.abs(grads).sum(axis=0))) / \
        float(np.linalg.norm(grads.sum(axis=0)))
    if gradient_floor >= LOOSEST:
        raise ValueError(f"the micro-batches' gradients cancel so much that rounding in {params[0].dtype} alone could "
                         f"move the full-batch gradient by {gradient_floor:.0%}: the check could not tell a 5 % error "
                         "from a pass; use float64 (make_model) or other micro_batches")
    return dict(w0=w0, grads=grads, counts=counts, mean_grads=np.stack(mean_grads), weights=np.stack(weights),
                eps=eps, problem=problem, gradient_floor=gradient_floor)
