"""Head detectors: what kind of head each attention head is, read from its attention pattern.

Each detector takes one layer's pattern `(batch, head, q_pos, k_pos)` (as cached at
`blocks.{l}.attn.hook_pattern`) and returns one score per head in [0, 1]: the mean attention
it pays to the key that kind of head looks at, over the batch and the queries that have a
choice (query 0 can only attend to itself, so it is left out).

- previous-token head: each query attends to the position just before it (the diagonal -1);
- first-token head: each query attends to position 0 (often a "resting" position, BOS);
- induction head (Olsson et al., 2022): on a random segment written twice, each query of the
  second repeat attends to the token *after* the same token's earlier occurrence, seg_len - 1
  positions back (the diagonal at offset -(seg_len - 1)), so it can copy that token next.

`repeated_tokens` makes the sequences the induction score is read on (an optional BOS, then a
random segment, then the same segment again), and `repeat_losses` the per-token loss on the
first and on the second repeat: a model with an induction head predicts the second far better.
"""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from transformer_course import validate

__all__ = [
    "prev_token_scores",
    "first_token_scores",
    "induction_scores",
    "repeated_tokens",
    "per_token_loss",
    "repeat_losses",
]


def _pattern(pattern: Tensor) -> Tensor:
    """A pattern `(batch, head, q_pos, k_pos)` of a self-attention (q_pos == k_pos), checked."""
    if not isinstance(pattern, Tensor) or pattern.ndim != 4:
        got = tuple(pattern.shape) if isinstance(pattern, Tensor) else type(pattern).__name__
        raise ValueError(f"pattern: expected a tensor (batch, head, q_pos, k_pos), got {got}")
    if pattern.shape[-1] != pattern.shape[-2] or pattern.shape[-1] < 2:
        shape = tuple(pattern.shape)
        raise ValueError(f"pattern: expected q_pos == k_pos >= 2 (self-attention), got {shape}")
    return pattern


def prev_token_scores(pattern: Float[Tensor, "batch head q_pos k_pos"]) -> Float[Tensor, " head"]:
    """Mean attention from each query (1 ..) to the position just before it.

    Course: chapter 10, exercise 10.2, checked by checks.interpretability.check_prev_token_scores.
    """
    diagonal = _pattern(pattern).diagonal(offset=-1, dim1=-2, dim2=-1)  # (batch, head, q_pos - 1)
    return einops.reduce(diagonal, "batch head q -> head", "mean")


def first_token_scores(pattern: Float[Tensor, "batch head q_pos k_pos"]) -> Float[Tensor, " head"]:
    """Mean attention from each query (1 ..) to position 0.

    Course: chapter 10, exercise 10.3, checked by checks.interpretability.check_first_token_scores.
    """
    return einops.reduce(_pattern(pattern)[:, :, 1:, 0], "batch head q -> head", "mean")


def induction_scores(
    pattern: Float[Tensor, "batch head q_pos k_pos"], seg_len: int
) -> Float[Tensor, " head"]:
    """Mean attention from each query of the second repeat (the last `seg_len` positions) to the
    token after the same token's earlier occurrence: the diagonal at offset -(seg_len - 1).

    The convention is Olsson et al.'s and ARENA's: for tokens [BOS, x, x] with `x` of length
    `seg_len` (or [x, x] without BOS), query `q` of the second repeat holds the token seen at
    `q - seg_len`, and the induction head attends to `q - seg_len + 1`, the token that came next.

    Course: chapter 10, exercise 10.4, checked by checks.interpretability.check_induction_scores.
    """
    pattern = _pattern(pattern)
    validate.integer("seg_len", seg_len, low=2, high=pattern.shape[-1] // 2)
    diagonal = pattern.diagonal(offset=-(seg_len - 1), dim1=-2, dim2=-1)
    return einops.reduce(diagonal[..., -seg_len:], "batch head q -> head", "mean")


def repeated_tokens(
    batch: int,
    seg_len: int,
    d_vocab: int,
    *,
    bos: int | None = None,
    seed: int = 0,
) -> Int[Tensor, "batch pos"]:
    """`batch` rows of a uniformly random segment of `seg_len` tokens written twice, after `bos`
    if given (`pos` = 2 seg_len, + 1 with BOS); seeded, so the same call gives the same tokens.
    Tokens are drawn from 0 .. d_vocab - 1 leaving out `bos`, so BOS appears once per row.

    Course: chapter 10.
    """
    validate.positive_int("batch", batch)
    validate.integer("seg_len", seg_len, low=2)
    validate.integer("d_vocab", d_vocab, low=2 if bos is None else 3)
    if bos is not None:
        bos = validate.token_id("bos", bos, d_vocab)
    generator = torch.Generator().manual_seed(seed)
    high = d_vocab if bos is None else d_vocab - 1
    segment = torch.randint(0, high, (batch, seg_len), generator=generator)
    if bos is not None:
        segment = segment + (segment >= bos).long()  # skip the BOS id
    rows = [segment, segment]
    if bos is not None:
        rows.insert(0, torch.full((batch, 1), bos, dtype=torch.long))
    return torch.cat(rows, dim=1)


def per_token_loss(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"]
) -> Float[Tensor, "batch pos_minus_1"]:
    """The cross-entropy of each next token: entry `i` is the loss of predicting `tokens[:, i+1]`
    from position `i`."""
    validate.same_batch("tokens", tokens, logits, "logits")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens: expected shape {tuple(logits.shape[:2])} (logits' batch, pos), "
            f"got {tuple(tokens.shape)}"
        )
    log_probs = F.log_softmax(logits[:, :-1].double(), dim=-1)
    return -log_probs.gather(-1, tokens[:, 1:, None])[..., 0].to(logits.dtype)


def repeat_losses(
    loss: Float[Tensor, "batch pos_minus_1"], seg_len: int
) -> tuple[Float[Tensor, "batch seg_minus_1"], Float[Tensor, "batch seg_minus_1"]]:
    """The per-token loss (from `per_token_loss`) on the first and on the second repeat: the
    losses of predicting each token of a repeat but its first (which nothing predicts: the
    segment is random, and nothing says where it restarts). The sequences end with the
    second repeat, so this works with or without BOS.

    Course: chapter 10, exercise 10.5, checked by checks.interpretability.check_repeat_losses.
    """
    validate.integer("seg_len", seg_len, low=2, high=(loss.shape[-1] + 1) // 2)
    # targets are positions 1 .. pos - 1; the second repeat's tokens are the last seg_len
    second = loss[:, -(seg_len - 1) :]
    first = loss[:, -(2 * seg_len - 1) : -seg_len]
    return first, second
