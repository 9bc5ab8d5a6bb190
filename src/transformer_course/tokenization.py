"""Tokenizers: from text to the integer ids a model reads, and back.

Two tokenizers share one small interface (`encode`, `decode`, `vocab_size`):

- `CharTokenizer`: one id per distinct character of a training text (nanoGPT's shakespeare_char).
- `BPETokenizer`: byte-level byte pair encoding as used by GPT-2. Its base vocabulary is the 256
  byte values, so every string UTF-8 can encode can be encoded, and training learns merges of
  frequent neighbouring pairs into new tokens.

The small functions the BPE tokenizer is built from (`get_pair_counts`, `merge_pair`,
`train_merges`, `encode_chunk`, `decode_ids`) are the chapter's exercises.
"""

from __future__ import annotations

import heapq
import json
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import regex

from transformer_course.files import atomic_write

__all__ = [
    "GPT2_SPLIT_PATTERN",
    "BPETokenizer",
    "CharTokenizer",
    "Tokenizer",
    "bytes_to_unicode",
    "decode_ids",
    "encode_chunk",
    "get_pair_counts",
    "merge_pair",
    "split_chunks",
    "train_merges",
]

Pair = tuple[int, int]

# GPT-2's pre-split (Radford et al., 2019): contractions, letters, digits, other symbols and
# whitespace become separate chunks, and merges never cross a chunk boundary.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

FILE_FORMAT = "transformer_course.bpe"
FILE_VERSION = 1
CACHE_SIZE = 1_000_000  # chunks whose encoding a BPETokenizer remembers


# --- the building blocks (the workbook's exercises) -----------------------------------------


def get_pair_counts(ids: Sequence[int], counts: dict[Pair, int] | None = None, weight: int = 1) -> dict[Pair, int]:
    """Count each pair of neighbouring ids, adding `weight` per occurrence to `counts` (or a new dict).

    `get_pair_counts([1, 2, 3, 1, 2]) == {(1, 2): 2, (2, 3): 1, (3, 1): 1}`
    """
    counts = {} if counts is None else counts
    for pair in zip(ids, ids[1:]):
        counts[pair] = counts.get(pair, 0) + weight
    return counts


def merge_pair(ids: Sequence[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every occurrence of `pair` in `ids` by `new_id`, scanning left to right.

    Occurrences never overlap: `merge_pair([5, 5, 5], (5, 5), 9) == [9, 5]`.
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


def train_merges(chunk_counts: Mapping[bytes, int], num_merges: int) -> dict[Pair, int]:
    """Learn `num_merges` merges from chunks of bytes and how often each chunk occurs.

    Each step merges the most frequent pair (ties go to the smallest pair) into the next new id,
    starting at 256. Returns `{pair: new_id}` in the order the merges were learned.

    Rather than recounting the whole corpus after every merge, the pair counts are kept up to
    date: only the chunks that contain the merged pair are touched, and a heap finds the most
    frequent pair (entries whose count has since changed are skipped when popped).
    """
    chunks = [list(chunk) for chunk in chunk_counts]
    weights = list(chunk_counts.values())
    counts: dict[Pair, int] = {}
    where: dict[Pair, set[int]] = {}  # pair -> indices of the chunks that contain it
    for index, (chunk, weight) in enumerate(zip(chunks, weights)):
        get_pair_counts(chunk, counts, weight)
        for pair in zip(chunk, chunk[1:]):
            where.setdefault(pair, set()).add(index)
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)

    merges: dict[Pair, int] = {}
    while len(merges) < num_merges and heap:
        negative_count, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -negative_count or negative_count == 0:
            continue  # stale entry: this pair's count changed after it was pushed
        new_id = 256 + len(merges)
        merges[pair] = new_id
        changes: dict[Pair, int] = {}
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


def encode_chunk(ids: Sequence[int], merges: Mapping[Pair, int], ranks: Mapping[Pair, int]) -> list[int]:
    """Apply learned merges to one chunk: always the pair learned first (lowest rank), leftmost first.

    `merges[pair]` is the id a merge creates and `ranks[pair]` its position in training order.
    A heap of candidate positions keeps this fast on long chunks; `tokens[i] is None` marks a
    position merged into its left neighbour, and `after`/`before` link the live positions.
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
    """
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, used in `vocab.json`/`merges.txt`.

    Printable Latin-1 bytes stand for themselves; the others (control characters, space, ...)
    are shifted to code points from 256 on, so every token is a visible string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


# --- tokenizers ------------------------------------------------------------------------------


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")


def _check_utf8(text: Any) -> None:
    """Raise a clear error unless `text` is a str that UTF-8 can encode (no lone surrogates)."""
    _check_text(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text: expected a string UTF-8 can encode, got the lone surrogate {text[exc.start]!r} "
            f"at index {exc.start}"
        ) from None


def _as_id(token: Any) -> int | None:
    """`token` as an int if it is an integer of any kind (int, NumPy, 0-d tensor), else None.

    Bools are refused: `True` is an int to Python, but never meant as token 1.
    """
    if isinstance(token, bool) or str(getattr(token, "dtype", "")) == "torch.bool":
        return None
    try:
        return operator.index(token)
    except TypeError:
        return None


def _check_ids(ids: Any, vocab: Mapping[int, Any]) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids: expected a sequence of ints, got {type(ids).__name__}")
    checked = []
    for position, token in enumerate(ids):
        i = _as_id(token)
        if i not in vocab:
            raise ValueError(
                f"ids: expected token ids in the vocabulary (0..{len(vocab) - 1}), "
                f"got {token!r} at position {position}"
            )
        checked.append(i)
    return checked


def _compile_pattern(pattern: Any) -> regex.Pattern | None:
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise TypeError(
            f"pattern: expected a regular expression str or None, got {type(pattern).__name__}"
        )
    try:
        return regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(
            f"pattern: expected a valid regular expression, got {pattern!r} ({exc})"
        ) from None


def split_chunks(text: str, split: regex.Pattern | None) -> list[str]:
    """Cut `text` into the chunks merges never cross: the pattern's matches *and* the text between.

    Keeping the unmatched text means no pattern can drop characters, so `decode(encode(s)) == s`
    whatever the pattern (GPT-2's matches every character, so for it the two are the same).
    """
    if split is None:
        return [text] if text else []
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


def _check_tables(
    vocab: Mapping[int, bytes], merges: Mapping[Pair, int], special_tokens: Mapping[str, int]
) -> None:
    """Raise a clear error unless ids are 0..len(vocab)-1 and merges and special tokens agree with
    the vocabulary."""
    for i, token in vocab.items():
        if _as_id(i) is None or not 0 <= i < len(vocab):
            raise ValueError(
                f"vocab: expected ids 0..{len(vocab) - 1} (one per token), got id {i!r}"
            )
        if not isinstance(token, bytes) or not token:
            raise ValueError(f"vocab: expected non-empty bytes for id {i}, got {token!r}")
    created: set[int] = set()
    for rank, (pair, new_id) in enumerate(merges.items()):
        ids = (*pair, new_id) if isinstance(pair, tuple) and len(pair) == 2 else ()
        if not ids or any(_as_id(j) is None or j not in vocab for j in ids):
            raise ValueError(
                "merges: expected a pair of ids in the vocabulary and a new id, "
                f"got {pair} -> {new_id}"
            )
        if vocab[new_id] != vocab[pair[0]] + vocab[pair[1]]:
            raise ValueError(
                f"merges: merge {rank} {pair} -> {new_id} disagrees with vocab: expected the bytes "
                f"{vocab[pair[0]] + vocab[pair[1]]!r}, vocab has {vocab[new_id]!r}"
            )
        if new_id in created:
            raise ValueError(
                f"merges: expected each merge to create a new id, got {new_id} twice (merge {rank})"
            )
        created.add(new_id)
    for token, i in special_tokens.items():
        if not isinstance(token, str) or not token or _as_id(i) is None or i not in vocab:
            raise ValueError(
                "special_tokens: expected non-empty strings with ids in the vocabulary, "
                f"got {token!r}: {i!r}"
            )
        if vocab[i] != token.encode("utf-8"):
            raise ValueError(
                f"special_tokens: {token!r} has id {i}, but vocab has {vocab[i]!r} for that id"
            )


def _read_json(path: Path, name: str) -> Any:
    """Parse the JSON file `path`; an unreadable one is a ValueError naming the file and `name`."""
    text = _read_text(path, name)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: {str(path)!r} is not valid JSON: {exc}") from None


def _read_text(path: Path, name: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name}: {str(path)!r} is not UTF-8 text: {exc}") from None


def _load_field(
    state: dict[str, Any], name: str, kind: type | tuple[type, ...], expected: str
) -> Any:
    """`state[name]`, or a ValueError naming the field unless it is there and of type `kind`."""
    if name not in state:
        raise ValueError(f"field {name!r}: missing")
    value = state[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        got = f"{type(value).__name__} {value!r:.60}"
        raise ValueError(f"field {name!r}: expected {expected}, got {got}")
    return value


def _special_pattern(special_tokens: Iterable[str]) -> str:
    """A regex that captures any of the special tokens, the longest first when one contains another."""
    return "(" + "|".join(regex.escape(token) for token in sorted(special_tokens, key=len, reverse=True)) + ")"


class Tokenizer:
    """The interface every tokenizer here has: `encode`, `decode` and `vocab_size`."""

    vocab: dict[int, Any]

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


class CharTokenizer(Tokenizer):
    """One id per distinct character of `text`, in sorted order (as in nanoGPT's shakespeare_char)."""

    def __init__(self, text: str) -> None:
        _check_text(text)
        if not text:
            raise ValueError("text: expected at least one character to build a vocabulary from, got ''")
        self.vocab = dict(enumerate(sorted(set(text))))
        self.ids = {char: i for i, char in self.vocab.items()}

    def encode(self, text: str) -> list[int]:
        """One id per character; a character not seen in training is an error."""
        _check_text(text)
        try:
            return [self.ids[char] for char in text]
        except KeyError as exc:
            raise ValueError(
                f"text: expected only characters from the tokenizer's vocabulary, got {exc.args[0]!r} "
                f"at index {text.index(exc.args[0])}"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab[i] for i in _check_ids(ids, self.vocab))


class BPETokenizer(Tokenizer):
    """Byte-level BPE: bytes in, merges of frequent pairs, special tokens recognised in text.

    `vocab` maps every id to its bytes, `merges` maps each learned pair to the id it creates (in
    training order: a merge's rank is its position), `special_tokens` maps strings such as
    `"<|endoftext|>"` to ids, and `pattern` (if any) pre-splits text into chunks that merges
    never cross. Build one with `train`, `load`, `from_huggingface` or `from_gpt2_files`; the
    constructor refuses tables that disagree (a merge whose bytes are not its pair's, ids
    outside 0..vocab_size-1), since they would encode or decode wrongly without an error.
    """

    def __init__(
        self,
        vocab: Mapping[int, bytes],
        merges: Mapping[Pair, int],
        *,
        pattern: str | None = None,
        special_tokens: Mapping[str, int] | None = None,
    ) -> None:
        self.vocab = dict(vocab)
        self.merges = dict(merges)
        self.pattern = pattern
        self.special_tokens = dict(special_tokens or {})
        _check_tables(self.vocab, self.merges, self.special_tokens)
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        self.byte_ids = {}
        for i, token in self.vocab.items():
            if len(token) == 1 and i not in self.special_tokens.values():
                self.byte_ids.setdefault(token[0], i)
        missing = sorted(set(range(256)) - set(self.byte_ids))
        if missing:
            raise ValueError(f"vocab: expected an id for each of the 256 bytes, got none for bytes {missing[:8]}")
        self._split = _compile_pattern(pattern)
        self._special_split = regex.compile(_special_pattern(self.special_tokens)) if self.special_tokens else None
        self._cache: dict[str, list[int]] = {}

    # training --------------------------------------------------------------------------------

    @classmethod
    def train(
        cls, text: str, vocab_size: int, *, pattern: str | None = None, special_tokens: Iterable[str] = ()
    ) -> BPETokenizer:
        """Learn `vocab_size - 256 - len(special_tokens)` merges from `text`.

        Special tokens are cut out of the training text first, so no merge spans one; they take
        the last ids. With `pattern`, merges never cross the chunks the pattern splits text into
        (see `split_chunks`); without one the whole text is a single chunk (fine for short texts,
        slow for a book). A text too short for that many merges gives a smaller vocabulary.
        """
        _check_utf8(text)
        split = _compile_pattern(pattern)
        if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, Iterable):
            raise TypeError(
                "special_tokens: expected an iterable of strings such as ['<eos>'], "
                f"got {special_tokens!r}"
            )
        special_tokens = list(special_tokens)
        for token in special_tokens:
            if not isinstance(token, str) or not token:
                raise ValueError(f"special_tokens: expected non-empty strings, got {token!r}")
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"special_tokens: expected distinct strings, got {special_tokens}")
        smallest = 256 + len(special_tokens)
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < smallest:
            raise ValueError(
                f"vocab_size: expected an int >= {smallest} (256 bytes + {len(special_tokens)} special tokens), "
                f"got {vocab_size!r}"
            )
        pieces = regex.split(_special_pattern(special_tokens), text)[::2] if special_tokens else [text]
        chunks = (chunk for piece in pieces for chunk in split_chunks(piece, split))
        chunk_counts = Counter(chunk.encode("utf-8") for chunk in chunks)
        merges = train_merges(chunk_counts, vocab_size - smallest)
        vocab = {b: bytes([b]) for b in range(256)}
        for (left, right), new_id in merges.items():
            vocab[new_id] = vocab[left] + vocab[right]
        specials = {token: len(vocab) + k for k, token in enumerate(special_tokens)}
        vocab.update({i: token.encode("utf-8") for token, i in specials.items()})
        return cls(vocab, merges, pattern=pattern, special_tokens=specials)

    # encoding and decoding -------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text to ids: special tokens first, then the pre-split, then merges within each chunk."""
        _check_utf8(text)
        pieces = self._special_split.split(text) if self._special_split else [text]
        ids: list[int] = []
        cache = self._cache  # chunk -> ids: most chunks of a text are words seen before
        for k, piece in enumerate(pieces):
            if k % 2:  # split() puts the separators (here: special tokens) at odd positions
                ids.append(self.special_tokens[piece])
                continue
            for chunk in split_chunks(piece, self._split):
                chunk_ids = cache.get(chunk)
                if chunk_ids is None:
                    chunk_ids = encode_chunk([self.byte_ids[b] for b in chunk.encode("utf-8")], self.merges, self.ranks)
                    if len(cache) < CACHE_SIZE:
                        cache[chunk] = chunk_ids
                ids.extend(chunk_ids)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids to text; bytes are joined before UTF-8 decoding, so split characters survive."""
        return decode_ids(_check_ids(ids, self.vocab), self.vocab)

    # saving and loading ----------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as JSON (token bytes in hex), atomically: a crash keeps the old
        file."""
        state = {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "pattern": self.pattern,
            "vocab": {str(i): token.hex() for i, token in self.vocab.items()},
            "merges": [[left, right, new_id] for (left, right), new_id in self.merges.items()],
            "special_tokens": self.special_tokens,
        }
        atomic_write(path, json.dumps(state, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        """Read a tokenizer written by `save`, checking every field: a file that disagrees with
        itself is refused with its name and the field, never loaded into a wrong tokenizer."""
        path = Path(path)
        state = _read_json(path, "path")
        if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"path: expected a {FILE_FORMAT!r} JSON file written by BPETokenizer.save, "
                f"got {found!r} in {str(path)!r}"
            )
        try:
            return cls._from_state(state)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"path: {str(path)!r} is not a valid tokenizer file: {exc}") from None

    @classmethod
    def _from_state(cls, state: dict[str, Any]) -> BPETokenizer:
        version = _load_field(state, "version", int, f"the version {FILE_VERSION}")
        if version != FILE_VERSION:
            raise ValueError(
                f"field 'version': expected {FILE_VERSION} (the only version this code reads), "
                f"got {version}"
            )
        vocab = {}
        for key, token in _load_field(state, "vocab", dict, "an object {id: hex bytes}").items():
            try:
                i, token_bytes = int(key), bytes.fromhex(token)
                if str(i) != key:
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError(
                    f"field 'vocab': expected a decimal id and hex bytes, got {key!r}: {token!r}"
                ) from None
            vocab[i] = token_bytes
        merges = {}
        listed = _load_field(state, "merges", list, "a list of [left, right, new_id]")
        for rank, merge in enumerate(listed):
            if not isinstance(merge, list) or len(merge) != 3 or None in map(_as_id, merge):
                raise ValueError(
                    "field 'merges': expected [left, right, new_id] ids, "
                    f"got {merge!r} at index {rank}"
                )
            merges[(merge[0], merge[1])] = merge[2]
        if len(merges) != len(listed):
            raise ValueError("field 'merges': expected each pair to be merged once, got one twice")
        special_tokens = _load_field(state, "special_tokens", dict, "an object {token: id}")
        pattern = _load_field(state, "pattern", (str, type(None)), "a regular expression or null")
        return cls(vocab, merges, pattern=pattern, special_tokens=special_tokens)

    # GPT-2 and Hugging Face formats ----------------------------------------------------------

    @classmethod
    def from_gpt2_files(cls, vocab_json: str | Path, merges_txt: str | Path) -> BPETokenizer:
        """Load GPT-2's `vocab.json` (token string -> id) and `merges.txt` (one `left right` per line).

        Tokens are written in GPT-2's byte-to-unicode alphabet (see `bytes_to_unicode`). Vocabulary
        entries that are neither a byte nor a merge result (`<|endoftext|>`) become special tokens.
        """
        vocab = _read_json(Path(vocab_json), "vocab_json")
        if not isinstance(vocab, dict):
            raise ValueError(
                f"vocab_json: expected an object {{token: id}} in {str(vocab_json)!r}, "
                f"got {type(vocab).__name__}"
            )
        for token, i in vocab.items():
            if _as_id(i) is None:
                raise ValueError(
                    f"vocab_json: expected integer ids in {str(vocab_json)!r}, "
                    f"got {i!r} for the entry {token!r}"
                )
        merges = []
        lines = _read_text(Path(merges_txt), "merges_txt").splitlines()
        for number, line in enumerate(lines, start=1):
            if line.startswith("#version") or not line.strip():
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"merges_txt: expected 'left right' on line {number}, got {line!r}")
            merges.append((parts[0], parts[1]))
        return cls._from_gpt2_vocab(vocab, merges, pattern=GPT2_SPLIT_PATTERN)

    @classmethod
    def from_huggingface(cls, tokenizer: Any) -> BPETokenizer:
        """Copy a Hugging Face `tokenizers.Tokenizer` with a byte-level BPE model; ids stay identical."""
        try:
            config = json.loads(tokenizer.to_str())
        except AttributeError:
            raise TypeError(f"tokenizer: expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}") from None
        model = config["model"]
        pre = config.get("pre_tokenizer") or {}
        problems = {
            "model": (model.get("type"), "BPE"),
            "pre_tokenizer": (pre.get("type"), "ByteLevel"),
            "normalizer": (config.get("normalizer"), None),
            "pre_tokenizer.add_prefix_space": (pre.get("add_prefix_space"), False),
            "model.dropout": (model.get("dropout"), None),
            "model.continuing_subword_prefix": (model.get("continuing_subword_prefix") or None, None),
            "model.end_of_word_suffix": (model.get("end_of_word_suffix") or None, None),
            "model.ignore_merges": (model.get("ignore_merges", False), False),
        }
        for name, (actual, expected) in problems.items():
            if actual != expected:
                raise ValueError(f"tokenizer: expected {name}={expected!r} (byte-level BPE), got {actual!r}")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        vocab = dict(model["vocab"])
        specials = {}
        for added in config.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
            specials[added["content"]] = added["id"]
        pattern = GPT2_SPLIT_PATTERN if pre.get("use_regex", True) else None
        return cls._from_gpt2_vocab(vocab, merges, pattern=pattern, special_tokens=specials)

    @classmethod
    def _from_gpt2_vocab(
        cls,
        vocab: Mapping[str, int],
        merges: Sequence[tuple[str, str]],
        *,
        pattern: str | None,
        special_tokens: Mapping[str, int] | None = None,
    ) -> BPETokenizer:
        """Build from token strings in GPT-2's byte-to-unicode alphabet (shared by both formats)."""
        to_byte = {char: b for b, char in bytes_to_unicode().items()}
        special_tokens = dict(special_tokens or {})
        merged_tokens = {left + right for left, right in merges}
        ids: dict[int, bytes] = {}
        for token, i in vocab.items():
            if token in special_tokens:
                ids[i] = token.encode("utf-8")
            elif len(token) == 1 and token in to_byte or token in merged_tokens:
                try:
                    ids[i] = bytes(to_byte[char] for char in token)
                except KeyError as exc:
                    raise ValueError(f"vocab: expected tokens in GPT-2's byte alphabet, got {token!r}") from exc
            else:
                special_tokens[token] = i
                ids[i] = token.encode("utf-8")
        pairs = {}
        for rank, (left, right) in enumerate(merges):
            for part in (left, right, left + right):
                if part not in vocab:
                    raise ValueError(f"merges: expected tokens in the vocabulary, got {part!r} in merge {rank}")
            pairs[(vocab[left], vocab[right])] = vocab[left + right]
        return cls(ids, pairs, pattern=pattern, special_tokens=special_tokens)
