"""The map of the suite: one entry per notebook, in reading order.

The README, notebook 00 and the static site read this list, and a test checks that it
matches the notebooks on disk, so the map cannot drift from the lessons.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# A learner's time, estimated from the notebook itself (so it follows every edit): prose read at
# 200 words a minute, each visible code line read at 10 a minute (comments included; collapsed
# check cells are skipped), the run time, and 5 minutes per exercise, rounded up to 5 minutes.
# A fresh read of lessons 00-06 with the exercises took about 4.5 hours; this model gives 5.25, a little
# longer, which is the safer side for planning a day.
PROSE_WORDS_PER_MINUTE = 200
CODE_LINES_PER_MINUTE = 10
MINUTES_PER_EXERCISE = 5


@dataclass(frozen=True)
class Lesson:
    notebook: str
    title: str
    aim: str
    run_time: str  # under `pytest --nbmake` on 2 cores, kernel start included (`make bench`; a test compares)
    # A learner's minutes, without and with the exercises: learner_time() of the notebook, kept here
    # because an installed wheel has no notebooks to read (a test compares the two).
    learner_minutes: tuple[int, int]

    @property
    def run_seconds(self) -> int:
        return int(re.fullmatch(r"about (\d+) s", self.run_time).group(1))


LESSONS = (
    Lesson("00_start_here.ipynb", "Start here",
           "Check the environment, see the map of the suite, take the 2.04 teaser.", "about 6 s", (10, 20)),
    Lesson("01_why_accumulate.ipynb", "Why accumulate",
           "Memory measured; the plain loop; / GA vs forgetting it (2.04 vs 8.16); equal to the full batch.",
           "about 9 s", (20, 35)),
    Lesson("02_accelerate_does_it.ipynb", "Accelerate does it for you",
           "Accelerator, prepare, accumulate(), backward divides by GA, sync_gradients, the short last window, "
           "clipping.",
           "about 8 s", (25, 35)),
    Lesson("03_variable_length_trap.ipynb", "The variable-length trap",
           "Naive mean of means vs token normalisation: [0.0775, 0.4514] vs [0.0953, 0.4337]; error grows with GA.",
           "about 8 s", (25, 40)),
    Lesson("04_many_processes.ipynb", "Many processes",
           "x num_processes, gathering the count, no_sync, a simulator, and a real notebook_launcher run: "
           "[0.2117, 0.3172].", "about 10 s", (35, 50)),
    Lesson("05_capstone_language_model.ipynb", "Capstone: a tiny language model",
           "A character transformer on a shipped story: targets after the shift, naive vs token-normalised on 1 "
           "and 2 real processes, the naive error growing with GA, packing hiding it.", "about 14 s", (60, 80)),
    Lesson("06_pitfalls_gallery.ipynb", "A gallery of pitfalls",
           "Sixteen mistakes, most of them silent, reproduced with symptom and fix; check_accumulation catches the "
           "loop-level ones.",
           "about 10 s", (50, 65)),
    Lesson("07_benchmarks.ipynb", "What it costs and saves, measured",
           "Saved make-bench results: token normalisation's cost, accumulation's time cost, no_sync's saving, "
           "flat memory, speeds.",
           "about 6 s", (15, 30)),
    Lesson("08_your_real_stack.ipynb", "Your real stack: transformers, the Trainer, AdamW, bf16",
           "GPT-2 and Llama from configs: naive vs num_items_in_batch (weights and logged loss); the Trainer's GA "
           "equals its full batch on 1 and 2 real processes, but counts GPT-2's labels before the shift (0.9456 of "
           "each update); AdamW hides a forgotten / GA, not a mean of means; bf16 gradient buffers.",
           "about 15 s", (45, 55)),
    Lesson("09_schedulers_across_processes.ipynb", "Schedulers across processes",
           "A prepared scheduler steps N times per update, measured; N x ceil(ceil(L/N)/GA) steps an epoch "
           "(128, not 125); sizing total_steps; split_batches; sync_each_batch; adjust_scheduler read as False.",
           "about 9 s", (30, 45)),
    Lesson("10_past_ddp.ipynb", "Past DDP: FSDP, DeepSpeed, RL losses",
           "FSDP2 on 2 real processes equals the full batch: 3 reduce-scatters an update instead of 12, a whole "
           "gradient held instead of a shard; DeepSpeed's own accumulation (and its clip at 1.0); which GRPO loss "
           "types survive GA (bnpo drifts); BatchNorm, in-batch negatives and load balancing, with their fixes.",
           "about 15 s", (40, 55)),
)


def longest_first(paths: list) -> list:
    """The notebooks at ``paths``, the longest-running lesson first (one not in the map last): the order
    `make notebooks` and `make browser` queue them in, so the long ones start first."""
    seconds = {lesson.notebook: lesson.run_seconds for lesson in LESSONS}
    return sorted(paths, key=lambda path: -seconds.get(Path(path).name, 0))


@dataclass(frozen=True)
class LearnerTime:
    reading: float  # minutes: prose
    code: float  # minutes: the visible code cells
    exercises: int  # how many
    run_seconds: int

    @property
    def without_exercises(self) -> int:
        return _up_to_5(self.reading + self.code + self.run_seconds / 60)

    @property
    def total(self) -> int:
        return _up_to_5(self.reading + self.code + self.run_seconds / 60 + MINUTES_PER_EXERCISE * self.exercises)


def _up_to_5(minutes: float) -> int:
    return 5 * math.ceil(minutes / 5)


def learner_time(lesson: Lesson, folder: Path | None = None) -> LearnerTime:
    """Estimate a learner's minutes for ``lesson`` from its notebook (see the constants above)."""
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parents[1] / "notebooks"
    cells = json.loads((folder / lesson.notebook).read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    code_lines = sum(len("".join(c["source"]).splitlines()) for c in cells if c["cell_type"] == "code"
                     and not c.get("metadata", {}).get("jupyter", {}).get("source_hidden"))
    exercises = prose[prose.find("## Exercises"):] if "## Exercises" in prose else ""
    return LearnerTime(reading=len(prose.split()) / PROSE_WORDS_PER_MINUTE,
                       code=code_lines / CODE_LINES_PER_MINUTE,
                       exercises=len(re.findall(r"^\d+\. ", exercises, re.M)),
                       run_seconds=lesson.run_seconds)


def lesson_table() -> str:
    """The lessons as a Markdown table."""
    rows = ["| notebook | lesson | you will learn | run time | a learner's time (with the exercises) |",
            "|---|---|---|---|---|"]
    for x in LESSONS:
        without, total = x.learner_minutes
        rows.append(f"| `{x.notebook}` | {x.title} | {x.aim} | {x.run_time} | {without} min ({total} min) |")
    return "\n".join(rows)
