"""Rotary position embedding, RoPE (Su et al., 2021): positions as rotations of queries and keys.

RoPE adds nothing to the residual stream. It rotates each query and each key, pair of dims by
pair of dims, by an angle proportional to the vector's position: dims `(2i, 2i+1)` of a vector
at position `p` turn by `p * theta^(-2i / d_head)`. A rotation keeps lengths, and the dot
product of a query rotated by `a` and a key rotated by `b` depends only on `a - b`, so the
attention scores depend on how far apart two tokens are, not on where they sit.

Two layouts of the pairs exist. The paper and Meta's Llama code rotate *adjacent* dims
`(x[2i], x[2i+1])`, as `apply_rope` does. Hugging Face's Llama rotates dim `i` with dim
`i + d_head/2` (*halves*, `rotate_half`, `apply_rope_halves`), and its checkpoints store W_Q and
W_K with their rows permuted to match (its conversion script permutes Meta's weights).
`halves_to_adjacent` undoes that permutation, so Hugging Face's weights run with `apply_rope`;
the scores are unchanged, since permuting the dims of every query and key alike keeps their
dot products.

The angles are computed in float32 whatever the input's dtype, as Meta's and Hugging Face's code
compute them, so a model sees the rotations it was trained with (in bfloat16, position 1000
would be rounded to a multiple of 4). The rotation itself runs in float32 for half-precision
inputs and returns the input's dtype.
"""

from __future__ import annotations

import einops
import torch
from jaxtyping import Float, Integer
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.runtime import upcast

__all__ = [
    "rope_angles",
    "rotate_pairs",
    "apply_rope",
    "RotaryEmbedding",
    "rotate_half",
    "apply_rope_halves",
    "halves_to_adjacent",
    "adjacent_to_halves",
]


def rope_angles(
    positions: Integer[Tensor, "*#batch #pos"], d_head: int, theta: float = 10000.0
) -> Float[Tensor, "*#batch #pos half"]:
    """The angle of each pair `i` (of `d_head / 2`) at each position: `p * theta^(-2i / d_head)`,
    in float32. Pair 0 turns by one radian per position; the last pair, almost not at all.

    Course: chapter 7, exercise 7.1, checked by checks.llama.check_rope_angles.
    """
    validate.integer_positions(positions)
    validate.even("d_head", d_head, "RoPE rotates pairs of dims")
    validate.number("theta", theta, low=0, low_open=True)
    device = positions.device
    inv_freq = 1.0 / theta ** (torch.arange(0, d_head, 2, device=device).float() / d_head)
    return positions.float()[..., None] * inv_freq


def rotate_pairs(
    x: Float[Tensor, "*batch pos d_head"],
    cos: Float[Tensor, "*#batch #pos half"],
    sin: Float[Tensor, "*#batch #pos half"],
) -> Float[Tensor, "*batch pos d_head"]:
    """Turn each adjacent pair `(x[2i], x[2i+1])` by the angle whose cosine and sine are given:
    `(a, b) -> (a cos - b sin, a sin + b cos)`.

    Course: chapter 7, exercise 7.2, checked by checks.llama.check_rotate_pairs.
    """
    validate.rope_input(x)
    pairs = einops.rearrange(upcast(x), "... (half two) -> ... half two", two=2)
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return einops.rearrange(rotated, "... half two -> ... (half two)").to(x.dtype)


def apply_rope(
    x: Float[Tensor, "*batch pos d_head"],
    positions: Integer[Tensor, "*#batch #pos"],
    theta: float = 10000.0,
) -> Float[Tensor, "*batch pos d_head"]:
    """RoPE on queries or keys `x` `(..., pos, d_head)`: the vector at `positions[..., j]` has
    each adjacent pair of dims `(2i, 2i+1)` rotated by `positions[..., j] * theta^(-2i/d_head)`.

    `positions` is an integer tensor `(..., pos)` that broadcasts to `x`'s leading dims, for
    example `torch.arange(pos)`, or `torch.arange(start, start + pos)` for queries that follow
    `start` cached keys. `d_head` must be even.

    Course: chapter 7.
    """
    validate.rope_positions(positions, validate.rope_input(x))
    angles = rope_angles(positions, x.shape[-1], theta)
    return rotate_pairs(x, angles.cos(), angles.sin())


class RotaryEmbedding(nn.Module):
    """RoPE with its cosines and sines computed once, for positions 0 to `n_ctx - 1`.

    `forward(x, positions)` rotates `x` `(..., pos, d_head)` with `rotate_pairs`; without
    `positions` they are `offset, offset + 1, ...` (default offset 0). A KV cache passes
    `offset=` the number of cached positions: the new tokens come after them. The tables are
    buffers, not parameters (nothing to learn, nothing saved in the state dict), and stay
    float32 when the module is cast (`.to(dtype)` computes them again in float32 on the
    module's device).

    Course: chapter 7, exercise 7.3, checked by checks.llama.check_rotary_embedding.
    """

    def __init__(self, d_head: int, n_ctx: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.d_head = validate.even("d_head", d_head, "RoPE rotates pairs of dims")
        self.n_ctx = validate.positive_int("n_ctx", n_ctx)
        self.theta = validate.number("theta", theta, low=0, low_open=True)
        self.register_buffer("cos", torch.empty(0), persistent=False)  # (n_ctx, d_head / 2)
        self.register_buffer("sin", torch.empty(0), persistent=False)  # (n_ctx, d_head / 2)
        self._build_tables(torch.device("cpu"))

    def _build_tables(self, device: torch.device) -> None:
        angles = rope_angles(torch.arange(self.n_ctx, device=device), self.d_head, self.theta)
        self.cos, self.sin = angles.cos(), angles.sin()

    def _apply(self, fn, recurse=True):  # what .to(), .cuda(), .double() ... call
        super()._apply(fn, recurse)
        self._build_tables(self.cos.device)  # moved with the module, but float32 again
        return self

    def forward(
        self,
        x: Float[Tensor, "*batch pos d_head"],
        positions: Integer[Tensor, "*#batch #pos"] | None = None,
        *,
        offset: int = 0,
    ) -> Float[Tensor, "*batch pos d_head"]:
        """`x` rotated by the angles of `positions`, by default `offset, offset + 1, ...,
        offset + pos - 1` (a slice of the tables: no positions to read)."""
        validate.rope_input(x, self.d_head)
        if positions is not None:
            validate.rope_positions(positions, x, n_ctx=self.n_ctx, offset=offset)
            rows = positions.long()  # uint8 would index as a mask
            return rotate_pairs(x, self.cos[rows], self.sin[rows])
        end = validate.integer("offset", offset, low=0) + x.shape[-2]
        if end > self.n_ctx:
            raise ValueError(
                f"offset: expected offset + pos <= n_ctx={self.n_ctx}, got {offset} + "
                f"{x.shape[-2]} = {end}"
            )
        return rotate_pairs(x, self.cos[offset:end], self.sin[offset:end])

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, n_ctx={self.n_ctx}, theta={self.theta:g}"


# Hugging Face's layout: dim i turns with dim i + d_head / 2.


def rotate_half(x: Float[Tensor, "*batch d_head"]) -> Float[Tensor, "*batch d_head"]:
    """Hugging Face's `rotate_half`: `(x1, x2) -> (-x2, x1)` for the two halves of the last dim,
    the 90-degree turn of every pair `(x[i], x[i + d_head/2])`.

    Course: chapter 7.
    """
    validate.even("d_head (the last dim of x)", x.shape[-1], "rotate_half turns pairs of dims")
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope_halves(
    x: Float[Tensor, "*batch pos d_head"],
    positions: Integer[Tensor, "*#batch #pos"],
    theta: float = 10000.0,
) -> Float[Tensor, "*batch pos d_head"]:
    """RoPE in Hugging Face's layout: `x cos + rotate_half(x) sin`, with the angle of pair `i`
    at dims `i` and `i + d_head/2`. It equals `apply_rope` with the dims of `x` (and of the
    result) in halves order: `apply_rope_halves(x) == adjacent_to_halves(apply_rope(
    halves_to_adjacent(x)))`, each along the last dim.

    Course: chapter 7.
    """
    validate.rope_positions(positions, validate.rope_input(x))
    angles = rope_angles(positions, x.shape[-1], theta)
    angles = torch.cat((angles, angles), dim=-1)  # pair i sits at dims i and i + d_head/2
    out = upcast(x) * angles.cos() + rotate_half(upcast(x)) * angles.sin()
    return out.to(x.dtype)


def halves_to_adjacent(
    weight: Float[Tensor, "*batch rows"], n_heads: int = 1, dim: int = -1
) -> Float[Tensor, "*batch rows"]:
    """Reorder, head by head, the `n_heads * d_head` entries of `weight` along `dim` from
    Hugging Face's halves layout `(x[0], ..., x[h-1], y[0], ..., y[h-1])` to adjacent pairs
    `(x[0], y[0], x[1], y[1], ...)`, where pair `i` is `(x[i], y[i])` and `h = d_head / 2`.

    For a Hugging Face `q_proj.weight` or `k_proj.weight` `(n_heads * d_head, d_model)` use
    `dim=0`: the projection's outputs then come out in the order `apply_rope` rotates. It is
    the inverse of the permutation in Hugging Face's `convert_llama_weights_to_hf.py`.

    Course: chapter 7.
    """
    return _reorder(weight, n_heads, dim, "(head two half) -> (head half two)")


def adjacent_to_halves(
    weight: Float[Tensor, "*batch rows"], n_heads: int = 1, dim: int = -1
) -> Float[Tensor, "*batch rows"]:
    """The inverse of `halves_to_adjacent`: adjacent pairs back to Hugging Face's halves layout.

    Course: chapter 7.
    """
    return _reorder(weight, n_heads, dim, "(head half two) -> (head two half)")


def _reorder(weight: Tensor, n_heads: int, dim: int, pattern: str) -> Tensor:
    """`weight` with the entries of each head along `dim` reordered as `pattern` says."""
    moved = weight.movedim(dim, -1)
    validate.divisor("n_heads", n_heads, "weight.shape[dim]", moved.shape[-1])
    validate.even("d_head", moved.shape[-1] // n_heads, "RoPE rotates pairs of dims")
    source, target = pattern.split(" -> ")
    out = einops.rearrange(moved, f"... {source} -> ... {target}", head=n_heads, two=2)
    return out.movedim(-1, dim)
