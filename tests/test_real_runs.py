"""Real Accelerate in real processes (gloo on CPU): the simulator must match it within 1e-6."""

import os

import numpy as np
import pytest

from gaccum_lib import LaunchError, launch, real_run, reset_accelerate_state, seed_sequences, sequence_corpus, simulate

pytestmark = pytest.mark.real
PRINTED = 5e-5


def _both(problem, strategy, **kwargs):
    real = real_run(problem, strategy, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("sync_mode", "device")}
    return real, simulate(problem, strategy, **kwargs)


@pytest.mark.parametrize("strategy", ["token_normalised", "mean_of_means"])
def test_two_real_processes_match_the_simulator_on_the_seed_toy(strategy):
    real, sim = _both(seed_sequences(16), strategy, grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    assert "MULTI_CPU" in real.source  # really two processes, not two lonely ones
    assert real.token_counts.tolist() == [[52, 84]]
    assert real.max_difference(sim) < 1e-6
    # Every rank ends with the same weights.
    assert np.abs(real.rank_final_weights - real.rank_final_weights[0]).max() == 0.0
    expected = {"token_normalised": [0.2117, 0.3172], "mean_of_means": [0.1622, 0.3668]}[strategy]
    np.testing.assert_allclose(real.final_weights, expected, atol=PRINTED)


def test_one_real_process_reproduces_the_seed():
    real, sim = _both(seed_sequences(8), "token_normalised", grad_accum_steps=2, micro_batch_size=4, num_processes=1)
    assert real.source.startswith("accelerate (DistributedType.NO")
    assert real.token_counts.tolist() == [[36]]
    np.testing.assert_allclose(real.final_weights, [0.0953, 0.4337], atol=PRINTED)
    assert real.max_difference(sim) < 1e-6


@pytest.mark.parametrize("strategy", ["token_normalised", "mean_of_means"])
def test_many_updates_uneven_data_and_a_short_last_window(strategy):
    # 37 sequences, micro-batch 3: 13 batches, so even_batches tops up the last round, and
    # each rank's 7 batches make windows of 3, 3 and 1.
    real, sim = _both(sequence_corpus(37, mean_length=6, spread=0.9), strategy, grad_accum_steps=3,
                      micro_batch_size=3, num_processes=2, lr=0.05, epochs=2)
    assert real.num_updates == sim.num_updates == 6
    assert real.token_counts.tolist() == sim.token_counts.tolist()
    assert real.max_difference(sim) < 1e-6
    np.testing.assert_allclose(real.losses, sim.losses, atol=1e-6)


def test_three_processes():
    real, sim = _both(sequence_corpus(30), "token_normalised", grad_accum_steps=2, micro_batch_size=2,
                      num_processes=3)
    assert real.token_counts.shape[1] == 3
    assert real.max_difference(sim) < 1e-6


def test_no_sync_all_reduces_once_per_update_instead_of_ga_times():
    problem = sequence_corpus(32)
    kwargs = dict(grad_accum_steps=4, micro_batch_size=2, num_processes=2)
    quiet = real_run(problem, "token_normalised", sync_mode="no_sync", **kwargs)
    chatty = real_run(problem, "token_normalised", sync_mode="every_step", **kwargs)
    assert quiet.extras["allreduce_rounds_per_update"].tolist() == [[1, 1], [1, 1]]
    assert chatty.extras["allreduce_rounds_per_update"].tolist() == [[4, 4], [4, 4]]
    assert quiet.max_difference(chatty) < 1e-6


def test_inverted_no_sync_makes_the_ranks_diverge():
    run = real_run(sequence_corpus(32), "token_normalised", grad_accum_steps=4, micro_batch_size=2,
                   num_processes=2, sync_mode="inverted")
    assert np.abs(run.rank_final_weights[0] - run.rank_final_weights[1]).max() > 1e-4


def _returns_rank_and_world():
    from accelerate import Accelerator

    accelerator = Accelerator()
    return accelerator.process_index, accelerator.num_processes, os.getpid()


def test_launch_returns_each_ranks_result_from_distinct_processes():
    results = launch(_returns_rank_and_world, num_processes=2, quiet=True)
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert len({r[2] for r in results} | {os.getpid()}) == 3  # two children, neither is us


def _deepspeed_back_end():
    from accelerate import PartialState

    PartialState(cpu=True)  # joins the launch's process group
    return os.environ.get("DS_ACCELERATOR")


def test_cpu_ranks_give_deepspeed_the_cpu_back_end_unless_told_otherwise(monkeypatch):
    # Accelerate's unwrap_model imports DeepSpeed where it is installed: on a CPU rank it must not look for a GPU.
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert launch(_deepspeed_back_end, num_processes=2, quiet=True) == ["cpu", "cpu"]
    monkeypatch.setenv("DS_ACCELERATOR", "mps")  # a choice of the caller's stays
    assert launch(_deepspeed_back_end, num_processes=2, quiet=True) == ["mps", "mps"]
    assert os.environ["DS_ACCELERATOR"] == "mps"


def test_launch_after_an_accelerator_exists_in_this_process(capsys):
    from accelerate import Accelerator

    Accelerator(cpu=True)  # what an earlier notebook cell might have done
    results = launch(_returns_rank_and_world, num_processes=2)
    assert [r[:2] for r in results] == [(0, 2), (1, 2)]
    assert "already existed in this kernel" in capsys.readouterr().out
    assert reset_accelerate_state(quiet=True) is False  # and nothing is left behind


def _fails_on_rank_one():
    from accelerate import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise RuntimeError("rank one is unhappy")
    return "fine"


def test_a_failing_child_reports_its_rank_and_traceback():
    with pytest.raises(LaunchError, match=r"rank 1 of 2 failed with RuntimeError: rank one is unhappy") as info:
        launch(_fails_on_rank_one, num_processes=2, quiet=True)
    assert "_fails_on_rank_one" in str(info.value)  # the child's traceback is in the message


def test_one_process_with_a_short_last_micro_batch():
    # 22 sequences in micro-batches of 4: the last has 2, and one process does not top it up.
    real, sim = _both(sequence_corpus(22), "mean_of_means", grad_accum_steps=2, micro_batch_size=4, num_processes=1)
    assert real.token_counts.tolist() == sim.token_counts.tolist()
    assert real.max_difference(sim) < 1e-6


def test_accelerate_skips_the_update_of_a_short_window_read_ahead_under_accumulate():
    # Pins Accelerate's behaviour that lessons 04, 05 and 06 (pitfall 16) teach: reading a short last
    # window with islice runs the prepared loader out, its end() unregisters it from the GradientState
    # (whose end_of_dataloader then reads False), and accumulate() never syncs that window,
    # so the prepared optimizer skips the update and the count carries over.
    # If this fails, Accelerate changed: update those lessons (and the take-home script's docstring).
    settings = dict(grad_accum_steps=4, micro_batch_size=2, num_processes=2, epochs=2)
    corpus = sequence_corpus(20)  # 5 micro-batches per rank and epoch: windows of 4 and 1
    accumulate = real_run(corpus, "token_normalised", sync_mode="accumulate", **settings)
    no_sync = real_run(corpus, "token_normalised", sync_mode="no_sync", **settings)
    expected = simulate(corpus, "token_normalised", **settings)
    moved = [bool((b != a).any()) for a, b in zip(accumulate.weights[:-1], accumulate.weights[1:], strict=True)]
    assert moved == [True, False, False, False]
    assert accumulate.max_difference(expected) > 0.05
    assert no_sync.max_difference(expected) < 1e-6


def test_the_naive_loop_logs_its_mean_of_micro_batch_means():
    problem = seed_sequences(16)
    naive = real_run(problem, "mean_of_means", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    token = real_run(problem, "token_normalised", grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    rank0 = naive.extras["ranks"][0]
    # One update on 2 ranks x 2 micro-batches of 4: the logged number is the plain mean of the 4 micro-batch means
    batches = [problem.batch_of(ix) for ix in problem.micro_batch_indices(4)]
    model = problem.make_model()
    means = [float(loss.detach()) / n for loss, n in (problem.loss_sum_and_count(model, b) for b in batches)]
    assert abs(rank0["logged_losses"][0] - np.mean(means)) < 1e-9
    assert abs(rank0["logged_losses"][0] - rank0["losses"][0]) > 1e-4  # not the loss per target
    assert np.array_equal(token.extras["ranks"][0]["logged_losses"], token.extras["ranks"][0]["losses"])


def test_update_recorder_keeps_what_trajectory_from_ranks_reads(tmp_path):
    import torch

    from gaccum_lib.accelerate_runs import UpdateRecorder, fresh_accelerator, trajectory_from_ranks

    accelerator = fresh_accelerator()
    model = torch.nn.Linear(2, 1)
    recorder = UpdateRecorder()
    recorder(0, accelerator, model, None)
    with torch.no_grad():
        model.weight += 1.0
    stats = {"loss": torch.tensor(0.5), "targets": torch.tensor(7), "local_targets": torch.tensor(7),
             "grad_norm": torch.tensor(2.0), "lr": 0.1}
    recorder(1, accelerator, model, stats)
    reset_accelerate_state(quiet=True)
    recorder.save(tmp_path)
    [record] = UpdateRecorder.load_all(tmp_path)
    assert record["rank"] == 0 and record["num_processes"] == 1 and record["losses"] == [0.5]
    assert record["window_counts"] == [7] and record["grad_norms"] == [2.0] and record["lrs"] == [0.1]
    assert record["allreduce_rounds_per_update"] == [0]  # one process: nothing to all-reduce
    trajectory = trajectory_from_ranks([record], strategy="token_normalised", grad_accum_steps=1, micro_batch_size=1,
                                       lr=0.1)
    assert np.allclose(trajectory.weights[1] - trajectory.weights[0], [1.0, 1.0, 0.0])
