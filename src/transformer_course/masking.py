"""Attention masks: who may look at whom.

Every mask here is boolean with **True = may attend**, the convention of
`torch.nn.functional.scaled_dot_product_attention`. Masks broadcast against attention
scores of shape `(batch, head, q_pos, k_pos)`:

* `causal_mask(q_len, k_len)` is `(q_pos, k_pos)`: no query sees a later key;
* `padding_mask(tokens, pad_id)` is `(batch, 1, 1, k_pos)`: no query sees a padding key;
* `combine_masks(...)` ANDs any of them together.

`masked_softmax` turns scores and a mask into an attention pattern without ever producing NaN:
masked scores are filled with the most negative *finite* number of the dtype (not -inf), and a
query row with no allowed key gets an all-zero pattern. Half-precision scores are exponentiated
and summed in float32 (`upcast`), as PyTorch's fused kernels do.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from transformer_course import validate

__all__ = [
    "upcast",
    "causal_mask",
    "padding_mask",
    "combine_masks",
    "fill_masked",
    "masked_softmax",
]


def upcast(t: Tensor) -> Tensor:
    """`t` in float32 if it is float16 or bfloat16, else unchanged: the dtype to accumulate in.

    Half precision loses too much in a long sum, and float16 overflows above 65504.

    Course: chapter 3.
    """
    return t.to(torch.promote_types(t.dtype, torch.float32))


def causal_mask(
    q_len: int, k_len: int | None = None, *, device: torch.device | str | None = None
) -> Bool[Tensor, "q_pos k_pos"]:
    """The causal mask: query `i` may attend to key `j` iff `j <= i + (k_len - q_len)`.

    With `k_len == q_len` (the default) this is the lower triangle, diagonal included: a token
    sees itself and everything before it. With `k_len > q_len` the queries are the *last*
    `q_len` positions of a sequence of `k_len` (a KV cache holds the earlier keys), so the
    last query sees every key.

    Course: chapter 3, exercise 3.1, checked by checks.masking.check_causal_mask.
    """
    q_len = validate.positive_int("q_len", q_len)
    k_len = q_len if k_len is None else validate.positive_int("k_len", k_len)
    if k_len < q_len:
        raise ValueError(
            f"k_len: expected k_len >= q_len={q_len} (queries are the last positions of the "
            f"keys), got {k_len}"
        )
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=k_len - q_len)


def padding_mask(
    tokens: Int[Tensor, "batch k_pos"], pad_id: int
) -> Bool[Tensor, "batch 1 1 k_pos"]:
    """True where a key is a real token, False where it is padding.

    Shaped `(batch, 1, 1, k_pos)` so it broadcasts over heads and *queries*: padding is a
    property of keys. (Padded query rows still produce outputs; the loss ignores them.)

    Course: chapter 3, exercise 3.2, checked by checks.masking.check_padding_mask.
    """
    validate.integer_tensor("tokens", tokens, ("batch", "k_pos"))
    validate.integer("pad_id", pad_id)
    return (tokens != pad_id)[:, None, None, :]


def combine_masks(*masks: Bool[Tensor, "*dims"] | None) -> Bool[Tensor, "*dims"] | None:
    """AND boolean masks together with broadcasting; `None` means "no restriction".

    `combine_masks(causal_mask(T), padding_mask(tokens, pad))` is `(batch, 1, T, T)`:
    a query sees a key only if it is not in the future *and* not padding. Every mask must be
    bool: a 0/1 float or int mask could mean either convention, so it is refused.

    Course: chapter 3, exercise 3.3, checked by checks.masking.check_combine_masks.
    """
    combined = None
    for index, mask in enumerate(masks):
        if mask is None:
            continue
        validate.bool_mask(mask, f"masks[{index}]")
        if combined is None:
            combined = mask
            continue
        try:
            torch.broadcast_shapes(combined.shape, mask.shape)
        except RuntimeError:
            raise ValueError(
                f"masks[{index}]: shape {tuple(mask.shape)} does not broadcast with the "
                f"earlier masks' shape {tuple(combined.shape)}"
            ) from None
        combined = combined & mask
    return combined


def fill_masked(
    scores: Float[Tensor, "... q_pos k_pos"], mask: Bool[Tensor, "... q_pos k_pos"] | None
) -> Float[Tensor, "... q_pos k_pos"]:
    """Replace the scores of forbidden keys by the most negative finite value of the dtype.

    Not -inf: a row whose keys are *all* forbidden would then be softmax(-inf, ..., -inf) = NaN.
    A finite fill still gives those entries weight exp(min - max) = 0 in any row that has one
    allowed key.

    Course: chapter 3.
    """
    if mask is None:
        return scores
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)


def masked_softmax(
    scores: Float[Tensor, "... q_pos k_pos"], mask: Bool[Tensor, "... q_pos k_pos"] | None = None
) -> Float[Tensor, "... q_pos k_pos"]:
    """Softmax over keys (the last dim) that ignores forbidden keys and never returns NaN.

    A query row with no allowed key gets an all-zero pattern (and so a zero output and zero
    gradients), which is also what `torch.nn.functional.scaled_dot_product_attention` returns.
    float16 and bfloat16 scores are handled in float32; the pattern has the scores' dtype.

    Course: chapter 3, exercise 3.4, checked by checks.masking.check_masked_softmax.
    """
    if mask is None:
        return upcast(scores).softmax(dim=-1).to(scores.dtype)
    validate.bool_mask(mask)
    pattern = fill_masked(upcast(scores), mask).softmax(dim=-1)
    return pattern.masked_fill(~mask, 0.0).to(scores.dtype)
