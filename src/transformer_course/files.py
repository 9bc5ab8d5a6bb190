"""Writing files so that nothing a user saved is ever left half-written (tokenizers,
checkpoints and results all go through `atomic_write`), and reading text and JSON files with
errors that name the file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_write", "read_json", "read_text"]


def atomic_write(path: str | Path, write: Callable[[Any], None] | bytes | str) -> None:
    """Write a file atomically: to a temporary file in the same folder, then rename it over `path`,
    so a crash leaves the old file intact. `write` is the content, or a function given the open
    binary file (`lambda f: torch.save(obj, f)`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(write):
                write(f)
            else:
                f.write(write.encode() if isinstance(write, str) else write)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_text(path: Path, name: str) -> str:
    """The text of `path`; a file that is not UTF-8 is a ValueError naming it and `name`."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: {str(path)!r} is not UTF-8 text: {exc}") from None


def read_json(path: Path, name: str) -> Any:
    """Parse the JSON file `path`; an unreadable one is a ValueError naming the file and `name`."""
    text = read_text(path, name)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: {str(path)!r} is not valid JSON: {exc}") from None
