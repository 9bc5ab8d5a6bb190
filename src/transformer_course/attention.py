"""Scaled dot-product attention and multi-head attention.

Attention is a soft database lookup: each query is compared with every key, the scores are
turned into weights by a softmax over the keys, and the output is the weighted average of the
values. `MultiHeadAttention` runs `n_heads` such lookups in parallel on learned projections of
the input and sums their projected outputs.

Shapes and parameter names follow TransformerLens (`W_Q` is `(n_heads, d_model, d_head)`, ...),
so a TransformerLens `Attention` state dict loads directly, and the hook points have the same
names (`hook_q`, `hook_pattern`, ...), so `run_with_cache` shows every intermediate tensor.
Masks are boolean with True = may attend (see `transformer_course.masking`).

Numerics: float16 and bfloat16 inputs get their scores, softmax and weighted sum computed in
float32 (a float16 dot product overflows at 65504), and results come back in the input dtype.
Values (and, for the fused kernel, keys) at positions no query may attend (padding) are zeroed,
so a NaN or inf there never reaches an output. A NaN at a key that some query may attend is
data, not padding: it reaches the queries that attend it and, through 0 * NaN = NaN, the other
queries of the same head too, as in `torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.runtime import upcast

__all__ = [
    "causal_mask",
    "fill_masked",
    "masked_softmax",
    "attention_scores",
    "scaled_dot_product_attention",
    "zero_unseen",
    "LayerCache",
    "Mask",
    "MultiHeadAttention",
    "set_fast_path",
]


# A boolean mask, True = may attend, that broadcasts to the scores (..., q_pos, k_pos): for
# example (q_pos, k_pos) for the causal mask, (batch, 1, 1, k_pos) for padding, or (k_pos,).
Mask = Bool[Tensor, "*#batch #q_pos #k_pos"] | Bool[Tensor, "#k_pos"]

# Masks, and the softmax over the keys a mask allows. Chapter 3 explains them; they are written
# here because attention takes masks from the start.


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
    why = "queries are the last positions of the keys"
    k_len = q_len if k_len is None else validate.at_least("k_len", k_len, "q_len", q_len, why)
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return allowed.tril(diagonal=k_len - q_len)


def fill_masked(
    scores: Float[Tensor, "... q_pos k_pos"], mask: Mask | None
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
    scores: Float[Tensor, "... q_pos k_pos"], mask: Mask | None = None
) -> Float[Tensor, "... q_pos k_pos"]:
    """Softmax over keys (the last dim) that ignores forbidden keys and never returns NaN.

    A query row with no allowed key gets an all-zero pattern (and so a zero output and zero
    gradients), which is also what `torch.nn.functional.scaled_dot_product_attention` returns.
    float16 and bfloat16 scores are handled in float32; the pattern has the scores' dtype.

    Course: chapter 3, exercise 3.4, checked by checks.masking.check_masked_softmax.
    """
    if mask is None:
        return upcast(scores).softmax(dim=-1).to(scores.dtype)
    validate.bool_mask("mask", mask)
    pattern = fill_masked(upcast(scores), mask).softmax(dim=-1)
    return pattern.masked_fill(~mask, 0.0).to(scores.dtype)


# Attention.


def attention_scores(
    q: Float[Tensor, "... q_pos d_head"], k: Float[Tensor, "... k_pos d_head"]
) -> Float[Tensor, "... q_pos k_pos"]:
    """Every query dotted with every key, divided by sqrt(d_head).

    Without the scaling the dot product of two random unit-variance vectors has variance
    d_head, so large heads push the softmax into saturation where its gradient vanishes.
    float16 and bfloat16 inputs give float32 scores: float16 overflows at 65504.

    Course: chapter 2, exercise 2.1, checked by checks.attention.check_attention_scores.
    """
    # Scaling q (q_pos x d_head numbers) costs less than scaling the scores (q_pos x k_pos).
    q = upcast(q) / math.sqrt(q.shape[-1])
    return einops.einsum(q, upcast(k), "... q_pos d_head, ... k_pos d_head -> ... q_pos k_pos")


def zero_unseen(t: Float[Tensor, "... k_pos d"], mask: Mask | None) -> Float[Tensor, "... k_pos d"]:
    """Values (or keys) `t` with zeros at the positions no query may attend (padding).

    Their weight is already 0, but 0 * NaN = NaN: without this, one NaN in a padded position
    would turn every output of the sequence into NaN.

    Course: chapter 2.
    """
    if mask is None:
        return t
    seen = mask.any(dim=-2) if mask.ndim >= 2 else mask  # a 1-d mask is the same for every query
    return t.masked_fill(~seen[..., None], 0.0)


def scaled_dot_product_attention(
    q: Float[Tensor, "... q_pos d_head"],
    k: Float[Tensor, "... k_pos d_head"],
    v: Float[Tensor, "... k_pos d_v"],
    mask: Mask | None = None,
) -> tuple[Float[Tensor, "... q_pos d_v"], Float[Tensor, "... q_pos k_pos"]]:
    """softmax(q k^T / sqrt(d_head)) v, returning the output and the attention pattern.

    The softmax runs over keys: each query's weights sum to one (or are all zero when the
    mask forbids every key of that query). Half-precision inputs are computed in float32 and
    both results come back in the input dtype.

    Course: chapter 2, exercise 2.2, checked by checks.attention.check_scaled_dot_product_attention.
    """
    validate.attention_inputs(q, k, v, mask)
    pattern = masked_softmax(attention_scores(q, k), mask)
    v = upcast(zero_unseen(v, mask))
    out = einops.einsum(pattern, v, "... q_pos k_pos, ... k_pos d_v -> ... q_pos d_v")
    return out.to(q.dtype), pattern.to(q.dtype)


class LayerCache:
    """One attention layer's cached keys and values, each `(batch, n_heads, pos, d_head)`, in
    the attributes `k` and `v` (`None` while empty): the attention's `forward(..., cache=...)`
    calls `extend`, which appends each call's new positions and returns all of them. Made for
    chapter 2's attention, used by chapter 6's and chapter 7's KV caches.

    Course: chapter 2.
    """

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None) -> None:
        self.k, self.v = k, v

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new positions' keys and values; return all of them."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
        self.k, self.v = k, v
        return k, v


class MultiHeadAttention(HookedRootModule):
    """Multi-head attention with TransformerLens parameter names, shapes and hook points.

    `forward(x)` is self-attention; `forward(x, context)` is cross-attention, with queries
    from `x` and keys and values from `context` (the encoder output in chapter 5).

    Two paths compute the same thing. The default materialises the attention pattern with
    einsums, so `hook_attn_scores` and `hook_pattern` can be inspected. Set
    `fast_path=True` (in the constructor, for a whole model with `set_fast_path`) to call
    `torch.nn.functional.scaled_dot_product_attention` instead: faster and lighter on memory
    for training, but the pattern hooks are not run.

    Course: chapter 2, exercise 2.3, checked by checks.attention.check_multi_head_attention.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_head: int | None = None,
        bias: bool = True,
        *,
        fast_path: bool = False,
    ) -> None:
        super().__init__()
        d_head = validate.head_size(d_model, n_heads, d_head)
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_head
        self.fast_path = fast_path

        self.W_Q = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_K = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_V = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_O = nn.Parameter(torch.empty(n_heads, d_head, d_model))
        bias_shapes = {name: (n_heads, d_head) for name in ("b_Q", "b_K", "b_V")}
        for name, shape in {**bias_shapes, "b_O": (d_model,)}.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)) if bias else None)
        self.reset_parameters()

        self.hook_q = HookPoint()  # (batch, q_pos, head, d_head)
        self.hook_k = HookPoint()  # (batch, k_pos, head, d_head)
        self.hook_v = HookPoint()  # (batch, k_pos, head, d_head)
        self.hook_attn_scores = HookPoint()  # (batch, head, q_pos, k_pos), masked, before softmax
        self.hook_pattern = HookPoint()  # (batch, head, q_pos, k_pos)
        self.hook_z = HookPoint()  # (batch, q_pos, head, d_head)
        self.setup()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: weights from N(0, 0.02^2), biases zero."""
        for weight in (self.W_Q, self.W_K, self.W_V, self.W_O):
            nn.init.normal_(weight, std=0.02)
        for bias in (self.b_Q, self.b_K, self.b_V, self.b_O):
            if bias is not None:
                nn.init.zeros_(bias)

    def forward(
        self,
        x: Float[Tensor, "batch q_pos d_model"],
        context: Float[Tensor, "batch k_pos d_model"] | None = None,
        mask: Mask | None = None,
        *,
        causal: bool = False,
        cache: LayerCache | None = None,
    ) -> Float[Tensor, "batch q_pos d_model"]:
        """Attend from every position of `x` to every allowed position of `context` (default `x`).

        `mask` is boolean, True = may attend, broadcastable to (batch, head, q_pos, k_pos):
        e.g. `causal_mask(q_pos)` or `padding_mask(tokens, pad_id)`. `causal=True` also hides
        the keys after each query, as `causal_mask` does. `cache` keeps the keys and values of
        earlier positions (chapter 6's KV cache): the queries are then the last positions.
        """
        validate.attention_input("x", x, self.d_model, self.W_Q.dtype)
        if context is None:
            context = x
        else:
            validate.attention_input("context", context, self.d_model, self.W_Q.dtype, x.shape[0])
        q, k, v = self._project(x, context)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        # Heads become a batch dimension: (batch, head, pos, d_head).
        q, k, v = (einops.rearrange(t, "batch pos head d -> batch head pos d") for t in (q, k, v))
        if cache is not None:
            k, v = cache.extend(k, v)
        validate.attention_inputs(q, k, v, mask)
        mask, is_causal = self._mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
        v = zero_unseen(v, mask)
        z = (
            self._attend_fused(q, k, v, mask, is_causal)
            if self.fast_path
            else self._attend(q, k, v, mask)
        )
        z = self.hook_z(einops.rearrange(z, "batch head q_pos d -> batch q_pos head d"))
        # Concatenating the heads and multiplying by a (head d_head, d_model) matrix is the same
        # as projecting each head with its own W_O[head] and summing over heads.
        out = einops.einsum(
            z, self.W_O, "batch q_pos head d_head, head d_head d_model -> batch q_pos d_model"
        )
        return out if self.b_O is None else out + self.b_O

    def _project(self, x: Tensor, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q from `x`, k and v from `context`, each (batch, pos, head, d_head). The fast path
        projects self-attention's q, k and v with one matmul (the same numbers)."""

        def project(inp: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
            out = einops.einsum(
                inp, W, "batch pos d_model, head d_model d_head -> batch pos head d_head"
            )
            return out if b is None else out + b

        if self.fast_path and context is x:
            W = torch.cat([self.W_Q, self.W_K, self.W_V], dim=-1)
            b = None if self.b_Q is None else torch.cat([self.b_Q, self.b_K, self.b_V], dim=-1)
            return project(x, W, b).split(self.d_head, dim=-1)
        return project(x, self.W_Q, self.b_Q), *(
            project(context, W, b) for W, b in ((self.W_K, self.b_K), (self.W_V, self.b_V))
        )

    def _mask(self, mask, causal: bool, q_len: int, k_len: int, device) -> tuple[Tensor, bool]:
        """The mask to apply, and whether the fused kernel applies the causal mask itself: with no
        other mask and as many queries as keys, `is_causal=True` builds no mask (and lets
        FlashAttention run on a GPU)."""
        if mask is not None:  # as (batch, head, q_pos, k_pos), the shape the fused kernel reads
            mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        if not causal:
            return mask, False
        if self.fast_path and mask is None and q_len == k_len:
            return None, True
        allowed = causal_mask(q_len, k_len, device=device)
        return (allowed if mask is None else allowed & mask), False

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """The einsum path: scores and pattern are materialised and pass their hook points.
        Scores are float32 for half-precision inputs; the pattern has the input's dtype."""
        scores = self.hook_attn_scores(fill_masked(attention_scores(q, k), mask))
        pattern = scores.softmax(dim=-1)
        if mask is not None:  # as in masked_softmax: rows with no allowed key become zeros
            pattern = pattern.masked_fill(~mask, 0.0)
        pattern = self.hook_pattern(pattern.to(v.dtype))
        return einops.einsum(pattern, v, "... q_pos k_pos, ... k_pos d_head -> ... q_pos d_head")

    @staticmethod
    def _attend_fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool):
        """PyTorch's fused kernel. It adds -inf to masked scores, and NaN + -inf is NaN: keys at
        positions no query sees are zeroed as values are, and rows with no allowed key are
        zeros, whichever kernel ran."""
        z = F.scaled_dot_product_attention(
            q, zero_unseen(k, mask), v, attn_mask=mask, is_causal=is_causal
        )
        return z if mask is None else z.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


def set_fast_path(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch every `MultiHeadAttention` in `model` to PyTorch's fused attention (`enabled=True`:
    faster and lighter on memory for training and sampling, pattern hooks not run) or back to
    the einsum path whose patterns can be inspected. Returns `model`.

    Course: chapter 2.
    """
    for module in model.modules():
        if hasattr(module, "fast_path"):  # yours too: any attention module with the switch
            module.fast_path = enabled
    return model
