"""FlashAttention-2 in PyTorch (`transformer_course.flash_attention`).

References: the course's `attention.scaled_dot_product_attention` (with
`attention.causal_mask`, the course's alignment: with more keys than queries the last query sees
every key) and PyTorch's `F.scaled_dot_product_attention` with the same boolean mask, forward
and gradients, in float64 on inputs whose lengths are not multiples of the tiles: tolerance
1e-10 (we see ~1e-15; a wrong rescaling of the running sums or a mask off by one is O(0.1));
`torch.autograd.gradcheck` (finite differences) on tiny float64 inputs; `torch.logsumexp` of
the scores for the saved L. Memory: what autograd saves, counted by `saved_tensors_hooks`.
Half precision against float32 attention: 1e-2 for bfloat16 (8 bits of mantissa: relative
rounding 4e-3 on outputs of order 1), 2e-3 for float16.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from transformer_course.attention import causal_mask, scaled_dot_product_attention
from transformer_course.flash_attention import (
    FlashAttention,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
)
from transformer_course.step_cost import SavedTensorBytes

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
ATOL = 1e-10  # float64
# (leading dims, n_queries, n_keys, q_tile, k_tile): tiles that do not divide the lengths,
# more keys than queries (a KV cache's queries), more queries than keys (not causal), one of each.
CASES = [
    ((2, 3), 13, 13, 4, 5),
    ((2,), 5, 11, 2, 3),
    ((), 9, 4, 4, 3),
    ((3, 1), 1, 7, 64, 64),
    ((2, 2), 7, 1, 3, 2),
    ((1, 2), 70, 70, 64, 64),
]


def inputs(lead, n_queries, n_keys, d=8, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(*lead, n, d, generator=g, dtype=dtype).to(device)
    return [make(n_queries).requires_grad_(), make(n_keys).requires_grad_(), make(n_keys)]


def cases(causal: bool) -> list:
    return [c for c in CASES if not causal or c[1] <= c[2]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_equals_attention_forward_and_backward(device, causal):
    for lead, n_queries, n_keys, q_tile, k_tile in cases(causal):
        q, k, v = inputs(lead, n_queries, n_keys, device=device)
        v.requires_grad_()
        mask = causal_mask(n_queries, n_keys, device=device) if causal else None
        out = flash_attention(q, k, v, causal, q_tile=q_tile, k_tile=k_tile)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        course = scaled_dot_product_attention(q, k, v, mask)[0]
        torch_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        for expected in (course, torch_sdpa):
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
            expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
            for name, got, want in zip("qkv", grads, expected_grads):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck(causal):
    tiny = [((2,), 5, 7), ((), 4, 4), ((), 4, 3)]  # with tiles of 2 queries and 3 keys
    for lead, n_queries, n_keys in tiny[: 2 if causal else 3]:
        q, k, v = inputs(lead, n_queries, n_keys, d=3)
        v.requires_grad_()
        fn = lambda q, k, v: FlashAttention.apply(q, k, v, causal, 2, 3)
        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_apply_takes_the_contract_arguments():
    q, k, v = inputs((2,), 6, 9)
    out = FlashAttention.apply(q, k, v, True)  # default tiles
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(6, 9))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    out.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is None


@pytest.mark.parametrize("causal", [False, True])
def test_saves_q_k_v_the_output_and_one_log_sum_exp(causal):
    """Exactly one tensor besides q, k, v and the output: the log-sum-exp of each query's
    (scaled, masked) scores, (..., n_queries)."""
    q, k, v = inputs((2, 3), 10, 12)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = FlashAttention.apply(q, k, v, causal)
    assert [tuple(t.shape) for t in saved] == [
        (2, 3, 10, 8),
        (2, 3, 12, 8),
        (2, 3, 12, 8),
        (2, 3, 10, 8),
        (2, 3, 10),
    ]
    assert saved[0] is q and saved[1] is k and saved[2] is v and torch.equal(saved[3], out)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    if causal:
        scores = scores.masked_fill(~causal_mask(10, 12), -math.inf)
    torch.testing.assert_close(saved[4], torch.logsumexp(scores, dim=-1), atol=ATOL, rtol=0)
    _, lse = flash_attention_forward(q, k, v, causal, q_tile=3, k_tile=5)
    torch.testing.assert_close(lse, saved[4], atol=ATOL, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_the_backward_alone_from_the_saved_output_and_log_sum_exp(causal):
    q, k, v = inputs((3,), 6, 10)
    v.requires_grad_()
    out, lse = flash_attention_forward(q, k, v, causal, q_tile=4, k_tile=3)
    grad_out = torch.randn_like(out)
    grads = flash_attention_backward(q, k, v, out, lse, grad_out, causal, q_tile=5, k_tile=2)
    mask = causal_mask(6, 10) if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for name, got, want in zip("qkv", grads, torch.autograd.grad(expected, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=name)


def saved_bytes(attend, n: int) -> int:
    q, k, v = inputs((1, 2), n, n, d=16, dtype=torch.float32)
    with SavedTensorBytes() as saved:
        attend(q, k, v)
    return saved.bytes


def test_saves_memory_linear_in_the_context_not_quadratic():
    """At 1024 and 2048 positions (2 heads of 16 dims, float32): FlashAttention saves q, k, v,
    the output and L, 4 n d + n numbers per head; the einsum attention also saves the
    n x n pattern, so doubling the context quadruples most of what it saves."""
    flash = lambda q, k, v: flash_attention(q, k, v, True, q_tile=128, k_tile=128)
    mask = {n: causal_mask(n) for n in (1024, 2048)}
    naive = lambda q, k, v: scaled_dot_product_attention(q, k, v, mask[q.shape[-2]])
    flash_bytes = {n: saved_bytes(flash, n) for n in (1024, 2048)}
    naive_bytes = {n: saved_bytes(naive, n) for n in (1024, 2048)}
    for n, got in flash_bytes.items():
        assert got == 4 * 2 * (4 * n * 16 + n)
    assert flash_bytes[2048] == 2 * flash_bytes[1024]
    assert naive_bytes[2048] > 3.5 * naive_bytes[1024]
    assert naive_bytes[2048] > 2 * 4 * 2048**2  # at least one float32 pattern per head
    assert flash_bytes[2048] < naive_bytes[2048] / 20


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_half_precision_computes_in_float32(device, dtype, atol):
    q, k, v = inputs((2, 2), 40, 50, d=16, dtype=torch.float32, device=device)
    v.requires_grad_()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(40, 50, device=device))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    half = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention_forward(*half, True, q_tile=16, k_tile=16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out = flash_attention(*half, True, q_tile=16, k_tile=16)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    for got, want in zip(torch.autograd.grad(out.sum(), half), expected_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=atol * 4, rtol=0)


def test_clear_errors():
    q, k, v = inputs((2,), 5, 7)
    bad = {
        "q: expected a floating-point tensor of shape (..., pos, d), got int": (3, k, v),
        "k: expected a floating-point tensor of shape (..., pos, d), got torch.int64": (
            q,
            k.long(),
            v,
        ),
        "k: expected dtype torch.float64 (the dtype of q), got torch.float32": (q, k.float(), v),
        "k: expected last dim d_head=8 (the last dim of q), got 4": (q, k[..., :4], v),
        "v: expected last dim d=8 (the last dim of q), got 4": (q, k, v[..., :4]),
        "v: expected k_pos=7 positions (dim -2 of k), got 6": (q, k, v[:, :6]),
        "k: expected leading dims (2,) (those of q), got (1,)": (q, k[:1], v[:1]),
        "q: expected at least one position (dim -2), got shape (2, 0, 8)": (q[:, :0], k, v),
        "q: expected a floating-point tensor of shape (..., pos, d), got torch.float64 "
        "tensor of shape (8,)": (q[0, 0], k, v),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            flash_attention(*args)
    with pytest.raises(ValueError, match="k: expected at least n_queries=7 positions"):
        flash_attention(k, q, q, causal=True)
    with pytest.raises(ValueError, match="causal: expected True or False, got 1"):
        flash_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="q_tile: expected a positive int, got 0"):
        flash_attention(q, k, v, q_tile=0)
