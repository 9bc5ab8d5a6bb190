"""figures.figure_png and show: the smallest drawn text, measured while the figure is drawn,
against the ink of the rendered PNG itself; the metadata round trip; clear errors."""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from transformer_course.figures import (  # noqa: E402
    SMALLEST_TEXT_KEY,
    figure_png,
    png_text,
    show,
    smallest_text_px,
)


def ink_height(png: bytes) -> int:
    """Rows of the PNG holding any dark pixel: the height of what is drawn in black on white."""
    pixels = plt.imread(io.BytesIO(png))[..., :3].mean(axis=-1)
    rows = np.flatnonzero((pixels < 0.5).any(axis=1))
    return int(rows[-1] - rows[0] + 1)


@pytest.mark.parametrize("dpi", [100, 300])
def test_a_6pt_tick_label_reports_its_digit_height(dpi):
    """One tick label "0" at 6 pt, the only text: the reported height is the ink height of the
    digit in the PNG (to a pixel of anti-aliasing), about 0.76 of 6 pt in pixels."""

    def figure():
        fig = plt.figure(figsize=(1, 1))
        ax = fig.add_axes((0.3, 0.3, 0.6, 0.6))
        ax.set(xticks=[0], yticks=[], xlim=(-1, 1))
        ax.tick_params(labelsize=6, length=0)
        ax.spines[:].set_visible(False)  # the digit is the only dark thing
        return fig

    png = figure_png(figure(), dpi=dpi)
    reported = smallest_text_px(png)
    assert abs(reported - ink_height(png)) <= 1.0
    assert 0.7 * 6 * dpi / 72 < reported < 0.8 * 6 * dpi / 72


def test_the_smallest_text_wins_wherever_it_is():
    """Tick labels, a title, a legend, an annotation and a colour bar's label at 10 pt, and one
    of them at 5 pt: the 5 pt one decides, whichever it is."""
    placements = ["title", "legend", "annotation", "colorbar"]
    for small in placements:
        fig, ax = plt.subplots(figsize=(4, 3))
        size = {place: 5 if place == small else 10 for place in placements}
        image = ax.imshow(np.eye(3), label="image")
        ax.plot([0, 2], [0, 2], label="line")
        ax.set_title("title", fontsize=size["title"])
        ax.legend(fontsize=size["legend"])
        ax.annotate("note", (1, 1), fontsize=size["annotation"])
        fig.colorbar(image, ax=ax).set_label("weight", fontsize=size["colorbar"])
        reference = plt.figure(figsize=(1, 1))
        reference.text(0.5, 0.5, "0", fontsize=5)
        assert smallest_text_px(figure_png(fig)) == smallest_text_px(figure_png(reference)), small


def test_a_log_axis_superscript_counts_at_its_own_size():
    """A log axis labels 10^k with the exponent at mathtext's 0.7 of the size: a 10 pt axis's
    smallest text is a 7 pt digit's."""
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.loglog([1, 100], [1, 100])
    reference = plt.figure(figsize=(1, 1))
    reference.text(0.5, 0.5, "0", fontsize=7)
    expected = smallest_text_px(figure_png(reference))
    assert smallest_text_px(figure_png(fig)) == pytest.approx(expected, abs=0.02)


def test_hidden_text_does_not_count():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_title("title")
    ax.text(0.5, 0.5, "tiny", fontsize=3, visible=False)
    ax.tick_params(labelsize=3)
    ax.axis("off")  # the 3 pt tick labels are not drawn
    assert smallest_text_px(figure_png(fig)) > 9


def test_the_png_carries_its_metadata_and_still_reads():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, 1])
    png = figure_png(fig, dpi=100)
    assert set(png_text(png)) == {SMALLEST_TEXT_KEY, "Software"}
    assert plt.imread(io.BytesIO(png)).shape[1] > 250  # a valid PNG, about 3 in at 100 dpi


def test_show_closes_the_figure_and_returns_nothing(tmp_path):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_title("title")
    number = fig.number
    assert show() is None  # a cell ending with show() shows only the figure
    assert not plt.fignum_exists(number)
    path = tmp_path / "plot.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert smallest_text_px(path) is None  # a PNG not made by figure_png


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(TypeError, match="fig: expected a matplotlib Figure, got str"):
        figure_png("figure")
    fig = plt.figure()
    with pytest.raises(ValueError, match="dpi: expected a positive number, got 0"):
        figure_png(fig, dpi=0)
    with pytest.raises(ValueError, match="fig: expected a figure that draws some text"):
        figure_png(fig)
    with pytest.raises(ValueError, match="png: expected PNG data"):
        png_text(b"GIF89a")
