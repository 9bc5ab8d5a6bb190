"""Checkers for Chapter 1's workbook: the character tokenizer, then BPE's pair counting, merging,
training, encoding and decoding, and the whole encoder with its pre-split and special tokens."""

from __future__ import annotations

from collections.abc import Callable

import regex

from transformer_course.checks import CheckFailure, call, expect, passed
from transformer_course.tokenization import (
    GPT2_SPLIT_PATTERN,
    BPETokenizer,
    CharTokenizer,
    encode_chunk,
    get_pair_counts,
    merge_pair,
    split_chunks,
    train_merges,
)

__all__ = [
    "check_bpe_encode",
    "check_char_tokenizer",
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


def _relabelled(actual: list[int], expected: list[int]) -> bool:
    """Whether `actual` is `expected` with the ids renamed one to one."""
    return len(set(zip(actual, expected))) == len(set(actual)) == len(set(expected))


CHAR_TEXTS = ("hello", "To be, or not to be", "ba", "日本語 café\n\t!")


def check_char_tokenizer(cls: type) -> None:
    """`cls(text)`: ids 0.. for the sorted distinct characters, `encode`, `decode`, `vocab_size`."""
    name = "CharTokenizer"
    for text in CHAR_TEXTS:
        reference = CharTokenizer(text)
        theirs = call(f"{name}({text!r})", cls, text)
        size = call(f"{name}.vocab_size", getattr, theirs, "vocab_size")
        expect(
            size == reference.vocab_size,
            f"{name}({text!r}).vocab_size",
            f"expected {reference.vocab_size} (one per distinct character), got {size!r}.",
            "self.vocab maps each id to its character, once per distinct character "
            "(vocab_size counts it).",
        )
        query = text[::-1]
        actual, expected = call(f"{name}.encode", theirs.encode, query), reference.encode(query)
        hint = "number the distinct characters 0, 1, ... in sorted order."
        ints = isinstance(actual, list) and all(isinstance(i, int) for i in actual)
        if ints and [i - 1 for i in actual] == expected:
            hint = "ids start at 0."
        elif ints and len(actual) == len(expected) and _relabelled(actual, expected):
            hint = "sort the characters: a set's order changes from run to run, the ids must not."
        expect(
            actual == expected,
            f"{name}({text!r}).encode({query!r})",
            f"expected {expected}, got {actual!r}.",
            hint,
        )
        decoded = call(f"{name}.decode", theirs.decode, expected)
        expect(
            decoded == query,
            f"{name}({text!r}).decode({expected})",
            f"expected {query!r}, got {decoded!r}.",
            "look each id up in self.vocab and join the characters into one str.",
        )
    try:
        ids = cls("abc").encode("abz")
    except Exception:  # any error is right: the character has no id
        ids = None
    expect(
        ids is None,
        f"{name}('abc').encode('abz')",
        f"expected an error ('z' has no id), got {ids!r}.",
        "a character the tokenizer never saw cannot be encoded: raise, don't skip it.",
    )
    passed(name)


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
        "with counts={(1, 2): 1} and weight=3 expected the same dict updated to "
        f"{{(1, 2): 7, (2, 1): 3}}, "
        f"got {dict(actual) if isinstance(actual, dict) else actual!r}"
        + ("" if actual is counts else " (a new dict)")
        + ".",
        "add `weight` per occurrence to the `counts` you were given "
        "(a chunk seen 3 times counts 3 times).",
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
        expect(
            ids == before,
            name,
            "it changed the `ids` list it was given.",
            "build and return a new list.",
        )
        expect(
            isinstance(actual, list) and actual == expected,
            name,
            f"merging {pair} -> {new_id} in {ids} should give {expected}, got {actual!r}.",
            hint
            or "walk left to right; where ids[i], ids[i + 1] equal the pair, emit new_id and skip "
            "both.",
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
        "a small Shakespeare sample (with chunk counts)": (
            _chunk_counts(SAMPLE * 3 + "the the the "),
            40,
        ),
    }
    for label, (chunk_counts, num_merges) in corpora.items():
        merges = call(name, fn, dict(chunk_counts), num_merges)
        expect(
            isinstance(merges, dict),
            name,
            f"expected a dict {{pair: new_id}}, got {type(merges).__name__}.",
        )
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
                    else OVERLAP_HINT
                    + " Also recount (or update) the pair counts after every merge."
                )
                raise CheckFailure(
                    f"`{name}`: on {label}, merge {step} chose {pair} "
                    f"(count {counts.get(pair, 0)}), "
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
        (
            [97, 98, 99],
            in_order,
            "apply the merge learned first (lowest rank), not the pair that comes first in the "
            "text.",
        ),
        ([97, 98, 97, 98], in_order, ""),
        ([], in_order, ""),
        ([97], in_order, ""),
        ([97, 97, 97], {(97, 97): 256}, OVERLAP_HINT),
        ([97, 97, 97, 97], {(97, 97): 256, (256, 256): 257}, OVERLAP_HINT),
        (
            [97, 97, 98],
            {(97, 97): 256, (256, 98): 257, (97, 98): 258},
            "keep merging: a new token can merge again.",
        ),
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
            f"for ids={ids[:20]}{'...' if len(ids) > 20 else ''} expected {expected[:20]}, "
            f"got {actual!r:.200}.",
            hint
            or "repeatedly find the pair with the lowest rank, merge it (left to right), stop when "
            "none has a rank.",
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
# Runs of spaces teach the merge "  ", which the pre-split keeps from joining " spaces".
BPE_TRAINING = (
    "Hello world, hello worlds. The end<|endoftext|>The start. café naïve 日本語 a  b   c\n"
)


def _is_id(i: object, vocab: dict[int, bytes]) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and i in vocab


def _rank_order_samples(tokenizer: BPETokenizer, limit: int = 3) -> list[str]:
    """Texts of three bytes a, b, c that are one chunk, where (b, c) was learned before (a, b):
    merged in rank order they start a + bc, merged in the order of the text ab + c."""
    byte_merges = [(pair, rank) for pair, rank in tokenizer.ranks.items() if max(pair) < 256]
    samples = []
    for (a, b), late in byte_merges:
        for (middle, c), early in byte_merges:
            try:
                text = bytes([a, b, c]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if middle == b and early < late and _units(tokenizer, text) == [text]:
                samples.append(text)
    return samples[:limit]


def _units(tokenizer: BPETokenizer, text: str) -> list[str]:
    """The pieces the reference merges within: each special token, and each chunk of the rest."""
    units = []
    pieces = tokenizer._special_split.split(text) if tokenizer._special_split else [text]
    for k, piece in enumerate(pieces):
        units += [piece] if k % 2 else split_chunks(piece, tokenizer._split)
    return units


def _ends(pieces: list[bytes]) -> set[int]:
    """The byte offsets at which the pieces end."""
    ends, end = set(), 0
    for piece in pieces:
        end += len(piece)
        ends.add(end)
    return ends


def _bpe_encode_hint(tokenizer: BPETokenizer, text: str, actual: list[int]) -> str:
    """Which family of mistake `actual` (valid ids that decode to `text`) belongs to."""
    specials = tokenizer.special_tokens
    expected_specials = sum(text.count(token) for token in specials)
    if sum(i in specials.values() for i in actual) < expected_specials:
        return (
            "special tokens are cut out of the text first (self._special_split.split puts them "
            "at the odd positions) and each becomes its one id, never merged bytes."
        )
    units = _units(tokenizer, text)
    crossing = _ends([unit.encode() for unit in units]) - _ends(
        [tokenizer.vocab[i] for i in actual]
    )
    if crossing:
        return (
            "a token crosses the pre-split: merges must stay inside the chunks of "
            "split_chunks(piece, self._split); encode each chunk on its own."
        )
    return (
        "the chunks are right but their merges are not: within each chunk, merge the pair with "
        "the lowest rank (self.ranks) first, as encode_chunk does."
    )


def check_bpe_encode(cls: type) -> None:
    """`cls(vocab, merges, pattern=, special_tokens=).encode(text)`: special tokens whole, the
    pre-split, then the merges within each chunk; ids identical to the reference's."""
    name = "BPETokenizer.encode"
    for pattern in (GPT2_SPLIT_PATTERN, None):
        reference = BPETokenizer.train(
            BPE_TRAINING * 20, 300, pattern=pattern, special_tokens=["<|endoftext|>"]
        )
        theirs = call(
            f"{name} (building the tokenizer)",
            cls,
            reference.vocab,
            reference.merges,
            pattern=pattern,
            special_tokens=reference.special_tokens,
        )
        for sample in BPE_TEXTS + tuple(_rank_order_samples(reference)):
            where = f"{name}({sample!r}), pattern={'GPT-2' if pattern else 'None'}"
            actual = call(name, theirs.encode, sample)
            expected = reference.encode(sample)
            if actual == expected:
                continue
            expect(
                isinstance(actual, list) and all(_is_id(i, reference.vocab) for i in actual),
                where,
                f"expected a list of int ids below {reference.vocab_size}, got {actual!r:.80}.",
            )
            expect(
                reference.decode(actual) == sample,
                where,
                f"decode(encode(text)) is {reference.decode(actual)!r}, not the text.",
                "every character must be encoded once: each special token as its id, and every "
                "chunk of the text between them (split_chunks keeps what the pattern skips).",
            )
            hint = _bpe_encode_hint(reference, sample, actual)
            expect(False, where, f"expected {expected}, got {actual}.", hint)
    passed(name)
