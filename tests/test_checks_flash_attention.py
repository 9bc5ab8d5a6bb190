"""The FlashAttention-2 checkers (`checks.flash_attention`): a tiled alternative passes, and each
classic mistake of the forward, the backward and the autograd function is named (each written
out here as a small variant of the reference, as a learner would write it)."""

from __future__ import annotations

import math

import torch
from checking import fails

from transformer_course import flash_attention
from transformer_course.checks.flash_attention import (
    check_flash_attention_backward,
    check_flash_attention_forward,
    check_flash_attention_function,
)
from transformer_course.masking import causal_mask


def whole_attention_forward(q, k, v, causal=False, *, q_tile=64, k_tile=64):
    """Right numbers, no tiles: the whole pattern at once."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def test_forward_mistakes_are_named():
    fails(check_flash_attention_forward, whole_attention_forward, "pattern", "one tile at a time")

    def lse_without_max(q, k, v, causal=False, **tiles):
        out, lse = flash_attention.flash_attention_forward(q, k, v, causal, **tiles)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
        return out, lse - scores.amax(-1)

    fails(check_flash_attention_forward, lse_without_max, "m + log(l)")

    def first_keys(q, k, v, causal=False, **tiles):
        if causal and q.shape[-2] < k.shape[-2]:  # aligned to the first keys
            n = q.shape[-2]
            out, lse = flash_attention.flash_attention_forward(
                q, k[..., :n, :], v[..., :n, :], True
            )
            return out, lse
        return flash_attention.flash_attention_forward(q, k, v, causal, **tiles)

    fails(check_flash_attention_forward, first_keys, "last")

    def in_float32_out(q, k, v, causal=False, **tiles):
        out, lse = flash_attention.flash_attention_forward(q.float(), k.float(), v.float(), causal)
        return (out.double() if q.dtype == torch.float64 else out), lse.to(q.dtype)

    fails(check_flash_attention_forward, in_float32_out, "float")


def test_a_forward_without_rescaling_is_named():
    def no_rescale(q, k, v, causal=False, *, q_tile=64, k_tile=64):
        n_q, n_k = q.shape[-2], k.shape[-2]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
        for i0 in range(0, n_q, q_tile):
            q_i = q[..., i0 : i0 + q_tile, :] / math.sqrt(q.shape[-1])
            m = torch.full(q_i.shape[:-1], -math.inf, dtype=q.dtype)
            l, acc = torch.zeros_like(m), torch.zeros_like(q_i)  # noqa: E741
            for j0 in range(0, n_k, k_tile):
                s = q_i @ k[..., j0 : j0 + k_tile, :].transpose(-2, -1)
                if causal:
                    i = torch.arange(i0, i0 + q_i.shape[-2])[:, None] + n_k - n_q
                    s = s.masked_fill(torch.arange(j0, j0 + s.shape[-1]) > i, -math.inf)
                m = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m[..., None])
                l, acc = l + p.sum(-1), acc + p @ v[..., j0 : j0 + k_tile, :]  # noqa: E741
            out[..., i0 : i0 + q_tile, :] = acc / l[..., None]
            lse[..., i0 : i0 + q_tile] = m + torch.log(l)
        return out, lse

    fails(check_flash_attention_forward, no_rescale, "exp(m - m')")


def tiled_forward(stop=lambda i1, offset, n_k: min(n_k, i1 + offset), strict=False, half=False):
    """A learner's tiled forward: `stop` ends the causal key loop, `strict` masks j < i + offset
    (the diagonal out), `half` computes in the inputs' float16 and casts only L."""

    def forward(q, k, v, causal=False, *, q_tile=64, k_tile=64):
        n_q, n_k = q.shape[-2], k.shape[-2]
        up = (
            (lambda t: t)
            if half
            else (lambda t: t.double() if t.dtype == torch.float64 else t.float())
        )
        out, lse = (
            torch.empty_like(q),
            torch.empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32)),
        )
        for i0 in range(0, n_q, q_tile):
            i1 = min(i0 + q_tile, n_q)
            q_i = up(q[..., i0:i1, :]) / math.sqrt(q.shape[-1])
            m = torch.full(q_i.shape[:-1], -math.inf, dtype=q_i.dtype)
            l, acc = torch.zeros_like(m), torch.zeros_like(q_i)  # noqa: E741
            for j0 in range(0, stop(i1, n_k - n_q, n_k) if causal else n_k, k_tile):
                s = q_i @ up(k[..., j0 : j0 + k_tile, :]).transpose(-2, -1)
                if causal:
                    i = torch.arange(i0, i1)[:, None] + n_k - n_q
                    j = torch.arange(j0, j0 + s.shape[-1])
                    s = s.masked_fill(j >= i if strict else j > i, -math.inf)
                m_new = torch.maximum(m, s.amax(-1))
                p, rescale = torch.exp(s - m_new[..., None]), torch.exp(m - m_new)
                l = rescale * l + p.sum(-1)  # noqa: E741
                acc = rescale[..., None] * acc + p @ up(v[..., j0 : j0 + k_tile, :])
                m = m_new
            out[..., i0:i1, :] = (acc / l[..., None]).to(q.dtype)
            lse[..., i0:i1] = m + torch.log(l)
        return out, lse

    return forward


def test_tiled_forward_alternative_passes():
    check_flash_attention_forward(tiled_forward())


def test_causal_forward_tiles_are_checked_at_every_alignment():
    short = tiled_forward(stop=lambda i1, offset, n_k: min(n_k, i1 - 1 + offset))
    fails(check_flash_attention_forward, short, "key loop stops short", "never met key")
    fails(check_flash_attention_forward, tiled_forward(strict=True), "diagonal", "<=, not <")
    fails(check_flash_attention_forward, tiled_forward(half=True), "accumulate in float32")


def tiled_backward(first=lambda j0, offset, q_tile: max(0, j0 - offset) // q_tile, half=False):
    """A learner's backward: key tiles outside, the query tiles from `first(j0, offset, q_tile)`
    on inside; `half` computes in the inputs' float16."""

    def backward(q, k, v, out, lse, grad_out, causal=False, *, q_tile=64, k_tile=64):
        n_q, n_k, scale = q.shape[-2], k.shape[-2], 1 / math.sqrt(q.shape[-1])
        offset = n_k - n_q
        up = (
            (lambda t: t.to(q.dtype))
            if half
            else (lambda t: t.double() if t.dtype == torch.float64 else t.float())
        )
        D = (up(grad_out) * up(out)).sum(-1)
        dq, dk, dv = (torch.zeros_like(up(t)) for t in (q, k, v))
        for j0 in range(0, n_k, k_tile):
            k_j, v_j = up(k[..., j0 : j0 + k_tile, :]), up(v[..., j0 : j0 + k_tile, :])
            j = torch.arange(j0, j0 + k_j.shape[-2])
            for i0 in range(first(j0, offset, q_tile) * q_tile if causal else 0, n_q, q_tile):
                i1 = min(i0 + q_tile, n_q)
                q_i, do_i = up(q[..., i0:i1, :]), up(grad_out[..., i0:i1, :])
                p = torch.exp(q_i @ k_j.transpose(-2, -1) * scale - up(lse[..., i0:i1, None]))
                if causal:
                    p = p.masked_fill(j > torch.arange(i0, i1)[:, None] + offset, 0.0)
                dv[..., j0 : j0 + k_tile, :] += p.transpose(-2, -1) @ do_i
                ds = p * (do_i @ v_j.transpose(-2, -1) - D[..., i0:i1, None])
                dq[..., i0:i1, :] += ds @ k_j * scale
                dk[..., j0 : j0 + k_tile, :] += ds.transpose(-2, -1) @ q_i * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    return backward


def test_tiled_backward_alternative_passes():
    check_flash_attention_backward(tiled_backward())


def test_causal_backward_tiles_are_checked_at_every_alignment():
    one_off = tiled_backward(first=lambda j0, offset, q_tile: -(-max(0, j0 - offset) // q_tile))
    fails(check_flash_attention_backward, one_off, "query tiles that meet key tile", "never met")
    fails(check_flash_attention_backward, tiled_backward(half=True), "computed in float16")


def test_backward_mistakes_are_named():
    def whole(q, k, v, out, lse, grad_out, causal=False, **tiles):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        o, _ = whole_attention_forward(q, k, v, causal)
        return torch.autograd.grad(o, (q, k, v), grad_out)

    fails(check_flash_attention_backward, whole, "pattern")

    def no_correction(q, k, v, out, lse, grad_out, causal=False, **tiles):
        return flash_attention.flash_attention_backward(
            q, k, v, torch.zeros_like(out), lse, grad_out, causal, **tiles
        )  # D = rowsum(dO * 0) = 0

    fails(check_flash_attention_backward, no_correction, "dS = P * (dP - D)")

    def unscaled(q, k, v, out, lse, grad_out, causal=False, **tiles):
        dq, dk, dv = flash_attention.flash_attention_backward(
            q, k, v, out, lse, grad_out, causal, **tiles
        )
        return dq * math.sqrt(q.shape[-1]), dk * math.sqrt(q.shape[-1]), dv

    fails(check_flash_attention_backward, unscaled, "1/sqrt(d)")


class SavesPattern(torch.autograd.Function):
    """Right gradients, but the whole pattern kept for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, q_tile=64, k_tile=64):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
        p = torch.softmax(scores, -1)
        ctx.save_for_backward(q, k, v, p, torch.logsumexp(scores, -1))
        return p @ v

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, p, _ = ctx.saved_tensors
        dv = p.transpose(-2, -1) @ grad_out
        dp = grad_out @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
        return ds @ k, ds.transpose(-2, -1) @ q, dv, None, None, None


class LseOnCtx(flash_attention.FlashAttention):
    """Keeps L as an attribute of ctx instead of saving it."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, q_tile=64, k_tile=64):
        out, ctx.lse = flash_attention.flash_attention_forward(
            q, k, v, causal, q_tile=q_tile, k_tile=k_tile
        )
        ctx.save_for_backward(q, k, v, out)
        ctx.causal, ctx.tiles = causal, dict(q_tile=q_tile, k_tile=k_tile)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        grads = flash_attention.flash_attention_backward(
            q, k, v, out, ctx.lse, grad_out, ctx.causal, **ctx.tiles
        )
        return *grads, None, None, None


class OutOnCtx(flash_attention.FlashAttention):
    """Keeps the output as an attribute of ctx instead of saving it."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, q_tile=64, k_tile=64):
        ctx.out, lse = flash_attention.flash_attention_forward(
            q, k, v, causal, q_tile=q_tile, k_tile=k_tile
        )
        ctx.save_for_backward(q, k, v, lse)
        ctx.causal, ctx.tiles = causal, dict(q_tile=q_tile, k_tile=k_tile)
        return ctx.out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lse = ctx.saved_tensors
        grads = flash_attention.flash_attention_backward(
            q, k, v, ctx.out, lse, grad_out, ctx.causal, **ctx.tiles
        )
        return *grads, None, None, None


class NoTiles(flash_attention.FlashAttention):
    """Takes no tile sizes, and returns four gradients."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False):
        return flash_attention.FlashAttention.forward(ctx, q, k, v, causal)

    @staticmethod
    def backward(ctx, grad_out):
        return flash_attention.FlashAttention.backward(ctx, grad_out)[:4]


class TooFewGradients(flash_attention.FlashAttention):
    @staticmethod
    def backward(ctx, grad_out):
        return flash_attention.FlashAttention.backward(ctx, grad_out)[:3]


class IgnoresTiles(flash_attention.FlashAttention):
    """Takes the tile sizes but runs the forward with the default ones."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, q_tile=64, k_tile=64):
        return flash_attention.FlashAttention.forward(ctx, q, k, v, causal)


class BackwardWithoutTiles(flash_attention.FlashAttention):
    """Tiles the forward, but runs the backward with the default tiles."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = flash_attention.flash_attention_backward(q, k, v, out, lse, grad_out, ctx.causal)
        return *grads, None, None, None


def test_flash_attention_function_mistakes_are_named():
    fails(check_flash_attention_function, SavesPattern, "size of the pattern")
    fails(check_flash_attention_function, LseOnCtx, "exactly one saved tensor", "attribute of ctx")
    fails(check_flash_attention_function, TooFewGradients, "None for causal")
    fails(check_flash_attention_function, OutOnCtx, "q and the output saved")
    fails(check_flash_attention_function, NoTiles, "the tile sizes follow causal")
    fails(check_flash_attention_function, IgnoresTiles, "its forward", "pass q_tile and k_tile")
    fails(check_flash_attention_function, BackwardWithoutTiles, "its backward", "ctx")


def test_a_backward_that_returns_float32_for_half_inputs_is_named():
    def in_float32(q, k, v, out, lse, grad_out, causal=False, **tiles):
        dq, dk, dv = flash_attention.flash_attention_backward(
            q, k, v, out, lse, grad_out, causal, **tiles
        )
        return dq.float(), dk.float(), dv.float()

    fails(check_flash_attention_backward, in_float32, "not float16", "input's dtype")
