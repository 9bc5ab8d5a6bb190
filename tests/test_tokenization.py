"""Tokenizers: hand-worked examples, a naive reference trainer, exact agreement with Hugging Face.

Tolerance: token ids are integers, so every comparison with a reference is exact equality.
"""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import regex
import tokenizers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from transformer_course import tokenization
from transformer_course.data import load_text
from transformer_course.tokenization import (
    GPT2_SPLIT_PATTERN,
    SHORT_CHUNK,
    SPACE_BEFORE_WORD,
    BPETokenizer,
    CharTokenizer,
    encode_chunk,
    encode_long_chunk,
    get_pair_counts,
    merge_pair,
    split_chunks,
    train_merges,
)
from transformer_course.tokenizer_files import bytes_to_unicode

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
    return BPETokenizer.train(
        shakespeare[:20_000], 400, pattern=GPT2_SPLIT_PATTERN, special_tokens=[EOT]
    )


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
    # 2. (256, a) and (a, b) both occur twice; ties go to the smaller pair,
    #    (97, 98) -> 257 ("ZYdZYac")
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


def naive_train_merges(
    chunk_counts: dict[bytes, int], num_merges: int
) -> dict[tuple[int, int], int]:
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


def _merge_table(data: st.DataObject, alphabet: int, n_merges: int, shuffled: bool) -> dict:
    """A random merge table over `alphabet` bytes; each merge joins two earlier tokens, unless
    `shuffled` reorders the merges (ranks that disagree with the order tokens were made)."""
    tokens, merges = list(range(97, 97 + alphabet)), {}
    for _ in range(n_merges):
        pair = (data.draw(st.sampled_from(tokens)), data.draw(st.sampled_from(tokens)))
        if pair not in merges:
            merges[pair] = 256 + len(merges)
            tokens.append(merges[pair])
    items = list(merges.items())
    return dict(data.draw(st.permutations(items))) if shuffled else merges


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(), alphabet=st.integers(1, 4), n_merges=st.integers(0, 12), shuffled=st.booleans()
)
def test_encode_chunk_and_encode_long_chunk_agree(data, alphabet, n_merges, shuffled) -> None:
    """The scan and the heap apply the same merges: lowest rank first, leftmost on a tie."""
    merges = _merge_table(data, alphabet, n_merges, shuffled)
    ranks = {pair: rank for rank, pair in enumerate(merges)}
    ids = data.draw(st.lists(st.integers(97, 96 + alphabet), max_size=80))
    assert encode_chunk(ids, merges, ranks) == encode_long_chunk(ids, merges, ranks)


def test_long_chunks_encode_as_short_ones(shakespeare: str, small_bpe: BPETokenizer) -> None:
    text = shakespeare[:3000]  # without a pre-split, one chunk far longer than SHORT_CHUNK
    ids = [small_bpe.byte_ids[b] for b in text.encode()]
    assert len(ids) > SHORT_CHUNK
    reference = encode_chunk(ids, small_bpe.merges, small_bpe.ranks)
    assert encode_long_chunk(ids, small_bpe.merges, small_bpe.ranks) == reference
    unsplit = BPETokenizer(small_bpe.vocab, small_bpe.merges)
    assert unsplit.encode(text) == reference


def _encodes_whole(tokenizer: BPETokenizer, token: int) -> bool:
    ids = [tokenizer.byte_ids[b] for b in tokenizer.vocab[token]]
    return encode_chunk(ids, tokenizer.merges, tokenizer.ranks) == [token]


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("aab bc\né日"), min_size=1, max_size=200),
    pattern=st.sampled_from([None, GPT2_SPLIT_PATTERN, r"\w+"]),
    n_merges=st.integers(1, 60),
)
def test_trained_tokens_encode_whole(text: str, pattern: str | None, n_merges: int) -> None:
    """What `train` promises with tokens_encode_whole=True: a token's bytes encode as it."""
    tokenizer = BPETokenizer.train(text, 256 + n_merges, pattern=pattern)
    assert tokenizer.tokens_encode_whole
    assert all(_encodes_whole(tokenizer, token) for token in tokenizer.merges.values())


def test_real_trained_tokens_encode_whole(small_bpe: BPETokenizer) -> None:
    specials = small_bpe.special_tokens.values()
    assert all(_encodes_whole(small_bpe, t) for t in small_bpe.vocab if t not in specials)


def test_tokens_encode_whole_is_claimed_only_where_it_holds(hf_regex, tmp_path) -> None:
    # (b, c) before (a, b) before (ab, c): the chunk "abc" spells token 258 but encodes as a + bc.
    vocab = {**{b: bytes([b]) for b in range(256)}, 256: b"bc", 257: b"ab", 258: b"abc"}
    merges = {(98, 99): 256, (97, 98): 257, (257, 99): 258}
    assert BPETokenizer(vocab, merges).encode("abc") == [97, 256]
    assert not _encodes_whole(BPETokenizer(vocab, merges), 258)
    assert BPETokenizer(vocab, merges, tokens_encode_whole=True).encode("abc") == [258]  # wrong
    trained = BPETokenizer.train("hello hello", 260)
    trained.save(tmp_path / "bpe.json")
    unknown_origin = [
        BPETokenizer.load(tmp_path / "bpe.json"),
        BPETokenizer.from_huggingface(hf_regex),
        BPETokenizer.from_gpt2_files(*_gpt2_files(hf_regex, tmp_path)),
    ]
    assert trained.tokens_encode_whole
    assert not any(tokenizer.tokens_encode_whole for tokenizer in unknown_origin)


def test_encode_chunk_applies_merges_in_rank_order() -> None:
    # Merges learned in this order: (b, c) first, then (a, b). "abc" must become a + bc, because
    # (b, c) has the lower rank even though (a, b) comes first in the text.
    merges = {(98, 99): 256, (97, 98): 257}
    ranks = {(98, 99): 0, (97, 98): 1}
    assert encode_chunk([97, 98, 99], merges, ranks) == [97, 256]
    assert encode_chunk([97, 98, 97, 98], merges, ranks) == [257, 257]
    assert encode_chunk([], merges, ranks) == []


# --- agreement with Hugging Face `tokenizers` and `transformers` -----------------------------


def test_from_huggingface_matches_with_regex_split(
    shakespeare: str, hf_regex: tokenizers.Tokenizer
) -> None:
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


def test_from_gpt2_files_matches_transformers(
    shakespeare: str, hf_regex: tokenizers.Tokenizer, tmp_path
) -> None:
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


def random_pieces(text: str, seed: int, longest: int = 12) -> list[str]:
    """`text` cut at random places into pieces of 0 to `longest` characters."""
    rng, pieces, start = random.Random(seed), [], 0
    while start < len(text):
        stop = start + rng.randint(0, longest)
        pieces.append(text[start:stop])
        start = stop
    return pieces


# Contractions decided late ("'l" + "l"), runs of spaces, digits, special tokens and their
# prefixes, multi-byte characters: the places where a cut could change the ids.
STREAM_TEXT = (
    f"We'll see; they've gone.  It's   9000 {EOT}x{EOT}{EOT} <|endof <|end \n\n"
    "  café 日本 🙂 I'd you're 'll\n"
)


def test_encode_iterable_equals_encode_for_any_cut(small_bpe: BPETokenizer, shakespeare: str):
    """Cut anywhere, even inside a special token or a word. The second tokenizer has merges
    for contractions, so holding back only the last chunk fails ("We'l" splits as We ' l, and
    "'" would be encoded before "'ll" is complete)."""
    text = STREAM_TEXT + shakespeare[:1500].replace("\n\n", f"\n{EOT}") + STREAM_TEXT + "<|endo"
    contractions = BPETokenizer.train(
        "We'll see, they've gone; it's I'd you're    9000 " * 30,
        330,
        pattern=GPT2_SPLIT_PATTERN,
        special_tokens=[EOT],
    )
    assert len(contractions.encode("'ll")) == 1
    for tokenizer in (small_bpe, contractions):
        expected = tokenizer.encode(text)
        for seed in range(30):
            pieces = random_pieces(text, seed, longest=[1, 3, 12, 80][seed % 4])
            assert list(tokenizer.encode_iterable(pieces)) == expected, seed
        assert list(tokenizer.encode_iterable(text)) == expected  # one character at a time
    assert list(small_bpe.encode_iterable([])) == []
    chars = CharTokenizer(text)  # every tokenizer streams; characters are their own chunks
    assert list(chars.encode_iterable(random_pieces(text, 0))) == chars.encode(text)
    cuts = ["It's a we'", "ll do <|endof", "text|>", "<", "|endoftext|", ">"]
    assert list(small_bpe.encode_iterable(cuts)) == small_bpe.encode("".join(cuts))


def test_encode_iterable_holds_constant_memory_as_the_input_grows(small_bpe, shakespeare):
    """Streaming 4 times more lines (generated one at a time, never held) must not raise the
    peak memory Python allocates: measured with tracemalloc while the ids are counted, the peak
    for 8,000 lines stays within 1.5x of the peak for 2,000 (a tokenizer that joined its input
    first would need about 4x). The ids are those of `encode` on each line run joined."""
    import tracemalloc

    lines = shakespeare[:20_000].splitlines(keepends=True)

    def stream(n_lines):
        return (lines[i % len(lines)] for i in range(n_lines))

    def peak(n_lines):
        tracemalloc.start()
        try:
            count = sum(1 for _ in small_bpe.encode_iterable(stream(n_lines)))
            return tracemalloc.get_traced_memory()[1], count
        finally:
            tracemalloc.stop()

    (small, n_small), (large, n_large) = peak(2_000), peak(8_000)
    assert n_large > 3.5 * n_small
    assert large < 1.5 * small, (small, large)
    text = "".join(stream(300))
    assert list(small_bpe.encode_iterable(stream(300))) == small_bpe.encode(text)


@pytest.mark.parametrize(
    "specials, pattern",
    [
        (["<e>", "<e>>"], None),
        (["<e>", "<e>>", "e>x"], None),
        ([EOT, "text|>!"], GPT2_SPLIT_PATTERN),
    ],
)
def test_encode_iterable_with_overlapping_special_tokens(specials, pattern) -> None:
    """A special token that is the start of a longer one ("<e>" of "<e>>"), or whose end starts
    another ("<e>" and "e>x"), waits for what follows it; without a pattern, so does the text."""
    training = "hello <e> there e>x text!\n" * 20
    tokenizer = BPETokenizer.train(training, 300, pattern=pattern, special_tokens=specials)
    text = f"hello<e>> there <e>x e>x <e> a{EOT}! {EOT}text|>!" * 4 + "<e"
    expected = tokenizer.encode(text)
    for seed in range(30):
        assert list(tokenizer.encode_iterable(random_pieces(text, seed, 5))) == expected, seed


def test_encode_iterable_is_lazy(small_bpe: BPETokenizer, shakespeare: str) -> None:
    lines = shakespeare.splitlines(keepends=True)[:400]
    read = 0

    def reading():
        nonlocal read
        for line in lines:
            read += 1
            yield line

    ids = small_bpe.encode_iterable(reading())
    first = next(ids)
    assert read <= 2  # the first line's ids come once the second line is read
    assert [first, *ids] == small_bpe.encode("".join(lines))
    assert read == len(lines)


def test_encode_iterable_names_a_bad_piece(small_bpe: BPETokenizer) -> None:
    with pytest.raises(TypeError, match=r"iterable\[1\]"):
        list(small_bpe.encode_iterable(["ok", b"bytes"]))
    with pytest.raises(ValueError, match=r"iterable\[0\]"):
        list(small_bpe.encode_iterable(["\ud800"]))


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
        with pytest.raises(
            ValueError, match=r"ids: expected token ids in the vocabulary .* at position 1"
        ):
            small_bpe.decode([0, bad])
    with pytest.raises(TypeError, match="ids: expected a sequence of ints, got str"):
        small_bpe.decode("abc")


def test_non_string_text_is_rejected(small_bpe: BPETokenizer) -> None:
    for call in (
        small_bpe.encode,
        CharTokenizer("ab").encode,
        lambda t: BPETokenizer.train(t, 300),
    ):
        with pytest.raises(TypeError, match="text: expected a str, got bytes"):
            call(b"hello")


def test_lone_surrogate_is_rejected(small_bpe: BPETokenizer) -> None:
    with pytest.raises(
        ValueError, match=r"text: expected a string UTF-8 can encode.*'\\ud800' at index 2"
    ):
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
    with pytest.raises(ValueError, match=r"path: expected .* got None in '.*other.json'"):
        BPETokenizer.load(path)


# --- loaders check what they read (file name and field in every error) -----------------------


def _first_merge_of_two_merged_tokens(state: dict) -> list[int]:
    return next(m for m in state["merges"] if m[0] >= 256 or m[1] >= 256)


def _hello_becomes_allo(state: dict) -> None:
    """The vocabulary says one thing and the merges another: 'hello' would decode to 'allo'."""
    left, right, new_id = _first_merge_of_two_merged_tokens(state)
    state["vocab"][str(new_id)] = (b"a" + bytes.fromhex(state["vocab"][str(new_id)])[1:]).hex()


CORRUPTIONS = {  # name: (how the saved state is corrupted, what the error says)
    "unknown version": (lambda st: st.update(version=2), "field 'version': expected 1 .* got 2"),
    "version as string": (
        lambda st: st.update(version="1"),
        "field 'version': expected the version 1, got str",
    ),
    "missing merges": (lambda st: st.pop("merges"), "field 'merges': missing"),
    "vocab as list": (
        lambda st: st.update(vocab=list(st["vocab"].values())),
        "field 'vocab': expected an object",
    ),
    "vocab not hex": (
        lambda st: st["vocab"].update({"5": "zz"}),
        r"field 'vocab': expected a decimal id .* '5': 'zz'",
    ),
    "vocab id not decimal": (
        lambda st: st["vocab"].update({"0x5": "61"}),
        r"field 'vocab': .* '0x5'",
    ),
    "vocab id out of range": (
        lambda st: st["vocab"].update({"99999": "61"}),
        r"vocab: expected ids 0\.\.\d+ .* got id 99999",
    ),
    "merge id as string": (
        lambda st: st["merges"][0].__setitem__(2, "256"),
        r"field 'merges': .* at index 0",
    ),
    "merge of a missing id": (
        lambda st: st["merges"][0].__setitem__(0, 99999),
        "merges: expected a pair of ids in the vocabulary",
    ),
    "merged bytes disagree": (
        _hello_becomes_allo,
        "merges: merge .* disagrees with vocab: expected the bytes",
    ),
    "special token id moved": (
        lambda st: st["special_tokens"].update({EOT: 5}),
        "special_tokens: .* has id 5, but vocab has",
    ),
    "special tokens as list": (
        lambda st: st.update(special_tokens=[EOT]),
        "field 'special_tokens': expected an object",
    ),
    "pattern not a string": (
        lambda st: st.update(pattern=3),
        "field 'pattern': expected a regular expression or null, got int",
    ),
    "pattern not a regex": (
        lambda st: st.update(pattern="(unclosed"),
        "pattern: expected a valid regular expression",
    ),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_load_refuses_inconsistent_files_naming_file_and_field(small_bpe, tmp_path, name) -> None:
    corrupt, message = CORRUPTIONS[name]
    path = tmp_path / "bpe.json"
    small_bpe.save(path)
    state = json.loads(path.read_text())
    corrupt(state)
    path.write_text(json.dumps(state))
    expected = rf"path: '{regex.escape(str(path))}' is not a valid tokenizer file: {message}"
    with pytest.raises(ValueError, match=expected):
        BPETokenizer.load(path)


def test_load_names_the_file_for_json_and_unicode_errors(tmp_path) -> None:
    truncated, binary = tmp_path / "truncated.json", tmp_path / "binary.json"
    truncated.write_text('{"format": "transformer_course.bpe", "vocab": {')
    binary.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(ValueError, match=r"path: '.*truncated.json' is not valid JSON: .* line 1"):
        BPETokenizer.load(truncated)
    with pytest.raises(ValueError, match=r"path: '.*binary.json' is not UTF-8 text:.* position 12"):
        BPETokenizer.load(binary)


def _gpt2_files(hf: tokenizers.Tokenizer, folder) -> tuple:
    hf.model.save(str(folder))
    return folder / "vocab.json", folder / "merges.txt"


def test_from_gpt2_files_refuses_ids_written_as_strings(hf_regex, tmp_path) -> None:
    vocab_json, merges_txt = _gpt2_files(hf_regex, tmp_path)
    vocab = json.loads(vocab_json.read_text())
    vocab["Ġthe"] = str(vocab["Ġthe"])
    vocab_json.write_text(json.dumps(vocab))
    expected = r"vocab_json: expected integer ids in '.*vocab.json', got '\d+' for the entry 'Ġthe"
    with pytest.raises(ValueError, match=expected):
        BPETokenizer.from_gpt2_files(vocab_json, merges_txt)
    vocab_json.write_text("[1, 2")
    with pytest.raises(ValueError, match=r"vocab_json: '.*vocab.json' is not valid JSON"):
        BPETokenizer.from_gpt2_files(vocab_json, merges_txt)
    vocab_json.write_text(json.dumps({char: b for b, char in bytes_to_unicode().items()}))
    merges_txt.write_bytes(b"#version: 0.2\n\xc3 \xa9\n")
    with pytest.raises(ValueError, match=r"merges_txt: '.*merges.txt' is not UTF-8 text"):
        BPETokenizer.from_gpt2_files(vocab_json, merges_txt)


def test_constructor_refuses_ids_outside_the_vocabulary() -> None:
    vocab = {b: bytes([b]) for b in range(256)}
    with pytest.raises(ValueError, match=r"vocab: expected ids 0\.\.256 .* got id 300"):
        BPETokenizer({**vocab, 300: b"ab"}, {(97, 98): 300})
    vocab.update({256: b"aa", 257: b"aaa"})
    with pytest.raises(ValueError, match="merges: expected each merge to create a new id, got 257"):
        BPETokenizer(vocab, {(97, 97): 256, (256, 97): 257, (97, 256): 257})


# --- writes are atomic ----------------------------------------------------------------------


def test_save_is_atomic(small_bpe: BPETokenizer, tmp_path, monkeypatch) -> None:
    path = tmp_path / "bpe.json"
    path.write_text("the user's previous tokenizer")

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        small_bpe.save(path)
    assert path.read_text() == "the user's previous tokenizer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe.json"]  # no temporary file left
    monkeypatch.undo()
    small_bpe.save(path)
    assert BPETokenizer.load(path).vocab == small_bpe.vocab
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe.json"]


# --- no silent contract breaks --------------------------------------------------------------

PATTERNS = [r"\w+", r"[a-z]", r"(a)|(b)", r"x*", "", r"\s", r"(?=a)", r"\d+|\p{L}+", "é+"]
PATTERNS.append(GPT2_SPLIT_PATTERN)
literal_patterns = st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3).map(
    lambda pieces: "|".join(regex.escape(piece) for piece in pieces)
)


@settings(max_examples=100, deadline=None)
@given(
    pattern=st.one_of(st.sampled_from(PATTERNS), literal_patterns),
    training=st.text(max_size=40),
    text=st.text(max_size=40),
)
def test_round_trip_any_text_any_pattern(pattern: str, training: str, text: str) -> None:
    """Text a pattern does not match is kept as chunks of its own, never dropped."""
    training += "hello hello"
    tokenizer = BPETokenizer.train(training, 280, pattern=pattern, special_tokens=[EOT])
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode(text + EOT + text)) == text + EOT + text


def _chunks_by_finditer(text: str, pattern: str) -> list[str]:
    """split_chunks written plainly: every match, and every stretch of text between matches."""
    chunks, end = [], 0
    for match in regex.finditer(pattern, text):
        chunks += [text[end : match.start()], match.group()]
        end = max(end, match.end())
    return [chunk for chunk in [*chunks, text[end:]] if chunk]


@settings(max_examples=200, deadline=None)
@given(pattern=st.one_of(st.sampled_from(PATTERNS), literal_patterns), text=st.text(max_size=40))
def test_split_chunks_keeps_every_character(pattern: str, text: str) -> None:
    chunks = split_chunks(text, regex.compile(pattern))
    assert "".join(chunks) == text and all(chunks)
    assert chunks == _chunks_by_finditer(text, pattern)


def test_cache_changes_no_ids(small_bpe: BPETokenizer, shakespeare: str, monkeypatch) -> None:
    text = shakespeare[:20_000] + EOT
    first = small_bpe.encode(text)
    assert small_bpe.encode(text) == first  # now from the cache
    monkeypatch.setattr(tokenization, "CACHE_SIZE", 0)
    uncached = BPETokenizer(
        small_bpe.vocab,
        small_bpe.merges,
        pattern=small_bpe.pattern,
        special_tokens=small_bpe.special_tokens,
    )
    assert uncached.encode(text) == first
    assert not uncached._chunk_cache and not uncached._word_cache


# --- encoding by words: GPT-2's pattern never crosses a space before a non-space ---------------

# The characters where that could go wrong: spaces, other whitespace (`\x1c` is whitespace to
# `re` but not to `regex`), letters, digits, a contraction's pieces, symbols, combining marks.
BOUNDARY_CHARACTERS = [" ", "  ", "\n", "\t", "\r\n", "\x1c", "\x85", "\xa0", "\u2003", "\u3000"]
BOUNDARY_CHARACTERS += ["a", "Z", "é", "日", "1", "²", "'", "s", "ll", ",", "-", "\u0301", "🙂"]


def test_re_whitespace_covers_regex_whitespace() -> None:
    """`SPACE_BEFORE_WORD` uses `re`; GPT-2's pattern uses `regex`. A character `regex` calls
    whitespace but `re` does not would make a false cut, so none may exist in all of Unicode."""
    every = "".join(map(chr, range(0x110000)))
    assert set(regex.findall(r"\s", every)) <= set(re.findall(r"\s", every))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(BOUNDARY_CHARACTERS), max_size=30).map("".join))
def test_chunks_never_cross_a_space_before_a_non_space(text: str) -> None:
    split = regex.compile(GPT2_SPLIT_PATTERN)
    first, *words = SPACE_BEFORE_WORD.split(text)
    by_words = split_chunks(first, split)
    for word in words:
        by_words += split_chunks(" " + word, split)
    assert by_words == split_chunks(text, split)


BOUNDARY_WORDS = [*BOUNDARY_CHARACTERS, " the", " thee", EOT]


@pytest.fixture(scope="module")
def boundary_bpe() -> BPETokenizer:
    """A tokenizer with merges for runs of whitespace, so a wrong cut changes the ids."""
    text = "".join(random.Random(0).choices(BOUNDARY_WORDS, k=5000))
    return BPETokenizer.train(text, 400, pattern=GPT2_SPLIT_PATTERN, special_tokens=[EOT])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(BOUNDARY_WORDS), max_size=30).map("".join))
def test_encoding_by_words_gives_the_ids_of_encoding_by_chunks(
    boundary_bpe: BPETokenizer, text: str
) -> None:
    assert boundary_bpe._word_cache is not None  # GPT-2's pattern: encode_ordinary goes by words
    by_chunks = boundary_bpe._encode_chunks(split_chunks(text, boundary_bpe._split))
    assert boundary_bpe.encode_ordinary(text) == by_chunks
    assert boundary_bpe.decode(by_chunks) == text


def test_encode_ordinary_reads_special_tokens_as_text(small_bpe: BPETokenizer) -> None:
    text = f"Farewell.{EOT} ROMEO:"
    ordinary = small_bpe.encode_ordinary(text)
    assert small_bpe.special_tokens[EOT] not in ordinary
    assert small_bpe.decode(ordinary) == text
    assert ordinary != small_bpe.encode(text)
    with pytest.raises(TypeError, match="text: expected a str, got bytes"):
        small_bpe.encode_ordinary(b"ROMEO")


def test_constructors_build_the_class_they_are_called_on(hf_regex, tmp_path) -> None:
    class Subclass(BPETokenizer):
        pass

    trained = Subclass.train("hello hello", 260)
    trained.save(tmp_path / "bpe.json")
    built = [
        trained,
        Subclass.load(tmp_path / "bpe.json"),
        Subclass.from_huggingface(hf_regex),
        Subclass.from_gpt2_files(*_gpt2_files(hf_regex, tmp_path)),
    ]
    assert all(type(tokenizer) is Subclass for tokenizer in built)


def test_pattern_that_matches_nothing_keeps_the_text() -> None:
    tokenizer = BPETokenizer.train("aaa bbb aaa", 260, pattern=r"a+")
    assert tokenizer.decode(tokenizer.encode("aaa bbb!")) == "aaa bbb!"
    assert tokenizer.merges  # merges are still learned inside the kept chunks


def test_bad_patterns_and_special_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pattern: expected a valid regular expression, got '\(a"):
        BPETokenizer.train("hello", 260, pattern="(a")
    with pytest.raises(TypeError, match="pattern: expected a regular expression str .* got bytes"):
        BPETokenizer.train("hello", 260, pattern=rb"\w+")
    expected = r"special_tokens: expected an iterable of strings, not one str, got '<eos>'"
    with pytest.raises(TypeError, match=expected):
        BPETokenizer.train("hello", 260, special_tokens="<eos>")
    with pytest.raises(TypeError, match="special_tokens: expected an iterable of strings"):
        BPETokenizer.train("hello", 260, special_tokens=5)


def test_lone_surrogate_in_training_text_names_text() -> None:
    with pytest.raises(ValueError, match=r"text: expected a string UTF-8 .*'\\udc80' at index 1"):
        BPETokenizer.train("a\udc80b", 260)


def test_decode_accepts_numpy_and_tensor_integers(small_bpe: BPETokenizer) -> None:
    ids = small_bpe.encode("To be, or not")
    numpy_ints = [np.int64(i) for i in ids]
    for given_ids in (np.array(ids), np.array(ids, np.int32), numpy_ints, torch.tensor(ids)):
        assert small_bpe.decode(given_ids) == "To be, or not"
    chars = CharTokenizer("abc")
    assert chars.decode(np.array([2, 0])) == "ca"
    for bad in (True, np.True_, torch.tensor(True), np.float64(1.0)):
        with pytest.raises(ValueError, match="ids: expected token ids in the vocabulary .* 0"):
            small_bpe.decode([bad])
