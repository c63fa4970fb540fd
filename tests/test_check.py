"""check_accumulation: a correct loop passes, each known pitfall fails with its diagnosis, misuse raises."""

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gaccum_check import AccumulationCheckError, AccumulationReport, check_accumulation
from gaccum_lib import count_targets_before_shift, seed_sequences, sequences_from_lengths, simulate, tiny_lm

# The seed's variable-length toy: 16 items of lengths 1..16, micro-batches of 4 items, so the
# window is 4 micro-batches: GA=4 on 1 process, GA=2 on each of 2 processes.
SEQ = seed_sequences(16)
MICRO_BATCHES = [SEQ.batch_of(ix) for ix in SEQ.micro_batch_indices(4)]
LOSS = SEQ.loss_sum_and_count
# Equal lengths: every micro-batch has 4 x 3 = 12 targets.
EQUAL = sequences_from_lengths([3] * 16)
EQUAL_BATCHES = [EQUAL.batch_of(ix) for ix in EQUAL.micro_batch_indices(4)]
# A causal LM (its loss shifts the labels): 8 rows of 2, 390 targets after the shift, 398 labels before it.
LM = tiny_lm(8, d_model=8)
LM_BATCHES = [LM.batch_of(ix) for ix in LM.micro_batch_indices(2)]


def check(step, problem=SEQ, batches=MICRO_BATCHES, **kwargs) -> AccumulationReport:
    return check_accumulation(step, problem.make_model, batches, problem.loss_sum_and_count, **kwargs)


def targets(micro_batches) -> int:
    return sum(SEQ.count_targets(b) for b in micro_batches)


# --- loops a user might write: one optimizer update over this rank's micro-batches ---------------


def token_normalised(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def token_normalised_accelerate(model, optimizer, micro_batches, loss_fn, ctx):
    # The same through ctx.backward (= accelerator.backward, which divides by GA), tensor count.
    total = ctx.all_reduce_sum(torch.tensor(targets(micro_batches)))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        ctx.backward(loss_sum * ctx.grad_accum_steps * ctx.num_processes / total)
    optimizer.step()
    optimizer.zero_grad()


def divided_twice(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        ctx.backward(loss_sum * ctx.num_processes / total)  # the plain loss, divided by GA again
    optimizer.step()
    optimizer.zero_grad()


def not_divided(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.grad_accum_steps * ctx.num_processes / total).backward()  # meant for ctx.backward
    optimizer.step()
    optimizer.zero_grad()


def mean_of_means(model, optimizer, micro_batches, loss_fn, ctx):
    for batch in micro_batches:
        loss_sum, count = loss_fn(model, batch)
        (loss_sum / count / ctx.grad_accum_steps).backward()
    optimizer.step()
    optimizer.zero_grad()


def sum_of_means(model, optimizer, micro_batches, loss_fn, ctx):
    for batch in micro_batches:
        loss_sum, count = loss_fn(model, batch)
        (loss_sum / count).backward()
    optimizer.step()
    optimizer.zero_grad()


def count_not_gathered(model, optimizer, micro_batches, loss_fn, ctx):
    total = targets(micro_batches)
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def missing_world_scale(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def steps_every_micro_batch(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
        optimizer.step()  # an optimizer not prepared by Accelerate steps every time
        optimizer.zero_grad()


def never_zeroes(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.step()


def zeroes_before_step(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(targets(micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.zero_grad()
    optimizer.step()


def lm_token_normalised(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(sum(LM.count_targets(b) for b in micro_batches))  # after the shift
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def counted_before_shift(model, optimizer, micro_batches, loss_fn, ctx):
    total = ctx.all_reduce_sum(sum(count_targets_before_shift(b) for b in micro_batches))  # one per row too many
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def counted_before_shift_not_gathered(model, optimizer, micro_batches, loss_fn, ctx):
    total = sum(count_targets_before_shift(b) for b in micro_batches)
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        (loss_sum * ctx.num_processes / total).backward()
    optimizer.step()
    optimizer.zero_grad()


def rank_dependent_edit(model, optimizer, micro_batches, loss_fn, ctx):
    token_normalised(model, optimizer, micro_batches, loss_fn, ctx)
    if ctx.rank == 1:
        with torch.no_grad():
            model.weight.add_(0.01)


# --- a correct loop passes -----------------------------------------------------------------------


@pytest.mark.parametrize("step", [token_normalised, token_normalised_accelerate])
def test_token_normalised_loop_passes_on_1_and_2_processes(step):
    report = check(step)
    assert report.passed and bool(report)
    assert report.diagnosis == ()
    assert report.notes == ()  # variable lengths and 2 processes: nothing left unchecked
    assert list(report.details) == [1, 2]
    assert [d.grad_accum_steps for d in report.details.values()] == [4, 2]
    assert report.relative_distance <= 1e-5
    for d in report.details.values():
        assert d.passed and d.optimizer_steps == 1 and d.rank_spread == 0.0 and d.matches == ()
        assert d.update_ratio == pytest.approx(1.0, abs=1e-5)
        assert d.cosine == pytest.approx(1.0, abs=1e-6)
    assert report.update_ratio == {1: report.details[1].update_ratio, 2: report.details[2].update_ratio}


def test_reference_and_simulated_ranks_reproduce_the_seed_numbers():
    # The seed's figures (1 process: 8 items, lr 0.08, GA=2; 2 processes: 16 items, GA=2 each).
    for items, processes, full_batch, naive in [(8, 1, [0.0953, 0.4337], [0.0775, 0.4514]),
                                                (16, 2, [0.2117, 0.3172], [0.1622, 0.3668])]:
        problem = seed_sequences(items)
        batches = [problem.batch_of(ix) for ix in problem.micro_batch_indices(4)]
        correct = check(token_normalised, problem, batches, num_processes=processes, lr=0.08)
        wrong = check(mean_of_means, problem, batches, num_processes=processes, lr=0.08)
        np.testing.assert_allclose(correct.details[processes].reference_weights, full_batch, atol=5e-5)
        np.testing.assert_allclose(wrong.details[processes].user_weights, naive, atol=5e-5)
        # And the library's simulator agrees with the threads to 1e-6.
        kwargs = {"grad_accum_steps": 2, "micro_batch_size": 4, "num_processes": processes, "lr": 0.08}
        np.testing.assert_allclose(correct.details[processes].user_weights,
                                   simulate(problem, "full_batch", **kwargs).final_weights, atol=1e-6)
        np.testing.assert_allclose(wrong.details[processes].user_weights,
                                   simulate(problem, "mean_of_means", **kwargs).final_weights, atol=1e-6)


def test_ctx_tells_rank_sizes_and_sums_over_ranks():
    seen = []
    lock = threading.Lock()

    def recording(model, optimizer, micro_batches, loss_fn, ctx):
        local = targets(micro_batches)
        as_int = ctx.all_reduce_sum(local)
        as_float = ctx.all_reduce_sum(float(local))
        as_tensor = ctx.all_reduce_sum(torch.tensor([local, 1]))
        with lock:
            seen.append((ctx.num_processes, ctx.rank, ctx.grad_accum_steps, len(micro_batches), local, as_int,
                         as_float, as_tensor.tolist(), ctx.is_main_process))
        token_normalised(model, optimizer, micro_batches, loss_fn, ctx)

    assert check(recording)
    first_window = sorted(seen)[::2]  # the step runs for two windows: each entry twice
    assert sorted(seen) == sorted(first_window * 2)
    # 1 process: all 136 targets; 2 processes: 52 and 84 (the seed's figures), summed to 136.
    assert first_window == [
        (1, 0, 4, 4, 136, 136, 136.0, [136, 1], True),
        (2, 0, 2, 2, 52, 136, 136.0, [136, 2], True),
        (2, 1, 2, 2, 84, 136, 136.0, [136, 2], False),
    ]
    assert all(type(entry[5]) is int and type(entry[6]) is float for entry in seen)


def test_the_check_is_deterministic():
    first, second = check(mean_of_means), check(mean_of_means)
    assert first.relative_distance == second.relative_distance
    for p in (1, 2):
        assert np.array_equal(first.details[p].user_weights, second.details[p].user_weights)


def test_it_works_when_called_under_no_grad():
    with torch.no_grad():
        assert check(token_normalised)


# --- each pitfall fails with its diagnosis -------------------------------------------------------


@pytest.mark.parametrize(("step", "labels", "passed", "ratios"), [
    (divided_twice, ("loss divided by GA twice",), {1: False, 2: False}, {1: 0.25, 2: 0.5}),
    (not_divided, ("loss not divided by GA",), {1: False, 2: False}, {1: 4.0, 2: 2.0}),
    (mean_of_means, ("mean of micro-batch means",), {1: False, 2: False}, None),
    (sum_of_means, ("loss not divided by GA", "mean of micro-batch means"), {1: False, 2: False}, None),
    (count_not_gathered, ("token count not gathered across ranks",), {1: True, 2: False}, {1: 1.0}),
    (missing_world_scale, ("missing x num_processes",), {1: True, 2: False}, {1: 1.0, 2: 0.5}),
])
def test_each_normalisation_pitfall_gets_its_diagnosis(step, labels, passed, ratios):
    report = check(step)
    assert not report.passed and not report
    assert report.labels == labels
    assert {p: d.passed for p, d in report.details.items()} == passed
    assert all(d.optimizer_steps == 1 for d in report.details.values())
    assert report.relative_distance > 1e-3
    for p, ratio in (ratios or {}).items():
        assert report.update_ratio[p] == pytest.approx(ratio, abs=1e-5)


def test_mean_of_means_is_off_by_the_same_ratio_as_the_naive_seed_run():
    # Naive vs full batch on this window: update ratio 0.7741 on 1 and on 2 processes.
    report = check(mean_of_means)
    assert report.update_ratio[1] == pytest.approx(0.7741, abs=5e-5)
    assert report.update_ratio[2] == pytest.approx(0.7741, abs=5e-5)
    assert report.details[1].matches == ("mean_of_means",)
    assert "divide by the window's total target count" in report.diagnosis[0]


def test_mean_of_means_passes_on_equal_length_data_and_says_why():
    report = check(mean_of_means, EQUAL, EQUAL_BATCHES)
    assert report, str(report)
    assert report.diagnosis == ()
    assert len(report.notes) == 1 and "same number of targets" in report.notes[0]
    # A real pitfall still fails there.
    assert check(divided_twice, EQUAL, EQUAL_BATCHES).labels == ("loss divided by GA twice",)


def test_targets_counted_before_the_shift_gets_its_diagnosis():
    after = sum(LM.count_targets(b) for b in LM_BATCHES)
    before = sum(count_targets_before_shift(b) for b in LM_BATCHES)
    assert (after, before) == (390, 398)  # one extra target per row
    assert check(lm_token_normalised, LM, LM_BATCHES)  # the count after the shift passes
    report = check(counted_before_shift, LM, LM_BATCHES)
    assert not report
    assert report.labels == ("targets counted before the shift",)
    assert report.diagnosis[0].startswith("targets counted before the shift: the gradient is (targets after the shift) "
                                          "/ (targets before the shift) of the reference; ")
    for d in report.details.values():
        assert not d.passed and d.matches == ("counted_before_shift",)
        assert d.update_ratio == pytest.approx(390 / 398, abs=1e-6)
    # Not gathered as well: wrong on 2 processes only by the local counts, both named.
    both = check(counted_before_shift_not_gathered, LM, LM_BATCHES)
    assert both.labels == ("token count not gathered across ranks", "targets counted before the shift")
    assert both.details[2].matches == ("count_not_gathered+counted_before_shift",)


def test_the_shift_diagnosis_needs_its_exact_update_and_a_shifting_loss():
    def scaled(model, optimizer, micro_batches, loss_fn, ctx):  # close to 390 / 398 = 0.9799, not it
        total = ctx.all_reduce_sum(sum(LM.count_targets(b) for b in micro_batches))
        for batch in micro_batches:
            loss_sum, _ = loss_fn(model, batch)
            (0.97 * loss_sum * ctx.num_processes / total).backward()
        optimizer.step()
        optimizer.zero_grad()

    def one_extra_per_row(model, optimizer, micro_batches, loss_fn, ctx):
        # The same miscount on the seed's token classifier, whose loss does not shift: nothing to name.
        total = ctx.all_reduce_sum(sum(SEQ.count_targets(b) + len(b["labels"]) for b in micro_batches))
        for batch in micro_batches:
            loss_sum, _ = loss_fn(model, batch)
            (loss_sum * ctx.num_processes / total).backward()
        optimizer.step()
        optimizer.zero_grad()

    report = check(scaled, LM, LM_BATCHES)
    assert report.labels == ("wrong update size",)
    assert report.update_ratio[1] == pytest.approx(0.97, abs=1e-6)
    seed = check(one_extra_per_row)
    assert seed.labels == ("wrong update size",)
    assert seed.update_ratio[1] == pytest.approx(136 / 152, abs=1e-5)  # 16 rows, 136 targets


def test_stepping_on_every_micro_batch():
    report = check(steps_every_micro_batch)
    assert report.labels == ("optimizer stepped on every micro-batch",)
    assert {p: d.optimizer_steps for p, d in report.details.items()} == {1: 4, 2: 2}
    assert "ran 4 times in one window of GA=4" in report.diagnosis[0]


def test_missing_zero_grad_shows_in_the_second_window():
    report = check(never_zeroes)
    assert report.labels == ("state carried over between windows",)
    assert "optimizer.zero_grad() was never called" in report.diagnosis[0]
    # The first update itself is right.
    assert all(d.update_ratio == pytest.approx(1.0, abs=1e-5) for d in report.details.values())


def test_zeroing_before_the_step_is_no_update():
    report = check(zeroes_before_step)
    assert report.labels == ("no update",)
    assert report.update_ratio == {1: 0.0, 2: 0.0}


def test_ranks_that_end_with_different_weights():
    report = check(rank_dependent_edit)
    assert report.labels == ("ranks diverged",)
    assert report.diagnosis[0].startswith("ranks diverged (only with 2 processes): ")
    assert repr(report).startswith("AccumulationReport(FAILED: ranks diverged (only with 2 processes) |")
    assert report.details[1].passed and not report.details[2].passed
    assert report.failed_process_counts == (2,)
    # Rank 1 adds 0.01 to each weight after each window: far more than the allowed distance.
    assert report.details[2].rank_spread > 100 * report.details[2].allowed


def test_one_process_count_cannot_tell_some_pitfalls_apart_and_says_so():
    # With 2 processes and GA=2, dividing by GA twice and missing x num_processes give the same update.
    report = check(divided_twice, num_processes=2)
    assert report.labels == ("loss divided by GA twice", "missing x num_processes")
    assert any("several known pitfalls give this same gradient" in n for n in report.notes)
    # With 1 process only, the notes say what goes unchecked.
    assert any("only 1 process checked" in n for n in check(token_normalised, num_processes=1).notes)


def test_an_unknown_constant_factor():
    def scaled(model, optimizer, micro_batches, loss_fn, ctx):
        total = ctx.all_reduce_sum(targets(micro_batches))
        for batch in micro_batches:
            loss_sum, _ = loss_fn(model, batch)
            (0.3 * loss_sum * ctx.num_processes / total).backward()
        optimizer.step()
        optimizer.zero_grad()

    report = check(scaled)
    assert report.labels == ("wrong update size",)
    assert report.update_ratio[1] == pytest.approx(0.3, abs=1e-5)
    assert "0.3 times its size" in report.diagnosis[0]


def test_an_update_no_pitfall_explains_still_reports_its_numbers():
    def padding_counted(model, optimizer, micro_batches, loss_fn, ctx):
        for batch in micro_batches:  # each micro-batch's mean over its padded size
            loss_sum, _ = loss_fn(model, batch)
            (loss_sum / batch["labels"].numel() / ctx.grad_accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad()

    def with_bias():
        # With a bias the gradients span two directions, so a wrong weighting shows in the direction too.
        torch.manual_seed(0)
        return torch.nn.Linear(1, 2)

    report = check_accumulation(padding_counted, with_bias, MICRO_BATCHES, LOSS)
    # One diagnosis for both process counts (issue 21), with each count's numbers.
    assert report.labels == ("no known pitfall matches",) and len(report.diagnosis) == 1
    assert report.diagnosis[0].startswith("no known pitfall matches: with 1 process, gradient ratio 0.6687")
    assert "(GA=4); with 2 processes, gradient ratio" in report.diagnosis[0]
    assert report.details[1].cosine < 1 - 1e-5


# --- plain assert, repr and str --------------------------------------------------------------------


def test_plain_assert_passes_and_fails_with_the_diagnosis():
    assert check_accumulation(token_normalised, SEQ.make_model, MICRO_BATCHES, LOSS)
    with pytest.raises(AssertionError, match="divided by GA twice"):
        assert check_accumulation(divided_twice, SEQ.make_model, MICRO_BATCHES, LOSS)


def test_repr_leads_with_the_diagnosis_and_str_has_everything():
    report = check(sum_of_means)
    text = repr(report)
    # pytest shows only about the first 120 characters of a long repr: the labels come first.
    assert text[:118].startswith("AccumulationReport(FAILED: loss not divided by GA; mean of micro-batch means")
    assert "\n" not in text and "2 processes GA=2" in text and "tol 0.0001" in text
    full = str(report)
    assert full.startswith("check_accumulation FAILED (relative tol 0.0001, largest relative distance")
    assert "1 process (GA=4): FAILED" in full and "2 processes (GA=2): FAILED" in full
    assert "diagnosis:\n  - loss not divided by GA: " in full
    assert repr(check(token_normalised)).startswith("AccumulationReport(passed | 1 process GA=4: gradient ")


def test_the_documented_example_runs(capsys):
    page = Path(__file__).resolve().parents[1] / "docs" / "check_accumulation.md"
    example = re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)
    exec(compile(example, str(page), "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.startswith("check_accumulation passed (relative tol 0.0001")


# --- misuse ------------------------------------------------------------------------------------


def plain_model():
    return SEQ.make_model()


@pytest.mark.parametrize(("args", "kwargs", "error", "message"), [
    (("not callable", plain_model, MICRO_BATCHES, LOSS), {}, TypeError, "step must be a callable"),
    ((token_normalised, None, MICRO_BATCHES, LOSS), {}, TypeError, "make_model must be a callable"),
    ((token_normalised, plain_model, MICRO_BATCHES, 3), {}, TypeError, "loss_fn must be a callable"),
    ((token_normalised, plain_model, [], LOSS), {}, ValueError, "micro_batches must hold at least 1 micro-batch"),
    ((token_normalised, plain_model, iter(MICRO_BATCHES), LOSS), {}, TypeError,
     "micro_batches must be a list or tuple"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"num_processes": 3}, ValueError,
     "micro_batches holds 4 micro-batches, which num_processes=3 does not divide"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"num_processes": 0}, ValueError,
     r"num_processes must be in \[1, 64\], got 0"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"num_processes": (1, 2.0)}, TypeError,
     "num_processes must be an int, got float"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"num_processes": True}, TypeError,
     "num_processes must be an int, got bool"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"num_processes": ()}, ValueError,
     "num_processes must be a positive int or a non-empty tuple"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"num_processes": (2, 2)}, ValueError,
     "num_processes must not repeat a process count"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"tol": 0.0}, ValueError,
     r"tol must be in \(0.0, 0.01\], got 0.0"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"tol": -1e-6}, ValueError, r"tol must be in \(0.0, 0.01\]"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"tol": float("nan")}, ValueError,
     "tol must be a finite number"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"tol": 0.05}, ValueError,
     r"tol must be in \(0.0, 0.01\], got 0.05"),  # could not tell a 5 % error from a pass
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"make_optimizer": lambda p: None, "lr": 0.1}, ValueError,
     "lr applies to the default SGD only"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"make_optimizer": 3}, TypeError,
     "make_optimizer must be a callable"),
    ((token_normalised, plain_model, MICRO_BATCHES, LOSS), {"lr": 0}, ValueError,
     r"lr must be in \(0.0, 1000.0\], got 0.0"),
])
def test_bad_arguments_are_named(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        check_accumulation(*args, **kwargs)


def test_bad_models_are_refused():
    with pytest.raises(TypeError, match="make_model\\(\\) must return a torch.nn.Module, got str"):
        check(token_normalised, problem=type("P", (), {"make_model": staticmethod(lambda: "model"),
                                                       "loss_sum_and_count": staticmethod(LOSS)}))

    def frozen():
        model = SEQ.make_model()
        model.requires_grad_(False)
        return model

    with pytest.raises(ValueError, match="make_model\\(\\) built a model with no trainable parameter"):
        check_accumulation(token_normalised, frozen, MICRO_BATCHES, LOSS)
    with pytest.raises(ValueError, match="make_model\\(\\) built different initial weights on different calls"):
        check_accumulation(token_normalised, lambda: torch.nn.Linear(1, 2, bias=False), MICRO_BATCHES, LOSS)
    shared = SEQ.make_model()
    with pytest.raises(ValueError, match="make_model\\(\\) returned a model that shares parameters"):
        check_accumulation(token_normalised, lambda: shared, MICRO_BATCHES, LOSS)


@pytest.mark.parametrize(("loss_fn", "error", "message"), [
    (lambda model, batch: LOSS(model, batch)[0], TypeError,
     r"loss_fn\(model, micro_batches\[0\]\) must return \(summed_loss_tensor, number_of_targets\), got Tensor"),
    (lambda model, batch: (LOSS(model, batch)[0], 4.0), TypeError,
     r"loss_fn\(model, micro_batches\[0\]\)\[1\] \(the number of targets\) must be an int, got float"),
    (lambda model, batch: (1.5, 4), TypeError, r"micro_batches\[0\]\)\[0\] must be a floating-point tensor"),
    (lambda model, batch: (LOSS(model, batch)[0].detach(), 4), ValueError,
     "does not depend on the model's parameters"),
    (lambda model, batch: (LOSS(model, batch)[0], -1), ValueError, r"\(the number of targets\) must be >= 0, got -1"),
    (lambda model, batch: (LOSS(model, batch)[0], 0), ValueError, "loss_fn counts 0 targets in the whole window"),
])
def test_a_bad_loss_fn_is_named(loss_fn, error, message):
    with pytest.raises(error, match=message):
        check_accumulation(token_normalised, SEQ.make_model, MICRO_BATCHES, loss_fn)


def test_a_step_that_never_steps_is_refused():
    def no_step(model, optimizer, micro_batches, loss_fn, ctx):
        for batch in micro_batches:
            loss_fn(model, batch)[0].backward()

    with pytest.raises(ValueError, match=r"step never called optimizer.step\(\) \(rank 0 of 1, window 1\)"):
        check(no_step)


# --- a failing rank never leaves the others waiting ------------------------------------------------


def test_an_exception_on_one_rank_comes_back_with_its_rank():
    def fails_on_rank_1(model, optimizer, micro_batches, loss_fn, ctx):
        if ctx.rank == 1:
            raise ZeroDivisionError("boom")
        token_normalised(model, optimizer, micro_batches, loss_fn, ctx)  # rank 0 waits in all_reduce_sum

    with pytest.raises(AccumulationCheckError, match=r"step raised ZeroDivisionError on rank 1 of 2 \(window 1 of 2\)"
                                                     r": boom") as caught:
        check(fails_on_rank_1)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


def test_ranks_making_different_collective_calls_are_refused():
    def only_rank_0_gathers(model, optimizer, micro_batches, loss_fn, ctx):
        if ctx.rank == 0:
            ctx.all_reduce_sum(1)
        mean_of_means(model, optimizer, micro_batches, loss_fn, ctx)

    with pytest.raises(AccumulationCheckError, match=r"with 2 processes: the ranks made different collective calls "
                                                     r"at the same point \(rank 0 ctx.all_reduce_sum\(\), "
                                                     r"rank 1 gradient all-reduce\)"):
        check(only_rank_0_gathers)


def test_a_bad_all_reduce_value_is_named():
    def gathers_a_string(model, optimizer, micro_batches, loss_fn, ctx):
        ctx.all_reduce_sum("136")

    with pytest.raises(AccumulationCheckError, match=r"TypeError on rank 0 of 1 .*value must be an int, a float or "
                                                     r"a tensor, got str"):
        check(gathers_a_string, num_processes=1)


def test_a_rank_stuck_in_user_code_times_out(monkeypatch):
    import gaccum_check.collective
    import gaccum_check.ranks

    monkeypatch.setattr(gaccum_check.collective, "COLLECTIVE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(gaccum_check.ranks, "JOIN_TIMEOUT_S", 5.0)

    def rank_1_late(model, optimizer, micro_batches, loss_fn, ctx):
        if ctx.rank == 1:
            time.sleep(0.3)
        token_normalised(model, optimizer, micro_batches, loss_fn, ctx)

    with pytest.raises(AccumulationCheckError, match="rank 0 of 2 waited more than 0.05 s at a collective call"):
        check(rank_1_late, num_processes=2)

    monkeypatch.setattr(gaccum_check.ranks, "JOIN_TIMEOUT_S", 0.05)

    def stuck(model, optimizer, micro_batches, loss_fn, ctx):
        time.sleep(0.3)

    with pytest.raises(AccumulationCheckError, match="rank 0 of 1 has not returned from step after 0.05 s"):
        check(stuck, num_processes=1)


def test_window_two_uses_one_pass_over_the_window_only_where_the_loss_adds_up():
    """The reference's second window comes from one forward over the concatenated window only when that
    forward's loss equals the sum of the micro-batches' (shown at the initial weights); else one per micro-batch."""
    from gaccum_check.reference import _additive_whole

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    batches = [torch.randn(2, 3) for _ in range(4)]

    def summed(m, b):
        return m(b).pow(2).sum(), b.shape[0]

    def scaled_by_batch(m, b):  # each row's loss depends on how many rows share its batch (in-batch negatives)
        return m(b).pow(2).sum() * b.shape[0], b.shape[0]

    for loss_fn, additive in ((summed, True), (scaled_by_batch, False)):
        with torch.no_grad():
            losses = [loss_fn(model, b)[0] for b in batches]
        whole = _additive_whole(model, batches, loss_fn, losses, [2] * 4)
        assert (whole is not None) == additive
        if additive:
            assert torch.equal(whole, torch.cat(batches))
    assert _additive_whole(model, batches[:1], summed, [summed(model, batches[0])[0]], [2]) is None
