# %% [markdown]
# # Chapter 1 workbook: tokenization
#
# You will build byte-level byte pair encoding (BPE), the tokenizer of GPT-2, in five steps:
#
# 1. `get_pair_counts`: how often each pair of neighbouring ids occurs.
# 2. `merge_pair`: replace every occurrence of one pair by a new id.
# 3. `train_merges`: learn merges by repeatedly merging the most frequent pair.
# 4. `encode_chunk`: apply learned merges to new text.
# 5. `decode_ids`: turn ids back into text.
#
# Text starts as UTF-8 bytes, so ids 0..255 are the raw bytes and every merge creates the next
# id from 256 on. Each check cell compares your code with the course's reference, and when
# they differ it tells you which classic mistake your output matches. The chapter's book page
# explains the why.

# %% tags=nbval-ignore-output
import heapq
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import regex

from transformer_course.checks.tokenization import (
    check_decode_ids,
    check_encode_chunk,
    check_get_pair_counts,
    check_merge_pair,
    check_train_merges,
)
from transformer_course.data import load_text
from transformer_course.runtime import describe, pick, seed_everything
from transformer_course.tokenization import GPT2_SPLIT_PATTERN, Pair

seed_everything(0)
print(describe())

# %% [markdown]
# ## Exercise 1.1: `get_pair_counts`
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

# %% [markdown]
# ## Exercise 1.2: `merge_pair`
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

# %% [markdown]
# ## Exercise 1.3: `train_merges`
#
# The input is every distinct chunk of training text (as bytes) with how often it occurs; the
# output is `{pair: new_id}` in the order the merges were learned. The simplest correct loop:
# count pairs over all chunks (weighted), take the most frequent pair, give it the next id,
# merge it in every chunk, repeat. The reference keeps the counts up to date instead of
# recounting (only chunks that contain the merged pair change), which is what makes training
# on a whole book fast; the simple loop passes the check too. Ties may go either way.

# %% [exercise] transformer_course.tokenization:train_merges difficulty=3 importance=5 minutes=25
# hint: Keep every chunk as a list of ids. One merge step is: count pairs over all chunks, pick the
#   most frequent, give it the next free id, merge it everywhere.
# hint: Reuse your `get_pair_counts` with `weight=` the chunk's count, so a chunk seen 3 times
#   counts 3 times. The first new id is 256, then 257, ...
# hint: Stop early when no chunk has a pair left. `max(counts, key=counts.get)` picks the most
#   frequent pair; record it in an insertion-ordered dict.

# %% [check]
check_train_merges(train_merges)

# %% [markdown]
# On the worked example of the book, three merges turn `aaabdaaabac` into five tokens:

# %% [check]
merges = train_merges({b"aaabdaaabac": 1}, 3)
print(merges)

# %% [markdown]
# ## Exercise 1.4: `encode_chunk`
#
# New text is encoded by replaying the merges. Not in the order the pairs appear in the text,
# but in the order they were learned: `ranks[pair]` is that position (0 for the first merge)
# and `merges[pair]` the id it creates. Repeatedly merge the lowest-ranked pair present until
# no pair of the chunk has a rank. (The reference uses a heap of positions so very long chunks
# stay fast; a loop over `min(zip(ids, ids[1:]), key=...)` with your `merge_pair` is fine.)

# %% [exercise] transformer_course.tokenization:encode_chunk difficulty=3 importance=5 minutes=20
# hint: The order that matters is the order merges were learned (`ranks`), not the order of pairs in
#   the text.
# hint: Loop: among the neighbouring pairs of the current ids, find the one with the lowest rank; if
#   none has a rank you are done, else merge it with your `merge_pair`.

# %% [check]
check_encode_chunk(encode_chunk)

# %% [markdown]
# ## Exercise 1.5: `decode_ids`
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

# %% [markdown]
# ## Putting it together
#
# Your five functions make a tokenizer. Split Tiny Shakespeare with GPT-2's pattern, learn
# merges, encode, decode, and measure the compression in bytes per token.

# %% [check]
text = load_text("tinyshakespeare")[: pick(quick=200_000, full=1_000_000)]
chunks = regex.findall(GPT2_SPLIT_PATTERN, text)
merges = train_merges(Counter(chunk.encode("utf-8") for chunk in chunks), 500)
ranks = {pair: rank for rank, pair in enumerate(merges)}
vocab = {b: bytes([b]) for b in range(256)}
for (left, right), new_id in merges.items():
    vocab[new_id] = vocab[left] + vocab[right]

ids = [token for chunk in chunks for token in encode_chunk(list(chunk.encode("utf-8")), merges, ranks)]
assert decode_ids(ids, vocab) == text
print(f"{len(text.encode('utf-8')):,} bytes -> {len(ids):,} tokens: {len(text.encode('utf-8')) / len(ids):.2f} bytes per token")
print("longest tokens:", sorted((vocab[i] for i in merges.values()), key=len)[-5:])

# %% [markdown]
# ## Going further
#
# - `transformer_course.tokenization.BPETokenizer` wraps these functions with special tokens,
#   a per-chunk cache, save/load and GPT-2's file format. Train one with
#   `BPETokenizer.train(text, 1000, pattern=GPT2_SPLIT_PATTERN)` and compare its ids with a
#   Hugging Face `tokenizers` BPE copied by `BPETokenizer.from_huggingface`.
# - Train without the pattern (`regex.findall` replaced by one chunk per line). Which merges
#   appear that GPT-2's split forbids?
