"""Activation patching (chapter 10) against `transformer_lens.patching` on the same weights and
inputs: residual stream per layer and position, heads per position and over all positions.

Tolerance: 1e-6 (both store the metric in float32; the models run in float64).
"""

from __future__ import annotations

import pytest
import torch
from test_hooks import attention_only_pair, gpt2_pair, tokens
from transformer_lens import patching as tl_patching

from transformer_course.patching import (
    logit_difference,
    patch_head_all_pos,
    patch_head_by_pos,
    patch_residual,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


def clean_and_corrupted():
    clean = tokens(batch=2, pos=5, seed=5)
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 23
    metric = lambda logits: logit_difference(logits, clean[:, 2], corrupted[:, 2])  # noqa: E731
    return clean, corrupted, metric


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (patch_residual, tl_patching.get_act_patch_resid_pre),
        (patch_head_by_pos, tl_patching.get_act_patch_attn_head_out_by_pos),
        (patch_head_all_pos, tl_patching.get_act_patch_attn_head_out_all_pos),
    ],
)
@pytest.mark.parametrize("pair", [gpt2_pair, attention_only_pair])
def test_patching_equals_transformer_lens(pair, ours, theirs):
    model, reference = pair()
    clean, corrupted, metric = clean_and_corrupted()
    result = ours(model, clean, corrupted, metric)
    expected = theirs(reference, corrupted, reference.run_with_cache(clean)[1], metric)
    assert result.shape == expected.shape
    torch.testing.assert_close(result, expected.to(result.dtype), atol=1e-6, rtol=0)
    assert result.std() > 1e-3  # the patches differ: the metric sees them


def test_residual_patching_restores_the_clean_metric_at_the_corrupted_position():
    model, _ = gpt2_pair()
    clean, corrupted, metric = clean_and_corrupted()
    result = patch_residual(model, clean, corrupted, metric)
    clean_metric = float(metric(model(clean).detach()))
    assert abs(result[0, 2] - clean_metric) < 1e-6  # layer 0, the corrupted position: all of it
    corrupted_metric = float(metric(model(corrupted).detach()))
    assert (result[:, :2] - corrupted_metric).abs().max() < 1e-6  # earlier positions: nothing


def test_logit_difference_against_indexing():
    logits = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))
    correct, wrong = torch.tensor([0, 5, 2]), torch.tensor([1, 1, 3])
    expected = sum(logits[b, -1, correct[b]] - logits[b, -1, wrong[b]] for b in range(3)) / 3
    torch.testing.assert_close(logit_difference(logits, correct, wrong), expected)


def test_token_counts_that_differ_are_an_error():
    model, _ = gpt2_pair()
    clean, _, metric = clean_and_corrupted()
    with pytest.raises(
        ValueError, match=r"corrupted_tokens: expected the clean run's shape \(2, 5\)"
    ):
        patch_residual(model, clean, tokens(batch=2, pos=6), metric)
