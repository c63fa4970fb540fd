"""Checks for the deep dives' exercises (07-12); gaccum_course.exercises.check dispatches to them.

Each checker computes the right answer with the library, as the core lessons' checkers do.
"""

from __future__ import annotations

from .feedback import Feedback


def _allreduce_cost_model() -> tuple[float, float, int]:
    """(rest of the update, one all-reduce) in ms, and GA, from the saved all-reduce benchmark.

    Without ``no_sync`` an update does GA all-reduces, with it one, and otherwise the same work:
    ``without = rest + GA * one`` and ``with = rest + one``.
    """
    from .benchmarks import load

    allreduce = load()["allreduce"]
    ga = allreduce["grad_accum_steps"]
    with_no_sync, without = allreduce["ms_per_update"]["no_sync"], allreduce["ms_per_update"]["every_micro_batch"]
    one_allreduce = (without - with_no_sync) / (ga - 1)
    return with_no_sync - one_allreduce, one_allreduce, ga


def _allreduce_ratio_directions(answer) -> Feedback:
    if isinstance(answer, str) or len(answer) != 2:
        raise ValueError("give two words, the 10x faster link first, then the 10x slower, e.g. ('larger', 'larger')")
    words = [str(a).strip().lower() for a in answer]
    if not set(words) <= {"larger", "smaller"}:
        raise ValueError("each answer must be 'larger' or 'smaller'")
    rest, one_allreduce, ga = _allreduce_cost_model()

    def ratio(allreduce_ms):  # time per update without no_sync / with it
        return (rest + ga * allreduce_ms) / (rest + allreduce_ms)

    faster_link, slower_link = ratio(one_allreduce / 10), ratio(one_allreduce * 10)
    expected = ["larger" if r > ratio(one_allreduce) else "smaller" for r in (faster_link, slower_link)]
    if words == expected:
        return Feedback(True, f"correct! with the saved times ({rest:.1f} ms of other work, {one_allreduce:.1f} ms "
                              f"per all-reduce) the ratio {ratio(one_allreduce):.2f} becomes {faster_link:.2f} "
                              f"with a 10x faster all-reduce and {slower_link:.2f} with a 10x slower one")
    return Feedback(False, "not quite: the ratio is (other work + GA all-reduces) / (other work + 1 all-reduce); "
                           "what happens to it when each all-reduce gets cheaper, or dearer?")


def _allreduce_ms(answer) -> Feedback:
    estimate = float(answer)
    rest, one_allreduce, ga = _allreduce_cost_model()
    if abs(estimate - one_allreduce) <= 0.02 * one_allreduce:
        return Feedback(True, f"correct! (without - with no_sync) / (GA - 1) = {one_allreduce:.1f} ms per all-reduce; "
                              f"the other {rest:.1f} ms of an update is the rest of the work")
    return Feedback(False, f"not quite: the two times differ by GA - 1 = {ga - 1} all-reduces, and both include "
                           "the same compute")


def _naive_overweight_at_ga16(answer) -> Feedback:
    """12.1: GA 16, one row a micro-batch: the naive 1/16 over the shortest row's share of the update's targets."""
    from gaccum_lib.lm import tiny_lm

    lengths = tiny_lm(64).lengths[:16]  # the first update's rows
    targets = [length - 1 for length in lengths]
    right = (1 / 16) / (min(targets) / sum(targets))
    answer = float(answer)
    if abs(answer - right) < 0.01 * right:
        return Feedback(True, f"correct! {sum(targets)} targets in the update, {min(targets)} in the shortest row: "
                              f"its share is {min(targets)}/{sum(targets)}, the naive loop gives it 1/16, "
                              f"{right:.2f} times as much")
    if abs(answer - 1 / right) < 0.01 / right:
        return Feedback(False, "not quite: that is the full-batch weight over the naive one; the question is the "
                               "other way round")
    before = (1 / 16) / (min(lengths) / sum(lengths))
    if abs(answer - before) < 0.01 * before:
        return Feedback(False, "not quite: count targets after the shift, L - 1 per row")
    return Feedback(False, "not quite: the full batch weighs a row by its targets over the update's targets "
                           "(after the shift); the naive loop by 1/16")


def _last_update_targets(answer) -> Feedback:
    """12.2: 22 rows, 2 processes, micro-batches of 2, GA 4: the last update's targets, even_batches vs padded."""
    from gaccum_lib.lm import tiny_lm
    from gaccum_lib.sharding import plan_windows

    if not isinstance(answer, tuple | list) or len(answer) != 2:
        raise TypeError("give a pair (plain, padded), e.g. (500, 400)")
    lengths = tiny_lm(22).lengths
    plain_plan = plan_windows(22, micro_batch_size=2, grad_accum_steps=4, num_processes=2)  # even_batches, on
    plain = sum(lengths[i] - 1 for rank in plain_plan[-1] for batch in rank for i in batch)
    padded = sum(length - 1 for length in lengths[16:])  # rows 16-21; the rows without targets add none
    plain_answer, padded_answer = (int(x) for x in answer)
    if (plain_answer, padded_answer) == (plain, padded):
        return Feedback(True, f"correct! {plain} from the plain DataLoader, which tops rank 1 up with rows 0 and 1 "
                              f"again, {padded} from padded_loader, rows 16-21 only")
    if (plain_answer, padded_answer) == (padded, plain):
        return Feedback(False, "not quite: the other way round; which loader repeats rows?")
    if padded_answer != padded:
        return Feedback(False, "not quite: padded_loader's last update holds the rows after the first update's 16, "
                               "each with L - 1 targets")
    return Feedback(False, "not quite: 11 micro-batches for 2 processes: rank 1 is one short, and the plain "
                           "DataLoader fills it from the start of the data")


def _scheduler_steps_three_processes(answer) -> Feedback:
    from gaccum_lib.schedule import schedule_length

    right = schedule_length("updates", 1000, 8, 3, epochs=2)
    if int(answer) == right:
        return Feedback(True, f"correct! 2 x 3 x ceil(ceil(1000 / 3) / 8) = 2 x 3 x 42 = {right}")
    if int(answer) == schedule_length("usual_rule", 1000, 8, 3, epochs=2):
        return Feedback(False, "not quite: that is the usual ceil(L / GA) rule; each rank gets ceil(1000 / 3) "
                               "batches and makes ceil(that / 8) updates, and each update steps 3 times")
    return Feedback(False, "not quite: N x ceil(ceil(L / N) / GA) per epoch, with L = 1000, GA = 8, N = 3")


def _scheduler_steps_split_batches(answer) -> Feedback:
    """09.2: exercise 1's run with split_batches and the same global batch: ceil(1000 / 3) loader batches, seen by
    every rank, one scheduler step per update."""
    import math

    from gaccum_lib.schedule import schedule_length

    loader_batches = math.ceil(1000 / 3)  # each batch of the loader holds 3 of the old ones
    right = schedule_length("updates", loader_batches, 8, 1, epochs=2)  # split_batches: as on one process
    if int(answer) == right:
        return Feedback(True, f"correct! every rank sees all {loader_batches} batches (a third of each): "
                              f"ceil({loader_batches} / 8) = {right // 2} updates an epoch, one scheduler step "
                              "each; the same training as exercise 1, a third of its steps")
    if int(answer) == schedule_length("updates", 1000, 8, 3, epochs=2):
        return Feedback(False, "not quite: that is exercise 1's count; with split_batches each update steps the "
                               "scheduler once, not once per process")
    if int(answer) == schedule_length("usual_rule", 1000, 8, 1, epochs=2):
        return Feedback(False, "not quite: the loader no longer has 1000 batches: each of its batches holds 3 of the "
                               "old ones")
    return Feedback(False, "not quite: with split_batches every rank sees every batch of the loader (a part of each) "
                           "and each update steps the scheduler once: epochs x ceil(len(loader) / GA)")


def _gpt2_trainer_fraction(answer) -> Feedback:
    """08.1: 4 rows of 10 tokens on rank 0, 4 of 40 on rank 1, GA 1: the Trainer's count, gathered, is the labels of
    all 8 rows; the loss sums over their targets, one fewer a row."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from gaccum_lib.real_stack import collate, fixed_length_rows, targets_after_shift, tiny_causal_lm

    answer = float(answer)
    ranks = [collate(fixed_length_rows(4, 10)), collate(fixed_length_rows(4, 40))]  # each rank's micro-batch
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="gaccum-08-"), use_cpu=True, report_to="none")
    trainer = Trainer(model=tiny_causal_lm("gpt2"), args=args, data_collator=collate)
    labels = int(trainer.get_batch_samples(iter(ranks), 2, "cpu")[1])  # both ranks' rows: the gathered count
    targets = sum(targets_after_shift(batch) for batch in ranks)
    per_rank = [targets_after_shift(b) / int(trainer.get_batch_samples(iter([b]), 1, "cpu")[1]) for b in ranks]
    if abs(answer - targets / labels) < 1e-3:
        return Feedback(True, f"correct! {targets} targets / {labels} labels = {targets / labels:.2f}: one count "
                              "for the whole update, gathered over both processes")
    if abs(answer - sum(per_rank) / 2) < 1e-3 or any(abs(answer - f) < 1e-3 for f in per_rank):
        return Feedback(False, "not quite: that is one process's fraction, or their mean; the Trainer gathers one "
                               "count over both processes, so count targets and labels over all 8 rows")
    if abs(answer - labels / targets) < 1e-3:
        return Feedback(False, "not quite: that is labels / targets; the Trainer divides by the larger count, "
                               "so the update is shorter, not longer")
    return Feedback(False, "not quite: the Trainer divides by the labels (10 or 40 a row), the loss sums over the "
                           "targets after the shift (one fewer a row)")


def _collate_with_shift_labels(answer) -> Feedback:
    """08.2: the learner's collate, judged by the count a real Trainer takes around the default GPT-2, and the loss."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from gaccum_lib.real_stack import collate, targets_after_shift, tiny_causal_lm, variable_length_rows

    if not callable(answer):
        raise TypeError(f"give your function itself, my_collate(rows), not a {type(answer).__name__}")
    rows = variable_length_rows(16)
    groups = [rows[i:i + 2] for i in range(0, 16, 2)]
    window = [answer(group) for group in groups]
    if not all(isinstance(batch, dict) and "shift_labels" in batch for batch in window):
        return Feedback(False, "not quite: my_collate must return collate(rows)'s batch with a 'shift_labels' entry")
    model = tiny_causal_lm("gpt2")  # no loss_type: without shift_labels the Trainer counts every label
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="gaccum-08-"), use_cpu=True, report_to="none")
    _, count = Trainer(model=model, args=args, data_collator=answer).get_batch_samples(iter(window), 8, "cpu")
    targets = sum(targets_after_shift(collate(group)) for group in groups)
    if int(count) != targets:
        return Feedback(False, f"not quite: the Trainer counts {int(count)}, the loss averages over {targets}; "
                               "hint: shift_labels[:, t] is the label position t predicts, labels[:, t + 1]")
    try:
        with torch.no_grad():
            gaps = [abs(float(model(**batch).loss) - float(model(**collate(group)).loss))
                    for batch, group in zip(window, groups, strict=True)]
    except (RuntimeError, ValueError):
        return Feedback(False, "not quite: the loss cannot use these shift_labels: they need the shape of labels, "
                               "with -100 at the last position")
    if max(gaps) > 1e-5:
        return Feedback(False, "not quite: the count is right but the loss is not collate's: shift_labels[:, t] must "
                               "be labels[:, t + 1], and -100 at the last position")
    return Feedback(True, f"correct! the Trainer counts {targets} targets after the shift, and the loss is unchanged")


def _fsdp_gradient_gib(answer) -> Feedback:
    """10.1: 8e9 bf16 gradients: the whole gradient with sync off, a 1/8 shard with sync on."""
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        raise TypeError("give a pair (sync_off_gib, sync_on_gib), e.g. (10.0, 2.5)")
    off, on = (float(x) for x in answer)
    whole = 8e9 * 2 / 2**30
    if abs(off - whole) < 0.02 * whole and abs(on - whole / 8) < 0.02 * whole / 8:
        return Feedback(True, f"correct! {whole:.1f} GiB of unsharded gradient with sync off, a {whole / 8:.2f} GiB "
                              "shard with sync on: the unsharded one does not shrink with more GPUs")
    if abs(off - 16) < 0.2 and abs(on - 2) < 0.05:
        return Feedback(False, "not quite: those are GB (10^9 bytes); a GiB is 2^30 bytes")
    if abs(on - whole) < 0.02 * whole and abs(off - whole / 8) < 0.02 * whole / 8:
        return Feedback(False, "not quite: the other way round; with sync off the process keeps the whole gradient")
    return Feedback(False, "not quite: sync off keeps every weight's gradient (8e9 x 2 bytes) on each GPU; sync on "
                           "keeps that GPU's shard, 1/8 of it")


def _deepspeed_double_division(answer) -> Feedback:
    """10.2: loss / N / GA, then the engine's / GA and the mean over 2 processes: 1 / (GA^2 P) of the right one."""
    answer = float(answer)
    if abs(answer - 1 / 32) < 1e-4:
        return Feedback(True, "correct! 1/32: divided by GA twice (yours and the engine's) and averaged over 2 "
                              "processes without the x P; the right loss is loss_sum x GA x P / N")
    if abs(answer - 1 / 16) < 1e-4:
        return Feedback(False, "not quite: GA twice is 1/16; what does averaging over the 2 processes add?")
    if abs(answer - 1 / 8) < 1e-4 or abs(answer - 1 / 4) < 1e-4:
        return Feedback(False, "not quite: engine.backward divides by GA too, on top of the loop's own / GA")
    return Feedback(False, "not quite: follow the loss: the loop's / N / GA, the engine's / GA, DDP's mean over "
                           "processes; compare with the full batch's loss_sum / N")


def _bnpo_short_token_weight(answer) -> Feedback:
    """11.1: bnpo, completions of 2 and 6 tokens, GA 2, one each a micro-batch: a short token's weight is
    1 / (2 x GA) = 1/4 against 1/8 in the full batch, 2 times."""
    answer = float(answer)
    full, short, long = 1 / 8, 1 / (2 * 2), 1 / (6 * 2)  # per token: full batch 1/8; micro-batch mean / GA
    if abs(answer - short / full) < 0.01:
        return Feedback(True, f"correct! {short / full:g} times: its micro-batch divides by its own 2 tokens (then "
                              f"by GA), where the full batch divides by all 8; the long completion's tokens get "
                              f"{long / full:.2f} times theirs")
    if abs(answer - 2 * short / full) < 0.01:
        return Feedback(False, "not quite: bnpo's micro-batch loss is divided by GA before backward, as "
                               "accelerator.backward does")
    if abs(answer - long / full) < 0.01:
        return Feedback(False, "not quite: that is a token of the long completion; the short one's micro-batch "
                               "holds 2 tokens")
    if abs(answer - full / short) < 0.01:
        return Feedback(False, "not quite: the other way round; the short completion's tokens weigh more")
    return Feedback(False, "not quite: the full batch divides the summed loss by all 8 tokens; at GA 2 each "
                           "micro-batch divides by its own tokens, then by GA")


def _gradcache_negatives(answer) -> Feedback:
    """11.2: 256 pairs at GA 8: 32 pairs a micro-batch, 31 negatives each; GradCache's window loss: 255."""
    if not isinstance(answer, tuple | list) or len(answer) != 2:
        raise TypeError("give a pair (as_is, with_gradcache), e.g. (10, 100)")
    as_is, cached = (int(x) for x in answer)
    if (as_is, cached) == (31, 255):
        return Feedback(True, "correct! 32 pairs a micro-batch leave 31 negatives each; GradCache computes the "
                              "window's loss, with all 255 others")
    if (as_is, cached) == (32, 256):
        return Feedback(False, "not quite: an image's own text is its positive, not a negative")
    if (as_is, cached) == (255, 31):
        return Feedback(False, "not quite: the other way round; GradCache's loss sees the whole window")
    return Feedback(False, "not quite: a micro-batch holds 256 / 8 pairs; an image's negatives are the texts of "
                           "its batch but its own")


DEEP_DIVE_CHECKS = {
    "07.2": _allreduce_ms,
    "07.3": _allreduce_ratio_directions,
    "08.1": _gpt2_trainer_fraction,
    "08.2": _collate_with_shift_labels,
    "09.1": _scheduler_steps_three_processes,
    "09.2": _scheduler_steps_split_batches,
    "10.1": _fsdp_gradient_gib,
    "10.2": _deepspeed_double_division,
    "11.1": _bnpo_short_token_weight,
    "11.2": _gradcache_negatives,
    "12.1": _naive_overweight_at_ga16,
    "12.2": _last_update_targets,
}
