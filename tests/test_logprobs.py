"""Per-token log-probs and entropy (`logprobs`) against TRL 1.16's `selective_log_softmax` and
`entropy_from_logits`, and the masked reductions against their formulas written here in float64.
Tolerances:

- Log-probs: 1e-5 + 1e-6 relative, entropy 1e-5 (float32 results of a float64 or float32
  model; TRL on the float64 logits); from a bfloat16 model, 1e-5 against TRL on the same
  logits cast to float32 (the point: the log-softmax runs in float32, so nothing is rounded
  to bfloat16's 8 bits).
- Entropy of logits of size 1e4 (float32): finite, 1e-3 against TRL in float64.
- masked_mean / masked_normalize: 1e-12 in float64; an empty mask row gives 0 and a 0 gradient.
"""

from __future__ import annotations

import pytest
import torch
from trl.trainer.utils import entropy_from_logits, selective_log_softmax

from transformer_course.llama import Llama, LlamaConfig
from transformer_course.logprobs import (
    masked_mean,
    masked_normalize,
    response_log_probs,
    token_entropy,
)

CFG = LlamaConfig(16, 2, 4, 2, 6, 24, 37, 16)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = Llama(CFG)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)  # sharp distributions, log-probs far below 0
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_log_probs_and_entropy_against_trl(model, dtype):
    model = model.to(dtype)
    ids = torch.randint(37, (3, 9), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(37, (3, 9), generator=torch.Generator().manual_seed(2))
    ours = response_log_probs(model, ids, labels)
    logits = model(ids).detach()
    reference = logits.double() if dtype == torch.float64 else logits.float()
    assert ours.dtype == torch.float32 and ours.shape == (3, 9)
    assert ours.min() < -5  # the comparison covers far-from-uniform log-probs
    torch.testing.assert_close(
        ours.double(), selective_log_softmax(reference, labels).double(), atol=1e-5, rtol=1e-6
    )
    entropy = token_entropy(logits)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(
        entropy.double(), entropy_from_logits(reference).double(), atol=1e-5, rtol=0
    )
    model.double()


def test_entropy_of_huge_logits_is_finite():
    logits = 1e4 * torch.randn(4, 5, 50, generator=torch.Generator().manual_seed(3))
    ours = token_entropy(logits.float())
    assert ours.isfinite().all()
    torch.testing.assert_close(
        ours.double(), entropy_from_logits(logits.double()), atol=1e-3, rtol=0
    )


def test_log_probs_shapes_must_agree(model):
    with pytest.raises(ValueError, match="labels: expected the shape of input_ids"):
        response_log_probs(model, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4).long())


X = torch.randn(3, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)


def reference_mean(x, mask, dim):
    """sum(x * m) / sum(m) entry by entry in float64, 0 where sum(m) is 0."""
    if dim is None:
        return sum(float(a) for a, m in zip(x.flatten(), mask.flatten()) if m) / int(mask.sum())
    rows = x if dim in (1, -1) else x.T
    masks = mask if dim in (1, -1) else mask.T
    means = [[float(a) for a, m in zip(r, ms) if m] for r, ms in zip(rows, masks)]
    return torch.tensor([sum(m) / len(m) if m else 0.0 for m in means], dtype=torch.float64)


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("as_float", [False, True])
def test_masked_mean_and_normalize(dim, as_float):
    mask = MASK.double() if as_float else MASK
    x = X.clone().requires_grad_()
    ours = masked_mean(x, mask, dim=dim)
    torch.testing.assert_close(
        ours, torch.as_tensor(reference_mean(X, MASK, dim), dtype=torch.float64), atol=1e-12, rtol=0
    )
    ours.sum().backward()
    assert x.grad.isfinite().all() and (x.grad[~MASK] == 0).all()
    total = (X * MASK).sum() if dim is None else (X * MASK).sum(dim)
    torch.testing.assert_close(masked_normalize(X, mask, dim, 4.0), total / 4.0, atol=1e-12, rtol=0)


def test_masked_reductions_ignore_non_finite_masked_entries():
    x = X.clone()
    x[~MASK] = float("-inf")  # the log-prob of a padding token, say
    assert masked_mean(x, MASK, dim=1).isfinite().all()
    assert masked_normalize(x, MASK).isfinite()


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: masked_mean(X, MASK[:, :5]), "mask: expected the shape of x"),
        (lambda: masked_normalize(X, MASK, normalize_constant=0), "normalize_constant"),
        (lambda: masked_mean(MASK, MASK), "x: expected a floating-point"),
    ],
)
def test_bad_input_is_refused(call, words):
    with pytest.raises(ValueError, match=words):
        call()
