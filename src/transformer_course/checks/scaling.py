"""Checkers for chapter 8's workbook (08_scaling): what a step costs (parameters, FLOPs),
FlashAttention-2's tiled forward, its backward from the log-sum-exp and the autograd function
that joins them, gradient buckets, and, on two gloo processes forked on the CPU, data
parallelism, the sharded optimizer and FSDP, each against single-process training."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from transformer_course import data_parallel, flash_attention, step_cost
from transformer_course.checks.harness import (
    CheckFailure,
    call,
    describe,
    expect,
    expect_close,
    expect_no_known_mistake,
    passed,
    randn,
    seeded,
)
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.llama import LlamaConfig
from transformer_course.masking import causal_mask
from transformer_course.ranks import CollectiveBytes, on_ranks

CONFIGS = {  # heads of a size other than d_model // n_heads, odd vocabularies, tied or not
    "GPT-2": GPT2Config(
        d_model=24, n_layers=2, n_heads=3, d_head=10, d_mlp=40, d_vocab=37, n_ctx=9
    ),
    "GPT-2, tied": GPT2Config(d_model=16, n_layers=3, n_heads=2, d_vocab=31, tie_embeddings=True),
    "modern decoder": LlamaConfig(d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_vocab=37),
    "modern decoder, tied": LlamaConfig(
        d_model=16,
        n_layers=1,
        n_heads=4,
        n_kv_heads=1,
        d_head=6,
        d_mlp=20,
        d_vocab=29,
        tie_embeddings=True,
    ),
}
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
RANKS_TIMEOUT = 90  # seconds: a check on two ranks takes a few
HANG_HINT = "every rank must start the same collectives, in the same order, on tensors of the "
HANG_HINT += "same size; a rank that skips one (or waits for one the other never starts) hangs."


def _param_count_mistakes(cfg) -> dict[str, int]:
    """What `param_count(cfg)` returns for each classic slip, {hint: value}."""
    right = step_cost.param_count(cfg)
    d, v, layers = cfg.d_model, cfg.d_vocab, cfg.n_layers
    mistakes = {}
    if cfg.tie_embeddings:
        mistakes["a tied unembedding is W_E itself (one tensor): count it once."] = right + v * d
    else:
        mistakes["the unembedding W_U (d_model, d_vocab) is missing."] = right - v * d
    if isinstance(cfg, GPT2Config):
        mistakes["GPT-2's position table W_pos (n_ctx, d_model) is missing."] = (
            right - cfg.n_ctx * d
        )
        biases = layers * (3 * cfg.n_heads * cfg.d_head + d + cfg.d_mlp + d) + v
        mistakes["the biases are missing: b_Q, b_K, b_V, b_O, b_in, b_out and b_U."] = (
            right - biases
        )
        norms = 2 * (2 * layers + 1) * d
        mistakes["the layer norms' w and b are missing (two per block, one at the end)."] = (
            right - norms
        )
        attention = 4 * cfg.n_heads * d * cfg.d_head
        mistakes["the heads have size d_head (cfg.d_head), not d_model // n_heads."] = (
            right
            - layers * (attention + 3 * cfg.n_heads * cfg.d_head)
            + layers * (4 * d * d + 3 * d)
        )
    else:
        mistakes[
            "the modern decoder's RMSNorms have a gain w each (two per block, one at the end)."
        ] = right - (2 * layers + 1) * d
        extra = 2 * layers * (cfg.n_heads - cfg.n_kv_heads) * d * cfg.d_head
        mistakes["W_K and W_V have n_kv_heads heads, not n_heads."] = right + extra
        mistakes["SwiGLU has three matrices: W_gate, W_in and W_out."] = (
            right - layers * d * cfg.d_mlp
        )
    return mistakes


def check_param_count(param_count: Callable) -> None:
    """`param_count(cfg)` against the parameters of the models themselves: GPT-2 and the modern
    decoder, tied and untied, heads of a size other than d_model / n_heads."""
    from transformer_course.llama import Llama

    for label, cfg in CONFIGS.items():
        model = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
        expected = sum(p.numel() for p in model.parameters())  # a tied W_E once
        where = f"param_count({label})"
        got = call(where, param_count, cfg)
        expect(isinstance(got, int), where, f"expected an int, got {describe(got)}.")
        mistakes = {h: n for h, n in _param_count_mistakes(cfg).items() if n != expected}
        problem = f"expected {expected:,} parameters (the model's own count), got {got:,}."
        expect_no_known_mistake(where, got, mistakes, problem=problem)
        pieces = "matrix, bias, norm gain and bias" if isinstance(cfg, GPT2Config) else "matrix"
        hint = f"count each {pieces} of one block, times n_layers, plus what sits outside the "
        hint += "blocks: the embedding tables, the final norm and the unembedding."
        expect(got == expected, where, problem, hint)
    passed("param_count")


def check_flops_per_token(flops_per_token: Callable) -> None:
    """`flops_per_token(cfg, seq_len)` against 6 N + 12 L H Q T, at several contexts."""
    for label, cfg in CONFIGS.items():
        n = step_cost.flop_param_count(cfg)
        heads = cfg.n_layers * cfg.n_heads * cfg.d_head
        for seq_len in (1, 7, 9):
            where = f"flops_per_token({label}, seq_len={seq_len})"
            got = call(where, flops_per_token, cfg, seq_len)
            expect(isinstance(got, int), where, f"expected an int, got {describe(got)}.")
            expected = 6 * n + 12 * heads * seq_len
            mistakes = {
                "the forward only: the backward costs twice the forward (6 N, not 2 N), "
                "attention included.": 2 * n + 4 * heads * seq_len,
                "attention's two matmuls (scores and the weighted sum of values) have no "
                "parameters but cost 12 L H Q T per token.": 6 * n,
                "attention's matmuls in the forward only: with the backward, three times "
                "4 L H Q T.": 6 * n + 4 * heads * seq_len,
                "N is `flop_param_count(cfg)`: an embedding lookup costs no FLOPs.": (
                    6 * step_cost.param_count(cfg) + 12 * heads * seq_len
                ),
                "H Q is n_heads * d_head (cfg.d_head), not d_model.": (
                    6 * n + 12 * cfg.n_layers * cfg.d_model * seq_len
                ),
            }
            mistakes = {h: n for h, n in mistakes.items() if n != expected}
            problem = f"expected {expected:,} FLOPs per token, got {got:,}."
            expect_no_known_mistake(where, got, mistakes, problem=problem)
            expect(got == expected, where, problem, "6 N + 12 L H Q T (see the formula above).")
    passed("flops_per_token")


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


def _bucket_variant(params, bucket_size_mb, *, mib=2**20, size=None, dtype=True, fit=True):
    """`make_buckets` with one knob turned: MiB as 10^6 bytes, sizes in elements, dtypes
    mixed in a bucket, or a parameter that exactly fills a bucket sent to the next."""
    if bucket_size_mb is None:
        return [[p] for p in params]
    limit, buckets, used = bucket_size_mb * mib, [], 0
    for p in params:
        nbytes = size(p) if size else p.numel() * p.element_size()
        full = used + nbytes > limit if fit else used + nbytes >= limit
        if not buckets or full or (dtype and buckets[-1][0].dtype != p.dtype):
            buckets.append([])
            used = 0
        buckets[-1].append(p)
        used += nbytes
    return buckets


def check_make_buckets(make_buckets: Callable) -> None:
    """Buckets of consecutive parameters: sizes in bytes (MiB = 2^20), a parameter that fills
    a bucket exactly stays in it, a larger one alone, a new bucket at each change of dtype."""
    kib = 2**10 / 2**20  # one KiB, in MiB
    # In bytes: 256 + 768 fill 1 KiB exactly; 400 + 612 fit in 1 KiB but not in 1000 bytes; the
    # float64 400 + 800 do not fit (at 4 bytes an element they would); a dtype change; 1200 alone.
    sizes = [
        (64, torch.float32),
        (192, torch.float32),
        (100, torch.float32),
        (153, torch.float32),
        (50, torch.float64),
        (100, torch.float64),
        (300, torch.float32),
        (5, torch.float32),
    ]
    params = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    index = {id(p): i for i, p in enumerate(params)}
    as_indices = lambda buckets: [[index.get(id(p), -1) for p in b] for b in buckets]
    for bucket_size_mb in (None, kib, 1.5 * kib, 4 * kib):
        where = f"make_buckets(params, bucket_size_mb={bucket_size_mb})"
        got = call(where, make_buckets, list(params), bucket_size_mb)
        ok = isinstance(got, list) and all(isinstance(b, list) for b in got)
        expect(ok, where, f"expected a list of lists of parameters, got {describe(got)}.")
        got = as_indices(got)
        expected = as_indices(data_parallel.make_buckets(params, bucket_size_mb))
        mistakes = {
            "a MiB is 2**20 bytes, not 10**6.": dict(mib=10**6),
            "measure in bytes: numel() * element_size() (a float64 takes 8).": dict(
                size=lambda p: p.numel()
            ),
            "a float64 element takes 8 bytes: numel() * element_size(), not numel() * 4.": dict(
                size=lambda p: 4 * p.numel()
            ),
            "a bucket is one flat tensor: start a new one where the dtype changes.": dict(
                dtype=False
            ),
            "a parameter that exactly fills the bucket belongs in it: a new bucket only when "
            "the size would pass bucket_size_mb.": dict(fit=False),
        }
        for hint, knobs in mistakes.items():
            wrong = as_indices(_bucket_variant(params, bucket_size_mb, **knobs))
            if wrong != expected:
                expect(got != wrong, where, f"expected buckets {expected}, got {got}.", hint)
        hint = "walk the parameters in order, adding each to the last bucket while it fits."
        expect(got == expected, where, f"expected buckets {expected}, got {got} (indices).", hint)
    passed("make_buckets")


# ---- two ranks ---------------------------------------------------------------------------


def _guarded(rank: int, notes: str, worker: Callable, *args: Any) -> Any:
    """`worker(rank, *args)`; a failed check is written to `notes` and ends this rank at once,
    so that the other rank's collectives fail now instead of waiting for it until a timeout."""
    try:
        return worker(rank, *args)
    except CheckFailure as failure:  # rank 0's is reported first; another rank's says which
        message = str(failure) if rank == 0 else f"{failure} (on rank {rank})"
        (Path(notes) / f"{rank}.txt").write_text(message)
        os._exit(1)


def _on_two_ranks(name: str, worker: Callable, *args: Any) -> list[Any]:
    """`worker(rank, *args)` on two gloo ranks; a failure, a crash or a hang as a CheckFailure."""
    with tempfile.TemporaryDirectory() as notes:
        try:
            return on_ranks(_guarded, notes, worker, *args, timeout=RANKS_TIMEOUT)
        except Exception as exc:  # a rank's failed check, a crash or a hang
            failed = sorted(Path(notes).glob("*.txt"))
            if failed:
                raise CheckFailure(failed[0].read_text()) from None
            if isinstance(exc, TimeoutError):
                problem = f"the two ranks were still running after {RANKS_TIMEOUT} s: a hang."
            else:
                problem = f"a rank crashed: {str(exc).strip().splitlines()[-1]}"
            raise CheckFailure(f"`{name}`: {problem}\nHint: {HANG_HINT}") from None


DIST_CFG = GPT2Config(d_model=16, n_layers=1, n_heads=2, d_vocab=29, n_ctx=8, tie_embeddings=True)
STEPS, BATCH, SEQ, LR = 3, 4, 6, 0.5


def _batches() -> list[tuple[Tensor, Tensor]]:
    data = torch.randint(0, DIST_CFG.d_vocab, (STEPS, BATCH, SEQ + 1), generator=seeded(7))
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _initial() -> GPT2:
    torch.manual_seed(0)
    return GPT2(DIST_CFG)


def _train(
    model: nn.Module,
    rank: int | None,
    finish: Callable | None,
    *,
    lr: float = LR,
    optimizer: Any = None,
) -> dict[str, Tensor]:
    """SGD steps on the batches (on rank r's half of each if `rank` is given)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    for tokens, targets in _batches():
        if rank is not None:
            half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            tokens, targets = tokens[half], targets[half]
        loss = lm_loss(model(tokens), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Branchy(nn.Module):
    """A matrix used twice, a frozen one, one never used, one used only where asked."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Parameter(torch.randn(4, 4))
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(4))
        self.sometimes = nn.Parameter(torch.randn(4, 4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor, use_sometimes: bool) -> Tensor:
        h = torch.tanh(x @ self.shared @ self.frozen) @ self.shared + self.bias
        return h @ self.sometimes if use_sometimes else h


def _branchy_grads(model: nn.Module, rank: int, finish: Callable | None) -> dict:
    x = torch.randn(3, 4, generator=seeded(10 + rank))
    model(x, use_sometimes=rank == 0).pow(2).sum().backward()
    if finish is not None:
        finish()
    inner = getattr(model, "module", model)
    return {n: None if p.grad is None else p.grad.clone() for n, p in inner.named_parameters()}


def _finisher(where: str, wrapper: nn.Module) -> Callable[[], None]:
    """The learner's `wrapper.finish_gradient_synchronization`, a crash reported as a check."""
    name = f"{where}.finish_gradient_synchronization"
    return lambda: call(name, wrapper.finish_gradient_synchronization)


class _AllReduces:
    """Record, while in use, how each `dist.all_reduce` is started (`async_op`, in the backward
    or in `finish_gradient_synchronization`) and where its work is waited on."""

    def __init__(self) -> None:
        self.phase, self.started, self.waited = "backward", [], []

    def finisher(self, finish: Callable[[], None]) -> Callable[[], None]:
        """`finish`, with the phase it runs in recorded."""

        def run() -> None:
            self.phase = "finish"
            finish()
            self.phase = "backward"

        return run

    def __enter__(self) -> _AllReduces:
        self._original = dist.all_reduce

        def all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            asynchronous = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            self.started.append((self.phase, asynchronous))
            work = self._original(tensor, *args, **kwargs)
            return _RecordedWork(work, self) if work is not None else None

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._original


class _RecordedWork:
    """A collective's work that notes the phase its `wait()` is called in."""

    def __init__(self, work: Any, record: _AllReduces) -> None:
        self._work, self._record = work, record

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._record.waited.append(self._record.phase)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _data_parallel_worker(rank: int, cls: type) -> dict:
    results = {}
    for bucket_size_mb in (None, 0.002):
        where = f"DataParallel(GPT2, bucket_size_mb={bucket_size_mb})"
        torch.manual_seed(rank)  # each rank its own weights: the broadcast must fix that
        model = GPT2(DIST_CFG)
        dp = call(where, cls, model, bucket_size_mb=bucket_size_mb)
        with _AllReduces() as record:
            finish = record.finisher(_finisher(where, dp))
            results[bucket_size_mb] = _train_wrapped(dp, rank, finish)
        results[f"all-reduces {bucket_size_mb}"] = (record.started, record.waited)
        torch.manual_seed(rank)
        branchy = call(where, cls, Branchy(), bucket_size_mb=bucket_size_mb)
        finish = _finisher(where, branchy)
        results[f"branchy {bucket_size_mb}"] = _branchy_grads(branchy, rank, finish)
    return results


def _train_wrapped(dp: nn.Module, rank: int, finish: Callable) -> dict[str, Tensor]:
    """`_train` through the wrapper (its forward), the state read from the inner module."""
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=LR)
    try:
        _train(dp, rank, finish, optimizer=optimizer)
    except RuntimeError as error:
        if "still being averaged" not in str(error):
            raise
        problem = "the second step's forward found the first step's state still there."
        hint = "finish_gradient_synchronization() ends the step: reset each bucket's ready, "
        hint += "flat and work, self._has_grad and self._next."
        raise CheckFailure(f"`DataParallel`: {problem}\nHint: {hint}") from None
    return {k: v.detach().clone() for k, v in dp.module.state_dict().items()}


def _expect_states(where: str, got: dict, expected: dict, mistakes: dict, atol: float) -> None:
    """Every tensor of a state dict against the expected one; a known mistake named."""
    hint = f"after {STEPS} steps the weights differ from one process's."
    for key, value in expected.items():
        wrong = {mistake: state[key] for mistake, state in mistakes.items()}
        expect_close(got[key], value, f"{where}: {key}", hint, atol=atol, mistakes=wrong)


def check_data_parallel(cls: type) -> None:
    """On two gloo ranks: rank 0's weights broadcast; after 3 SGD steps on each rank's half of
    the batch, the weights of one process trained on the whole batch (1e-5), bucketed and not;
    a shared matrix reduced once, unused parameters without gradient, one used on one rank
    averaged over both; each all-reduce started with async_op=True in the backward and waited
    on in finish_gradient_synchronization."""
    results = _on_two_ranks("DataParallel", _data_parallel_worker, cls)
    expected = _train(_initial(), None, None)
    mistakes = {
        "the gradients were summed, not averaged: divide by the world size.": _train(
            _initial(), None, None, lr=2 * LR
        ),
        "each rank stepped on its own half only: write the averaged gradient back into each "
        "parameter's .grad once its all-reduce is done.": _train(_initial(), 0, None),
    }
    for bucket_size_mb in (None, 0.002):
        where = f"DataParallel(bucket_size_mb={bucket_size_mb}), rank 0"
        _expect_states(where, results[0][bucket_size_mb], expected, mistakes, atol=1e-5)
        for key, value in results[0][bucket_size_mb].items():
            same = torch.equal(value, results[1][bucket_size_mb][key])
            expect(
                same,
                f"DataParallel(bucket_size_mb={bucket_size_mb})",
                f"the ranks' `{key}` differ after training.",
                "every rank must end each step with the same averaged gradients.",
            )
        started, waited = results[0][f"all-reduces {bucket_size_mb}"]
        where = f"DataParallel(bucket_size_mb={bucket_size_mb})"
        blocking = [phase for phase, asynchronous in started if not asynchronous]
        problem = f"{len(blocking)} of its {len(started)} all-reduces blocked until done."
        hint = "start each bucket's all-reduce with dist.all_reduce(flat, async_op=True) and keep "
        hint += "the work in bucket.work: the backward then goes on while it runs."
        expect(not blocking, where, problem, hint)
        problem = "every all-reduce started in finish_gradient_synchronization, after the backward."
        hint = "_start(bucket) starts the bucket's all-reduce as soon as it is full (in the "
        hint += "backward); finish_gradient_synchronization only starts the buckets still waiting."
        # none recorded: the answer calls an all_reduce imported by name, which goes unseen
        in_backward = not started or any(phase == "backward" for phase, _ in started)
        expect(in_backward, where, problem, hint)
        early = waited.count("backward")
        problem = f"{early} all-reduces were waited on during the backward, in _start."
        hint = "wait for bucket.work in finish_gradient_synchronization: waiting in _start "
        hint += "leaves nothing to overlap with the rest of the backward."
        expect(not early, where, problem, hint)
    own = []  # each rank's own gradients, from rank 0's weights
    for rank in (0, 1):
        torch.manual_seed(0)
        own.append(_branchy_grads(Branchy(), rank, None))
    for bucket_size_mb in (None, 0.002):
        where = f"DataParallel(bucket_size_mb={bucket_size_mb}), a model with a shared matrix"
        got = results[0][f"branchy {bucket_size_mb}"]
        for name in ("frozen", "unused"):
            hint = "a parameter no rank used keeps grad None (the optimizer then skips it)."
            expect(
                got[name] is None,
                f"{where}: {name}",
                f"expected no gradient, got {describe(got[name])}.",
                hint,
            )
        for name in ("shared", "bias"):
            wanted = (own[0][name] + own[1][name]) / 2
            hint = "a parameter used twice has one gradient (the sum of both uses): reduce it once."
            expect_close(got[name], wanted, f"{where}: {name}", hint, atol=1e-5)
        wanted = own[0]["sometimes"] / 2
        hint = "used on rank 0 only: rank 1's gradient counts as zero, and the sum is divided by "
        hint += "the world size like every other."
        expect(
            got["sometimes"] is not None,
            f"{where}: sometimes",
            "used on rank 0 only, it got no gradient on rank 0.",
            hint,
        )
        expect_close(
            got["sometimes"],
            wanted,
            f"{where}: sometimes",
            hint,
            atol=1e-5,
            mistakes={hint: own[0]["sometimes"]},
        )
    passed("DataParallel")


def _toy() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _groups(model: nn.Module) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "weight_decay": 0.1},
        {"params": biases, "lr": 0.02, "weight_decay": 0.01},
    ]


def _optimize(model: nn.Module, optimizer: Any, schedule: tuple[str, ...] = ("lr", "weight_decay")):
    """Three steps on one batch, halving each group's settings in `schedule` after each step
    (a schedule); the final weights."""
    x, y = torch.randn(8, 6, generator=seeded(4)), torch.randn(8, 3, generator=seeded(5))
    for _ in range(3):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        for group in optimizer.param_groups:
            for setting in schedule:
                group[setting] *= 0.5
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=0.01)),
    "SGD with momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def _params_with_state(optimizer: Any) -> set[int]:
    """The ids of the parameters for which `optimizer`, or an optimizer it holds, keeps state."""
    kept = set()
    for held in [optimizer, *vars(optimizer).values()]:
        if isinstance(held, torch.optim.Optimizer):
            kept |= {id(p) for p, state in held.state.items() if state}
    return kept


def _sharded_worker(rank: int, cls: type) -> dict:
    results = {}
    for label, (optimizer_cls, kwargs) in OPTIMIZERS.items():
        model = _toy()  # the same weights and the same batch on both ranks
        where = f"ShardedOptimizer(groups, {optimizer_cls.__name__}, ...)"
        optimizer = call(where, cls, _groups(model), optimizer_cls, **kwargs)
        step = optimizer.step
        optimizer.step = lambda step=step, where=where: call(f"{where}.step", step)
        results[label] = _optimize(model, optimizer)
        kept = _params_with_state(optimizer)
        owners = getattr(optimizer, "owner", {})
        results[f"{label} state"] = [
            n for n, p in model.named_parameters() if id(p) in kept and owners.get(p) != rank
        ]
    lone = nn.Parameter(torch.ones(3))  # one parameter: one of the ranks owns nothing
    where = "ShardedOptimizer([one parameter], SGD, lr=0.1)"
    optimizer = call(where, cls, [lone], torch.optim.SGD, lr=0.1)
    lone.grad = torch.full((3,), 2.0)
    hint = "a rank that owns no parameter has no optimizer of its own (self.optimizer is None): "
    hint += "it only takes part in the broadcasts."
    call(f"{where}.step", optimizer.step, hint=hint)
    results["lone"] = lone.detach().clone()
    return results


def check_sharded_optimizer(cls: type) -> None:
    """On two gloo ranks, the same gradients: after 3 steps (two parameter groups, a schedule
    that halves the lr and the weight decay) the weights of the unsharded optimizer (1e-6), AdamW
    and SGD, each rank's optimizer state only for the parameters it owns; and a rank that owns
    no parameter."""
    results = _on_two_ranks("ShardedOptimizer", _sharded_worker, cls)
    for label, (optimizer_cls, kwargs) in OPTIMIZERS.items():
        model = _toy()
        expected = _optimize(model, optimizer_cls(_groups(model), **kwargs))
        mistakes = {}
        for schedule, hint in (
            (
                (),
                "this rank's optimizer kept the settings it started with: copy each group's "
                "settings (a schedule changes group['lr'] and group['weight_decay']) into its own "
                "groups before stepping.",
            ),
            (
                ("lr",),
                "only the learning rate reached this rank's optimizer: copy every setting "
                "of each group but 'params' (a schedule may change group['weight_decay'] too).",
            ),
        ):
            model = _toy()
            mistakes[hint] = _optimize(model, optimizer_cls(_groups(model), **kwargs), schedule)
        for key, value in results[0][label].items():
            same = torch.equal(value, results[1][label][key])
            hint = "after the step, broadcast each parameter from its owner "
            hint += "(dist.broadcast(p, src=self.owner[p])): every rank then holds every update."
            expect(same, f"ShardedOptimizer with {label}", f"the ranks' `{key}` differ.", hint)
        for rank in (0, 1):
            where = f"ShardedOptimizer with {label}, rank {rank}"
            _expect_states(where, results[rank][label], expected, mistakes, atol=1e-6)
            others = results[rank][f"{label} state"]
            problem = f"it keeps optimizer state for {others}, which rank {1 - rank} owns."
            hint = "step self.optimizer, this rank's optimizer over the parameters it owns: "
            hint += "each rank keeps the state of its own share only (that is the saving)."
            expect(not others, where, problem, hint)
    for rank in (0, 1):
        where = f"ShardedOptimizer over one parameter, rank {rank}"
        hint = "broadcast each parameter from its owner after the step."
        expect_close(results[rank]["lone"], torch.full((3,), 0.8), where, hint, atol=1e-6)
    passed("ShardedOptimizer")


def _fsdp_worker(rank: int, cls: type) -> dict:
    results = {}
    for dtype in (None, torch.float16):
        where = f"FullyShardedDataParallel(GPT2, compute_dtype={dtype})"
        torch.manual_seed(rank)
        model = GPT2(DIST_CFG)
        numels = {n: p.numel() for n, p in model.named_parameters()}
        fsdp = call(where, cls, model, compute_dtype=dtype)
        shards = {n: p.numel() for n, p in fsdp.named_parameters()}
        for name, numel in numels.items():  # before any collective meets a slice too short
            kept = shards.get(f"module.{name}", numel)
            problem = f"`{name}` ({numel} elements) is kept as {kept} elements per rank: the "
            problem += f"last {numel - 2 * kept} are on no rank."
            hint = "pad the flat parameter with zeros to a multiple of the world size and keep "
            hint += "ceil(numel / world_size) elements per rank: numel // world_size loses the "
            hint += "remainder."
            expect(2 * kept >= numel, where, problem, hint)
        stored = {
            n: p.untyped_storage().nbytes() // p.element_size() for n, p in fsdp.named_parameters()
        }
        finish = _finisher(where, fsdp)
        optimizer = torch.optim.SGD(fsdp.parameters(), lr=LR)
        with CollectiveBytes() as sent:
            _train(fsdp, rank, finish, optimizer=optimizer)
        state = call(f"{where}.gather_full_params", fsdp.gather_full_params)
        gathered = sent.bytes.get("all_gather", 0)
        results[dtype] = dict(
            state=state, numels=numels, shards=shards, stored=stored, gathered=gathered
        )
    return results


def check_fsdp(cls: type) -> None:
    """On two gloo ranks: each keeps half of every parameter (padded: the remainder kept);
    after 3 SGD steps on each rank's half of the batch, the gathered weights of one process
    trained on the whole batch: 1e-5 computing in float32, 2e-3 in float16."""
    results = _on_two_ranks("FullyShardedDataParallel", _fsdp_worker, cls)
    expected = _train(_initial(), None, None)
    mistakes = {
        "the gradients were summed, not averaged: divide by the world size before the "
        "reduce-scatter.": _train(_initial(), None, None, lr=2 * LR),
    }
    for dtype, atol in ((None, 1e-5), (torch.float16, 2e-3)):
        where = f"FullyShardedDataParallel(compute_dtype={dtype})"
        got = results[0][dtype]
        for name, numel in got["numels"].items():
            shard = got["shards"].get(f"module.{name}")
            want = math.ceil(numel / 2)
            problem = f"`{name}` ({numel} elements) is kept as {shard} elements on rank 0."
            hint = "each rank keeps ceil(numel / world_size) elements: the flat parameter, "
            hint += "padded with zeros to a multiple of the world size, cut in equal slices."
            expect(shard is None or shard == want, where, problem, hint)
            stored = got["stored"].get(f"module.{name}", want)
            problem = f"`{name}`'s slice of {want} elements keeps {stored} in memory."
            hint = "clone this rank's slice: a slice of the padded tensor keeps all of it alive."
            expect(stored == want, where, problem, hint)
        wrong = {k: str(t.dtype) for k, t in got["state"].items() if t.dtype != torch.float32}
        problem = f"gather_full_params() gave {wrong}, not float32."
        hint = "_all_gather(shard, dtype) gathers in `dtype` when one is given (the compute dtype "
        hint += "only by default): the full parameters are the float32 masters."
        expect(not wrong, where, problem, hint)
        _expect_states(where, got["state"], expected, mistakes, atol=atol)
    half, full = results[0][torch.float16]["gathered"], results[0][None]["gathered"]
    problem = f"computing in float16 it gathered {half:,} bytes, against {full:,} in float32."
    hint = "cast this rank's slice to the compute dtype before all_gather_single: a float16 "
    hint += "step then moves half the bytes of a float32 one."
    expect(
        half <= 0.6 * full, "FullyShardedDataParallel(compute_dtype=torch.float16)", problem, hint
    )
    passed("FullyShardedDataParallel")
