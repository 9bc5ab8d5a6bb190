"""Checkers for Chapter 1's workbook: pair counting, merging, training, encoding and decoding."""

from __future__ import annotations

from collections.abc import Callable

import regex

from transformer_course.checks import CheckFailure, call, expect, passed
from transformer_course.tokenization import (
    GPT2_SPLIT_PATTERN,
    BPETokenizer,
    encode_chunk,
    get_pair_counts,
    merge_pair,
    split_chunks,
    train_merges,
)

__all__ = [
    "check_bpe_encode",
    "check_decode_ids",
    "check_encode_chunk",
    "check_get_pair_counts",
    "check_merge_pair",
    "check_train_merges",
]

OVERLAP_HINT = (
    "are you merging overlapping pairs? In [a, a, a] the pair (a, a) can merge only once, "
    "giving [X, a]: after a merge, move past both ids of the pair."
)

SAMPLE = """First Citizen:
Before we proceed any further, hear me speak.
All: Speak, speak. You are all resolved rather to die than to famish?
Resolved. resolved. First, you know Caius Marcius is chief enemy to the people.
We know't, we know't. Let us kill him, and we'll have corn at our own price.
Is't a verdict? No more talking on't; let it be done: away, away! 1234 1234
Café naïve 日本語 日本 🙂🙂 aaaaaaa
"""


def _chunk_counts(text: str) -> dict[bytes, int]:
    counts: dict[bytes, int] = {}
    for chunk in regex.findall(GPT2_SPLIT_PATTERN, text):
        counts[chunk.encode()] = counts.get(chunk.encode(), 0) + 1
    return counts


def check_get_pair_counts(fn: Callable) -> None:
    """`get_pair_counts(ids, counts=None, weight=1)` counts neighbouring pairs."""
    name = "get_pair_counts"
    for ids in ([1, 2, 3, 1, 2], [], [7], [5, 5, 5], list(b"hello, hello")):
        actual = call(name, fn, ids)
        expect(isinstance(actual, dict), name, f"expected a dict, got {type(actual).__name__}.")
        expected = get_pair_counts(ids)
        expect(
            dict(actual) == expected,
            name,
            f"for ids={ids} expected {expected}, got {dict(actual)}.",
            "pair each id with the next one: zip(ids, ids[1:]). Overlapping pairs all count here.",
        )
    counts = {(1, 2): 1}
    actual = call(name, fn, [1, 2, 1, 2], counts, 3)
    expect(
        actual is counts and dict(actual) == {(1, 2): 7, (2, 1): 3},
        name,
        f"with counts={{(1, 2): 1}} and weight=3 expected the same dict updated to {{(1, 2): 7, (2, 1): 3}}, "
        f"got {dict(actual) if isinstance(actual, dict) else actual!r}"
        + ("" if actual is counts else " (a new dict)") + ".",
        "add `weight` per occurrence to the `counts` you were given (a chunk seen 3 times counts 3 times).",
    )
    passed(name)


def check_merge_pair(fn: Callable) -> None:
    """`merge_pair(ids, pair, new_id)` replaces non-overlapping occurrences, left to right."""
    name = "merge_pair"
    cases = [
        ([1, 2, 3, 1, 2], (1, 2), 9, ""),
        ([], (1, 2), 9, ""),
        ([1], (1, 2), 9, "a single id has no pair to merge."),
        ([3, 1, 2], (1, 2), 9, "don't forget a pair that ends the list."),
        ([2, 1, 2, 1], (1, 2), 9, "merge only the pair in its order: (1, 2) is not (2, 1)."),
        ([5, 5, 5], (5, 5), 9, OVERLAP_HINT),
        ([5, 5, 5, 5], (5, 5), 9, OVERLAP_HINT),
        ([5, 5, 5, 5, 5], (5, 5), 9, OVERLAP_HINT),
    ]
    for ids, pair, new_id, hint in cases:
        before = list(ids)
        actual = call(name, fn, ids, pair, new_id)
        expected = merge_pair(ids, pair, new_id)
        expect(ids == before, name, "it changed the `ids` list it was given.", "build and return a new list.")
        expect(
            isinstance(actual, list) and actual == expected,
            name,
            f"merging {pair} -> {new_id} in {ids} should give {expected}, got {actual!r}.",
            hint or "walk left to right; where ids[i], ids[i + 1] equal the pair, emit new_id and skip both.",
        )
    passed(name)


def check_train_merges(fn: Callable) -> None:
    """`train_merges(chunk_counts, num_merges)`: every step must merge a most frequent pair.

    Ties may be broken either way, so the learner's merges are replayed: at each step the
    chosen pair must have the highest count over the (weighted) chunks merged so far.
    """
    name = "train_merges"
    corpora = {
        "the chunk b'aaabdaaabac'": ({b"aaabdaaabac": 1}, 3),
        "a small Shakespeare sample (with chunk counts)": (_chunk_counts(SAMPLE * 3 + "the the the "), 40),
    }
    for label, (chunk_counts, num_merges) in corpora.items():
        merges = call(name, fn, dict(chunk_counts), num_merges)
        expect(isinstance(merges, dict), name, f"expected a dict {{pair: new_id}}, got {type(merges).__name__}.")
        expect(
            len(merges) == num_merges,
            name,
            f"on {label} asked for {num_merges} merges, got {len(merges)}.",
            "loop until you have num_merges merges.",
        )
        chunks = {tuple(chunk): weight for chunk, weight in chunk_counts.items()}
        for step, (pair, new_id) in enumerate(merges.items()):
            expect(
                new_id == 256 + step,
                name,
                f"merge {step} should create id {256 + step}, got {new_id}.",
                "new ids count up from 256, one per merge.",
            )
            counts: dict = {}
            for chunk, weight in chunks.items():
                get_pair_counts(chunk, counts, weight)
            best = max(counts.values())
            if counts.get(pair, 0) != best:
                unweighted: dict = {}
                for chunk in chunks:
                    get_pair_counts(chunk, unweighted)
                hint = (
                    "weight each chunk's pairs by how often the chunk occurs."
                    if unweighted.get(pair, 0) == max(unweighted.values())
                    else OVERLAP_HINT + " Also recount (or update) the pair counts after every merge."
                )
                raise CheckFailure(
                    f"`{name}`: on {label}, merge {step} chose {pair} (count {counts.get(pair, 0)}), "
                    f"but the most frequent pair then occurs {best} times.\nHint: {hint}"
                )
            merged: dict = {}
            for chunk, weight in chunks.items():
                new_chunk = tuple(merge_pair(list(chunk), pair, new_id))
                merged[new_chunk] = merged.get(new_chunk, 0) + weight
            chunks = merged
    passed(name)


def check_encode_chunk(fn: Callable) -> None:
    """`encode_chunk(ids, merges, ranks)` applies merges lowest rank first."""
    name = "encode_chunk"
    in_order = {(98, 99): 256, (97, 98): 257}  # (b, c) learned before (a, b)
    cases = [
        ([97, 98, 99], in_order, "apply the merge learned first (lowest rank), not the pair that comes first in the text."),
        ([97, 98, 97, 98], in_order, ""),
        ([], in_order, ""),
        ([97], in_order, ""),
        ([97, 97, 97], {(97, 97): 256}, OVERLAP_HINT),
        ([97, 97, 97, 97], {(97, 97): 256, (256, 256): 257}, OVERLAP_HINT),
        ([97, 97, 98], {(97, 97): 256, (256, 98): 257, (97, 98): 258}, "keep merging: a new token can merge again."),
    ]
    sample_merges = train_merges(_chunk_counts(SAMPLE), 60)
    for chunk in regex.findall(GPT2_SPLIT_PATTERN, SAMPLE)[:40] + [SAMPLE.replace(" ", "")]:
        cases.append((list(chunk.encode()), sample_merges, ""))
    for ids, merges, hint in cases:
        ranks = {pair: rank for rank, pair in enumerate(merges)}
        actual = call(name, fn, list(ids), dict(merges), ranks)
        expected = encode_chunk(ids, merges, ranks)
        expect(
            isinstance(actual, list) and actual == expected,
            name,
            f"for ids={ids[:20]}{'...' if len(ids) > 20 else ''} expected {expected[:20]}, got {actual!r:.200}.",
            hint or "repeatedly find the pair with the lowest rank, merge it (left to right), stop when none has a rank.",
        )
    passed(name)


def check_decode_ids(fn: Callable) -> None:
    """`decode_ids(ids, vocab)` joins bytes before decoding, so split characters survive."""
    name = "decode_ids"
    vocab = {b: bytes([b]) for b in range(256)}
    vocab.update({256: b"caf\xc3", 257: b"\xa9!", 258: "日本".encode()})
    split_hint = (
        "a character's bytes can be split across tokens ('é' is C3 A9): join all the tokens' bytes "
        "with b''.join(...) and decode once at the end, not token by token."
    )
    cases = [
        ([104, 105], "hi", ""),
        ([], "", ""),
        ([258, 33], "日本!", ""),
        ([256, 257], "café!", split_hint),
        ([0xE6, 0x97, 0xA5], "日", split_hint),
        ([0xFF, 104], "\ufffdh", "ids may spell invalid UTF-8: decode with errors='replace'."),
    ]
    for ids, expected, hint in cases:
        try:
            actual = call(name, fn, ids, vocab)
        except CheckFailure as failure:
            if isinstance(failure.__cause__, UnicodeDecodeError):
                raise CheckFailure(f"{failure}\nHint: {hint}") from None
            raise
        expect(
            actual == expected,
            name,
            f"ids {ids} should decode to {expected!r}, got {actual!r}.",
            hint or "look up each id's bytes in vocab, join them, decode as UTF-8.",
        )
    passed(name)


BPE_TEXTS = (
    "Hello world! Hello, worlds.",
    "the end<|endoftext|>The start<|endoftext|><|endoftext|>",
    "  spaces   and\nnew lines\n\n",
    "café, naïve, 日本語, emoji 🙂",
    "",
)


def _encode_without(tokenizer: BPETokenizer, text: str, *, specials: bool = True, pre_split: bool = True) -> list[int]:
    """The reference's encoding with one of its two splits left out: what those bugs produce."""
    pieces = tokenizer._special_split.split(text) if specials else [text]
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            ids.append(tokenizer.special_tokens[piece])
            continue
        for chunk in split_chunks(piece, tokenizer._split) if pre_split else [piece] if piece else []:
            ids += encode_chunk([tokenizer.byte_ids[b] for b in chunk.encode("utf-8")], tokenizer.merges, tokenizer.ranks)
    return ids


def check_bpe_encode(cls: type) -> None:
    """`cls(vocab, merges, pattern=, special_tokens=).encode(text)`: special tokens whole, the
    pre-split, then the merges within each chunk; ids identical to the reference's."""
    name = "BPETokenizer.encode"
    # Runs of spaces teach the merge "  ", which the pre-split keeps from joining " spaces".
    text = "Hello world, hello worlds. The end<|endoftext|>The start. café naïve 日本語 a  b   c\n" * 20
    for pattern in (GPT2_SPLIT_PATTERN, None):
        reference = BPETokenizer.train(text, 300, pattern=pattern, special_tokens=["<|endoftext|>"])
        theirs = call(f"{name} (building the tokenizer)", cls, reference.vocab, reference.merges,
                      pattern=pattern, special_tokens=reference.special_tokens)
        for sample in BPE_TEXTS:
            where = f"{name}({sample!r}), pattern={'GPT-2' if pattern else 'None'}"
            actual = call(name, theirs.encode, sample)
            expected = reference.encode(sample)
            if actual == expected:
                continue
            expect(isinstance(actual, list) and all(isinstance(i, int) for i in actual), where,
                   f"expected a list of int ids, got {actual!r:.80}.")
            hint = "split out special tokens first, pre-split the rest, merge each chunk with encode_chunk."
            if actual == _encode_without(reference, sample, specials=False):
                hint = ("special tokens are cut out of the text first (self._special_split.split puts them "
                        "at the odd positions) and each becomes its one id, never merged bytes.")
            elif pattern and actual == _encode_without(reference, sample, pre_split=False):
                hint = ("merges must not cross the pre-split: encode each chunk of "
                        "split_chunks(piece, self._split) on its own.")
            expect(False, where, f"expected {expected}, got {actual}.", hint)
            expect(theirs.decode(actual) == sample, where, "decode(encode(text)) is not the text.")
    passed(name)
