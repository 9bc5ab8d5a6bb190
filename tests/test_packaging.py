"""Every package the course imports is declared: the package's own imports in `pyproject.toml`'s
dependencies (an optional one, imported under `try: ... except ImportError`, in an extra), the
workbooks' and the book pages' in its `learn` extra, and the maintainers' (tests, scripts,
benchmarks) in `requirements.txt`."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = {  # import name -> distribution name, where they differ
    "transformer_lens": "transformer-lens",
    "fancy_einsum": "fancy-einsum",
    "yaml": "pyyaml",
    "xdist": "pytest-xdist",
    "IPython": "ipykernel",
}


def top_level_imports(code: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def optional_imports(code: str) -> set[str]:
    """The imports inside a `try` whose handler catches ImportError: the code runs without them."""
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            found |= top_level_imports(ast.unparse(ast.Module(body=node.body, type_ignores=[])))
    return found


def third_party(names: set[str]) -> set[str]:
    local = {"transformer_course", "test_encoder_decoder", "test_gpt2", "shape_checks", "book_site"}
    local |= {path.stem for path in (ROOT / "scripts").glob("*.py")}
    local |= {path.stem for path in (ROOT / "tests").glob("*.py")}
    return {
        DISTRIBUTION.get(name, name).lower().replace("_", "-")
        for name in names - local - set(sys.stdlib_module_names) - {"__future__"}
    }


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    lines = [
        line
        for cell in cells
        if cell["cell_type"] == "code"
        for line in "".join(cell["source"]).splitlines()
        if not line.lstrip().startswith(("%", "!"))
    ]
    return "\n".join(lines)


def names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PINNED = [
    line
    for line in (ROOT / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith(("#", "-e"))
]


def test_the_package_declares_what_it_imports():
    modules = [p.read_text() for p in (ROOT / "src").rglob("*.py")]
    optional = set().union(*(optional_imports(code) for code in modules))
    required = set().union(*(top_level_imports(code) for code in modules)) - optional
    assert third_party(required) - names(PROJECT["dependencies"]) == set()
    extras = set().union(*map(names, PROJECT["optional-dependencies"].values()))
    assert third_party(optional) - names(PROJECT["dependencies"]) - extras == set()


def test_the_learn_extra_covers_the_workbooks_and_the_book_pages():
    notebooks = [*(ROOT / "book").glob("*.ipynb"), *(ROOT / "exercises").glob("*.ipynb")]
    code = "\n".join(notebook_code(p) for p in notebooks)
    declared = names(PROJECT["dependencies"]) | names(PROJECT["optional-dependencies"]["learn"])
    assert third_party(top_level_imports(code)) - declared == set()


def test_requirements_pin_what_the_maintainers_run():
    files = [*(ROOT / "tests").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    files += [*(ROOT / "benchmarks").glob("*.py"), ROOT / "conftest.py"]
    code = "\n".join(p.read_text() for p in files)
    assert third_party(top_level_imports(code)) - names(PINNED) == set()
