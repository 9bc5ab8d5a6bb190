"""Tokenizers: hand-worked examples, a naive reference trainer, and exact agreement with Hugging Face.

Tolerance: token ids are integers, so every comparison with a reference is exact equality.
"""

from __future__ import annotations

import json

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from transformer_course.data import load_text
from transformer_course.tokenization import (
    GPT2_SPLIT_PATTERN,
    BPETokenizer,
    CharTokenizer,
    bytes_to_unicode,
    encode_chunk,
    get_pair_counts,
    merge_pair,
    train_merges,
)

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return load_text("tinyshakespeare")


def train_hf(texts: list[str], *, use_regex: bool, vocab_size: int = 1000) -> tokenizers.Tokenizer:
    """A byte-level BPE trained by Hugging Face `tokenizers` (GPT-2's setup, no prefix space)."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOT],
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return hf


@pytest.fixture(scope="module")
def hf_regex(shakespeare: str) -> tokenizers.Tokenizer:
    return train_hf([shakespeare], use_regex=True)


@pytest.fixture(scope="module")
def small_bpe(shakespeare: str) -> BPETokenizer:
    return BPETokenizer.train(shakespeare[:20_000], 400, pattern=GPT2_SPLIT_PATTERN, special_tokens=[EOT])


# --- hand-worked examples -------------------------------------------------------------------


def test_pair_counts_by_hand() -> None:
    assert get_pair_counts([1, 2, 3, 1, 2]) == {(1, 2): 2, (2, 3): 1, (3, 1): 1}
    assert get_pair_counts([7]) == {}


def test_merge_pair_never_overlaps() -> None:
    # "aaa" holds (a, a) twice, but the two occurrences share the middle "a": only one merges.
    assert merge_pair([97, 97, 97], (97, 97), 256) == [256, 97]
    assert merge_pair([97, 97, 97, 97], (97, 97), 256) == [256, 256]
    assert merge_pair([1, 2, 3, 1, 2], (1, 2), 9) == [9, 3, 9]


def test_worked_example_aaabdaaabac() -> None:
    # Wikipedia's BPE example, by hand (a=97, b=98, c=99, d=100):
    # 1. (a, a) occurs 4 times -> 256 ("ZabdZabac")
    # 2. (256, a) and (a, b) both occur twice; ties go to the smaller pair, (97, 98) -> 257 ("ZYdZYac")
    # 3. (256, 257) occurs twice -> 258 ("XdXac")
    tokenizer = BPETokenizer.train("aaabdaaabac", 259)
    assert tokenizer.encode("aaabdaaabac") == [258, 100, 258, 97, 99]
    assert list(tokenizer.merges.items()) == [((97, 97), 256), ((97, 98), 257), ((256, 257), 258)]
    assert tokenizer.vocab[258] == b"aaab"
    assert tokenizer.vocab_size == 259


def test_char_tokenizer_by_hand() -> None:
    tokenizer = CharTokenizer("hello")  # sorted characters: e h l o
    assert tokenizer.vocab_size == 4
    assert tokenizer.encode("hello") == [1, 0, 2, 2, 3]
    assert tokenizer.decode([3, 2, 1]) == "olh"


def test_multibyte_character_split_across_tokens() -> None:
    # "é" is the two bytes C3 A9 in UTF-8; ids 0..255 of a fresh tokenizer are the raw bytes.
    tokenizer = BPETokenizer.train("x", 256)
    assert tokenizer.decode([0xC3, 0xA9]) == "é"
    assert tokenizer.encode("é") == [0xC3, 0xA9]


def test_byte_alphabet_matches_gpt2() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode as reference

    assert bytes_to_unicode() == reference()
    assert bytes_to_unicode()[ord(" ")] == "Ġ"  # GPT-2 writes the space as U+0120


# --- the incremental trainer against a naive one ---------------------------------------------


def naive_train_merges(chunk_counts: dict[bytes, int], num_merges: int) -> dict[tuple[int, int], int]:
    """Recount every pair of every chunk after every merge (slow and obviously right)."""
    chunks = {tuple(chunk): count for chunk, count in chunk_counts.items()}
    merges = {}
    for step in range(num_merges):
        counts: dict[tuple[int, int], int] = {}
        for chunk, weight in chunks.items():
            for pair in zip(chunk, chunk[1:]):
                counts[pair] = counts.get(pair, 0) + weight
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges[pair] = 256 + step
        new_chunks: dict[tuple[int, ...], int] = {}
        for chunk, weight in chunks.items():
            merged, i = [], 0
            while i < len(chunk):
                if chunk[i : i + 2] == pair:
                    merged.append(256 + step)
                    i += 2
                else:
                    merged.append(chunk[i])
                    i += 1
            new_chunks[tuple(merged)] = new_chunks.get(tuple(merged), 0) + weight
        chunks = new_chunks
    return merges


def test_incremental_training_matches_naive_recount(shakespeare: str) -> None:
    import regex

    chunks: dict[bytes, int] = {}
    for chunk in regex.findall(GPT2_SPLIT_PATTERN, shakespeare[:30_000]):
        chunks[chunk.encode()] = chunks.get(chunk.encode(), 0) + 1
    chunks[b"aaaaaaa"] = 50  # runs of one byte exercise the overlapping-pair updates
    assert train_merges(chunks, 150) == naive_train_merges(chunks, 150)


def test_encode_chunk_applies_merges_in_rank_order() -> None:
    # Merges learned in this order: (b, c) first, then (a, b). "abc" must become a + bc, because
    # (b, c) has the lower rank even though (a, b) comes first in the text.
    merges = {(98, 99): 256, (97, 98): 257}
    ranks = {(98, 99): 0, (97, 98): 1}
    assert encode_chunk([97, 98, 99], merges, ranks) == [97, 256]
    assert encode_chunk([97, 98, 97, 98], merges, ranks) == [257, 257]
    assert encode_chunk([], merges, ranks) == []


# --- agreement with Hugging Face `tokenizers` and `transformers` -----------------------------


def test_from_huggingface_matches_with_regex_split(shakespeare: str, hf_regex: tokenizers.Tokenizer) -> None:
    ours = BPETokenizer.from_huggingface(hf_regex)
    assert ours.vocab_size == hf_regex.get_vocab_size()
    assert ours.encode(shakespeare) == hf_regex.encode(shakespeare).ids
    mixed = f"First Citizen:{EOT} naïve café, 12345 日本語 🙂\n\n  tabs\tand  spaces {EOT}"
    ids = hf_regex.encode(mixed).ids
    assert ours.encode(mixed) == ids
    assert ours.decode(ids) == hf_regex.decode(ids, skip_special_tokens=False) == mixed


def test_from_huggingface_matches_without_regex_split(shakespeare: str) -> None:
    # Trained line by line (one 1 MB "word" would take the Hugging Face trainer minutes).
    lines = shakespeare.splitlines(keepends=True)
    hf = train_hf(lines, use_regex=False)
    ours = BPETokenizer.from_huggingface(hf)
    assert ours.pattern is None
    assert [ours.encode(line) for line in lines] == [e.ids for e in hf.encode_batch(lines)]
    # Without a pre-split a long text is one chunk: merges cross spaces and newlines.
    passage = shakespeare[:50_000]
    assert ours.encode(passage) == hf.encode(passage).ids


def test_from_gpt2_files_matches_transformers(shakespeare: str, hf_regex: tokenizers.Tokenizer, tmp_path) -> None:
    from transformers import GPT2Tokenizer

    hf_regex.model.save(str(tmp_path))  # writes vocab.json and merges.txt in GPT-2's format
    assert (tmp_path / "merges.txt").read_text().startswith("#version")
    reference = GPT2Tokenizer.from_pretrained(str(tmp_path))
    ours = BPETokenizer.from_gpt2_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert ours.encode(shakespeare) == reference.encode(shakespeare)
    text = f"Hello{EOT} world"
    assert ours.encode(text) == reference.encode(text)
    assert ours.special_tokens == {EOT: reference.convert_tokens_to_ids(EOT)}


# --- round trips ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(small_bpe: BPETokenizer, text: str) -> None:
    assert small_bpe.decode(small_bpe.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["ab", "é", "日", " ", "\n", EOT, "🙂", "x"])).map("".join))
def test_round_trip_without_pattern_and_specials(text: str) -> None:
    tokenizer = BPETokenizer.train("ab ab é日 🙂🙂 x\n" * 20, 300, special_tokens=[EOT])
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(small_bpe: BPETokenizer) -> None:
    eot = small_bpe.special_tokens[EOT]
    assert eot == small_bpe.vocab_size - 1  # special tokens take the last ids
    ids = small_bpe.encode(f"To be{EOT}or not")
    assert ids == small_bpe.encode("To be") + [eot] + small_bpe.encode("or not")
    assert small_bpe.decode(ids) == f"To be{EOT}or not"


def test_special_tokens_longest_match_first() -> None:
    tokenizer = BPETokenizer.train("hello", 258, special_tokens=["<e>", "<e>>"])
    assert tokenizer.encode("<e>>") == [257]
    assert tokenizer.encode("<e><e>>h") == [256, 257, ord("h")]
    assert tokenizer.decode([257, 256]) == "<e>><e>"


def test_save_load_round_trip(small_bpe: BPETokenizer, shakespeare: str, tmp_path) -> None:
    path = tmp_path / "bpe.json"
    small_bpe.save(path)
    json.loads(path.read_text())  # plain JSON
    loaded = BPETokenizer.load(path)
    assert loaded.vocab == small_bpe.vocab
    assert list(loaded.merges.items()) == list(small_bpe.merges.items())
    assert loaded.special_tokens == small_bpe.special_tokens
    assert loaded.pattern == small_bpe.pattern
    sample = shakespeare[:5000] + EOT
    assert loaded.encode(sample) == small_bpe.encode(sample)


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocab_size", "special_tokens", "expected"),
    [(255, (), ">= 256"), (257, ("<a>", "<b>"), ">= 258"), ("300", (), "got '300'")],
)
def test_train_rejects_small_vocab(vocab_size, special_tokens, expected: str) -> None:
    with pytest.raises(ValueError, match="vocab_size") as info:
        BPETokenizer.train("hello", vocab_size, special_tokens=special_tokens)
    assert expected in str(info.value)


def test_decode_rejects_unknown_ids(small_bpe: BPETokenizer) -> None:
    for bad in (small_bpe.vocab_size, -1, 1.5):
        with pytest.raises(ValueError, match=r"ids: expected token ids in the vocabulary .* at position 1"):
            small_bpe.decode([0, bad])
    with pytest.raises(TypeError, match="ids: expected a sequence of ints, got str"):
        small_bpe.decode("abc")


def test_non_string_text_is_rejected(small_bpe: BPETokenizer) -> None:
    for call in (small_bpe.encode, CharTokenizer("ab").encode, lambda t: BPETokenizer.train(t, 300)):
        with pytest.raises(TypeError, match="text: expected a str, got bytes"):
            call(b"hello")


def test_lone_surrogate_is_rejected(small_bpe: BPETokenizer) -> None:
    with pytest.raises(ValueError, match=r"text: expected a string UTF-8 can encode.*'\\ud800' at index 2"):
        small_bpe.encode("ab\ud800c")


def test_char_tokenizer_rejects_unknown_character() -> None:
    with pytest.raises(ValueError, match="text: .* got 'z' at index 2"):
        CharTokenizer("abc").encode("abz")


def test_from_huggingface_rejects_prefix_space(hf_regex: tokenizers.Tokenizer) -> None:
    hf = tokenizers.Tokenizer.from_str(hf_regex.to_str())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(ValueError, match="add_prefix_space"):
        BPETokenizer.from_huggingface(hf)
    with pytest.raises(TypeError, match="tokenizer: expected a tokenizers.Tokenizer, got dict"):
        BPETokenizer.from_huggingface({})


def test_load_rejects_other_json(tmp_path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"model": {}}')
    with pytest.raises(ValueError, match="path: expected"):
        BPETokenizer.load(path)
