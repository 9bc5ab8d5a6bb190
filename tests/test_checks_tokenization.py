"""The Chapter 1 checkers: the reference passes, blanks fail, classic bugs get targeted hints."""

from __future__ import annotations

from collections import defaultdict

import pytest
import regex

from transformer_course import tokenization
from transformer_course.checks.harness import CheckFailure
from transformer_course.checks.tokenization import (
    BPE_TRAINING,
    _rank_order_samples,
    check_bpe_encode,
    check_char_tokenizer,
    check_decode_ids,
    check_encode_chunk,
    check_get_pair_counts,
    check_merge_pair,
    check_train_merges,
)
from transformer_course.tokenization import (
    GPT2_SPLIT_PATTERN,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    encode_chunk,
    split_chunks,
)

CHECKS = {
    check_get_pair_counts: tokenization.get_pair_counts,
    check_merge_pair: tokenization.merge_pair,
    check_train_merges: tokenization.train_merges,
    check_encode_chunk: tokenization.encode_chunk,
    check_decode_ids: tokenization.decode_ids,
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_reference_passes(check, capsys) -> None:
    check(CHECKS[check])
    assert "passes every check" in capsys.readouterr().out


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_blank_fails_with_hint(check) -> None:
    def blank(*args, **kwargs):
        raise NotImplementedError("Walk left to right.")

    with pytest.raises(CheckFailure, match="not implemented yet.*Walk left to right"):
        check(blank)


def fails_with(check, fn, word: str) -> None:
    with pytest.raises(CheckFailure) as info:
        check(fn)
    assert word in str(info.value), str(info.value)


# --- buggy variants ---------------------------------------------------------------------------


def merge_overlapping(ids, pair, new_id):
    """Bug: after a match, steps one id instead of two, so (a, a) merges twice in "aaa"."""
    out, i = [], 0
    while i < len(ids):
        if tuple(ids[i : i + 2]) == pair:
            out.append(new_id)
        elif i == 0 or tuple(ids[i - 1 : i + 1]) != pair:
            out.append(ids[i])
        i += 1
    return out


def test_merge_pair_overlapping_is_caught() -> None:
    assert merge_overlapping([97, 97, 97], (97, 97), 256) == [256, 256]  # the bug, shown
    fails_with(check_merge_pair, merge_overlapping, "overlapping")


def test_merge_pair_other_correct_variant_passes() -> None:
    def stops_early(ids, pair, new_id):
        out, i = [], 0
        while i < len(ids) - 1:
            if (ids[i], ids[i + 1]) == pair:
                out.append(new_id)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        return out + list(ids[i:])

    check_merge_pair(stops_early)  # a correct variant written differently must pass


def test_pair_counts_ignoring_weight_is_caught() -> None:
    def unweighted(ids, counts=None, weight=1):
        counts = {} if counts is None else counts
        for pair in zip(ids, ids[1:]):
            counts[pair] = counts.get(pair, 0) + 1
        return counts

    fails_with(check_get_pair_counts, unweighted, "weight")


def test_pair_counts_skipping_overlaps_is_caught() -> None:
    def skips_overlaps(ids, counts=None, weight=1):
        counts = {} if counts is None else counts
        i = 0
        while i < len(ids) - 1:
            pair = (ids[i], ids[i + 1])
            counts[pair] = counts.get(pair, 0) + weight
            i += 2 if ids[i] == ids[i + 1] else 1
        return counts

    fails_with(check_get_pair_counts, skips_overlaps, "Overlapping pairs all count")


def naive_train(
    chunk_counts, num_merges, *, merge=tokenization.merge_pair, weighted=True, stops=True
):
    chunks = {tuple(c): w for c, w in chunk_counts.items()}
    merges = {}
    for step in range(num_merges):
        counts = {}
        for chunk, weight in chunks.items():
            tokenization.get_pair_counts(chunk, counts, weight if weighted else 1)
        if not counts and stops:
            break
        pair = max(counts, key=counts.get)
        merges[pair] = 256 + step
        chunks = {tuple(merge(list(c), pair, 256 + step)): w for c, w in chunks.items()}
    return merges


def test_train_merges_naive_but_correct_passes() -> None:
    check_train_merges(naive_train)  # ties broken differently from the reference are fine


def test_train_merges_with_the_largest_pair_on_a_tie_passes() -> None:
    def largest_on_tie(chunk_counts, num_merges):
        chunks, merges = [list(c) for c in chunk_counts], {}
        weights = list(chunk_counts.values())
        while len(merges) < num_merges:
            counts = {}
            for chunk, weight in zip(chunks, weights):
                tokenization.get_pair_counts(chunk, counts, weight)
            if not counts:
                return merges
            pair = max(counts, key=lambda p: (counts[p], p))  # the reference takes the smallest
            merges[pair] = 256 + len(merges)
            chunks = [tokenization.merge_pair(c, pair, merges[pair]) for c in chunks]
        return merges

    check_train_merges(largest_on_tie)


def test_train_merges_that_crashes_when_no_pair_is_left_is_caught() -> None:
    fails_with(
        check_train_merges, lambda c, n: naive_train(c, n, stops=False), "no chunk has a pair left"
    )


def test_train_merges_that_merges_pairs_no_longer_present_is_caught() -> None:
    def keeps_going(chunk_counts, num_merges):
        """Bug: counts kept up to date, but a pair whose count fell to 0 stays a candidate."""
        chunks, counts, merges = [list(c) for c in chunk_counts], {}, {}
        for chunk, weight in zip(chunks, chunk_counts.values()):
            tokenization.get_pair_counts(chunk, counts, weight)
        while len(merges) < num_merges:
            pair = max(counts, key=counts.get)
            merges[pair] = 256 + len(merges)
            for index, (chunk, weight) in enumerate(zip(chunks, chunk_counts.values())):
                tokenization.get_pair_counts(chunk, counts, -weight)
                chunks[index] = tokenization.merge_pair(chunk, pair, merges[pair])
                tokenization.get_pair_counts(chunks[index], counts, weight)
            del counts[pair]
        return merges

    fails_with(check_train_merges, keeps_going, "a pair whose count fell to 0")


def test_train_merges_that_stops_at_pairs_seen_once_is_caught() -> None:
    def min_frequency_two(chunk_counts, num_merges):
        merges = tokenization.train_merges(chunk_counts, num_merges)
        chunks = [list(c) for c in chunk_counts]
        for index, (pair, new_id) in enumerate(merges.items()):
            counts = {}
            for chunk, weight in zip(chunks, chunk_counts.values()):
                tokenization.get_pair_counts(chunk, counts, weight)
            if counts[pair] < 2:
                return dict(list(merges.items())[:index])
            chunks = [tokenization.merge_pair(c, pair, new_id) for c in chunks]
        return merges

    fails_with(check_train_merges, min_frequency_two, "a pair that occurs once")


def test_pair_counts_crash_on_filled_counts_names_the_call_and_a_hint() -> None:
    def defaultdict_only_when_none(ids, counts=None, weight=1):
        counts = defaultdict(int) if counts is None else counts
        for pair in zip(ids, ids[1:]):
            counts[pair] += weight  # a KeyError in a plain dict without the pair
        return counts

    with pytest.raises(CheckFailure) as info:
        check_get_pair_counts(defaultdict_only_when_none)
    message = str(info.value)
    assert "counts={(1, 2): 1}, weight=3)` raised KeyError" in message, message
    assert "may already hold pairs" in message, message


def test_messages_never_cut_an_argument_in_the_middle() -> None:
    with pytest.raises(CheckFailure) as info:
        check_decode_ids(lambda ids, vocab: "".join(vocab[i].decode("latin-1") for i in ids))
    call = str(info.value).splitlines()[0]
    assert "...} (259 entries)" in call and "b'\\x0" not in call.split("...}")[0][-4:], call


def test_train_merges_overlapping_merge_is_caught() -> None:
    fails_with(
        check_train_merges, lambda c, n: naive_train(c, n, merge=merge_overlapping), "overlapping"
    )


def test_train_merges_ignoring_chunk_counts_is_caught() -> None:
    fails_with(
        check_train_merges,
        lambda c, n: naive_train(c, n, weighted=False),
        "how often the chunk occurs",
    )


def test_train_merges_ids_not_from_256_is_caught() -> None:
    def from_zero(chunk_counts, num_merges):
        return {
            pair: i - 256 for pair, i in tokenization.train_merges(chunk_counts, num_merges).items()
        }

    fails_with(check_train_merges, from_zero, "256")


def test_encode_in_text_order_is_caught() -> None:
    def text_order(ids, merges, ranks):
        ids = list(ids)
        while True:
            pairs = [p for p in zip(ids, ids[1:]) if p in merges]
            if not pairs:
                return ids
            ids = tokenization.merge_pair(ids, pairs[0], merges[pairs[0]])

    fails_with(check_encode_chunk, text_order, "lowest rank")


def test_encode_overlapping_is_caught() -> None:
    def overlapping(ids, merges, ranks):
        ids = list(ids)
        while len(ids) > 1:
            pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            ids = merge_overlapping(ids, pair, merges[pair])
        return ids

    fails_with(check_encode_chunk, overlapping, "overlapping")


def test_encode_minbpe_loop_passes() -> None:
    def minbpe(ids, merges, ranks):
        ids = list(ids)
        while len(ids) > 1:
            pair = min(zip(ids, ids[1:]), key=lambda p: ranks.get(p, float("inf")))
            if pair not in ranks:
                break
            ids = tokenization.merge_pair(ids, pair, merges[pair])
        return ids

    check_encode_chunk(minbpe)


@pytest.mark.parametrize("errors", ["strict", "replace"])
def test_decode_token_by_token_is_caught(errors: str) -> None:
    def token_by_token(ids, vocab):
        return "".join(vocab[i].decode("utf-8", errors=errors) for i in ids)

    fails_with(check_decode_ids, token_by_token, "join all the tokens' bytes")


def test_decode_strict_is_caught() -> None:
    def strict(ids, vocab):
        return b"".join(vocab[i] for i in ids).decode("utf-8")

    fails_with(check_decode_ids, strict, "errors='replace'")


# ---- BPETokenizer.encode ----------------------------------------------------------------------


def _bpe_with(encode):
    return type("LearnerBPE", (BPETokenizer,), {"encode": encode})


def _byte_ids(self, chunk: str) -> list[int]:
    return [self.byte_ids[b] for b in chunk.encode("utf-8")]


def _chunk_ids(self, chunk: str) -> list[int]:
    return encode_chunk(_byte_ids(self, chunk), self.merges, self.ranks)


def _pieces(self, text: str) -> list[str]:
    """Special tokens cut out: text at the even positions, special tokens at the odd ones."""
    return self._special_split.split(text) if self._special_split else [text]


def _encode_with(self, text: str, encode_piece) -> list[int]:
    ids = []
    for k, piece in enumerate(_pieces(self, text)):
        ids += [self.special_tokens[piece]] if k % 2 else encode_piece(self, piece)
    return ids


def test_bpe_encode_reference_passes(capsys):
    check_bpe_encode(BPETokenizer)
    assert "passes every check" in capsys.readouterr().out


def test_bpe_encode_blank_fails_naming_the_exercise():
    def blank(self, text):
        raise NotImplementedError("Exercise 1.7: write BPETokenizer.encode")

    with pytest.raises(CheckFailure, match="not implemented yet.*Exercise 1.7"):
        check_bpe_encode(_bpe_with(blank))


def test_bpe_encode_that_ignores_special_tokens_is_caught():
    def no_specials(self, text):
        return [i for chunk in split_chunks(text, self._split) for i in _chunk_ids(self, chunk)]

    with pytest.raises(CheckFailure, match="special tokens are cut out"):
        check_bpe_encode(_bpe_with(no_specials))


def test_bpe_encode_that_merges_across_the_pre_split_is_caught():
    def no_pre_split(self, text):
        return _encode_with(
            self, text, lambda self, piece: _chunk_ids(self, piece) if piece else []
        )

    with pytest.raises(CheckFailure, match="crosses the pre-split"):
        check_bpe_encode(_bpe_with(no_pre_split))


def _merged_in_text_order(self, chunk: str) -> list[int]:
    """The bug: merge the first mergeable pair of the text, not the pair learned first."""
    ids = _byte_ids(self, chunk)
    while pairs := [p for p in zip(ids, ids[1:]) if p in self.merges]:
        ids = tokenization.merge_pair(ids, pairs[0], self.merges[pairs[0]])
    return ids


def test_bpe_encode_with_merges_in_text_order_is_caught():
    def text_order(self, text):
        return _encode_with(
            self,
            text,
            lambda self, piece: [
                i
                for chunk in split_chunks(piece, self._split)
                for i in _merged_in_text_order(self, chunk)
            ],
        )

    with pytest.raises(CheckFailure, match="lowest rank"):
        check_bpe_encode(_bpe_with(text_order))


def test_bpe_encode_that_drops_special_tokens_is_caught():
    def skips_specials(self, text):
        return [
            i
            for piece in _pieces(self, text)[::2]
            for i in self._encode_chunks(split_chunks(piece, self._split))
        ]

    with pytest.raises(CheckFailure, match="every character must be encoded once"):
        check_bpe_encode(_bpe_with(skips_specials))


def test_rank_order_samples_tell_the_orders_apart():
    """The checker's extra samples are where merging in text order gives other ids."""
    for pattern in (GPT2_SPLIT_PATTERN, None):
        reference = BPETokenizer.train(BPE_TRAINING * 20, 300, pattern=pattern)
        samples = _rank_order_samples(reference)
        assert samples
        for sample in samples:
            assert reference.encode(sample) != _merged_in_text_order(reference, sample)


def test_bpe_encode_valid_alternatives_pass():
    def by_hand(self, text):
        """Finds special tokens with str.find (longest first), splits with regex.findall, and
        replays the merges in training order over each chunk (minbpe's other loop)."""
        ids, start = [], 0
        specials = sorted(self.special_tokens, key=len, reverse=True)
        while start <= len(text):
            found = [(text.find(s, start), -len(s), s) for s in specials if s in text[start:]]
            at, _, special = min(found) if found else (len(text), 0, None)
            piece = text[start:at]
            chunks = regex.findall(self.pattern, piece) if self.pattern else [piece] * bool(piece)
            for chunk in chunks:
                chunk_ids = _byte_ids(self, chunk)
                for pair, new_id in self.merges.items():
                    chunk_ids = tokenization.merge_pair(chunk_ids, pair, new_id)
                ids += chunk_ids
            if special is None:
                return ids
            ids.append(self.special_tokens[special])
            start = at + len(special)
        return ids

    def without_cache(self, text):
        return _encode_with(
            self,
            text,
            lambda self, piece: [
                i for chunk in split_chunks(piece, self._split) for i in _chunk_ids(self, chunk)
            ],
        )

    check_bpe_encode(_bpe_with(by_hand))
    check_bpe_encode(_bpe_with(without_cache))


# ---- CharTokenizer -----------------------------------------------------------------------------


def _char_tokenizer(order=sorted, first_id=0, decode_join=True, on_unknown="raise"):
    """A CharTokenizer written with one of the classic mistakes (or none)."""

    class LearnerChars(Tokenizer):
        def __init__(self, text):
            self.vocab = {first_id + i: c for i, c in enumerate(order(set(text)))}
            self.ids = {c: i for i, c in self.vocab.items()}

        def encode(self, text):
            if on_unknown == "skip":
                return [self.ids[c] for c in text if c in self.ids]
            return [self.ids[c] for c in text]

        def decode(self, ids):
            chars = [self.vocab[i] for i in ids]
            return "".join(chars) if decode_join else chars

    return LearnerChars


def test_char_tokenizer_reference_and_a_written_variant_pass(capsys):
    class WithIndex(Tokenizer):
        def __init__(self, text):
            self.chars = sorted(set(text))
            self.vocab = dict(enumerate(self.chars))

        def encode(self, text):
            return [self.chars.index(c) for c in text]  # ValueError for unknown characters

        def decode(self, ids):
            return "".join(self.chars[i] for i in ids)

    check_char_tokenizer(CharTokenizer)
    check_char_tokenizer(WithIndex)
    check_char_tokenizer(_char_tokenizer())
    assert capsys.readouterr().out.count("passes every check") == 3


def test_char_tokenizer_blank_fails_naming_the_exercise():
    class Blank(Tokenizer):
        def __init__(self, text):
            raise NotImplementedError("Exercise 1.1: write CharTokenizer")

    with pytest.raises(CheckFailure, match="not implemented yet.*Exercise 1.1"):
        check_char_tokenizer(Blank)


@pytest.mark.parametrize(
    ("mistake", "hint"),
    [
        ({"order": lambda chars: sorted(chars, reverse=True)}, "sort the characters"),
        ({"order": list}, "sort the characters"),
        ({"first_id": 1}, "ids start at 0"),
        ({"decode_join": False}, "join the characters"),
        ({"on_unknown": "skip"}, "raise, don't skip"),
    ],
)
def test_char_tokenizer_mistakes_are_caught(mistake, hint):
    fails_with(check_char_tokenizer, _char_tokenizer(**mistake), hint)
