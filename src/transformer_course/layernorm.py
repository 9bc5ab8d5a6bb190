"""Layer normalisation (Ba et al., 2016) and RMSNorm (Zhang & Sennrich, 2019).

Both normalise each position's vector over its last dimension, `d_model`, so every token is
treated on its own: no statistics are shared across the batch or along the sequence. Parameter
and hook names follow TransformerLens, so a TransformerLens `LayerNorm` or `RMSNorm` state dict
loads directly.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from transformer_course.masking import upcast


def check_last_dim(x: Tensor, d_model: int, name: str = "x") -> None:
    """Raise a clear error unless `x` is a floating-point tensor whose last dimension is `d_model`."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] != d_model:
        got = x.shape[-1] if x.ndim else "none (a 0-d tensor)"
        raise ValueError(f"{name}: expected last dim d_model={d_model}, got {got} (shape {tuple(x.shape)})")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def check_norm_args(d_model: int, eps: float) -> None:
    """Raise a clear error for a norm's constructor arguments: an int `d_model` >= 1, an `eps` > 0.

    With `eps=0` a constant vector has variance 0 and gives 0 / 0 = NaN, and so does an `eps` too
    small for float32 (the dtype half-precision inputs are computed in), which rounds to 0.
    """
    if isinstance(d_model, bool) or not isinstance(d_model, int):
        raise TypeError(f"d_model: expected an int, got {type(d_model).__name__} {d_model!r}")
    if d_model < 1:
        raise ValueError(f"d_model: expected a positive size, got {d_model}")
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps: expected a number, got {type(eps).__name__} {eps!r}")
    if not math.isfinite(eps) or eps < torch.finfo(torch.float32).tiny:
        smallest = torch.finfo(torch.float32).tiny
        raise ValueError(f"eps: expected a finite number >= {smallest:.3g}, got {eps}")


class LayerNorm(nn.Module):
    """Normalise each vector to zero mean and unit variance, then scale by `w` and shift by `b`.

    The variance is the biased one (divide by `d_model`, as `torch.nn.LayerNorm` does) and `eps`
    sits inside the square root, so a constant vector gives `b` rather than a division by zero.
    float16 and bfloat16 inputs are normalised in float32 (in float16, squaring overflows once
    |x| > 256) and the result is returned in the input's dtype.
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        check_norm_args(d_model, eps)
        self.d_model = d_model
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        self.b = nn.Parameter(torch.zeros(d_model))
        self.hook_scale = HookPoint()  # [*batch, 1]: the standard deviation each vector is divided by
        self.hook_normalized = HookPoint()  # [*batch, d_model]: before the learned scale and shift

    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Normalise each vector of `x` over its last dim, then apply the learned `w` and `b`."""
        check_last_dim(x, self.d_model)
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
    it computes in float32 for float16 and bfloat16 inputs and returns the input's dtype."""

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        check_norm_args(d_model, eps)
        self.d_model = d_model
        self.eps = eps
        self.w = nn.Parameter(torch.ones(d_model))
        self.hook_scale = HookPoint()  # [*batch, 1]: the root mean square each vector is divided by
        self.hook_normalized = HookPoint()  # [*batch, d_model]: before the learned scale

    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        """Divide each vector of `x` by its root mean square over the last dim, then scale by `w`."""
        check_last_dim(x, self.d_model)
        dtype, x = x.dtype, upcast(x)
        mean_square = x.pow(2).mean(dim=-1, keepdim=True)
        scale: Float[Tensor, "*batch 1"] = self.hook_scale((mean_square + self.eps).sqrt())
        x = self.hook_normalized(x / scale)
        return (x * self.w).to(dtype)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, eps={self.eps}"
