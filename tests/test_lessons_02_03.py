"""Claims of lessons 02 and 03 that their prose states and their cells do not re-check in plain sight."""

import pytest

from gaccum_lib import compare_strategies, sequence_corpus, simulate, toy_regression


@pytest.mark.parametrize("lr", [0.001, 0.002, 0.005])
def test_02_the_short_last_window_takes_half_the_full_batch_step_at_any_learning_rate(lr):
    # 20 points, micro-batches of 2, GA 4: windows of 4, 4 and 2 micro-batches.
    kwargs = dict(grad_accum_steps=4, micro_batch_size=2, lr=lr)
    full, naive = (simulate(toy_regression(num_points=20), s, **kwargs).weights[:, 0]
                   for s in ("full_batch", "mean_of_means"))
    assert abs(full[2] - naive[2]) < 1e-6  # the same weight before the short window
    assert (naive[3] - naive[2]) / (full[3] - full[2]) == pytest.approx(0.5, abs=1e-4)


def test_02_at_lr_0_02_the_large_points_overshoot_further_than_they_started():
    full = simulate(toy_regression(num_points=20), "full_batch", grad_accum_steps=4, micro_batch_size=2,
                    lr=0.02).weights[:, 0]
    assert abs(full[3] - 2) > abs(full[2] - 2)
    stable = simulate(toy_regression(num_points=20), "full_batch", grad_accum_steps=4, micro_batch_size=2,
                      lr=0.002).weights[:, 0]
    assert abs(stable[3] - 2) < abs(stable[0] - 2)


def _largest_distances(runs):
    full = runs["full_batch"]
    return (runs["mean_of_means"].distance_from(full).max(), runs["token_normalised"].distance_from(full).max())


def test_03_the_explorer_opens_on_the_lessons_run():
    from gaccum_course.widgets import variable_length_explorer

    explorer = variable_length_explorer(strict=True)
    assert explorer.values == dict(grad_accum_steps=4, micro_batch_size=2, num_processes=1, spread=0.75, lr=0.05,
                                   epochs=1)
    corpus, runs = explorer.state.result
    lesson = compare_strategies(sequence_corpus(64, mean_length=8, spread=0.75), grad_accum_steps=4,
                                micro_batch_size=2, lr=0.05)
    assert corpus.lengths == sequence_corpus(64, mean_length=8, spread=0.75).lengths
    assert _largest_distances(runs) == _largest_distances(lesson)


def test_03_the_explorers_suggested_moves_show_what_the_lesson_says():
    from gaccum_course.widgets import variable_length_explorer

    explorer = variable_length_explorer(strict=True)
    packed = _largest_distances(explorer.set(spread=0.0).result[1])
    assert max(packed) < 1e-6  # spread 0: the naive loop is exact too
    ga2 = _largest_distances(explorer.set(spread=1.0, grad_accum_steps=2).result[1])
    ga8 = _largest_distances(explorer.set(grad_accum_steps=8, micro_batch_size=1).result[1])
    assert max(ga2[1], ga8[1]) < 1e-6  # token normalisation: rounding only
    assert ga8[0] > ga2[0] > 1e-3  # the naive error grows with GA
    assert explorer.state.error is None
