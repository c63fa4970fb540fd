"""Which micro-batches each process sees, as Accelerate's prepared DataLoader decides it.

Accelerate (``split_batches=False``, the default) deals whole batches round-robin: with
two processes, rank 0 gets batches 0, 2, 4, ... and rank 1 gets 1, 3, 5, ...  When the
batches do not fill the last round, ``even_batches=True`` (the default) tops the round up
with examples from the start of the dataset, so every rank gets the same number of full
batches -- and the "full batch" of that step then contains duplicates.
``even_batches=False`` leaves the ranks with unequal shares instead.

These functions work on example *indices*, so the simulator, the plots and the tests can
all see the assignment. ``tests/test_sharding.py`` checks them against Accelerate's own
``BatchSamplerShard`` for many sizes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from ._checks import check_int


def shard_batches(
    batches: list[list[int]], num_processes: int, batch_size: int, *, even_batches: bool = True
) -> list[list[list[int]]]:
    """Split ``batches`` (example-index lists, in DataLoader order) into one list per rank."""
    check_int("num_processes", num_processes, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    if not isinstance(even_batches, bool):
        raise TypeError(f"even_batches must be a bool, got {type(even_batches).__name__}")
    if not batches:
        raise ValueError("batches must hold at least one batch, got 0 (is the dataset empty?)")
    for i, batch in enumerate(batches):
        if not 1 <= len(batch) <= batch_size or (len(batch) < batch_size and i != len(batches) - 1):
            raise ValueError(f"batches[{i}] has {len(batch)} examples; every batch but the last must have "
                             f"batch_size={batch_size}, and the last between 1 and {batch_size}")

    if num_processes == 1:
        # Accelerate's prepare_data_loader only shards (and tops up) when there are several
        # processes: one process iterates the DataLoader as it is, short last batch included.
        return [[list(batch) for batch in batches]]
    shards: list[list[list[int]]] = [[] for _ in range(num_processes)]
    rounds = [batches[i:i + num_processes] for i in range(0, len(batches), num_processes)]
    final = rounds[-1]
    final_is_complete = len(final) == num_processes and len(final[-1]) == batch_size
    for round_ in rounds if final_is_complete else rounds[:-1]:
        for rank, batch in enumerate(round_):
            shards[rank].append(list(batch))
    if final_is_complete:
        return shards

    if not even_batches:
        # Each rank keeps what it was dealt, short batch included; later ranks get nothing.
        for rank, batch in enumerate(final):
            shards[rank].append(list(batch))
        return shards

    # even_batches: complete the round with examples from the start of the dataset.
    # The pool is the examples of the first num_processes batches, repeated until it can
    # fill a whole round (tiny datasets need several copies).
    pool = [i for batch in batches[:num_processes] for i in batch]
    while len(pool) < num_processes * batch_size:
        pool = pool + pool
    taken = 0
    for rank in range(num_processes):
        batch = list(final[rank]) if rank < len(final) else []
        missing = batch_size - len(batch)
        shards[rank].append(batch + pool[taken:taken + missing])
        taken += missing
    return shards


def split_windows(micro_batches: list, grad_accum_steps: int) -> list[list]:
    """Group one rank's micro-batches into optimizer steps of ``grad_accum_steps`` (last may be short)."""
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    return [micro_batches[i:i + grad_accum_steps] for i in range(0, len(micro_batches), grad_accum_steps)]


def plan_windows(
    num_examples_or_batches,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    num_processes: int = 1,
    even_batches: bool = True,
) -> list[list[list[list[int]]]]:
    """The whole plan: ``plan[update][rank]`` is the list of that rank's micro-batches (index lists).

    ``num_examples_or_batches`` is a dataset length (examples are batched in order) or the
    batches themselves. Raises when ranks would disagree on the number of optimizer
    updates: in a real run the rank with more updates would wait forever in an all-reduce.
    """
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    check_int("grad_accum_steps", grad_accum_steps, minimum=1)
    check_int("num_processes", num_processes, minimum=1)
    accepted = "an int (a dataset length) or a list of batches (lists of example indices)"
    if isinstance(num_examples_or_batches, numbers.Integral):  # numpy ints too; check_int refuses a bool
        n = check_int("num_examples", num_examples_or_batches, minimum=1)
        batches = [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]
    elif isinstance(num_examples_or_batches, str | bytes) or not isinstance(num_examples_or_batches, Iterable):
        raise TypeError(f"num_examples_or_batches must be {accepted}, got {type(num_examples_or_batches).__name__} "
                        f"({num_examples_or_batches!r})")
    else:
        batches = list(num_examples_or_batches)
        for i, batch in enumerate(batches):
            if isinstance(batch, str | bytes) or not isinstance(batch, Iterable):
                raise TypeError(f"num_examples_or_batches[{i}] must be a batch (a list of example indices), got "
                                f"{type(batch).__name__} ({batch!r}); num_examples_or_batches must be {accepted}")
        batches = [list(b) for b in batches]
    shards = shard_batches(batches, num_processes, micro_batch_size, even_batches=even_batches)
    per_rank = [split_windows(shard, grad_accum_steps) for shard in shards]
    counts = [len(w) for w in per_rank]
    if len(set(counts)) != 1:
        raise ValueError(
            f"with even_batches=False the ranks get {counts} optimizer updates; a real run would hang "
            "in the all-reduce of the rank that has more. Use even_batches=True or a dataset whose "
            f"batches divide evenly by num_processes={num_processes}"
        )
    return [[per_rank[rank][u] for rank in range(num_processes)] for u in range(counts[0])]
