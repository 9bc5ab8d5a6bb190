"""The book's table of components agrees with the code, the tests and the workbooks."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import components  # noqa: E402


def test_every_exercise_target_names_its_exercise_and_checker():
    assert components.disagreements(components.components()) == []


def test_the_table_in_the_book_is_current():
    assert components.main(["--check"]) == 0, "run python scripts/components.py"


def test_a_wrong_exercise_number_is_caught():
    found = components.components()
    assert found, "no component has a Course: line"
    wrong = [c for c in found if c.exercises]
    assert wrong, "no component names an exercise"
    wrong[0].exercises = {"99.1": "checks.x.check_x"}
    assert any("99.1" in problem for problem in components.disagreements(found))
