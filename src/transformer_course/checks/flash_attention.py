"""Checkers for chapter 8's FlashAttention-2 exercises (08_scaling, 8.3-8.5): the tiled
forward with the online softmax, the backward from the log-sum-exp and the autograd function
that joins them, each against plain attention in float64, never a whole pattern in memory."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from transformer_course import flash_attention
from transformer_course.checks.harness import call, describe, expect, expect_close, passed, randn
from transformer_course.masking import causal_mask

TILES = dict(q_tile=16, k_tile=8)
SHAPES = {  # (n_queries, n_keys, causal): ragged tiles, more keys than queries
    "37 queries, 37 keys": (37, 37, False),
    "37 queries, 37 keys, causal": (37, 37, True),
    "5 queries, 29 keys": (5, 29, False),
    "5 queries, 29 keys, causal (the last 5 positions)": (5, 29, True),
    "32 queries, 32 keys, causal (tiles that divide them)": (32, 32, True),
    "29 queries, 5 keys": (29, 5, False),
}
# (n_queries, n_keys, q_tile, k_tile), causal: tile starts on, before and past the diagonal of
# every alignment, tiles that divide the lengths and tiles that do not, as many keys and more
CAUSAL_TILINGS = [(10, 10, 4, 3), (10, 10, 3, 4), (12, 12, 4, 4), (12, 12, 3, 2), (7, 13, 3, 4)]
CAUSAL_TILINGS += [(5, 13, 2, 3), (6, 13, 4, 5), (9, 9, 9, 1), (9, 9, 1, 9)]


def _pattern_sized(shape: tuple[int, ...], n_queries: int, n_keys: int) -> bool:
    """Whether a tensor of `shape` holds a whole n_queries x n_keys pattern (or its transpose)."""
    return tuple(shape[-2:]) in ((n_queries, n_keys), (n_keys, n_queries))


class _Patterns(TorchDispatchMode):
    """Record the shape of every tensor an operation makes that holds a whole pattern."""

    def __init__(self, n_queries: int, n_keys: int) -> None:
        super().__init__()
        self.sizes, self.found = (n_queries, n_keys), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and _pattern_sized(t.shape, *self.sizes):
                self.found.append(tuple(t.shape))
        return out


def _qkv(n_queries: int, n_keys: int, seed: int, dtype=torch.float64) -> list[Tensor]:
    """q, k, v `(batch 2, heads 3, positions, d 8)` with scores large enough to matter."""
    q = 3 * randn(2, 3, n_queries, 8, seed=seed, dtype=dtype)
    return [q, *(randn(2, 3, n_keys, 8, seed=seed + i, dtype=dtype) for i in (1, 2))]


def _masked_scores(q, k, causal: bool, scale: float | None = None) -> Tensor:
    """The scores `q k^T` times `scale` (default 1/sqrt(d)), -inf where a causal query may not
    look."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    return scores


def _attention(q, k, v, causal: bool, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Plain attention, the reference: the output and each query's log-sum-exp."""
    scores = _masked_scores(q, k, causal, scale)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def _tiled_without_rescale(q, k, v, causal: bool) -> tuple[Tensor, Tensor]:
    """The online softmax that forgets to rescale the running sums when the maximum grows."""
    scores = _masked_scores(q, k, causal)
    m = torch.full(scores.shape[:-1], -math.inf, dtype=q.dtype)
    l, acc = torch.zeros_like(m), torch.zeros_like(q)  # noqa: E741
    for j0 in range(0, k.shape[-2], TILES["k_tile"]):
        s = scores[..., j0 : j0 + TILES["k_tile"]]
        m = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        l, acc = l + p.sum(-1), acc + p @ v[..., j0 : j0 + TILES["k_tile"], :]  # noqa: E741
    return acc / l[..., None], m + torch.log(l)


def _forward_mistakes(q, k, v, causal: bool) -> dict[str, tuple[Tensor, Tensor]]:
    """The (output, L) each classic slip of the forward gives, {hint: (out, L)}."""
    out, lse = _attention(q, k, v, causal)
    mistakes = {
        "when a tile raises a row's maximum from m to m', the sums so far were taken against m: "
        "multiply l and acc by exp(m - m') before adding the new tile.": _tiled_without_rescale(
            q, k, v, causal
        ),
        "scale the scores by 1/sqrt(d).": _attention(q, k, v, causal, scale=1.0),
        "L is the log-sum-exp of the scores, m + log(l), not log(l).": (
            out,
            lse - _masked_scores(q, k, causal).amax(-1),
        ),
    }
    if causal and q.shape[-2] < k.shape[-2]:
        first = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        first = first.masked_fill(~torch.ones(q.shape[-2], k.shape[-2]).tril().bool(), -math.inf)
        mistakes[
            "the queries are the *last* positions: query i sees keys up to i + n_keys - n_queries "
            "(causal_mask's alignment), not up to i."
        ] = (torch.softmax(first, -1) @ v, torch.logsumexp(first, -1))
    return mistakes


def _expect_pair(where: str, got: Any, shapes: tuple) -> tuple[Tensor, Tensor]:
    problem = f"expected a tuple (out, L) of tensors of shapes {shapes}, got {describe(got)}."
    expect(isinstance(got, tuple) and len(got) == 2, where, problem)
    expect(all(isinstance(t, Tensor) for t in got), where, problem)
    return got


def _seen_problem(seen: Tensor, missing_hint: str) -> tuple[str, str] | None:
    """What is wrong with the keys each query met (`seen`, n_queries x n_keys, causal), as
    (problem, hint), or None."""
    n_q, n_k = seen.shape
    expected = causal_mask(n_q, n_k)
    if torch.equal(seen, expected):
        return None
    own = torch.eye(n_q, n_k, dtype=torch.bool).roll(n_k - n_q, dims=1)  # key i + n_k - n_q
    if torch.equal(seen, expected & ~own):
        problem = "no query met the key at its own position (the diagonal)."
        return problem, "query i sees keys j <= i + n_keys - n_queries: <=, not <."
    i, j = (int(x) for x in (seen ^ expected).nonzero()[0])
    if seen[i, j]:
        problem = f"query {i} met key {j}, after its own position."
        return problem, "mask the keys j > i + n_keys - n_queries in the tiles on the diagonal."
    return f"query {i} never met key {j}, at or before its own position.", missing_hint


def _probe_forward(forward: Callable, n_q: int, n_k: int, q_tile: int, k_tile: int) -> None:
    """Which keys each query of a causal forward met: with q = 0 every score is 0, and with v
    the identity (d = n_keys) row i of the output is 1/count over the keys query i saw."""
    q, k = torch.zeros(1, 1, n_q, n_k, dtype=torch.float64), randn(1, 1, n_k, n_k, seed=1)
    v = torch.eye(n_k, dtype=torch.float64).expand(1, 1, n_k, n_k)
    where = f"flash_attention_forward({n_q} queries, {n_k} keys, causal, "
    where += f"q_tile={q_tile}, k_tile={k_tile})"
    got = call(where, forward, q, k, v, True, q_tile=q_tile, k_tile=k_tile)
    out, _ = _expect_pair(where, got, (tuple(q.shape), tuple(q.shape[:-1])))
    hint = "the key loop stops short: query tile [i0, i1) needs every key tile that starts "
    hint += "before min(n_keys, i1 + n_keys - n_queries), the last key its last query sees "
    hint += "included (a key tile may start exactly there)."
    found = _seen_problem(out[0, 0] > 0.5 / n_k, hint)
    if found:
        expect(False, where, *found)


def _probe_backward(backward: Callable, n_q: int, n_k: int, q_tile: int, k_tile: int) -> None:
    """Which (query, key) pairs a causal backward visited: with q = 0 every pattern row is
    1/count over the keys the query sees, and with dO the identity (d = n_queries), dV = P^T dO
    holds P itself, 0 where a pair was skipped."""
    q, k = torch.zeros(1, 1, n_q, n_q, dtype=torch.float64), randn(1, 1, n_k, n_q, seed=2)
    v = randn(1, 1, n_k, n_q, seed=3)
    out, lse = _attention(q, k, v, True)
    grad_out = torch.eye(n_q, dtype=torch.float64).expand(1, 1, n_q, n_q)
    where = f"flash_attention_backward({n_q} queries, {n_k} keys, causal, "
    where += f"q_tile={q_tile}, k_tile={k_tile})"
    got = call(where, backward, q, k, v, out, lse, grad_out, True, q_tile=q_tile, k_tile=k_tile)
    expect(isinstance(got, tuple) and len(got) == 3, where, f"expected (dq, dk, dv), got {got}.")
    hint = "the query tiles that meet key tile [j0, j1) start at the first one whose last query "
    hint += "sees key j0: i1 - 1 + n_keys - n_queries >= j0 (no tile later)."
    found = _seen_problem(got[2][0, 0].transpose(0, 1) > 0.5 / n_k, hint)
    if found:
        expect(False, where, *found)


def _error_against(got: Tensor, exact: Tensor) -> float:
    return (got.double() - exact).abs().max().item()


def check_flash_attention_forward(forward: Callable) -> None:
    """The tiled forward: which keys each causal query meets, tile starts at every alignment
    with the diagonal; its output and L against plain attention in float64 (1e-10), tiles that
    divide the lengths and tiles that do not, more keys than queries and fewer; never an
    n_queries x n_keys tensor; half precision in, half out, L float32 and as close as float32
    accumulation gets it."""
    for n_q, n_k, q_tile, k_tile in CAUSAL_TILINGS:
        _probe_forward(forward, n_q, n_k, q_tile, k_tile)
    for seed, (label, (n_q, n_k, causal)) in enumerate(SHAPES.items()):
        q, k, v = _qkv(n_q, n_k, seed=10 * seed)
        where = f"flash_attention_forward({label}, q_tile=16, k_tile=8)"
        patterns = _Patterns(n_q, n_k)
        with patterns:
            got = call(where, forward, q, k, v, causal, **TILES)
        out, lse = _expect_pair(where, got, (tuple(q.shape), tuple(q.shape[:-1])))
        expected = _attention(q, k, v, causal)
        mistakes = _forward_mistakes(q, k, v, causal)
        for i, what in enumerate(("the output", "L")):
            wrong = {hint: pair[i] for hint, pair in mistakes.items()}
            hint = "see the online-softmax update above: m, l and acc per query row."
            expect_close(got[i], expected[i], f"{where}: {what}", hint, atol=1e-10, mistakes=wrong)
        found = patterns.found[0] if patterns.found else None
        problem = f"it made a tensor of shape {found}: a whole {n_q} x {n_k} pattern per head."
        hint = "work one tile at a time: q[..., i0:i1, :] against k[..., j0:j1, :], never all keys."
        expect(not patterns.found, where, problem, hint)
    q, k, v = (t.half() for t in _qkv(20, 20, seed=3))
    where = "flash_attention_forward(float16 inputs)"
    out, lse = _expect_pair(where, call(where, forward, q, k, v, True, **TILES), ())
    expect(
        out.dtype == torch.float16,
        where,
        f"the output is {out.dtype}, not float16.",
        "compute in float32 and return the output in the input's dtype.",
    )
    expect(
        lse.dtype == torch.float32,
        where,
        f"L is {lse.dtype}, not float32.",
        "keep L in float32: the backward exponentiates against it.",
    )
    exact = _attention(*(t.double() for t in (q, k, v)), True)
    hint = "accumulate in float32: upcast each tile of q, k and v, and cast only the output."
    expect_close(out.double(), exact[0], where, hint, atol=2e-3)
    # float32 accumulation gets L within ~1e-6; float16 arithmetic ~1e-3 (its rounding).
    ours = _error_against(
        flash_attention.flash_attention_forward(q, k, v, True, **TILES)[1], exact[1]
    )
    error = _error_against(lse, exact[1])
    problem = f"L is {error:.2g} from the exact log-sum-exp; float32 accumulation gets "
    problem += f"{ours:.2g}: the scores were computed in float16."
    expect(error <= 10 * ours + 1e-4, where, problem, hint)
    passed("flash_attention_forward")


def _gradients(q, k, v, causal: bool, grad_out: Tensor) -> tuple[Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, _ = _attention(q, k, v, causal)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def _backward_mistakes(q, k, v, causal, grad_out) -> dict[str, tuple[Tensor, ...]]:
    """The gradients each classic slip of the backward gives, {hint: (dq, dk, dv)}."""
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = _attention(q, k, v, causal)
    s = q @ k.transpose(-2, -1) * scale
    p = torch.exp(s - lse[..., None])
    if causal:
        p = p.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), 0.0)
    dp = grad_out @ v.transpose(-2, -1)
    D = (grad_out * out).sum(-1, keepdim=True)

    def grads(ds, p=p, scaled=True):
        factor = scale if scaled else 1.0
        return ds @ k * factor, ds.transpose(-2, -1) @ q * factor, p.transpose(-2, -1) @ grad_out

    mistakes = {
        "dS = P * (dP - D) with D = rowsum(dO * O): the softmax's correction term.": grads(p * dp),
        "dQ and dK carry the 1/sqrt(d) of the scores: dQ = dS K / sqrt(d).": grads(
            p * (dp - D), scaled=False
        ),
    }
    if causal:
        unmasked = torch.exp(s - lse[..., None])
        mistakes["P = exp(S - L) is 0 where a query may not see the key: mask it."] = grads(
            unmasked * (dp - D), p=unmasked
        )
    return mistakes


def check_flash_attention_backward(backward: Callable) -> None:
    """The backward from q, k, v, O and L: dq, dk and dv against autograd through plain
    attention in float64 (1e-10), the same shapes as the forward's check; never an
    n_queries x n_keys tensor; which (query, key) tile pairs a causal backward visits, tile
    starts at every alignment with the diagonal; float16 in and out, as close as float32
    accumulation gets."""
    for n_q, n_k, q_tile, k_tile in CAUSAL_TILINGS:
        _probe_backward(backward, n_q, n_k, q_tile, k_tile)
    for seed, (label, (n_q, n_k, causal)) in enumerate(SHAPES.items()):
        q, k, v = _qkv(n_q, n_k, seed=10 * seed + 1)
        grad_out = randn(*q.shape, seed=seed + 99)
        out, lse = _attention(q, k, v, causal)
        where = f"flash_attention_backward({label}, q_tile=16, k_tile=8)"
        patterns = _Patterns(n_q, n_k)
        with patterns:
            got = call(where, backward, q, k, v, out, lse, grad_out, causal, **TILES)
        problem = f"expected a tuple (dq, dk, dv), got {describe(got)}."
        expect(isinstance(got, tuple) and len(got) == 3, where, problem)
        mistakes = _backward_mistakes(q, k, v, causal, grad_out)
        for i, (name, wanted) in enumerate(zip("qkv", _gradients(q, k, v, causal, grad_out))):
            wrong = {hint: grads[i] for hint, grads in mistakes.items()}
            hint = "recompute P = exp(S - L) per tile; dV += P^T dO; dP = dO V^T; "
            hint += "dS = P * (dP - D); dQ += dS K / sqrt(d); dK += dS^T Q / sqrt(d)."
            expect_close(got[i], wanted, f"{where}: d{name}", hint, atol=1e-10, mistakes=wrong)
        found = patterns.found[0] if patterns.found else None
        problem = f"it made a tensor of shape {found}: a whole {n_q} x {n_k} pattern per head."
        hint = "recompute P tile by tile; D = rowsum(dO * O) is one number per query."
        expect(not patterns.found, where, problem, hint)
    q, k, v, grad_out = (t.half().double() for t in (*_qkv(20, 20, seed=4), randn(2, 3, 20, 8)))
    out, lse = _attention(q, k, v, True)
    where = "flash_attention_backward(float16 inputs)"
    half = [t.half() for t in (q, k, v, out)]
    got = call(where, backward, *half, lse.float(), grad_out.half(), True, **TILES)
    ours = flash_attention.flash_attention_backward(
        *half, lse.float(), grad_out.half(), True, **TILES
    )
    exact = _gradients(q, k, v, True, grad_out)
    for name, grad, wanted, our in zip("qkv", got, exact, ours):
        problem = f"d{name} is {describe(grad)}, not float16 like {name}."
        expect(
            grad.dtype == torch.float16,
            where,
            problem,
            "return each gradient in its input's dtype.",
        )
        hint = "accumulate in float32 (upcast each tile), then cast the gradients back."
        expect_close(grad.double(), wanted, f"{where}: d{name}", hint, atol=2e-2)
        # float16 arithmetic throughout is 4 to 16 times further off than float32 accumulation
        error, bound = _error_against(grad, wanted), 3 * _error_against(our, wanted) + 5e-4
        problem = f"d{name} is {error:.2g} from the exact gradient; float32 accumulation gets "
        problem += f"{bound:.2g} at most: it was computed in float16."
        expect(error <= bound, f"{where}: d{name}", problem, hint)
    passed("flash_attention_backward")


def check_flash_attention_function(function: type) -> None:
    """`FlashAttention.apply(q, k, v, causal)`: output and gradients against plain attention in
    float64, causal and not, with exactly one tensor of shape (..., n_queries) saved for the
    backward and nothing of the pattern's size."""
    for seed, (label, (n_q, n_k, causal)) in enumerate(SHAPES.items()):
        q, k, v = (t.requires_grad_() for t in _qkv(n_q, n_k, seed=10 * seed + 2))
        where = f"FlashAttention.apply({label}, q_tile=16, k_tile=8)"
        saved: list[tuple[int, ...]] = []

        def pack(t: Tensor, saved: list = saved) -> Tensor:
            saved.append(tuple(t.shape))
            return t

        patterns = {"forward": _Patterns(n_q, n_k), "backward": _Patterns(n_q, n_k)}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), patterns["forward"]:
            hint = "forward(ctx, q, k, v, causal, q_tile, k_tile): the tile sizes follow causal."
            out = call(where, function.apply, q, k, v, causal, *TILES.values(), hint=hint)
        expect(isinstance(out, Tensor), where, f"expected a tensor, got {describe(out)}.")
        grad_out = randn(*q.shape, seed=seed + 5)
        hint = "backward returns one gradient per input of forward: dq, dk, dv, then None for "
        hint += "causal, q_tile and k_tile; and passes the tile sizes on to the backward."
        with patterns["backward"]:
            grads = call(
                f"{where}, backward", torch.autograd.grad, out, (q, k, v), grad_out, hint=hint
            )
        expected = _attention(q.detach(), k.detach(), v.detach(), causal)[0]
        expect_close(out, expected, where, "call your flash_attention_forward.", atol=1e-10)
        for name, got, wanted in zip("qkv", grads, _gradients(q, k, v, causal, grad_out)):
            expect_close(
                got,
                wanted,
                f"{where}: d{name}",
                "call your flash_attention_backward with what forward saved.",
                atol=1e-10,
            )
        lse_shape = tuple(q.shape[:-1])
        hint = "ctx.save_for_backward(q, k, v, out, L): the log-sum-exp and nothing else new "
        hint += "(a tensor kept as an attribute of ctx escapes autograd's bookkeeping)."
        expect(
            saved.count(lse_shape) == 1,
            where,
            f"expected exactly one saved tensor of shape {lse_shape} (L); saved {saved}.",
            hint,
        )
        big = [s for s in saved if _pattern_sized(s, n_q, n_k)]
        expect(not big, where, f"it saved {big}, the size of the pattern.", hint)
        problem = f"expected q and the output saved (two tensors of shape {tuple(q.shape)}); "
        problem += f"saved {saved}."
        expect(saved.count(tuple(q.shape)) >= 2, where, problem, hint)
        for step, found in patterns.items():
            problem = f"its {step} made a tensor of shape {found.found[:1]}: a whole pattern."
            hint = f"pass q_tile and k_tile on to flash_attention_{step} (keep them on ctx for "
            hint += "the backward): with the default tiles one tile holds every key here."
            expect(not found.found, where, problem, hint)
    passed("FlashAttention")
