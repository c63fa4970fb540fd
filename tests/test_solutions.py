"""Every exercise with a check cell has a tested solution, and its checker can say no."""

import json
import re
import sys
from pathlib import Path

import pytest

from gaccum_lib.exercises import CHECKS, check

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "solutions"))
from answers import ANSWERS  # noqa: E402

WRONG = {"00.2": 2, "01.1": True, "01.2": 0.02, "02.1": [3, 6, 9], "03.2": [1, 2, 3, 4, 5, 6, 7, 8], "04.1": 52,
         "05.1": 3738, "05.2": 2, "06.2": "no update"}


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
    with pytest.raises(ValueError, match="exercise must be one of"):
        check("99.9", 1)


def test_the_solutions_readme_answers_every_exercise():
    text = (ROOT / "solutions" / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("0*.ipynb")):
        assert f"## {path.stem}" in text, f"solutions/README.md has no section for {path.name}"
