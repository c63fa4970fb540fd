"""Lesson 10's plumbing (gaccum_course.fsdp_deepspeed) and the facts about FSDP2 and DeepSpeed it rests on."""

import pytest
import torch

from gaccum_course.fsdp_deepspeed import (
    LR,
    NUM_ROWS,
    count_collectives,
    deepspeed_config,
    flat_weights,
    full_batch_weights,
    gradient_elements_held,
    rank_windows,
    regression_mlp,
    regression_rows,
)
from gaccum_launch import launch


def test_windows_are_dealt_as_accelerate_deals_micro_batches():
    x, _ = regression_rows()
    rank1 = rank_windows(2, 4, 1, 2)
    assert len(rank1) == NUM_ROWS // (2 * 4 * 2) and all(len(w) == 2 for w in rank1)
    # Rank 1 gets micro-batches 1, 3, 5, ...: rows 4-7 and 12-15 in its first window.
    assert torch.equal(rank1[0][0][0], x[4:8]) and torch.equal(rank1[0][1][0], x[12:16])
    with pytest.raises(ValueError, match="multiple of grad_accum_steps x micro_batch_size x num_processes = 24"):
        rank_windows(3, 4, 0, 2)
    with pytest.raises(ValueError, match="rank"):
        rank_windows(2, 4, 2, 2)


def test_the_full_batch_is_plain_sgd_on_the_mean_loss():
    weights = full_batch_weights(16)
    assert len(weights) == NUM_ROWS // 16
    model = regression_mlp(16)
    x, y = regression_rows()
    (model(x[:16]).squeeze(-1) - y[:16]).pow(2).mean().backward()
    by_hand = torch.cat([(p - LR * p.grad).detach().reshape(-1).double() for p in model.parameters()])
    torch.testing.assert_close(weights[0], by_hand, rtol=0, atol=1e-7)
    assert torch.equal(full_batch_weights(16)[-1], weights[-1])  # deterministic


def _collectives_and_memory(sync):
    from accelerate.state import PartialState
    from torch.distributed.fsdp import fully_shard

    PartialState(cpu=True)
    model = regression_mlp(8)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    model.set_requires_gradient_sync(sync)
    x, y = regression_rows(4)
    with count_collectives() as calls:
        (model(x).squeeze(-1) - y).pow(2).sum().backward()
        torch.distributed.all_reduce(torch.ones(1))
    return {"calls": dict(calls), "held": gradient_elements_held(model), "numel": flat_weights(model).numel()}


@pytest.mark.real
def test_fsdp2_holds_a_whole_gradient_while_sync_is_off_and_a_shard_when_on():
    off, on = (launch(_collectives_and_memory, (sync,), num_processes=2, quiet=True)[0] for sync in (False, True))
    numel = sum(p.numel() for p in regression_mlp(8).parameters())
    assert off["numel"] == on["numel"] == numel == 121
    assert off["held"] == {"sharded": 0, "unsharded": 121}
    # Each parameter's shard is ceil(rows / 2) rows: 65 elements of 121 on rank 0.
    shard = sum(-(-p.shape[0] // 2) * (p[0].numel() if p.dim() > 1 else 1) for p in regression_mlp(8).parameters())
    assert on["held"] == {"sharded": shard, "unsharded": 0} and shard == 65
    # Three sharded layers: three reduce-scatters when sync is on, none when off; the all_reduce counted too.
    assert on["calls"]["reduce-scatter"] == 3 and "reduce-scatter" not in off["calls"]
    assert on["calls"]["all-reduce"] == off["calls"]["all-reduce"] == 1


def test_count_collectives_puts_torch_distributed_back():
    import torch.distributed as dist

    before = dist.all_reduce
    with count_collectives():
        assert dist.all_reduce is not before
    assert dist.all_reduce is before


def test_deepspeed_clips_to_norm_1_unless_told_so_the_config_says():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    assert GRADIENT_CLIPPING_DEFAULT == 1.0  # what the lesson and deepspeed_config's docstring state
    config = deepspeed_config(4, 2)
    assert config["gradient_clipping"] == 0.0 and config["gradient_accumulation_steps"] == 4
    assert config["train_micro_batch_size_per_gpu"] == 2
    with pytest.raises(ValueError, match="grad_accum_steps"):
        deepspeed_config(0, 2)


def _rank0_shards(widths):
    from accelerate.state import PartialState
    from torch.distributed.fsdp import fully_shard

    state = PartialState(cpu=True)
    held = {}
    for width in widths:
        model = regression_mlp(width)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        x, y = regression_rows(4)
        (model(x).squeeze(-1) - y).pow(2).sum().backward()  # sync on: each rank keeps its shard
        held[width] = gradient_elements_held(model)
    return state.process_index, held


@pytest.mark.real
def test_lesson_10s_memory_plot_rank_0_holds_the_rounded_up_half_of_each_parameter():
    # Lesson 10 measures widths 8 to 64 and states "about half" (within 5 %): the exact rule, ceil(rows / 2) rows
    # of each parameter on rank 0, so the last layer's single row stays whole: w^2 / 2 + 4w + 1 of w^2 + 7w + 1.
    widths = (8, 16, 32, 64)
    rank, held = launch(_rank0_shards, (widths,), num_processes=2, quiet=True)[0]
    assert rank == 0
    for w in widths:
        size = sum(p.numel() for p in regression_mlp(w).parameters())
        assert size == w * w + 7 * w + 1
        assert held[w] == {"sharded": w * w // 2 + 4 * w + 1, "unsharded": 0}
        assert 0.5 <= held[w]["sharded"] / size < 0.55
