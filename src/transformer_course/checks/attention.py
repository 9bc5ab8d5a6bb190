"""Checkers for chapter 2's workbook (02_attention): attention scores, scaled dot-product
attention, multi-head attention with both of its paths."""

from __future__ import annotations

from collections.abc import Callable

import einops
import torch
from torch.overrides import TorchFunctionMode

from transformer_course import attention
from transformer_course.checks.harness import (
    OVERFLOW_HINT,
    call,
    describe,
    expect,
    expect_cached,
    expect_close,
    expect_hooks_used,
    expect_mask_not_inverted,
    expect_no_known_mistake,
    expect_raises,
    matches,
    passed,
    perturb,
    randn,
    shape_of,
)
from transformer_course.masking import causal_mask, padding_mask

SCALE_HINT = "divide the scores by sqrt(d_head): without it the softmax saturates as d_head grows."
KEYS_HINT = "take the softmax over keys, the last dim (`dim=-1`): each query's weights sum to one."
NAN_HINT = "a query with no allowed key must give zeros, not NaN: fill forbidden scores with "
NAN_HINT += "`torch.finfo(dtype).min` (not -inf) and zero those rows after the softmax."
NO_MASK_HINT = "`mask` defaults to None, which means every query sees every key: skip the masking."
HOOK_HINTS = {
    "hook_q": "queries come from x, projected with W_Q and b_Q, (batch, q_pos, head, d_head).",
    "hook_k": "keys come from the context (x for self-attention), projected with W_K and b_K.",
    "hook_v": "values come from the context (x for self-attention), projected with W_V and b_V.",
    "hook_attn_scores": "scores are q k^T / sqrt(d_head), shape (batch, head, q_pos, k_pos).",
    "hook_pattern": "the pattern is the masked softmax of the scores over keys.",
    "hook_z": "z = pattern @ v, rearranged to (batch, q_pos, head, d_head).",
}
CAUSAL_HINT = "`causal=True` hides later keys on top of `mask`: attend with the mask that "
CAUSAL_HINT += "self._mask(mask, causal, q_pos, k_pos, device) returns, causal part included."
CACHE_HINT = "with a cache, `k, v = cache.extend(k, v)` after moving the heads before the "
CACHE_HINT += "positions; the queries are the last positions, so the causal mask is (q_pos, k_pos)."
FAST_PATH_HINTS = {  # by the value of fast_path
    True: "with fast_path=True one F.scaled_dot_product_attention(q, k, v, attn_mask=mask) call "
    "replaces the scores-pattern-z steps, so hook_attn_scores and hook_pattern are not run.",
    False: "with fast_path=False compute the scores and the pattern with einsums and pass them "
    "through hook_attn_scores and hook_pattern; the fused call is for fast_path=True.",
}


def _qkv(q_len: int, k_len: int, d_head: int, d_v: int, seed: int = 0, scale: float = 1.0):
    q, k, v = randn(3, 2, 3, max(q_len, k_len), max(d_head, d_v), seed=seed)
    return q[..., :q_len, :d_head] * scale, k[..., :k_len, :d_head] * scale, v[..., :k_len, :d_v]


HALF_SCORES = "float16 and bfloat16 inputs give float32 scores: upcast q and k (`upcast`, given) "
HALF_SCORES += "before the dot product, which in float16 overflows past 65504."


def check_attention_scores(fn: Callable) -> None:
    """`attention_scores(q, k)`: q k^T / sqrt(d_head), shape (..., q_pos, k_pos); float32
    scores for float16 and bfloat16 inputs, also where float16's dot product overflows."""
    name, (q, k, _) = "attention_scores", _qkv(4, 6, 16, 16)
    expected, actual = attention.attention_scores(q, k), call(name, fn, q, k)
    root = "divide by the square root of d_head, not d_head itself."
    hint, mistakes = "dot every query with every key, then scale.", {SCALE_HINT: expected * 4}
    expect_close(actual, expected, name, hint, atol=1e-8, mistakes={**mistakes, root: expected / 4})
    for dtype in (torch.float16, torch.bfloat16):
        q, k, _ = _qkv(4, 6, 16, 16, seed=8, scale=90.0)  # dot products up to about 1e5
        q, k = q.to(dtype), k.to(dtype)
        where = f"{name} ({str(dtype)[6:]} q and k whose dot products reach 1e5)"
        actual = call(where, fn, q, k, hint=HALF_SCORES)
        dtype_got = getattr(actual, "dtype", None)
        problem = f"expected float32 scores, got {describe(actual)}."
        expect(dtype_got == torch.float32, where, problem, HALF_SCORES)
        expected = attention.attention_scores(q, k)
        expect_close(actual, expected, where, HALF_SCORES, atol=1e-3, rtol=1e-4)
    passed(name)


def _expect_pattern(where: str, pattern, allowed, nan_hint: str, leak_hint: str) -> None:
    """Weights over the keys `allowed`: the mask's convention, finite, rows summing to one."""
    expect_mask_not_inverted(where, pattern, allowed)
    expect(bool(pattern.isfinite().all()), where, "the pattern contains NaN or inf.", nan_hint)
    sums = pattern.detach().sum(-1)[allowed.any(-1)]
    problem = "the weights of a query (a row of the pattern) do not sum to one."
    expect(matches(sums, torch.ones_like(sums)), where, problem, KEYS_HINT)
    leaked = pattern.detach().masked_fill(allowed, 0).abs().max().item()
    expect(leaked < 1e-6, where, f"forbidden keys get weight (up to {leaked:.3g}).", leak_hint)


def _expect_attention(fn: Callable, where: str, q, k, v, mask, large: bool = False) -> None:
    """One call of the learner's attention (no mask argument when `mask` is None), step by step."""
    args = (q, k, v) if mask is None else (q, k, v, mask)
    result = call(where, fn, *args, hint=NO_MASK_HINT if mask is None else "")
    expect(isinstance(result, tuple) and len(result) == 2, where, "expected (out, pattern).")
    (out, pattern), (expected_out, expected) = result, attention.scaled_dot_product_attention(*args)
    problem = f"expected the pattern's shape {tuple(expected.shape)}, got {shape_of(pattern)}."
    expect(shape_of(pattern) == expected.shape, where, problem)
    allowed = torch.ones_like(expected, dtype=torch.bool) if mask is None else mask
    leak = "apply the mask to the scores before the softmax (True = may attend)."
    hint = OVERFLOW_HINT if large else NAN_HINT
    _expect_pattern(where, pattern, allowed.expand_as(expected), hint, leak)
    hint = OVERFLOW_HINT if large else "softmax(q k^T / sqrt(d_head)) over keys."
    unscaled = attention.masked_softmax(q @ k.transpose(-2, -1), mask)  # softmax(q k^T)
    mistakes, where_pattern = {SCALE_HINT: unscaled}, f"{where}, pattern"
    expect_close(pattern, expected, where_pattern, hint, atol=1e-8, mistakes=mistakes)
    expect_close(out, expected_out, f"{where}, output", "the output is pattern @ v.", atol=1e-8)


def check_scaled_dot_product_attention(fn: Callable) -> None:
    """`scaled_dot_product_attention(q, k, v, mask=None) -> (out, pattern)`, every mask, float16."""
    name, empty = "scaled_dot_product_attention", torch.ones(4, 4, dtype=torch.bool)
    empty[1], padding = False, padding_mask(torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]), 0)
    for label, qkv, mask in [
        ("no mask", _qkv(5, 5, 8, 8), None),
        ("q_len != k_len, d_v != d_head", _qkv(3, 7, 8, 5, seed=1), None),
        ("a causal mask", _qkv(6, 6, 16, 16, seed=2), causal_mask(6)),
        ("a padding mask", _qkv(4, 5, 8, 8, seed=3), padding),
        ("a query with no allowed key", _qkv(4, 4, 8, 8, seed=4), empty),
        ("scores in the thousands", _qkv(4, 6, 8, 8, seed=6, scale=30.0), causal_mask(4, 6)),
    ]:
        _expect_attention(fn, f"{name} ({label})", *qkv, mask, large="thousands" in label)
    q, k, v = (t.half() for t in _qkv(4, 5, 8, 8, seed=7))
    result, where = call(name, fn, q, k, v, causal_mask(4, 5)), f"{name} (float16 inputs)"
    dtypes = [getattr(t, "dtype", None) for t in result]
    problem = f"expected float16 results (the dtype of q), got {dtypes[0]} and {dtypes[1]}."
    hint = "computing in float32 inside is fine (more accurate, even); return `.to(q.dtype)`."
    expect(dtypes == [torch.float16] * 2, where, problem, hint)
    expected = attention.scaled_dot_product_attention(q, k, v, causal_mask(4, 5))[0]
    expect_close(result[0], expected, where, "the output is pattern @ v.", atol=1e-2, rtol=1e-2)
    _expect_refused(name, fn)
    passed(name)


def _expect_refused(name: str, fn: Callable) -> None:
    """Inputs that do not fit together get a ValueError that names them, not a crash deep in
    an einsum or, worse, a result of the wrong shape."""
    (q, k, v), hint = _qkv(4, 5, 8, 8, seed=9), VALIDATE_HINT
    for label, args in (
        ("k with d_head 6, q with 8", (q, k[..., :6], v)),
        ("v with 4 positions, k with 5", (q, k, v[..., :4, :])),
        ("a mask of shape (2, 2, 3, 4, 5), more dims than the scores", (q, k, v, _BIG_MASK)),
    ):
        expect_raises(f"{name}({label})", hint, fn, *args, errors=(ValueError,))


_BIG_MASK = torch.ones(2, 2, 3, 4, 5, dtype=torch.bool)
VALIDATE_HINT = "inputs that do not fit together must be refused with a clear ValueError (which "
VALIDATE_HINT += "one, and why): start with validate.attention_inputs(q, k, v, mask), given."


class _Calls(TorchFunctionMode):
    """Inside the block, the names of the torch functions called."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def _forward_cases() -> list[tuple[str, tuple, dict]]:
    """(label, args, kwargs): self- and cross-attention, every mask argument, none."""
    x, context = randn(2, 6, 16, seed=2), randn(2, 8, 16, seed=3)
    padding = padding_mask(torch.tensor([[4, 5, 6, 7, 8, 9, 1, 2], [3, 4, 5, 0, 0, 0, 0, 0]]), 0)
    empty = torch.ones(2, 1, 6, 8, dtype=torch.bool)
    empty[0, 0, 2] = False
    return [
        ("self-attention, causal mask", (x,), {"mask": causal_mask(6)}),
        ("cross-attention, padding mask", (x, context), {"mask": padding}),
        ("cross-attention, a query with no allowed key", (x, context), {"mask": empty & padding}),
        ("self-attention, causal=True", (x,), {"causal": True}),
        ("causal=True and a padding mask", (x,), {"mask": padding[..., :6], "causal": True}),
        ("self-attention, no mask", (x,), {}),
    ]


def _expect_hook(stage: str, hook: str, actual, cache: dict, allowed, hint: str) -> None:
    """What one hook point received, compared with the reference's `cache`."""
    expected, scores = cache[hook], hook == "hook_attn_scores"  # forbidden scores' fill is free
    problem = f"expected shape {tuple(expected.shape)}, got {shape_of(actual)}."
    expect(shape_of(actual) == expected.shape, stage, problem, hint)
    if matches(actual[allowed] if scores else actual, expected[allowed] if scores else expected):
        return
    own = f"pass each intermediate through its own hook point; {hook} gets: {HOOK_HINTS[hook]}"
    elsewhere = {f"that tensor belongs at `{k}`: {own}": cache[k] for k in HOOK_HINTS if k != hook}
    expect_no_known_mistake(stage, actual, elsewhere)
    if scores:
        expect_no_known_mistake(stage, actual[allowed], {SCALE_HINT: expected[allowed] * 2})
    if hook == "hook_pattern":
        _expect_pattern(stage, actual, allowed, NAN_HINT, hint)
    expect(False, stage, "differs from the reference.", hint)


def _expect_forward(name: str, module: torch.nn.Module, reference, fast: bool) -> None:
    """Every forward case, fused (`fast`) or hook by hook, then the output; `fast_path` left set."""
    module.fast_path = fast
    for label, args, kwargs in _forward_cases():
        if fast and "no allowed key" in label:  # SDPA's rows with no allowed key are NaN
            continue
        where, causal = f"{name}(fast_path={fast}), {label}", kwargs.get("causal", False)
        hint = "compare each step with the reference using run_with_cache."
        hint = CAUSAL_HINT if causal else hint if kwargs else NO_MASK_HINT
        expected, ref_cache = reference.run_with_cache(*args, **kwargs)
        with _Calls() as calls:
            actual, cache = call(where, module.run_with_cache, *args, hint=hint, **kwargs)
        allowed = ref_cache["hook_pattern"] > 0  # the keys each query may attend to
        expect_mask_not_inverted(f"{where}, hook_pattern", cache.get("hook_pattern"), allowed)
        for hook, hook_hint in HOOK_HINTS.items() if not fast else ():
            pattern_hook, stage = hook in ("hook_attn_scores", "hook_pattern"), f"{where}, {hook}"
            never = FAST_PATH_HINTS[False] if pattern_hook else hook_hint
            expect(hook in cache, stage, "this hook point never received a tensor.", never)
            if hook == "hook_pattern":
                hook_hint = "a padding mask (batch, 1, 1, k_pos) hides keys."
                hook_hint = CAUSAL_HINT if causal else hook_hint
            elif len(args) > 1 and hook in ("hook_k", "hook_v"):
                hook_hint = "in cross-attention keys and values come from `context`, not from x."
            _expect_hook(stage, hook, cache[hook], ref_cache, allowed, hook_hint)
        fused = "scaled_dot_product_attention" in calls.names
        hooked = {"hook_attn_scores", "hook_pattern"} <= set(cache)
        problem = f"F.scaled_dot_product_attention was {'' if fused else 'not '}called and "
        problem += f"the pattern hooks {'ran' if hooked else 'did not run'}."
        expect(fused == fast and hooked != fast, where, problem, FAST_PATH_HINTS[fast])
        z = einops.rearrange(ref_cache["hook_z"], "batch pos head d -> batch pos (d head)")
        W_O = einops.rearrange(reference.W_O, "head d d_model -> (head d) d_model")
        concat = "the heads are concatenated in the wrong order: flatten z as '(head d_head)' to "
        concat += "line up with W_O's rows, or project each head with W_O[head] and sum over heads."
        mistakes = {concat: z @ W_O + reference.b_O}
        expect_close(actual, expected, where, hint, atol=1e-8, mistakes=mistakes)


def check_multi_head_attention(cls: type) -> None:
    """`MultiHeadAttention`: parameters, forward hook by hook, `fast_path`, `bias=False`."""
    name = "MultiHeadAttention"
    torch.manual_seed(0)
    module, reference = call(name, cls, 64, 4), attention.MultiHeadAttention(64, 4)
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
    expected = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    hint = "use TransformerLens names and shapes: W_Q is (n_heads, d_model, d_head), W_O is "
    hint += "(n_heads, d_head, d_model)."
    expect(shapes == expected, name, f"expected parameters {expected}, got {shapes}.", hint)
    for bias in ("b_Q", "b_K", "b_V", "b_O"):
        value, hint = getattr(module, bias), "initialise biases to zero, as GPT-2 does."
        problem = "the bias starts at one." if value.eq(1).all() else "the bias is not zero."
        expect(not value.any(), f"{name}.{bias}", problem, hint)
        std, hint = getattr(module, "W" + bias[1:]).std().item(), "nn.init.normal_(w, std=0.02)."
        expect(0.015 < std < 0.025, f"{name}.W{bias[1:]}", f"its std is {std:.3g}.", hint)
    reference = perturb(attention.MultiHeadAttention(16, 4).double(), seed=1, scale=0.5)
    module = call(name, cls, 16, 4).double()
    call(f"{name}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    x = randn(2, 7, 16, seed=5)  # chapter 6's KV cache: causal self-attention in three calls
    for fast in (False, True):
        _expect_forward(name, module, reference, fast)
        where = f"{name}(x, causal=True, cache=...), fast_path={fast}"
        expect_cached(where, module, reference, x, [3, 4], CACHE_HINT, causal=True)
    module.fast_path, where = False, f"{name}(x, mask=causal_mask(7)), fast_path=False"
    expect_hooks_used(where, module, reference, HOOK_HINTS, x, None, causal_mask(7))
    (_, args, kwargs), where = _forward_cases()[1], f"{name}(bias=False)"
    module = call(where, cls, 16, 4, bias=False).double()
    reference = attention.MultiHeadAttention(16, 4, bias=False).double()
    expected = sorted(n for n, _ in reference.named_parameters())
    named = sorted(n for n, _ in module.named_parameters()) == expected
    hint = "with bias=False register the biases as None, and skip them in reset_parameters and "
    expect(named, where, f"expected only the parameters {expected}.", hint + "forward.")
    call(f"{where}.reset_parameters", module.reset_parameters)
    call(f"{where}.load_state_dict", module.load_state_dict, reference.state_dict(), strict=False)
    actual, hint = call(where, module, *args, **kwargs), "without biases, the einsums alone."
    expect_close(actual, reference(*args, **kwargs), where, hint, atol=1e-8)
    _expect_half(name, cls)
    passed(name)


HALF_HINT = "in half precision the scores are float32 (your attention_scores upcasts), the "
HALF_HINT += "values are not: bring the pattern to v's dtype before the weighted sum, and keep "
HALF_HINT += "every result in x's dtype."


def _expect_half(name: str, cls: type) -> None:
    """A module cast to float16 or bfloat16 runs on inputs of its dtype, both paths, and gives
    the reference's output in that dtype (to its rounding)."""
    reference = perturb(attention.MultiHeadAttention(16, 4), seed=3, scale=0.5)
    x, padding = randn(2, 6, 16, seed=6, dtype=torch.float32), _forward_cases()[1][2]["mask"]
    for dtype in (torch.float16, torch.bfloat16):
        ours = attention.MultiHeadAttention(16, 4).to(dtype)
        ours.load_state_dict(reference.state_dict())
        module = call(f"{name}.__init__", cls, 16, 4).to(dtype)
        call(f"{name}.load_state_dict", module.load_state_dict, reference.state_dict())
        for fast in (False, True):
            module.fast_path = ours.fast_path = fast
            where = f"{name}.to({dtype}), fast_path={fast}, causal=True and a padding mask"
            args, kwargs = (x.to(dtype),), dict(mask=padding[..., :6], causal=True)
            with torch.no_grad():
                actual = call(where, module, *args, hint=HALF_HINT, **kwargs)
                expected = ours(*args, **kwargs)
            problem = f"expected {describe(expected)}, got {describe(actual)}."
            expect(getattr(actual, "dtype", None) == dtype, where, problem, HALF_HINT)
            expect_close(actual, expected, where, HALF_HINT, atol=3e-2, rtol=3e-2)
