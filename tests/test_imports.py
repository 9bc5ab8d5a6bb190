"""The package's imports run one way: a module imports only modules of its own chapter or an
earlier one, the shared utilities sit below every chapter, and nothing imports in a circle.

The map below is the README's "Where code goes" table; a new module must be placed in it.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from forkserver import PYTHON

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "transformer_course"
SHARED = 0
CHECKS = 99  # the exercise checkers grade every chapter's parts, so they sit above them all
CHAPTER = {
    "validate": SHARED,
    "runtime": SHARED,
    "figures": SHARED,
    "files": SHARED,
    "data": SHARED,
    "tokenizer_files": 1,
    "tokenization": 1,
    "attention": 2,
    "masking": 3,
    "layernorm": 4,
    "blocks": 5,
    "decoding": 5,
    "encoder_decoder": 5,
    "training": 5,
    "translation": 5,
    "gpt2_weights": 6,
    "gpt2": 6,
    "rope": 7,
    "llama_weights": 7,
    "llama": 7,
    "optim": 7,
    "step_cost": 8,
    "flash_attention": 8,
    "flash_attention_triton": 8,
    "data_parallel": 8,
    "sharded": 8,
    "ranks": 8,
    "chat": 9,
    "logprobs": 9,
    "lora": 9,
    "dpo": 9,
    "policy_gradient": 9,
    "assistant_task": 9,
    "fine_tuning": 9,
    "grpo": 9,
    "hooks": 10,
    "head_detectors": 10,
    "attribution": 10,
    "ablation": 10,
    "patching": 10,
    "circuits": 10,
    "attention_only": 10,
    "induction": 10,
    "checks": CHECKS,
    "parts": CHECKS,  # runs the checks on the learner's saved parts
}


def module_names() -> list[str]:
    """Every module of the package, as `tokenization` or `checks.gpt2`."""
    return sorted(
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent != PACKAGE
    )


def imports_of(name: str) -> set[str]:
    """The package modules that module `name` imports, at the top or inside a function."""
    path = PACKAGE / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE / name.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "transformer_course":  # from transformer_course import validate
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("transformer_course."):
                found.add(node.module.removeprefix("transformer_course."))
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.removeprefix("transformer_course.")
                for alias in node.names
                if alias.name.startswith("transformer_course.")
            }
    return found - {name}


def chapter_of(name: str) -> int:
    top = name.split(".")[0]
    assert top in CHAPTER, f"{name}: place the new module in CHAPTER (and the README's map)"
    return CHAPTER[top]


def test_every_module_imports_only_its_own_chapter_or_earlier():
    back = [
        f"{name} (chapter {chapter_of(name)}) imports {other} (chapter {chapter_of(other)})"
        for name in module_names()
        for other in imports_of(name)
        if chapter_of(other) > chapter_of(name)
    ]
    assert back == []


def test_no_module_imports_in_a_circle():
    graph = {name: imports_of(name) for name in module_names()}

    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for other in sorted(graph.get(path[-1], ())):
            if other == start:
                return [*path, start]
            if other not in path:
                found = cycle_from(start, [*path, other])
                if found:
                    return found
        return None

    circles = [" -> ".join(c) for name in graph if (c := cycle_from(name, [name]))]
    assert circles == []


# Loads the third-party libraries once, then forks a child per module that imports it before
# any other module of the package: each child is a fresh interpreter as far as the package goes.
FORK_EACH = """
import os, sys
import einops, jaxtyping, regex, torch, transformer_lens, transformers  # noqa: F401
failed = []
for name in sys.argv[1:]:
    child = os.fork()
    if child == 0:
        try:
            __import__("transformer_course." + name)
        except BaseException as error:
            print(name, type(error).__name__, error, file=sys.stderr)
            os._exit(1)
        os._exit(0)
    if os.waitpid(child, 0)[1] != 0:
        failed.append(name)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Imported on its own, before any other module of the package, each module loads: a circle
    would leave one of them half-initialised."""
    command = [*PYTHON, "-c", FORK_EACH, *module_names()]  # PYTHON: no import of torch again
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
