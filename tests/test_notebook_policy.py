"""The committed notebooks follow the policy, and the policy checker catches violations."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from gaccum_course import benchmarks
from gaccum_course.lessons import LESSONS, lesson_table, longest_first

FIX = "run `python scripts/update_lesson_times.py`"  # what mends a stale time in any of these places
ROOT = Path(__file__).resolve().parents[1]
CHECKER = [sys.executable, str(ROOT / "scripts" / "check_notebooks.py")]


def test_committed_notebooks_pass_the_policy():
    result = subprocess.run([*CHECKER, str(ROOT / "notebooks")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_checker_flags_outputs_and_strip_removes_them(tmp_path):
    source = ROOT / "notebooks" / "00_start_here.ipynb"
    copy = tmp_path / source.name
    shutil.copy(source, copy)
    nb = json.loads(copy.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"][1]  # [0] is the install cell, kept as it is
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["stale\n"]}]
    code["execution_count"] = 7
    code["metadata"] = {"tags": ["raises-exception"], "jupyter": {"source_hidden": True}, "scrolled": True,
                        "execution": {"iopub.execute_input": "2026-12-02T20:00:00Z"}}
    nb["metadata"]["widgets"] = {"state": {}}
    copy.write_text(json.dumps(nb))
    flagged = subprocess.run([*CHECKER, str(tmp_path)], capture_output=True, text=True)
    assert flagged.returncode == 1
    assert "has outputs" in flagged.stdout and "execution count" in flagged.stdout and "'widgets'" in flagged.stdout
    subprocess.run([*CHECKER, "--strip", str(tmp_path)], check=True, capture_output=True)
    assert subprocess.run([*CHECKER, str(tmp_path)], capture_output=True).returncode == 0
    stripped = json.loads(copy.read_text())
    kept = [c for c in stripped["cells"] if c["cell_type"] == "code"][1]["metadata"]
    assert kept == {"tags": ["raises-exception"], "jupyter": {"source_hidden": True}}  # what the lessons use
    assert set(stripped["metadata"]) == {"kernelspec", "language_info"}
    again = subprocess.run([*CHECKER, "--strip", str(tmp_path)], check=True, capture_output=True, text=True)
    assert again.stdout.startswith("clean")  # stripping twice changes nothing


def test_checker_requires_asserts_and_the_lesson_shape(tmp_path):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3"}},
          "cells": [{"cell_type": "code", "metadata": {}, "source": ["print(1)"], "outputs": [],
                     "execution_count": None}]}
    (tmp_path / "bad.ipynb").write_text(json.dumps(nb))
    out = subprocess.run([*CHECKER, str(tmp_path)], capture_output=True, text=True).stdout
    assert "no assert" in out and "install cell" in out and "What you will learn" in out and "## Summary" in out


def test_checker_flags_a_code_cell_over_25_lines_unless_it_is_the_take_home_function(tmp_path):
    def notebook(lines, tags):
        cell = {"cell_type": "code", "metadata": {"tags": tags}, "source": ["x = 1\n" * lines], "outputs": [],
                "execution_count": None}
        return {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3"}},
                "cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# x"]}, cell]}

    for name, lines, tags in [("long", 26, []), ("short", 25, []), ("take_home", 60, ["take-home"])]:
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(notebook(lines, tags)))
    out = subprocess.run([*CHECKER, str(tmp_path)], capture_output=True, text=True).stdout
    assert "long.ipynb: cell 1 has 26 lines of code (at most 25 unless tagged 'take-home')" in out
    assert "short.ipynb: cell" not in out and "take_home.ipynb: cell" not in out


def test_the_lesson_map_matches_the_notebooks_on_disk():
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [lesson.notebook for lesson in LESSONS] == on_disk
    assert lesson_table().count("\n") == len(LESSONS) + 1


def test_readme_lesson_table_is_the_lesson_map():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- lessons:start -->\n", 1)[1].split("\n<!-- lessons:end -->", 1)[0]
    assert block == lesson_table()


def test_make_notebooks_queues_the_lessons_longest_first_and_a_scratch_notebook_last():
    paths = [f"build/executed/{lesson.notebook}" for lesson in LESSONS] + ["build/executed/scratch.ipynb"]
    queued = longest_first(list(reversed(paths)))
    seconds = [next(x.run_seconds for x in LESSONS if x.notebook == Path(p).name) for p in queued[:-1]]
    assert seconds == sorted(seconds, reverse=True) and queued[-1].endswith("scratch.ipynb")
    assert sorted(queued) == sorted(paths)  # nothing lost
    # what the Makefile runs: the same order, as one line of paths
    printed = subprocess.run([sys.executable, str(ROOT / "scripts" / "longest_first.py"), *paths],
                             capture_output=True, text=True, check=True).stdout.split()
    assert printed == longest_first(paths)


def test_run_times_match_the_benchmark_and_the_notebooks_say_the_same():
    """The map's run times are `make bench`'s nbmake times (rounded up), and each notebook states its own."""
    import math
    import re

    measured = benchmarks.load()["notebooks"]["notebooks"]
    for lesson in LESSONS:
        stated = int(re.fullmatch(r"about (\d+) s", lesson.run_time).group(1))
        assert abs(stated - math.ceil(measured[lesson.notebook]["seconds"])) <= 2, (lesson.notebook, FIX)
        opening = "".join(json.loads((ROOT / "notebooks" / lesson.notebook).read_text())["cells"][0]["source"])
        assert f"**Run time**: about {stated} seconds" in opening, (lesson.notebook, FIX)


def test_facilitator_agenda_uses_the_measured_run_times():
    guide = (ROOT / "docs" / "facilitator-guide.md").read_text()
    for lesson in LESSONS:
        row = next((line for line in guide.splitlines() if f"`{lesson.notebook.removesuffix('.ipynb')}`" in line
                    and line.startswith("|")), None)
        assert row is not None, f"the agenda has no row for {lesson.notebook}"
        assert f"| {lesson.run_time} |" in row, row


def test_each_lesson_states_the_learners_time_its_notebook_gives():
    from gaccum_course.lessons import learner_time

    for lesson in LESSONS:
        time = learner_time(lesson)
        assert lesson.learner_minutes == (time.without_exercises, time.total), (lesson.notebook, FIX)
        opening = "".join(json.loads((ROOT / "notebooks" / lesson.notebook).read_text())["cells"][0]["source"])
        assert (f"**A learner's time**: about {time.without_exercises} minutes to read and run, {time.total} with "
                "the exercises") in opening, (lesson.notebook, FIX)


def test_the_learners_time_counts_prose_visible_code_and_exercises(tmp_path):
    from gaccum_course.lessons import Lesson, learner_time

    cells = [{"cell_type": "markdown", "source": ["word " * 400 + "\n## Exercises\n1. one\n2. two\n"]},
             {"cell_type": "code", "metadata": {}, "source": ["x = 1\n" * 30]},
             {"cell_type": "code", "metadata": {"jupyter": {"source_hidden": True}}, "source": ["y = 2\n" * 99]}]
    (tmp_path / "99_x.ipynb").write_text(json.dumps({"cells": cells}))
    time = learner_time(Lesson("99_x.ipynb", "x", "x", "about 30 s", (0, 0)), tmp_path)
    assert (time.exercises, time.code) == (2, 3.0)  # the collapsed cell is not read
    assert abs(time.reading - 406 / 200) < 1e-9
    assert (time.without_exercises, time.total) == (10, 20)  # 2.03 + 3 + 0.5 min, rounded up; + 10 of exercises


def test_facilitator_agenda_uses_each_lessons_learner_time():
    from gaccum_course.lessons import learner_time

    guide = (ROOT / "docs" / "facilitator-guide.md").read_text()
    for lesson in LESSONS:
        time = learner_time(lesson)
        rows = [line for line in guide.splitlines() if line.startswith("|")
                and f"`{lesson.notebook.removesuffix('.ipynb')}`" in line]
        stated = f"| {time.without_exercises} min ({time.total}) |"
        assert rows and all(stated in row for row in rows), (lesson.notebook, FIX)


def test_the_core_agenda_gives_each_whole_lesson_its_learners_time_and_ends_at_three_hours():
    """A lesson the core does all of ('all of it, exercise 1') gets at least its reading and running
    time plus one exercise (5 minutes); the session ends at 3:00."""
    from gaccum_course.lessons import MINUTES_PER_EXERCISE, learner_time

    guide = (ROOT / "docs" / "facilitator-guide.md").read_text()
    core = guide.split("### The 3-hour core", 1)[1].split("\n\n", 2)[1]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in core.splitlines()[2:]]

    def minutes(clock):
        hours, mins = clock.split(":")
        return 60 * int(hours) + int(mins)

    assert rows[-1][:2] == ["3:00", "end"]
    by_name = {lesson.notebook.removesuffix(".ipynb"): lesson for lesson in LESSONS}
    whole = 0
    for row, after in zip(rows, rows[1:], strict=False):
        slot = minutes(after[0]) - minutes(row[0])
        assert slot > 0, row
        if row[4].startswith("all of it"):
            time = learner_time(by_name[row[1].strip("`")])
            assert slot >= time.without_exercises + MINUTES_PER_EXERCISE, (row[1], slot, time.without_exercises)
            whole += 1
    assert whole >= 3


def test_the_agenda_states_what_lessons_00_to_06_take_with_every_exercise():
    from gaccum_course.lessons import learner_time

    total = sum(learner_time(lesson).total for lesson in LESSONS[:7])
    guide = (ROOT / "docs" / "facilitator-guide.md").read_text()
    assert f"exercises take {total // 60} h {total % 60:02d} min" in guide.replace("\n", " ")
