"""The saved results of `make bench-save` (package data, gaccum_course/saved/benchmarks.json): load, print, plot.

Lesson 07 shows them, and `benchmarks/write_results.py` writes them to benchmarks/RESULTS.md; the measuring
itself is `benchmarks/bench.py`, outside the library (it is infrastructure, not something a learner needs to read).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

# Shipped inside the package, so a wheel installed anywhere reads the same results lesson 07 shows.
SAVED = resources.files("gaccum_course") / "saved" / "benchmarks.json"
SECTIONS = ("strategy_cost", "time_cost", "allreduce", "memory", "simulator", "check", "widgets", "notebooks")


def _strategy_cost(r: dict) -> list[str]:
    return [f"strategy cost     token-normalised / naive per update: {r['token_over_naive']:.3f} "
            f"({r['token_ms_per_update']:.2f} vs {r['naive_ms_per_update']:.2f} ms, GA {r['grad_accum_steps']})"]


def _time_cost(r: dict) -> list[str]:
    def ratios(part):
        return ", ".join(f"GA {ga} {ratio:.2f}x" for ga, ratio in part["over_big_batch"].items() if ga != "1")

    return [f"time cost         GA micro-batches / one big batch of {r['rows']} rows, per update:",
            f"                  packed rows       {ratios(r['packed'])}",
            f"                  one line per row  {ratios(r['one_line_per_row'])} (a big batch pads more)"]


def _allreduce(r: dict) -> list[str]:
    counts = r["allreduce_rounds_per_update"]
    return [f"all-reduce        rounds per update: no_sync {counts['no_sync']}, without "
            f"{counts['every_micro_batch']} (GA {r['grad_accum_steps']}); time without / with no_sync: "
            f"{r['every_micro_batch_over_no_sync']:.2f}x ({r['gradient_mib']:.0f} MiB of gradients, {r['device']})"]


def _memory(r: dict) -> list[str]:
    rows = r["rows"]
    return ["memory            effective batch " + ", ".join(str(x["effective_batch"]) for x in rows),
            "                  big batch MiB    " + ", ".join(f"{x['big_batch_mib']:.1f}" for x in rows),
            "                  accumulation MiB " + ", ".join(f"{x['accumulation_mib']:.1f}" for x in rows)]


def _simulator(r: dict) -> list[str]:
    return [f"simulator         real launch / simulator: {r['real_over_simulated']:.0f}x ({r['real_launch_ms']:.0f} "
            f"vs {r['simulated_ms']:.1f} ms), same result to {r['same_result_max_diff']:.1e}"]


def _check(r: dict) -> list[str]:
    return [f"check_accumulation {r['model']}, {r['micro_batches']} micro-batches, 1 and 2 processes: median "
            f"{r['median_ms']:.0f} ms over {r['calls']} calls (fastest {r['fastest_ms']:.0f}); the first call "
            f"{r['first_call_ms']:.0f} ms after {r['import_ms']:.0f} ms of imports"]


def _widgets(r: dict) -> list[str]:
    return [f"widget            {name}: median {w['median_ms']:.0f} ms, worst {w['worst_ms']:.0f} ms "
            f"over {w['changes']} changes (first display {w['first_display_ms']:.0f} ms)"
            for name, w in r.items() if isinstance(w, dict)]


def _notebooks(r: dict) -> list[str]:
    rounds = max((n.get("runs", 1) for n in r["notebooks"].values()), default=1)
    if "runs" not in next(iter(r["notebooks"].values()), {}):  # a run from before the rounds: over the median
        head = f"notebooks         bare notebook (import torch): {r['bare_notebook_s']:.1f} s under nbmake"
        return [head] + [f"                  {name:<36} {n['seconds']:5.1f} s = {n['times_bare']:.1f}x bare"
                         for name, n in r["notebooks"].items()]
    best = f", the better of {rounds} rounds" if rounds > 1 else ""
    head = (f"notebooks         bare notebook (import torch): {r['bare_notebook_s']:.1f} s under nbmake (median); "
            f"each lesson over the bare runs just before and after it{best}")
    return [head] + [f"                  {name:<36} {n['seconds']:5.1f} s, {n['times_bare']:.1f}x the bare runs "
                     "beside it" for name, n in r["notebooks"].items()]


_SECTION_LINES = {"strategy_cost": _strategy_cost, "time_cost": _time_cost, "allreduce": _allreduce, "memory": _memory,
                  "simulator": _simulator, "check": _check, "widgets": _widgets, "notebooks": _notebooks}


def table(results: dict) -> str:
    """The saved results as text, one block a section (sections not measured are left out)."""
    machine = results["machine"]
    lines = [f"machine: {machine['cpu_cores']} cores, {machine['gpus']} GPUs, "
             f"torch {machine['torch']}, accelerate {machine['accelerate']}"
             + (f", load {machine['load_average']} at the start" if "load_average" in machine else "")
             + (f"; its speed: one tiny_lm(16) pass (4 rows, forward and backward) {machine['pass_ms_start']:.2f} "
                f"ms at the start, {machine['pass_ms_end']:.2f} ms at the end" if "pass_ms_end" in machine else "")]
    for section in SECTIONS:
        if results.get(section):
            lines += _SECTION_LINES[section](results[section])
    return "\n".join(lines)


def load(path: Path | None = None) -> dict:
    """The saved results (the package's copy, written by `make bench-save`), or the run at ``path``."""
    source = Path(path) if path is not None else SAVED
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist: run `make bench` first (it writes build/bench/)")
    return json.loads(source.read_text())


def plot(results: dict, path: Path | None = None):
    """Four panels: memory, widget answer times, notebook run times, cost ratios; saved if ``path``."""
    import matplotlib.pyplot as plt

    from . import plots

    plots.apply_style()
    # A pyplot figure, so a notebook's inline backend shows it (a bare Figure shows only its repr)
    fig = plt.figure(figsize=(13, 9), layout="constrained")
    axes = fig.subplots(2, 2)
    if "memory" in results:
        rows = results["memory"]["rows"]
        batches = [r["effective_batch"] for r in rows]
        axes[0, 0].plot(batches, [r["big_batch_mib"] for r in rows], label="one big batch",
                        **plots.style_for("full_batch"))
        axes[0, 0].plot(batches, [r["accumulation_mib"] for r in rows], label="accumulation",
                        **plots.style_for("token_normalised"))
        axes[0, 0].set_xscale("log", base=2)
        axes[0, 0].set_xticks(batches, [str(b) for b in batches])
        axes[0, 0].minorticks_off()
        axes[0, 0].set(xlabel="effective batch (examples per update)", ylabel="peak MiB",
                       title="memory of one update (micro-batch 32)")
        axes[0, 0].legend()
    if "widgets" in results:
        names = [n for n, w in results["widgets"].items() if isinstance(w, dict)]
        medians = [results["widgets"][n]["median_ms"] for n in names]
        worst = [results["widgets"][n]["worst_ms"] for n in names]
        x = range(len(names))
        axes[0, 1].bar([i - 0.2 for i in x], medians, width=0.4, label="median", color=plots.OKABE_ITO["blue"])
        axes[0, 1].bar([i + 0.2 for i in x], worst, width=0.4, label="worst", color=plots.OKABE_ITO["orange"],
                       hatch="//")
        axes[0, 1].set_xticks(list(x), [n.replace("_explorer", "") for n in names])
        axes[0, 1].set(ylabel="ms (compute + redraw)", title="widget answer time")
        axes[0, 1].legend()
    if "notebooks" in results:
        nbs = results["notebooks"]["notebooks"]
        names = list(nbs)
        axes[1, 0].barh(names, [nbs[n]["times_bare"] for n in names], color=plots.OKABE_ITO["sky"])
        axes[1, 0].axvline(4, color="0.4", linestyle="--", label="4x bare")
        axes[1, 0].set(xlabel="nbmake time / bare notebook's", title="notebook run time")
        axes[1, 0].invert_yaxis()
        axes[1, 0].legend()
    ratios = {}
    if "strategy_cost" in results:
        ratios["token-normalised\n/ naive"] = results["strategy_cost"]["token_over_naive"]
    if "time_cost" in results:
        packed = results["time_cost"]["packed"]["over_big_batch"]
        largest = max(packed, key=int)
        ratios[f"GA {largest}\nmicro-batches\n/ one big batch"] = packed[largest]
    if "allreduce" in results:
        ratios["sync every\nmicro-batch\n/ no_sync"] = results["allreduce"]["every_micro_batch_over_no_sync"]
    if ratios:
        axes[1, 1].bar(list(ratios), list(ratios.values()), color=plots.OKABE_ITO["green"])
        axes[1, 1].axhline(1, color="0.4")
        axes[1, 1].set(ylabel="time ratio", title="what the methods cost")
        axes[1, 1].tick_params(axis="x", labelsize="small")  # three labels of up to three lines: no overlap
    if path is not None:
        fig.savefig(path, dpi=80)
    return fig
