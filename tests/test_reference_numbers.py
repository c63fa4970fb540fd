"""Every reference figure of the seed document, through the library (simulator)."""

import numpy as np
import pytest

from gaccum_lib import seed_sequences, simulate, toy_regression

PRINTED = 5e-5  # the seed prints 4 decimals: agree to within half a unit of the last digit
EXACT = 1e-6  # correct accumulation vs full batch: rounding only


def test_toy_regression_accumulated_equals_full_batch_2_04():
    problem = toy_regression()
    accumulated = simulate(problem, "mean_of_means", grad_accum_steps=4, micro_batch_size=2, lr=0.02)
    full = simulate(problem, "full_batch", grad_accum_steps=4, micro_batch_size=2, lr=0.02)
    assert accumulated.initial_weights[0] == 0.0
    assert accumulated.final_weights[0] == pytest.approx(2.04, abs=1e-6)
    assert full.final_weights[0] == pytest.approx(2.04, abs=1e-6)
    assert accumulated.max_difference(full) < EXACT


def test_toy_regression_without_dividing_by_ga_is_four_times_the_step():
    problem = toy_regression()
    forgot = simulate(problem, "sum_of_means", grad_accum_steps=4, micro_batch_size=2, lr=0.02)
    assert forgot.final_weights[0] == pytest.approx(8.16, abs=1e-5)
    assert forgot.final_weights[0] / 2.04 == pytest.approx(4.0, abs=1e-5)


def test_initial_weights_of_the_sequence_toy():
    trajectory = simulate(seed_sequences(8), "full_batch", grad_accum_steps=2, micro_batch_size=4)
    np.testing.assert_allclose(trajectory.initial_weights, [-0.0075, 0.5364], atol=PRINTED)


def test_one_process_token_normalised_36_items_equals_full_batch():
    problem = seed_sequences(8)
    token = simulate(problem, "token_normalised", grad_accum_steps=2, micro_batch_size=4)
    full = simulate(problem, "full_batch", grad_accum_steps=2, micro_batch_size=4)
    assert token.token_counts.tolist() == [[36]]
    np.testing.assert_allclose(token.final_weights, [0.0953, 0.4337], atol=PRINTED)
    assert token.max_difference(full) < EXACT


def test_two_processes_token_normalised_52_84_136_equals_full_batch_on_both_ranks():
    problem = seed_sequences(16)
    token = simulate(problem, "token_normalised", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    full = simulate(problem, "full_batch", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    assert token.token_counts.tolist() == [[52, 84]]
    assert token.window_tokens.tolist() == [136]
    for rank_weights in token.rank_final_weights:
        np.testing.assert_allclose(rank_weights, [0.2117, 0.3172], atol=PRINTED)
    assert token.max_difference(full) < EXACT


def test_naive_one_process():
    naive = simulate(seed_sequences(8), "mean_of_means", grad_accum_steps=2, micro_batch_size=4)
    np.testing.assert_allclose(naive.final_weights, [0.0775, 0.4514], atol=PRINTED)


def test_naive_two_processes_same_on_both_ranks():
    naive = simulate(seed_sequences(16), "mean_of_means", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    for rank_weights in naive.rank_final_weights:
        np.testing.assert_allclose(rank_weights, [0.1622, 0.3668], atol=PRINTED)


def test_naive_ga8_micro_batch_1():
    naive = simulate(seed_sequences(8), "mean_of_means", grad_accum_steps=8, micro_batch_size=1)
    np.testing.assert_allclose(naive.final_weights, [0.0666, 0.4623], atol=PRINTED)


def test_naive_drifts_further_from_full_batch_as_ga_grows():
    """The 2024 Trainer bug in miniature: more accumulation steps, more error."""
    problem = seed_sequences(8)
    full = simulate(problem, "full_batch", grad_accum_steps=1, micro_batch_size=8)
    errors = [simulate(problem, "mean_of_means", grad_accum_steps=ga, micro_batch_size=8 // ga).max_difference(full)
              for ga in (1, 2, 4, 8)]
    assert errors[0] < EXACT
    assert errors[1] < errors[2] < errors[3]


def test_toy_regression_loss_sum_and_count_is_the_mean_squared_error():
    """Lesson 00 divides loss_sum_and_count's sum by its count: that is torch's mean squared error."""
    import torch

    problem = toy_regression()
    model = problem.make_model()
    x_all, y_all = problem.batch_of(range(8))
    loss_sum, n = problem.loss_sum_and_count(model, (x_all, y_all))
    assert n == 8
    assert torch.isclose(loss_sum / n, torch.nn.functional.mse_loss(model(x_all), y_all))
