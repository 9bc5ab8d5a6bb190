"""Your parts, carried from chapter to chapter.

Each workbook's check cell ends with `keep(part)`: once the check has passed, the cell that
defines the part is saved to your own file, `my_transformer/chapter_N.py` beside the workbooks
(or in the folder `$TRANSFORMER_COURSE_PARTS` names). A later workbook starts with
`load_parts(globals(), chapter=N)`, which puts in the notebook the course's tools (the public
names of every module, and the private helpers of the modules that hold exercises; not the parts
of chapter N and later, which are the learner's to write) and every part of the chapters before
N: yours, run from your files and checked again with its exercise's check, or the course's where
yours is missing or fails, and a table says which is which.

Your parts are run in the notebook's own namespace, in chapter order, so they use one another:
chapter 6's GPT-2 is built from your block (chapter 5), whose attention (chapter 2) uses your
masks (chapter 3). The saved files are cells, not modules: `load_parts` runs them; an import
would not find the names they use.

A trained model is kept the same way, for a later chapter to look inside: `keep_model` saves
its configuration and weights (as a training checkpoint) beside your files, and `load_model`
builds it again, or says that it is not there.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import linecache
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformer_course import validate
from transformer_course.files import atomic_write
from transformer_course.training import History, load_checkpoint, read_checkpoint, save_checkpoint

__all__ = ["Part", "keep", "keep_model", "load_model", "load_parts", "parts_of", "whose_parts"]

FOLDER_ENV = "TRANSFORMER_COURSE_PARTS"
COURSE_LINE = re.compile(r"exercise (\d+)\.(\d+), checked by\s+checks\.(\w+)\.(\w+)")
MARKER = "# --- part: {name} (exercise {number}) ---"
MARKER_LINE = re.compile(r"^# --- part: (\w+) \(exercise ([\d.]+)\) ---$", re.MULTILINE)


@dataclass(frozen=True)
class Part:
    """A part the learner builds: its name, exercise number, the course's own version, and
    the check it must pass.

    Course: chapter 1.
    """

    name: str
    number: str  # "2.3"
    course: Any
    check: Callable[[Any], None]

    @property
    def chapter(self) -> int:
        return int(self.number.split(".")[0])


def _course_modules() -> list[Any]:
    import transformer_course

    names = [
        info.name
        for info in pkgutil.iter_modules(transformer_course.__path__, "transformer_course.")
        if info.name.rsplit(".", 1)[-1] not in ("checks", "parts")
    ]
    return [importlib.import_module(name) for name in sorted(names)]


def parts_of(chapter: int | None = None) -> list[Part]:
    """The parts of one chapter (all chapters with None), in exercise order, read from the
    `Course:` lines of the course's docstrings.

    Course: chapter 1.
    """
    found = {}
    for module in _course_modules():
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            for ch, ex, checks, checker in COURSE_LINE.findall(obj.__doc__ or ""):
                if chapter is None or int(ch) == chapter:
                    check = getattr(
                        importlib.import_module(f"transformer_course.checks.{checks}"), checker
                    )
                    found.setdefault((int(ch), int(ex)), Part(name, f"{ch}.{ex}", obj, check))
    return [found[key] for key in sorted(found)]


def _folder(folder: str | Path | None) -> Path:
    return Path(folder or os.environ.get(FOLDER_ENV) or "my_transformer")


def _cell_of(part: Any) -> str:
    """The source of the notebook cell that defined `part` (a function or a class)."""
    functions = [part] if hasattr(part, "__code__") else list(vars(part).values())
    for function in functions:
        function = getattr(function, "__func__", function)  # a staticmethod's own function
        code = getattr(function, "__code__", None)
        if code is not None and (lines := linecache.getlines(code.co_filename)):
            return "".join(lines).strip("\n") + "\n"
    raise ValueError(f"part: cannot find the cell that defined {part!r}; run its cell again")


def _sections(text: str) -> dict[str, tuple[str, str]]:
    """A saved file's parts: name -> (exercise number, cell source)."""
    found = {}
    marks = list(MARKER_LINE.finditer(text))
    for mark, following in zip(marks, [*marks[1:], None]):
        end = following.start() if following else len(text)
        found[mark[1]] = (mark[2], text[mark.end() + 1 : end].rstrip("\n") + "\n")
    return found


def keep(part: Any, *, folder: str | Path | None = None) -> None:
    """Save the cell that defines `part` (a part whose check just passed) to your file for its
    chapter, replacing an earlier version of it, and say where. Returns nothing, so a check
    cell that ends with it shows only that line.

    Course: chapter 1.
    """
    by_name = {p.name: p for p in parts_of()}
    name = getattr(part, "__name__", None)
    validate.one_of("part", name, by_name)
    known = by_name[name]
    if part is known.course:
        raise ValueError(
            f"part: expected your {name}, got the course's: run the cell where you write it "
            "(without errors) before its check"
        )
    path = _folder(folder) / f"chapter_{known.chapter}.py"
    sections = _sections(path.read_text()) if path.exists() else {}
    sections[name] = (known.number, _cell_of(part))
    ordered = sorted(sections.items(), key=lambda item: tuple(map(int, item[1][0].split("."))))
    header = (
        f'"""Your parts from chapter {known.chapter}, each saved by `keep` when its check passed. '
        '`load_parts` runs them\nin a later workbook; they are cells, not a module to import."""\n'
    )
    body = "".join(
        f"\n\n{MARKER.format(name=n, number=number)}\n{cell}" for n, (number, cell) in ordered
    )
    atomic_write(path, header + body)
    print(f"kept {name} in {path}")


def _passes(part: Part, candidate: Any) -> str | None:
    """None if `candidate` passes the part's check, else the first line of why not."""
    rng = torch.get_rng_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            part.check(candidate)
    except Exception as error:  # a failed check, or a crash inside the candidate
        return str(error).splitlines()[0]
    finally:
        torch.set_rng_state(rng)
    return None


def load_parts(
    namespace: dict[str, Any], chapter: int, *, folder: str | Path | None = None
) -> dict[str, str]:
    """Fill `namespace` (a notebook's `globals()`) with the course's tools and the parts of
    chapters 1 to `chapter - 1`: yours where your file has them and they pass their checks,
    the course's otherwise. Prints and returns, for each part, whose it is and why.

    Course: chapter 1.
    """
    validate.integer("chapter", chapter, low=1)
    homes = {part.course.__module__ for part in parts_of()}  # their helpers come too
    for module in _course_modules():
        home = module.__name__ in homes
        names = [k for k in vars(module) if not k.startswith("__" if home else "_")]
        namespace.update({k: vars(module)[k] for k in names})
    for part in parts_of():  # this chapter's parts and later ones are the learner's to write
        if part.chapter >= chapter:
            namespace.pop(part.name, None)
    earlier = [part for part in parts_of() if part.chapter < chapter]
    problems: dict[str, str] = {}
    for number in sorted({part.chapter for part in earlier}):
        path = _folder(folder) / f"chapter_{number}.py"
        sections = _sections(path.read_text()) if path.exists() else {}
        for name, (_, cell) in sections.items():
            where = f"{path}:{name}"  # tracebacks, and `keep`, read the cell back from linecache
            linecache.cache[where] = (len(cell), None, cell.splitlines(keepends=True), where)
            try:
                exec(compile(cell, where, "exec"), namespace)  # noqa: S102
            except Exception as error:
                problems[name] = f"cannot run: {type(error).__name__}: {error}"
        for part in (p for p in earlier if p.chapter == number and p.name not in sections):
            problems[part.name] = f"not in {path}: run chapter {number}'s workbook"
    whose = {}
    for part in earlier:
        why = problems.get(part.name) or _passes(part, namespace[part.name])
        if why is not None:
            namespace[part.name] = part.course
        whose[part.name] = "yours" if why is None else f"the course's ({why})"
        print(f"{part.number:>5} {part.name:<30} {whose[part.name]}")
    return whose


def whose_parts(namespace: dict[str, Any], chapter: int) -> dict[str, str]:
    """Whose each part of chapters 1 to `chapter` in `namespace` is: yours (written in your
    workbooks) or the course's. Prints the table and a count, and returns it.

    Course: chapter 1.
    """
    validate.integer("chapter", chapter, low=1)
    whose = {}
    for part in (p for p in parts_of() if p.chapter <= chapter):
        mine = part.name in namespace and namespace[part.name] is not part.course
        whose[part.name] = "yours" if mine else "the course's"
        print(f"{part.number:>5} {part.name:<30} {whose[part.name]}")
    yours = sum(w == "yours" for w in whose.values())
    print(f"{yours} of {len(whose)} parts are yours")
    return whose


def _model_path(name: Any, folder: str | Path | None) -> Path:
    if not isinstance(name, str) or not re.fullmatch(r"\w+", name):
        raise ValueError(f"name: expected a name of letters, digits and _, got {name!r}")
    return _folder(folder) / f"{name}.pt"


def keep_model(model: nn.Module, name: str, *, folder: str | Path | None = None) -> None:
    """Save `model` (its `cfg` and its weights as they are now: load the best ones first) as
    `name.pt` beside your parts, atomically, in the training checkpoint format, and say where;
    a later workbook reads it back with `load_model`.

    Course: chapter 6.
    """
    path = _model_path(name, folder)
    if not isinstance(model, nn.Module) or not is_dataclass(getattr(model, "cfg", None)):
        got = type(model).__name__
        raise ValueError(f"model: expected a course model with a dataclass `cfg`, got a {got}")
    save_checkpoint(path, model, None, 0, History())
    print(f"kept your model in {path}")


def load_model(
    name: str,
    model_class: Callable[[Any], nn.Module],
    config_class: Callable[..., Any],
    *,
    folder: str | Path | None = None,
) -> nn.Module | None:
    """The model `keep_model` saved as `name.pt`, built as `model_class(config_class(**cfg))`
    with the saved configuration and weights; None, saying so, when no such file exists. A file
    that cannot be read, or that another kind of model wrote, is a ValueError naming it.

    Course: chapter 6.
    """
    path = _model_path(name, folder)
    if not path.is_file():
        print(f"no model kept in {path}: run the workbook that trains it to the end")
        return None
    architecture = read_checkpoint(path)["architecture"]
    config = architecture.get("config") if isinstance(architecture, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"checkpoint {path}: field 'architecture' holds no model configuration")
    try:
        model = model_class(config_class(**config))
    except (TypeError, ValueError) as error:
        raise ValueError(f"checkpoint {path}: its configuration does not fit: {error}") from None
    load_checkpoint(path, model)
    return model
