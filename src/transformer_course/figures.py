"""Show a matplotlib figure in a notebook as a PNG that says how small its text is drawn.

A plot on a book page is shown at the page's width: on a 390 px phone a 5.8 inch plot made at
100 dpi is scaled to about 58%, and a 10 pt tick label shrinks to digits 6 px tall, too small to
read. `show` saves the figure as a PNG, records while it draws the smallest text it draws (tick
labels, labels, titles, legends, annotations, colour bars, a log axis's superscripts), and stores
that height in the PNG's text metadata under `SMALLEST_TEXT_KEY`. The book's browser test reads
it back and scales it by the width the page shows the PNG at.

The height is a digit's: the ink height of "0" at the smallest font size drawn, in the PNG's
pixels (about 0.76 of the font size in pixels for DejaVu Sans). A lowercase letter is shorter,
a capital about as tall.

    from transformer_course.figures import show
    fig, ax = plt.subplots(figsize=(4.2, 3), layout="constrained")
    ...
    show(fig)  # instead of plt.show()
"""

from __future__ import annotations

import io
import struct
import zlib
from contextlib import contextmanager
from pathlib import Path

try:
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.figure import Figure
    from matplotlib.mathtext import MathTextParser
    from matplotlib.textpath import TextPath
except ImportError:  # the package imports without the `learn` extra; `show` says what is missing
    plt = None

__all__ = ["SMALLEST_TEXT_KEY", "figure_png", "png_text", "show", "smallest_text_px"]

SMALLEST_TEXT_KEY = "SmallestTextPx"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def show(fig: Figure | None = None, dpi: float = 100) -> None:
    """Show `fig` (default: the current figure) in the notebook as `figure_png(fig, dpi)`, and
    close it, so the inline backend does not show it a second time. Returns nothing, so a cell
    that ends with it shows only the figure. Outside a notebook the figure is measured and
    closed, not shown.
    """
    if plt is None:
        raise ImportError("figures.show needs matplotlib: pip install -e '.[learn]'")
    png = figure_png(plt.gcf() if fig is None else fig, dpi)
    try:
        from IPython import get_ipython
        from IPython.display import Image, display
    except ImportError:  # plain Python: no notebook to show it in
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Image(data=png, format="png"))


def figure_png(fig: Figure, dpi: float = 100) -> bytes:
    """`fig` saved as a PNG at `dpi` (cropped to what it draws, as the inline backend does), with
    the height in pixels of its smallest drawn text stored under `SMALLEST_TEXT_KEY`; the figure
    is closed.
    """
    if plt is None:
        raise ImportError("figures.figure_png needs matplotlib: pip install -e '.[learn]'")
    if not isinstance(fig, Figure):
        raise TypeError(f"fig: expected a matplotlib Figure, got {type(fig).__name__}")
    if not dpi > 0:
        raise ValueError(f"dpi: expected a positive number, got {dpi}")
    buffer = io.BytesIO()
    with _recording_text() as heights:
        fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    if not heights:
        raise ValueError("fig: expected a figure that draws some text (axis labels, a title)")
    return _with_png_text(buffer.getvalue(), SMALLEST_TEXT_KEY, f"{min(heights):.2f}")


@contextmanager
def _recording_text():
    """While active, every text the Agg renderer draws appends its digit height in pixels."""
    heights: list[float] = []
    draw_text = RendererAgg.draw_text

    def recording(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if s.strip():
            points = _smallest_size(s, prop) if ismath else prop.get_size_in_points()
            digit = TextPath((0, 0), "0", size=points, prop=prop).get_extents().height
            heights.append(digit * self.dpi / 72)
        return draw_text(self, gc, x, y, s, prop, angle, ismath=ismath, mtext=mtext)

    RendererAgg.draw_text = recording
    try:
        yield heights
    finally:
        RendererAgg.draw_text = draw_text


def _smallest_size(s: str, prop) -> float:
    """The smallest font size in points of any glyph of mathtext `s` (superscripts shrink)."""
    glyphs = MathTextParser("path").parse(s, dpi=72, prop=prop).glyphs
    return min((size for _, size, *_ in glyphs), default=prop.get_size_in_points())


def _with_png_text(png: bytes, key: str, value: str) -> bytes:
    """`png` with a tEXt chunk `key`=`value` inserted after its header chunk."""
    body = b"tEXt" + key.encode("latin-1") + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    header_end = len(PNG_SIGNATURE) + 8 + 13 + 4  # signature, IHDR's length and type, data, CRC
    return png[:header_end] + chunk + png[header_end:]


def png_text(png: bytes | str | Path) -> dict[str, str]:
    """The tEXt metadata of a PNG (its bytes or a path): keyword -> text."""
    data = png if isinstance(png, bytes) else Path(png).read_bytes()
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError(f"png: expected PNG data, got bytes starting {data[:8]!r}")
    text, position = {}, len(PNG_SIGNATURE)
    while position + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[position : position + 8])
        if kind == b"tEXt":
            key, _, value = data[position + 8 : position + 8 + length].partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
        position += 12 + length
    return text


def smallest_text_px(png: bytes | str | Path) -> float | None:
    """The smallest text height `show` stored in a PNG, in its pixels; None if it has none."""
    value = png_text(png).get(SMALLEST_TEXT_KEY)
    return None if value is None else float(value)
