"""Checkers for the chapter 2 workbook: attention scores, scaled dot-product attention,
multi-head attention."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import einops
import torch
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import attention
from transformer_course.checks import CheckFailure, call, expect, expect_close, passed
from transformer_course.checks.masking import (
    OVERFLOW_HINT,
    call_with_hint,
    expect_mask_not_inverted,
)
from transformer_course.masking import causal_mask, combine_masks, padding_mask

__all__ = [
    "check_attention_scores",
    "check_scaled_dot_product_attention",
    "check_multi_head_attention",
]

SCALE_HINT = "divide the scores by sqrt(d_head): without it the softmax saturates as d_head grows."
KEYS_HINT = (
    "take the softmax over keys, the last dim (`dim=-1`): each query's weights must sum to one."
)
NAN_HINT = (
    "a query with no allowed key must give zeros, not NaN: fill forbidden scores with a large "
    "finite negative number (`torch.finfo(dtype).min`, not -inf) and zero those rows after the "
    "softmax (`masked_softmax` from chapter 3 does both)."
)
NO_MASK_HINT = "`mask` defaults to None, which means every query sees every key: skip the masking."
HOOK_HINTS = {
    "hook_q": "q = einsum(x, W_Q, 'batch pos d_model, head d_model d_head -> batch pos head "
    "d_head') + b_Q.",
    "hook_k": "keys come from the context (x for self-attention), projected with W_K and b_K.",
    "hook_v": "values come from the context (x for self-attention), projected with W_V and b_V.",
    "hook_attn_scores": "scores are q k^T / sqrt(d_head), shape (batch, head, q_pos, k_pos).",
    "hook_pattern": "the pattern is the masked softmax of the scores over keys.",
    "hook_z": "z = pattern @ v, rearranged to (batch, q_pos, head, d_head).",
}
CROSS_HINT = "in cross-attention keys and values come from `context`, not from x."
CAUSAL_HINT = "`causal=True` adds `causal_mask(q_pos, k_pos)` to `mask`: AND the two."
PADDING_HINT = (
    "a padding mask (batch, 1, 1, k_pos) hides keys, not queries; apply it before the softmax."
)


def _qkv(
    q_len: int, k_len: int, d_head: int, d_v: int, seed: int = 0, scale: float = 1.0
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 3, q_len, d_head, generator=g, dtype=torch.float64) * scale,
        torch.randn(2, 3, k_len, d_head, generator=g, dtype=torch.float64) * scale,
        torch.randn(2, 3, k_len, d_v, generator=g, dtype=torch.float64),
    )


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-8) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().to(b.dtype), b, atol=atol, rtol=1e-6)


def check_attention_scores(fn: Callable[..., torch.Tensor]) -> None:
    """`attention_scores(q, k)`: q k^T / sqrt(d_head), shape (..., q_pos, k_pos)."""
    name = "attention_scores"
    q, k, _ = _qkv(4, 6, 16, 16)
    expected = attention.attention_scores(q, k)
    actual = call(name, fn, q, k)
    expect(
        isinstance(actual, torch.Tensor),
        name,
        f"expected a torch.Tensor, got {type(actual).__name__}.",
    )
    expect(
        tuple(actual.shape) != (2, 3, 6, 4),
        name,
        "got shape (..., k_pos, q_pos).",
        "one row per query: einsum '... q_pos d_head, ... k_pos d_head -> ... q_pos k_pos'.",
    )
    expect(
        not _close(actual, expected * math.sqrt(16)), name, "the scores are not scaled.", SCALE_HINT
    )
    expect(
        not _close(actual, expected / math.sqrt(16)),
        name,
        "the scores are divided by d_head.",
        "divide by the square root of d_head, not d_head itself.",
    )
    expect_close(
        actual, expected, name, "dot every query with every key, then scale.", atol=1e-8, rtol=1e-6
    )
    passed(name)


def _check_sdpa_case(
    fn: Callable[..., Any],
    where: str,
    qkv: tuple[torch.Tensor, ...],
    mask: torch.Tensor | None,
    large_scores: bool = False,
) -> None:
    """One call of the learner's attention, compared step by step with the reference."""
    q, k, v = qkv
    if mask is None:
        result = call_with_hint(where, NO_MASK_HINT, fn, q, k, v, mask)
    else:
        result = call(where, fn, q, k, v, mask)
    expect(
        isinstance(result, tuple) and len(result) == 2, where, "expected a tuple (out, pattern)."
    )
    out, pattern = result
    expected_out, expected_pattern = attention.scaled_dot_product_attention(q, k, v, mask)
    got = tuple(pattern.shape) if isinstance(pattern, torch.Tensor) else type(pattern).__name__
    expect(
        isinstance(pattern, torch.Tensor) and pattern.shape == expected_pattern.shape,
        where,
        f"expected the pattern's shape {tuple(expected_pattern.shape)} (..., q_pos, k_pos), "
        f"got {got}.",
    )
    if mask is not None:
        expect_mask_not_inverted(where, pattern, mask)
    expect(
        bool(torch.isfinite(pattern).all()),
        where,
        "the pattern contains NaN or inf.",
        OVERFLOW_HINT if large_scores else NAN_HINT,
    )
    unscaled, _ = attention.scaled_dot_product_attention(q * math.sqrt(q.shape[-1]), k, v, mask)
    expect(
        not _close(out, unscaled),
        where,
        "the output matches attention without scaling.",
        SCALE_HINT,
    )
    sums = pattern.sum(-1)
    expect(
        _close(sums, torch.ones_like(expected_pattern.sum(-1)), atol=1e-6),
        where,
        "the weights of a query (a row of the pattern) do not sum to one.",
        KEYS_HINT,
    )
    if mask is not None:
        leaked = pattern.detach().masked_select(~mask.expand_as(pattern)).abs().max().item()
        expect(
            leaked < 1e-6,
            where,
            f"forbidden keys get weight (up to {leaked:.3g}).",
            "apply the mask to the scores before the softmax (True = may attend).",
        )
    hint = OVERFLOW_HINT if large_scores else "softmax(q k^T / sqrt(d_head)) over keys."
    expect_close(pattern, expected_pattern, f"{where}, pattern", hint, atol=1e-8)
    expect_close(out, expected_out, f"{where}, output", "the output is pattern @ v.", atol=1e-8)


def check_scaled_dot_product_attention(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """`scaled_dot_product_attention(q, k, v, mask=None) -> (out, pattern)`: without a mask,
    with causal and padding masks, with scores large enough to overflow a naive exp, and with
    a query that may attend to nothing."""
    name = "scaled_dot_product_attention"
    padding = padding_mask(torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]), 0)
    cases = [
        ("no mask", _qkv(5, 5, 8, 8), None),
        ("q_len != k_len, d_v != d_head", _qkv(3, 7, 8, 5, seed=1), None),
        ("a causal mask", _qkv(6, 6, 16, 16, seed=2), causal_mask(6)),
        ("a padding mask", _qkv(4, 5, 8, 8, seed=3), padding),
    ]
    for label, qkv, mask in cases:
        _check_sdpa_case(fn, f"{name} ({label})", qkv, mask)
    large = _qkv(4, 6, 8, 8, seed=6, scale=30.0)
    _check_sdpa_case(fn, f"{name} (scores in the thousands)", large, causal_mask(4, 6), True)

    q, k, v = _qkv(3, 5, 8, 8, seed=5)
    where = f"{name} (called without a mask)"
    result = call_with_hint(where, NO_MASK_HINT, fn, q, k, v)
    expect(
        isinstance(result, tuple) and len(result) == 2, where, "expected a tuple (out, pattern)."
    )
    expected = attention.scaled_dot_product_attention(q, k, v)[0]
    expect_close(result[0], expected, where, NO_MASK_HINT, atol=1e-8)

    _expect_input_dtype_kept(name, fn)

    q, k, v = _qkv(4, 4, 8, 8, seed=4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    where = f"{name} (a query with no allowed key)"
    out, pattern = call(name, fn, q, k, v, mask)
    expect(
        not torch.isnan(out).any().item() and not torch.isnan(pattern).any().item(),
        where,
        "the result contains NaN.",
        NAN_HINT,
    )
    expect(
        torch.equal(out[..., 1, :].detach(), torch.zeros_like(out[..., 1, :])),
        where,
        "expected zeros for that query.",
        NAN_HINT,
    )
    passed(name)


def _expect_input_dtype_kept(name: str, fn: Callable[..., Any]) -> None:
    """float16 inputs give float16 results, close to the reference's."""
    q, k, v = (t.to(torch.float16) for t in _qkv(4, 5, 8, 8, seed=7))
    mask = causal_mask(4, 5)
    where = f"{name} (float16 inputs)"
    result = call(where, fn, q, k, v, mask)
    expect(
        isinstance(result, tuple) and len(result) == 2, where, "expected a tuple (out, pattern)."
    )
    dtypes = [getattr(t, "dtype", type(t).__name__) for t in result]
    expect(
        dtypes == [torch.float16, torch.float16],
        where,
        f"expected float16 results (the dtype of q), got {dtypes[0]} and {dtypes[1]}.",
        "computing in float32 inside is fine (more accurate, even); return `.to(q.dtype)`.",
    )
    expected_out, _ = attention.scaled_dot_product_attention(q, k, v, mask)
    expect_close(result[0], expected_out, where, "the output is pattern @ v.", atol=1e-2, rtol=1e-2)


def _run_with_cache(
    module: torch.nn.Module, *args: object, **kwargs: object
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(module, HookedRootModule):
        out, cache = module.run_with_cache(*args, **kwargs)
        return out, dict(cache.items())
    return module(*args, **kwargs), {}


def _expect_parameters(name: str, cls: type[torch.nn.Module]) -> None:
    """TransformerLens names and shapes; GPT-2's initialisation."""
    torch.manual_seed(0)
    module = call(name, cls, 64, 4)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    reference = attention.MultiHeadAttention(64, 4)
    expected_shapes = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    expect(
        shapes == expected_shapes,
        name,
        f"expected parameters {expected_shapes}, got {shapes}.",
        "use TransformerLens names and shapes: W_Q is (n_heads, d_model, d_head), W_O is "
        "(n_heads, d_head, d_model).",
    )
    for bias in ("b_Q", "b_K", "b_V", "b_O"):
        value = getattr(module, bias).detach()
        zero_hint = "initialise biases to zero, as GPT-2 and TransformerLens do."
        where = f"{name}.{bias}"
        ones = torch.equal(value, torch.ones_like(value))
        expect(not ones, where, "the bias starts at one.", zero_hint)
        zeros = torch.equal(value, torch.zeros_like(value))
        expect(zeros, where, "the bias does not start at zero.", zero_hint)
    for weight in ("W_Q", "W_K", "W_V", "W_O"):
        std = getattr(module, weight).detach().std().item()
        expect(
            0.015 < std < 0.025,
            f"{name}.{weight}",
            f"initial std is {std:.3g}, expected 0.02.",
            "initialise weights with `nn.init.normal_(w, std=0.02)`.",
        )


def _forward_cases() -> list[tuple[str, tuple, dict]]:
    """(label, args, kwargs) for the learner's forward: self- and cross-attention, every mask
    argument, and the optional ones left out."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    context = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    padding = padding_mask(torch.tensor([[4, 5, 6, 7, 8, 9, 1, 2], [3, 4, 5, 0, 0, 0, 0, 0]]), 0)
    empty = torch.ones(2, 1, 6, 8, dtype=torch.bool)
    empty[0, 0, 2] = False
    return [
        ("self-attention, causal mask", (x,), {"mask": causal_mask(6)}),
        ("cross-attention, padding mask", (x, context), {"mask": padding}),
        (
            "cross-attention, a query with no allowed key",
            (x, context),
            {"mask": combine_masks(empty, padding)},
        ),
        ("self-attention, causal=True", (x,), {"causal": True}),
        ("causal=True and a padding mask", (x,), {"mask": padding[..., :6], "causal": True}),
        ("self-attention, no mask", (x,), {}),
    ]


def _expect_forward(name: str, module: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every forward case, hook by hook, then the output."""
    for label, args, kwargs in _forward_cases():
        where = f"{name} ({label})"
        if kwargs.get("causal"):
            hint = CAUSAL_HINT
        elif "mask" not in kwargs:
            hint = NO_MASK_HINT
        else:
            hint = "compare each step with the reference using run_with_cache."
        expected, ref_cache = reference.run_with_cache(*args, **kwargs)
        actual, cache = call_with_hint(where, hint, _run_with_cache, module, *args, **kwargs)
        # The mask the reference applies: `mask` and, with causal=True, the causal mask.
        causal = causal_mask(args[0].shape[1], args[-1].shape[1]) if kwargs.get("causal") else None
        mask = combine_masks(causal, kwargs.get("mask"))
        leak_hint = CAUSAL_HINT if kwargs.get("causal") else PADDING_HINT
        _compare_hooks(where, cache, ref_cache, mask, cross=len(args) > 1, leak_hint=leak_hint)
        _explain_output(where, actual, expected, ref_cache["hook_z"], reference)
        expect_close(actual, expected, where, hint, atol=1e-8)


def check_multi_head_attention(cls: type[torch.nn.Module]) -> None:
    """`MultiHeadAttention`: TransformerLens parameters and initialisation, then the forward
    pass compared hook by hook with the reference (self- and cross-attention, every mask
    argument, `causal=True`, no mask), the fast path and `bias=False`."""
    name = "MultiHeadAttention"
    _expect_parameters(name, cls)

    reference = attention.MultiHeadAttention(16, 4).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    module = call(name, cls, 16, 4).double()
    call(f"{name}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    _expect_forward(name, module, reference)

    _, (x, context), kwargs = _forward_cases()[1]
    if hasattr(module, "fast_path"):
        module.fast_path = True
        expect_close(
            call(name, module, x, context, **kwargs),
            reference(x, context, **kwargs),
            f"{name} (fast_path=True)",
            "F.scaled_dot_product_attention wants (batch, head, pos, d_head) and a bool "
            "attn_mask with True = may attend.",
            atol=1e-8,
        )
    _expect_no_bias_variant(name, cls, x, context, kwargs["mask"])
    passed(name)


def _expect_no_bias_variant(
    name: str, cls: type, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor
) -> None:
    """`bias=False`: no bias parameters, `reset_parameters` copes, and the forward pass skips
    them."""
    where = f"{name}(bias=False)"
    module = call(where, cls, 16, 4, bias=False).double()
    reference = attention.MultiHeadAttention(16, 4, bias=False).double()
    expected = sorted(n for n, _ in reference.named_parameters())
    expect(
        sorted(n for n, _ in module.named_parameters()) == expected,
        where,
        f"expected only the parameters {expected}.",
        "with bias=False register the biases as None, and skip them in reset_parameters and "
        "forward.",
    )
    call(f"{where}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    call(f"{where}.reset_parameters", module.reset_parameters)
    call(f"{where}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    expect_close(
        call(where, module, x, context, mask=mask),
        reference(x, context, mask=mask),
        where,
        "without biases the projections are the einsums alone.",
        atol=1e-8,
    )


def _expect_own_tensor(stage: str, hook: str, actual: torch.Tensor, ref_cache: dict) -> None:
    """Recognise a hook point fed the tensor that belongs at another hook point."""
    for other, tensor in ref_cache.items():
        if other != hook and other in HOOK_HINTS and _close(actual, tensor):
            raise CheckFailure(
                f"`{stage}`: received the tensor that belongs at `{other}`.\n"
                f"Hint: pass each intermediate through its own hook point; {hook} gets: "
                f"{HOOK_HINTS[hook]}"
            )


def _compare_hooks(
    where: str,
    cache: dict,
    ref_cache: dict,
    mask: torch.Tensor | None,
    *,
    cross: bool,
    leak_hint: str,
) -> None:
    """Point at the first intermediate tensor that differs from the reference."""
    hints = dict(HOOK_HINTS)
    if cross:
        hints["hook_k"] = hints["hook_v"] = CROSS_HINT
    if mask is None:
        mask = torch.ones(ref_cache["hook_pattern"].shape, dtype=torch.bool)
    elif "hook_pattern" in cache:
        expect_mask_not_inverted(f"{where}, hook_pattern", cache["hook_pattern"], mask)
    allowed = mask.expand_as(ref_cache["hook_pattern"])
    for hook, hint in hints.items():
        if hook not in cache:
            continue
        actual, expected = cache[hook], ref_cache[hook]
        stage = f"{where}, {hook}"
        expect(
            tuple(actual.shape) == tuple(expected.shape),
            stage,
            f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}.",
            hint,
        )
        if _close(actual, expected):
            continue
        _expect_own_tensor(stage, hook, actual, ref_cache)
        if hook == "hook_attn_scores":
            actual, expected = actual[allowed], expected[allowed]
            unscaled = _close(actual, expected * math.sqrt(4))
            expect(not unscaled, stage, "the scores are not scaled.", SCALE_HINT)
        if hook == "hook_pattern":
            expect(
                not torch.isnan(actual).any().item(), stage, "the pattern contains NaN.", NAN_HINT
            )
            sums = actual.sum(-1)[allowed.any(-1)]
            expect(
                _close(sums, torch.ones_like(sums), atol=1e-6),
                stage,
                "the weights of a query do not sum to one.",
                KEYS_HINT,
            )
            leaked = actual.detach().masked_select(~allowed).abs().max().item()
            expect(
                leaked < 1e-6,
                stage,
                f"forbidden keys get weight (up to {leaked:.3g}).",
                leak_hint,
            )
        expect(_close(actual, expected), stage, "differs from the reference.", hint)


def _explain_output(
    where: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    z: torch.Tensor,
    ref: torch.nn.Module,
) -> None:
    """Recognise heads concatenated in the wrong order before the output projection."""
    if not isinstance(actual, torch.Tensor) or _close(actual, expected):
        return
    swapped = einops.rearrange(z, "batch pos head d_head -> batch pos (d_head head)")
    W_O = einops.rearrange(ref.W_O, "head d_head d_model -> (head d_head) d_model")
    if _close(actual, swapped @ W_O + ref.b_O):
        raise CheckFailure(
            f"`{where}`: the heads are concatenated in the wrong order.\n"
            "Hint: flatten z with '(head d_head)' (head outermost) so it lines up with W_O's "
            "(head d_head) rows, or sum W_O[head] projections over heads with one einsum."
        )
