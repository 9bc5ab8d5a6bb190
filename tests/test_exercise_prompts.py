"""No exercise gives its answer away: what a learner sees before opening the last hint (the
blank with its docstring, the prompt above it and every hint but the last) contains no line of
the reference solution's code."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import notebooks  # noqa: E402

TOKEN = re.compile(r"[A-Za-z_]\w*|\d+(?:\.\d+)?|==|!=|<=|>=|\*\*|//|[-+*/%@<>=()\[\]{},:~&|^]")
SHORTEST = 4  # tokens; `return x` or `x = 0` give nothing away


def tokens(text: str) -> list[str]:
    """Code tokens, with `self` dropped: `self.W_E[tokens]` reads as `W_E[tokens]`."""
    return [t for t in TOKEN.findall(text) if t != "self"]


def solution_lines(source: str, names: list[str]) -> list[str]:
    """The code lines of the named functions' bodies that the rest of `source` (what the
    exercise gives) does not contain too."""
    lines = source.splitlines()
    blanked: set[int] = set()
    for node in notebooks._functions(source, names):
        body = node.body
        docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        first = body[1] if docstring and len(body) > 1 else body[0]
        blanked |= set(range(first.lineno - 1, node.end_lineno))
    given = " ".join(tokens("\n".join(lines[k] for k in range(len(lines)) if k not in blanked)))
    code = [lines[k].strip() for k in sorted(blanked)]
    return [
        line
        for line in code
        if len(tokens(line)) >= SHORTEST
        and not line.startswith(("#", "validate."))  # argument checks, not the algorithm
        and " ".join(tokens(line)) not in given
    ]


def exercises():
    for source in sorted(notebooks.SOURCES.glob("*.py")):
        cells = notebooks.parse_source(source)
        chapter, count = int(source.stem[:2]), 0
        for index, cell in enumerate(cells):
            if cell.kind == "exercise":
                count += 1
                prompt = cells[index - 1] if cells[index - 1].kind == "markdown" else None
                yield pytest.param(cell, prompt, f"{chapter}.{count}", id=f"{chapter}.{count}")


@pytest.mark.parametrize(("cell", "prompt", "number"), list(exercises()))
def test_what_a_learner_sees_first_holds_no_line_of_the_solution(cell, prompt, number):
    blank = notebooks.exercise_code(cell, number, solution=False)
    seen = [blank, *(prompt.lines if prompt else []), *notebooks.hints(cell)[:-1]]
    visible = " ".join(tokens("\n".join(seen)))
    reference = notebooks.target_source(cell)
    leaked = [
        line
        for line in solution_lines(reference, notebooks.blanked_names(cell))
        if " ".join(tokens(line)) in visible
    ]
    assert leaked == [], f"exercise {number} shows lines of its solution"
