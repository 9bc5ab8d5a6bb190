"""Claims, not digits: the rule that keeps CI's green independent of the CPU (book/maintainers.md,
"Claims, not digits").

A book page or workbook cell whose output holds a measured number is tagged `nbval-ignore-output`,
so its digits are never compared, and states its result as an `assert` with a tolerance (or runs a
course checker, which raises). nbval compares exactly only what is exact: ids, shapes, counts,
dtypes. Two failures, each with the cell named:

- a compared cell that prints a float (a decimal point, an exponent, a percentage, nan or inf);
- an ignored cell that prints something and asserts nothing.

And the prose holds to it: where a page's text says a cell asserts what it claims ("the cell
asserts it", "(asserted)"), the code cell just above or just below that text asserts something,
so deleting the assert from the cell fails here, not silently.

The exceptions are named below with the reason each is exact, or not a claim.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
IGNORED = "nbval-ignore-output"
FLOAT = re.compile(
    r"(?<![\w.])[-+]?(?:\d+\.\d+|\.\d+|\d+(?:\.\d+)?e[-+]?\d+|\d+(?:\.\d+)?%)(?!\w)|\b(?:nan|inf)\b",
    re.IGNORECASE,
)
ASSERTS = re.compile(r"^\s*assert\b|\bcheck_\w+\(", re.MULTILINE)
PROSE_CLAIM = re.compile(r"\bcells? asserts?\b|\(asserted\)|\bis asserted\b", re.IGNORECASE)
RUN_LINE = re.compile(r"^profile=\w+ device=\w+ torch=\S+\n?$")  # describe_run(): not a result
# A workbook's parts table (`load_parts`, `whose_parts`): '1.1' and so on are exercise numbers,
# and whose each part is depends on the learner's work; it is no measured result.
PARTS_TABLE = re.compile(r"\b(?:load_parts|whose_parts)\(globals\(\), chapter=\d+\)")

# (notebook, a piece of the cell's source) -> why its output may be compared exactly although it
# prints a float, or why it prints something without asserting it.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("book/01_tokenization.ipynb", "chars = CharTokenizer(text)"): (
        "prints the vocabulary's characters ('-.3' is three of them), not a number"
    ),
    ("book/01_tokenization.ipynb", 'for s in ["a", "é", "日", "🙂"]:'): (
        "code points in hex (U+00E9), exact"
    ),
    ("book/01_tokenization.ipynb", "bytes_per_token = [held_out_bytes / n for n in n_tokens]"): (
        "bytes per token: a ratio of two integer counts of a deterministic tokenizer, exact"
    ),
    ("book/01_tokenization.ipynb", '" 3.14159"'): "the literal '3.14159' being tokenized",
    ("book/01_tokenization.ipynb", 'corpora = {"Tiny Shakespeare (held out)"'): (
        "bytes per token: ratios of integer counts of deterministic tokenizers, exact"
    ),
    ("book/02_attention.ipynb", "per forward+backward"): (
        "one run's timing on whatever machine ran the page, and the text says so; "
        "benchmarks/attention.py measures the two paths"
    ),
    ("book/03_masking.ipynb", 'print("softmax of an all -inf row:", naive.tolist())'): (
        "NaN is exact: a softmax over a row of -inf is 0/0 in IEEE arithmetic on every machine"
    ),
    ("book/03_masking.ipynb", 'print("output rows of the empty queries:"'): (
        "0.0 is exact (the empty rows' weights are zeroed); 'NaN' is a word of a label"
    ),
    ("book/03_masking.ipynb", "def fully_masked_softmax(dtype: torch.dtype, fill: str) -> str:"): (
        "-1e9 is a label, finfo.min a constant of each dtype; the table's entries are words"
    ),
    ("solutions/01_tokenization.ipynb", "{n_bytes / len(ids):.2f} bytes per token"): (
        "bytes per token: a ratio of two integer counts of a deterministic tokenizer, exact"
    ),
    ("solutions/03_masking.ipynb", 'print("1. no NaN in output or gradients:"'): (
        "'NaN' is a word of a label; the three results are booleans"
    ),
    ("book/06_gpt2.ipynb", "print(textwrap.fill(repr(GPT2Config())"): (
        "the default config's literal fields (1e-05, 0.02), not measured"
    ),
    ("book/06_gpt2.ipynb", "bpe_vocab = by_profile(quick=512, full=2048)"): (
        "characters per token: a ratio of two integer counts of deterministic tokenizers, exact"
    ),
}


def printed(cell) -> str:
    """What a cell shows as text: standard output and plain-text results (not plots, not stderr,
    where warnings and progress bars go)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream" and output.name == "stdout":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            data = output.get("data", {})
            if not any(key.startswith("image/") for key in data):
                parts.append(data.get("text/plain", ""))
    return "".join(parts)


def code_cells(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def exception_for(path: Path, source: str) -> str | None:
    for (notebook, piece), reason in EXCEPTIONS.items():
        if notebook == f"{path.parent.name}/{path.name}" and piece in source:
            return reason
    return None


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """The rule's failures in one notebook, each naming the cell."""
    found = []
    for number, cell in enumerate(code_cells(path)):
        text = printed(cell)
        tags = cell.metadata.get("tags", [])
        skipped = exception_for(path, cell.source) or PARTS_TABLE.search(cell.source)
        if "nbval-skip" in tags or skipped or RUN_LINE.match(text):
            continue
        first_line = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
        where = f"{path.relative_to(root)} code cell {number} ({first_line[:60]!r})"
        floats = FLOAT.findall(text)
        if IGNORED not in tags and floats:
            found.append(f"{where} prints {floats[:3]} and is compared exactly: tag it {IGNORED}")
        elif IGNORED in tags and text.strip() and not ASSERTS.search(cell.source):
            found.append(f"{where} prints a result that nothing checks: assert what it claims")
    return found


def unasserted_prose(path: Path, root: Path = ROOT) -> list[str]:
    """Markdown cells that say a cell asserts their claim while neither neighbouring code cell
    (the nearest above and the nearest below) asserts anything, each named."""
    cells = nbformat.read(path, as_version=4).cells
    found = []
    for number, cell in enumerate(cells):
        if cell.cell_type != "markdown" or not (claim := PROSE_CLAIM.search(cell.source)):
            continue
        above = [c for c in cells[:number] if c.cell_type == "code"][-1:]
        below = [c for c in cells[number + 1 :] if c.cell_type == "code"][:1]
        if not any(ASSERTS.search(c.source) for c in above + below):
            found.append(
                f"{path.relative_to(root)} markdown cell {number} says {claim[0]!r}, but neither "
                "neighbouring code cell asserts anything"
            )
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_prose_that_cites_an_assert_has_one(path):
    problems = unasserted_prose(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_printed_result_is_asserted_and_no_float_is_compared(path):
    problems = violations(path)
    assert not problems, "\n".join(problems)


def test_every_exception_names_one_cell():
    """An exception that matches no cell (or several) is stale: the rule would skip the wrong
    cell, or none."""
    for (notebook, piece), reason in EXCEPTIONS.items():
        assert reason, f"{notebook}: the exception for {piece!r} gives no reason"
        matches = [c for c in code_cells(ROOT / notebook) if piece in c.source]
        assert len(matches) == 1, f"{notebook}: {piece!r} matches {len(matches)} code cells"


def test_the_rule_catches_both_mistakes(tmp_path):
    """A compared float and an unchecked ignored result are reported; asserted and exact ones are
    not."""
    book = tmp_path / "book"
    book.mkdir()
    cells = [
        ("print(loss)", [], "loss 2.31\n"),
        ("print(bleu)", [IGNORED], "BLEU 21.3\n"),
        ("print(bleu)\nassert bleu > 15, 'it translates'", [IGNORED], "BLEU 21.3\n"),
        ("print(ids)", [], "[70, 97, 263]\n"),
        ("check_layer_norm(LayerNorm)", [IGNORED], "LayerNorm: passed, max error 1.2e-07\n"),
    ]
    notebook = nbformat.v4.new_notebook()
    for source, tags, text in cells:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": tags})
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        notebook.cells.append(cell)
    path = book / "99_example.ipynb"
    nbformat.write(notebook, path)
    problems = violations(path, root=tmp_path)
    assert len(problems) == 2, problems
    assert "code cell 0" in problems[0] and "compared exactly" in problems[0]
    assert "code cell 1" in problems[1] and "nothing checks" in problems[1]


def test_the_prose_rule_catches_a_claim_without_its_assert(tmp_path):
    """Text that cites an assert next to cells that assert nothing is reported; text next to an
    asserting cell, and text that cites nothing, are not."""
    book = tmp_path / "book"
    book.mkdir()
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell("print(loss)"),
        nbformat.v4.new_markdown_cell("The loss falls below 2 (the cell asserts it)."),
        nbformat.v4.new_code_cell("print(bleu)"),
        nbformat.v4.new_markdown_cell("BLEU is 3 or more (asserted)."),
        nbformat.v4.new_code_cell("assert bleu >= 3, 'it translates'"),
        nbformat.v4.new_markdown_cell("The plot shows the loss."),
    ]
    path = book / "99_example.ipynb"
    nbformat.write(notebook, path)
    problems = unasserted_prose(path, root=tmp_path)
    assert len(problems) == 1, problems
    assert "markdown cell 1" in problems[0] and "cell asserts" in problems[0]
