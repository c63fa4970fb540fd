"""The collective calls of the simulated ranks: a barrier that every rank reaches, then one combine.

Each rank deposits its value and waits; the last rank to arrive combines the values while the
others wait, so a rank that raises (or calls something else) cannot leave the others hanging.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Callable

import torch

# A toy step takes milliseconds; a rank that waits this long at a collective call waits for
# a rank that will never come (it is stuck in the user's code).
COLLECTIVE_TIMEOUT_S = 60.0


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
        self.num_processes = num_processes
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
        if self.num_processes == 1:  # nobody to wait for
            return combine([value])
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
