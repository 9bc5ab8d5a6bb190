"""The built book, read the way a learner reads it: every page opened in headless Chromium.

The `book_html` fixture (conftest.py) builds the book with warnings as errors; `pytest
tests/test_book_html.py` runs these checks alone. The HTML is served from `_build/html` on
127.0.0.1; every request to any other host is blocked and reported, so a page that only works
online fails here.

For every page:
  * it has a title and exactly one non-empty H1, and heading levels never skip;
  * MathJax (the book's own copy) has typeset every formula: no TeX error, no raw `\\(`, `\\[`
    or `$$` left in the visible text;
  * every image has loaded (naturalWidth > 0) and has an alt text that describes it, not a path;
  * no console error, no uncaught exception, no failed or 4xx/5xx request;
  * no request to a host other than 127.0.0.1;
  * every internal link points to a file that exists, and its #anchor to an id on that page;
  * at 1440 px and at 390 px (a phone), with collapsed blocks opened, no block (code, output,
    table, figure, box, displayed formula) is wider than the column; at 1440 px nothing scrolls
    sideways (every code and output line fits: at most 100 characters), on the phone a code
    block or a table may scroll inside its own box, never wrap a line back to column 0;
  * inline code keeps its spaces (` Hello`, a token with its leading space, is not `Hello`);
  * one printout is one box: no cell shows its printed output split over several boxes;
  * every image is a numbered figure with a caption, and its text reads on the phone: as shown
    at 390 px, a plot's smallest text (the height of a digit, tick labels, legends, colour bars
    and a log axis's superscripts included, stored in the PNG by `figures.show`, which measured
    it while drawing) and a drawing's (the height of a digit at its smallest font size, in the
    font the browser draws it with) are 8 px or more; a PNG not made by `figures.show` is
    refused;
  * every part a chapter's exercise box lists is named in the chapter's text (not only in code
    or in the box), where its idea is taught.
Every chapter has learning objectives and a summary.
Without a browser, the HTML is still checked for notebook outputs a reader should never see
(warnings, stderr, tracebacks, object reprs), for scripts or styles from other hosts, for alt
texts, and for the course's drawn figures: each on its page, with a caption.

A full-page screenshot of a page that fails is saved under `_build/screenshots/`; of every page
with `BOOK_SCREENSHOTS=1`.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from book_site import toc_pages

from transformer_course.figures import SMALLEST_TEXT_KEY, smallest_text_px

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Folders of the built site that hold assets, not pages.
ASSET_DIRS = {"_static", "_sources", "_downloads", "_images"}

# What must never appear in a notebook output shown in the book.
BAD_OUTPUT = {
    "a Python warning": re.compile(r"\w*Warning:"),
    "a traceback": re.compile(r"Traceback \(most recent call last\)"),
    "an object repr": re.compile(r"<torch\._C\.Generator|<matplotlib\.| object at 0x[0-9a-fA-F]+"),
}
BAD_OUTPUT_CLASSES = {"stderr", "traceback", "error"}
# The course's drawn figures (book/images/*.svg) and the page each must appear on.
DRAWN_FIGURES = {
    "book/index.html": ("chapter_map.svg",),
    "book/02_attention.html": ("attention_data_flow.svg",),
    "book/05_translation.html": ("encoder_decoder.svg",),
    "book/06_gpt2.html": ("gpt2_residual_stream.svg",),
    "book/07_llama.html": (
        "llama_vs_gpt2_block.svg",
        "rope_rotation.svg",
        "grouped_query_heads.svg",
        "kv_cache.svg",
    ),
    "book/08_scaling.html": (
        "flash_tiles.svg",
        "online_softmax.svg",
        "overlap_timeline.svg",
        "ring_allreduce.svg",
        "rank_memory.svg",
    ),
}
IMAGE_FILE = re.compile(r"\S*\.(png|svg|jpe?g|gif|webp)", re.IGNORECASE)


def alt_problem(src: str, alt: str | None) -> str | None:
    """Why an image's alt text does not describe it (missing, a file name or path), else None."""
    alt = (alt or "").strip()
    if not alt:
        return f"image without alt text: {src}"
    if IMAGE_FILE.fullmatch(alt) or alt in src or len(alt.split()) < 3:
        return f"image whose alt text is not a description: {src} (alt {alt!r})"
    return None


PAGES = [f"{page}.html" for page in toc_pages()]


class _Scan(HTMLParser):
    """Collects ids, resource URLs and the text of notebook outputs of one HTML file."""

    VOID = {
        "area",
        "base",
        "br",
        "col",
        "embed",
        "hr",
        "img",
        "input",
        "link",
        "meta",
        "source",
        "track",
        "wbr",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.resources: list[str] = []
        self.outputs: list[str] = []
        self.bad_blocks: list[str] = []
        self.images: list[tuple[str, str | None]] = []  # (src, alt)
        self.figures: list[dict] = []  # {"images": [src, ...], "caption": text}
        self._stack: list[tuple[str, bool]] = []  # open elements: (tag, inside a cell output?)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attributes.get(key):
                self.ids.add(attributes[key])
        if tag in ("script", "img", "iframe", "source", "audio", "video") and attributes.get("src"):
            self.resources.append(attributes["src"])
        if tag == "img":
            self.images.append((attributes.get("src") or "", attributes.get("alt")))
            if self._open("figure"):
                self.figures[-1]["images"].append(attributes.get("src") or "")
        if tag == "figure":
            self.figures.append({"images": [], "caption": ""})
        if (
            tag == "link"
            and attributes.get("href")
            and attributes.get("rel") not in ("canonical", "alternate")
        ):
            self.resources.append(attributes["href"])
        classes = set((attributes.get("class") or "").split())
        inside = bool(self._stack and self._stack[-1][1]) or "cell_output" in classes
        if inside and classes & BAD_OUTPUT_CLASSES:
            self.bad_blocks.append(f"<{tag} class={attributes.get('class')!r}>")
        if tag not in self.VOID:
            self._stack.append((tag, inside))

    def handle_endtag(self, tag: str) -> None:
        # Close the innermost open element of this name, and any left unclosed inside it.
        for index in range(len(self._stack) - 1, -1, -1):
            if self._stack[index][0] == tag:
                del self._stack[index:]
                return

    def handle_data(self, data: str) -> None:
        if self._stack and self._stack[-1][1]:
            self.outputs.append(data)
        if self._open("figcaption") and self.figures:
            self.figures[-1]["caption"] += data

    def _open(self, tag: str) -> bool:
        return any(open_tag == tag for open_tag, _ in self._stack)


@functools.cache
def scan(path: Path) -> _Scan:
    parser = _Scan()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


# ---------------------------------------------------------------- checks without a browser


@pytest.mark.parametrize("page", PAGES)
def test_outputs_are_clean(page, book_html):
    """No warning, stderr block, traceback or object repr in any notebook output."""
    parsed = scan(book_html / page)
    problems = [f"a {block} block" for block in parsed.bad_blocks]
    text = "".join(parsed.outputs)
    for what, pattern in BAD_OUTPUT.items():
        problems += [f"{what}: {match[0]!r}" for match in pattern.finditer(text)]
    assert not problems, f"{page}: outputs a reader should not see: {problems}"


@pytest.mark.parametrize("page", PAGES)
def test_no_resource_from_another_host(page, book_html):
    """Scripts, styles, images and fonts all come from the book itself."""
    external = [
        url
        for url in scan(book_html / page).resources
        if urlsplit(url).netloc or url.startswith("//")
    ]
    assert not external, f"{page} loads from other hosts: {external}"


@pytest.mark.parametrize("page", PAGES)
def test_every_image_has_a_real_alt_text(page, book_html):
    """Notebook plots and drawn figures alike: alt text a screen reader can read out, not a path."""
    problems = [why for src, alt in scan(book_html / page).images if (why := alt_problem(src, alt))]
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize(
    "page, drawing",
    [(page, drawing) for page, drawings in DRAWN_FIGURES.items() for drawing in drawings],
)
def test_drawn_figure_is_on_its_page_with_a_caption(page, drawing, book_html):
    parsed = scan(book_html / page)
    figures = [f for f in parsed.figures if any(src.endswith("/" + drawing) for src in f["images"])]
    assert len(figures) == 1, f"{page}: expected one <figure> showing {drawing}, got {len(figures)}"
    assert len(figures[0]["caption"].split()) >= 5, f"{page}: {drawing} has no caption"
    (src,) = [src for src in figures[0]["images"] if src.endswith("/" + drawing)]
    assert (book_html / page).parent.joinpath(src).resolve().is_file(), f"{page}: no file {src}"


CHAPTERS = [page for page in PAGES if re.fullmatch(r"book/\d\d_\w+\.html", page)]


@pytest.mark.parametrize("page", CHAPTERS)
def test_every_chapter_has_objectives_and_a_summary(page, book_html):
    html = (book_html / page).read_text(encoding="utf-8")
    assert "Learning objectives" in html, f"{page}: no learning objectives"
    assert re.search(r"<h2>Summary<a", html), f"{page}: no Summary section"


def test_root_redirects_to_the_landing_page(book_html):
    root = (book_html / "index.html").read_text(encoding="utf-8")
    assert 'url=book/index.html"' in root, (
        f"_build/html/index.html does not redirect to book/index.html: {root!r}"
    )


def test_mathjax_is_served_by_the_book(book_html):
    mathjax = book_html / "_static" / "mathjax"
    assert (mathjax / "tex-chtml-full.js").is_file(), "MathJax is missing from _static/mathjax"
    assert sorted((mathjax / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff")), (
        "MathJax fonts are missing"
    )


# ---------------------------------------------------------------- checks in a browser


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the signature of the base class
        pass


@pytest.fixture(scope="module")
def server(book_html):
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so the browser test may not be skipped)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A persistent Chromium context with a fresh profile directory."""
    if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
        _unavailable(
            f"no Chromium at {CHROMIUM}: install it (`apt-get install chromium`) or set $CHROMIUM"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed: `pip install -r requirements.txt`")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            headless=True,
            # At 1440 px (a common laptop width) and wider, the code column shows 100
            # characters: the line length of src (ruff's line-length in pyproject.toml).
            viewport={"width": 1440, "height": 900},
            service_workers="block",
        )
        yield context
        context.close()


# Runs in the page: wait for MathJax, then report what the checks need.
INSPECT_PAGE = """
async () => {
  const mathjax = Boolean(window.MathJax && MathJax.startup && MathJax.startup.promise);
  if (mathjax) { await MathJax.startup.promise; }
  const images = Array.from(document.images);
  for (const img of images) { img.loading = "eager"; }
  await Promise.all(images.map(img => img.decode().catch(() => null)));
  const article = document.querySelector("article.bd-article") || document.body;
  // Blocks wider than the column, or scrolling sideways, collapsed blocks opened first.
  article.querySelectorAll("details").forEach(d => { d.open = true; });
  article.querySelectorAll(".toggle-hidden").forEach(e => e.classList.remove("toggle-hidden"));
  const column = article.getBoundingClientRect();
  const blocks = "pre, table, div.cell_output, div.admonition, figure, img, mjx-container";
  const phone = innerWidth < 960;
  const wide = Array.from(article.querySelectorAll(blocks)).filter(el => {
    const box = el.getBoundingClientRect();
    if (box.width === 0) { return false; }
    if (phone && el.parentElement.closest("table, pre")) { return false; }  // scrolls with it
    const scrolls = el.scrollWidth > el.clientWidth + 1;
    const outside = box.left < column.left - 1 || box.right > column.right + 1;
    if (el.matches("mjx-container")) {  // a formula breaks over lines to fit, at any width
      return outside || (scrolls && el.matches("[display='true']"));
    }
    if (el.matches("pre, table") && phone) {  // on a phone: scrolls inside its own box
      return outside || (scrolls && getComputedStyle(el).overflowX === "visible");
    }
    return outside || scrolls;
  }).map(el => {
    const what = (el.textContent || el.getAttribute("src") || "").trim().slice(0, 80);
    return `${el.tagName.toLowerCase()}: ${what}`;
  });
  const keepsSpaces = ["pre", "pre-wrap", "break-spaces"];
  const collapsedSpaces = Array.from(article.querySelectorAll("code.literal"))
    .filter(code => !keepsSpaces.includes(getComputedStyle(code).whiteSpace))
    .map(code => code.textContent);
  // Printed output split over several boxes: two stdout boxes in a row in one cell.
  const splitPrintouts = Array.from(article.querySelectorAll("div.cell_output"))
    .filter(out => Array.from(out.children).some((box, i, boxes) => i > 0
      && box.matches(".output.stream") && boxes[i - 1].matches(".output.stream")))
    .map(out => out.textContent.trim().slice(0, 80));
  // A drawing's smallest text, in its own units (its viewBox): the height of a digit at each
  // text's font size, in the font Chromium draws it with (about 0.71 of the size in Liberation
  // Sans, which stands in for Helvetica and Arial here), measured at 100 px where the
  // whole-pixel ink box is precise. The drawing sits in a shadow root, out of sight, so the
  // page's styles do not reach it, as they do not reach it in its <img>.
  const drawingText = async src => {
    const source = await (await fetch(src)).text();
    const drawing = new DOMParser().parseFromString(source, "image/svg+xml").documentElement;
    const host = document.body.appendChild(document.createElement("div"));
    host.style.cssText = "position: absolute; left: -10000px; top: 0";
    host.attachShadow({mode: "open"}).appendChild(drawing);
    const context = new OffscreenCanvas(1, 1).getContext("2d");
    const digitHeights = Array.from(drawing.querySelectorAll("text, tspan"))
      .filter(text => text.textContent.trim())
      .map(text => {
        const style = getComputedStyle(text);
        context.font = `100px ${style.fontFamily}`;
        const digits = context.measureText("0123456789");
        const height = digits.actualBoundingBoxAscent + digits.actualBoundingBoxDescent;
        return height / 100 * parseFloat(style.fontSize);
      });
    host.remove();
    return {digit: Math.min(...digitHeights), viewBox: drawing.viewBox.baseVal.width};
  };
  // Figures: caption, and how wide each image is shown against its own width.
  const figures = await Promise.all(images.filter(img => article.contains(img)).map(async img => {
    const figure = img.closest("figure");
    const caption = figure && figure.querySelector("figcaption");
    const src = img.currentSrc || img.src;
    const drawn = img.complete && img.naturalWidth > 0;
    return {
      src: src,
      shown: img.getBoundingClientRect().width,
      natural: img.naturalWidth,
      number: caption ? (caption.querySelector(".caption-number") || {}).textContent || "" : "",
      caption: caption ? caption.textContent.trim() : "",
      ...(phone && drawn && new URL(src).pathname.endsWith(".svg") ? await drawingText(src) : {}),
    };
  }));
  // The parts the exercise box lists, and the page's prose (no code cells, no box).
  const box = Array.from(article.querySelectorAll("div.admonition"))
    .find(a => /Exercises: the chapter/.test(a.textContent));
  const parts = box ? Array.from(box.querySelectorAll("td:nth-child(2) code"))
    .map(code => code.textContent.trim().split(".")[0]) : [];
  const prose = article.cloneNode(true);
  prose.querySelectorAll("div.cell, pre, div.admonition.dropdown, script, style")
    .forEach(e => e.remove());
  Array.from(prose.querySelectorAll("div.admonition"))
    .filter(a => /Exercises: the chapter/.test(a.textContent)).forEach(a => a.remove());
  const proseText = prose.textContent;
  const untaught = [...new Set(parts)].filter(part => !proseText.includes(part));
  const visible = article.cloneNode(true);
  visible.querySelectorAll("pre, code, script, style, textarea, mjx-assistive-mml")
    .forEach(e => e.remove());
  return {
    title: document.title,
    headings: Array.from(article.querySelectorAll("h1, h2, h3, h4, h5, h6"))
      .map(h => [Number(h.tagName[1]), h.textContent.replace(/[#¶]/g, "").trim()]),
    mathjax: mathjax,
    mathSource: article.querySelectorAll(".math").length,
    mathTypeset: article.querySelectorAll("mjx-container").length,
    mathErrors: Array.from(article.querySelectorAll("mjx-merror")).map(e => e.textContent),
    text: visible.innerText,
    images: images.map(img => ({
      src: img.currentSrc || img.src,
      alt: img.getAttribute("alt"),
      ok: img.complete && img.naturalWidth > 0,
    })),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
    wide: wide,
    collapsedSpaces: collapsedSpaces,
    splitPrintouts: splitPrintouts,
    figures: figures,
    untaught: untaught,
  };
}
"""
PHONE_TEXT_PX = 8  # the smallest text a figure may show on a 390 px phone


def figure_problem(figure: dict, width: int) -> str | None:
    """Why an image shown on a page is not a readable, numbered, captioned figure, else None."""
    src = urlsplit(figure["src"]).path
    if not figure["number"].strip().startswith("Fig.") or len(figure["caption"].split()) < 5:
        return f"an image that is not a numbered figure with a caption: {src}"
    if width >= 960:
        return None
    if src.endswith(".png"):
        smallest = smallest_text_px(SITE / unquote(src).lstrip("/"))
        if smallest is None:
            return f"a plot not shown through figures.show (no {SMALLEST_TEXT_KEY}): {src}"
        shown = smallest * figure["shown"] / figure["natural"]
        if shown < PHONE_TEXT_PX:
            return f"a plot whose smallest text shows {shown:.1f} px tall at {width} px: {src}"
    if src.endswith(".svg"):
        shown = figure["digit"] * figure["shown"] / figure["viewBox"]
        if shown < PHONE_TEXT_PX:
            return f"a drawing whose smallest digit shows {shown:.1f} px tall at {width} px: {src}"
    return None


RAW_MATH = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$")


def _check_link(url: str) -> str | None:
    """Why an internal link is broken, or None if it resolves."""
    parts = urlsplit(url)
    path = SITE / unquote(parts.path).lstrip("/")
    if path.is_dir():
        path = path / "index.html"
    if not path.is_file():
        return f"{url}: no such file"
    fragment = unquote(parts.fragment)
    if fragment and path.suffix == ".html" and fragment not in scan(path).ids:
        return f"{url}: no id {fragment!r} on that page"
    return None


@pytest.mark.slow
@pytest.mark.parametrize("width", [1440, 390])
@pytest.mark.parametrize("page", PAGES)
def test_page_in_browser(page, width, server, browser):
    problems: list[str] = []
    external: list[str] = []
    tab = browser.new_page()
    tab.set_viewport_size({"width": width, "height": 900})

    def route(route):
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            external.append(route.request.url)
            route.abort()

    tab.route("**/*", route)
    tab.on(
        "console",
        lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
    )
    tab.on("pageerror", lambda e: problems.append(f"uncaught exception: {e}"))
    tab.on(
        "requestfailed",
        lambda r: (
            problems.append(f"request failed: {r.url} ({r.failure})")
            if urlsplit(r.url).hostname == "127.0.0.1"
            else None
        ),
    )
    tab.on(
        "response",
        lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None,
    )
    try:
        tab.goto(f"{server}/{page}", wait_until="load")
        info = tab.evaluate(INSPECT_PAGE)
        tab.wait_for_load_state("networkidle")
        problems += page_problems(page, width, info, server)
        problems += [f"request to another host: {url}" for url in external]
        if problems or os.environ.get("BOOK_SCREENSHOTS"):  # half a page's time: only if asked
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shot = SCREENSHOTS / f"{page.replace('/', '__').removesuffix('.html')}_{width}.png"
            tab.screenshot(path=str(shot), full_page=True, animations="disabled")
    finally:
        tab.close()
    assert not problems, f"{page}:\n  " + "\n  ".join(problems)


def page_problems(page: str, width: int, info: dict, server: str) -> list[str]:
    """What the measurements `info` of `page` (INSPECT_PAGE's) show is wrong with it."""
    problems = [f"wider than the column at {width} px: {block}" for block in info["wide"]]
    problems += [f"a printout split over boxes: {text!r}" for text in info["splitPrintouts"]]
    problems += [why for figure in info["figures"] if (why := figure_problem(figure, width))]
    if width == 1440:
        problems += [f"exercise part not named in the text: {part}" for part in info["untaught"]]
    problems += [f"inline code that loses its spaces: {text!r}" for text in info["collapsedSpaces"]]
    title = info["title"].strip()
    if not title or "<no title>" in title:
        problems.append(f"no page title ({info['title']!r})")
    h1 = [text for level, text in info["headings"] if level == 1]
    if len(h1) != 1 or not h1[0]:
        problems.append(f"expected exactly one non-empty H1, found {h1}")
    levels = [level for level, _ in info["headings"]]
    for (before, after), (_, text) in zip(zip(levels, levels[1:]), info["headings"][1:]):
        if after > before + 1:
            problems.append(f"heading level skips from H{before} to H{after} at {text!r}")
    if info["mathSource"] and not info["mathjax"]:
        problems.append("the page has math but MathJax did not load")
    if info["mathTypeset"] < info["mathSource"]:
        problems.append(f"MathJax typeset {info['mathTypeset']} of {info['mathSource']} formulas")
    if info["mathErrors"]:
        problems.append(f"TeX errors: {info['mathErrors']}")
    raw = sorted({match[0] for match in RAW_MATH.finditer(info["text"])})
    if raw:
        problems.append(f"untypeset TeX delimiters in the visible text: {raw}")
    problems += [f"image did not load: {img['src']}" for img in info["images"] if not img["ok"]]
    problems += [why for img in info["images"] if (why := alt_problem(img["src"], img["alt"]))]
    for drawing in DRAWN_FIGURES.get(page, ()):
        if not any(img["ok"] and img["src"].endswith("/" + drawing) for img in info["images"]):
            problems.append(f"the drawn figure {drawing} is not shown")
    internal = {url for url in info["links"] if url.startswith(server + "/")}
    problems += [why for url in sorted(internal) if (why := _check_link(url[len(server) :]))]
    return problems
