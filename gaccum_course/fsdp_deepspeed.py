"""Lesson 10's plumbing: accumulation under FSDP2 and DeepSpeed, in real CPU processes (gloo).

The training loops are written out in the lesson; this module holds what they train on and
what measures them, so nothing here is what a learner came to copy.

* :func:`regression_mlp` and :func:`regression_rows`: a seeded three-layer net and its rows,
  the same in every process. Every micro-batch holds the same number of rows, so the loss per
  row of the update (summed loss / rows of the update) is the full batch's mean whatever the
  normalisation question of lessons 03-05: here only the sharding is in question.
* :func:`rank_windows`: the micro-batches each process gets, dealt as Accelerate's prepared
  DataLoader deals them (process r takes micro-batches r, r + P, ...), GA to a window.
* :func:`full_batch_weights`: plain SGD on one process, one micro-batch per update: what every
  run must equal.
* :func:`count_collectives`: counts the collective calls made inside it, by kind (FSDP2
  reduce-scatters gradients and all-gathers parameters through ``torch.distributed``; which
  function of each kind it calls differs between torch versions).
* :func:`gradient_elements_held`: the gradient elements an FSDP2 model holds in this process
  right now: the sharded gradient (``param.grad``, 1/P of each parameter) and any unsharded
  gradient kept between micro-batches while gradient sync is off.
* :func:`deepspeed_config`: the smallest DeepSpeed config for these runs (ZeRO stage 0, SGD).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn

from gaccum_lib._checks import check_int

#: Rows of the regression (divisible by every window the lesson uses).
NUM_ROWS = 64
#: Learning rate of every run.
LR = 0.1
# The torch.distributed functions that FSDP2, DDP and DeepSpeed call to move gradients and weights, by kind.
# torch 2.13's FSDP2 calls reduce_scatter_single and all_gather_single, torch 2.11's reduce_scatter_tensor and
# all_gather_into_tensor: the same collectives, so they are counted by kind.
COLLECTIVES = {"all_reduce": "all-reduce", "reduce_scatter_tensor": "reduce-scatter",
               "reduce_scatter_single": "reduce-scatter", "reduce_scatter": "reduce-scatter",
               "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather", "all_gather": "all-gather",
               "broadcast": "broadcast"}


def regression_mlp(width: int = 16, *, seed: int = 0) -> nn.Sequential:
    """Linear(4, width) - Tanh - Linear(width, width) - Tanh - Linear(width, 1); the same weights for the same seed."""
    check_int("width", width, minimum=1, maximum=4096)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def regression_rows(num_rows: int = NUM_ROWS, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (num_rows, 4) and targets (num_rows,) of a noisy linear rule, seeded."""
    check_int("num_rows", num_rows, minimum=1)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(num_rows, generator=generator)
    return x, y


def rank_windows(grad_accum_steps: int, micro_batch_size: int, rank: int, num_processes: int,
                 num_rows: int = NUM_ROWS) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """This process's windows: GA micro-batches each, dealt as Accelerate deals them (r, r + P, ...)."""
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    check_int("num_processes", num_processes, minimum=1)
    check_int("rank", rank, minimum=0, maximum=num_processes - 1)
    rows_per_update = grad_accum_steps * micro_batch_size * num_processes
    if num_rows % rows_per_update:
        raise ValueError(f"num_rows={num_rows} must be a multiple of grad_accum_steps x micro_batch_size x "
                         f"num_processes = {rows_per_update}, so that every window is full")
    x, y = regression_rows(num_rows)
    starts = range(0, num_rows, micro_batch_size)
    micro_batches = [(x[i:i + micro_batch_size], y[i:i + micro_batch_size]) for i in starts]
    mine = micro_batches[rank::num_processes]
    return [mine[i:i + grad_accum_steps] for i in range(0, len(mine), grad_accum_steps)]


def flat_weights(model) -> torch.Tensor:
    """Every weight in one float64 vector; FSDP2's sharded parameters gathered in full first."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1).double() for p in full])


def full_batch_weights(rows_per_update: int, *, width: int = 16, num_rows: int = NUM_ROWS) -> list[torch.Tensor]:
    """Plain SGD, one process, one micro-batch of ``rows_per_update`` rows per update: the weights after each."""
    check_int("rows_per_update", rows_per_update, minimum=1, maximum=num_rows)
    model = regression_mlp(width)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = regression_rows(num_rows)
    weights = []
    for start in range(0, num_rows - rows_per_update + 1, rows_per_update):
        rows = slice(start, start + rows_per_update)
        (model(x[rows]).squeeze(-1) - y[rows]).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append(flat_weights(model))
    return weights


@contextlib.contextmanager
def count_collectives():
    """Count the ``torch.distributed`` collective calls made inside, by kind (``"reduce-scatter"``, ``"all-gather"``,
    ``"all-reduce"``, ``"broadcast"``): ``with count_collectives() as calls:``."""
    import torch.distributed as dist

    calls: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[COLLECTIVES[name]] += 1
            return function(*args, **kwargs)
        return call

    for name, function in originals.items():
        setattr(dist, name, counted(name, function))
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def gradient_elements_held(model) -> dict[str, int]:
    """Gradient elements this process holds for an FSDP2 model: ``{"sharded": ..., "unsharded": ...}``.

    Reads FSDP2's own bookkeeping (``FSDPParam``: the sharded parameter's ``grad``, and the
    unsharded gradient it keeps between backward passes while gradient sync is off). Private torch
    API, on purpose: torch 2.13 (and 2.11) offer no public way to see that unsharded gradient, which
    is the very memory the lesson measures; the sharded one alone would be ``param.grad``.
    """
    held = {"sharded": 0, "unsharded": 0}
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for param in getattr(group, "fsdp_params", ()):
            if param.sharded_param.grad is not None:
                held["sharded"] += param.sharded_param.grad.to_local().numel()
            unsharded = param.unsharded_accumulated_grad
            if unsharded is None and getattr(param, "_unsharded_param", None) is not None:
                unsharded = param._unsharded_param.grad
            if unsharded is not None:
                held["unsharded"] += unsharded.numel()
    return held


def deepspeed_config(grad_accum_steps: int, micro_batch_size: int, *, gradient_clipping: float = 0.0) -> dict:
    """ZeRO stage 0, float32: DeepSpeed's accumulation and nothing else.

    ``gradient_clipping`` is written out because DeepSpeed's default is not 0: 0.19.8 clips the
    gradient to norm 1.0 when the config does not say (``GRADIENT_CLIPPING_DEFAULT`` in
    ``deepspeed/runtime/constants.py``), which the full batch here does not do.
    """
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps,
            "gradient_clipping": gradient_clipping, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}


__all__ = ["COLLECTIVES", "LR", "NUM_ROWS", "count_collectives", "deepspeed_config",
           "flat_weights", "full_batch_weights", "gradient_elements_held", "rank_windows", "regression_mlp",
           "regression_rows"]
