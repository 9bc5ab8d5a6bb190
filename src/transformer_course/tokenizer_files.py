"""Reading other people's byte-level BPE tokenizers into the course's `BPETokenizer`.

Two formats hold the same thing, a vocabulary and an ordered list of merges, with every token
written in GPT-2's printable byte alphabet (`bytes_to_unicode`, where the space is `Ġ`):

- OpenAI's GPT-2 files: `vocab.json` (token -> id; OpenAI calls it `encoder.json`) and
  `merges.txt` (one `left right` per line, in training order; OpenAI's `vocab.bpe`);
- a Hugging Face `tokenizers.Tokenizer` with a byte-level BPE model.

Each reader returns the constructor arguments of a `BPETokenizer` (`vocab`, `merges`, `pattern`,
`special_tokens`), so `BPETokenizer.from_gpt2_files` and `BPETokenizer.from_huggingface` stay
one line each. Ids are kept exactly, so the course encodes to the very ids the originals do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformer_course.tokenization import GPT2_SPLIT_PATTERN, _is_id, _read_json, _read_text

__all__ = ["bytes_to_unicode", "read_gpt2_files", "read_huggingface"]


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
    vocab = _read_json(Path(vocab_json), "vocab_json")
    if not isinstance(vocab, dict):
        raise ValueError(
            f"vocab_json: expected an object {{token: id}} in {str(vocab_json)!r}, "
            f"got {type(vocab).__name__}"
        )
    for token, i in vocab.items():
        if not _is_id(i):
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
