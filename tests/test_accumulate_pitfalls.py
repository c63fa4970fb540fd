"""Two ways `accelerator.accumulate()` goes wrong, pinned on real processes (lesson 06, pitfalls 18 and 19).

Measured with Accelerate 1.16 and torch 2.13 on CPU (2 processes, gloo). Each test pins what
Accelerate does today, wrong numbers included: when a release changes it, a test here fails and
lesson 06 must say what happens now. The loops are the lesson's, on a `Linear(1, 1)` whose weight
moves on every optimizer step that Accelerate lets through.

* Pitfall 18, a window read ahead, full last window: the canonical loop (`optimizer.step()` and
  `zero_grad()` inside `with accelerator.accumulate(model)`) with windows read ahead by
  `itertools.islice`. Fetching the last window reaches the loader's last batch, which sets its
  `end_of_dataloader` before the window's first backward, and `accumulate()` syncs at the end of
  the data: every micro-batch of that window steps.
* Pitfall 19, an evaluation loop left early: a prepared loader registers in the `GradientState`
  when its iteration starts (`DataLoaderStateMixin.begin`) and unregisters when it ends (`end`,
  after its last batch, not in a `finally`); `GradientState.end_of_dataloader` asks the last one
  registered. An evaluation loop left with `break` closes the iterator without `end()`, so the
  evaluation loader stays on top: the training loop's `accumulate()` misses its epoch's end.
  Accelerate PR #4248 (open) runs `end()` in a `finally`; once it is released, these tests fail.
"""

import contextlib
import itertools

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported once here, not in each forked rank (an optimizer's first use: seconds)
import torch.distributed.tensor  # noqa: F401 - likewise, for DDP's prepare
from accelerate import Accelerator

from gaccum_launch import launch

pytestmark = [pytest.mark.real, pytest.mark.slow]

GA = 4
CHANGED = "Accelerate changed how accumulate() {}: lesson 06's pitfall {} must say what happens now"


def _prepared(num_batches, *extra_loaders):
    """An Accelerator at GA 4, a prepared Linear(1, 1) with SGD, and num_batches micro-batches on each rank."""
    accelerator = Accelerator(gradient_accumulation_steps=GA)
    model = torch.nn.Linear(1, 1)
    weight, optimizer = model.weight, torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.ones(accelerator.num_processes * num_batches, 1))
    prepared = accelerator.prepare(model, optimizer, loader, *extra_loaders)
    return accelerator, weight, prepared


def _canonical_step(accelerator, model, optimizer, weight, batch) -> bool:
    """One micro-batch of the canonical loop; whether the weights moved."""
    with accelerator.accumulate(model):
        before = weight.item()
        accelerator.backward(model(batch).sum())
        optimizer.step()
        optimizer.zero_grad()
    return weight.item() != before


def _read_ahead(loop: str, num_batches: int = 8) -> list[int]:
    """The micro-batches after which the weights moved, for one of lesson 06's loops (pitfalls 16 and 18)."""
    accelerator, weight, (model, optimizer, loader) = _prepared(num_batches)
    batches, stepped, i = iter(loader), [], -1
    if loop == "one batch at a time":
        return [i for i, batch in enumerate(batches) if _canonical_step(accelerator, model, optimizer, weight, batch)]
    while window := list(itertools.islice(batches, GA)):
        for j, batch in enumerate(window):
            i += 1
            if loop == "read ahead":  # the canonical loop: step inside accumulate()
                stepped += [i] if _canonical_step(accelerator, model, optimizer, weight, batch) else []
                continue
            last = j == len(window) - 1
            if loop == "lesson 04":  # accumulate() around each micro-batch, one step after the window
                sync = accelerator.accumulate(model)
            else:  # "synced by hand": the fix
                sync = contextlib.nullcontext() if last else accelerator.no_sync(model)
            with sync:
                accelerator.backward(model(batch).sum())
            if last:
                before = weight.item()
                optimizer.step()
                optimizer.zero_grad()
                stepped += [i] if weight.item() != before else []
    return stepped


def test_a_full_last_window_read_ahead_steps_on_every_micro_batch_of_it():
    stepped = {loop: launch(_read_ahead, (loop,), num_processes=2, quiet=True)
               for loop in ("one batch at a time", "read ahead", "synced by hand", "lesson 04")}
    assert all(ranks[0] == ranks[1] for ranks in stepped.values()), stepped
    assert stepped["one batch at a time"][0] == [3, 7]
    assert stepped["read ahead"][0] == [3, 4, 5, 6, 7], CHANGED.format("sees a window read ahead", 18)
    assert stepped["synced by hand"][0] == [3, 7]  # the fix
    # lesson 04's loop steps once a window: there the end of the data costs all-reduces, not steps
    assert stepped["lesson 04"][0] == [3, 7]


def _evaluate(model, eval_loader, leave_early):
    with torch.no_grad():
        for batch in eval_loader:
            model(batch)
            if leave_early:
                break


def _train_and_evaluate(leave_early: bool, prepare_eval: bool = True, num_batches: int = 10) -> list:
    """(epoch, micro-batch) of every update of the canonical loop, with one evaluation after micro-batch 4."""
    eval_loader = torch.utils.data.DataLoader(torch.ones(16, 1))
    accelerator, weight, prepared = _prepared(num_batches, *([eval_loader] if prepare_eval else []))
    model, optimizer, loader = prepared[:3]
    eval_loader = prepared[3] if prepare_eval else eval_loader
    updates = []
    for epoch in range(2):
        for i, batch in enumerate(loader):
            if _canonical_step(accelerator, model, optimizer, weight, batch):
                updates.append((epoch, i))
            if (epoch, i) == (0, 4):
                _evaluate(model, eval_loader, leave_early)
    return updates


RIGHT = [(0, 3), (0, 7), (0, 9), (1, 3), (1, 7), (1, 9)]


def test_an_evaluation_loop_left_early_shifts_the_training_updates():
    updates = {case: launch(_train_and_evaluate, case, num_processes=2, quiet=True)
               for case in ((True,), (False,), (True, False))}
    assert all(ranks[0] == ranks[1] for ranks in updates.values()), updates
    assert updates[(False,)][0] == RIGHT  # run to its end
    assert updates[(True, False)][0] == RIGHT  # left early, but the loader was not prepared
    assert updates[(True,)][0] == [(0, 3), (0, 7), (1, 1), (1, 5), (1, 9)], \
        CHANGED.format("sees a loader left early", 19)


def _registered_after_evaluation(leave_early: bool) -> tuple[bool, bool]:
    accelerator, _, (model, _, loader, eval_loader) = _prepared(4, torch.utils.data.DataLoader(torch.ones(4, 1)))
    state = accelerator.gradient_state
    for i, _batch in enumerate(loader):
        if i == 1:
            _evaluate(model, eval_loader, leave_early)
            on_top = state.active_dataloader is eval_loader
        at_the_end = state.end_of_dataloader
    return on_top, at_the_end


def test_the_cause_a_loader_left_early_stays_registered_on_top_of_the_training_loader():
    # One process is enough: the registration is each process's own (GradientState, a per-process singleton).
    left_early = launch(_registered_after_evaluation, (True,), num_processes=1, quiet=True)[0]
    run_through = launch(_registered_after_evaluation, (False,), num_processes=1, quiet=True)[0]
    assert run_through == (False, True)  # unregistered: at its last batch the training loader says "end"
    assert left_early == (True, False), CHANGED.format("sees a loader left early", 19)
