"""Decoding: from a trained encoder–decoder and a batch of source ids to target ids.

At test time there is no reference translation to feed the decoder: it reads its own output,
one token at a time. `greedy_decode` appends the most likely token at each step;
`beam_search` keeps the `beam_size` likeliest partial translations. Both return one list of ids
per source row, without the start and end tokens. (`translation.translate` wraps them to go
from strings to strings.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from transformer_course import validate
from transformer_course.runtime import evaluating

if TYPE_CHECKING:
    from transformer_course.encoder_decoder import EncoderDecoderTransformer

__all__ = ["beam_search", "greedy_decode", "next_token_logits"]


def _validate_decode_args(
    model: EncoderDecoderTransformer, src: Tensor, max_len: int, bos_id: int, eos_id: int
) -> None:
    validate.integer("max_len", max_len, low=1, high=model.cfg.max_len)
    model._validate_tokens("src", src, model.cfg.src_vocab)
    # An eos_id the model cannot emit would let every row run on to max_len.
    validate.token_id("bos_id", bos_id, model.cfg.tgt_vocab)
    validate.token_id("eos_id", eos_id, model.cfg.tgt_vocab)


@torch.no_grad()
def next_token_logits(
    model: EncoderDecoderTransformer,
    tgt: Int[Tensor, "batch tgt_pos"],
    memory: Float[Tensor, "batch src_pos d_model"],
    src_mask: Bool[Tensor, "batch 1 1 src_pos"],
) -> Float[Tensor, "batch tgt_vocab"]:
    """The decoder's logits for the token after `tgt`. NaN or inf (broken weights) is an error:
    argmax would silently read a row of NaN as token 0.

    Course: chapter 5.
    """
    logits = model.decode(tgt, memory, src_mask)[:, -1]
    if not logits.isfinite().all():
        raise FloatingPointError(
            "model: the decoder's logits are not finite; check its weights and the input"
        )
    return logits


def greedy_decode(
    model: EncoderDecoderTransformer,
    src: Int[Tensor, "batch src_pos"],
    *,
    bos_id: int,
    eos_id: int,
    max_len: int,
) -> list[list[int]]:
    """Translate by always taking the most likely next token; at most `max_len` tokens per row.

    Returns one list of ids per source row, without the start and end tokens.

    Course: chapter 5, exercise 5.8, checked by checks.encoder_decoder.check_greedy_decode.
    """
    _validate_decode_args(model, src, max_len, bos_id, eos_id)
    with evaluating(model):
        memory, src_mask = model.encode(src), model.src_mask(src)
        ys = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            next_token = next_token_logits(model, ys, memory, src_mask).argmax(dim=-1)
            next_token = next_token.masked_fill(finished, model.cfg.pad_id)
            ys = torch.cat([ys, next_token[:, None]], dim=1)
            finished |= next_token == eos_id
            if finished.all():
                break
    out = []
    for row in ys[:, 1:].tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


def beam_search(
    model: EncoderDecoderTransformer,
    src: Int[Tensor, "batch src_pos"],
    *,
    bos_id: int,
    eos_id: int,
    max_len: int,
    beam_size: int = 4,
    length_penalty: float = 0.6,
) -> list[list[int]]:
    """Keep the `beam_size` likeliest partial translations at each step; return the best
    finished one of each source row.

    Hypotheses are ranked by total log-probability divided by `length ** length_penalty`, so
    longer translations are not unfairly punished for having more factors below one. With
    `beam_size=1` this is greedy decoding.

    Course: chapter 5, exercise 5.9, checked by checks.encoder_decoder.check_beam_search.
    """
    _validate_decode_args(model, src, max_len, bos_id, eos_id)
    validate.positive_int("beam_size", beam_size)
    results = []
    with evaluating(model):
        for row in src:
            row = row[None]
            memory, src_mask = model.encode(row), model.src_mask(row)
            beams = torch.full((1, 1), bos_id, dtype=torch.long, device=src.device)
            scores = torch.zeros(1, device=src.device)
            finished: list[tuple[float, list[int]]] = []
            for step in range(max_len):
                n = beams.shape[0]
                logits = next_token_logits(
                    model, beams, memory.expand(n, -1, -1), src_mask.expand(n, -1, -1, -1)
                )
                candidates = (scores[:, None] + logits.float().log_softmax(dim=-1)).flatten()
                top_scores, top_ids = candidates.topk(min(2 * beam_size, candidates.numel()))
                vocab = logits.shape[-1]
                keep_beam, keep_token, keep_score = [], [], []
                for score, index in zip(top_scores.tolist(), top_ids.tolist()):
                    beam, token = divmod(index, vocab)
                    if token == eos_id:
                        normalised = score / (step + 1) ** length_penalty
                        finished.append((normalised, beams[beam, 1:].tolist()))
                    else:
                        keep_beam.append(beam)
                        keep_token.append(token)
                        keep_score.append(score)
                    if len(keep_beam) == beam_size:
                        break
                if len(finished) >= beam_size or not keep_beam:
                    break
                index = torch.tensor(keep_beam, device=src.device)
                tokens = torch.tensor(keep_token, device=src.device)[:, None]
                beams = torch.cat([beams[index], tokens], dim=1)
                scores = torch.tensor(keep_score, device=src.device)
            if not finished:  # nothing ended within max_len: fall back to the live beams
                length = beams.shape[1] - 1
                finished = [
                    (s / length**length_penalty, b[1:])
                    for s, b in zip(scores.tolist(), beams.tolist())
                ]
            results.append(max(finished, key=lambda item: item[0])[1])
    return results
