"""GRPO's loss types under gradient accumulation, measured (gaccum_lib.rl_losses; lesson 11).

The figures are pinned as measured on CPU (torch 2.13, transformers 5, float32): the exact ones
to rounding (< 1e-6), the drifting ones to 3 significant digits.
"""

import pytest
import torch

from gaccum_lib.rl_losses import (
    LOSS_TYPES,
    aggregate,
    distance_table,
    full_batch_gradient,
    generation_batch,
    group_advantages,
    relative_distance,
    steps_per_generation_table,
    tiny_policy,
    update_gradients,
    versus_token_mean,
)

pytest.importorskip("transformers")
EXACT = ("grpo", "dr_grpo", "dapo")
# bnpo's distance from its own full batch, keyed (GA, P), as measured.
BNPO = {(1, 1): 0.0, (1, 2): 0.251, (2, 1): 0.251, (2, 2): 0.458, (4, 1): 0.458, (4, 2): 0.477, (8, 1): 0.477,
        (8, 2): 0.883}


@pytest.fixture(scope="module")
def table():
    return {(r["loss_type"], r["grad_accum_steps"], r["num_processes"]): r for r in distance_table()}


@pytest.fixture(scope="module")
def setup():
    return tiny_policy(), generation_batch()


def test_the_generation_batch_has_different_lengths_and_group_normalised_advantages():
    batch = generation_batch()
    assert batch.num_sequences == 16 and batch.max_completion_length == 8
    assert batch.completion_mask.sum(1).tolist() == [1, 5, 3, 2, 7, 8, 8, 7, 1, 2, 6, 2, 6, 1, 2, 5]
    assert int(batch.completion_mask.sum()) == 66
    groups = batch.advantages.view(4, 4)
    assert groups.mean(1).abs().max() < 1e-6
    assert torch.allclose(groups.std(1), torch.ones(4), atol=1e-3)  # 1 up to the 1e-4 in the denominator
    # every member of a group shares its prompt
    prompts = batch.input_ids[:, :batch.prompt_length].view(4, 4, -1)
    assert (prompts == prompts[:, :1]).all()


def test_the_table_covers_every_setting_with_its_micro_batch_size(table):
    assert len(table) == 4 * 4 * 2
    assert table[("dapo", 8, 2)]["micro_batch_size"] == 1
    assert table[("grpo", 2, 1)]["micro_batch_size"] == 8


@pytest.mark.parametrize("loss_type", EXACT)
def test_grpo_dr_grpo_and_dapo_equal_their_own_full_batch_at_every_ga_and_p(table, loss_type):
    # grpo: a mean of equal-sized means is the mean; dr_grpo: a per-sequence constant; dapo: one global count.
    distances = [r["distance"] for (t, _, _), r in table.items() if t == loss_type]
    assert len(distances) == 8 and max(distances) < 1e-6


@pytest.mark.parametrize(("ga", "processes"), sorted(BNPO))
def test_bnpo_drifts_as_measured(table, ga, processes):
    measured = table[("bnpo", ga, processes)]["distance"]
    assert measured == pytest.approx(BNPO[(ga, processes)], abs=5e-4)


def test_bnpo_drift_depends_on_the_micro_batches_not_on_how_they_are_spread(table):
    # GA 2 on 1 process and GA 1 on 2 processes make the same micro-batches: the same drift.
    for ga in (1, 2, 4):
        assert table[("bnpo", 2 * ga, 1)]["distance"] == pytest.approx(table[("bnpo", ga, 2)]["distance"], abs=1e-6)
    # and it grows with the number of micro-batches
    ranked = [table[("bnpo", ga, p)]["distance"] for ga, p in ((1, 1), (2, 1), (4, 1), (8, 1), (8, 2))]
    assert ranked == sorted(ranked)
    assert min(ranked[1:]) > 0.2 > 1e-6 > max(table[(t, 8, 2)]["distance"] for t in EXACT)


def test_bnpo_on_one_sequence_per_micro_batch_is_grpo(table):
    # Each micro-batch normalised by its own tokens, one sequence each: a mean of per-sequence means.
    grpo_vs_token_mean = versus_token_mean()["grpo"]["distance"]
    assert table[("bnpo", 8, 2)]["distance"] == pytest.approx(grpo_vs_token_mean, abs=1e-6)


def test_exact_is_not_the_same_objective():
    found = versus_token_mean()
    assert found["bnpo"]["distance"] < 1e-6  # one micro-batch: bnpo is the token mean
    assert found["dr_grpo"]["cosine"] == pytest.approx(1.0, abs=1e-6)  # the token mean's direction ...
    assert found["dr_grpo"]["distance"] == pytest.approx(1 - 66 / (16 * 8), abs=1e-6)  # ... scaled by N / (B x L)
    assert found["grpo"]["distance"] == pytest.approx(0.883, abs=5e-4)
    assert found["grpo"]["cosine"] == pytest.approx(0.763, abs=5e-4)


@pytest.fixture(scope="module")
def split_generation():
    return {r["loss_type"]: r for r in steps_per_generation_table()}


def test_more_steps_per_generation_shrink_each_dapo_update_by_its_windows_share(split_generation):
    dapo = split_generation["dapo"]
    assert dapo["updates"] == 2
    assert dapo["window_shares"] == pytest.approx([41 / 66, 25 / 66])
    assert dapo["scales"] == pytest.approx(dapo["window_shares"], abs=1e-6)
    assert dapo["distances"] == pytest.approx([1 - s for s in dapo["window_shares"]], abs=1e-6)
    assert dapo["sum_distance"] < 1e-6  # together the updates are the generation batch's step
    # Counting dapo's tokens per window makes each update its window's full batch again.
    assert max(split_generation["dapo (window count)"]["distances"]) < 1e-6


def test_more_steps_per_generation_keep_mean_type_updates_full_sized(split_generation):
    for loss_type in ("grpo", "dr_grpo"):
        row = split_generation[loss_type]
        assert max(row["distances"]) < 1e-6
        assert row["sum_distance"] == pytest.approx(1.0, abs=1e-6)  # two full-sized steps, twice one
    assert split_generation["bnpo"]["distances"] == pytest.approx([0.591, 0.125], abs=5e-4)


def test_two_calls_give_the_same_numbers(table):
    again = distance_table(loss_types=("bnpo",), grad_accum_steps=(4,), num_processes=(1,))
    assert again[0]["distance"] == table[("bnpo", 4, 1)]["distance"]
    assert generation_batch().input_ids.equal(generation_batch().input_ids)


def test_dapo_on_one_micro_batch_is_its_full_batch(setup):
    policy, batch = setup
    (update,) = update_gradients(policy, batch, "dapo", grad_accum_steps=1)
    assert relative_distance(update["gradient"], full_batch_gradient(policy, batch, "dapo")) == 0.0


# ----------------------------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"grad_accum_steps": 3}, ValueError, r"steps_per_generation x num_processes=3 must divide the 16 sequences"),
    ({"grad_accum_steps": 0}, ValueError, r"grad_accum_steps must be in \[1, 64\], got 0"),
    ({"grad_accum_steps": 2.0}, TypeError, "grad_accum_steps must be an int, got float"),
    ({"num_processes": 0}, ValueError, r"num_processes must be in \[1, 64\], got 0"),
    ({"steps_per_generation": 1}, ValueError, r"steps_per_generation must be in \[2, 64\], got 1"),
    ({"steps_per_generation": 3}, ValueError, "steps_per_generation=3 must be a multiple of grad_accum_steps=2"),
    ({"dapo_count": "global"}, ValueError, "dapo_count must be one of generation, window; got 'global'"),
    ({"loss_type": "ppo"}, ValueError, "loss_type must be one of grpo, bnpo, dr_grpo, dapo; got 'ppo'"),
])
def test_update_gradients_rejects_bad_arguments(setup, kwargs, error, message):
    policy, batch = setup
    arguments = {"loss_type": "dapo", "grad_accum_steps": 2, **kwargs}
    with pytest.raises(error, match=message):
        update_gradients(policy, batch, arguments.pop("loss_type"), **arguments)


def test_the_batch_must_be_a_generation_batch(setup):
    with pytest.raises(TypeError, match="batch must be a GenerationBatch"):
        update_gradients(setup[0], {"input_ids": None}, "dapo", grad_accum_steps=1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_groups": 0}, r"num_groups must be in \[1, 64\], got 0"),
    ({"group_size": 1}, r"group_size must be in \[2, 64\], got 1"),
    ({"max_completion_length": 0}, r"max_completion_length must be in \[1, 64\], got 0"),
])
def test_generation_batch_rejects_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generation_batch(**kwargs)


def test_advantages_need_whole_groups():
    with pytest.raises(ValueError, match="rewards must be 1-D with a multiple of group_size=2 values"):
        group_advantages(torch.rand(5), 2)


def test_dapo_needs_the_window_count_and_loss_types_are_checked():
    tokens, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="num_items_in_batch is needed for loss_type='dapo'"):
        aggregate("dapo", tokens, mask, max_completion_length=3)
    with pytest.raises(ValueError, match=r"loss_types\[0\] must be one of grpo, bnpo, dr_grpo, dapo"):
        distance_table(loss_types=("sapo",))
    assert set(LOSS_TYPES) == {"grpo", "bnpo", "dr_grpo", "dapo"}
