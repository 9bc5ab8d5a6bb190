"""The generated workbooks: never stale, and every blank fails its check with a helpful message.

The other direction (the solutions pass every check) is nbval's run of `solutions/`.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import notebooks  # noqa: E402

from transformer_course.checks import CheckFailure  # noqa: E402

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
def test_every_blank_fails_its_check_with_the_hint(source, monkeypatch, tmp_path):
    """Run the exercise workbook's cells in order: each exercise's first check must fail
    with a `CheckFailure` that carries the exercise's hint."""
    cells = notebooks.parse_source(source)
    notebook = notebooks.build(source, solution=False, repo_url=None)
    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    kinds = [c for c in cells if c.kind != "markdown"]
    assert len(kinds) == len(code_cells)
    monkeypatch.chdir(ROOT / "exercises")
    namespace: dict = {"__name__": "__workbook__"}
    pending_hints: list[str] = []
    checked = 0
    for cell, code in zip(kinds, code_cells):
        if cell.kind == "exercise":
            hints = notebooks._hints(cell)
            pending_hints += list(hints.values()) or [""]
        with contextlib.redirect_stdout(io.StringIO()):
            if cell.kind != "check":
                exec(compile(_runnable(code.source), f"<{source.stem}>", "exec"), namespace)
                continue
            with pytest.raises(Exception) as failure:
                exec(compile(_runnable(code.source), f"<{source.stem}>", "exec"), namespace)
        if pending_hints:
            assert isinstance(failure.value, CheckFailure), (
                f"{source.stem}: the check after an exercise raised {type(failure.value).__name__}: "
                f"{failure.value} — expected a CheckFailure with a hint"
            )
            message = str(failure.value)
            assert "not implemented" in message, message
            assert any(h and h in message for h in pending_hints), (
                f"{source.stem}: the check message does not repeat the exercise's hint: {message}"
            )
            pending_hints = []
            checked += 1
    assert checked >= 1, f"{source.stem}: no exercise is followed by a check"


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
