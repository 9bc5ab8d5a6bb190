"""The book builds with warnings as errors, and every page in the table of contents is there."""

from book_site import toc_pages


def test_every_toc_page_is_built(book_html):
    pages = toc_pages()
    assert "book/index" in pages and len(pages) >= 7, pages
    missing = [page for page in pages if not (book_html / f"{page}.html").is_file()]
    assert not missing, f"pages in _toc.yml with no HTML: {missing}"
