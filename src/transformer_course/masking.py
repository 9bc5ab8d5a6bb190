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
and summed in float32, as PyTorch's fused kernels do.

Chapter 2's attention already takes masks, so `causal_mask`, `fill_masked` and `masked_softmax`
are written in `attention` (modules import only earlier chapters); this chapter explains them
and they are importable from here.
"""

from __future__ import annotations

from jaxtyping import Bool, Int
from torch import Tensor

from transformer_course import validate
from transformer_course.attention import causal_mask, fill_masked, masked_softmax

__all__ = [
    "causal_mask",
    "padding_mask",
    "combine_masks",
    "fill_masked",
    "masked_softmax",
]


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


def combine_masks(*masks: Bool[Tensor, "..."] | None) -> Bool[Tensor, "..."] | None:  # noqa: UP037
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
        validate.bool_mask(f"masks[{index}]", mask)
        if combined is None:
            combined = mask
            continue
        validate.broadcastable(f"masks[{index}]", mask.shape, combined.shape)
        combined = combined & mask
    return combined
