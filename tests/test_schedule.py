"""The scheduler emulation matches real Accelerate on 1 and 2 processes."""

import numpy as np
import pytest

from gaccum_lib import launch, reset_accelerate_state
from gaccum_lib.schedule import accelerate_lr_trace, lr_per_update, schedule_length, scheduler_steps_per_update


@pytest.mark.parametrize(("num_batches", "ga", "epochs"), [(16, 4, 1), (10, 4, 2), (9, 2, 1), (8, 1, 1)])
def test_emulation_matches_accelerate_on_one_process(num_batches, ga, epochs):
    total = schedule_length("updates", num_batches, ga, 1, epochs)
    real = accelerate_lr_trace(num_batches, ga, total, epochs=epochs)
    reset_accelerate_state(quiet=True)
    np.testing.assert_allclose(real, lr_per_update("updates", num_batches, ga, 1, epochs), atol=1e-12)


@pytest.mark.real
@pytest.mark.parametrize("sizing", ["updates", "micro_batches", "sharded_updates"])
def test_emulation_matches_accelerate_on_two_processes(sizing):
    num_batches, ga = 16, 2
    total = schedule_length(sizing, num_batches, ga, 2)
    traces = launch(accelerate_lr_trace, (num_batches, ga, total), num_processes=2, quiet=True)
    assert traces[0] == traces[1]
    np.testing.assert_allclose(traces[0], lr_per_update(sizing, num_batches, ga, 2), atol=1e-12)


@pytest.mark.real
def test_exact_step_count_against_real_accelerate_where_the_usual_rule_is_short():
    # 10 batches, GA 2, 3 processes: each rank gets 4 batches (even_batches), 2 updates, 3 steps each.
    assert schedule_length("updates", 10, 2, 3) == 6 and schedule_length("usual_rule", 10, 2, 3) == 5
    traces = launch(accelerate_lr_trace, (10, 2, 6), num_processes=3, quiet=True)
    assert len(traces[0]) == 2
    np.testing.assert_allclose(traces[0], lr_per_update("updates", 10, 2, 3), atol=1e-12)
    assert scheduler_steps_per_update(1000, 8, 4)[-1] == 128 and schedule_length("usual_rule", 1000, 8, 4) == 125


def test_prepared_scheduler_steps_num_processes_times_per_update():
    assert scheduler_steps_per_update(16, 2, 2).tolist() == [2, 4, 6, 8]
    assert scheduler_steps_per_update(10, 4, 1).tolist() == [1, 2, 3]  # 4 + 4 + a short window of 2


def test_only_update_sizing_ends_the_decay_at_the_end_of_training():
    for processes in (1, 2, 4):
        right = lr_per_update("updates", 64, 4, processes, epochs=2)
        slow = lr_per_update("micro_batches", 64, 4, processes, epochs=2)
        # The decay reaches 0 right after the last update: that update uses the last step of it.
        assert right[-1] == pytest.approx(0.1 / len(right))
        assert slow[-1] > 0.07  # GA times too long: most of the decay never happens
    early = lr_per_update("sharded_updates", 64, 4, 2, epochs=2)
    assert (early[len(early) // 2:] == 0).all()  # runs out halfway: the second half trains at lr 0


def test_accelerates_adjust_scheduler_option_does_not_change_the_learning_rates():
    # What lesson 02 says: the option only bumps the scheduler's step counter.
    total = schedule_length("updates", 16, 4, 1)
    adjusted = accelerate_lr_trace(16, 4, total, adjust_scheduler=True)
    reset_accelerate_state(quiet=True)
    not_adjusted = accelerate_lr_trace(16, 4, total, adjust_scheduler=False)
    reset_accelerate_state(quiet=True)
    assert adjusted == not_adjusted == lr_per_update("updates", 16, 4, 1).tolist()
    with pytest.raises(TypeError, match="adjust_scheduler must be a bool, got str"):
        accelerate_lr_trace(16, 4, total, adjust_scheduler="yes")


def test_the_exact_count_is_the_usual_rule_rounded_up_to_a_multiple_of_the_processes():
    # Lesson 09's statement: equal exactly when ceil(L / GA) is a multiple of N, else short by under N.
    for num_batches in range(1, 200):
        for ga in range(1, 10):
            for processes in range(1, 6):
                usual = schedule_length("usual_rule", num_batches, ga, processes)
                right = schedule_length("updates", num_batches, ga, processes)
                assert right == processes * -(-usual // processes)
                assert (right == usual) == (usual % processes == 0) and 0 <= right - usual < processes
    assert schedule_length("usual_rule", 24, 4, 2) == schedule_length("updates", 24, 4, 2) == 6
