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
from dataclasses import dataclass, field

import numpy as np
import torch

from gaccum_lib.simulate import mean_over_ranks

from . import collective as _collective
from .collective import AccumulationCheckError, Collective, _CollectiveError, _sum_values, processes_text

# The user's step runs for two windows in a row: one window cannot show that gradients (or
# any other state) leak from one optimizer update into the next.
WINDOWS = 2
JOIN_TIMEOUT_S = 2 * _collective.COLLECTIVE_TIMEOUT_S



class _Rank:
    """One rank's model, gradient bookkeeping and collectives, and what its step did (:class:`WindowRecord`)."""

    def __init__(self, rank: int, model, collective: Collective):
        self.rank, self.collective = rank, collective
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.in_no_sync = False
        self.unsynced = False  # a backward outside no_sync added gradients since the last all-reduce
        # Each gradient as the last backward or all-reduce left it (the tensor and its in-place version
        # counter): anything that edits it before optimizer.step() (a clip) changes one of the two.
        self.left: dict[int, tuple] = {}
        self.synced: list | None = None  # the gradients right after the last all-reduce, while no backward followed
        self.record = WindowRecord()
        self._reached: set | None = None  # the parameters the current backward pass has reached (None: it ended)
        self.autocast: set = set()  # (device type, dtype) of every autocast the model's forward ran under
        self.devices = sorted({"cpu"} | {p.device.type for p in self.params})
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_accumulated)
        model.register_forward_pre_hook(self._forward_started)

    def _grad_accumulated(self, param) -> None:
        if not self.in_no_sync:
            self.unsynced = True
        self.left[id(param)] = (param.grad, param.grad._version)
        self.synced = None
        # A backward pass calls this once for each parameter it reaches: a parameter seen again starts the next one.
        if self._reached is None or not self.record.events.endswith("B") or id(param) in self._reached:
            self.record.event("B")
            self._reached = set()
        self._reached.add(id(param))

    def _forward_started(self, _module, _inputs) -> None:
        # Autocast is thread-local: this hook runs in the rank's thread, inside the step's own context.
        for device in self.devices:
            if torch.is_autocast_enabled(device):
                self.autocast.add((device, torch.get_autocast_dtype(device)))

    def gradients_edited(self) -> bool:
        """Whether a gradient changed in place (or was replaced) since the last backward or all-reduce."""
        def unchanged(p):
            tensor, version = self.left.get(id(p), (None, None))
            return tensor is p.grad and version == p.grad._version

        return any(p.grad is not None and not unchanged(p) for p in self.params)

    def _remember_gradients(self, synced) -> None:
        self.left = {id(p): (p.grad, p.grad._version) for p in self.params if p.grad is not None}
        self.synced = synced

    def sync(self) -> None:
        """DDP's all-reduce: every rank's gradients become their average over the ranks."""
        grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        if self.collective.num_processes == 1:  # the average of one rank: nothing to exchange
            self.unsynced = False
            self._remember_gradients(grads)
            return
        means = self.collective.exchange(self.rank, "gradient all-reduce", grads, mean_over_ranks)
        with torch.no_grad():
            for p, mean in zip(self.params, means, strict=True):
                if mean is not None:
                    p.grad = mean.clone() if p.grad is None else p.grad.copy_(mean)
        self.unsynced = False
        self._remember_gradients(means)


@dataclass
class WindowRecord:
    """What one rank's step did in one window, in the order it did it."""

    events: str = ""  # B: a backward added gradients, Z: optimizer.zero_grad(), S: optimizer.step()
    gradient: np.ndarray | None = None  # the gradient handed to the first optimizer.step()
    # The gradient after the window's last all-reduce, when the step edited it before optimizer.step() (a clip).
    before_edit: np.ndarray | None = None
    edited: bool = False  # the gradient changed between the last backward (or all-reduce) and optimizer.step()
    edited_before_sync: bool = False  # ... and before its all-reduce: a plain backward on several ranks
    settings: list = field(default_factory=list)  # param_groups (without params) when the window began
    settings_at_step: list | None = None  # ... when optimizer.step() was called

    def event(self, kind: str) -> None:
        self.events += kind

    @property
    def steps(self) -> int:
        return self.events.count("S")

    @property
    def zero_grads(self) -> int:
        return self.events.count("Z")


def optimizer_settings(param_groups) -> list[dict]:
    """Each param group's settings (lr, momentum, betas, ...): everything but its parameters, copied."""
    return [{k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
             for k, v in group.items() if k != "params"} for group in param_groups]


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
        self._rank._reached = None  # the next backward is another pass, whichever parameters it reaches
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


class RankOptimizer(torch.optim.Optimizer):
    """The optimizer ``step`` receives: the chosen optimizer, recording what is done with it.

    It counts ``step()`` and ``zero_grad()`` calls, and records the gradient it is handed (after
    DDP's averaging, if a plain backward left some pending). It is a ``torch.optim.Optimizer``
    (as Accelerate's ``AcceleratedOptimizer`` is) so that a learning-rate scheduler can be built
    on it; everything else is the inner optimizer's.
    """

    def __init__(self, inner, rank: _Rank):  # no super().__init__(): the inner optimizer holds the state
        self._inner, self._rank = inner, rank

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    @property
    def defaults(self):
        return getattr(self._inner, "defaults", {})

    def __getattr__(self, name):  # anything else of the real optimizer
        if name in ("_inner", "_rank"):  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self._inner.add_param_group(param_group)

    def step(self, closure=None) -> None:
        if closure is not None:
            raise TypeError("optimizer.step(closure): the checked optimizer takes no closure; call step() "
                            "after the window's backward passes")
        rank, record = self._rank, self._rank.record
        record.event("S")
        if record.steps == 1:
            self._record_first_step(rank, record)
        elif rank.unsynced:
            rank.sync()
        self._inner.step()

    def _record_first_step(self, rank: _Rank, record: WindowRecord) -> None:
        pending = rank.unsynced  # a plain backward's gradients, averaged only now
        edited = rank.gradients_edited()
        synced = rank.synced
        if pending:
            rank.sync()
        record.gradient = flat_grads(rank.params)
        record.edited = edited
        record.edited_before_sync = edited and pending and rank.collective.num_processes > 1
        if edited and synced is not None:
            record.before_edit = flat_tensors(synced, rank.params)
        record.settings_at_step = optimizer_settings(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._rank.record.event("Z")
        self._inner.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"RankOptimizer(rank={self._rank.rank}, {self._inner!r})"


def flat(params) -> np.ndarray:
    """All parameters as one float64 vector (a copy)."""
    # One conversion a parameter and one concatenation (not four conversions and numpy's): flat runs on every rank.
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in params]).numpy()


def flat_grads(params) -> np.ndarray:
    return flat_tensors([p.grad for p in params], params)


def flat_tensors(tensors, params) -> np.ndarray:
    """Tensors shaped like ``params`` (None: zeros) as one float64 vector."""
    return torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if t is None
                      else t.detach().reshape(-1).to("cpu", torch.float64)
                      for t, p in zip(tensors, params, strict=True)]).numpy()


@dataclass
class RankRun:
    """Every rank's weights and records after each window (``weights[window, rank]``, ``records[window][rank]``)."""

    weights: np.ndarray
    records: list
    autocast: set  # (device type, dtype) pairs the models' forwards ran under, on any rank
    models: list

    @property
    def steps(self) -> np.ndarray:
        return np.array([[r.steps for r in window] for window in self.records])


def run_ranks(step, models, shards, loss_fn, make_optimizer, grad_accum_steps) -> RankRun:
    """Run ``step`` on every rank for each window, each with fresh copies of its micro-batches."""
    num_processes = len(models)
    collective = Collective(num_processes)
    ranks = [_Rank(r, models[r], collective) for r in range(num_processes)]
    optimizers = [RankOptimizer(make_optimizer(ranks[r].params), ranks[r]) for r in range(num_processes)]
    weights = np.zeros((WINDOWS, num_processes, sum(p.numel() for p in ranks[0].params)))
    records = [[None] * num_processes for _ in range(WINDOWS)]
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
                ranks[rank].record = WindowRecord(settings=optimizer_settings(optimizer.param_groups))
                # Fresh copies: a loop that edits its batches (pops labels, shifts in place) works as in training.
                step(models[rank], optimizer, copy.deepcopy(shards[rank]), loss_fn, ctx)
                # Every rank must come back from step at the same point of the collective sequence.
                collective.exchange(rank, "returned from step", None, lambda values: None)
                weights[window, rank] = flat(ranks[rank].params)
                records[window][rank] = ranks[rank].record
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
    return RankRun(weights=weights, records=records, autocast=set().union(*(r.autocast for r in ranks)),
                   models=models)


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
                f"rank {rank} of {num_processes} waited more than {_collective.COLLECTIVE_TIMEOUT_S:g} s at a "
                "collective call (ctx.backward(), optimizer.step() or ctx.all_reduce_sum()) that another rank never "
                "reached") from exc
