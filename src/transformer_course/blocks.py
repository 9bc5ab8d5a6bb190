"""The transformer block: attention and an MLP, each wrapped in a residual connection and a
layer norm. Shared by the chapter 4 experiment and GPT-2 (chapter 6).

Names follow TransformerLens (`ln1`, `attn`, `ln2`, `mlp`, `W_in`, `hook_resid_pre`, ...), so a
TransformerLens `TransformerBlock` state dict loads directly and `run_with_cache` shows the same
activations under the same names.
"""

from __future__ import annotations

from typing import Literal

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.attention import MultiHeadAttention
from transformer_course.layernorm import LayerNorm

__all__ = ["ACTIVATIONS", "MLP", "TransformerBlock"]

ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation of GELU
    "gelu": F.gelu,  # the exact GELU, x * Phi(x)
    "relu": F.relu,  # the original transformer's (Vaswani et al., 2017)
}


class MLP(nn.Module):
    """Position-wise feed-forward network: widen to `d_mlp`, apply the nonlinearity, project back.

    Each position goes through the same two linear maps on its own; this is where most of a
    transformer's parameters live (with d_mlp = 4 d_model, two thirds of each block's).
    """

    def __init__(self, d_model: int, d_mlp: int, act_fn: str = "gelu_new"):
        super().__init__()
        for name, value in (("d_model", d_model), ("d_mlp", d_mlp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if act_fn not in ACTIVATIONS:
            raise ValueError(f"act_fn: expected one of {sorted(ACTIVATIONS)}, got {act_fn!r}")
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
        validate.last_dim(x, self.d_model)
        pre = self.hook_pre(einops.einsum(x, self.W_in, "... d_model, d_model d_mlp -> ... d_mlp") + self.b_in)
        post = self.hook_post(ACTIVATIONS[self.act_fn](pre))
        return einops.einsum(post, self.W_out, "... d_mlp, d_mlp d_model -> ... d_model") + self.b_out


class TransformerBlock(HookedRootModule):
    """A decoder-only block: causal self-attention, then an MLP, each added to the residual stream.

    `norm="pre"` (GPT-2, most modern models) normalises each sublayer's *input* and leaves the
    residual stream itself untouched:

        x = x + attn(ln1(x));  x = x + mlp(ln2(x))

    `norm="post"` (the original transformer) normalises *after* each residual addition:

        x = ln1(x + attn(x));  x = ln2(x + mlp(x))

    `dropout` (default 0) is applied to each sublayer's output before it is added, as in GPT-2.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_head: int,
        d_mlp: int,
        *,
        ln_eps: float = 1e-5,
        norm: Literal["pre", "post"] = "pre",
        act_fn: str = "gelu_new",
        dropout: float = 0.0,
    ):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm: expected 'pre' or 'post', got {norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout!r}")
        self.d_model, self.norm = d_model, norm
        self.ln1 = LayerNorm(d_model, eps=ln_eps)
        self.attn = MultiHeadAttention(d_model, n_heads, d_head)
        self.ln2 = LayerNorm(d_model, eps=ln_eps)
        self.mlp = MLP(d_model, d_mlp, act_fn=act_fn)
        self.dropout = nn.Dropout(dropout)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]: what attention adds to the stream
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]: what the MLP adds to the stream
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        self.setup()

    def forward(
        self,
        resid: Float[Tensor, "batch pos d_model"],
        mask: Bool[Tensor, "... pos pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Run the block. Attention is always causal; `mask` (True = may attend), e.g.
        `padding_mask(tokens, pad_id)`, further restricts which keys each query sees."""
        if not isinstance(resid, Tensor) or resid.ndim != 3:
            got = f"shape {tuple(resid.shape)}" if isinstance(resid, Tensor) else type(resid).__name__
            raise ValueError(f"resid: expected shape (batch, pos, d_model={self.d_model}), got {got}")
        validate.last_dim(resid, self.d_model, name="resid")
        if resid.shape[1] == 0:
            raise ValueError(f"resid: expected at least one position, got shape {tuple(resid.shape)}")

        resid = self.hook_resid_pre(resid)
        if self.norm == "pre":
            attn_out = self.attn(self.ln1(resid), mask=mask, causal=True)
            attn_out = self.hook_attn_out(self.dropout(attn_out))
            resid = self.hook_resid_mid(resid + attn_out)
            mlp_out = self.hook_mlp_out(self.dropout(self.mlp(self.ln2(resid))))
            return self.hook_resid_post(resid + mlp_out)
        attn_out = self.hook_attn_out(self.dropout(self.attn(resid, mask=mask, causal=True)))
        resid = self.hook_resid_mid(self.ln1(resid + attn_out))
        mlp_out = self.hook_mlp_out(self.dropout(self.mlp(resid)))
        return self.hook_resid_post(self.ln2(resid + mlp_out))
