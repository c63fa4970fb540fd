"""The committed notebooks follow the policy, and the policy checker catches violations."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from gaccum_course.lessons import LESSONS, lesson_table, longest_first

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


def test_checker_flags_long_prose_source_line_numbers_source_reading_and_pinned_floats(tmp_path):
    def notebook(markdown, code, hidden=False):
        metadata = {"jupyter": {"source_hidden": True}} if hidden else {}
        return {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3"}},
                "cells": [{"cell_type": "markdown", "metadata": {}, "source": [markdown]},
                          {"cell_type": "code", "metadata": metadata, "source": [code], "outputs": [],
                           "execution_count": None}]}

    cases = {
        "long": notebook("word " * 1501, "x = 1"),
        "short": notebook("word " * 1500, "x = 1"),
        "cites": notebook("see `engine.py`, line 3413", "x = 1"),
        "reads": notebook("x", "import inspect\nsource = inspect.getsource(f)"),
        "pins": notebook("x", "assert round(d, 3) == 0.883"),
        "pins_list": notebook("x", "assert [round(s, 3) for s in scales] == [0.621, 0.379]"),
        "claims": notebook("x", 'cmp("real vs full batch", a, b, tol=1e-6)\nassert spread == 0.0 and n == 64'),
        "hidden": notebook("x", "assert round(d, 3) == 0.883", hidden=True),
    }
    for name, nb in cases.items():
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(nb))
    out = subprocess.run([*CHECKER, str(tmp_path)], capture_output=True, text=True).stdout
    assert "long.ipynb: 1501 words of prose (at most 1500)" in out and "short.ipynb: 1500 words" not in out
    assert "cites.ipynb: cell 0 cites a source line number (line 3413)" in out
    assert "reads.ipynb: cell 1 reads library source" in out
    assert "pins.ipynb: cell 1 pins an exact float" in out and "pins_list.ipynb: cell 1 pins an exact float" in out
    assert "claims.ipynb: cell 1 pins" not in out and "hidden.ipynb: cell 1 pins" not in out


def test_the_lesson_map_matches_the_notebooks_on_disk():
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [lesson.notebook for lesson in LESSONS] == on_disk
    table = lesson_table()
    assert all(f"| `{lesson.notebook}` | {lesson.title} |" in table for lesson in LESSONS)


def test_the_core_path_fits_a_3_hour_workshop_and_reads_first():
    from gaccum_course.lessons import PARTS

    assert {lesson.part for lesson in LESSONS} <= set(PARTS)
    core = [lesson for lesson in LESSONS if lesson.part == "core"]
    assert sum(lesson.learner_minutes[1] for lesson in core) <= 180  # the readers' times, exercises included
    assert LESSONS[:len(core)] == tuple(core)  # the numbering shows the path: the core lessons come first



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
