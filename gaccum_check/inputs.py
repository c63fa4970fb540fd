"""The arguments of :func:`~gaccum_check.check_accumulation`, checked before anything runs.

Each bad value gets a TypeError or ValueError that names the argument and what it accepts.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gaccum_lib._checks import check_int

from .ranks import flat

MAX_PROCESSES = 64



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


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def checked_loss(output, k):
    """``loss_fn``'s (summed loss, count), checked; ``k`` names the batch (an index, or a description)."""
    where = f"loss_fn(model, micro_batches[{k}])" if isinstance(k, int) else f"loss_fn(model, {k})"
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
