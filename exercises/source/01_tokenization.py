# %% [markdown]
# # Chapter 1 workbook: tokenization
#
# You will build two tokenizers: a warm-up with one token per character, then byte-level byte
# pair encoding (BPE), the tokenizer of GPT-2, from its parts up to the whole encoder:
#
# 1. `CharTokenizer`: one id per distinct character.
# 2. `get_pair_counts`: how often each pair of neighbouring ids occurs.
# 3. `merge_pair`: replace every occurrence of one pair by a new id.
# 4. `train_merges`: learn merges by repeatedly merging the most frequent pair.
# 5. `encode_chunk`: apply learned merges to new text.
# 6. `decode_ids`: turn ids back into text.
# 7. `BPETokenizer.encode`: the whole encoder, with special tokens and GPT-2's regex pre-split.
#
# Text starts as UTF-8 bytes, so ids 0..255 are the raw bytes and every merge creates the next
# id from 256 on. Each check cell compares your code with the course's reference, and when
# they differ it tells you which classic mistake your output matches. The chapter's book page
# explains the why. At the end, your encoder reads GPT-2's real tokenizer files.

# %% tags=nbval-ignore-output
from __future__ import annotations

import heapq
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import regex

from transformer_course import tokenizer_files, validate
from transformer_course.checks.tokenization import (
    check_bpe_encode,
    check_char_tokenizer,
    check_decode_ids,
    check_encode_chunk,
    check_get_pair_counts,
    check_merge_pair,
    check_train_merges,
)
from transformer_course.data import fetch, load_text
from transformer_course.files import atomic_write
from transformer_course.parts import keep
from transformer_course.runtime import by_profile, describe_run, seed_everything
from transformer_course.tokenization import (  # what BPETokenizer uses besides your functions
    CACHE_SIZE,
    SHORT_CHUNK,
    SPACE_BEFORE_WORD,
    Tokenizer,
    _byte_ids,
    _Memo,
    _special_pattern,
    _token_ids_by_bytes,
    count_chunks,
    encode_long_chunk,
    load_gpt2_tokenizer,
    split_chunks,
)
from transformer_course.tokenizer_files import GPT2_SPLIT_PATTERN, TokenPair, check_tables

seed_everything(0)
print(describe_run())

# %% [markdown]
# ## Exercise 1.1: `CharTokenizer`
#
# The simplest tokenizer gives each distinct character of a training text its own id, as
# nanoGPT does for Shakespeare. Number the characters in sorted order, so the same text always
# gives the same ids. `self.vocab` maps each id to its character (the base class `Tokenizer`
# counts it for `vocab_size`); `encode` turns a string into ids and `decode` ids into a string.

# %% [exercise] transformer_course.tokenization:CharTokenizer blank=__init__,encode,decode difficulty=1 importance=3 minutes=10
# hint: Two dicts do all the work: one from id to character (`self.vocab`) and one back.
# hint: `set(text)` has no fixed order; sort it before numbering. A character the tokenizer never
#   saw has no id: let the lookup fail rather than skip it.

# %% [check]
check_char_tokenizer(CharTokenizer)
keep(CharTokenizer)
chars = CharTokenizer(load_text("tinyshakespeare"))
ids = chars.encode("To be")
print(f"{chars.vocab_size} characters; 'To be' -> {ids} -> {chars.decode(ids)!r}")

# %% [markdown]
# ## Exercise 1.2: `get_pair_counts`
#
# Count each pair of neighbours: `[1, 2, 3, 1, 2]` has `(1, 2)` twice and `(2, 3)`, `(3, 1)`
# once. Training counts pairs over many chunks of text and a chunk that occurs 3 times counts
# 3 times, so the function adds `weight` per occurrence to the dict `counts` it is given.

# %% [exercise] transformer_course.tokenization:get_pair_counts difficulty=1 importance=3 minutes=5
# hint: Neighbouring pairs are what you get by walking `ids` and its copy shifted by one side by
#   side.
# hint: `zip(ids, ids[1:])` yields every neighbouring pair once. Each occurrence adds `weight`, not
#   1, and `counts` may arrive already filled (or be `None`).

# %% [check]
check_get_pair_counts(get_pair_counts)
keep(get_pair_counts)

# %% [markdown]
# ## Exercise 1.3: `merge_pair`
#
# Replace the pair by `new_id`, scanning left to right. Occurrences of a pair can overlap:
# in `[a, a, a]` the pair `(a, a)` starts at 0 and at 1, but the middle `a` can only belong to
# one token, so the answer is `[X, a]`, never `[X, X]`.

# %% [exercise] transformer_course.tokenization:merge_pair difficulty=2 importance=4 minutes=10
# hint: Build a new list while scanning with an index you move yourself, rather than a `for` loop
#   over positions: after a merge you must skip a position.
# hint: At index `i`: if `ids[i]` and `ids[i + 1]` form the pair, emit `new_id` and move two places;
#   otherwise emit `ids[i]` and move one. Mind the last element.

# %% [check]
check_merge_pair(merge_pair)
keep(merge_pair)

# %% [markdown]
# ## Exercise 1.4: `train_merges`
#
# The input is every distinct chunk of training text (as bytes) with how often it occurs; the
# output is `{pair: new_id}` in the order the merges were learned, new ids counting up from 256.
# Each merge takes the pair that is most frequent at that moment, counting a chunk that occurs
# 3 times 3 times. When several pairs tie for most frequent, any of them is right: the check
# accepts each. A pair that occurs once still counts, but a pair that occurs no more does not:
# when no chunk has a pair left, stop, so a short text gives fewer merges than `num_merges`.
#
# Recounting every pair after each merge is correct and passes the check; the reference keeps
# the counts up to date instead (only chunks that contain the merged pair change), which is
# what makes training on a whole book fast.

# %% [exercise] transformer_course.tokenization:train_merges difficulty=3 importance=5 minutes=25
# docstring: Learn up to `num_merges` merges from chunks of bytes and how often each chunk
#   occurs: each merges a most frequent pair (any, on a tie) into the next new id, from 256,
#   until no chunk has a pair left. Returns `{pair: new_id}` in the order learned.
# hint: Keep every chunk as a list of ids. One merge step: count the pairs over all chunks, pick
#   a most frequent one, give it the next free id, merge it everywhere.
# hint: Reuse your `get_pair_counts` with `weight=` the chunk's count, so a chunk seen 3 times
#   counts 3 times. An empty count means no pair is left.
# hint: `max(counts, key=counts.get)` picks a most frequent pair (on a tie, the first counted:
#   that is fine); record it in an insertion-ordered dict and break when `counts` is empty.

# %% [check]
check_train_merges(train_merges)
keep(train_merges)

# %% [markdown]
# On the worked example of the book, three merges turn `aaabdaaabac` into five tokens:

# %% [check]
merges = train_merges({b"aaabdaaabac": 1}, 3)
print(merges)

# %% [markdown]
# ## Exercise 1.5: `encode_chunk`
#
# New text is encoded by replaying the merges. Not in the order the pairs appear in the text,
# but in the order they were learned: `ranks[pair]` is that position (0 for the first merge)
# and `merges[pair]` the id it creates. Repeatedly merge the lowest-ranked pair present until
# no pair of the chunk has a rank. (A loop over `min(zip(ids, ids[1:]), key=...)` with your
# `merge_pair` is fine; the reference updates only the two pairs beside each merge.)

# %% [exercise] transformer_course.tokenization:encode_chunk difficulty=3 importance=5 minutes=20
# docstring: Apply learned merges to one chunk's `ids` and return the new ids: always the
#   pair learned first (lowest `ranks[pair]`), leftmost first, until no neighbouring pair was
#   ever learned. `merges[pair]` is the id that merging `pair` creates.
# hint: The order that matters is the order merges were learned (`ranks`), not the order of pairs in
#   the text.
# hint: Loop: among the neighbouring pairs of the current ids, find the one with the lowest rank; if
#   none has a rank you are done, else merge it with your `merge_pair`.

# %% [check]
check_encode_chunk(encode_chunk)
keep(encode_chunk)

# %% [markdown]
# ## Exercise 1.6: `decode_ids`
#
# `vocab[i]` is the bytes of token `i`. A character's bytes can be split across tokens ("é" is
# the two bytes `C3 A9`, which may land in two tokens), so join all the bytes first and decode
# UTF-8 once. Arbitrary ids can spell invalid UTF-8: decode with `errors="replace"`.

# %% [exercise] transformer_course.tokenization:decode_ids difficulty=1 importance=4 minutes=5
# hint: A token can end in the middle of a character's UTF-8 bytes, so decoding token by token
#   breaks on "é".
# hint: Join all the tokens' bytes into one `bytes` object first, then decode once with
#   `errors="replace"`.

# %% [check]
check_decode_ids(decode_ids)
keep(decode_ids)

# %% [markdown]
# ## Exercise 1.7: `BPETokenizer.encode`
#
# Your functions become a tokenizer. `BPETokenizer` holds the tables (`vocab`, `merges`,
# `ranks`, `special_tokens`) and turns text into ids in three stages:
#
# 1. **Special tokens** such as `<|endoftext|>` are not text: cut them out first, and each
#    becomes its own id. `self._special_split` (or `None` without special tokens) is a compiled
#    regex with one capturing group, so its `split` keeps the special tokens in the result.
# 2. **The pre-split**: the text between special tokens is cut into chunks with the pattern
#    (`self._split`, GPT-2's regex or `None`); `split_chunks` does it and keeps any text the
#    pattern does not match. Merges never cross a chunk.
# 3. **Merges**: each chunk's UTF-8 bytes become byte ids (`self.byte_ids[b]`), merged by your
#    `encode_chunk`. The method `_encode_chunks` does this for a list of chunks, encoding each
#    distinct chunk once.
#
# The rest of the class (training, saving, loading, GPT-2's files) is given.

# %% [exercise] transformer_course.tokenization:BPETokenizer blank=encode difficulty=3 importance=5 minutes=20
# hint: The order of the three stages matters: a special token cut into chunks first would be
#   merged like any text. What does `regex.split` return when its pattern has a capturing group?
# hint: In the list that `self._special_split.split(text)` returns, the special tokens are at the
#   odd positions and the text between them at the even ones (possibly empty strings).
# hint: Never let a merge join two chunks: cut each piece of text with `split_chunks` and the
#   pattern, and encode its chunks apart (`_encode_chunks` takes a list of chunks).

# %% [check]
check_bpe_encode(BPETokenizer)
keep(BPETokenizer)

# %% [markdown]
# ## Putting it together
#
# Train your tokenizer on Tiny Shakespeare with GPT-2's pattern and a special token, and measure
# the compression in bytes per token. Then load GPT-2's real tokenizer files into *your* class:
# with your `encode_chunk` and your `encode`, it gives the same ids as the course's copy (which
# the tests compare with OpenAI's tiktoken and Hugging Face on whole corpora).

# %% [check]
text = load_text("tinyshakespeare")[: by_profile(quick=200_000, full=1_000_000)]
ours = BPETokenizer.train(text, 756, pattern=GPT2_SPLIT_PATTERN, special_tokens=["<|endoftext|>"])
ids = ours.encode(text + "<|endoftext|>")
assert ours.decode(ids) == text + "<|endoftext|>"
assert ids[-1] == ours.special_tokens["<|endoftext|>"]
n_bytes = len(text.encode("utf-8"))
print(f"{n_bytes:,} bytes -> {len(ids):,} tokens: {n_bytes / len(ids):.2f} bytes per token")
print("longest tokens:", sorted((ours.vocab[i] for i in ours.merges.values()), key=len)[-5:])

gpt2 = BPETokenizer.from_gpt2_files(fetch("gpt2", "encoder.json"), fetch("gpt2", "vocab.bpe"))
sample = "First Citizen: Before we proceed any further, hear me speak.<|endoftext|>"
print([gpt2.decode([i]) for i in gpt2.encode(sample)])
assert gpt2.encode(text[:20_000]) == load_gpt2_tokenizer().encode(text[:20_000])
print("your encoder gives GPT-2's ids")

# %% [markdown]
# ## Going further
#
# - Train without the pattern (`pattern=None`, the whole text one chunk per piece). Which merges
#   appear that GPT-2's split forbids?
# - Compare your tokenizer with a Hugging Face `tokenizers` BPE trained on the same text and
#   copied by `BPETokenizer.from_huggingface`: the book page shows the ids agree.
