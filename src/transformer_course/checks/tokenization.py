"""Checkers for chapter 1's workbook (01_tokenization): the character tokenizer, BPE's pair
counting, merging, training, encoding and decoding, and the whole encoder (pre-split, specials)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import regex

from transformer_course import tokenization
from transformer_course.checks.harness import (
    call,
    describe,
    expect,
    expect_close,
    expect_raises,
    passed,
)
from transformer_course.tokenization import GPT2_SPLIT_PATTERN, BPETokenizer, merge_pair

OVERLAP_HINT = "are you merging overlapping pairs? In [a, a, a] the pair (a, a) can merge only "
OVERLAP_HINT += "once, giving [X, a]: after a merge, move past both ids of the pair."
SAMPLE = """First Citizen:
Before we proceed any further, hear me speak.
All: Speak, speak. You are all resolved rather to die than to famish?
Resolved. resolved. First, you know Caius Marcius is chief enemy to the people.
We know't, we know't. Let us kill him, and we'll have corn at our own price.
Is't a verdict? No more talking on't; let it be done: away, away! 1234 1234
Café naïve 日本語 日本 🙂🙂 aaaaaaa
"""
CHAR_TEXTS = ("hello", "To be, or not to be", "ba", "日本語 café\n\t!")
SORT_HINT = "sort the characters: a set's order changes from run to run, the ids must not."


def check_char_tokenizer(cls: type) -> None:
    """`cls(text)`: ids 0.. for the sorted distinct characters, `encode`, `decode`, `vocab_size`."""
    name = "CharTokenizer"
    for text in CHAR_TEXTS:
        reference, theirs = tokenization.CharTokenizer(text), call(name, cls, text)
        where, query = f"{name}({text!r})", text[::-1]
        size = call(f"{where}.vocab_size", getattr, theirs, "vocab_size")
        hint = "self.vocab maps each id to its character, once per distinct character."
        expect_close(size, reference.vocab_size, f"{where}.vocab_size", hint)
        actual, expected = call(f"{name}.encode", theirs.encode, query), reference.encode(query)
        relabelled = isinstance(actual, list) and len(actual) == len(expected)
        relabelled = relabelled and len(set(zip(actual, expected))) == len(set(actual))
        hint = SORT_HINT if relabelled else "number the distinct characters 0, 1, ... in order."
        mistakes = {"ids start at 0.": [i + 1 for i in expected]}
        expect_close(actual, expected, f"{where}.encode({query!r})", hint, mistakes=mistakes)
        decoded = call(f"{name}.decode", theirs.decode, expected)
        hint = "look each id up in self.vocab and join the characters into one str."
        expect_close(decoded, query, f"{where}.decode({expected})", hint)
    hint = "a character the tokenizer never saw cannot be encoded: raise, don't skip it."
    expect_raises(f"{name}('abc').encode('abz')", hint, cls("abc").encode, "abz")
    passed(name)


def _expect_cases(name: str, fn: Callable, cases, hint: str) -> None:
    """`fn(*args)` against the reference function `name`, args unchanged, per `(*args, hint)`."""
    reference = getattr(tokenization, name)
    for *args, case_hint in cases:
        where, given = f"{name}({', '.join(describe(a, 60) for a in args)})", copy.deepcopy(args)
        actual = call(where, fn, *given, hint=case_hint or hint)
        expect(given == args, where, "it changed an argument it was given.", "return a new list.")
        expect_close(actual, reference(*args), where, case_hint or hint)


def check_get_pair_counts(fn: Callable) -> None:
    """`get_pair_counts(ids, counts=None, weight=1)` counts neighbouring pairs."""
    name, cases = "get_pair_counts", [(ids, "") for ids in ([1, 2, 3, 1, 2], [], [7], [5, 5, 5])]
    hint = "pair each id with the next one: zip(ids, ids[1:]). Overlapping pairs all count here."
    _expect_cases(name, fn, [*cases, (list(b"hello, hello"), "")], hint)
    counts, where = {(1, 2): 1}, f"{name}([1, 2, 1, 2], counts={{(1, 2): 1}}, weight=3)"
    hint = "add `weight` per occurrence to the `counts` you were given (a chunk seen 3 times "
    hint += "counts 3 times), which may already hold pairs."
    actual = call(where, fn, [1, 2, 1, 2], counts, 3, hint=hint)
    expect(actual is counts, where, "expected the same dict, updated; got a new one.", hint)
    expect_close(actual, {(1, 2): 7, (2, 1): 3}, where, hint)
    passed(name)


MERGE_CASES = [  # ids, pair, new id, hint
    ([1, 2, 3, 1, 2], (1, 2), 9, ""),
    ([], (1, 2), 9, ""),
    ([1], (1, 2), 9, "a single id has no pair to merge."),
    ([3, 1, 2], (1, 2), 9, "don't forget a pair that ends the list."),
    ([2, 1, 2, 1], (1, 2), 9, "merge only the pair in its order: (1, 2) is not (2, 1)."),
    ([5, 5, 5], (5, 5), 9, OVERLAP_HINT),
    ([5, 5, 5, 5], (5, 5), 9, OVERLAP_HINT),
    ([5, 5, 5, 5, 5], (5, 5), 9, OVERLAP_HINT),
]


def check_merge_pair(fn: Callable) -> None:
    """`merge_pair(ids, pair, new_id)` replaces non-overlapping occurrences, left to right."""
    hint = "walk left to right: where ids[i], ids[i + 1] is the pair, emit new_id."
    _expect_cases("merge_pair", fn, MERGE_CASES, hint)
    passed("merge_pair")


def _most_frequent(chunks: list[tuple], pair: tuple, weighted: bool = True) -> bool:
    """Whether `pair` occurs in `chunks`, [(ids, count)], and has the highest count there,
    weighted or not."""
    counts: dict = {}
    for chunk, weight in chunks:
        tokenization.get_pair_counts(chunk, counts, weight if weighted else 1)
    return counts.get(pair, 0) > 0 and counts[pair] == max(counts.values())


GONE_HINT = "stop when no chunk has a pair left: a pair whose count fell to 0 no longer occurs, "
GONE_HINT += "and merging it adds a token the text never uses."
ONCE_MORE_HINT = "a pair that occurs once is still the most frequent when no pair occurs more "
ONCE_MORE_HINT += "often: merge it too, and stop only when no chunk has a pair left."


def check_train_merges(fn: Callable) -> None:
    """`train_merges(chunk_counts, num_merges)`: each merge a most frequent pair then, and no
    more merges than the text has pairs for."""
    name = "train_merges"
    shakespeare = tokenization.count_chunks(SAMPLE * 3 + "the the the ", GPT2_SPLIT_PATTERN)
    for label, chunk_counts, num_merges in (
        ("the chunk b'aaabdaaabac'", {b"aaabdaaabac": 1}, 3),
        ("a small Shakespeare sample (with chunk counts)", shakespeare, 40),
        ("chunks b'abcd' and b'xy' (4 merges leave no pair)", {b"abcd": 1, b"xy": 2}, 10),
    ):
        where = f"{name}({label}, {num_merges})"
        merges = call(where, fn, dict(chunk_counts), num_merges, hint=GONE_HINT)
        wanted = len(tokenization.train_merges(chunk_counts, num_merges))
        got = len(merges) if isinstance(merges, dict) else describe(merges)
        problem = f"expected a dict of {wanted} merges {{pair: new_id}}, got {got}."
        hint = "loop until you have num_merges merges."
        if wanted < num_merges:
            problem = f"expected {wanted} merges, after which no chunk has a pair left; got {got}."
            hint = GONE_HINT if isinstance(got, int) and got > wanted else ONCE_MORE_HINT
        expect(got == wanted, where, problem, hint)
        chunks = [(list(chunk), weight) for chunk, weight in chunk_counts.items()]
        for step, (pair, new_id) in enumerate(merges.items()):
            problem, hint = f"merge {step} created id {new_id}.", "new ids count up from 256."
            expect(new_id == 256 + step, where, problem, hint)
            hint = "weight each chunk's pairs by how often the chunk occurs."
            if not _most_frequent(chunks, pair, weighted=False):
                hint = OVERLAP_HINT + " Also recount (or update) the pair counts after every merge."
            problem = f"merge {step} chose {pair}, which is not the most frequent pair then."
            expect(_most_frequent(chunks, pair), where, problem, hint)
            chunks = [(merge_pair(chunk, pair, new_id), weight) for chunk, weight in chunks]
    passed(name)


IN_ORDER = {(98, 99): 256, (97, 98): 257}  # (b, c) learned before (a, b)
ENCODE_CASES = [  # ids, merges, hint
    ([97, 98, 99], IN_ORDER, "apply the merge learned first (lowest rank), not the first pair."),
    ([97, 98, 97, 98], IN_ORDER, ""),
    ([], IN_ORDER, ""),
    ([97], IN_ORDER, ""),
    ([97, 97, 97], {(97, 97): 256}, OVERLAP_HINT),
    ([97, 97, 97, 97], {(97, 97): 256, (256, 256): 257}, OVERLAP_HINT),
    ([97, 97, 98], {(97, 97): 256, (256, 98): 257, (97, 98): 258}, "a new token can merge again."),
]


def check_encode_chunk(fn: Callable) -> None:
    """`encode_chunk(ids, merges, ranks)` applies merges lowest rank first."""
    sample_merges = BPETokenizer.train(SAMPLE, 256 + 60, pattern=GPT2_SPLIT_PATTERN).merges
    chunks = regex.findall(GPT2_SPLIT_PATTERN, SAMPLE)[:40] + [SAMPLE.replace(" ", "")]
    cases = ENCODE_CASES + [(list(chunk.encode()), sample_merges, "") for chunk in chunks]
    cases = [(ids, merges, {p: r for r, p in enumerate(merges)}, h) for ids, merges, h in cases]
    hint = "repeatedly merge the pair of lowest rank until no pair has a rank."
    _expect_cases("encode_chunk", fn, cases, hint)
    passed("encode_chunk")


SPLIT_HINT = "a character's bytes can be split across tokens ('é' is C3 A9): join all the tokens' "
SPLIT_HINT += "bytes with b''.join(...) and decode once at the end, not token by token."
VOCAB = {b: bytes([b]) for b in range(256)} | {256: b"caf\xc3", 257: b"\xa9!", 258: "日本".encode()}
DECODE_CASES = [  # ids, vocab, hint
    ([104, 105], VOCAB, ""),
    ([], VOCAB, ""),
    ([258, 33], VOCAB, ""),
    ([256, 257], VOCAB, SPLIT_HINT),
    ([0xE6, 0x97, 0xA5], VOCAB, SPLIT_HINT),
    ([0xFF, 104], VOCAB, "ids may spell invalid UTF-8: decode with errors='replace'."),
]


def check_decode_ids(fn: Callable) -> None:
    """`decode_ids(ids, vocab)` joins bytes before decoding, so split characters survive."""
    hint = "look up each id's bytes in vocab, join them, decode as UTF-8."
    _expect_cases("decode_ids", fn, DECODE_CASES, hint)
    passed("decode_ids")


BPE_TEXTS = (
    "Hello world! Hello, worlds.",
    "the end<|endoftext|>The start<|endoftext|><|endoftext|>",
    "  spaces   and\nnew lines\n\n",
    "café, naïve, 日本語, emoji 🙂",
    "",
)
ONCE_HINT = "every character must be encoded once: each special token as its id, and every "
ONCE_HINT += "chunk of the text between them (split_chunks keeps what the pattern skips)."
EOT = "<|endoftext|>"
# Runs of spaces teach the merge "  ", which the pre-split keeps from joining " spaces".
BPE_TRAINING = f"Hello world, hello worlds. The end{EOT}The start. café naïve 日本語 a  b   c\n"


def _split(tokenizer: BPETokenizer) -> regex.Pattern | None:
    """The pre-split regex of `tokenizer`, from its `pattern` (None: no pre-split)."""
    return None if tokenizer.pattern is None else regex.compile(tokenizer.pattern)


def _rank_order_samples(tokenizer: BPETokenizer, limit: int = 3) -> list[str]:
    """Chunks a, b, c with (b, c) learned before (a, b): rank order differs from text order."""
    byte_merges = [(pair, rank) for pair, rank in tokenizer.ranks.items() if max(pair) < 256]
    samples = []
    for (a, b), late in byte_merges:
        for (middle, c), early in byte_merges:
            try:
                text = bytes([a, b, c]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            one_chunk = tokenization.split_chunks(text, _split(tokenizer)) == [text]
            if middle == b and early < late and one_chunk:
                samples.append(text)
    return samples[:limit]


def _in_text_order(tokenizer: BPETokenizer, text: str) -> list[int]:
    """The ids of `text` with each chunk merged in text order instead of rank order."""
    ids: list[int] = []
    for k, piece in enumerate(text.split(EOT)):  # the one special token of these tokenizers
        ids += [tokenizer.special_tokens[EOT]] if k else []
        for chunk in tokenization.split_chunks(piece, _split(tokenizer)):
            chunk_ids = [tokenizer.byte_ids[b] for b in chunk.encode()]
            while pairs := [p for p in zip(chunk_ids, chunk_ids[1:]) if p in tokenizer.merges]:
                chunk_ids = merge_pair(chunk_ids, pairs[0], tokenizer.merges[pairs[0]])
            ids += chunk_ids
    return ids


def _bpe_mistakes(tokenizer: BPETokenizer, text: str) -> dict[str, list[int]]:
    """What encoding `text` gives with each classic mistake of `BPETokenizer.encode`."""
    whole = BPETokenizer(tokenizer.vocab, tokenizer.merges, special_tokens=tokenizer.special_tokens)
    return {
        "special tokens are cut out of the text first (the special-token regex's split puts them "
        "at the odd positions), each its one id.": tokenizer.encode_ordinary(text),
        "a token crosses the pre-split: merges stay inside the chunks split_chunks cuts each "
        "piece into with the pattern; encode each chunk on its own.": whole.encode(text),
        "the chunks are right but their merges are not: within each chunk, merge the pair with "
        "the lowest rank first, as encode_chunk does.": _in_text_order(tokenizer, text),
    }


def check_bpe_encode(cls: type) -> None:
    """`cls(vocab, merges, pattern=, special_tokens=).encode(text)`: the reference's ids."""
    name = "BPETokenizer.encode"
    for pattern in (GPT2_SPLIT_PATTERN, None):
        options = dict(pattern=pattern, special_tokens=[EOT])
        reference = BPETokenizer.train(BPE_TRAINING * 20, 300, **options)
        options["special_tokens"] = reference.special_tokens
        theirs = call(name, cls, reference.vocab, reference.merges, **options)
        for sample in BPE_TEXTS + tuple(_rank_order_samples(reference)):
            where = f"{name}({sample!r}), pattern={'GPT-2' if pattern else 'None'}"
            actual, expected = call(name, theirs.encode, sample), reference.encode(sample)
            if actual != expected:
                ids = isinstance(actual, list) and all(i in reference.vocab for i in actual)
                problem = f"expected ids below {len(reference.vocab)}, got {describe(actual)}."
                expect(ids, where, problem)
                problem = f"decode(encode(text)) is {reference.decode(actual)!r}, not the text."
                expect(reference.decode(actual) == sample, where, problem, ONCE_HINT)
            hint = "cut out the special tokens, split_chunks the rest, merge each chunk by rank."
            expect_close(actual, expected, where, hint, mistakes=_bpe_mistakes(reference, sample))
    passed(name)
