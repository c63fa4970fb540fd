#!/usr/bin/env python
"""What accumulation costs and saves, measured as ratios and counts in one run (`make bench`).

    python benchmarks/bench.py                      # everything, about 8 minutes on 2 cores (= make bench)
    python benchmarks/bench.py --only memory,widgets
    python benchmarks/bench.py --out results.json --plot results.png

`make bench` writes build/bench/; `make bench-save` replaces the committed results (the package
data gaccum_course/saved/benchmarks.json, and results.png beside this file); notebook 07 and the README
show them through gaccum_course.benchmarks (load, table, plot). On a GPU machine the same command
measures the GPU sections there.

Every figure is a ratio or a count from this one run, so the numbers compare across
machines: the cost ratios are medians over interleaved repetitions (A, B, A, B, ...), so
background load hits both sides alike; the check and the explorers are medians of consecutive
calls, in milliseconds; the notebooks are the better of two rounds (bench_notebooks). The JSON
records the machine (cores, GPUs, versions) it ran on, and its speed at the run's start and end.

Sections:
  strategy_cost      per-update time of token-normalised vs naive accumulation, capstone LM
  time_cost          per-update time of GA micro-batches vs one big batch of the same rows, capstone LM
                     (packed rows, and one line per row with its padding)
  allreduce          all-reduce rounds per update and time with no_sync vs without, 2 real processes
  memory             peak memory of one update as the effective batch grows: big batch vs accumulation
  simulator          simulator vs a real multi-process launch for the same result (time ratio)
  check              check_accumulation's time on tiny_lm(16), 4 micro-batches, 1 and 2 processes (first call, median)
  widgets            widget answer time (compute + redraw), median and worst
  notebooks          each notebook's nbmake time as a multiple of a bare notebook's (import torch), the
                     better of two rounds (one with --quick), each over the bare runs just before and after it
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gaccum_course.benchmarks import SAVED, SECTIONS, plot, table

ROOT = Path(__file__).resolve().parents[1]  # the repository: notebooks and build/ live there


def _median_ms(samples):
    return 1000 * statistics.median(samples)


def _interleaved(functions: dict, repeats: int) -> dict:
    """Time each function `repeats` times, alternating between them; seconds per call."""
    for f in functions.values():  # warm-up: first calls pay for lazy imports and allocations
        f()
    times = {name: [] for name in functions}
    for _ in range(repeats):
        for name, f in functions.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    return times


# ----------------------------------------------------------------------------------------------


def bench_strategy_cost(quick: bool) -> dict:
    """One optimizer update of the capstone LM, naive vs token-normalised, same micro-batches."""
    import torch

    from gaccum_lib.lm import tiny_lm

    torch.set_num_threads(1)
    problem = tiny_lm(64, dtype="float32")
    grad_accum_steps, micro_batch_size = 4, 4
    indices = problem.micro_batch_indices(micro_batch_size)[:grad_accum_steps]
    window = [problem.batch_of(ix) for ix in indices]
    model = problem.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def naive_update():
        for batch in window:
            loss_sum, n = problem.loss_sum_and_count(model, batch)
            (loss_sum / n / grad_accum_steps).backward()
        optimizer.step()
        optimizer.zero_grad()

    def token_normalised_update():
        total = sum(problem.count_targets(batch) for batch in window)  # the extra work: one count
        for batch in window:
            loss_sum, _ = problem.loss_sum_and_count(model, batch)
            (loss_sum / total).backward()
        optimizer.step()
        optimizer.zero_grad()

    times = _interleaved({"naive": naive_update, "token_normalised": token_normalised_update},
                         repeats=20 if quick else 80)
    naive, token = _median_ms(times["naive"]), _median_ms(times["token_normalised"])
    return {"model_parameters": sum(p.numel() for p in model.parameters()), "grad_accum_steps": grad_accum_steps,
            "micro_batch_size": micro_batch_size, "naive_ms_per_update": naive, "token_ms_per_update": token,
            "token_over_naive": token / naive}


def bench_time_cost(quick: bool) -> dict:
    """One update on the same 16 rows: one big batch, or GA micro-batches of 16 / GA rows each.

    Accumulation does the same arithmetic in smaller pieces: what it costs is the per-call
    overhead (GA forwards and backwards instead of one) and smaller, less efficient matrix
    products. Measured on packed rows (all the same length, so the pieces add up to exactly the
    big batch's work) and on the capstone's one line per row, where a big batch pads every row to
    its longest and smaller micro-batches pad less. Token-normalised on both sides, so each GA
    gives the big batch's gradient.
    """
    import torch

    from gaccum_lib.lm import tiny_lm

    torch.set_num_threads(1)
    ga_values = (1, 2, 4, 8, 16)
    out = {"rows": 16, "ga_values": list(ga_values)}
    for key, packed in (("packed", True), ("one_line_per_row", False)):
        problem = tiny_lm(64, dtype="float32", packed=packed)
        rows = problem.micro_batch_indices(16)[0]  # the first 16 rows, in the loader's order
        model = problem.make_model()
        windows = {ga: [problem.batch_of(rows[i:i + 16 // ga]) for i in range(0, 16, 16 // ga)] for ga in ga_values}

        def gradient_of(window, model=model, problem=problem):
            total = sum(problem.count_targets(batch) for batch in window)
            for batch in window:
                loss_sum, _ = problem.loss_sum_and_count(model, batch)
                (loss_sum / total).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
            return grads

        reference = gradient_of(windows[1])
        same = max(max((a - b).abs().max().item() for a, b in zip(reference, gradient_of(windows[ga]), strict=True))
                   for ga in ga_values)
        times = _interleaved({ga: (lambda w=windows[ga]: gradient_of(w)) for ga in ga_values},
                             repeats=20 if quick else 60)
        ms = {ga: _median_ms(times[ga]) for ga in ga_values}
        out[key] = {"ms_per_update": {str(ga): ms[ga] for ga in ga_values},
                    "over_big_batch": {str(ga): ms[ga] / ms[1] for ga in ga_values},
                    "same_gradient_max_diff": same}
    out["model_parameters"] = sum(p.numel() for p in model.parameters())
    return out


def _allreduce_worker(grad_accum_steps, micro_batch_size, width, depth, repeats):
    """Runs in each launched process: time updates with and without no_sync, count all-reduce rounds."""
    import contextlib

    import torch
    from accelerate import Accelerator

    from gaccum_lib.accelerate_runs import count_allreduce_rounds

    accelerator = Accelerator()
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = accelerator.prepare(torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)))
    rounds = count_allreduce_rounds(model)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    batches = [torch.randn(micro_batch_size, width, generator=generator, device="cpu").to(accelerator.device)
               for _ in range(grad_accum_steps)]

    def update(skip_sync: bool):
        for i, x in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if (last or not skip_sync) else model.no_sync():
                model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    counts = {}
    for mode, skip in (("no_sync", True), ("every_micro_batch", False)):
        before = rounds["rounds"]
        update(skip)
        counts[mode] = rounds["rounds"] - before
    times = {"no_sync": [], "every_micro_batch": []}
    for _ in range(repeats):
        for mode, skip in (("no_sync", True), ("every_micro_batch", False)):
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            update(skip)
            accelerator.wait_for_everyone()
            times[mode].append(time.perf_counter() - start)
    return {"rank": accelerator.process_index, "device": str(accelerator.device), "counts": counts,
            "ms": {mode: _median_ms(t) for mode, t in times.items()},
            "parameters": sum(p.numel() for p in model.parameters())}


def bench_allreduce(quick: bool) -> dict:
    from gaccum_lib import launch

    grad_accum_steps = 8
    width, depth = (512, 3) if quick else (1024, 4)
    records = launch(_allreduce_worker, (grad_accum_steps, 4, width, depth, 5 if quick else 15),
                     num_processes=2, quiet=True)
    rank0 = records[0]
    return {"num_processes": 2, "device": rank0["device"], "grad_accum_steps": grad_accum_steps,
            "model_parameters": rank0["parameters"], "gradient_mib": rank0["parameters"] * 4 / 2**20,
            "allreduce_rounds_per_update": rank0["counts"], "ms_per_update": rank0["ms"],
            "every_micro_batch_over_no_sync": rank0["ms"]["every_micro_batch"] / rank0["ms"]["no_sync"]}


def bench_memory(quick: bool) -> dict:
    from gaccum_lib.memory import memory_table

    table = memory_table(micro_batch_size=32, accumulation_steps=(1, 2, 4, 8, 16))
    rows = [{"effective_batch": big.effective_batch, "big_batch_mib": big.peak / 2**20,
             "accumulation_mib": acc.peak / 2**20, "big_batch_activation_mib": big.peak_activations / 2**20,
             "accumulation_activation_mib": acc.peak_activations / 2**20}
            for big, acc in zip(table["full_batch"], table["accumulation"], strict=True)]
    return {"micro_batch_size": 32, "rows": rows,
            "big_over_accumulation_at_largest": rows[-1]["big_batch_mib"] / rows[-1]["accumulation_mib"]}


def bench_simulator(quick: bool) -> dict:
    from gaccum_lib import real_run, seed_sequences, simulate

    problem = seed_sequences(16)
    kwargs = dict(grad_accum_steps=2, micro_batch_size=4, num_processes=2)
    results = {}

    def simulated():
        results["simulated"] = simulate(problem, "token_normalised", **kwargs)

    def real():
        results["real"] = real_run(problem, "token_normalised", **kwargs)

    times = _interleaved({"simulated": simulated, "real": real}, repeats=3 if quick else 8)
    sim, launched = _median_ms(times["simulated"]), _median_ms(times["real"])
    return {"simulated_ms": sim, "real_launch_ms": launched, "real_over_simulated": launched / sim,
            "same_result_max_diff": results["real"].max_difference(results["simulated"])}


# Run in a fresh interpreter, so the first call's cost is what a learner's first call pays (imports included).
CHECK_SCRIPT = """
import json, statistics, sys, time
start = time.perf_counter()
from gaccum_check import check_accumulation
from gaccum_lib import tiny_lm
imported = time.perf_counter()
problem = tiny_lm(16)
micro_batches = [problem.batch_of(ix) for ix in problem.micro_batch_indices(4)]  # 4 micro-batches of 4 rows


def token_normalised_step(model, optimizer, micro_batches, loss_fn, ctx):
    window_targets = ctx.all_reduce_sum(sum(problem.count_targets(b) for b in micro_batches))
    for batch in micro_batches:
        loss_sum, _ = loss_fn(model, batch)
        ctx.backward(loss_sum * ctx.grad_accum_steps * ctx.num_processes / window_targets)
    optimizer.step()
    optimizer.zero_grad()


def one_check():
    t0 = time.perf_counter()
    report = check_accumulation(token_normalised_step, problem.make_model, micro_batches, problem.loss_sum_and_count)
    assert report, report
    return (time.perf_counter() - t0) * 1000


first = one_check()
later = [one_check() for _ in range(int(sys.argv[1]))]
print(json.dumps({"import_ms": (imported - start) * 1000, "first_call_ms": first,
                  "median_ms": statistics.median(later), "fastest_ms": min(later), "calls": len(later)}))
"""


def bench_check(quick: bool) -> dict:
    result = subprocess.run([sys.executable, "-c", CHECK_SCRIPT, "5" if quick else "15"], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the check_accumulation benchmark failed:\n{result.stderr[-2000:]}")
    return {"model": "tiny_lm(16)", "micro_batches": 4, "rows_per_micro_batch": 4, "num_processes": [1, 2],
            **json.loads(result.stdout.strip().splitlines()[-1])}


def bench_widgets(quick: bool) -> dict:
    from gaccum_course import widgets

    sequences = {
        "regression_explorer": [dict(grad_accum_steps=g) for g in (1, 2, 8, 4)] + [dict(lr=0.01), dict(epochs=5)],
        "variable_length_explorer": [dict(grad_accum_steps=g) for g in (2, 8, 4)]
        + [dict(num_processes=p) for p in (2, 4, 1)] + [dict(spread=s) for s in (0.0, 1.0, 0.5)]
        + [dict(micro_batch_size=m) for m in (1, 4, 2)] + [dict(epochs=e) for e in (2, 1)],
        "schedule_explorer": [dict(grad_accum_steps=g) for g in (1, 8, 4)] + [dict(num_processes=p) for p in (1, 4)],
        "trainer_count_explorer": [dict(mean_length=n) for n in (4, 128, 20)] + [dict(grad_accum_steps=g) for g in
                                                                                 (1, 32, 8)],
    }
    out = {}
    for name, changes in sequences.items():
        explorer = getattr(widgets, name)(strict=True)
        first = explorer.state.answer_ms[0]
        for change in changes * (1 if quick else 2):
            explorer.set(**change)
        answers = explorer.state.answer_ms[1:]
        out[name] = {"changes": len(answers), "median_ms": statistics.median(answers), "worst_ms": max(answers),
                     "first_display_ms": first}
    out["median_ms_all"] = statistics.median(
        [a for name in sequences for a in [out[name]["median_ms"]]])
    return out


BARE_NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "bare", "metadata": {}, "outputs": [],
               "source": ["import torch\n", "assert torch.ones(1).item() == 1.0"]}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def _nbmake_seconds(path: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "--nbmake", "-q", "-p", "no:cacheprovider", str(path)],
                            cwd=path.parent, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{path.name} failed under nbmake:\n{result.stdout[-2000:]}")
    return elapsed


def bench_notebooks(quick: bool, before_lesson_07=None) -> dict:
    """Each lesson's nbmake time over a bare notebook's. Lesson 07 prints the saved run's figures, these
    times among them: it runs last, after ``before_lesson_07`` got the other lessons' results.

    The machine's speed drifts by tens of percent within minutes (``pass_ms``), and a lesson's
    compute feels it more than a bare notebook's imports: every lesson runs in two rounds (one with
    ``quick``), minutes apart, each run measured against the mean of the bare runs just before and
    after it, and the better of its ratios is kept, as timeit keeps the fastest of its runs (its
    seconds are that run's; every round's are saved too). Lesson 07 sees the first round's figures.
    """
    rounds = 1 if quick else 2
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"), key=lambda p: p.name.startswith("07_"))
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        bare = work / "bare.ipynb"
        bare.write_text(json.dumps(BARE_NOTEBOOK))
        copies = []
        for nb in notebooks:
            copy = work / nb.name
            copy.write_text(nb.read_text())
            copies.append(copy)
        bare_times = [_nbmake_seconds(bare)]
        runs = {copy.name: [] for copy in copies}  # (seconds, ratio to the bare runs around it), one a round
        for round_ in range(rounds):
            for copy in copies:
                if copy.name.startswith("07_") and before_lesson_07 is not None and round_ == 0:
                    before_lesson_07(_ratios(runs, bare_times))
                seconds = _nbmake_seconds(copy)
                bare_times.append(_nbmake_seconds(bare))  # interleaved: drift hits both
                runs[copy.name].append((seconds, seconds / statistics.mean(bare_times[-2:])))
    result = _ratios(runs, bare_times)
    result["notebooks"] = dict(sorted(result["notebooks"].items()))
    return result


def _ratios(runs: dict, bare_times: list) -> dict:
    best = {name: min(done, key=lambda run: run[1]) for name, done in runs.items() if done}
    return {"bare_notebook_s": statistics.median(bare_times),
            "notebooks": {name: {"seconds": s, "times_bare": ratio, "runs": len(runs[name]),
                                 "every_round": [{"seconds": t, "times_bare": r} for t, r in runs[name]]}
                          for name, (s, ratio) in best.items()}}


def pass_ms() -> float:
    """The machine's speed, to read this run's milliseconds by: one forward and backward of tiny_lm(16)
    on its first 4 rows (float64, one thread), median of 40. The check runs 25 forwards and 24 backwards
    of that model (on 4-row micro-batches of 71 to 91 characters, one of 8 rows). On the machine the
    suite is measured on, this took from 1.9 to 3.3 ms within one night."""
    import torch

    from gaccum_lib import tiny_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        problem = tiny_lm(16)
        model = problem.make_model()
        batch = problem.batch_of(problem.micro_batch_indices(4)[0])

        def one_pass():
            loss_sum, _ = problem.loss_sum_and_count(model, batch)
            loss_sum.backward()

        return _median_ms(_interleaved({"pass": one_pass}, 40)["pass"])
    finally:
        torch.set_num_threads(threads)


def machine() -> dict:
    from importlib import metadata

    import torch

    from gaccum_launch import gpu_count

    return {"python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}",
            "cpu_cores": os.cpu_count(), "gpus": gpu_count(),
            "torch": torch.__version__, "accelerate": metadata.version("accelerate"),
            "date": time.strftime("%Y-%m-%d"),
            # what else the machine was doing: the 1-minute load average as the run started
            "load_average": round(os.getloadavg()[0], 2), "pass_ms_start": round(pass_ms(), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "results.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "build" / "bench" / "results.png",
                        help="where the figure goes; --no-plot for a machine without matplotlib")
    parser.add_argument("--no-plot", dest="plot", action="store_const", const=None)
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    # The multi-process section forks: run it before anything in this process could touch CUDA.
    order = [s for s in SECTIONS if s in chosen]
    results = {"machine": machine(), "quick": args.quick}
    saving = args.out.resolve() == Path(str(SAVED)).resolve()
    previous = json.loads(args.out.read_text()) if saving and args.out.is_file() else {}

    def before_lesson_07(notebooks: dict) -> None:
        # Lesson 07 reads the saved file while it is timed: give it this run's figures, its own
        # time from the previous run (the only one this run cannot know yet).
        old_07 = {k: v for k, v in previous.get("notebooks", {}).get("notebooks", {}).items() if k.startswith("07_")}
        notebooks["notebooks"].update(old_07)
        args.out.write_text(json.dumps({**previous, **results, "notebooks": notebooks}, indent=2) + "\n")

    for section in order:
        start = time.perf_counter()
        print(f"[bench] {section} ...", flush=True)
        if section == "notebooks":
            results[section] = bench_notebooks(args.quick, before_lesson_07 if saving else None)
        else:
            results[section] = globals()[f"bench_{section}"](args.quick)
        print(f"[bench] {section} done in {time.perf_counter() - start:.1f} s", flush=True)
    results["machine"]["pass_ms_end"] = round(pass_ms(), 2)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot is not None:
        import matplotlib.pyplot as plt

        plt.close(plot(results, args.plot))
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
