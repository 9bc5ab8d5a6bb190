"""The generated workbooks: never stale, and every blank fails its check with a helpful message.

The other direction (the solutions pass every check) is nbval's run of `solutions/`.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import notebooks  # noqa: E402

from transformer_course.checks.harness import CheckFailure, call, expect  # noqa: E402

SOURCES = sorted(notebooks.SOURCES.glob("*.py"))


def test_there_are_workbooks():
    assert SOURCES, f"no workbook sources in {notebooks.SOURCES}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_generated_workbooks_are_current(source):
    repo = notebooks.repository_url()
    for path, solution in zip(notebooks.workbook_paths(source), (False, True)):
        expected = notebooks.build(source, solution=solution, repo_url=repo)
        assert not notebooks.stale(path, expected), (
            f"{path.relative_to(ROOT)} is stale: run `python scripts/notebooks.py {source.stem}`"
        )


def _runnable(code: str) -> str:
    """Cell code without IPython magics and shell escapes, for plain `exec`."""
    return "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_blank_fails_its_check_naming_the_exercise(source, monkeypatch):
    """Run the exercise workbook's cells in order: each exercise's first check must fail fast
    with a short `CheckFailure` that names the exercise and gives none of its hints away."""
    cells = notebooks.parse_source(source)
    notebook = notebooks.build(source, solution=False, repo_url=None)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    kinds = [c for c in cells if c.kind != "markdown"]
    assert len(kinds) == len(code_cells)
    monkeypatch.chdir(ROOT / "exercises")
    namespace: dict = {"__name__": "__workbook__"}
    pending: list[notebooks.SourceCell] = []
    checked = 0
    for cell, code in zip(kinds, code_cells):
        if cell.kind == "exercise":
            pending.append(cell)
        with contextlib.redirect_stdout(io.StringIO()):
            if cell.kind != "check":
                exec(compile(_runnable(code.source), f"<{source.stem}>", "exec"), namespace)
                continue
            with pytest.raises(Exception) as failure:
                exec(compile(_runnable(code.source), f"<{source.stem}>", "exec"), namespace)
        if pending:
            assert isinstance(failure.value, CheckFailure), (
                f"{source.stem}: the check after an exercise raised "
                f"{type(failure.value).__name__}: {failure.value} — expected a CheckFailure"
            )
            message = str(failure.value)
            assert "not implemented yet" in message and "Exercise " in message, message
            assert len(message) <= 200, f"{source.stem}: a blank's message runs long: {message}"
            for hint in (h for c in pending for h in notebooks.hints(c)):
                assert hint not in message, (
                    f"{source.stem}: the message gives a hint away: {message}"
                )
            pending = []
            checked += 1
    assert checked >= 1, f"{source.stem}: no exercise is followed by a check"


def _exercise_cells(notebook) -> list[tuple[int, object]]:
    return [
        (index, cell)
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and "NotImplementedError(" in cell.source
    ]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_each_exercise_has_a_header_hints_and_a_collapsed_solution(source):
    exercises = [c for c in notebooks.parse_source(source) if c.kind == "exercise"]
    blanked = notebooks.build(source, solution=False, repo_url=None)
    solved = notebooks.build(source, solution=True, repo_url=None)
    found = _exercise_cells(blanked)
    assert len(found) == len(exercises), f"{source.stem}: every exercise cell holds a blank"
    chapter = int(source.stem[:2])
    for number, ((index, cell), exercise) in enumerate(zip(found, exercises), start=1):
        header, help_cell = blanked.cells[index - 1], blanked.cells[index + 1]
        assert header.cell_type == "markdown" and re.fullmatch(
            rf"> \*\*Exercise {chapter}\.{number}\*\* · difficulty [●○]{{5}} · "
            r"importance [●○]{5} · about \d+ minutes",
            header.source,
        ), header.source
        assert f"Exercise {chapter}.{number}: write" in cell.source
        hints = notebooks.hints(exercise)
        assert help_cell.source.count("<details><summary>Hint") == len(hints) >= 1
        for hint in hints:
            assert hint in help_cell.source and hint not in cell.source
        assert "<details><summary>Solution" in help_cell.source
        reference = solved.cells[index].source
        for name in notebooks.blanked_names(exercise):
            definition = next(line for line in reference.splitlines() if f"def {name}(" in line)
            assert definition.strip() in help_cell.source, f"{source.stem}: {name}'s solution"
        assert "<details><summary>Solution" not in solved.cells[index + 1].source


def test_an_exercise_without_ratings_or_hints_is_refused(tmp_path):
    source = tmp_path / "09_demo.py"
    source.write_text(
        "# %% [exercise] transformer_course.masking:causal_mask difficulty=2\n# hint: x\n"
    )
    with pytest.raises(ValueError, match="importance=N minutes=N"):
        notebooks.parse_source(source)
    source.write_text("# %% [exercise] m:f difficulty=6 importance=1 minutes=5\n")
    with pytest.raises(ValueError, match="difficulty must be an integer from 1 to 5, got '6'"):
        notebooks.parse_source(source)
    source.write_text("# %% [exercise] m:f difficulty=1 importance=1 minutes=5\n")
    (cell,) = notebooks.parse_source(source)
    with pytest.raises(ValueError, match="at least one '# hint: ...'"):
        notebooks.hints(cell)


def _learners_code(x):
    return x.missing_attribute  # the learner's bug: an AttributeError in their own code


def test_a_failed_check_shows_its_message_and_the_learners_frames_only():
    with pytest.raises(CheckFailure) as plain:
        expect(False, "LayerNorm.forward", "values differ.", "is eps inside the square root?")
    assert plain.value._render_traceback_() == [
        "CheckFailure: `LayerNorm.forward`: values differ.",
        "Hint: is eps inside the square root?",
    ]
    with pytest.raises(CheckFailure) as crashed:
        call("LayerNorm.forward", _learners_code, 1)
    shown = "\n".join(crashed.value._render_traceback_())
    assert "AttributeError" in shown and "_learners_code" in shown and __file__ in shown
    assert "transformer_course/checks" not in shown


def test_colab_install_cell_comes_first_when_the_course_has_a_repository():
    source = SOURCES[0]
    with_repo = notebooks.build(source, solution=False, repo_url="https://github.com/owner/course")
    first = with_repo.cells[0]
    assert first.metadata["tags"] == ["colab"]
    assert '"google.colab" in sys.modules' in first.source
    assert "git+https://github.com/owner/course" in first.source
    without = notebooks.build(source, solution=False, repo_url=None)
    assert len(with_repo.cells) == len(without.cells) + 1
    assert "google.colab" not in without.cells[0].source
