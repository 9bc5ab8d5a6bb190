"""Layer normalisation (Ba et al., 2016) and RMSNorm (Zhang & Sennrich, 2019).

Both normalise each position's vector over its last dimension, `d_model`, so every token is
treated on its own: no statistics are shared across the batch or along the sequence. Parameter
and hook names follow TransformerLens, so a TransformerLens `LayerNorm` or `RMSNorm` state dict
loads directly.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from transformer_course import validate
from transformer_course.runtime import upcast


class LayerNorm(nn.Module):
    """Normalise each vector to zero mean and unit variance, then scale by `w` and shift by `b`.

    The variance is the biased one (divide by `d_model`, as `torch.nn.LayerNorm` does) and `eps`
    sits inside the square root, so a constant vector gives `b` rather than a division by zero.
    float16 and bfloat16 inputs are normalised in float32 (in float16, squaring overflows once
    |x| > 256) and the result is returned in the input's dtype.

    Course: chapter 4, exercise 4.1, checked by checks.layernorm.check_layernorm.
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        validate.norm_args(d_model, eps)
        self.d_model = d_model
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        self.b = nn.Parameter(torch.zeros(d_model))
        # [*batch, 1]: the standard deviation each vector is divided by
        self.hook_scale = HookPoint()
        # [*batch, d_model]: the normalised vector, before the learned scale and shift
        self.hook_normalized = HookPoint()

    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Normalise each vector of `x` over its last dim, then apply the learned `w` and `b`."""
        validate.last_dim("x", x, self.d_model)
        dtype, x = x.dtype, upcast(x)
        x = x - x.mean(dim=-1, keepdim=True)
        variance = x.pow(2).mean(dim=-1, keepdim=True)  # biased: divide by d_model, not d_model - 1
        scale: Float[Tensor, "*batch 1"] = self.hook_scale((variance + self.eps).sqrt())
        x = self.hook_normalized(x / scale)
        return (x * self.w + self.b).to(dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"


class RMSNorm(nn.Module):
    """Divide each vector by its root mean square, then scale by `w`: layer norm without the
    centring and without the shift, used by LLaMA, T5 and most recent models. Like `LayerNorm`,
    it computes in float32 for float16 and bfloat16 inputs and returns the input's dtype.

    Course: chapter 4, exercise 4.2, checked by checks.layernorm.check_rmsnorm.
    """

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        validate.norm_args(d_model, eps)
        self.d_model = d_model
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        # [*batch, 1]: the root mean square each vector is divided by
        self.hook_scale = HookPoint()
        # [*batch, d_model]: the normalised vector, before the learned scale
        self.hook_normalized = HookPoint()

    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Divide each vector of `x` by its root mean square over its last dim, then scale by w."""
        validate.last_dim("x", x, self.d_model)
        dtype, x = x.dtype, upcast(x)
        mean_square = x.pow(2).mean(dim=-1, keepdim=True)
        scale: Float[Tensor, "*batch 1"] = self.hook_scale((mean_square + self.eps).sqrt())
        x = self.hook_normalized(x / scale)
        return (x * self.w).to(dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"
