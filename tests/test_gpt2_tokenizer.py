"""GPT-2's real tokenizer as the course loads it, against tiktoken and Hugging Face.

Both references are built offline from OpenAI's `encoder.json` and `vocab.bpe` (the mirror's
`gpt2/` folder), so the comparison needs no network and no cached Hugging Face download.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from transformers import GPT2Tokenizer

from transformer_course import data
from transformer_course.tokenization import BPETokenizer, encode_chunk, load_gpt2_tokenizer

ENDOFTEXT = "<|endoftext|>"
# tiktoken_ext/openai_public.py, gpt2(): the pre-split regex of OpenAI's encoder.py
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
DEFAULT_MIRROR = Path(__file__).resolve().parents[2] / "shared" / "data"
MIRROR = Path(os.environ.get(data.MIRROR_ENV) or DEFAULT_MIRROR)
pytestmark = pytest.mark.skipif(
    not (MIRROR / "gpt2" / "vocab.bpe").is_file(),
    reason=f"needs the data mirror ({data.MIRROR_ENV}) with gpt2/encoder.json and gpt2/vocab.bpe",
)
CORPORA = ("wikitext-2-valid", "wikitext-2-test", "tinyshakespeare")


@pytest.fixture(scope="module")
def ours() -> BPETokenizer:
    return load_gpt2_tokenizer()


@pytest.fixture(scope="module")
def tiktoken_gpt2() -> tiktoken.Encoding:
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data.fetch("gpt2", "vocab.bpe")),
        encoder_json_file=str(data.fetch("gpt2", "encoder.json")),
    )
    return tiktoken.Encoding(
        "gpt2-offline",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: 50256},
    )


@pytest.fixture(scope="module")
def hf_gpt2() -> GPT2Tokenizer:
    vocab, merges = data.fetch("gpt2", "encoder.json"), data.fetch("gpt2", "vocab.bpe")
    return GPT2Tokenizer(vocab=str(vocab), merges=str(merges))


def test_loader_gives_gpt2s_vocabulary(ours: BPETokenizer) -> None:
    assert ours.vocab_size == 50257
    assert ours.special_tokens == {ENDOFTEXT: 50256}
    assert ours.encode("Hello world") == [15496, 995]  # the check in OpenAI's and tiktoken's docs
    assert len(ours.merges) == 50000


def test_every_gpt2_token_encodes_whole(ours: BPETokenizer) -> None:
    """Why the loader may say tokens_encode_whole=True: each of the 50,256 tokens (all but
    `<|endoftext|>`), encoded from its bytes by the merges alone, is that one token."""
    assert ours.tokens_encode_whole
    for token, token_bytes in ours.vocab.items():
        if token != ours.special_tokens[ENDOFTEXT]:
            ids = [ours.byte_ids[b] for b in token_bytes]
            assert encode_chunk(ids, ours.merges, ours.ranks) == [token], token_bytes


@pytest.mark.parametrize("corpus", CORPORA)
def test_same_ids_as_tiktoken_and_hugging_face(
    corpus: str, ours: BPETokenizer, tiktoken_gpt2: tiktoken.Encoding, hf_gpt2: GPT2Tokenizer
) -> None:
    text = data.load_text(corpus)
    ids = ours.encode(text)
    assert ids == tiktoken_gpt2.encode_ordinary(text)
    assert ids == hf_gpt2(text)["input_ids"]
    assert ours.decode(ids) == text


def test_endoftext_is_one_special_token(
    ours: BPETokenizer, tiktoken_gpt2: tiktoken.Encoding, hf_gpt2: GPT2Tokenizer
) -> None:
    text = f"The end.{ENDOFTEXT}Once upon a time{ENDOFTEXT}"
    ids = ours.encode(text)
    assert ids.count(50256) == 2
    assert ids == tiktoken_gpt2.encode(text, allowed_special="all")
    assert ids == hf_gpt2(text)["input_ids"]
    assert ours.decode(ids) == text
    partial = "<|endoftext"  # not the special token: ordinary text
    assert ours.encode(partial) == tiktoken_gpt2.encode_ordinary(partial)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_and_tiktoken_agree_on_any_text(
    text: str, ours: BPETokenizer, tiktoken_gpt2: tiktoken.Encoding
) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    if ENDOFTEXT not in text:
        assert ids == tiktoken_gpt2.encode_ordinary(text)


# Where encoding by words (`encode_ordinary`) could cut wrongly: runs of spaces, other whitespace,
# and what may follow a space.
AROUND_SPACES = [" ", "  ", "\n", "\t", "\x1c", "\x85", "\xa0", "\u3000", "a", "é", "1", "'", "s"]
AROUND_SPACES += [",", "\u0301", "🙂", " the", "'ll"]


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(AROUND_SPACES), max_size=40).map("".join))
def test_tiktoken_agrees_around_spaces(
    text: str, ours: BPETokenizer, tiktoken_gpt2: tiktoken.Encoding
) -> None:
    assert ours.encode_ordinary(text) == tiktoken_gpt2.encode_ordinary(text)


def test_encode_iterable_equals_encode_across_blank_lines(ours: BPETokenizer) -> None:
    """At the end of a text a run of newlines is one chunk ("\\n\\n", id 628), but before a
    word it splits ("\\n" + "\\n" + "World"): a stream must not settle text that ends in
    whitespace, or a file read line by line gets other ids than the file read whole."""
    text = "Hello.\n\nWorld\n\n\n  indented\n \n\tThe end.\n" * 3
    expected = ours.encode(text)
    assert 628 not in expected[:4]  # "\n" "\n" before "World", not "\n\n"
    assert list(ours.encode_iterable(text.splitlines(keepends=True))) == expected
    assert list(ours.encode_iterable(text)) == expected  # a character at a time
    shakespeare = data.load_text("tinyshakespeare")[:20_000]
    lines = shakespeare.splitlines(keepends=True)
    assert list(ours.encode_iterable(lines)) == ours.encode(shakespeare)


def test_encode_iterable_looks_again_only_once_unsettled_text_has_doubled(ours, monkeypatch):
    """A run that cannot settle (one long word, fed a character at a time) is looked at again
    when it has doubled, not after every piece: linear time, not quadratic."""
    looks = []
    settled_length = ours.settled_length
    monkeypatch.setattr(
        ours, "settled_length", lambda text: looks.append(text) or settled_length(text)
    )
    word = "a" * 4000
    assert list(ours.encode_iterable(word)) == ours.encode(word)
    assert len(looks) <= 14, len(looks)  # about log2(4000) = 12
