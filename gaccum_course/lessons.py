"""The map of the suite: one entry per notebook, in reading order.

The README, notebook 00 and the static site read this list, and a test checks that it
matches the notebooks on disk, so the map cannot drift from the lessons.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PARTS = ("core", "reference", "deep dive")
PART_TITLES = {"core": "The core path: a 3-hour workshop, exercises included",
               "reference": "The reference: dip in from the lessons that point to it",
               "deep dive": "Deep dives for self-study: one topic each, in any order after the core"}


@dataclass(frozen=True)
class Lesson:
    notebook: str
    title: str
    aim: str
    part: str  # one of PARTS
    # A careful learner's minutes, without and with the exercises, as a fresh reader took them doing the
    # lesson (not a words-per-minute formula): the headers and the facilitator guide say the same.
    learner_minutes: tuple[int, int]
    run_time: str  # under nbmake on 2 cores, kernel start included: only orders CI's runs, longest first

    @property
    def run_seconds(self) -> int:
        return int(re.fullmatch(r"about (\d+) s", self.run_time).group(1))

    @property
    def time_text(self) -> str:
        without, total = self.learner_minutes
        return f"about {without} min, {total} with the exercises"


LESSONS = (
    Lesson("00_start_here.ipynb", "Start here",
           "Check the environment, see the path through the suite, test the idea of accumulation on a toy.",
           "core", (10, 14), "about 8 s"),
    Lesson("01_why_accumulate.ipynb", "Why accumulate",
           "Memory measured (activations grow with the batch, accumulation's stay flat); the plain loop; why each "
           "loss is divided by GA and what forgetting it does; equal to the full batch.",
           "core", (18, 28), "about 9 s"),
    Lesson("02_accelerate_does_it.ipynb", "Accelerate does it for you",
           "Accelerator, prepare, accumulate(), backward divides by GA, sync_gradients, the short last window and "
           "its fix, clipping the complete gradient.",
           "core", (21, 28), "about 8 s"),
    Lesson("03_variable_length_trap.ipynb", "The variable-length trap",
           "Naive mean of means vs token normalisation on sequences of different lengths; the error grows with GA, "
           "packing hides it.",
           "core", (22, 30), "about 9 s"),
    Lesson("04_many_processes.ipynb", "Many processes",
           "x num_processes, the gathered count, counting before the backward passes, no_sync (all-reduces "
           "counted), and a bare notebook_launcher run checked against the simulator and the full batch.",
           "core", (29, 38), "about 9 s"),
    Lesson("05_capstone_language_model.ipynb", "Capstone: the recipe on a tiny language model",
           "Targets after the shift; naive vs token-normalised on 1 and 2 real processes; the take-home "
           "train_causal_lm on 2 processes with clipping and a schedule equals the 1-process full batch; write the "
           "step yourself.",
           "core", (30, 41), "about 11 s"),
    Lesson("06_pitfalls_gallery.ipynb", "A gallery of pitfalls",
           "Nineteen ways accumulation goes wrong, indexed by number and symptom, each with cause, fix and a cell "
           "that shows it; check_accumulation catches the loop-level ones.",
           "reference", (60, 77), "about 10 s"),
    Lesson("07_benchmarks.ipynb", "What it costs and saves, measured",
           "Saved make-bench results: token normalisation's cost, accumulation's time cost, no_sync's saving, "
           "flat memory, speeds.",
           "deep dive", (22, 40), "about 8 s"),
    Lesson("08_your_real_stack.ipynb", "Your real stack: transformers, the Trainer, AdamW, bf16",
           "GPT-2 and Llama from configs: naive vs num_items_in_batch (weights and logged loss); the Trainer's GA "
           "equals its full batch on 1 and 2 real processes, but counts GPT-2's labels before the shift; AdamW "
           "hides a forgotten / GA, not a mean of means; bf16 gradient buffers.",
           "deep dive", (75, 95), "about 17 s"),
    Lesson("09_schedulers_across_processes.ipynb", "Schedulers across processes",
           "A prepared scheduler steps N times per update, measured; N x ceil(ceil(L/N)/GA) steps an epoch "
           "(128, not 125); sizing total_steps; split_batches; sync_each_batch; adjust_scheduler read as False "
           "(measured).",
           "deep dive", (55, 70), "about 10 s"),
    Lesson("10_fsdp_and_deepspeed.ipynb", "FSDP2 and DeepSpeed: accumulation when the model is sharded",
           "Sync off between micro-batches: one reduce-scatter per update, a whole unsharded gradient held; "
           "DeepSpeed steps at the boundary accumulate() sets (an optional extra).",
           "deep dive", (32, 42), "about 14 s"),
    Lesson("11_rl_and_unaccumulable_losses.ipynb", "RL losses, and the losses accumulation cannot reproduce",
           "Which loss_type equals its own full batch under GA; BatchNorm, in-batch negatives and MoE balancing, "
           "each with its fix.",
           "deep dive", (29, 43), "about 12 s"),
    Lesson("12_capstone_further.ipynb", "The capstone, further",
           "The naive error grows with GA, packing hides it; the logged loss; uneven data (pad vs repeat); bf16; "
           "DeepSpeed/FSDP refused, ZeRO stages defined.",
           "deep dive", (24, 39), "about 13 s"),
)


def longest_first(paths: list) -> list:
    """The notebooks at ``paths``, the longest-running lesson first (one not in the map last): the order
    `make notebooks` and `make browser` queue them in, so the long ones start first."""
    seconds = {lesson.notebook: lesson.run_seconds for lesson in LESSONS}
    return sorted(paths, key=lambda path: -seconds.get(Path(path).name, 0))


def lesson_table() -> str:
    """The lessons as Markdown: one table per part, in the order of PARTS."""
    out = []
    for part in PARTS:
        out += [f"**{PART_TITLES[part]}**", "", "| notebook | lesson | you will learn | time |", "|---|---|---|---|"]
        out += [f"| `{x.notebook}` | {x.title} | {x.aim} | {x.time_text} |" for x in LESSONS if x.part == part]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
