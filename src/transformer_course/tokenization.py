"""Tokenizers: from text to the integer ids a model reads, and back.

Two tokenizers share one small interface (`encode`, `decode`, `vocab_size`):

- `CharTokenizer`: one id per distinct character of a training text (nanoGPT's shakespeare_char).
- `BPETokenizer`: byte-level byte pair encoding as used by GPT-2. Its base vocabulary is the 256
  byte values, so every string UTF-8 can encode can be encoded, and training learns merges of
  frequent neighbouring pairs into new tokens.

The small functions the BPE tokenizer is built from (`get_pair_counts`, `merge_pair`,
`train_merges`, `encode_chunk`, `decode_ids`) are the chapter's exercises. Reading and writing
tokenizer files (the course's, GPT-2's, Hugging Face's) is the job of `tokenizer_files`.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from pathlib import Path
from types import MappingProxyType
from typing import Any

import regex

from transformer_course import tokenizer_files, validate
from transformer_course.data import fetch
from transformer_course.tokenizer_files import GPT2_SPLIT_PATTERN, TokenPair, check_tables

__all__ = [
    "GPT2_SPLIT_PATTERN",
    "SPACE_BEFORE_WORD",
    "BPETokenizer",
    "CharTokenizer",
    "TokenPair",
    "Tokenizer",
    "count_chunks",
    "decode_ids",
    "encode_chunk",
    "encode_long_chunk",
    "get_pair_counts",
    "merge_pair",
    "split_chunks",
    "load_gpt2_tokenizer",
    "train_merges",
]

CACHE_SIZE = 1_000_000  # chunks, and words, whose ids a BPETokenizer remembers (each)
SHORT_CHUNK = 48  # up to this many bytes, encode_chunk's scan beats encode_long_chunk's heap
# encode_iterable encodes a pre-split chunk once this many characters follow it: the furthest
# GPT-2's pattern (and tiktoken's cl100k and o200k) looks past a chunk is a contraction of up to
# 3 characters ("x'l" splits as x ' l, but "x'll" as x 'll).
STREAM_LOOKAHEAD = 3

# No chunk of GPT-2's pattern crosses a space that comes before a non-space character, so text
# can be cut there first, fast. `re`'s \s covers every character `regex`'s \s covers (the tests
# check all of Unicode), so each cut it finds is one the pattern makes too.
SPACE_BEFORE_WORD = re.compile(r" (?=\S)")
WHITESPACE = regex.compile(r"\s")  # what the patterns' \s matches


# --- the building blocks (the workbook's exercises) -----------------------------------------


def get_pair_counts(
    ids: Sequence[int], counts: dict[TokenPair, int] | None = None, weight: int = 1
) -> dict[TokenPair, int]:
    """Count each pair of neighbouring ids, adding `weight` per occurrence to `counts` (or a new
    dict). `get_pair_counts([1, 2, 3, 1, 2]) == {(1, 2): 2, (2, 3): 1, (3, 1): 1}`

    Course: chapter 1, exercise 1.2, checked by checks.tokenization.check_get_pair_counts.
    """
    counts = {} if counts is None else counts
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + weight
    return counts


def merge_pair(ids: Sequence[int], pair: TokenPair, new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids` by `new_id`, scanning left to right.

    Occurrences never overlap: `merge_pair([5, 5, 5], (5, 5), 9) == [9, 5]`.

    Course: chapter 1, exercise 1.3, checked by checks.tokenization.check_merge_pair.
    """
    merged = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            merged.append(new_id)
            i += 2
        else:
            merged.append(ids[i])
            i += 1
    return merged


def train_merges(chunk_counts: Mapping[bytes, int], num_merges: int) -> dict[TokenPair, int]:
    """Learn `num_merges` merges from chunks of bytes and how often each chunk occurs.

    Each step merges the most frequent pair (ties go to the smallest pair) into the next new id,
    starting at 256. Returns `{pair: new_id}` in the order the merges were learned.

    Rather than recounting the whole corpus after every merge, the pair counts are kept up to
    date: only the chunks that contain the merged pair are touched, and a heap finds the most
    frequent pair (entries whose count has since changed are skipped when popped).

    Course: chapter 1, exercise 1.4, checked by checks.tokenization.check_train_merges.
    """
    chunks = [list(chunk) for chunk in chunk_counts]
    weights = list(chunk_counts.values())
    counts: dict[TokenPair, int] = {}
    where: dict[TokenPair, set[int]] = {}  # pair -> indices of the chunks that contain it
    for index, (chunk, weight) in enumerate(zip(chunks, weights)):
        get_pair_counts(chunk, counts, weight)
        for pair in zip(chunk, chunk[1:]):
            where.setdefault(pair, set()).add(index)
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)

    merges: dict[TokenPair, int] = {}
    while len(merges) < num_merges and heap:
        negative_count, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -negative_count or negative_count == 0:
            continue  # stale entry: this pair's count changed after it was pushed
        new_id = 256 + len(merges)
        merges[pair] = new_id
        changes: dict[TokenPair, int] = {}
        for index in where.pop(pair):
            old, weight = chunks[index], weights[index]
            new = merge_pair(old, pair, new_id)
            get_pair_counts(old, changes, -weight)
            get_pair_counts(new, changes, weight)
            for neighbour in zip(new, new[1:]):
                where.setdefault(neighbour, set()).add(index)
            chunks[index] = new
        for changed, delta in changes.items():
            if delta == 0 or changed == pair:
                continue
            counts[changed] = counts.get(changed, 0) + delta
            heapq.heappush(heap, (-counts[changed], changed))
        del counts[pair]
    return merges


def encode_chunk(
    ids: Sequence[int], merges: Mapping[TokenPair, int], ranks: Mapping[TokenPair, int]
) -> list[int]:
    """Apply learned merges to one chunk: always the pair learned first (lowest rank), leftmost
    first, until no neighbouring pair was ever learned.

    `merges[pair]` is the id a merge creates and `ranks[pair]` its position in training order
    (0, 1, ...). `pair_ranks[i]` is the rank of the pair that starts at `i`, or `len(ranks)` for
    a pair never learned, so the next merge is the first minimum: a scan fast on short chunks.

    Course: chapter 1, exercise 1.5, checked by checks.tokenization.check_encode_chunk.
    """
    ids = list(ids)
    never = len(ranks)
    pair_ranks = [ranks.get(pair, never) for pair in zip(ids, ids[1:])]
    while pair_ranks and (best := min(pair_ranks)) < never:
        i = pair_ranks.index(best)
        new = merges[ids[i], ids[i + 1]]
        ids[i : i + 2] = [new]
        del pair_ranks[i]  # only the pairs on either side of the new token change
        if i > 0:
            pair_ranks[i - 1] = ranks.get((ids[i - 1], new), never)
        if i < len(pair_ranks):
            pair_ranks[i] = ranks.get((new, ids[i + 1]), never)
    return ids


def encode_long_chunk(
    ids: Sequence[int], merges: Mapping[TokenPair, int], ranks: Mapping[TokenPair, int]
) -> list[int]:
    """`encode_chunk` in O(n log n) time, for long chunks (a text without a pre-split is one).

    A heap of candidate positions replaces the scan; `tokens[i] is None` marks a position
    merged into its left neighbour, and `after`/`before` link the live positions.

    Course: chapter 1.
    """
    tokens: list[int | None] = list(ids)
    n = len(tokens)
    after = list(range(1, n + 1))
    before = list(range(-1, n - 1))
    heap = [(ranks[pair], i) for i, pair in enumerate(zip(tokens, tokens[1:])) if pair in ranks]
    heapq.heapify(heap)
    while heap:
        rank, i = heapq.heappop(heap)
        j = after[i] if tokens[i] is not None else n
        if j >= n or ranks.get((tokens[i], tokens[j])) != rank:
            continue  # stale: one side of this pair was merged away since it was pushed
        tokens[i], tokens[j] = merges[(tokens[i], tokens[j])], None
        after[i] = after[j]
        if after[i] < n:
            before[after[i]] = i
        for left in (before[i], i):
            if left >= 0 and after[left] < n:
                pair = (tokens[left], tokens[after[left]])
                if pair in ranks:
                    heapq.heappush(heap, (ranks[pair], left))
    return [token for token in tokens if token is not None]


def decode_ids(ids: Iterable[int], vocab: Mapping[int, bytes]) -> str:
    """Turn token ids back into text: join every token's bytes first, then decode UTF-8 once.

    A character's bytes may be split across tokens, so decoding token by token would break it.
    Byte sequences that are not valid UTF-8 (possible for arbitrary ids) become U+FFFD.

    Course: chapter 1, exercise 1.6, checked by checks.tokenization.check_decode_ids.
    """
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def split_chunks(text: str, split: regex.Pattern | None) -> list[str]:
    """Cut `text` into the chunks merges never cross: the pattern's matches *and* the text between.

    Keeping the unmatched text means no pattern can drop characters, so `decode(encode(s)) == s`
    whatever the pattern. When the matches already tile the text (GPT-2's pattern matches every
    character), `findall` gives the chunks in one call.

    Course: chapter 1.
    """
    if split is None:
        return [text] if text else []
    if not split.groups:
        chunks = split.findall(text)
        if sum(map(len, chunks)) == len(text):  # ordered, non-overlapping: they tile the text
            return [chunk for chunk in chunks if chunk] if "" in chunks else chunks
    chunks, end = [], 0
    for match in split.finditer(text):
        start, stop = match.span()
        if start > end:
            chunks.append(text[end:start])
        if stop > start:
            chunks.append(text[start:stop])
        end = max(end, stop)
    if end < len(text):
        chunks.append(text[end:])
    return chunks


# --- checking what a tokenizer is built from ---------------------------------------------------


def _byte_ids(vocab: Mapping[int, bytes], special_ids: Iterable[int]) -> list[int]:
    """The id of each of the 256 single bytes (GPT-2's files order them differently from 0..255)."""
    specials = set(special_ids)
    found: dict[int, int] = {}
    for i, token in vocab.items():
        if len(token) == 1 and i not in specials:
            found.setdefault(token[0], i)
    missing = sorted(set(range(256)) - set(found))
    if missing:
        raise ValueError(
            f"vocab: expected an id for each of the 256 bytes, got none for bytes {missing[:8]}"
        )
    return [found[b] for b in range(256)]


def _token_ids_by_bytes(tokenizer: BPETokenizer) -> dict[bytes, int]:
    """Each token's bytes -> its id, special tokens aside: the encoding of a chunk that spells a
    token, for a tokenizer whose tokens all encode whole.

    Not every table has that property: with the merges (b, c), (a, b), (ab, c) in that order,
    "abc" encodes as a + bc. Every table that BPE training learns has it: a pair is learned
    where it occurs in the training text, and the merges that built that spot there build it
    the same way on its own, so `train` says so. The tests check GPT-2's files token by token
    (`load_gpt2_tokenizer` says so too) and trained tokenizers on many texts.
    """
    special_ids = set(tokenizer.special_tokens.values())
    return {token: i for i, token in tokenizer.vocab.items() if i not in special_ids}


def _special_pattern(special_tokens: Iterable[str]) -> str:
    """A regex that captures any of the special tokens, the longest first when one contains
    another."""
    ordered = sorted(special_tokens, key=len, reverse=True)
    return "(" + "|".join(regex.escape(token) for token in ordered) + ")"


# --- tokenizers ------------------------------------------------------------------------------


def count_chunks(text: str, pattern: str | None, special_tokens: Sequence[str] = ()) -> Counter:
    """How often each chunk's bytes occur in `text`, cut by `pattern` (None: the whole text is one
    chunk) after the special tokens are cut out, so that no merge learned from them spans one.

    Course: chapter 1.
    """
    pieces = [text]
    if special_tokens:
        pieces = regex.split(_special_pattern(special_tokens), text)[::2]
    split = None if pattern is None else regex.compile(pattern)
    return Counter(
        chunk.encode("utf-8") for piece in pieces for chunk in split_chunks(piece, split)
    )


class _Memo(dict):
    """A dict that fills in a missing key with `compute(key)` and remembers it, up to `CACHE_SIZE`
    keys: most chunks of a text were seen before, so each is merged once."""

    def __init__(self, compute: Callable[[str], tuple[int, ...]]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, key: str) -> tuple[int, ...]:
        value = self.compute(key)
        if len(self) < CACHE_SIZE:
            self[key] = value
        return value


class Tokenizer:
    """The interface every tokenizer here has: `encode`, `decode` and `vocab_size`, and
    `encode_iterable`, which streams `encode` over pieces of text.

    `encode_iterable` needs two facts about a tokenizer: the chunks it encodes independently of
    each other (`_split`, here one per character; None: the whole text is one chunk) and the
    special tokens it recognises first (`special_tokens`, `_special_split`).

    Course: chapter 1.
    """

    vocab: dict[int, Any]
    special_tokens: Mapping[str, int] = MappingProxyType({})
    _split: regex.Pattern | None = regex.compile(r"(?s).")
    _special_split: regex.Pattern | None = None

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids."""
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Text to token ids."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids to text."""
        raise NotImplementedError

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """The ids of the strings of `iterable` joined (the lines of a file, say), yielded as
        soon as they are known: `list(encode_iterable(pieces)) == encode("".join(pieces))`,
        without holding the whole text.

        Text waits until nothing that may follow can change its ids (`settled_length`): its
        last chunks ("hel" + "lo" is one chunk), and an end that could begin a special token
        ("<|endof" + "text|>"). Without a pattern, the text between special tokens is one
        chunk, so its ids come at the next special token or at the end. Text that stays
        unsettled is looked at again once it has doubled, so a long run costs linear time.
        """
        held, look_at = "", 0
        for index, piece in enumerate(iterable):
            held += validate.text(f"iterable[{index}]", piece, utf8=True)
            if len(held) < look_at:
                continue
            done = self.settled_length(held)
            yield from self.encode(held[:done])
            held, look_at = held[done:], 0 if done else 2 * len(held)
        yield from self.encode(held)

    def settled_length(self, text: str) -> int:
        """The length of the longest start of `text` whose ids no continuation can change: the
        text up to the last special token that cannot grow into a longer one, then the chunks
        that `STREAM_LOOKAHEAD` characters follow, up to the last that does not end in
        whitespace (at the end of a text, a run of whitespace is one chunk: "\n\n" alone, but
        "\n" + "\n" before a word)."""
        end, tail_start = self._before_partial_special(text), 0
        for match in self._special_split.finditer(text) if self._special_split else ():
            if match.start() >= end:
                break
            if match.end() > end:  # a special token that overlaps one that may still grow
                end = match.start()
                break
            tail_start = match.end()
        tail, done, settled = text[tail_start:end], 0, 0
        for chunk in split_chunks(tail, self._split):
            if done + len(chunk) > len(tail) - STREAM_LOOKAHEAD:
                break
            done += len(chunk)
            settled = settled if WHITESPACE.match(chunk[-1]) else done
        return tail_start + settled

    def _before_partial_special(self, text: str) -> int:
        """Where the end of `text` starts to spell part of a special token (len(text) if not)."""
        longest = max(map(len, self.special_tokens), default=0)
        for start in range(max(0, len(text) - longest + 1), len(text)):
            rest = text[start:]
            if any(token.startswith(rest) and token != rest for token in self.special_tokens):
                return start
        return len(text)


class CharTokenizer(Tokenizer):
    """One id per distinct character of `text`, in sorted order (as in nanoGPT's
    shakespeare_char): `vocab` maps each id to its character.

    Course: chapter 1, exercise 1.1, checked by checks.tokenization.check_char_tokenizer.
    """

    def __init__(self, text: str) -> None:
        validate.text_of_characters("text", text)
        self.vocab = dict(enumerate(sorted(set(text))))
        self.ids = {char: i for i, char in self.vocab.items()}

    def encode(self, text: str) -> list[int]:
        """One id per character; a character not seen in training is an error."""
        validate.in_vocabulary("text", validate.text("text", text), self.ids)
        return [self.ids[char] for char in text]

    def decode(self, ids: Iterable[int]) -> str:
        """The characters of the ids, joined."""
        return "".join(self.vocab[i] for i in validate.token_ids("ids", ids, len(self.vocab)))


class BPETokenizer(Tokenizer):
    """Byte-level BPE: bytes in, merges of frequent pairs, special tokens recognised in text.

    `vocab` maps every id to its bytes, `merges` each learned pair to the id it creates (in
    training order), `special_tokens` strings such as `"<|endoftext|>"` to ids, and `pattern`
    (if any) pre-splits text into chunks that merges never cross. Build one with `train`, `load`,
    `from_huggingface` or `from_gpt2_files`; tables that disagree are refused (`check_tables`).
    `tokens_encode_whole=True` states that every token's bytes encode as that one token (see
    `_token_ids_by_bytes`), so a chunk that spells a token needs no merges.

    Course: chapter 1, exercise 1.7, checked by checks.tokenization.check_bpe_encode.
    """

    def __init__(
        self,
        vocab: Mapping[int, bytes],
        merges: Mapping[TokenPair, int],
        *,
        pattern: str | None = None,
        special_tokens: Mapping[str, int] | None = None,
        tokens_encode_whole: bool = False,
    ) -> None:
        self.vocab = dict(vocab)
        self.merges = dict(merges)
        self.pattern = validate.regex_pattern("pattern", pattern)
        self.special_tokens = dict(special_tokens or {})
        check_tables(self.vocab, self.merges, self.special_tokens)
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        self.byte_ids = _byte_ids(self.vocab, self.special_tokens.values())
        self._split = None if pattern is None else regex.compile(pattern)
        specials = _special_pattern(self.special_tokens) if self.special_tokens else None
        self._special_split = None if specials is None else regex.compile(specials)
        self.tokens_encode_whole = validate.flag("tokens_encode_whole", tokens_encode_whole)
        self._whole = _token_ids_by_bytes(self) if tokens_encode_whole else {}
        self._chunk_cache = _Memo(self._merge_chunk)
        self._word_cache: dict[str, tuple[int, ...]] | None = None
        if pattern == GPT2_SPLIT_PATTERN:  # encode_ordinary goes by words
            self._word_cache = {}

    @classmethod
    def train(
        cls,
        text: str,
        vocab_size: int,
        *,
        pattern: str | None = None,
        special_tokens: Iterable[str] = (),
    ) -> BPETokenizer:
        """Learn `vocab_size - 256 - len(special_tokens)` merges from `text`.

        Special tokens are cut out of the training text first, so no merge spans one; they take
        the last ids. With `pattern`, merges never cross the chunks the pattern splits text into
        (see `split_chunks`); without one the whole text is a single chunk (fine for short texts,
        slow for a book). A text too short for that many merges gives a smaller vocabulary.
        """
        validate.text("text", text, utf8=True)
        validate.regex_pattern("pattern", pattern)
        special_tokens = validate.distinct_strings("special_tokens", special_tokens)
        smallest = 256 + len(special_tokens)
        validate.integer("vocab_size", vocab_size, low=smallest)
        merges = train_merges(count_chunks(text, pattern, special_tokens), vocab_size - smallest)
        vocab = {b: bytes([b]) for b in range(256)}
        for (left, right), new_id in merges.items():
            vocab[new_id] = vocab[left] + vocab[right]
        specials = {token: len(vocab) + k for k, token in enumerate(special_tokens)}
        vocab.update({i: token.encode("utf-8") for token, i in specials.items()})
        return cls(
            vocab, merges, pattern=pattern, special_tokens=specials, tokens_encode_whole=True
        )

    def encode(self, text: str) -> list[int]:
        """Text to ids: special tokens first, then the pre-split, then merges within each chunk."""
        validate.text("text", text, utf8=True)
        pieces = self._special_split.split(text) if self._special_split else [text]
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:  # split() puts the separators (here: special tokens) at odd positions
                ids.append(self.special_tokens[piece])
            else:
                ids += self.encode_ordinary(piece)
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Text to ids, special tokens read as plain text: the pre-split, then the merges.

        With GPT-2's pattern the text is first cut at each space before a non-space (see
        `SPACE_BEFORE_WORD`) into words such as " king," that repeat, and each distinct word
        is split into chunks and merged once.
        """
        validate.text("text", text, utf8=True)
        if self._word_cache is None:
            return self._encode_chunks(split_chunks(text, self._split))
        first, *words = SPACE_BEFORE_WORD.split(text)
        new = [word for word in dict.fromkeys(words) if word not in self._word_cache]
        if len(self._word_cache) + len(new) > CACHE_SIZE:  # too many words to remember
            return self._encode_chunks(split_chunks(text, self._split))
        self._learn_words(new)
        ids = self._encode_chunks(split_chunks(first, self._split))
        ids += chain.from_iterable(map(self._word_cache.__getitem__, words))
        return ids

    def _learn_words(self, words: list[str]) -> None:
        """Remember the ids of " " + word for each word. One regex pass splits them all: joined as
        " w1 w2 ...", the words cut into the same chunks as each " " + word on its own."""
        chunks = iter(self._split.findall(" " + " ".join(words)))
        for word in words:
            ids, left = [], 1 + len(word)
            while left > 0:  # the chunks of " " + word, which add up to its length
                chunk = next(chunks)
                ids += self._chunk_cache[chunk]
                left -= len(chunk)
            self._word_cache[word] = tuple(ids)

    def _encode_chunks(self, chunks: Iterable[str]) -> list[int]:
        """The ids of each chunk, merged on its own (and remembered)."""
        return list(chain.from_iterable(map(self._chunk_cache.__getitem__, chunks)))

    def _merge_chunk(self, chunk: str) -> tuple[int, ...]:
        """One chunk's ids: the token it spells, if tokens encode whole, else the merges' result."""
        data = chunk.encode("utf-8")
        token = self._whole.get(data)
        if token is not None:
            return (token,)
        merge = encode_chunk if len(data) <= SHORT_CHUNK else encode_long_chunk
        return tuple(merge([self.byte_ids[b] for b in data], self.merges, self.ranks))

    def decode(self, ids: Iterable[int]) -> str:
        """Ids to text; bytes are joined before UTF-8 decoding, so split characters survive."""
        return decode_ids(validate.token_ids("ids", ids, len(self.vocab)), self.vocab)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as JSON, atomically (a crash keeps the old file)."""
        tables = dict(vocab=self.vocab, merges=self.merges, special_tokens=self.special_tokens)
        tokenizer_files.write_bpe(path, {**tables, "pattern": self.pattern})

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Read a tokenizer written by `save`; a file that disagrees with itself is refused with
        its name and the field, never loaded into a wrong tokenizer."""
        return cls(**tokenizer_files.read_bpe(path))

    @classmethod
    def from_gpt2_files(cls, vocab_json: str | Path, merges_txt: str | Path) -> BPETokenizer:
        """GPT-2's `vocab.json` and `merges.txt`, read by `tokenizer_files.read_gpt2_files`."""
        return cls(**tokenizer_files.read_gpt2_files(vocab_json, merges_txt))

    @classmethod
    def from_huggingface(cls, tokenizer: Any) -> BPETokenizer:
        """A Hugging Face byte-level BPE `tokenizers.Tokenizer`, read by `tokenizer_files`."""
        return cls(**tokenizer_files.read_huggingface(tokenizer))


def load_gpt2_tokenizer() -> BPETokenizer:
    """OpenAI's GPT-2 tokenizer (50,257 tokens, `<|endoftext|>` = 50256) as a course `BPETokenizer`.

    Built from the two files OpenAI published (`encoder.json`, `vocab.bpe`), the same files
    tiktoken's `gpt2` encoding and Hugging Face's `gpt2` tokenizer are made from, which the data
    layer finds (`data.fetch`).

    Course: chapter 1.
    """
    files = fetch("gpt2", "encoder.json"), fetch("gpt2", "vocab.bpe")
    # tests/test_gpt2_tokenizer.py checks that every token's bytes encode as that token
    return BPETokenizer(**tokenizer_files.read_gpt2_files(*files), tokens_encode_whole=True)
