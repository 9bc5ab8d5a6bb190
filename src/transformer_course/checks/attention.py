"""Checkers for the chapter 2 workbook: attention scores, scaled dot-product attention, multi-head attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import einops
import torch
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import attention
from transformer_course.checks import CheckFailure, call, expect, expect_close, passed
from transformer_course.masking import causal_mask, combine_masks, padding_mask

__all__ = ["check_attention_scores", "check_scaled_dot_product_attention", "check_multi_head_attention"]

SCALE_HINT = "divide the scores by sqrt(d_head): without it the softmax saturates as d_head grows."
KEYS_HINT = "take the softmax over keys, the last dim (`dim=-1`): each query's weights must sum to one."
INVERTED_HINT = (
    "True means *may attend*: fill the scores where the mask is False (`~mask`), not where it is True."
)
NAN_HINT = (
    "a query with no allowed key must give zeros, not NaN: fill forbidden scores with a large finite "
    "negative number (`torch.finfo(dtype).min`, not -inf) and zero those rows after the softmax "
    "(`masked_softmax` from chapter 3 does both)."
)


def _qkv(q_len: int, k_len: int, d_head: int, d_v: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, 3, q_len, d_head, generator=g, dtype=torch.float64),
        torch.randn(2, 3, k_len, d_head, generator=g, dtype=torch.float64),
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
    expect(isinstance(actual, torch.Tensor), name, f"expected a torch.Tensor, got {type(actual).__name__}.")
    expect(tuple(actual.shape) != (2, 3, 6, 4), name, "got shape (..., k_pos, q_pos).",
           "one row per query: einsum '... q_pos d_head, ... k_pos d_head -> ... q_pos k_pos'.")
    expect(not _close(actual, expected * math.sqrt(16)), name, "the scores are not scaled.", SCALE_HINT)
    expect(not _close(actual, expected / math.sqrt(16)), name, "the scores are divided by d_head.",
           "divide by the square root of d_head, not d_head itself.")
    expect_close(actual, expected, name, "dot every query with every key, then scale.", atol=1e-8, rtol=1e-6)
    passed(name)


def check_scaled_dot_product_attention(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`scaled_dot_product_attention(q, k, v, mask=None) -> (out, pattern)`."""
    name = "scaled_dot_product_attention"
    cases = [
        ("no mask", _qkv(5, 5, 8, 8), None),
        ("q_len != k_len, d_v != d_head", _qkv(3, 7, 8, 5, seed=1), None),
        ("a causal mask", _qkv(6, 6, 16, 16, seed=2), causal_mask(6)),
        ("a padding mask", _qkv(4, 5, 8, 8, seed=3), padding_mask(torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]), 0)),
    ]
    for label, (q, k, v), mask in cases:
        where = f"{name} ({label})"
        result = call(name, fn, q, k, v, mask)
        expect(isinstance(result, tuple) and len(result) == 2, where, "expected a tuple (out, pattern).")
        out, pattern = result
        expected_out, expected_pattern = attention.scaled_dot_product_attention(q, k, v, mask)
        expect(isinstance(pattern, torch.Tensor) and pattern.shape == expected_pattern.shape, where,
               f"expected the pattern's shape {tuple(expected_pattern.shape)} (..., q_pos, k_pos), "
               f"got {tuple(pattern.shape) if isinstance(pattern, torch.Tensor) else type(pattern).__name__}.")
        expect(not torch.isnan(pattern).any().item(), where, "the pattern contains NaN.", NAN_HINT)
        if mask is not None:
            _, inverted = attention.scaled_dot_product_attention(q, k, v, ~mask)
            expect(not _close(pattern, inverted), where, "the mask is inverted.", INVERTED_HINT)
        unscaled, _ = attention.scaled_dot_product_attention(q * math.sqrt(q.shape[-1]), k, v, mask)
        expect(not _close(out, unscaled), where, "the output matches attention without scaling.", SCALE_HINT)
        expect(_close(pattern.sum(-1), torch.ones_like(expected_pattern.sum(-1)), atol=1e-6), where,
               "the weights of a query (a row of the pattern) do not sum to one.", KEYS_HINT)
        if mask is not None:
            leaked = pattern.detach().masked_select(~mask.expand_as(pattern)).abs().max().item()
            expect(leaked < 1e-6, where, f"forbidden keys get weight (up to {leaked:.3g}).",
                   "apply the mask to the scores before the softmax (True = may attend).")
        expect_close(pattern, expected_pattern, f"{where}, pattern", "softmax(q k^T / sqrt(d_head)) over keys.", atol=1e-8)
        expect_close(out, expected_out, f"{where}, output", "the output is pattern @ v.", atol=1e-8)

    q, k, v = _qkv(3, 5, 8, 8, seed=5)
    where = f"{name} (called without a mask)"
    result = call(where, fn, q, k, v)
    expect(isinstance(result, tuple) and len(result) == 2, where, "expected a tuple (out, pattern).")
    expect_close(result[0], attention.scaled_dot_product_attention(q, k, v)[0], where,
                 "`mask` defaults to None, which means every query sees every key.", atol=1e-8)

    q, k, v = _qkv(4, 4, 8, 8, seed=4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False
    where = f"{name} (a query with no allowed key)"
    out, pattern = call(name, fn, q, k, v, mask)
    expect(not torch.isnan(out).any().item() and not torch.isnan(pattern).any().item(), where,
           "the result contains NaN.", NAN_HINT)
    expect(torch.equal(out[..., 1, :].detach(), torch.zeros_like(out[..., 1, :])), where,
           "expected zeros for that query.", NAN_HINT)
    passed(name)


def _run(module: torch.nn.Module, *args: object, **kwargs: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if isinstance(module, HookedRootModule):
        out, cache = module.run_with_cache(*args, **kwargs)
        return out, dict(cache.items())
    return module(*args, **kwargs), {}


def check_multi_head_attention(cls: type[torch.nn.Module]) -> None:
    """`MultiHeadAttention`: TransformerLens parameters and initialisation, then the forward pass,
    compared hook by hook with the reference (self-attention with a causal mask, cross-attention
    with a padding mask, and the fast path)."""
    name = "MultiHeadAttention"
    torch.manual_seed(0)
    module = call(name, cls, 64, 4)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    expected_shapes = {n: tuple(p.shape) for n, p in attention.MultiHeadAttention(64, 4).named_parameters()}
    expect(shapes == expected_shapes, name, f"expected parameters {expected_shapes}, got {shapes}.",
           "use TransformerLens names and shapes: W_Q is (n_heads, d_model, d_head), W_O is (n_heads, d_head, d_model).")
    for bias in ("b_Q", "b_K", "b_V", "b_O"):
        value = getattr(module, bias).detach()
        expect(not torch.equal(value, torch.ones_like(value)), f"{name}.{bias}", "the bias starts at one.",
               "initialise biases to zero, as GPT-2 and TransformerLens do.")
        expect(torch.equal(value, torch.zeros_like(value)), f"{name}.{bias}", "the bias does not start at zero.",
               "initialise biases to zero, as GPT-2 and TransformerLens do.")
    for weight in ("W_Q", "W_K", "W_V", "W_O"):
        std = getattr(module, weight).detach().std().item()
        expect(0.015 < std < 0.025, f"{name}.{weight}", f"initial std is {std:.3g}, expected 0.02.",
               "initialise weights with `nn.init.normal_(w, std=0.02)`.")

    reference = attention.MultiHeadAttention(16, 4).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    module = call(name, cls, 16, 4).double()
    call(f"{name}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)

    x = torch.randn(2, 6, 16, generator=g, dtype=torch.float64)
    context = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    tokens = torch.tensor([[4, 5, 6, 7, 8, 9, 1, 2], [3, 4, 5, 0, 0, 0, 0, 0]])
    empty = torch.ones(2, 1, 6, 8, dtype=torch.bool)
    empty[0, 0, 2] = False
    cases = [
        ("self-attention, causal mask", (x,), {"mask": causal_mask(6)}),
        ("cross-attention, padding mask", (x, context), {"mask": padding_mask(tokens, 0)}),
        ("cross-attention, a query with no allowed key", (x, context),
         {"mask": combine_masks(empty, padding_mask(tokens, 0))}),
    ]
    for label, args, kwargs in cases:
        where = f"{name} ({label})"
        expected, ref_cache = reference.run_with_cache(*args, **kwargs)
        actual, cache = call(name, _run, module, *args, **kwargs)
        _compare_hooks(where, cache, ref_cache, kwargs["mask"], label.startswith("cross"))
        _explain_output(where, actual, expected, ref_cache["hook_z"], reference)
        expect_close(actual, expected, where, "compare each step with the reference using run_with_cache.", atol=1e-8)

    if hasattr(module, "fast_path"):
        module.fast_path = True
        where = f"{name} (fast_path=True)"
        actual = call(name, module, x, context, mask=padding_mask(tokens, 0))
        expected = reference(x, context, mask=padding_mask(tokens, 0))
        expect_close(actual, expected, where,
                     "F.scaled_dot_product_attention wants (batch, head, pos, d_head) and a bool attn_mask "
                     "with True = may attend.", atol=1e-8)
    _expect_no_bias_variant(name, cls, x, context, padding_mask(tokens, 0))
    passed(name)


def _expect_no_bias_variant(name: str, cls: type, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> None:
    """`bias=False`: no bias parameters, `reset_parameters` copes, and the forward pass skips them."""
    where = f"{name}(bias=False)"
    module = call(where, cls, 16, 4, bias=False).double()
    reference = attention.MultiHeadAttention(16, 4, bias=False).double()
    expect({n for n, _ in module.named_parameters()} == {n for n, _ in reference.named_parameters()}, where,
           f"expected only the parameters {sorted(n for n, _ in reference.named_parameters())}.",
           "with bias=False register the biases as None, and skip them in reset_parameters and forward.")
    call(f"{where}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    call(f"{where}.reset_parameters", module.reset_parameters)
    call(f"{where}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    expect_close(call(where, module, x, context, mask=mask), reference(x, context, mask=mask), where,
                 "without biases the projections are the einsums alone.", atol=1e-8)


def _compare_hooks(where: str, cache: dict, ref_cache: dict, mask: torch.Tensor, cross: bool) -> None:
    """Point at the first intermediate tensor that differs from the reference."""
    hints = {
        "hook_q": "q = einsum(x, W_Q, 'batch pos d_model, head d_model d_head -> batch pos head d_head') + b_Q.",
        "hook_k": "keys come from the context (x for self-attention), projected with W_K and b_K.",
        "hook_v": "values come from the context (x for self-attention), projected with W_V and b_V.",
        "hook_attn_scores": "scores are q k^T / sqrt(d_head), shape (batch, head, q_pos, k_pos).",
        "hook_pattern": "the pattern is the masked softmax of the scores over keys.",
        "hook_z": "z = pattern @ v, rearranged to (batch, q_pos, head, d_head).",
    }
    if cross:
        hints["hook_k"] = "in cross-attention keys and values come from `context`, not from x."
        hints["hook_v"] = hints["hook_k"]
    for hook, hint in hints.items():
        if hook not in cache:
            continue
        actual, expected = cache[hook], ref_cache[hook]
        stage = f"{where}, {hook}"
        expect(tuple(actual.shape) == tuple(expected.shape), stage,
               f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}.", hint)
        if hook == "hook_attn_scores":
            allowed = mask.expand_as(expected)
            actual, expected = actual[allowed], expected[allowed]
            expect(not _close(actual, expected * math.sqrt(4)), stage, "the scores are not scaled.", SCALE_HINT)
        if hook == "hook_pattern":
            expect(not torch.isnan(actual).any().item(), stage, "the pattern contains NaN.", NAN_HINT)
            sums = actual.sum(-1)[mask.expand_as(expected).any(-1)]
            expect(_close(sums, torch.ones_like(sums), atol=1e-6), stage,
                   "the weights of a query do not sum to one.", KEYS_HINT)
            leaked = actual.detach().masked_select(~mask.expand_as(expected)).abs().max().item()
            expect(leaked < 1e-6, stage, f"forbidden keys get weight (up to {leaked:.3g}).",
                   "a padding mask (batch, 1, 1, k_pos) hides keys, not queries; apply it before the softmax.")
        expect(_close(actual, expected), stage, "differs from the reference.", hint)


def _explain_output(where: str, actual: torch.Tensor, expected: torch.Tensor, z: torch.Tensor, ref: torch.nn.Module) -> None:
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
