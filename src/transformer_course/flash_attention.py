"""FlashAttention-2 (Dao, 2023) in PyTorch: attention that never holds the n_queries x n_keys
pattern, forward or backward.

Plain attention builds the scores `S = q k^T / sqrt(d)` and the pattern `P = softmax(S)` for every
query and key at once, and autograd keeps `P` for the backward: memory grows with the square of the
context. FlashAttention walks over tiles instead: a tile of `q_tile` queries meets the keys and
values `k_tile` at a time, and the softmax is computed *online*. For each query row it keeps the
largest score seen so far `m`, the sum of `exp(s - m)` so far `l` and the unnormalised output
`acc`; when a new tile raises the maximum to `m'`, the old sums are rescaled by `exp(m - m')`:

    m' = max(m, rowmax(S_tile))
    l  = exp(m - m') l + rowsum(exp(S_tile - m'))
    acc = exp(m - m') acc + exp(S_tile - m') V_tile
    out = acc / l,    L = m + log(l)        (the log-sum-exp of the row's scores)

The forward saves q, k, v, the output O and the one vector L `(..., n_queries)`. The backward
recomputes each tile's pattern from L, `P = exp(S - L)`, and with `D = rowsum(dO * O)` (which
equals `rowsum(P * dP)`, the softmax's correction term) gets

    dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),
    dQ += dS K / sqrt(d),   dK += dS^T Q / sqrt(d)

so what the backward keeps grows linearly with the context. `causal=True` aligns queries with
the last keys, as `attention.causal_mask` does (with more keys than queries the last query sees
every key, and there may not be more queries than keys), and skips the tiles that lie wholly
above the diagonal. float16 and bfloat16 inputs are computed in float32 and the output comes back
in the input's dtype; L is float32 then.

This is the algorithm, written for reading: a Python loop over tiles is slower than the one
matmul of plain attention. The speed comes when each tile runs in a GPU's on-chip memory (a
Triton kernel, later in the chapter).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from transformer_course import validate
from transformer_course.runtime import upcast

__all__ = [
    "Q_TILE",
    "K_TILE",
    "flash_attention",
    "flash_attention_forward",
    "flash_attention_backward",
    "FlashAttention",
]

Q_TILE = 64  # queries per tile
K_TILE = 64  # keys (and values) per tile


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    *,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> Tensor:
    """softmax(q k^T / sqrt(d)) v, tile by tile, with a backward that recomputes the pattern.

    q `(..., n_queries, d)`, k and v `(..., n_keys, d)`, with the same leading (batch, head)
    dims and dtype; returns `(..., n_queries, d)`. Equal to
    `attention.scaled_dot_product_attention(q, k, v, causal_mask(n_queries, n_keys))[0]` (or
    without the mask), forward and backward, to rounding.

    Course: chapter 8.
    """
    return FlashAttention.apply(q, k, v, causal, q_tile, k_tile)


class FlashAttention(torch.autograd.Function):
    """FlashAttention-2 as an autograd function: `FlashAttention.apply(q, k, v, causal)` (tile
    sizes may follow: `apply(q, k, v, causal, q_tile, k_tile)`).

    The forward saves q, k, v, the output and one log-sum-exp tensor L `(..., n_queries)`;
    the backward rebuilds each tile's pattern from L, so nothing of size n_queries x n_keys is
    kept between the two.

    Course: chapter 8, exercise 8.5, checked by
    checks.flash_attention.check_flash_attention_function.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        q_tile: int = Q_TILE,
        k_tile: int = K_TILE,
    ) -> Tensor:
        out, lse = flash_attention_forward(q, k, v, causal, q_tile=q_tile, k_tile=k_tile)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.q_tile, ctx.k_tile = causal, q_tile, k_tile
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(
            q, k, v, out, lse, grad_out, ctx.causal, q_tile=ctx.q_tile, k_tile=ctx.k_tile
        )
        return dq, dk, dv, None, None, None  # nothing for causal and the tile sizes


def flash_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    *,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> tuple[Tensor, Tensor]:
    """The tiled forward with the online softmax: returns the output `(..., n_queries, d)` and
    the log-sum-exp of each query's scores L `(..., n_queries)`, which is all the backward needs
    besides q, k, v and the output.

    Course: chapter 8, exercise 8.3, checked by
    checks.flash_attention.check_flash_attention_forward.
    """
    _check_inputs(q, k, v, causal, q_tile, k_tile)
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))
    for i0 in range(0, n_queries, q_tile):
        i1 = min(i0 + q_tile, n_queries)
        q_i = upcast(q[..., i0:i1, :]) * scale
        m = torch.full(q_i.shape[:-1], -math.inf, dtype=q_i.dtype, device=q.device)  # row max
        l = torch.zeros_like(m)  # row sum of exp(s - m)  # noqa: E741
        acc = torch.zeros_like(q_i)  # unnormalised output
        for j0 in range(0, _keys_seen(i1, n_queries, n_keys, causal), k_tile):
            j1 = min(j0 + k_tile, n_keys)
            s = q_i @ upcast(k[..., j0:j1, :]).transpose(-2, -1)
            if causal:
                s = s.masked_fill(
                    ~_visible(i0, i1, j0, j1, n_keys - n_queries, q.device), -math.inf
                )
            # Every query sees key 0, in the first tile: m is finite from the first tile on.
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            rescale = torch.exp(m - m_new)  # the old sums were taken against a smaller maximum
            l = rescale * l + p.sum(dim=-1)  # noqa: E741
            acc = rescale[..., None] * acc + p @ upcast(v[..., j0:j1, :])
            m = m_new
        out[..., i0:i1, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., i0:i1] = m + torch.log(l)
    return out, lse


def flash_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    causal: bool = False,
    *,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> tuple[Tensor, Tensor, Tensor]:
    """The FlashAttention-2 backward: the gradients of q, k and v from the saved output and
    log-sum-exp L, recomputing each tile's pattern `P = exp(S - L)`. The outer loop runs over
    key tiles (each one's dK and dV are finished before the next), the inner over query tiles
    (dQ accumulates across them).

    Course: chapter 8, exercise 8.4, checked by
    checks.flash_attention.check_flash_attention_backward.
    """
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1])
    offset = n_keys - n_queries  # query i sees keys j <= i + offset when causal
    D = (upcast(grad_out) * upcast(out)).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP)
    dq = torch.zeros_like(upcast(q))
    dk, dv = torch.zeros_like(upcast(k)), torch.zeros_like(upcast(v))
    for j0 in range(0, n_keys, k_tile):
        j1 = min(j0 + k_tile, n_keys)
        k_j, v_j = upcast(k[..., j0:j1, :]), upcast(v[..., j0:j1, :])
        for i0 in range(0, n_queries, q_tile):
            i1 = min(i0 + q_tile, n_queries)
            if causal and i1 - 1 + offset < j0:  # no query of the tile sees a key of this one
                continue
            q_i, do_i = upcast(q[..., i0:i1, :]), upcast(grad_out[..., i0:i1, :])
            s = (q_i * scale) @ k_j.transpose(-2, -1)
            p = torch.exp(s - lse[..., i0:i1, None])
            if causal:
                p = p.masked_fill(~_visible(i0, i1, j0, j1, offset, q.device), 0.0)
            dv[..., j0:j1, :] += p.transpose(-2, -1) @ do_i
            dp = do_i @ v_j.transpose(-2, -1)
            ds = p * (dp - D[..., i0:i1, None])
            dq[..., i0:i1, :] += (ds @ k_j) * scale
            dk[..., j0:j1, :] += (ds.transpose(-2, -1) @ q_i) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _keys_seen(i1: int, n_queries: int, n_keys: int, causal: bool) -> int:
    """How many keys (from the first) the queries before `i1` see: with `causal`, query i sees
    keys up to i + n_keys - n_queries; the tiles past that are skipped."""
    return min(n_keys, i1 + n_keys - n_queries) if causal else n_keys


def _visible(i0: int, i1: int, j0: int, j1: int, offset: int, device: torch.device) -> Tensor:
    """The causal mask of one tile: True where query i (in [i0, i1)) may see key j (in [j0, j1)),
    j <= i + offset, the alignment of `attention.causal_mask`."""
    queries = torch.arange(i0, i1, device=device)[:, None]
    keys = torch.arange(j0, j1, device=device)[None, :]
    return keys <= queries + offset


def _check_inputs(q: Any, k: Any, v: Any, causal: Any, q_tile: Any, k_tile: Any) -> None:
    """q `(..., n_queries, d)`, k and v `(..., n_keys, d)`: floating, one dtype and device, the
    same leading dims and d, at least one query and one key (as many as queries if causal)."""
    validate.attention_inputs(q, k, v)
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(
                f"{name}: expected device {q.device} (the device of q), got {t.device}"
            )
        if t.shape[:-2] != q.shape[:-2]:
            raise ValueError(
                f"{name}: expected leading dims {tuple(q.shape[:-2])} (those of q), got "
                f"{tuple(t.shape[:-2])} (shape {tuple(t.shape)})"
            )
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"v: expected last dim d={q.shape[-1]} (the last dim of q), got {v.shape[-1]} "
            f"(shape {tuple(v.shape)})"
        )
    for name, t in (("q", q), ("k", k)):
        if t.shape[-2] == 0:
            raise ValueError(
                f"{name}: expected at least one position (dim -2), got shape {tuple(t.shape)}"
            )
    validate.flag("causal", causal)
    if causal and q.shape[-2] > k.shape[-2]:
        raise ValueError(
            f"k: expected at least n_queries={q.shape[-2]} positions with causal=True (the "
            f"queries are the last positions of the keys, as in causal_mask), got {k.shape[-2]}"
        )
    validate.positive_int("q_tile", q_tile)
    validate.positive_int("k_tile", k_tile)
