"""How a scheduler prepared by Accelerate steps under gradient accumulation.

Accelerate's ``AcceleratedScheduler.step()`` does nothing while gradients are being
accumulated (``sync_gradients`` is False), and on each real optimizer update it steps the
wrapped scheduler ``num_processes`` times (unless ``split_batches=True``): each process sees
only 1/num_processes of the batches, so a schedule sized for the whole dataloader on one
process is consumed at the right pace.

Hence the rule: size the schedule in the scheduler steps Accelerate will take,
``N * ceil(ceil(len(dataloader) / N) / grad_accum_steps)`` per epoch for ``N`` processes and the
unsharded dataloader's length: the usual rule, ``ceil(len(dataloader) / grad_accum_steps)``,
rounded up to a multiple of ``N``. The two agree whenever the usual rule is already a multiple of
``N`` (always on one process); otherwise the usual rule is short by at most ``N - 1`` steps (1000
batches, GA 8, 4 processes: 125 instead of 128). Sizing it in micro-batches makes it decay
``grad_accum_steps`` times too slowly; sizing it from the sharded dataloader's length makes it run
out ``N`` times too early.

:func:`scheduler_steps_per_update` reproduces that counting; ``tests/test_schedule.py``
checks it against real Accelerate in 1 and 2 processes.
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import check_choice, check_float, check_int

SIZINGS = {
    "updates": "N x ceil(ceil(len(dataloader) / N) / GA) per epoch: the steps Accelerate takes (right)",
    "usual_rule": "ceil(len(dataloader) / GA) per epoch: right on 1 process, a few steps short on several",
    "micro_batches": "len(dataloader) per epoch: GA times too long",
    "sharded_updates": "len(sharded dataloader) / GA per epoch: runs out num_processes times too early",
}


def scheduler_steps_per_update(num_batches: int, grad_accum_steps: int, num_processes: int = 1,
                               epochs: int = 1) -> np.ndarray:
    """Cumulative number of scheduler steps after each optimizer update (Accelerate's counting).

    ``num_batches`` is the length of the dataloader before ``prepare`` (one process).
    """
    check_int("num_batches", num_batches, minimum=1)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("num_processes", num_processes, minimum=1)
    check_int("epochs", epochs, minimum=1)
    batches_per_rank = math.ceil(num_batches / num_processes)  # even_batches: every rank gets as many
    updates_per_epoch = math.ceil(batches_per_rank / grad_accum_steps)  # the short last window syncs too
    return num_processes * np.arange(1, updates_per_epoch * epochs + 1)


def schedule_length(sizing: str, num_batches: int, grad_accum_steps: int, num_processes: int = 1,
                    epochs: int = 1) -> int:
    """The ``num_training_steps`` one would pass to the scheduler with each sizing."""
    check_choice("sizing", sizing, tuple(SIZINGS))
    check_int("num_batches", num_batches, minimum=1)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("num_processes", num_processes, minimum=1)
    check_int("epochs", epochs, minimum=1)
    if sizing == "micro_batches":
        return num_batches * epochs
    if sizing == "updates":
        return int(scheduler_steps_per_update(num_batches, grad_accum_steps, num_processes, epochs)[-1])
    if sizing == "usual_rule":
        return math.ceil(num_batches / grad_accum_steps) * epochs
    return math.ceil(math.ceil(num_batches / num_processes) / grad_accum_steps) * epochs


def linear_decay(step, total_steps: int, peak_lr: float = 0.1):
    """Learning rate of a linear decay from ``peak_lr`` to 0 over ``total_steps`` scheduler steps."""
    check_int("total_steps", total_steps, minimum=1)
    check_float("peak_lr", peak_lr, minimum=0.0, exclusive_minimum=True)
    return peak_lr * np.clip(1.0 - np.asarray(step, dtype=np.float64) / total_steps, 0.0, 1.0)


def lr_per_update(sizing: str, num_batches: int, grad_accum_steps: int, num_processes: int = 1,
                  epochs: int = 1, peak_lr: float = 0.1) -> np.ndarray:
    """Learning rate used by each optimizer update with a linear decay sized by ``sizing``."""
    total = schedule_length(sizing, num_batches, grad_accum_steps, num_processes, epochs)
    steps_before = np.concatenate([[0], scheduler_steps_per_update(num_batches, grad_accum_steps,
                                                                   num_processes, epochs)[:-1]])
    return linear_decay(steps_before, total, peak_lr)


def accelerate_lr_trace(num_batches: int, grad_accum_steps: int, total_steps: int, *, epochs: int = 1,
                        peak_lr: float = 0.1, cpu: bool = True, adjust_scheduler: bool = True) -> list[float]:
    """Run a real prepared optimizer + scheduler with ``accumulate()``; the lr of each real update.

    ``adjust_scheduler`` is Accelerate's ``GradientAccumulationPlugin`` option of that name
    (its default, True). Runs in the calling process (call it inside a launched function for
    several processes).
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    if not isinstance(adjust_scheduler, bool):
        raise TypeError(f"adjust_scheduler must be a bool, got {type(adjust_scheduler).__name__}")
    plugin = GradientAccumulationPlugin(num_steps=grad_accum_steps, adjust_scheduler=adjust_scheduler)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin, cpu=cpu)
    return _lr_of_each_update(accelerator, num_batches, epochs, peak_lr,
                              lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
                                  optimizer, lambda s: max(0.0, 1.0 - s / total_steps)))


def _lr_of_each_update(accelerator, num_batches: int, epochs: int, peak_lr: float, make_scheduler) -> list[float]:
    """Train a one-weight model through ``accumulate()`` with a prepared scheduler; the lr each update uses."""
    import torch

    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr)
    scheduler = make_scheduler(optimizer)
    loader = torch.utils.data.DataLoader(torch.ones(num_batches, 1), batch_size=1)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    used = []
    for _ in range(epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                if accelerator.sync_gradients:
                    used.append(scheduler.get_last_lr()[0])  # the lr this update is about to use
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return used


def one_cycle_lrs(num_batches: int, grad_accum_steps: int, *, honour_adjust_scheduler: bool) -> list[float]:
    """Learning rate of each update of a OneCycle schedule sized in updates, one process, ``accumulate()``.

    ``honour_adjust_scheduler=True`` sets the flag Accelerate 1.16 drops
    (``GradientAccumulationPlugin(adjust_scheduler=True)`` is read as False) directly in the
    gradient state, to show what the option would do. Leaves no Accelerator behind.
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    from gaccum_launch import reset_accelerate_state

    check_int("num_batches", num_batches, minimum=1)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    if not isinstance(honour_adjust_scheduler, bool):
        raise TypeError(f"honour_adjust_scheduler must be a bool, got {type(honour_adjust_scheduler).__name__}")
    reset_accelerate_state(quiet=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=grad_accum_steps, adjust_scheduler=True))
    if honour_adjust_scheduler:
        accelerator.gradient_state.plugin_kwargs["adjust_scheduler"] = True
    updates = math.ceil(num_batches / grad_accum_steps)
    used = _lr_of_each_update(accelerator, num_batches, 1, 0.1, lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=0.1, total_steps=updates))
    reset_accelerate_state(quiet=True)
    return used
