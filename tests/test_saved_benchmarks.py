"""gaccum_course/saved/benchmarks.json (package data): a whole, full `make bench` run of lesson 07's settings."""

import subprocess
from pathlib import Path

from gaccum_course import benchmarks

ROOT = Path(__file__).resolve().parents[1]


def test_the_saved_results_are_a_full_run_of_every_section():
    results = benchmarks.load()
    assert results["quick"] is False  # a full run, not a smoke run
    assert set(benchmarks.SECTIONS) <= set(results)
    # the machine it ran on, how busy it was, and how fast it ran then (one tiny_lm(16) pass, ms)
    machine = results["machine"]
    assert {"cpu_cores", "gpus", "torch", "accelerate", "load_average"} <= set(machine)
    assert 0 < machine["pass_ms_start"] < 100 and 0 < machine["pass_ms_end"] < 100
    assert f"{machine['pass_ms_start']:.2f} ms at the start" in benchmarks.table(results)
    # every lesson ran in two rounds; its ratio is one of them, over the bare runs beside it
    assert all(n["runs"] == 2 for n in results["notebooks"]["notebooks"].values())
    assert "the better of 2 rounds" in benchmarks.table(results)


def test_the_allreduce_and_memory_settings_are_the_ones_the_lesson_describes():
    results = benchmarks.load()
    allreduce = results["allreduce"]
    assert allreduce["num_processes"] == 2 and allreduce["grad_accum_steps"] == 8
    assert allreduce["device"].startswith("cuda" if results["machine"]["gpus"] >= 2 else "cpu")
    assert 1e6 < allreduce["model_parameters"] < 1e7
    assert allreduce["gradient_mib"] > 1  # megabytes per all-reduce, against one integer per all-gather
    memory = results["memory"]
    assert memory["micro_batch_size"] == 32 and memory["rows"][-1]["effective_batch"] == 16 * 32  # up to GA 16


def test_the_time_cost_compares_the_same_rows_at_each_ga():
    time_cost = benchmarks.load()["time_cost"]
    assert time_cost["rows"] == 16 and time_cost["ga_values"] == [1, 2, 4, 8, 16]
    for rows in ("packed", "one_line_per_row"):
        part = time_cost[rows]
        assert list(part["over_big_batch"]) == ["1", "2", "4", "8", "16"]
        assert part["over_big_batch"]["1"] == 1.0  # each GA against the big batch of the same run
        ms = part["ms_per_update"]
        assert all(abs(part["over_big_batch"][ga] - ms[ga] / ms["1"]) < 1e-12 for ga in ms)
        assert part["same_gradient_max_diff"] < 1e-6
    assert "one line per row  GA 2 " in benchmarks.table(benchmarks.load())


def test_make_bench_leaves_the_committed_results_alone():
    # A `make bench` on a busy machine must not rewrite what lesson 07 and the README show (and `make test`
    # checks); only `make bench-save` replaces them.
    def commands(target):
        dry = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [line for line in dry.splitlines() if "benchmarks/bench.py" in line]

    [bench] = commands("bench")
    assert "--out build/bench/results.json" in bench and "benchmarks/results" not in bench
    [save] = commands("bench-save")
    assert "--out gaccum_course/saved/benchmarks.json" in save and "--plot benchmarks/results.png" in save
