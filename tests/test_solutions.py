"""Every exercise with a check cell has a tested solution and its checker can say no.

The numbers solutions/README.md states are recomputed with the library, so the README cannot drift.
"""

import json
import re
import sys
from pathlib import Path

import pytest

from gaccum_course.exercises import CHECKS, check

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "solutions"))
from answers import ANSWERS  # noqa: E402


def _naive_accumulation_step(model, optimizer, micro_batches, loss_fn, ctx):
    for batch in micro_batches:
        loss_sum, num_targets = loss_fn(model, batch)
        ctx.backward(loss_sum / num_targets)  # each micro-batch's own mean
    optimizer.step()
    optimizer.zero_grad()


def _collate_without_shift_labels(rows):
    from gaccum_lib.real_stack import collate

    return collate(rows)


WRONG = {"00.2": 2, "01.1": 2.04, "01.2": 1.9992, "02.2": 1, "03.1": 0.0178,
         "03.2": [1, 2, 3, 4, 5, 6, 7, 8], "04.1": 52,
         "05.1": 1835, "05.2": _naive_accumulation_step, "06.2": "no update",
         "07.2": 34.8, "07.3": ("larger", "larger"),
         "08.1": 0.9375, "08.2": lambda rows: _collate_without_shift_labels(rows),
         "09.1": 250, "09.2": 252, "10.1": (16, 2), "10.2": 1 / 16,  # 07.2: the slower time / GA, other work included
         "11.1": 4, "11.2": (32, 256),
         "12.1": 0.25, "12.2": (324, 408)}


def _check_cells():
    ids = set()
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            ids |= set(re.findall(r'check\("(\d\d\.\d)"', "".join(cell["source"])))
    return ids


def test_every_check_cell_has_a_checker_and_a_solution():
    used = _check_cells()
    assert used <= set(CHECKS), used - set(CHECKS)
    assert used <= set(ANSWERS), used - set(ANSWERS)


@pytest.mark.parametrize("exercise", sorted(ANSWERS))
def test_solution_is_accepted(exercise):
    assert check(exercise, ANSWERS[exercise], quiet=True)


@pytest.mark.parametrize("exercise", sorted(WRONG))
def test_a_wrong_answer_is_rejected_with_a_hint(exercise):
    feedback = check(exercise, WRONG[exercise], quiet=True)
    assert not feedback
    assert feedback.message.startswith(("not quite", "not yet"))


def test_no_answer_and_nonsense_answers():
    assert check("03.2", None, quiet=True).message.startswith("no answer yet")
    assert check("04.1", "many", quiet=True).message.startswith("that answer cannot be checked")
    assert check("07.3", "smaller", quiet=True).message.startswith("that answer cannot be checked")
    assert check("07.3", ("smaller", "faster"), quiet=True).message.startswith("that answer cannot be checked")
    assert check("05.2", 3, quiet=True).message.startswith("that answer cannot be checked: give your function")
    with pytest.raises(ValueError, match="exercise must be one of"):
        check("99.9", 1)


def test_the_solutions_readme_answers_every_exercise():
    text = (ROOT / "solutions" / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"## {path.stem}" in text, f"solutions/README.md has no section for {path.name}"


# ----------------------------------------------------------------------------------------------
# The numbers solutions/README.md states, recomputed: the README cannot drift from the library.
# ----------------------------------------------------------------------------------------------

def _readme_section(lesson: str) -> str:
    """The README's section for lesson "NN", whitespace collapsed (the prose wraps anywhere)."""
    text = (ROOT / "solutions" / "README.md").read_text()
    section = re.search(rf"^## {lesson}_.*?(?=^## |\Z)", text, re.M | re.S).group(0)
    return " ".join(section.split())


def _numbers_00():
    from gaccum_lib import simulate, toy_regression

    problem = toy_regression()
    unscaled = simulate(problem, "sum_of_means", grad_accum_steps=4, micro_batch_size=2, lr=0.02).final_weights[0]
    full = simulate(problem, "full_batch", grad_accum_steps=4, micro_batch_size=2, lr=0.02).final_weights[0]
    factor = unscaled / full
    assert factor == pytest.approx(ANSWERS["00.2"])
    return [f"**{factor:.0f}x** larger (w = {unscaled:.2f})", f"{factor:.0f} times"]


def _numbers_01():
    import torch

    from gaccum_lib import simulate, toy_regression

    problem = toy_regression()
    runs = {s: simulate(problem, s, grad_accum_steps=3, micro_batch_size=3, lr=0.02).final_weights[0]
            for s in ("mean_of_means", "full_batch")}
    ga, last_size = 3, len(problem.micro_batch_indices(3)[-1])
    model = problem.make_model()  # exercise 2: two updates of the plain loop, no zero_grad() between them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    weights, gradients = [], []
    for _ in range(2):
        for indices in problem.micro_batch_indices(2):
            x, y = problem.batch_of(indices)
            (torch.nn.functional.mse_loss(model(x), y) / 4).backward()
        gradients.append(model.weight.grad.item())  # what .grad holds at the step
        optimizer.step()
        weights.append(model.weight.item())
    with_zero_grad = simulate(problem, "mean_of_means", grad_accum_steps=4, micro_batch_size=2, lr=0.02,
                              epochs=2).weights[2, 0]
    assert weights[1] == pytest.approx(ANSWERS["01.2"], abs=1e-4)
    own = gradients[1] - gradients[0]
    return [f"`my_weight = {ANSWERS['01.1']}`", f"by 1/{ga}", f"the {last_size} points",
            f"1/{ga * last_size} each instead of 1/{len(problem)}",
            f"w = {runs['mean_of_means']:.4f} against the full batch's {runs['full_batch']:.4f}",
            f"w = {weights[1]:.4f}** (`my_weight_2 = {ANSWERS['01.2']}`), against {with_zero_grad:.4f} with it",
            f"the first update's gradient, {gradients[0]:.0f}, when the second update adds its own, {own:.2f}",
            f"at w = {weights[0]:.2f} the gradient is {own / (weights[0] - 2):.0f} × (w - 2)",
            f"0.02 × {-gradients[1]:.2f} = {weights[1] - weights[0]:.4f} forward instead of "
            f"{weights[0] - with_zero_grad:.4f} back"]


def _accumulate_loop_weight(short_window_factor: float) -> float:
    """Lesson 02's accumulate() loop on a real Accelerator, 22 points, the short last window's losses scaled."""
    import torch
    from accelerate import Accelerator

    from gaccum_lib import reset_accelerate_state, toy_regression

    problem = toy_regression(num_points=22)
    reset_accelerate_state(quiet=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = problem.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.002)
    loader = torch.utils.data.DataLoader(problem, batch_size=2, collate_fn=problem.collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    last_window_start = len(loader) // 4 * 4
    for i, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            scale = short_window_factor if i >= last_window_start else 1.0
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y) * scale)
            optimizer.step()
            optimizer.zero_grad()
    weight = model.weight.item()
    reset_accelerate_state(quiet=True)
    return weight


def _numbers_02():
    from gaccum_lib import simulate, toy_regression
    from gaccum_lib.sharding import split_windows

    last_window = split_windows(toy_regression(num_points=22).micro_batch_indices(2), 4)[-1]
    full = simulate(toy_regression(num_points=22), "full_batch", grad_accum_steps=4, micro_batch_size=2,
                    lr=0.002).final_weights[0]
    scaled, unscaled = _accumulate_loop_weight(ANSWERS["02.2"]), _accumulate_loop_weight(1.0)
    assert scaled == pytest.approx(full, abs=1e-5)
    return [f"(here 4 / {len(last_window)}, about {4 / len(last_window):.2f};", "`my_factor = 4 / 3`",
            f"full batch's w = {scaled:.5f}", f"without it at {unscaled:.5f}"]


def _numbers_09():
    import math

    from gaccum_lib import schedule

    per_rank = math.ceil(1000 / 3)
    updates = math.ceil(per_rank / 8)
    total = schedule.schedule_length("updates", 1000, 8, 3, epochs=2)
    assert total == ANSWERS["09.1"] == 2 * 3 * updates
    split = schedule.schedule_length("updates", per_rank, 8, 1, epochs=2)  # split_batches: as on one process
    assert split == ANSWERS["09.2"] == 2 * updates
    return [f"**{total} scheduler steps**", f"`ceil(1000 / 3) = {per_rank}`", f"`ceil({per_rank} / 8) = {updates}`",
            f"{3 * updates} steps an epoch",
            f"rule says {schedule.schedule_length('usual_rule', 1000, 8, 3, epochs=2)}",
            f"**{split} scheduler steps** (`my_split_steps = {ANSWERS['09.2']}`)", f"{split} in two epochs",
            f"a `total_steps` of {total} carried over",
            f"`launch_count(3, {per_rank}, 8, split_batches=True)` ends one epoch at {updates}"]


def _numbers_08():
    rows = [10] * 4 + [40] * 4  # rank 0's rows, then rank 1's
    labels, targets = sum(rows), sum(n - 1 for n in rows)
    assert ANSWERS["08.1"] == pytest.approx(targets / labels)
    own = [9 / 10, 39 / 40]
    return [f"**{targets / labels:.2f}** (`my_fraction = {ANSWERS['08.1']}`)", f"4 x 10 + 4 x 40 = {labels} labels",
            f"4 x 9 + 4 x 39 = {targets}", f"{targets} / {labels} = {targets / labels:.2f}",
            f"({own[0]:g} and {own[1]:g}, mean {sum(own) / 2:g})", f"mean row length ({labels // len(rows)} here)"]


def _numbers_03():
    import numpy as np

    from gaccum_lib import count_target_tokens, seed_sequences, simulate

    problem = seed_sequences(8)

    def targets(size):
        return [count_target_tokens(problem.batch_of(ix)["labels"]) for ix in problem.micro_batch_indices(size)]

    def naive_error(ga):
        kwargs = dict(grad_accum_steps=ga, micro_batch_size=8 // ga, lr=0.08)
        naive, full = (simulate(problem, s, **kwargs).final_weights for s in ("mean_of_means", "full_batch"))
        return float(np.abs(naive - full).max())

    pairs, halves = targets(2), targets(4)
    assert ANSWERS["03.1"] == pytest.approx(naive_error(4), abs=5e-5)
    fold = {5: "five"}[max(pairs) / min(pairs)]
    order = ANSWERS["03.2"]
    per_pair = {a + b for a, b in zip(order[0::2], order[1::2], strict=True)}
    assert len(per_pair) == 1
    return [", ".join(map(str, pairs[:-1])) + f" and {pairs[-1]} targets",
            f"a {fold}-fold spread ({max(pairs)} / {min(pairs)})",
            f"{max(halves) / min(halves):.1f}-fold ({max(halves)} / {min(halves)})",
            f"{naive_error(4):.4f} against {naive_error(2):.4f} for GA = 2",
            f"`my_distance = {ANSWERS['03.1']:.4f}`", f"below GA = 8's {naive_error(8):.4f}",
            f"`{order}`", f"each hold {per_pair.pop()} targets"]


def _numbers_04():
    from gaccum_lib import seed_sequences, simulate

    problem = seed_sequences(32)
    counts = simulate(problem, "token_normalised", grad_accum_steps=2, micro_batch_size=4,
                      num_processes=4).token_counts[0]
    assert counts[1] == ANSWERS["04.1"]

    def items(first, last):
        lengths = problem.lengths[first:last + 1]
        return f"({' + '.join(map(str, lengths))} = {sum(lengths)})"

    # The launch's data with 4 processes (lesson 04: a third micro-batch a rank): the second, short update.
    second = simulate(seed_sequences(48), "token_normalised", grad_accum_steps=2, micro_batch_size=4,
                      num_processes=4).token_counts[1].tolist()
    return [f"**Rank 1 counts {counts[1]} targets**", f"items 4-7 {items(4, 7)} and 20-23 {items(20, 23)}",
            f"local counts are {counts.tolist()}, {counts.sum()} in total",
            f"({', '.join(map(str, second[:-1]))} and {second[-1]} targets of {sum(second)})"]


def _numbers_05():
    from gaccum_lib.lm import count_targets_before_shift, tiny_lm

    problem = tiny_lm(32)
    before = count_targets_before_shift(problem.batch_of(range(len(problem))))
    assert problem.num_targets == ANSWERS["05.1"]
    return [f"**{problem.num_targets} targets**: the {len(problem)} rows hold {before} characters",
            f"{before} is the count before the shift"]


def _numbers_06():
    from gaccum_lib import seed_sequences, simulate

    problem = seed_sequences(24)
    lonely, grouped = (simulate(problem, "mean_of_means", grad_accum_steps=2, micro_batch_size=4, num_processes=n)
                       for n in (1, 2))
    words = {2: "two", 3: "three"}
    return [ANSWERS["06.2"], f"sees all {len(problem)}",
            f"{len(problem.micro_batch_indices(4))} micro-batches of 4, GA = 2: {words[lonely.num_updates]} updates",
            f"short one of 1, {words[grouped.num_updates]} updates",
            f"is {lonely.num_updates} for `n=1` and {grouped.num_updates} for `n=2`"]


def _numbers_07():
    from gaccum_course import benchmarks

    allreduce = benchmarks.load()["allreduce"]
    ga = allreduce["grad_accum_steps"]
    with_no_sync, without = allreduce["ms_per_update"]["no_sync"], allreduce["ms_per_update"]["every_micro_batch"]
    one = (without - with_no_sync) / (ga - 1)
    rest = with_no_sync - one

    def ratio(allreduce_ms):
        return (rest + ga * allreduce_ms) / (rest + allreduce_ms)

    assert ratio(one) == pytest.approx(allreduce["every_micro_batch_over_no_sync"])
    assert ANSWERS["07.2"] == pytest.approx(one, rel=0.02)
    nvlink, two_machines = ANSWERS["07.3"]
    return [f'`my_directions = ("{nvlink}", "{two_machines}")`',
            f"({rest:.1f} ms of other work, {one:.1f} ms per all-reduce, GA = {ga})",
            f"the measured {ratio(one):.2f} becomes {ratio(one / 10):.2f} if every all-reduce is 10 times faster",
            f"and {ratio(one * 10):.2f} if it is 10 times slower",
            f"**About {one:.1f} ms per all-reduce** (`my_allreduce_ms = {ANSWERS['07.2']}`)",
            f"{without:.1f} ms without `no_sync` and {with_no_sync:.1f} ms with it",
            f"differ by GA - 1 = {ga - 1} all-reduces", f"({without:.1f} - {with_no_sync:.1f}) / {ga - 1} ms",
            f"Dividing {without:.1f} ms by {ga} ({without / ga:.1f} ms)"]


def _numbers_10():
    gib = 8e9 * 2 / 2**30
    assert ANSWERS["10.1"] == (round(gib, 1), round(gib / 8, 2))
    return [f"**{gib:.1f} GiB with sync off, {gib / 8:.2f} GiB with sync on**", "8 x 10^9 x 2 bytes / 2^30",
            f"**1/{round(1 / ANSWERS['10.2'])}**", "`loss_sum x GA x P / N`"]


def _numbers_11():
    import torch

    from gaccum_check import check_accumulation
    from gaccum_lib import unaccumulable
    from gaccum_lib.rl_losses import aggregate

    mask = (torch.arange(8) < torch.tensor([[2], [6]])).double()  # completions of 2 and 6 tokens

    def token_weights(micro_batches):  # d(update) / d(each token's loss), bnpo divided by GA
        token_loss = torch.ones(2, 8, dtype=torch.float64, requires_grad=True)
        for rows in micro_batches:
            loss = aggregate("bnpo", token_loss[rows], mask[rows], max_completion_length=8)
            (loss / len(micro_batches)).backward()
        return token_loss.grad

    full, split = token_weights([[0, 1]]), token_weights([[0], [1]])
    short, long = float(split[0, 0] / full[0, 0]), float(split[1, 0] / full[1, 0])
    assert short == pytest.approx(ANSWERS["11.1"])
    negatives = (256 // 8 - 1, 256 - 1)
    assert ANSWERS["11.2"] == negatives

    def summed_step(model, optimizer, micro_batches, loss_fn, ctx):  # the lesson's loop
        window_rows = ctx.all_reduce_sum(sum(len(b["x"]) for b in micro_batches))
        for batch in micro_batches:
            ctx.backward(loss_fn(model, batch)[0] * ctx.grad_accum_steps * ctx.num_processes / window_rows)
        optimizer.step()
        optimizer.zero_grad()

    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    rows = [{"x": x[i:i + 8], "y": x[i:i + 8].sum(1, keepdim=True)} for i in range(0, 32, 8)]
    report = check_accumulation(summed_step, lambda: unaccumulable.norm_net("batch").eval(), rows,
                                lambda model, b: ((model(b["x"]) - b["y"]).pow(2).sum(), len(b["x"])))
    assert report and report.labels == ()
    return [f"**{short:g} times**", f"1/{round(1 / float(split[1, 0]))}, {long:.2f} times theirs",
            f"**{negatives[0]} and {negatives[1]}**", "256 / 8 = 32 pairs",
            "**check_accumulation passed, with no label**"]


def _numbers_12():
    from gaccum_lib.lm import tiny_lm

    first = tiny_lm(64).lengths[:16]
    targets, shortest, longest = sum(first) - 16, min(first), max(first)
    assert targets / (16 * (shortest - 1)) == pytest.approx(ANSWERS["12.1"], rel=0.01)
    lengths = tiny_lm(22).lengths
    padded = sum(lengths[16:]) - 6
    assert ANSWERS["12.2"] == (padded + lengths[0] + lengths[1] - 2, padded)
    return [f"**{ANSWERS['12.1']:.1f} times**", f"16 rows hold {targets} targets", f"{shortest} characters, holds "
            f"{shortest - 1} of them", f"{targets} / (16 x {shortest - 1}) = {ANSWERS['12.1']:.1f}",
            f"({longest} characters, {longest - 1} targets) gets {targets / (16 * (longest - 1)):.2f} times",
            f"rows 16-21, {padded} targets", f"rows 0 and 1 ({lengths[0] - 1} + {lengths[1] - 1} targets): "
            f"{ANSWERS['12.2'][0]}"]


README_NUMBERS = {"00": _numbers_00, "01": _numbers_01, "02": _numbers_02, "03": _numbers_03, "04": _numbers_04,
                  "05": _numbers_05, "06": _numbers_06, "07": _numbers_07, "08": _numbers_08,
                  "09": _numbers_09, "10": _numbers_10, "11": _numbers_11, "12": _numbers_12}


def test_the_readme_numbers_cover_every_lesson():
    lessons = {path.name[:2] for path in (ROOT / "notebooks").glob("*.ipynb")}
    assert lessons == set(README_NUMBERS)


@pytest.mark.parametrize("lesson", sorted(README_NUMBERS))
def test_the_solutions_readme_states_the_recomputed_numbers(lesson):
    section = _readme_section(lesson)
    missing = [text for text in README_NUMBERS[lesson]() if text not in section]
    assert missing == [], f"solutions/README.md, section {lesson}: these recomputed statements are not in it"


def test_the_lm_step_checker_names_the_bug_and_a_hint():
    feedback = check("05.2", _naive_accumulation_step, quiet=True)
    assert "mean of micro-batch means" in feedback.message
    assert "hint: divide each micro-batch's summed loss by the window's count" in feedback.message


def test_the_lm_step_checker_never_calls_a_division_after_the_all_reduce_a_wrong_update():
    def divide_after(model, optimizer, micro_batches, loss_fn, ctx):  # backward x GA x P, then .grad / N
        local = sum(int(batch["labels"][:, 1:].ne(-100).sum()) for batch in micro_batches)
        for batch in micro_batches:
            ctx.backward(loss_fn(model, batch)[0] * ctx.grad_accum_steps * ctx.num_processes)
        total = ctx.all_reduce_sum(local)
        for parameter in model.parameters():
            parameter.grad /= total
        optimizer.step()
        optimizer.zero_grad()

    feedback = check("05.2", divide_after, quiet=True)
    # gaccum_check reads the division as a clip (issue 40); the checker says the update is right, N belongs in the loss
    assert feedback or feedback.message.startswith("not quite what the exercise asks: your weights after the update "
                                                   "equal the full batch's")
