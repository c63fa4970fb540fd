"""The simulator's sharding must be Accelerate's: compared with BatchSamplerShard itself."""

import itertools

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

from gaccum_lib import plan_windows, shard_batches


def accelerate_shards(num_examples, batch_size, num_processes, even_batches):
    sampler = BatchSampler(SequentialSampler(range(num_examples)), batch_size=batch_size, drop_last=False)
    return [list(BatchSamplerShard(sampler, num_processes, rank, even_batches=even_batches))
            for rank in range(num_processes)]


def ours(num_examples, batch_size, num_processes, even_batches):
    batches = [list(range(s, min(s + batch_size, num_examples))) for s in range(0, num_examples, batch_size)]
    return shard_batches(batches, num_processes, batch_size, even_batches=even_batches)


CASES = list(itertools.product(range(1, 26), (1, 2, 3, 4), (1, 2, 3, 4), (True, False)))


@pytest.mark.parametrize(("num_examples", "batch_size", "num_processes", "even_batches"),
                         [case for case in CASES if case[2] > 1])
def test_same_batches_as_accelerate(num_examples, batch_size, num_processes, even_batches):
    assert ours(num_examples, batch_size, num_processes, even_batches) == \
        accelerate_shards(num_examples, batch_size, num_processes, even_batches)


@pytest.mark.parametrize("num_examples", range(1, 12))
def test_one_process_keeps_the_dataloader_as_it_is(num_examples):
    """prepare_data_loader shards only for several processes: no top-up, the short batch stays."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from gaccum_lib import reset_accelerate_state

    accelerator = Accelerator(cpu=True)
    try:
        prepared = accelerator.prepare(DataLoader(list(range(num_examples)), batch_size=3))
        seen = [batch.tolist() for batch in prepared]
    finally:
        reset_accelerate_state(quiet=True)
    assert ours(num_examples, 3, 1, True) == [seen]


def test_round_robin_on_two_processes():
    assert ours(16, 4, 2, True) == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]


def test_even_batches_repeats_the_first_examples():
    # 5 examples, batch 2, 2 processes: batches [0,1] [2,3] [4]; the last is topped up with 0,
    # and rank 1 gets a whole new batch made of 1 and 2: duplicates in the "full batch".
    assert ours(5, 2, 2, True) == [[[0, 1], [4, 0]], [[2, 3], [1, 2]]]


def test_plan_groups_windows_and_refuses_a_plan_that_would_hang():
    plan = plan_windows(16, micro_batch_size=4, grad_accum_steps=2, num_processes=2)
    assert plan == [[[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]]
    with pytest.raises(ValueError, match="would hang"):
        plan_windows(12, micro_batch_size=4, grad_accum_steps=1, num_processes=2, even_batches=False)


def test_last_window_can_be_short():
    plan = plan_windows(10, micro_batch_size=2, grad_accum_steps=2)
    assert [len(window[0]) for window in plan] == [2, 2, 1]
