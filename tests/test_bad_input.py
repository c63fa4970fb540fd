"""Bad input fails loudly, naming the argument and what would be accepted."""

import numpy as np
import pytest
import torch

from gaccum_launch import choose_device, cpu_process_limit
from gaccum_lib import (
    cmp,
    count_target_tokens,
    launch,
    max_diff,
    pad_and_stack,
    plain_backward_loss,
    plan_windows,
    real_run,
    seed_sequences,
    sequence_corpus,
    sequences_from_lengths,
    simulate,
    toy_regression,
)
from gaccum_lib.data import make_problem

SEQ = seed_sequences(8)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"grad_accum_steps": 0}, ValueError, r"grad_accum_steps must be in \[1, 4096\], got 0"),
    ({"grad_accum_steps": 2.0}, TypeError, "grad_accum_steps must be an int, got float"),
    ({"grad_accum_steps": True}, TypeError, "grad_accum_steps must be an int, got bool"),
    ({"num_processes": 0}, ValueError, r"num_processes must be in \[1, 1024\], got 0"),
    ({"micro_batch_size": 0}, ValueError, r"micro_batch_size must be in \[1, 8\], got 0"),
    ({"micro_batch_size": 9}, ValueError, r"micro_batch_size must be in \[1, 8\], got 9"),
    ({"lr": 0.0}, ValueError, r"lr must be in \(0.0, 1000.0\], got 0.0"),
    ({"lr": float("nan")}, ValueError, "lr must be a finite number"),
    ({"lr": "0.1"}, TypeError, "lr must be a number, got str"),
    ({"epochs": 0}, ValueError, r"epochs must be in \[1, 10000\], got 0"),
])
def test_simulate_rejects_bad_arguments(kwargs, error, message):
    base = {"grad_accum_steps": 2, "micro_batch_size": 4}
    with pytest.raises(error, match=message):
        simulate(SEQ, "token_normalised", **{**base, **kwargs})


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(ValueError, match="strategy must be one of full_batch, mean_of_means, .*got 'mean'"):
        simulate(SEQ, "mean", grad_accum_steps=2, micro_batch_size=4)


def test_problem_must_be_a_problem():
    with pytest.raises(TypeError, match="problem must be a gaccum_lib Problem"):
        simulate([1, 2, 3], "full_batch", grad_accum_steps=1, micro_batch_size=1)


def test_empty_datasets_are_refused():
    with pytest.raises(ValueError, match="lengths must hold at least one length"):
        sequences_from_lengths([])
    with pytest.raises(ValueError, match="num_points must be in"):
        toy_regression(num_points=0)
    with pytest.raises(ValueError, match="num_sequences must be in"):
        sequence_corpus(num_sequences=0)
    with pytest.raises(ValueError, match="examples must hold at least one item"):
        pad_and_stack([])


def test_zero_length_sequence_is_refused():
    with pytest.raises(ValueError, match=r"lengths\[1\] must be in \[1, 100000\], got 0"):
        sequences_from_lengths([3, 0, 2])


def test_spread_outside_0_1():
    with pytest.raises(ValueError, match=r"spread must be in \[0.0, 1.0\], got 1.5"):
        sequence_corpus(spread=1.5)


def test_window_without_target_tokens():
    with pytest.raises(ValueError, match="window_terms=0: the window has no target token"):
        plain_backward_loss("token_normalised", torch.tensor(0.0), 0, window_terms=0, local_window_terms=0,
                            grad_accum_steps=2)
    with pytest.raises(ValueError, match="num_terms=0"):
        plain_backward_loss("mean_of_means", torch.tensor(0.0), 0, window_terms=3, local_window_terms=3,
                            grad_accum_steps=2)


def test_all_padding_window_is_reported_with_its_update_number():
    problem = seed_sequences(4)
    all_padding = {"input_ids": torch.full((2,), -100.0), "labels": torch.full((2,), -100)}
    problem = type(problem)(name="padding", examples=(*problem.examples, all_padding, all_padding))
    with pytest.raises(ValueError, match="update 2 has no target token in its window"):
        simulate(problem, "token_normalised", grad_accum_steps=2, micro_batch_size=1)


def test_mismatched_shapes_in_a_batch():
    bad = {"input_ids": torch.arange(1.0, 4.0), "labels": torch.tensor([1, 0])}
    with pytest.raises(ValueError, match="input_ids and labels must have the same shape"):
        pad_and_stack([bad])


def test_make_problem_names_the_kinds():
    with pytest.raises(ValueError, match="spec\\['kind'\\] must be one of .*got 'imagenet'"):
        make_problem({"kind": "imagenet"})
    with pytest.raises(TypeError, match="spec must be a dict with a 'kind' key"):
        make_problem("seed_sequences")


def test_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"num_examples must be in \[1, inf\), got 0"):
        plan_windows(0, micro_batch_size=1, grad_accum_steps=1)


@pytest.mark.parametrize(("value", "message"), [
    (8.0, r"num_examples_or_batches must be an int \(a dataset length\) or a list of batches \(lists of example "
          r"indices\), got float \(8.0\)"),
    ("8", r"num_examples_or_batches must be an int .*, got str \('8'\)"),
    (None, r"num_examples_or_batches must be an int .*, got NoneType \(None\)"),
    ([[0, 1], 2], r"num_examples_or_batches\[1\] must be a batch \(a list of example indices\), got int \(2\)"),
])
def test_plan_names_a_bad_dataset_argument(value, message):
    with pytest.raises(TypeError, match=message):
        plan_windows(value, micro_batch_size=2, grad_accum_steps=2)


def test_plan_accepts_numpy_ints_and_batch_lists():
    expected = plan_windows(8, micro_batch_size=2, grad_accum_steps=2)
    assert expected == [[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]]]
    assert plan_windows(np.int64(8), micro_batch_size=2, grad_accum_steps=2) == expected
    assert plan_windows(((0, 1), (2, 3), (4, 5), (6, 7)), micro_batch_size=2, grad_accum_steps=2) == expected


@pytest.mark.parametrize(("labels", "kind"), [({"labels": torch.tensor([1, -100])}, "dict"), ([1, -100], "list")])
def test_count_target_tokens_wants_the_labels_tensor(labels, kind):
    with pytest.raises(TypeError, match=rf"labels must be a torch.Tensor of label ids \(e.g. batch\['labels'\]\), "
                                        rf"got {kind}$"):
        count_target_tokens(labels)
    assert count_target_tokens(torch.tensor([[1, -100], [0, 1]])) == 3


@pytest.mark.parametrize(("tol", "error", "message"), [
    ("1e-6", TypeError, r"tol must be a number, got str \('1e-6'\)"),
    (None, TypeError, r"tol must be a number, got NoneType"),
    (True, TypeError, r"tol must be a number, got bool"),
    (-1e-6, ValueError, r"tol must be in \[0.0, inf\), got -1e-06"),
    (float("nan"), ValueError, r"tol must be a finite number, got nan"),
    (float("inf"), ValueError, r"tol must be a finite number, got inf"),
])
def test_cmp_rejects_a_bad_tol(tol, error, message):
    with pytest.raises(error, match=message):
        cmp("weights", [1.0], [1.0], tol=tol, quiet=True)


def test_cmp_and_max_diff_refuse_empty_or_mismatched_inputs():
    with pytest.raises(ValueError, match=r"got and expected must have the same shape, got \(2,\) and \(1,\)"):
        cmp("weights", [1.0, 2.0], [1.0], quiet=True)
    with pytest.raises(ValueError, match=r"got and expected are empty \(shape \(0,\)\); they need at least 1 value"):
        cmp("weights", [], torch.zeros(0), quiet=True)
    with pytest.raises(ValueError, match=r"a and b must have the same shape, got \(2, 1\) and \(2,\)"):
        max_diff(np.zeros((2, 1)), np.zeros(2))
    with pytest.raises(ValueError, match=r"a and b are empty \(shape \(0, 3\)\)"):
        max_diff(np.zeros((0, 3)), np.zeros((0, 3)))
    with pytest.raises(TypeError, match=r"expected must be a number, a tensor or an array of numbers, got str"):
        cmp("weights", [1.0], "1.0", quiet=True)
    with pytest.raises(TypeError, match="label must be a str, got NoneType"):
        cmp(None, [1.0], [1.0], quiet=True)
    # Valid input still compares: tol=0 asks for exact equality.
    assert cmp("weights", torch.tensor([1.0, 2.0]), [1.0, 2.0], tol=0, quiet=True)
    assert not cmp("weights", [1.0, 2.0], [1.0, 2.0 + 1e-9], tol=0, quiet=True)
    assert max_diff([1.0, 2.0], [1.5, 2.0]) == 0.5


def test_too_many_cpu_processes_says_the_limit():
    limit = cpu_process_limit()
    with pytest.raises(ValueError, match=rf"num_processes={limit + 1} is more than makes sense .*\[1, {limit}\]"):
        choose_device(limit + 1, "cpu")


def test_more_gpus_than_the_machine_has():
    with pytest.raises(ValueError, match=r"GPUs requested but this machine has \d+"):
        choose_device(64, "gpu")


def test_real_run_rejects_full_batch_and_bad_sync_mode_before_launching():
    with pytest.raises(ValueError, match="strategy must be one of mean_of_means"):
        real_run(SEQ, "full_batch", grad_accum_steps=2, micro_batch_size=4)
    with pytest.raises(ValueError, match="sync_mode must be one of no_sync, every_step"):
        real_run(SEQ, "token_normalised", grad_accum_steps=2, micro_batch_size=4, sync_mode="sometimes")


def test_launch_checks_its_arguments():
    with pytest.raises(TypeError, match="function must be callable"):
        launch("train")
    with pytest.raises(TypeError, match="args must be a tuple"):
        launch(print, [1])
    with pytest.raises(ValueError, match="device must be one of auto, cpu, gpu"):
        launch(print, (), device="tpu")
