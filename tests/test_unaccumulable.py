"""Losses accumulation cannot reproduce, and their fixes, measured (gaccum_lib.unaccumulable; lesson 11).

The naive figures are pinned as measured on CPU (torch 2.13, float32) to 3 significant digits;
every fix must equal the full window within 1e-6, every naive run must be off by more than 1e-2.
"""

import pytest

from gaccum_lib.unaccumulable import (
    in_batch_negatives_case,
    load_balancing_case,
    measure_all,
    micro_batches,
    norm_case,
)

# Measured: GA -> naive figure.
BATCH_NORM = {2: 0.0970, 4: 0.401, 8: 0.662}
CONTRASTIVE = {2: 0.330, 4: 0.460, 8: 0.567}
CONTRASTIVE_NAIVE_LOSS = {2: 1.06, 4: 0.590, 8: 0.318}
BALANCING = {2: 0.157, 4: 0.165, 8: 0.302}
BALANCING_LOSS = {2: 0.000883, 4: 0.00223, 8: 0.0197}


def three_digits(value):
    return pytest.approx(value, rel=1e-2 / 2)  # the pinned figures carry 3 significant digits


@pytest.fixture(scope="module")
def rows():
    return {(r["case"], r["grad_accum_steps"]): r for r in measure_all()}


@pytest.mark.parametrize("ga", sorted(BATCH_NORM))
def test_batch_norm_drifts_and_group_or_layer_norm_do_not(rows, ga):
    row = rows[("batch_norm", ga)]
    assert row["naive_distance"] == three_digits(BATCH_NORM[ga])
    assert row["naive_distance"] > 1e-2
    assert row["fix_distance"] < 1e-6 and row["layer_distance"] < 1e-6


@pytest.mark.parametrize("ga", sorted(CONTRASTIVE))
def test_in_batch_negatives_drift_and_grad_cache_does_not(rows, ga):
    row = rows[("in_batch_negatives", ga)]
    assert row["naive_distance"] == three_digits(CONTRASTIVE[ga])
    assert row["naive_distance"] > 1e-2
    # fewer negatives per query: an easier, smaller loss
    assert row["full_loss"] == three_digits(1.63)
    assert row["naive_loss"] == three_digits(CONTRASTIVE_NAIVE_LOSS[ga])
    assert row["gradcache_distance"] < 1e-6 and row["fix_distance"] == row["gradcache_distance"]


@pytest.mark.parametrize("ga", sorted(BALANCING))
def test_load_balancing_drifts_and_window_counts_do_not(rows, ga):
    row = rows[("load_balancing", ga)]
    assert row["naive_distance"] == three_digits(BALANCING[ga])
    assert row["naive_distance"] > 1e-2
    assert row["naive_loss_distance"] == three_digits(BALANCING_LOSS[ga])
    assert row["full_loss"] == three_digits(1.02)
    assert row["fix_distance"] < 1e-6 and row["fix_loss_distance"] < 1e-6


def test_the_naive_drift_grows_with_ga(rows):
    for case in ("batch_norm", "in_batch_negatives", "load_balancing"):
        drift = [rows[(case, ga)]["naive_distance"] for ga in (2, 4, 8)]
        assert drift == sorted(drift)


def test_one_micro_batch_is_the_full_batch():
    assert norm_case(1)["distance"] == 0.0
    assert in_batch_negatives_case(1)["naive_distance"] == 0.0
    assert load_balancing_case(1)["naive_distance"] == 0.0


def test_two_calls_give_the_same_numbers(rows):
    assert norm_case(4) == norm_case(4)
    assert load_balancing_case(4)["naive_distance"] == rows[("load_balancing", 4)]["naive_distance"]


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: norm_case(4, norm="instance"), ValueError, "norm must be one of batch, group, layer; got 'instance'"),
    (lambda: norm_case(32), ValueError, r"grad_accum_steps must be in \[1, 16\], got 32"),  # BatchNorm needs 2
    (lambda: norm_case(3), ValueError, "grad_accum_steps must divide window=32 into equal micro-batches, got 3"),
    (lambda: norm_case(True), TypeError, "grad_accum_steps must be an int, got bool"),
    (lambda: in_batch_negatives_case(4, temperature=0.0), ValueError, r"temperature must be in \(0.0, 100.0\]"),
    (lambda: in_batch_negatives_case(32), ValueError, r"grad_accum_steps must be in \[1, 16\], got 32"),
    (lambda: load_balancing_case(4, num_experts=1), ValueError, r"num_experts must be in \[2, 64\], got 1"),
    (lambda: micro_batches(1, 1), ValueError, r"window must be in \[2, 4096\], got 1"),
])
def test_bad_input_is_refused(call, error, message):
    with pytest.raises(error, match=message):
        call()
