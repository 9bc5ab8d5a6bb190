"""Generate each chapter's exercise and solution workbooks from its one source.

A workbook source is `exercises/source/NN_topic.py`, in jupytext's percent format, with two extra
cell kinds:

    # %% [exercise] transformer_course.tokenization:merge difficulty=2 importance=4 minutes=10
    # docstring: What to build, its shapes and conventions; not how.
    # hint: A nudge that names the idea, not the code.
    # hint: A more specific hint; a line that starts with "#   " continues the line above.

is replaced by the real code of `merge` from `src/` in the solution workbook, and by the same
signature with a short `raise NotImplementedError("Exercise N.M: ...")` in the exercise workbook,
under the `docstring:` text when there is one (else src's docstring): src's docstrings explain
the code to its readers, and may say too much to someone about to write it. For a class,
`blank=forward[,method]` blanks only the named methods, and `docstring METHOD:` gives each one
its own.

Every exercise gets a header (difficulty and importance out of 5, expected minutes) above it
and, below it, its graded hints and (in the exercise workbook) the reference solution, each in
a collapsed `<details>` block, so the answer is one deliberate click away and never in an error
message.

    # %% [check]

is an ordinary code cell that exercises a learner's code; in the exercise workbook it carries
the `raises-exception` tag, because blanks fail their checks until the learner fills them in.
Any cell header may end in `tags=a,b` to add notebook cell tags (`nbval-ignore-output`, ...).

Usage:
    python scripts/notebooks.py            # regenerate exercises/ and solutions/
    python scripts/notebooks.py --execute  # ... and store fresh outputs in solutions/ and book/
    python scripts/notebooks.py --check    # exit 1 if a generated workbook is stale
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "exercises" / "source"
HEADER = re.compile(r"^# %%(?: \[(?P<kind>[a-z]+)\])?(?P<rest>.*)$")
HINT = re.compile(r"^#\s*hint:\s*(?P<text>.+)$")
DOCSTRING = re.compile(r"^#\s*docstring(?: (?P<name>\w+))?:\s*(?P<text>.+)$")
HINT_CONTINUATION = re.compile(r"^#\s{2,}(?P<text>\S.*)$")
RATINGS = ("difficulty", "importance")  # each 1..5, as ARENA's exercise headers
COLAB_CELL = """\
# On Colab, install the course package first (elsewhere this cell does nothing).
import sys

if "google.colab" in sys.modules:
    %pip install --quiet "transformer-course @ git+{repo}"\
"""


@dataclass
class SourceCell:
    kind: str  # "markdown", "code", "exercise" or "check"
    lines: list[str]
    target: str = ""
    blank: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    meta: dict[str, int] = field(default_factory=dict)  # difficulty, importance, minutes


def parse_source(path: Path) -> list[SourceCell]:
    """Split a percent-format source into cells."""
    cells: list[SourceCell] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        header = HEADER.match(line)
        if header is None:
            if not cells:
                if line.strip():
                    raise ValueError(f"{path}:{number}: text before the first '# %%' cell header")
                continue
            cells[-1].lines.append(line)
            continue
        kind = header["kind"] or "code"
        if kind not in ("code", "markdown", "exercise", "check"):
            raise ValueError(f"{path}:{number}: unknown cell kind [{kind}]")
        cell = SourceCell(kind, [])
        for word in header["rest"].split():
            if word.startswith("tags="):
                cell.tags += word.removeprefix("tags=").split(",")
            elif word.startswith("blank="):
                cell.blank += word.removeprefix("blank=").split(",")
            elif kind == "exercise" and word.partition("=")[0] in (*RATINGS, "minutes"):
                key, _, value = word.partition("=")
                cell.meta[key] = _rating(path, number, key, value)
            elif kind == "exercise" and not cell.target:
                cell.target = word
            else:
                raise ValueError(f"{path}:{number}: unexpected {word!r} in cell header")
        if kind == "exercise" and not cell.target:
            raise ValueError(f"{path}:{number}: [exercise] needs a target such as module:function")
        missing = [
            key for key in (*RATINGS, "minutes") if kind == "exercise" and key not in cell.meta
        ]
        if missing:
            raise ValueError(f"{path}:{number}: [exercise] needs {'=N '.join(missing)}=N")
        cells.append(cell)
    return cells


def _rating(path: Path, number: int, key: str, value: str) -> int:
    """A header's `difficulty=`, `importance=` (1..5) or `minutes=` (1..120) value."""
    top = 5 if key in RATINGS else 120
    if not value.isdigit() or not 1 <= int(value) <= top:
        raise ValueError(
            f"{path}:{number}: {key} must be an integer from 1 to {top}, got {value!r}"
        )
    return int(value)


def _strip(lines: list[str]) -> str:
    """Drop blank lines at both ends of a cell."""
    return "\n".join(lines).strip("\n")


def _markdown(lines: list[str]) -> str:
    return _strip([line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines])


def _notes(cell: SourceCell) -> list[tuple[str, str, list[str]]]:
    """The exercise cell's `# docstring:` and `# hint:` notes, in order: (kind, method name or
    "", lines), each continued by `#   more` lines."""
    found: list[tuple[str, str, list[str]]] = []
    for line in cell.lines:
        hint, doc = HINT.match(line.strip()), DOCSTRING.match(line.strip())
        more = HINT_CONTINUATION.match(line.rstrip())
        if hint is not None:
            found.append(("hint", "", [hint["text"]]))
        elif doc is not None:
            found.append(("docstring", doc["name"] or "", [doc["text"]]))
        elif more is not None and found:
            found[-1][2].append(more["text"])
        elif line.strip():
            raise ValueError(
                f"[exercise] {cell.target}: only '# hint:' and '# docstring:' lines belong "
                f"here, got {line!r}"
            )
    return found


def hints(cell: SourceCell) -> list[str]:
    """The exercise's graded hints, in order."""
    found = [" ".join(lines) for kind, _, lines in _notes(cell) if kind == "hint"]
    if not found:
        raise ValueError(f"[exercise] {cell.target}: give at least one '# hint: ...'")
    return found


def docstrings(cell: SourceCell) -> dict[str, str]:
    """The learner-facing docstring of each blanked function (by name), where the source gives
    one; a docstring line is kept as written (its lines are the docstring's lines)."""
    names = blanked_names(cell)
    found = {}
    for kind, name, lines in _notes(cell):
        if kind == "docstring":
            if not name and len(names) != 1:
                raise ValueError(f"[exercise] {cell.target}: name the method: '# docstring NAME:'")
            found[name or names[0]] = "\n".join(lines)
    return found


def resolve(target: str) -> object:
    module_name, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _functions(source: str, names: list[str]) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The named functions or methods of `source`, in the order they are written."""
    functions = {
        node.name: node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    for name in names:
        if name not in functions:
            raise ValueError(f"blank={name}: no function or method of that name in the target")
    return sorted((functions[n] for n in names), key=lambda node: node.lineno)


def blank_out(
    source: str, names: list[str], label: str, docstrings: dict[str, str] | None = None
) -> str:
    """Replace the bodies of the named functions in `source` with `raise NotImplementedError`.

    The signature and decorators are kept exactly as written in src, and the docstring too
    unless `docstrings` gives the function another; the error names the exercise and nothing
    more.
    """
    lines = source.splitlines()
    # Work bottom-up so earlier line numbers stay valid.
    for node in reversed(_functions(source, names)):
        body = node.body
        has_docstring = (
            isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        )
        first = body[1] if has_docstring and len(body) > 1 else body[0]
        if has_docstring and len(body) == 1:
            raise ValueError(f"blank={node.name}: the function has nothing but a docstring")
        indent = re.match(r"\s*", lines[first.lineno - 1])[0]
        start = body[0].lineno - 1 if has_docstring else first.lineno - 1
        new = [f"{indent}raise NotImplementedError({label!r})"]
        given = (docstrings or {}).get(node.name)
        if given is not None:
            text = textwrap.indent(given, indent).lstrip()
            new.insert(
                0, f'{indent}"""{text}\n{indent}"""' if "\n" in given else f'{indent}"""{text}"""'
            )
        elif has_docstring:
            new = lines[start : body[0].end_lineno] + new
        lines[start : node.end_lineno] = new
    return "\n".join(lines)


def target_source(cell: SourceCell) -> str:
    """The real code of an exercise's target, as written in src."""
    obj = resolve(cell.target)
    if inspect.isclass(obj) and not cell.blank:
        raise ValueError(f"[exercise] {cell.target}: a class needs blank=method[,method]")
    return textwrap.dedent(inspect.getsource(obj)).rstrip("\n")


def blanked_names(cell: SourceCell) -> list[str]:
    return cell.blank or [cell.target.rpartition(":")[2].rpartition(".")[2]]


def exercise_label(cell: SourceCell, number: str) -> str:
    """What a blank says: the exercise and what to write, never how."""
    owner = cell.target.rpartition(":")[2]
    if not cell.blank:
        return f"Exercise {number}: write {owner} (hints below the cell)"
    names = [f"{owner}.{name}" if len(cell.blank) == 1 else name for name in cell.blank]
    where = "" if len(cell.blank) == 1 else f" of {owner}"
    return f"Exercise {number}: write {', '.join(names)}{where} (hints below the cell)"


def exercise_code(cell: SourceCell, number: str, *, solution: bool) -> str:
    source = target_source(cell)
    if solution:
        return source
    label = exercise_label(cell, number)
    return blank_out(source, blanked_names(cell), label, docstrings(cell))


def exercise_header(cell: SourceCell, number: str) -> str:
    """ARENA-style header: difficulty and importance as five dots each, and expected minutes."""
    dots = {key: "●" * cell.meta[key] + "○" * (5 - cell.meta[key]) for key in RATINGS}
    return (
        f"> **Exercise {number}** · difficulty {dots['difficulty']} · "
        f"importance {dots['importance']} · about {cell.meta['minutes']} minutes"
    )


def solution_text(cell: SourceCell) -> str:
    """The reference code of just the blanked functions or methods."""
    source = target_source(cell)
    if not cell.blank:
        return source
    lines = source.splitlines()
    methods = []
    for node in _functions(source, cell.blank):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        methods.append(textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno])))
    return "\n\n".join(methods)


def help_cell(cell: SourceCell, *, solution: bool) -> str:
    """The collapsed hints, and in the exercise workbook the collapsed reference solution."""
    blocks = [
        f"<details><summary>Hint {index}</summary>\n\n{text}\n\n</details>"
        for index, text in enumerate(hints(cell), start=1)
    ]
    if not solution:
        blocks.append(
            "<details><summary>Solution (the course's implementation)</summary>\n\n"
            f"```python\n{solution_text(cell)}\n```\n\n</details>"
        )
    return "\n".join(blocks)


def exercise_list(source: Path) -> list[tuple[str, SourceCell]]:
    """(number, cell) of every exercise of a workbook source, in order."""
    chapter = int(source.stem.split("_")[0])
    found = [cell for cell in parse_source(source) if cell.kind == "exercise"]
    return [(f"{chapter}.{k}", cell) for k, cell in enumerate(found, start=1)]


def launch_links(repo_url: str | None, notebook: str) -> str:
    """Colab and Binder links to a workbook, where the course has a public repository."""
    match = re.match(r"https://github.com/([^/]+/[^/]+?)(?:\.git)?/?$", repo_url or "")
    if match is None:
        return ""
    repo = match[1]
    colab = f"https://colab.research.google.com/github/{repo}/blob/main/{notebook}"
    binder = f"https://mybinder.org/v2/gh/{repo}/main?labpath={notebook}"
    return f" Open it in [Colab]({colab}) or [Binder]({binder})."


def exercise_box(source: Path, repo_url: str | None) -> str:
    """The book page's box that opens each chapter: the workbook's links and its exercises."""
    chapter = int(source.stem.split("_")[0])
    name = f"{source.stem}.ipynb"
    rows = []
    for number, cell in exercise_list(source):
        what = " and ".join(f"`{n}`" for n in blanked_names(cell))
        owner = cell.target.rpartition(":")[2]
        if cell.blank:
            what = " and ".join(f"`{owner}.{n}`" for n in cell.blank)
        dots = "●" * cell.meta["difficulty"] + "○" * (5 - cell.meta["difficulty"])
        rows.append(f"| {number} | {what} | {dots} | {cell.meta['minutes']} |")
    table = "\n".join(["| | you write | difficulty | min |", "|---|---|---|---|", *rows])
    return (
        f"(ch{chapter}-exercises)=\n"
        f"````{{admonition}} Exercises: the chapter {chapter} workbook\n"
        ":class: tip\n"
        f"Build this chapter's parts yourself in its workbook, "
        f"{{download}}`{name} <../exercises/{name}>` (and its completed twin, "
        f"{{download}}`the solutions <../solutions/{name}>`); {{ref}}`usage` says how to set up."
        f"{launch_links(repo_url, f'exercises/{name}')}\n\n{table}\n````"
    )


def book_with_box(source: Path, repo_url: str | None) -> nbformat.NotebookNode | None:
    """The chapter's book page with its exercise box written in (or None if it has no page):
    the box is the markdown cell starting with the `(chN-exercises)=` label, placed after the
    page's first cell."""
    page = ROOT / "book" / f"{source.stem}.ipynb"
    if not page.exists():
        return None
    notebook = nbformat.read(page, as_version=4)
    box = exercise_box(source, repo_url)
    label = box.split("\n", 1)[0]
    cells = [c for c in notebook.cells if c.cell_type == "markdown" and c.source.startswith(label)]
    if cells:
        cells[0].source = box
    else:
        cell = nbformat.v4.new_markdown_cell(box)
        cell.id = f"ch{source.stem[:2]}-exercises"
        notebook.cells.insert(1, cell)
    return notebook


def build(source: Path, *, solution: bool, repo_url: str | None) -> nbformat.NotebookNode:
    """The exercise (solution=False) or solution (solution=True) workbook for one source."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    cells = parse_source(source)
    chapter = int(source.stem.split("_")[0])
    exercises = 0
    if repo_url:
        colab = nbformat.v4.new_code_cell(COLAB_CELL.format(repo=repo_url))
        colab.metadata["tags"] = ["colab"]
        notebook.cells.append(colab)
    for cell in cells:
        if cell.kind == "markdown":
            new = nbformat.v4.new_markdown_cell(_markdown(cell.lines))
        elif cell.kind == "exercise":
            exercises += 1
            number = f"{chapter}.{exercises}"
            notebook.cells.append(nbformat.v4.new_markdown_cell(exercise_header(cell, number)))
            new = nbformat.v4.new_code_cell(exercise_code(cell, number, solution=solution))
        else:
            new = nbformat.v4.new_code_cell(_strip(cell.lines))
        tags = list(cell.tags)
        if cell.kind == "check" and not solution:
            tags.append("raises-exception")
        if tags:
            new.metadata["tags"] = tags
        notebook.cells.append(new)
        if cell.kind == "exercise":
            notebook.cells.append(nbformat.v4.new_markdown_cell(help_cell(cell, solution=solution)))
    # Stable ids keep regenerated notebooks byte-identical.
    for index, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{index:03d}"
    return notebook


def repository_url() -> str | None:
    """The repository URL from `_config.yml` (`repository.url`), if the course has one."""
    config = ROOT / "_config.yml"
    if not config.exists():
        return None
    match = re.search(r"^repository:\s*\n(?:\s+.*\n)*?\s+url:\s*(\S+)", config.read_text(), re.M)
    return match[1] if match else None


def outputs_key(cell: nbformat.NotebookNode) -> tuple:
    return (cell.cell_type, cell.source, tuple(cell.metadata.get("tags", [])))


def stale(path: Path, expected: nbformat.NotebookNode) -> bool:
    """True if the stored notebook's cells differ from the generated ones (outputs aside)."""
    if not path.exists():
        return True
    stored = nbformat.read(path, as_version=4)
    return [outputs_key(c) for c in stored.cells] != [outputs_key(c) for c in expected.cells]


def keep_outputs(path: Path, notebook: nbformat.NotebookNode) -> None:
    """Carry stored outputs over to cells whose source did not change."""
    if not path.exists():
        return
    stored = {
        outputs_key(c): c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"
    }
    for cell in notebook.cells:
        old = stored.get(outputs_key(cell))
        if cell.cell_type == "code" and old is not None:
            cell.outputs, cell.execution_count = old.outputs, old.execution_count


def execute(path: Path) -> None:
    """Run a notebook top to bottom in this Python environment and store its outputs."""
    from nbclient import NotebookClient

    # One thread, as each of the test suite's xdist workers has: the stored outputs are what
    # nbval will see.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    notebook = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    client = NotebookClient(notebook, timeout=1800, kernel_name="python3", resources=resources)
    client.record_timing = False  # no timestamps in the stored notebooks
    client.execute()
    nbformat.write(notebook, path)


def workbook_paths(source: Path) -> tuple[Path, Path]:
    return ROOT / "exercises" / f"{source.stem}.ipynb", ROOT / "solutions" / f"{source.stem}.ipynb"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale workbooks")
    parser.add_argument(
        "--execute", action="store_true", help="store fresh outputs in solutions/ and book/"
    )
    parser.add_argument(
        "chapters", nargs="*", help="source stems to process, e.g. 01_tokenization (default: all)"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    repo = repository_url()
    sources = sorted(SOURCES.glob("*.py"))
    if args.chapters:
        sources = [s for s in sources if s.stem in args.chapters]
    problems = []
    for source in sources:
        exercise_path, solution_path = workbook_paths(source)
        for path, solution in ((exercise_path, False), (solution_path, True)):
            notebook = build(source, solution=solution, repo_url=repo)
            if args.check:
                if stale(path, notebook):
                    problems.append(path.relative_to(ROOT))
                continue
            if solution:
                keep_outputs(path, notebook)
            nbformat.write(notebook, path)
            if solution and args.execute:
                execute(path)
            print(f"wrote {path.relative_to(ROOT)}")
        page = book_with_box(source, repo)
        if page is not None:
            path = ROOT / "book" / f"{source.stem}.ipynb"
            if args.check:
                if stale(path, page):
                    problems.append(path.relative_to(ROOT))
            else:
                nbformat.write(page, path)
    if args.execute and not args.check:
        for page in sorted((ROOT / "book").glob("*.ipynb")):
            if args.chapters and not any(
                page.stem.startswith(c.split("_")[0]) for c in args.chapters
            ):
                continue
            execute(page)
            print(f"executed {page.relative_to(ROOT)}")
    if problems:
        print("stale (run `python scripts/notebooks.py`):", *problems, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
