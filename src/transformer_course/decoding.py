"""Decoding: from a trained encoder–decoder and a batch of source ids to target ids, and from
strings to strings.

At test time there is no reference translation to feed the decoder: it reads its own output,
one token at a time. `greedy_decode` appends the most likely token at each step;
`beam_search` keeps the `beam_size` likeliest partial translations. Both return one list of ids
per source row, without the start and end tokens. `translate` wraps them with tokenizers that
carry the special tokens below.

The model is any encoder–decoder with `encode(src)`, `src_mask(src)`, `decode(tgt, memory,
src_mask)` and a `cfg` (`src_vocab`, `tgt_vocab`, `n_ctx`, `pad_id`), such as
`encoder_decoder.EncoderDecoderTransformer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.runtime import evaluating

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "SPECIAL_TOKENS",
    "UNK",
    "beam_search",
    "greedy_decode",
    "next_token_logits",
    "pad_batch",
    "translate",
]

# The special tokens a translation tokenizer carries; <unk> is reserved (byte-level BPE can
# encode any text).
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def _decode_args(
    model: nn.Module,
    src: Tensor,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int | None,
    max_len: int | None,
    beam_size: int = 1,
) -> int:
    """Check every argument of a decoder; returns `max_new_tokens`, given under either name."""
    max_new_tokens = validate.renamed("max_len", max_len, "max_new_tokens", max_new_tokens)
    validate.integer("max_new_tokens", max_new_tokens, low=1, high=model.cfg.n_ctx)
    validate.token_tensor("src", src, model.cfg.src_vocab, n_ctx=model.cfg.n_ctx)
    # An eos_id the model cannot emit would let every row run on to max_new_tokens.
    validate.token_id("bos_id", bos_id, model.cfg.tgt_vocab)
    validate.token_id("eos_id", eos_id, model.cfg.tgt_vocab)
    validate.positive_int("beam_size", beam_size)
    return max_new_tokens


@torch.no_grad()
def next_token_logits(
    model: nn.Module,
    tgt: Int[Tensor, "batch tgt_pos"],
    memory: Float[Tensor, "batch src_pos d_model"],
    src_mask: Bool[Tensor, "batch 1 1 src_pos"],
) -> Float[Tensor, "batch tgt_vocab"]:
    """The decoder's logits for the token after `tgt`. NaN or inf (broken weights) is an error:
    argmax would silently read a row of NaN as token 0.

    Course: chapter 5.
    """
    return validate.finite_logits(model.decode(tgt, memory, src_mask)[:, -1], "for the next token")


def greedy_decode(
    model: nn.Module,
    src: Int[Tensor, "batch src_pos"],
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int | None = None,
    max_len: int | None = None,
) -> list[list[int]]:
    """Translate by always taking the most likely next token; at most `max_new_tokens` tokens
    per row (`max_len` is its former name).

    Returns one list of ids per source row, without the start and end tokens.

    Course: chapter 5, exercise 5.9, checked by checks.translation.check_greedy_decode.
    """
    max_new_tokens = _decode_args(model, src, bos_id, eos_id, max_new_tokens, max_len)
    with evaluating(model):
        memory, src_mask = model.encode(src), model.src_mask(src)
        ys = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_new_tokens):
            next_token = next_token_logits(model, ys, memory, src_mask).argmax(dim=-1)
            next_token = next_token.masked_fill(finished, model.cfg.pad_id)
            ys = torch.cat([ys, next_token[:, None]], dim=1)
            finished |= next_token == eos_id
            if finished.all():
                break
    return [row[: row.index(eos_id)] if eos_id in row else row for row in ys[:, 1:].tolist()]


def beam_search(
    model: nn.Module,
    src: Int[Tensor, "batch src_pos"],
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int | None = None,
    beam_size: int = 4,
    length_penalty: float = 0.6,
    max_len: int | None = None,
) -> list[list[int]]:
    """Keep the `beam_size` likeliest partial translations at each step; return the best
    finished one of each source row (`max_len` is the former name of `max_new_tokens`).

    Hypotheses are ranked by total log-probability over `length ** length_penalty`, so long
    translations are not punished for having more factors below one. A beam of 1 is greedy.

    Course: chapter 5, exercise 5.10, checked by checks.translation.check_beam_search.
    """
    max_new_tokens = _decode_args(model, src, bos_id, eos_id, max_new_tokens, max_len, beam_size)

    def search(one: Int[Tensor, "1 src_pos"]) -> list[int]:
        """The best translation of one source sentence."""
        memory, src_mask = model.encode(one), model.src_mask(one)
        beams = torch.full((1, 1), bos_id, dtype=torch.long, device=src.device)  # <s> + tokens
        scores = torch.zeros(1, device=src.device)  # each live beam's total log-probability
        finished = []  # (length-normalised score, tokens) of the hypotheses that ended
        for step in range(max_new_tokens):
            n = len(beams)
            logits = next_token_logits(
                model, beams, memory.expand(n, -1, -1), src_mask.expand(n, -1, -1, -1)
            )
            candidates = (scores[:, None] + logits.float().log_softmax(dim=-1)).flatten()
            top, ids = candidates.topk(min(2 * beam_size, candidates.numel()))
            beam, token = ids // logits.shape[-1], ids % logits.shape[-1]
            # Best first, until beam_size candidates go on; those that end on the way finish.
            goes_on = token != eos_id
            considered = goes_on.cumsum(0) - goes_on.long() < beam_size
            ends, keep = considered & ~goes_on, considered & goes_on
            norm = (step + 1) ** length_penalty
            finished += [(s / norm, beams[b, 1:].tolist()) for s, b in zip(top[ends], beam[ends])]
            if len(finished) >= beam_size or not keep.any():
                break
            beams, scores = torch.cat([beams[beam[keep]], token[keep, None]], dim=1), top[keep]
        norm = (beams.shape[1] - 1) ** length_penalty  # if none ended, the live beams compete
        finished = finished or [(s / norm, b[1:].tolist()) for s, b in zip(scores, beams)]
        return max(finished, key=lambda item: item[0])[1]

    with evaluating(model):
        return [search(row[None]) for row in src]


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> Int[Tensor, "batch pos"]:
    """Right-pad lists of ids to the longest one.

    Course: chapter 5.
    """
    width = max(len(s) for s in sequences)
    return torch.tensor(
        [list(s) + [pad_id] * (width - len(s)) for s in sequences], dtype=torch.long
    )


def translate(
    model: nn.Module,
    sentences: Sequence[str],
    src_tokenizer: Any,
    tgt_tokenizer: Any = None,
    *,
    beam_size: int = 1,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    max_len: int | None = None,
) -> list[str]:
    """Translate strings to strings: tokenize, decode greedily (`beam_size=1`) or with a beam,
    detokenize.

    The tokenizers (`BPETokenizer`s) must carry the special tokens `<pad> <s> </s>`; one
    tokenizer serves both sides when the vocabulary is shared. `max_new_tokens=None` means the
    model's `n_ctx` (`max_len` is its former name).

    Course: chapter 5.
    """
    max_new_tokens = validate.renamed("max_len", max_len, "max_new_tokens", max_new_tokens)
    validate.sentences("sentences", sentences)
    validate.positive_int("batch_size", batch_size)
    tgt_tokenizer = tgt_tokenizer or src_tokenizer
    validate.special_tokens("src_tokenizer", src_tokenizer, (EOS,))
    validate.special_tokens("tgt_tokenizer", tgt_tokenizer, (BOS, EOS))
    src_eos = src_tokenizer.special_tokens[EOS]
    options = dict(
        bos_id=tgt_tokenizer.special_tokens[BOS],
        eos_id=tgt_tokenizer.special_tokens[EOS],
        max_new_tokens=model.cfg.n_ctx if max_new_tokens is None else max_new_tokens,
    )
    if beam_size > 1:
        options["beam_size"] = beam_size
    decode = greedy_decode if beam_size == 1 else beam_search
    device = next(model.parameters()).device
    out: list[str] = []
    for start in range(0, len(sentences), batch_size):
        ids = [src_tokenizer.encode(s) + [src_eos] for s in sentences[start : start + batch_size]]
        rows = decode(model, pad_batch(ids, model.cfg.pad_id).to(device), **options)
        out += [tgt_tokenizer.decode(row) for row in rows]
    return out
