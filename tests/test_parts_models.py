"""Keeping a trained model for a later chapter: `keep_model` saves its configuration and weights
beside the learner's parts, `load_model` builds it again (None when it is absent)."""

from __future__ import annotations

import os

import pytest
import torch

from transformer_course.gpt2 import GPT2, GPT2Config
from transformer_course.llama import Llama, LlamaConfig
from transformer_course.parts import FOLDER_ENV, keep_model, load_model


def small_gpt2(seed: int = 0) -> GPT2:
    torch.manual_seed(seed)
    return GPT2(GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=11, n_ctx=8))


def test_a_kept_model_comes_back_with_its_config_weights_and_outputs(tmp_path, capsys):
    model = small_gpt2()
    keep_model(model, "chapter_6_gpt2", folder=tmp_path)
    assert f"kept your model in {tmp_path / 'chapter_6_gpt2.pt'}" in capsys.readouterr().out

    loaded = load_model("chapter_6_gpt2", GPT2, GPT2Config, folder=tmp_path)
    assert loaded.cfg == model.cfg and loaded is not model
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    tokens = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    model.eval(), loaded.eval()
    assert torch.equal(model(tokens), loaded(tokens))


def test_an_absent_model_is_none_and_says_why(tmp_path, capsys):
    assert load_model("chapter_6_gpt2", GPT2, GPT2Config, folder=tmp_path) is None
    out = capsys.readouterr().out
    assert f"no model kept in {tmp_path / 'chapter_6_gpt2.pt'}" in out
    assert "run the workbook that trains it" in out


def test_the_folder_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(FOLDER_ENV, str(tmp_path / "mine"))
    keep_model(small_gpt2(), "chapter_6_gpt2")
    assert (tmp_path / "mine" / "chapter_6_gpt2.pt").is_file()
    assert load_model("chapter_6_gpt2", GPT2, GPT2Config) is not None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"empty, truncated or not a checkpoint \(0 bytes\)"),
        (b"half a file", "empty, truncated or not a checkpoint"),
    ],
)
def test_a_corrupt_file_is_a_clear_error_naming_it(tmp_path, content, message):
    path = tmp_path / "chapter_6_gpt2.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        load_model("chapter_6_gpt2", GPT2, GPT2Config, folder=tmp_path)
    assert str(path) in str(error.value)


def test_a_truncated_file_is_a_clear_error(tmp_path):
    keep_model(small_gpt2(), "chapter_6_gpt2", folder=tmp_path)
    path = tmp_path / "chapter_6_gpt2.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"checkpoint {path}: cannot be read"):
        load_model("chapter_6_gpt2", GPT2, GPT2Config, folder=tmp_path)


def test_a_model_of_another_kind_is_refused_naming_the_file(tmp_path):
    torch.manual_seed(0)
    llama = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_vocab=11))
    keep_model(llama, "chapter_6_gpt2", folder=tmp_path)
    with pytest.raises(ValueError, match="chapter_6_gpt2.pt: its configuration does not fit"):
        load_model("chapter_6_gpt2", GPT2, GPT2Config, folder=tmp_path)


def test_keeping_is_atomic_a_failed_write_leaves_the_old_model(tmp_path, monkeypatch):
    keep_model(small_gpt2(0), "chapter_6_gpt2", folder=tmp_path)
    before = (tmp_path / "chapter_6_gpt2.pt").read_bytes()

    def crash(obj, f):
        f.write(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        keep_model(small_gpt2(1), "chapter_6_gpt2", folder=tmp_path)
    assert (tmp_path / "chapter_6_gpt2.pt").read_bytes() == before
    assert os.listdir(tmp_path) == ["chapter_6_gpt2.pt"]  # no temporary file left behind


@pytest.mark.parametrize("name", ["../elsewhere", "a/b", "", 6])
def test_a_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="name: expected a name of letters, digits and _"):
        keep_model(small_gpt2(), name, folder=tmp_path)


def test_only_a_course_model_with_a_config_is_kept(tmp_path):
    with pytest.raises(ValueError, match="model: expected a course model .* got a Linear"):
        keep_model(torch.nn.Linear(2, 2), "linear", folder=tmp_path)
    assert not list(tmp_path.iterdir())
