"""The transformer block: attention and an MLP, each wrapped in a residual connection and a
layer norm. One block serves the encoder and the decoder of chapter 5, the chapter 4
experiment and GPT-2 (chapter 6).

Names follow TransformerLens (`ln1`, `attn`, `ln2`, `mlp`, `W_in`, `hook_resid_pre`, ...), so a
TransformerLens `TransformerBlock` state dict loads directly and `run_with_cache` shows the same
activations under the same names. The decoder's cross-attention, which TransformerLens does not
have, adds `ln_cross`, `cross_attn`, `hook_cross_attn_out` and `hook_resid_mid_cross`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.attention import LayerCache, MultiHeadAttention
from transformer_course.layernorm import LayerNorm

__all__ = ["ACTIVATIONS", "MLP", "TransformerBlock", "residual_sublayer"]

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation of GELU
    "gelu": F.gelu,  # the exact GELU, x * Phi(x)
    "relu": F.relu,  # the original transformer's (Vaswani et al., 2017)
}


class MLP(nn.Module):
    """Position-wise feed-forward network: widen to `d_mlp`, apply the nonlinearity, project back.

    Each position goes through the same two linear maps on its own; this is where most of a
    transformer's parameters live (with d_mlp = 4 d_model, two thirds of each block's).

    Course: chapter 5, exercise 5.3, checked by checks.translation.check_mlp.
    """

    def __init__(self, d_model: int, d_mlp: int, act_fn: str = "gelu_new"):
        super().__init__()
        validate.positive_int("d_model", d_model)
        validate.positive_int("d_mlp", d_mlp)
        validate.one_of("act_fn", act_fn, ACTIVATIONS)
        self.d_model, self.d_mlp, self.act_fn = d_model, d_mlp, act_fn
        self.W_in = nn.Parameter(torch.empty(d_model, d_mlp))
        self.b_in = nn.Parameter(torch.zeros(d_mlp))
        self.W_out = nn.Parameter(torch.empty(d_mlp, d_model))
        self.b_out = nn.Parameter(torch.zeros(d_model))
        nn.init.normal_(self.W_in, std=0.02)
        nn.init.normal_(self.W_out, std=0.02)
        self.hook_pre = HookPoint()  # [*batch, d_mlp]: before the nonlinearity
        self.hook_post = HookPoint()  # [*batch, d_mlp]: after it (the "neurons")

    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        validate.last_dim("x", x, self.d_model)
        pre = self.hook_pre(
            einops.einsum(x, self.W_in, "... d_model, d_model d_mlp -> ... d_mlp") + self.b_in
        )
        post = self.hook_post(ACTIVATIONS[self.act_fn](pre))
        return (
            einops.einsum(post, self.W_out, "... d_mlp, d_mlp d_model -> ... d_model") + self.b_out
        )


def residual_sublayer(
    resid: Float[Tensor, "batch pos d_model"],
    sublayer: Callable[[Tensor], Tensor],
    ln: nn.Module,
    *,
    norm: Literal["pre", "post"],
    dropout: Callable[[Tensor], Tensor],
    hook_out: Callable[[Tensor], Tensor],
) -> Float[Tensor, "batch pos d_model"]:
    """One sublayer (an attention or the MLP) with its dropout, residual connection and norm.

    Pre-LN (GPT-2, most modern models) normalises the sublayer's *input* and leaves the
    residual stream itself untouched; post-LN (the original transformer) normalises the *sum*:

        norm="pre":   resid + dropout(sublayer(ln(resid)))
        norm="post":  ln(resid + dropout(sublayer(resid)))

    `hook_out` receives what the sublayer adds to the stream (after dropout), and what it
    returns is what gets added, so a hook can patch it.

    Course: chapter 5, exercise 5.4, checked by checks.translation.check_residual_sublayer.
    """
    if norm == "pre":
        return resid + hook_out(dropout(sublayer(ln(resid))))
    return ln(resid + hook_out(dropout(sublayer(resid))))


class TransformerBlock(HookedRootModule):
    """Self-attention, optionally cross-attention, then an MLP: each a `residual_sublayer`.

    `causal=True` (GPT-2, the decoder) hides from each position the positions after it;
    `causal=False` (the encoder) lets every position see every other. `cross_attention=True`
    (the decoder) adds a second attention whose queries come from the residual stream and whose
    keys and values come from `context`, the encoder's output. `norm` is "pre" or "post" (see
    `residual_sublayer`); `dropout` (default 0) applies to each sublayer's output.

    Course: chapter 5, exercise 5.5, checked by checks.translation.check_seq2seq_block.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_head: int,
        d_mlp: int,
        *,
        layer_norm_eps: float = 1e-5,
        norm: Literal["pre", "post"] = "pre",
        act_fn: str = "gelu_new",
        dropout: float = 0.0,
        causal: bool = True,
        cross_attention: bool = False,
    ):
        super().__init__()
        validate.one_of("norm", norm, ("pre", "post"))
        validate.probability("dropout", dropout)
        validate.flag("causal", causal)
        validate.flag("cross_attention", cross_attention)
        self.d_model, self.norm = d_model, norm
        self.causal, self.cross_attention = causal, cross_attention
        self.ln1 = LayerNorm(d_model, eps=layer_norm_eps)
        self.attn = MultiHeadAttention(d_model, n_heads, d_head)
        if cross_attention:
            self.ln_cross = LayerNorm(d_model, eps=layer_norm_eps)
            self.cross_attn = MultiHeadAttention(d_model, n_heads, d_head)
        self.ln2 = LayerNorm(d_model, eps=layer_norm_eps)
        self.mlp = MLP(d_model, d_mlp, act_fn=act_fn)
        self.dropout = nn.Dropout(dropout)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]: what self-attention adds
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]: after self-attention
        if cross_attention:
            self.hook_cross_attn_out = HookPoint()  # [batch, pos, d_model]: what it adds
            self.hook_resid_mid_cross = HookPoint()  # [batch, pos, d_model]: after it
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]: what the MLP adds
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        self.setup()

    def _validate_inputs(self, resid: Tensor, context: Tensor | None) -> None:
        if not isinstance(resid, Tensor) or resid.ndim != 3:
            got = (
                f"shape {tuple(resid.shape)}" if isinstance(resid, Tensor) else type(resid).__name__
            )
            raise ValueError(
                f"resid: expected shape (batch, pos, d_model={self.d_model}), got {got}"
            )
        validate.last_dim("resid", resid, self.d_model)
        if resid.shape[1] == 0:
            raise ValueError(
                f"resid: expected at least one position, got shape {tuple(resid.shape)}"
            )
        if self.cross_attention and context is None:
            raise ValueError(
                f"context: expected the encoder output, shape (batch, context_pos, "
                f"d_model={self.d_model}), for the cross-attention, got None"
            )
        if not self.cross_attention and context is not None:
            raise ValueError(
                "context: expected None (the block has no cross-attention; build it with "
                "cross_attention=True), got a tensor"
            )

    def forward(
        self,
        resid: Float[Tensor, "batch pos d_model"],
        mask: Bool[Tensor, "*#batch #pos #pos"] | Bool[Tensor, "#pos"] | None = None,
        context: Float[Tensor, "batch context_pos d_model"] | None = None,
        context_mask: Bool[Tensor, "*#batch #pos #context_pos"]
        | Bool[Tensor, "#context_pos"]
        | None = None,
        *,
        cache: LayerCache | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Run the block. `mask` (True = may attend), e.g. `padding_mask(tokens, pad_id)`,
        restricts the keys self-attention sees, on top of the causal mask when `self.causal`.
        `context` and `context_mask` feed the cross-attention: the encoder's output and the
        source padding mask. `cache` holds the keys and values of earlier
        positions, which self-attention extends with this call's."""
        self._validate_inputs(resid, context)
        norm_and_dropout = dict(norm=self.norm, dropout=self.dropout)
        resid = self.hook_resid_pre(resid)

        def attend(x: Tensor) -> Tensor:
            return self.attn(x, mask=mask, causal=self.causal, cache=cache)

        resid = residual_sublayer(
            resid, attend, self.ln1, hook_out=self.hook_attn_out, **norm_and_dropout
        )
        resid = self.hook_resid_mid(resid)
        if self.cross_attention:

            def attend_to_context(x: Tensor) -> Tensor:
                return self.cross_attn(x, context, mask=context_mask)

            resid = residual_sublayer(
                resid,
                attend_to_context,
                self.ln_cross,
                hook_out=self.hook_cross_attn_out,
                **norm_and_dropout,
            )
            resid = self.hook_resid_mid_cross(resid)
        resid = residual_sublayer(
            resid, self.mlp, self.ln2, hook_out=self.hook_mlp_out, **norm_and_dropout
        )
        return self.hook_resid_post(resid)
