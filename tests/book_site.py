"""The pages of the book, as listed in `_toc.yml`."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def toc_pages() -> list[str]:
    """Every page of `_toc.yml` (the root first) as a path without suffix, e.g. `book/index`."""

    def walk(node) -> list[str]:
        if isinstance(node, list):
            return [page for value in node for page in walk(value)]
        if not isinstance(node, dict):
            return []
        found = [node[key] for key in ("root", "file") if key in node]
        return found + [page for value in node.values() for page in walk(value)]

    return walk(yaml.safe_load((ROOT / "_toc.yml").read_text()))
