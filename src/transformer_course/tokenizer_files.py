"""Tokenizer files: the course's own JSON, OpenAI's GPT-2 files and Hugging Face's tokenizers,
each read into the constructor arguments of a `BPETokenizer` (`vocab`, `merges`, `pattern`,
`special_tokens`), and the check that those tables agree (`check_tables`).

The two outside formats hold the same thing, a vocabulary and an ordered list of merges, with
every token written in GPT-2's printable byte alphabet (`bytes_to_unicode`, where the space is
`Ġ`):

- OpenAI's GPT-2 files: `vocab.json` (token -> id; OpenAI calls it `encoder.json`) and
  `merges.txt` (one `left right` per line, in training order; OpenAI's `vocab.bpe`);
- a Hugging Face `tokenizers.Tokenizer` with a byte-level BPE model.

Ids are kept exactly, so the course encodes to the very ids the originals do. GPT-2's pre-split
pattern lives here too, as part of GPT-2's format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformer_course import validate
from transformer_course.files import atomic_write, read_json, read_text

__all__ = [
    "GPT2_SPLIT_PATTERN",
    "TokenPair",
    "bytes_to_unicode",
    "check_tables",
    "read_bpe",
    "read_gpt2_files",
    "read_huggingface",
    "write_bpe",
]

TokenPair = tuple[int, int]  # two neighbouring token ids

# GPT-2's pre-split (Radford et al., 2019): contractions, letters, digits, other symbols and
# whitespace become separate chunks, and merges never cross a chunk boundary.
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

FILE_FORMAT = "transformer_course.bpe"
FILE_VERSION = 1


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, used in `vocab.json`/`merges.txt`.

    Printable Latin-1 bytes stand for themselves; the others (control characters, space, ...)
    are shifted to code points from 256 on, so every token is a visible string.

    Course: chapter 1.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def read_gpt2_files(vocab_json: str | Path, merges_txt: str | Path) -> dict[str, Any]:
    """`BPETokenizer` arguments from GPT-2's `vocab.json` (token -> id) and `merges.txt`.

    Vocabulary entries that are neither a byte nor a merge result (`<|endoftext|>`) become
    special tokens; the pre-split is GPT-2's.

    Course: chapter 1.
    """
    vocab = read_json(Path(vocab_json), "vocab_json")
    if not isinstance(vocab, dict):
        raise ValueError(
            f"vocab_json: expected an object {{token: id}} in {str(vocab_json)!r}, "
            f"got {type(vocab).__name__}"
        )
    for token, i in vocab.items():
        if not validate.is_int(i):
            raise ValueError(
                f"vocab_json: expected integer ids in {str(vocab_json)!r}, "
                f"got {i!r} for the entry {token!r}"
            )
    merges = []
    lines = read_text(Path(merges_txt), "merges_txt").splitlines()
    for number, line in enumerate(lines, start=1):
        if line.startswith("#version") or not line.strip():
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"merges_txt: expected 'left right' on line {number}, got {line!r}")
        merges.append((parts[0], parts[1]))
    return _from_byte_alphabet(vocab, merges, pattern=GPT2_SPLIT_PATTERN)


def read_huggingface(tokenizer: Any) -> dict[str, Any]:
    """`BPETokenizer` arguments from a Hugging Face `tokenizers.Tokenizer` with a byte-level BPE
    model; its added tokens become special tokens, and ids stay identical.

    Course: chapter 1.
    """
    try:
        config = json.loads(tokenizer.to_str())
    except AttributeError:
        raise TypeError(
            f"tokenizer: expected a tokenizers.Tokenizer, got {type(tokenizer).__name__}"
        ) from None
    model, pre = config["model"], config.get("pre_tokenizer") or {}
    settings = {  # what would change the tokens: (its value, the value the course reads)
        "model": (model.get("type"), "BPE"),
        "pre_tokenizer": (pre.get("type"), "ByteLevel"),
        "normalizer": (config.get("normalizer"), None),
        "pre_tokenizer.add_prefix_space": (pre.get("add_prefix_space"), False),
        "model.dropout": (model.get("dropout"), None),
        "model.continuing_subword_prefix": (model.get("continuing_subword_prefix") or None, None),
        "model.end_of_word_suffix": (model.get("end_of_word_suffix") or None, None),
        "model.ignore_merges": (model.get("ignore_merges", False), False),
    }
    for name, (actual, expected) in settings.items():
        if actual != expected:
            raise ValueError(
                f"tokenizer: expected {name}={expected!r} (byte-level BPE), got {actual!r}"
            )
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = dict(model["vocab"])
    specials = {}
    for added in config.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        specials[added["content"]] = added["id"]
    pattern = GPT2_SPLIT_PATTERN if pre.get("use_regex", True) else None
    return _from_byte_alphabet(vocab, merges, pattern=pattern, special_tokens=specials)


def _from_byte_alphabet(
    vocab: Mapping[str, int],
    merges: Sequence[tuple[str, str]],
    *,
    pattern: str | None,
    special_tokens: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """`BPETokenizer` arguments from token strings in GPT-2's byte alphabet (both formats')."""
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
                raise ValueError(
                    f"vocab: expected tokens in GPT-2's byte alphabet, got {token!r}"
                ) from exc
        else:
            special_tokens[token] = i
            ids[i] = token.encode("utf-8")
    pairs = {}
    for rank, (left, right) in enumerate(merges):
        for part in (left, right, left + right):
            if part not in vocab:
                raise ValueError(
                    f"merges: expected tokens in the vocabulary, got {part!r} in merge {rank}"
                )
        pairs[(vocab[left], vocab[right])] = vocab[left + right]
    return {"vocab": ids, "merges": pairs, "pattern": pattern, "special_tokens": special_tokens}


def check_tables(
    vocab: Mapping[int, bytes], merges: Mapping[TokenPair, int], special_tokens: Mapping[str, int]
) -> None:
    """Raise a clear error unless ids are 0..len(vocab)-1 and merges and special tokens agree with
    the vocabulary: tables that disagree would encode or decode wrongly without an error."""
    for i, token in vocab.items():
        if not validate.is_int(i) or not 0 <= i < len(vocab):
            raise ValueError(
                f"vocab: expected ids 0..{len(vocab) - 1} (one per token), got id {i!r}"
            )
        if not isinstance(token, bytes) or not token:
            raise ValueError(f"vocab: expected non-empty bytes for id {i}, got {token!r}")
    created: set[int] = set()
    for rank, (pair, new_id) in enumerate(merges.items()):
        ids = (*pair, new_id) if isinstance(pair, tuple) and len(pair) == 2 else ()
        if not ids or any(not validate.is_int(j) or j not in vocab for j in ids):
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
        if not isinstance(token, str) or not token or not validate.is_int(i) or i not in vocab:
            raise ValueError(
                "special_tokens: expected non-empty strings with ids in the vocabulary, "
                f"got {token!r}: {i!r}"
            )
        if vocab[i] != token.encode("utf-8"):
            raise ValueError(
                f"special_tokens: {token!r} has id {i}, but vocab has {vocab[i]!r} for that id"
            )


def write_bpe(path: str | Path, tables: Mapping[str, Any]) -> None:
    """Write `BPETokenizer` arguments as the course's JSON (token bytes in hex), atomically."""
    state = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "pattern": tables["pattern"],
        "vocab": {str(i): token.hex() for i, token in tables["vocab"].items()},
        "merges": [[left, right, new_id] for (left, right), new_id in tables["merges"].items()],
        "special_tokens": tables["special_tokens"],
    }
    atomic_write(path, json.dumps(state, indent=1))


def read_bpe(path: str | Path) -> dict[str, Any]:
    """`BPETokenizer` arguments from a file `write_bpe` wrote, every field checked: a file that
    disagrees with itself is refused with its name and the field.

    Course: chapter 1.
    """
    path = Path(path)
    state = read_json(path, "path")
    if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"path: expected a {FILE_FORMAT!r} JSON file written by BPETokenizer.save, "
            f"got {found!r} in {str(path)!r}"
        )
    try:
        tables = _tables_from_state(state)
        check_tables(tables["vocab"], tables["merges"], tables["special_tokens"])
        validate.regex_pattern("pattern", tables["pattern"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"path: {str(path)!r} is not a valid tokenizer file: {exc}") from None
    return tables


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


def _tables_from_state(state: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments stored by `BPETokenizer.save`, each field checked by name."""
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
        if not isinstance(merge, list) or len(merge) != 3 or not all(map(validate.is_int, merge)):
            raise ValueError(
                f"field 'merges': expected [left, right, new_id] ids, got {merge!r} at index {rank}"
            )
        merges[(merge[0], merge[1])] = merge[2]
    if len(merges) != len(listed):
        raise ValueError("field 'merges': expected each pair to be merged once, got one twice")
    return {
        "vocab": vocab,
        "merges": merges,
        "special_tokens": _load_field(state, "special_tokens", dict, "an object {token: id}"),
        "pattern": _load_field(state, "pattern", (str, type(None)), "a regular expression or null"),
    }
