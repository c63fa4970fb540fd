#!/usr/bin/env python
"""Write each lesson's run time and learner's time everywhere they are stated, from their sources.

    python scripts/update_lesson_times.py      # after `make bench-save`, or after editing a lesson

The run time comes from the saved `make bench-save` run (each notebook's nbmake seconds, rounded
up); the learner's time from the notebook itself (`gaccum_course.lessons.learner_time`). Both go
into the lesson map (gaccum_course/lessons.py), each notebook's header, the README's lesson table
and the facilitator guide's agenda rows. tests/test_notebook_policy.py fails until this has run;
the agenda's own arithmetic (slots, the hours it states) stays the facilitator's to write.
"""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gaccum_course.lessons as lessons_module  # noqa: E402 -- the repository's copy, not an installed one
from gaccum_course import benchmarks  # noqa: E402


def _entry_span(text: str, notebook: str) -> re.Match:
    """The `"about N s", (a, b))` that closes `notebook`'s entry in the lesson map."""
    return re.compile(r'"about \d+ s", \(\d+, \d+\)\)').search(text, text.index(f'"{notebook}"'))


def _write_notebook_header(path: Path, run_seconds: int, minutes: tuple[int, int]) -> None:
    nb = json.loads(path.read_text())
    opening = "".join(nb["cells"][0]["source"])
    opening = re.sub(r"\*\*Run time\*\*: about \d+ seconds", f"**Run time**: about {run_seconds} seconds", opening)
    opening = re.sub(r"about \d+ minutes to read and run, \d+ with the exercises",
                     f"about {minutes[0]} minutes to read and run, {minutes[1]} with the exercises", opening)
    lines = opening.splitlines(keepends=True)
    if nb["cells"][0]["source"] != lines:
        nb["cells"][0]["source"] = lines
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def main() -> int:
    measured = benchmarks.load()["notebooks"]["notebooks"]
    map_path = ROOT / "gaccum_course" / "lessons.py"
    text = map_path.read_text()
    # Run times first: a learner's time includes the run time.
    for lesson in lessons_module.LESSONS:
        seconds = math.ceil(measured[lesson.notebook]["seconds"])
        span = _entry_span(text, lesson.notebook)
        text = text[:span.start()] + re.sub(r"about \d+ s", f"about {seconds} s", span.group(0)) + text[span.end():]
    map_path.write_text(text)
    importlib.reload(lessons_module)
    for lesson in lessons_module.LESSONS:
        time = lessons_module.learner_time(lesson, ROOT / "notebooks")
        span = _entry_span(text, lesson.notebook)
        text = (text[:span.start()] + re.sub(r"\(\d+, \d+\)\)$", f"({time.without_exercises}, {time.total}))",
                                             span.group(0)) + text[span.end():])
    map_path.write_text(text)
    importlib.reload(lessons_module)

    guide_path = ROOT / "docs" / "facilitator-guide.md"
    guide = guide_path.read_text().splitlines()
    for lesson in lessons_module.LESSONS:
        seconds = lesson.run_seconds
        _write_notebook_header(ROOT / "notebooks" / lesson.notebook, seconds, lesson.learner_minutes)
        stem = f"`{lesson.notebook.removesuffix('.ipynb')}`"
        without, total = lesson.learner_minutes
        guide = [re.sub(r"\| \d+ min \(\d+\) \|", f"| {without} min ({total}) |",
                        re.sub(r"\| about \d+ s \|", f"| {lesson.run_time} |", line))
                 if line.startswith("|") and stem in line else line for line in guide]
    guide_path.write_text("\n".join(guide) + "\n")

    readme_path = ROOT / "README.md"
    head, rest = readme_path.read_text().split("<!-- lessons:start -->\n", 1)
    _, tail = rest.split("\n<!-- lessons:end -->", 1)
    readme_path.write_text(f"{head}<!-- lessons:start -->\n{lessons_module.lesson_table()}\n<!-- lessons:end -->{tail}")
    for lesson in lessons_module.LESSONS:
        print(f"{lesson.notebook:<38} {lesson.run_time:>11}  learner {lesson.learner_minutes[0]} min "
              f"({lesson.learner_minutes[1]} with the exercises)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
