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
from transformer_course.masking import causal_mask, fill_masked, masked_softmax, upcast

__all__ = [
    "attention_scores",
    "scaled_dot_product_attention",
    "zero_unseen",
    "MultiHeadAttention",
    "set_fast_path",
]


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


def zero_unseen(
    t: Float[Tensor, "... k_pos d"], mask: Bool[Tensor, "... q_pos k_pos"] | None
) -> Float[Tensor, "... k_pos d"]:
    """Values (or keys) `t` with zeros at the positions no query may attend (padding).

    Their weight is already 0, but 0 * NaN = NaN: without this, one NaN in a padded position
    would turn every output of the sequence into NaN.

    Course: chapter 2.
    """
    if mask is None:
        return t
    return t.masked_fill(~mask.any(dim=-2)[..., None], 0.0)


def scaled_dot_product_attention(
    q: Float[Tensor, "... q_pos d_head"],
    k: Float[Tensor, "... k_pos d_head"],
    v: Float[Tensor, "... k_pos d_v"],
    mask: Bool[Tensor, "... q_pos k_pos"] | None = None,
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
        d_model = validate.positive_int("d_model", d_model)
        n_heads = validate.positive_int("n_heads", n_heads)
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model: expected a multiple of n_heads={n_heads} when d_head is not "
                    f"given, got {d_model}"
                )
            d_head = d_model // n_heads
        d_head = validate.positive_int("d_head", d_head)
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

    def _check_input(self, name: str, t: Tensor, batch: int | None = None) -> None:
        if not isinstance(t, Tensor) or t.ndim != 3 or t.shape[-1] != self.d_model:
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"{name}: expected shape (batch, pos, d_model={self.d_model}), got {got}"
            )
        # Under autocast PyTorch casts inputs and weights itself.
        if t.dtype != self.W_Q.dtype and not torch.is_autocast_enabled(t.device.type):
            raise ValueError(
                f"{name}: expected dtype {self.W_Q.dtype} (the dtype of the weights), "
                f"got {t.dtype}; convert the input or the module with .to(dtype)"
            )
        if batch is not None and t.shape[0] != batch:
            raise ValueError(
                f"{name}: expected batch size {batch} (the batch size of x), got {t.shape[0]}"
            )

    def forward(
        self,
        x: Float[Tensor, "batch q_pos d_model"],
        context: Float[Tensor, "batch k_pos d_model"] | None = None,
        mask: Bool[Tensor, "... q_pos k_pos"] | None = None,
        *,
        causal: bool = False,
    ) -> Float[Tensor, "batch q_pos d_model"]:
        """Attend from every position of `x` to every allowed position of `context` (default `x`).

        `mask` is boolean, True = may attend, broadcastable to (batch, head, q_pos, k_pos):
        e.g. `causal_mask(q_pos)` or `padding_mask(tokens, pad_id)`. `causal=True` also hides
        the keys after each query, as `causal_mask` does; on the fast path with no other mask,
        SDPA does that itself (`is_causal=True`, FlashAttention on a GPU) with no mask built.
        """
        self._check_input("x", x)
        if context is None:
            context = x
        else:
            self._check_input("context", context, batch=x.shape[0])

        def project(inp: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
            out = einops.einsum(
                inp, W, "batch pos d_model, head d_model d_head -> batch pos head d_head"
            )
            return out if b is None else out + b

        if self.fast_path and context is x:  # self-attention: one matmul for q, k and v
            W = torch.cat([self.W_Q, self.W_K, self.W_V], dim=-1)
            b = None if self.b_Q is None else torch.cat([self.b_Q, self.b_K, self.b_V], dim=-1)
            q, k, v = project(x, W, b).split(self.d_head, dim=-1)
        else:
            q, k, v = (
                project(inp, W, b)
                for inp, W, b in (
                    (x, self.W_Q, self.b_Q),
                    (context, self.W_K, self.b_K),
                    (context, self.W_V, self.b_V),
                )
            )
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        # Heads become a batch dimension: (batch, head, pos, d_head).
        q, k, v = (
            einops.rearrange(t, "batch pos head d_head -> batch head pos d_head") for t in (q, k, v)
        )
        validate.attention_inputs(q, k, v, mask)
        if causal and (mask is not None or not self.fast_path or q.shape[-2] != k.shape[-2]):
            allowed = causal_mask(q.shape[-2], k.shape[-2], device=q.device)
            mask, causal = (allowed if mask is None else allowed & mask), False
        v = zero_unseen(v, mask)

        if self.fast_path:
            # The fused kernel adds -inf to masked scores, and NaN + -inf is NaN: zero k as well.
            k = zero_unseen(k, mask)
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            if mask is not None:  # rows with no allowed key are zero, whichever kernel ran
                z = z.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
        else:
            # Scores are float32 for half-precision inputs; the pattern has the input's dtype.
            scores = self.hook_attn_scores(fill_masked(attention_scores(q, k), mask))
            pattern = scores.softmax(dim=-1)
            if mask is not None:  # as in masked_softmax: rows with no allowed key become zeros
                pattern = pattern.masked_fill(~mask, 0.0)
            pattern = self.hook_pattern(pattern.to(v.dtype))
            z = einops.einsum(pattern, v, "... q_pos k_pos, ... k_pos d_head -> ... q_pos d_head")
        z = self.hook_z(einops.rearrange(z, "batch head q_pos d_head -> batch q_pos head d_head"))

        # Concatenating the heads and multiplying by a (head d_head, d_model) matrix is the same
        # as projecting each head with its own W_O[head] and summing over heads.
        out = einops.einsum(
            z, self.W_O, "batch q_pos head d_head, head d_head d_model -> batch q_pos d_model"
        )
        return out if self.b_O is None else out + self.b_O


def set_fast_path(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch every `MultiHeadAttention` in `model` to PyTorch's fused attention (`enabled=True`:
    faster and lighter on memory for training and sampling, pattern hooks not run) or back to
    the einsum path whose patterns can be inspected. Returns `model`.

    Course: chapter 2.
    """
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.fast_path = enabled
    return model
