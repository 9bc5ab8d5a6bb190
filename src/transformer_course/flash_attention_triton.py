"""FlashAttention-2 in Triton: the algorithm of `flash_attention`, as GPU kernels.

`flash_attention` walks over the tiles in a Python loop: every tile's scores go out to the GPU's
main memory and come back, and every step is a separate kernel launch. Here one launch runs a
program per (query tile, batch * head): the program loads its queries once, streams the keys and
values through on-chip memory (shared memory and registers), and keeps the online softmax's
running max, sum and output there, so the scores never reach main memory. The backward is three
launches in the FlashAttention-2 split: D = rowsum(dO * O); dK and dV with a program per key
tile; dQ with a program per query tile, each rebuilding its tiles' pattern from the saved L.

Same contract as `flash_attention`: q `(..., n_queries, d)`, k and v `(..., n_keys, d)`, `causal`
aligned to the last keys; float16, bfloat16 or float32, computed in float32 (matmul inputs in the
input dtype, accumulation in float32; float32 matmuls in full precision, not TF32), head dims
16, 32, 64 or 128. It needs Triton and a CUDA device; `TRITON_INTERPRET=1`, set before this
module is imported, runs the same kernels on CPU tensors in Triton's interpreter (slowly: for
tests; float16 and float32 only, its bfloat16 matmuls being wrong).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from transformer_course.flash_attention import K_TILE, Q_TILE, _check_inputs

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; running the kernels says what is missing
    triton = tl = None

__all__ = ["FlashAttentionTriton", "flash_attention_triton", "HEAD_DIMS"]

HEAD_DIMS = (16, 32, 64, 128)  # the head dims the kernels take: tile widths are powers of two


def flash_attention_triton(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(d)) v by the Triton kernels, forward and backward.

    q `(..., n_queries, d)`, k and v `(..., n_keys, d)` on a CUDA device (or the CPU under
    `TRITON_INTERPRET=1`); returns `(..., n_queries, d)` in the input dtype. Equal to
    `flash_attention(q, k, v, causal)` to rounding.

    Course: chapter 8.
    """
    return FlashAttentionTriton.apply(q, k, v, causal)


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 on the GPU as an autograd function: `FlashAttentionTriton.apply(q, k, v,
    causal)`, the interface of `FlashAttention`.

    The forward saves q, k, v, the output and the log-sum-exp L `(..., n_queries)` (float32);
    the backward kernels rebuild each tile's pattern from L.

    Course: chapter 8.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        out, lse = _forward(q, k, v, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(q, k, v, out, lse, grad_out, ctx.causal), None)  # None: causal


# The host side -----------------------------------------------------------------------------


def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """The output `(..., n_queries, d)` and L `(..., n_queries)` (float32), one launch."""
    _check(q, k, v, causal)
    q3, k3, v3 = (_heads_first(t) for t in (q, k, v))
    out = torch.empty_like(q3)
    lse = torch.empty(q3.shape[:-1], dtype=torch.float32, device=q.device)
    tiles = _tiles(q.dtype, q.shape[-1])["forward"]
    grid = (triton.cdiv(q.shape[-2], tiles["BLOCK_Q"]), q3.shape[0])
    with _on_device(q):
        _forward_kernel[grid](q3, k3, v3, out, lse, **_sizes(q, k, causal), **tiles)
    return out.view(q.shape), lse.view(q.shape[:-1])


def _backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv from the saved tensors: D, then dK and dV per key tile, then dQ."""
    q3, k3, v3, out3, grad_out3 = (_heads_first(t) for t in (q, k, v, out, grad_out))
    lse3 = lse.reshape(q3.shape[:-1])
    delta = torch.empty_like(lse3)  # D = rowsum(dO * O), float32
    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    tiles = _tiles(q.dtype, q.shape[-1])
    sizes = _sizes(q, k, causal)
    n_queries, n_keys, batch_heads = q.shape[-2], k.shape[-2], q3.shape[0]
    with _on_device(q):
        grid = (triton.cdiv(n_queries, tiles["delta"]["BLOCK_Q"]), batch_heads)
        _delta_kernel[grid](out3, grad_out3, delta, n_queries, q.shape[-1], **tiles["delta"])
        grid = (triton.cdiv(n_keys, tiles["key_grads"]["BLOCK_K"]), batch_heads)
        _key_grads_kernel[grid](
            q3, k3, v3, grad_out3, lse3, delta, dk, dv, **sizes, **tiles["key_grads"]
        )
        grid = (triton.cdiv(n_queries, tiles["query_grads"]["BLOCK_Q"]), batch_heads)
        _query_grads_kernel[grid](
            q3, k3, v3, grad_out3, lse3, delta, dq, **sizes, **tiles["query_grads"]
        )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _sizes(q: Tensor, k: Tensor, causal: bool) -> dict[str, Any]:
    """The arguments every attention kernel takes besides its tensors and tiles."""
    return {
        "n_queries": q.shape[-2],
        "n_keys": k.shape[-2],
        "scale": 1 / math.sqrt(q.shape[-1]),
        "CAUSAL": causal,
        "HEAD_DIM": q.shape[-1],
    }


def _check(q: Any, k: Any, v: Any, causal: Any) -> None:
    """`flash_attention`'s checks, then what the kernels need: Triton, a dtype they take, a
    head dim from `HEAD_DIMS` and a device they run on."""
    _check_inputs(q, k, v, causal, Q_TILE, K_TILE)
    if triton is None:
        raise ImportError(
            "FlashAttentionTriton needs Triton, which is not installed (`pip install triton`; "
            "PyTorch's CUDA wheels for Linux bring it)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q: expected dtype torch.float16, torch.bfloat16 or torch.float32, got {q.dtype}"
        )
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"q: expected head dim d in {HEAD_DIMS}, got d={q.shape[-1]}")
    if _INTERPRETED and q.dtype == torch.bfloat16:
        raise ValueError(
            "q: expected torch.float16 or torch.float32 in Triton's interpreter "
            "(TRITON_INTERPRET=1), whose bfloat16 matmuls are wrong (triton-lang/triton#11584), "
            "got torch.bfloat16"
        )
    if q.device.type != "cuda" and not (q.device.type == "cpu" and _INTERPRETED):
        raise ValueError(
            f"q: expected a CUDA tensor (Triton compiles the kernels for the GPU), got device "
            f"{q.device}; on the CPU, set TRITON_INTERPRET=1 before importing "
            f"{__name__} to run them in Triton's interpreter"
        )


def _heads_first(t: Tensor) -> Tensor:
    """`(..., n, d)` as a contiguous `(batch * heads, n, d)`: the layout the kernels index."""
    return t.reshape(-1, *t.shape[-2:]).contiguous()


def _on_device(t: Tensor) -> torch.cuda.device:
    """Launch on `t`'s GPU (Triton launches on the current one); index -1 changes nothing."""
    return torch.cuda.device(t.device.index if t.is_cuda else -1)


def _tiles(dtype: torch.dtype, head_dim: int) -> dict[str, dict[str, int]]:
    """Tile sizes, warps and pipeline stages per kernel, sized for an H100: at most 72 KiB of
    shared memory a program, and in half precision no kernel spills registers there (sm_90; on
    an A100, sm_80, two spill a little). Wider heads get more warps for the accumulators.
    float32, for checking more than for speed, takes smaller tiles (its values take twice the
    on-chip memory, its full-precision matmuls many registers) and spills at d >= 64."""
    warps = 4 if head_dim <= 16 else 8
    delta = {"BLOCK_Q": 64, "num_warps": 4}
    if dtype == torch.float32:
        small = {"num_warps": warps, "num_stages": 2}
        return {
            "forward": {"BLOCK_Q": 64, "BLOCK_K": 32, **small},
            "delta": delta,
            "key_grads": {"BLOCK_Q": 32, "BLOCK_K": 32, **small},
            "query_grads": {"BLOCK_Q": 32, "BLOCK_K": 32, **small},
        }
    wide = 128 if head_dim <= 64 else 64
    return {
        "forward": {"BLOCK_Q": 128, "BLOCK_K": 64, "num_warps": warps, "num_stages": 3},
        "delta": delta,
        "key_grads": {"BLOCK_Q": 32, "BLOCK_K": wide, "num_warps": warps, "num_stages": 4},
        "query_grads": {"BLOCK_Q": wide, "BLOCK_K": 32, "num_warps": warps, "num_stages": 4},
    }


# The kernels -------------------------------------------------------------------------------
# Every tensor is a contiguous (batch * heads, n, HEAD_DIM) block (L and D: (batch * heads, n));
# axis 1 of the grid picks the (batch, head), axis 0 the tile. Scores, the pattern and every
# accumulator are float32; matmul inputs stay in the input dtype (tensor cores for half
# precision), and float32 matmuls run in full precision, as torch's do on CUDA by default.


def _jit(fn):
    """`triton.jit` where Triton is installed (the interpreter's version under
    TRITON_INTERPRET=1); without it the kernel stays a plain function, never launched."""
    return fn if triton is None else triton.jit(fn)


@_jit
def _load_rows(base, rows, n_rows, HEAD_DIM: tl.constexpr):
    """Rows `rows` of the (n_rows, HEAD_DIM) matrix at `base`; zeros past the last row."""
    columns = tl.arange(0, HEAD_DIM)
    mask = rows[:, None] < n_rows
    return tl.load(base + rows[:, None] * HEAD_DIM + columns[None, :], mask=mask, other=0.0)


@_jit
def _store_rows(base, rows, n_rows, values, HEAD_DIM: tl.constexpr):
    """Write `values` to rows `rows` of the matrix at `base`, in its dtype, up to its last row."""
    columns = tl.arange(0, HEAD_DIM)
    mask = rows[:, None] < n_rows
    tl.store(base + rows[:, None] * HEAD_DIM + columns[None, :], values, mask=mask)


@_jit
def _visible(queries, keys, n_keys, offset, CAUSAL: tl.constexpr):
    """(queries, keys) mask: the key exists and, if causal, key j <= query i + offset (the last
    query sees every key, as in `causal_mask`)."""
    visible = (keys < n_keys)[None, :]
    if CAUSAL:
        visible = visible & (keys[None, :] <= queries[:, None] + offset)
    return visible


@_jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    n_queries,
    n_keys,
    scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One tile of BLOCK_Q queries against every key it sees: its output and L."""
    q_start = tl.program_id(0) * BLOCK_Q
    head = tl.program_id(1).to(tl.int64)  # int64: head * n * HEAD_DIM may pass 2**31
    q_ptr += head * n_queries * HEAD_DIM
    out_ptr += head * n_queries * HEAD_DIM
    lse_ptr += head * n_queries
    k_ptr += head * n_keys * HEAD_DIM
    v_ptr += head * n_keys * HEAD_DIM

    queries = q_start + tl.arange(0, BLOCK_Q)
    q = _load_rows(q_ptr, queries, n_queries, HEAD_DIM)  # stays on chip for the whole loop
    row_max = tl.full([BLOCK_Q], float("-inf"), tl.float32)  # m: the largest score so far
    row_sum = tl.zeros([BLOCK_Q], tl.float32)  # l: the sum of exp(score - m) so far
    acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)  # the unnormalised output, sum exp(.) v
    offset = n_keys - n_queries
    keys_end = n_keys
    if CAUSAL:  # the tile's last query sees keys up to q_start + BLOCK_Q - 1 + offset
        keys_end = tl.minimum(n_keys, q_start + BLOCK_Q + offset)
    for k_start in range(0, keys_end, BLOCK_K):
        keys = k_start + tl.arange(0, BLOCK_K)
        k = _load_rows(k_ptr, keys, n_keys, HEAD_DIM)
        v = _load_rows(v_ptr, keys, n_keys, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(_visible(queries, keys, n_keys, offset, CAUSAL), scores, float("-inf"))
        # Every query sees key 0, in the first tile: row_max is finite from then on.
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        p = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(row_max - new_max)  # the old sums were taken against a smaller max
        row_sum = rescale * row_sum + tl.sum(p, axis=1)
        # acc = rescale * acc + p v, the addition done by the matmul
        acc = tl.dot(p.to(v.dtype), v, acc=acc * rescale[:, None], input_precision="ieee")
        row_max = new_max
    _store_rows(out_ptr, queries, n_queries, acc / row_sum[:, None], HEAD_DIM)
    tl.store(lse_ptr + queries, row_max + tl.log(row_sum), mask=queries < n_queries)


@_jit
def _delta_kernel(
    out_ptr, grad_out_ptr, delta_ptr, n_queries, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr
):
    """D = rowsum(dO * O) for one tile of queries: the softmax backward's correction term."""
    head = tl.program_id(1).to(tl.int64)
    queries = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    out = _load_rows(out_ptr + head * n_queries * HEAD_DIM, queries, n_queries, HEAD_DIM)
    grad_out = _load_rows(grad_out_ptr + head * n_queries * HEAD_DIM, queries, n_queries, HEAD_DIM)
    delta = tl.sum(out.to(tl.float32) * grad_out.to(tl.float32), axis=1)
    tl.store(delta_ptr + head * n_queries + queries, delta, mask=queries < n_queries)


@_jit
def _key_grads_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    grad_out_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    n_queries,
    n_keys,
    scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dK and dV of one tile of BLOCK_K keys, summed over the query tiles that see it."""
    k_start = tl.program_id(0) * BLOCK_K
    head = tl.program_id(1).to(tl.int64)
    q_ptr += head * n_queries * HEAD_DIM
    grad_out_ptr += head * n_queries * HEAD_DIM
    lse_ptr += head * n_queries
    delta_ptr += head * n_queries
    k_ptr += head * n_keys * HEAD_DIM
    v_ptr += head * n_keys * HEAD_DIM
    dk_ptr += head * n_keys * HEAD_DIM
    dv_ptr += head * n_keys * HEAD_DIM

    keys = k_start + tl.arange(0, BLOCK_K)
    k = _load_rows(k_ptr, keys, n_keys, HEAD_DIM)  # k and v stay on chip for the whole loop
    v = _load_rows(v_ptr, keys, n_keys, HEAD_DIM)
    dk = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_K, HEAD_DIM], tl.float32)
    offset = n_keys - n_queries
    q_begin = 0
    if CAUSAL:  # query i sees key k_start from i = k_start - offset on: start at its tile
        q_begin = tl.maximum(k_start - offset, 0) // BLOCK_Q * BLOCK_Q
    for q_start in range(q_begin, n_queries, BLOCK_Q):
        queries = q_start + tl.arange(0, BLOCK_Q)
        q = _load_rows(q_ptr, queries, n_queries, HEAD_DIM)
        grad_out = _load_rows(grad_out_ptr, queries, n_queries, HEAD_DIM)
        in_range = queries < n_queries  # rows past the end load zeros and add nothing
        lse = tl.load(lse_ptr + queries, mask=in_range, other=0.0)
        delta = tl.load(delta_ptr + queries, mask=in_range, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(_visible(queries, keys, n_keys, offset, CAUSAL), scores, float("-inf"))
        p = tl.exp(scores - lse[:, None])  # the pattern, rebuilt from L
        dv += tl.dot(tl.trans(p).to(grad_out.dtype), grad_out, input_precision="ieee")
        dp = tl.dot(grad_out, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])  # the softmax's backward
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
    _store_rows(dk_ptr, keys, n_keys, dk * scale, HEAD_DIM)
    _store_rows(dv_ptr, keys, n_keys, dv, HEAD_DIM)


@_jit
def _query_grads_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    grad_out_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    n_queries,
    n_keys,
    scale,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dQ of one tile of BLOCK_Q queries, summed over the key tiles it sees."""
    q_start = tl.program_id(0) * BLOCK_Q
    head = tl.program_id(1).to(tl.int64)
    q_ptr += head * n_queries * HEAD_DIM
    grad_out_ptr += head * n_queries * HEAD_DIM
    dq_ptr += head * n_queries * HEAD_DIM
    lse_ptr += head * n_queries
    delta_ptr += head * n_queries
    k_ptr += head * n_keys * HEAD_DIM
    v_ptr += head * n_keys * HEAD_DIM

    queries = q_start + tl.arange(0, BLOCK_Q)
    q = _load_rows(q_ptr, queries, n_queries, HEAD_DIM)
    grad_out = _load_rows(grad_out_ptr, queries, n_queries, HEAD_DIM)
    in_range = queries < n_queries
    lse = tl.load(lse_ptr + queries, mask=in_range, other=0.0)
    delta = tl.load(delta_ptr + queries, mask=in_range, other=0.0)
    dq = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
    offset = n_keys - n_queries
    keys_end = n_keys
    if CAUSAL:
        keys_end = tl.minimum(n_keys, q_start + BLOCK_Q + offset)
    for k_start in range(0, keys_end, BLOCK_K):
        keys = k_start + tl.arange(0, BLOCK_K)
        k = _load_rows(k_ptr, keys, n_keys, HEAD_DIM)
        v = _load_rows(v_ptr, keys, n_keys, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where(_visible(queries, keys, n_keys, offset, CAUSAL), scores, float("-inf"))
        p = tl.exp(scores - lse[:, None])
        dp = tl.dot(grad_out, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    _store_rows(dq_ptr, queries, n_queries, dq * scale, HEAD_DIM)


# Whether the kernels above were built for Triton's interpreter (TRITON_INTERPRET=1 at import).
_INTERPRETED = triton is not None and not isinstance(_forward_kernel, triton.runtime.JITFunction)
