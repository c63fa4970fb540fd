"""The same training as the simulator, for real: ``Accelerator``, DDP, gather, ``no_sync``.

:func:`accelerate_train` is the training function a launched process runs (it also runs
as a plain script under ``torchrun`` / ``accelerate launch``, see
``examples/train_accumulation.py``). :func:`real_run` launches it in N processes and
returns a :class:`~gaccum_lib.simulate.Trajectory` built from every rank's record, so it
can be compared number for number with :func:`~gaccum_lib.simulate.simulate`.

The loop is the window-first loop that correct token normalisation needs: fetch the
whole window of micro-batches, count its targets, gather the count over the ranks, then
run every micro-batch, skipping the all-reduce (``no_sync``) on all but the last one.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import math
from pathlib import Path

import numpy as np
import torch

from gaccum_launch import gpu_count, launch

from ._checks import check_choice
from .data import Problem, make_problem
from .sharding import plan_windows
from .simulate import Trajectory, check_training_args, flat_weights
from .strategies import accelerate_backward_loss, check_strategy

# How each micro-batch of a window decides whether to all-reduce its gradients.
SYNC_MODES = {
    "no_sync": "forward and backward inside model.no_sync() for all but the window's last micro-batch",
    "every_step": "no no_sync at all: an all-reduce after every micro-batch (correct, slower)",
    "accumulate": "accelerator.accumulate(model) decides",
    "backward_only": "pitfall: only the backward inside no_sync(), the forward outside",
    "inverted": "pitfall: no_sync() on the last micro-batch, sync on the others",
}


def fresh_accelerator(**kwargs):
    """A new single-process ``Accelerator`` in this kernel, forgetting any earlier one.

    Accelerate keeps its state in process-wide singletons, so a second ``Accelerator`` with a
    different ``gradient_accumulation_steps`` would otherwise share the first one's state.
    Defaults to ``cpu=True`` so the kernel never touches CUDA (a later launch could not fork).
    """
    from accelerate import Accelerator

    from gaccum_launch import reset_accelerate_state

    reset_accelerate_state(quiet=True)
    kwargs.setdefault("cpu", True)
    return Accelerator(**kwargs)


def _sync_context(sync_mode, accelerator, model, is_last):
    if accelerator.num_processes == 1 or sync_mode == "every_step":
        return contextlib.nullcontext()
    if sync_mode == "accumulate":
        return accelerator.accumulate(model)
    if sync_mode == "backward_only":
        return contextlib.nullcontext()  # the forward runs outside no_sync; see the backward below
    if sync_mode == "inverted":
        return model.no_sync() if is_last else contextlib.nullcontext()
    return contextlib.nullcontext() if is_last else model.no_sync()


def inner_module(model):
    """The model inside DDP's wrapper, for measurement. ``accelerator.unwrap_model`` gives the same, but
    first imports DeepSpeed wherever it is installed (to check for its engine): 0.7 s in every process."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def count_allreduce_rounds(model) -> dict:
    """Count the gradient all-reduce rounds of a DDP ``model``: returns a counter that the training updates.

    A DDP communication hook that all-reduces as usual and counts. For a model that is not wrapped
    in DDP (one process) nothing is ever all-reduced and the counter stays at 0.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter = {"rounds": 0, "buckets": 0}
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return counter

    def counting_hook(process_group, bucket):
        counter["buckets"] += 1
        if bucket.index() == 0:  # one all-reduce round may use several buckets: count rounds once
            counter["rounds"] += 1
        return allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, counting_hook)
    return counter


def accelerate_train(problem_spec: dict, strategy: str, *, grad_accum_steps: int, micro_batch_size: int,
                     lr: float = 0.08, epochs: int = 1, sync_mode: str = "no_sync", even_batches: bool = True,
                     cpu: bool | None = None, verbose: bool = False) -> dict:
    """Train with Accelerate in this process (one rank of a launch); return this rank's record."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import InitProcessGroupKwargs

    problem = make_problem(problem_spec)
    check_strategy(strategy, allow_full_batch=False)
    check_training_args(problem, grad_accum_steps, micro_batch_size, 1, lr, epochs)
    check_choice("sync_mode", sync_mode, tuple(SYNC_MODES))

    accelerator = Accelerator(
        gradient_accumulation_steps=grad_accum_steps,
        cpu=cpu if cpu is not None else gpu_count() == 0,
        dataloader_config=DataLoaderConfiguration(even_batches=even_batches),
        # A rank that waits for a crashed peer gives up after a minute instead of 30.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))],
    )
    world = accelerator.num_processes
    # Fail before training if the ranks would disagree on the number of updates (a hang).
    plan_windows(len(problem), micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                 num_processes=world, even_batches=even_batches)

    model = problem.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(problem, batch_size=micro_batch_size, collate_fn=problem.collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    counter = count_allreduce_rounds(model)

    weights = [flat_weights(inner_module(model))]
    local_counts, window_counts, losses, logged_losses, rounds_per_update = [], [], [], [], []
    for _ in range(epochs):
        batches = iter(loader)
        for _update in range(math.ceil(len(loader) / grad_accum_steps)):
            # Fetch the whole window first: its target count must be known before any backward.
            window = list(itertools.islice(batches, grad_accum_steps))
            local_terms = sum(problem.count_targets(b) for b in window)
            window_terms = int(accelerator.gather(torch.tensor([local_terms], device=accelerator.device)).sum())
            rounds_before = counter["rounds"]
            loss_sum_local, logged_local = 0.0, 0.0
            for i, batch in enumerate(window):
                with _sync_context(sync_mode, accelerator, model, is_last=i == len(window) - 1):
                    loss_sum, num_terms = problem.loss_sum_and_count(model, batch)
                    loss = accelerate_backward_loss(
                        strategy, loss_sum, num_terms, window_terms=window_terms, local_window_terms=local_terms,
                        grad_accum_steps=grad_accum_steps, num_processes=world)
                    if sync_mode == "backward_only" and world > 1 and i < len(window) - 1:
                        with model.no_sync():
                            accelerator.backward(loss)
                    else:
                        accelerator.backward(loss)
                micro_batch_loss = float(loss_sum.detach())  # read back once, used twice
                loss_sum_local += micro_batch_loss
                logged_local += micro_batch_loss / max(num_terms, 1)  # this micro-batch's mean
            optimizer.step()
            optimizer.zero_grad()
            window_loss = accelerator.gather(torch.tensor([loss_sum_local], dtype=torch.float64,
                                                       device=accelerator.device)).sum()
            losses.append(float(window_loss) / window_terms)
            # What the loop itself would log: a naive loop the mean of its micro-batch means, the others sum / N.
            if strategy == "mean_of_means":
                means = accelerator.gather(torch.tensor([logged_local], dtype=torch.float64, device=accelerator.device))
                logged_losses.append(float(means.sum()) / (len(window) * world))
            else:
                logged_losses.append(losses[-1])
            local_counts.append(local_terms)
            window_counts.append(window_terms)
            rounds_per_update.append(counter["rounds"] - rounds_before)
            weights.append(flat_weights(inner_module(model)))
            if verbose:
                print(f"rank {accelerator.process_index}: update {len(losses)} local targets {local_terms} "
                      f"of {window_terms}", flush=True)

    return {
        "rank": accelerator.process_index,
        "num_processes": world,
        "distributed_type": str(accelerator.distributed_type),
        "device": str(accelerator.device),
        "weights": np.stack(weights),
        "losses": np.asarray(losses),
        "logged_losses": np.asarray(logged_losses),
        "local_counts": np.asarray(local_counts, dtype=np.int64),
        "window_counts": np.asarray(window_counts, dtype=np.int64),
        "allreduce_rounds_per_update": np.asarray(rounds_per_update, dtype=np.int64),
    }


class UpdateRecorder:
    """The ``on_update`` callback the lessons hand ``examples/train_causal_lm.py``'s recipe: measurement only.

    Keeps, on this rank, what :func:`trajectory_from_ranks` reads: the flat weights before the first
    update and after each one (a host copy per update: fine for these tiny models, not for a large
    one), the logged loss, this rank's and the update's targets, the gradient norm, the learning
    rate and the all-reduce rounds of each update (a DDP communication hook, set before the first).
    """

    def __init__(self):
        self.record = {"weights": [], "losses": [], "local_counts": [], "window_counts": [], "grad_norms": [],
                       "lrs": [], "allreduce_rounds_per_update": []}
        self._counter, self._rounds_before = None, 0

    def __call__(self, update, accelerator, model, stats):
        if update == 0:
            self._counter = count_allreduce_rounds(model)
            self.record.update(rank=accelerator.process_index, num_processes=accelerator.num_processes,
                               distributed_type=str(accelerator.distributed_type))
        else:
            record = self.record
            record["losses"].append(float(stats["loss"]))
            record["local_counts"].append(int(stats["local_targets"]))
            record["window_counts"].append(int(stats["targets"]))
            record["grad_norms"].append(None if stats["grad_norm"] is None else float(stats["grad_norm"]))
            record["lrs"].append(float(stats["lr"]))
            record["allreduce_rounds_per_update"].append(self._counter["rounds"] - self._rounds_before)
        self._rounds_before = self._counter["rounds"]
        self.record["weights"].append(flat_weights(inner_module(model)))

    def save(self, folder) -> Path:
        """Write this rank's record to ``folder/rank<R>.pt`` (a launcher returns nothing: files carry it back)."""
        path = Path(folder) / f"rank{self.record['rank']}.pt"
        torch.save(self.record, path)
        return path

    @staticmethod
    def load_all(folder) -> list[dict]:
        """Every rank's saved record, rank 0 first."""
        return [torch.load(path, weights_only=False) for path in sorted(Path(folder).glob("rank*.pt"))]


def trajectory_from_ranks(records: list[dict], *, strategy, grad_accum_steps, micro_batch_size, lr) -> Trajectory:
    """Combine the per-rank records of a training function into one :class:`Trajectory`.

    A record is a dict with ``rank``, ``num_processes``, ``distributed_type``, ``weights`` (the
    flat weights before the first update and after each one), ``losses`` and ``local_counts``
    (one per update) and, optionally, ``allreduce_rounds_per_update``: what
    :func:`accelerate_train` returns, and what lesson 05's ``train_causal_lm`` saves.
    """
    records = sorted(records, key=lambda r: r["rank"])
    first = records[0]
    rounds = [r.get("allreduce_rounds_per_update", []) for r in records]
    return Trajectory(
        strategy=strategy, grad_accum_steps=grad_accum_steps, num_processes=first["num_processes"],
        micro_batch_size=micro_batch_size, lr=float(lr), weights=np.asarray(first["weights"]),
        losses=np.asarray(first["losses"]),
        token_counts=np.stack([np.asarray(r["local_counts"]) for r in records], axis=1),
        rank_final_weights=np.stack([np.asarray(r["weights"][-1]) for r in records]),
        source=f"accelerate ({first['distributed_type']}, {len(records)} process(es))",
        extras={"ranks": records, "allreduce_rounds_per_update": np.stack([np.asarray(r) for r in rounds])},
    )


def real_run(problem: Problem, strategy: str, *, grad_accum_steps: int, micro_batch_size: int, num_processes: int = 2,
             lr: float = 0.08, epochs: int = 1, sync_mode: str = "no_sync", even_batches: bool = True,
             device: str = "auto", verbose: bool = False, timeout: float | None = 300.0) -> Trajectory:
    """Launch :func:`accelerate_train` in ``num_processes`` real processes; return the combined trajectory."""
    check_strategy(strategy, allow_full_batch=False)
    check_training_args(problem, grad_accum_steps, micro_batch_size, num_processes, lr, epochs)
    check_choice("sync_mode", sync_mode, tuple(SYNC_MODES))
    plan_windows(len(problem), micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                 num_processes=num_processes, even_batches=even_batches)
    kwargs = dict(grad_accum_steps=grad_accum_steps, micro_batch_size=micro_batch_size, lr=lr, epochs=epochs,
                  sync_mode=sync_mode, even_batches=even_batches, verbose=verbose)
    records = launch(_train_entry, (problem.spec, strategy, kwargs), num_processes=num_processes, device=device,
                     quiet=not verbose, timeout=timeout)
    return trajectory_from_ranks(records, strategy=strategy, grad_accum_steps=grad_accum_steps,
                                 micro_batch_size=micro_batch_size, lr=lr)


def _train_entry(problem_spec, strategy, kwargs):
    return accelerate_train(problem_spec, strategy, **kwargs)

