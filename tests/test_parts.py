"""Carrying a learner's parts from chapter to chapter: `keep` saves a passed part's cell,
`load_parts` runs the saved cells in a later workbook's namespace and checks each part again."""

from __future__ import annotations

import inspect
import linecache
import typing

import pytest
import torch

from transformer_course import attention, layernorm, masking, parts
from transformer_course.parts import keep, load_parts, parts_of, whose_parts


def define(source: str, cell: str = "<cell-1>") -> dict:
    """Run `source` as a notebook cell does: under a file name that linecache knows."""
    linecache.cache[cell] = (len(source), None, source.splitlines(keepends=True), cell)
    namespace: dict = {}
    load_parts(namespace, chapter=1)  # the course's tools, as a workbook's first cell gives
    exec(compile(source, cell, "exec"), namespace)
    return namespace


def course_cell(obj) -> str:
    return inspect.getsource(obj)


def test_parts_are_read_from_the_course_lines_in_exercise_order():
    numbers = [part.number for part in parts_of()]
    assert numbers[:3] == ["1.1", "1.2", "1.3"]
    assert [p.name for p in parts_of(3)] == [
        "causal_mask",
        "padding_mask",
        "combine_masks",
        "masked_softmax",
    ]


def test_kept_parts_are_yours_in_a_later_chapter_and_use_each_other(tmp_path, capsys):
    ns2 = define(course_cell(attention.MultiHeadAttention), "<cell-mha>")
    keep(ns2["MultiHeadAttention"], folder=tmp_path)
    ns3 = define(course_cell(attention.causal_mask), "<cell-causal>")
    keep(ns3["causal_mask"], folder=tmp_path)
    assert "kept causal_mask in" in capsys.readouterr().out

    later: dict = {}
    whose = load_parts(later, chapter=4, folder=tmp_path)
    assert whose["MultiHeadAttention"] == "yours" and whose["causal_mask"] == "yours"
    assert whose["attention_scores"].startswith("the course's (not in")
    assert later["MultiHeadAttention"] is not attention.MultiHeadAttention
    # Your attention reads your causal mask: both live in the notebook's namespace.
    assert later["MultiHeadAttention"].forward.__globals__ is later
    assert later["causal_mask"] is not masking.causal_mask
    assert later["padding_mask"] is masking.padding_mask  # never kept: the course's


def test_keeping_again_replaces_the_part_and_keeps_the_others(tmp_path):
    keep(define(course_cell(masking.padding_mask), "<a>")["padding_mask"], folder=tmp_path)
    keep(define(course_cell(attention.causal_mask), "<b>")["causal_mask"], folder=tmp_path)
    newer = course_cell(masking.padding_mask).replace('"""True where', '"""Again: true where')
    keep(define(newer, "<c>")["padding_mask"], folder=tmp_path)
    text = (tmp_path / "chapter_3.py").read_text()
    assert text.count("def padding_mask") == 1 and "Again: true where" in text
    assert text.index("def causal_mask") < text.index("def padding_mask")  # exercise order


def test_a_part_that_fails_its_check_or_cannot_run_is_replaced_by_the_courses(tmp_path, capsys):
    wrong = course_cell(attention.causal_mask).replace("diagonal=k_len - q_len", "diagonal=0")
    keep(define(wrong, "<wrong>")["causal_mask"], folder=tmp_path)
    broken = "def padding_mask(tokens, pad_id):\n    return undefined_name\n"
    keep(define(broken, "<broken>")["padding_mask"], folder=tmp_path)
    text = (tmp_path / "chapter_3.py").read_text()
    (tmp_path / "chapter_3.py").write_text(text + "\nraise RuntimeError('a stray line')\n")

    later: dict = {}
    whose = load_parts(later, chapter=4, folder=tmp_path)
    assert whose["causal_mask"].startswith("the course's (") and "causal" in whose["causal_mask"]
    assert later["causal_mask"] is attention.causal_mask
    assert whose["padding_mask"].startswith("the course's (cannot run: RuntimeError")
    assert later["padding_mask"] is masking.padding_mask
    assert "the course's" in capsys.readouterr().out


def test_checking_a_part_leaves_the_random_state_alone(tmp_path):
    keep(define(course_cell(attention.causal_mask), "<c>")["causal_mask"], folder=tmp_path)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    load_parts({}, chapter=4, folder=tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_keep_refuses_what_is_not_a_part(tmp_path):
    with pytest.raises(ValueError, match="part: expected one of"):
        keep(len, folder=tmp_path)


def test_the_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(parts.FOLDER_ENV, str(tmp_path / "mine"))
    assert keep(define(course_cell(attention.causal_mask), "<env>")["causal_mask"]) is None
    assert (tmp_path / "mine" / "chapter_3.py").exists()


def test_whose_parts_names_each_part_of_the_chapters_so_far(tmp_path, capsys):
    keep(define(course_cell(attention.causal_mask), "<w>")["causal_mask"], folder=tmp_path)
    namespace: dict = {}
    load_parts(namespace, chapter=4, folder=tmp_path)
    namespace["LayerNorm"] = define(course_cell(layernorm.LayerNorm), "<ln>")["LayerNorm"]
    whose = whose_parts(namespace, chapter=4)
    assert whose["causal_mask"] == "yours" and whose["LayerNorm"] == "yours"
    assert whose["padding_mask"] == "the course's" and whose["RMSNorm"] == "the course's"
    assert set(whose) == {part.name for part in parts_of() if part.chapter <= 4}
    assert f"2 of {len(whose)} parts are yours" in capsys.readouterr().out
    assert "RMSNorm" not in namespace  # chapter 4 is the learner's to write
    assert whose_parts(namespace, chapter=4)["RMSNorm"] == "the course's"  # missing: not yours


def test_the_course_modules_never_give_one_name_two_meanings():
    """`load_parts` pours the course modules into one namespace (every public name, and the
    private helpers of the modules that hold exercises): a name two modules define differently
    (say two `Unembed`s) would silently replace a part with another."""
    homes = {part.course.__module__ for part in parts.parts_of()}
    seen: dict = {}
    clashes = []
    for module in parts._course_modules():
        hidden = "__" if module.__name__ in homes else "_"
        for name, value in vars(module).items():
            if name.startswith(hidden) or isinstance(value, typing.TypeVar):
                continue
            if name in seen and seen[name][1] is not value:
                clashes.append(f"{name}: {seen[name][0]} and {module.__name__}")
            seen[name] = (module.__name__, value)
    assert clashes == []


def test_keep_refuses_the_courses_own_part(tmp_path):
    """A cell that failed to run leaves the course's part in its place: never saved as yours."""
    (course,) = [part for part in parts.parts_of(8) if part.name == "param_count"]
    with pytest.raises(ValueError, match="expected your param_count, got the course's"):
        parts.keep(course.course, folder=tmp_path)
    assert not list(tmp_path.iterdir())


def test_load_parts_leaves_this_chapters_parts_to_the_learner(tmp_path, capsys):
    namespace: dict = {}
    parts.load_parts(namespace, chapter=8, folder=tmp_path)
    assert "param_count" not in namespace and "FullyShardedDataParallel" not in namespace
    assert "Llama" in namespace and "flop_param_count" in namespace  # earlier parts, tools
