"""The book builds with warnings as errors, and every page in the table of contents is there."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def toc_files(node) -> list[str]:
    """Every `file:` entry of `_toc.yml`, depth first, the root first."""
    found = []
    if isinstance(node, dict):
        for key in ("root", "file"):
            if key in node:
                found.append(node[key])
        for value in node.values():
            if isinstance(value, (list, dict)):
                found += toc_files(value)
    elif isinstance(node, list):
        for value in node:
            found += toc_files(value)
    return found


def test_every_toc_page_is_built(book_html):
    pages = toc_files(yaml.safe_load((ROOT / "_toc.yml").read_text()))
    assert len(pages) >= 7
    missing = [page for page in pages if not (book_html / f"{page}.html").is_file()]
    assert not missing, f"pages in _toc.yml with no HTML: {missing}"
