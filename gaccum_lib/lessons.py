"""The map of the suite: one entry per notebook, in reading order.

The README, notebook 00 and the static site read this list, and a test checks that it
matches the notebooks on disk, so the map cannot drift from the lessons.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lesson:
    notebook: str
    title: str
    aim: str
    run_time: str  # measured under `pytest --nbmake` on a 2-core laptop-class machine


LESSONS = (
    Lesson("00_start_here.ipynb", "Start here",
           "Check the environment, see the map of the suite, take the 2.04 teaser.", "about 3 s"),
)


def lesson_table() -> str:
    """The lessons as a Markdown table."""
    rows = ["| notebook | lesson | you will learn | run time |", "|---|---|---|---|"]
    rows += [f"| `{x.notebook}` | {x.title} | {x.aim} | {x.run_time} |" for x in LESSONS]
    return "\n".join(rows)
