"""Write the book's table of components (book/components.md) from the code itself.

Every component the course teaches ends its docstring with a line such as

    Course: chapter 2, exercise 2.3, checked by checks.attention.check_multihead_attention.

(or just `Course: chapter 2.` where there is no exercise; a part written in two chapters lists
both, separated by "; "). This script collects those lines and, for each component, its code,
the test files that use it, its exercise and checker, and its chapter's page. It refuses
docstrings that disagree with the workbooks: an exercise number that is not the one the
workbook gives the component, a checker the workbook never calls.

    python scripts/components.py          # rewrite book/components.md
    python scripts/components.py --check  # exit 1 if book/components.md is stale
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from notebooks import SOURCES, parse_source  # noqa: E402

PACKAGE = "transformer_course"
TABLE = ROOT / "book" / "components.md"
EXERCISE = r"exercise (\d+\.\d+), checked by (checks(?:\.\w+)+)"
COURSE_LINE = re.compile(
    rf"^Course: chapter (?P<chapter>\d+)(?P<exercises>, {EXERCISE}(?:; {EXERCISE})*)?\.$"
)


@dataclass
class Component:
    name: str  # module.object, under transformer_course
    chapter: int
    exercises: dict[str, str]  # exercise number -> checker


def course_line(obj: object) -> str | None:
    """The `Course:` line that ends an object's own docstring (it may wrap), if it has one."""
    doc = obj.__doc__  # a class's own: __doc__ is not inherited
    lines = [line.strip() for line in inspect.cleandoc(doc or "").splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Course:")]
    return " ".join(lines[starts[-1] :]).strip() if starts else None


def components() -> list[Component]:
    """Every class and function of the package (checkers excepted) with a `Course:` line."""
    package = importlib.import_module(PACKAGE)
    found: list[Component] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "checks":
            continue
        module = importlib.import_module(f"{PACKAGE}.{info.name}")
        for name, obj in vars(module).items():
            is_own = getattr(obj, "__module__", None) == module.__name__
            if not (is_own and (inspect.isclass(obj) or inspect.isfunction(obj))):
                continue
            line = course_line(obj)
            if line is None:
                continue
            match = COURSE_LINE.match(line)
            if match is None:
                raise ValueError(f"{module.__name__}.{name}: malformed course line {line!r}")
            found.append(
                Component(
                    name=f"{info.name}.{name}",
                    chapter=int(match["chapter"]),
                    exercises=dict(re.findall(EXERCISE, match["exercises"] or "")),
                )
            )
    return sorted(found, key=lambda c: (c.chapter, _exercise_key(c), c.name))


def _exercise_key(component: Component) -> tuple[int, ...]:
    first = min(component.exercises, default=None, key=lambda n: tuple(map(int, n.split("."))))
    return tuple(map(int, first.split("."))) if first else (10**6,)


def workbook_exercises() -> dict[str, tuple[str, str]]:
    """Exercise number -> (`module.object`, the chapter source's text), from every source."""
    exercises: dict[str, tuple[str, str]] = {}
    for source in sorted(SOURCES.glob("[0-9][0-9]_*.py")):
        chapter = int(source.stem.split("_")[0])
        cells = [cell for cell in parse_source(source) if cell.kind == "exercise"]
        for number, cell in enumerate(cells, start=1):
            module, obj = cell.target.split(":")
            name = f"{module.removeprefix(PACKAGE + '.')}.{obj}"
            exercises[f"{chapter}.{number}"] = (name, source.read_text())
    return exercises


def disagreements(found: list[Component]) -> list[str]:
    """Where docstrings and workbooks disagree; empty when they agree."""
    exercises = workbook_exercises()
    by_name = {c.name: c for c in found}
    problems = []
    for number, (name, text) in exercises.items():
        component = by_name.get(name)
        if component is None or number not in component.exercises:
            said = ", ".join(component.exercises) or "none" if component else "no course line"
            problems.append(f"{name}: the workbook has exercise {number}, the docstring {said}")
        elif component.exercises[number].rsplit(".", 1)[1] + "(" not in text:
            checker = component.exercises[number]
            problems.append(f"{name}: the workbook of exercise {number} never calls {checker}")
    for component in found:
        for number in component.exercises:
            if exercises.get(number, ("",))[0] != component.name:
                problems.append(f"{component.name}: exercise {number} is not this in any workbook")
    return problems


def tests_using(name: str) -> list[str]:
    """Test files that mention the object by name."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    return sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if word.search(p.read_text()))


def page_for(chapter: int) -> str | None:
    """The chapter's book page, or None while it has none (the code comes first)."""
    page = next((ROOT / "book").glob(f"{chapter:02d}_*.ipynb"), None)
    return None if page is None else page.stem


def render(found: list[Component]) -> str:
    rows = [
        "# Components",
        "",
        "Every part the course builds, chapter by chapter: the component (`module.name`, its",
        "code in `src/transformer_course/module.py`), the tests that use it",
        "(`tests/test_<name>.py`), the exercise where you write it and the checker (in",
        "`transformer_course.checks`; the workbook imports it) that grades yours.",
        "Generated by `scripts/components.py` from the `Course:` line that ends each component's",
        "docstring; a test keeps it current.",
    ]
    for chapter in sorted({c.chapter for c in found}):
        page = page_for(chapter)
        rows += [
            "",
            f"## Chapter {chapter}",
            "",
            f"The chapter: {{doc}}`{page}`." if page else "The chapter's page is to come.",
            "",
            "| component | tests | exercise | checker |",
            "|---|---|---|---|",
        ]
        for c in (c for c in found if c.chapter == chapter):
            name = c.name.split(".")[-1]
            tests = ", ".join(t[len("test_") : -len(".py")] for t in tests_using(name)) or "—"
            numbers = ", ".join(c.exercises) or "—"
            checkers = ", ".join(
                f"`{checker.rsplit('.', 1)[1]}`" for checker in c.exercises.values()
            )
            rows.append(f"| `{c.name}` | {tests} | {numbers} | {checkers or '—'} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    found = components()
    problems = disagreements(found)
    if problems:
        print("docstrings and workbooks disagree:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    table = render(found)
    if args.check:
        if not TABLE.exists() or TABLE.read_text() != table:
            print(f"{TABLE.relative_to(ROOT)} is stale: run python scripts/components.py")
            return 1
        return 0
    TABLE.write_text(table)
    print(f"wrote {TABLE.relative_to(ROOT)}: {len(found)} components")
    return 0


if __name__ == "__main__":
    sys.exit(main())
