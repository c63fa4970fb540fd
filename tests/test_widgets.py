"""The explorers: state a test can read, plots that change, errors that are clear and survivable."""

import numpy as np
import pytest

from gaccum_course.widgets import (
    Explorer,
    launch_explorer,
    regression_explorer,
    schedule_explorer,
    trainer_count_explorer,
    variable_length_explorer,
)


def test_moving_a_slider_recomputes_and_redraws():
    explorer = variable_length_explorer(strict=True)
    before = explorer.state.image_digest
    explorer.controls["grad_accum_steps"].value = 8  # what a learner's slider does
    assert explorer.state.refreshes == 2
    assert explorer.state.image_digest != before
    assert explorer.state.values["grad_accum_steps"] == 8
    _, runs = explorer.state.result
    assert runs["token_normalised"].grad_accum_steps == 8


def test_set_changes_several_controls_with_one_recompute():
    explorer = variable_length_explorer(strict=True)
    explorer.set(grad_accum_steps=2, micro_batch_size=4, spread=0.0)
    assert explorer.state.refreshes == 2
    _, runs = explorer.state.result
    assert runs["mean_of_means"].max_difference(runs["full_batch"]) < 1e-6  # spread 0: naive exact


def test_values_outside_a_slider_are_refused_not_clamped():
    explorer = variable_length_explorer(strict=True)
    with pytest.raises(ValueError, match=r"grad_accum_steps must be in \[1, 8\], got 9"):
        explorer.set(grad_accum_steps=9)
    with pytest.raises(TypeError, match="micro_batch_size must be an int, got 2.5"):
        explorer.set(micro_batch_size=2.5)
    with pytest.raises(ValueError, match=r"unknown control\(s\) \['gradient_steps'\]"):
        explorer.set(gradient_steps=2)
    with pytest.raises(ValueError, match=r"grad_accum_steps must be one of \[1, 2, 4, 8\], got 3"):
        regression_explorer(strict=True).set(grad_accum_steps=3)
    assert explorer.state.refreshes == 1 and explorer.state.error is None


def test_a_compute_error_is_shown_and_the_widget_keeps_working():
    calls = []

    def compute(n):
        calls.append(n)
        if n == 3:
            raise ValueError("n must not be 3 (a demonstration)")
        return n

    import ipywidgets

    explorer = Explorer({"n": ipywidgets.IntSlider(value=1, min=1, max=5)}, compute,
                        lambda result, figure: figure.subplots().plot([0, result]))
    good = explorer.state.image_digest
    explorer.controls["n"].value = 3
    assert explorer.state.error == "n must not be 3 (a demonstration)"
    assert "n must not be 3" in explorer.message.value
    assert explorer.state.image_digest == good  # the last good plot stays
    explorer.controls["n"].value = 4
    assert explorer.state.error is None and explorer.message.value == ""
    assert explorer.state.result == 4 and explorer.state.image_digest != good
    assert calls == [1, 3, 4]


def test_strict_mode_reraises_for_tests():
    import ipywidgets

    explorer = Explorer({"n": ipywidgets.IntSlider(value=1, min=1, max=5)},
                        lambda n: 1 / 0 if n == 2 else n, lambda r, f: f.subplots(), strict=True)
    with pytest.raises(ZeroDivisionError):
        explorer.set(n=2)


def test_regression_explorer_claims():
    explorer = regression_explorer(strict=True)
    for ga in (1, 2, 4, 8):
        result = explorer.set(grad_accum_steps=ga, epochs=1).result
        full, plain, forgot = (result[k].final_weights[0] for k in ("full batch", "plain: loss / GA", "forgot / GA"))
        assert abs(plain - full) < 1e-6 and abs(forgot / full - ga) < 1e-5
    assert explorer.state.summary.startswith("After 1 update:")


def test_schedule_explorer_shows_the_three_sizings():
    explorer = schedule_explorer(strict=True)
    lrs = explorer.set(num_processes=4, grad_accum_steps=4, epochs=2).result
    assert set(lrs) == {"updates", "micro_batches", "sharded_updates"}
    assert (lrs["sharded_updates"] == 0).any() and not (lrs["updates"] == 0).any()


def test_trainer_count_explorer_is_one_minus_one_over_the_row_length():
    explorer = trainer_count_explorer(strict=True)
    for length in (4, 100):
        fraction = explorer.set(mean_length=length, spread=0.0, grad_accum_steps=4).result["fraction"]
        assert len(fraction) == 8 and np.allclose(fraction, 1 - 1 / length, rtol=0, atol=1e-12)
    varied = explorer.set(mean_length=20, spread=1.0, grad_accum_steps=1).result["fraction"]
    assert varied.min() < 0.95 < varied.max() < 1.0  # windows of different lengths lose different shares
    assert "first window:" in explorer.state.summary
    with pytest.raises(ValueError, match="mean_length"):
        explorer.set(mean_length=1)


@pytest.mark.real
def test_launch_explorer_runs_real_processes_on_click():
    explorer = launch_explorer(strict=True)
    first = explorer.state.result["real"]
    assert "MULTI_CPU" in first.source and first.token_counts.tolist() == [[52, 84]]
    explorer.controls["num_processes"].value = 3  # nothing happens until the button is pressed
    assert explorer.state.refreshes == 1
    explorer.button.click()
    real = explorer.state.result["real"]
    assert explorer.state.refreshes == 2 and real.num_processes == 3
    assert real.max_difference(explorer.state.result["simulated"]) < 1e-6
    assert np.ptp(real.rank_final_weights, axis=0).max() == 0.0


def test_epochs_control_sets_the_number_of_updates():
    explorer = variable_length_explorer(strict=True)
    _, one = explorer.state.result
    _, three = explorer.set(epochs=3).result
    assert three["token_normalised"].num_updates == 3 * one["token_normalised"].num_updates
    assert explorer.state.summary.startswith(f"{three['full_batch'].num_updates} updates")
