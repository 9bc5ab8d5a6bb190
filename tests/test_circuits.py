"""OV and QK circuits and K-composition (chapter 10) against a direct computation from the weights
written here, TransformerLens's `FactoredMatrix` and `HookedTransformer.all_composition_scores`.

Tolerance: 1e-10 in float64.
"""

from __future__ import annotations

import pytest
import torch
from test_hooks import attention_only_pair, gpt2_pair
from transformer_lens import FactoredMatrix

from transformer_course.circuits import (
    composition_score,
    full_ov_circuit,
    k_composition_scores,
    ov_circuit,
    qk_circuit,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


@pytest.mark.parametrize("pair", [gpt2_pair, attention_only_pair])
def test_circuits_equal_transformer_lens(pair):
    model, reference = pair()
    with torch.no_grad():
        for layer in range(2):
            for head in range(2):
                OV = reference.OV[layer, head]
                QK = reference.QK[layer, head]
                torch.testing.assert_close(
                    ov_circuit(model, layer, head), OV.AB, atol=1e-10, rtol=0
                )
                torch.testing.assert_close(
                    qk_circuit(model, layer, head), QK.AB, atol=1e-10, rtol=0
                )
        full = reference.W_E @ reference.OV[1, 0] @ reference.W_U
        torch.testing.assert_close(full_ov_circuit(model, 1, 0), full.AB, atol=1e-10, rtol=0)


@pytest.mark.parametrize("pair", [gpt2_pair, attention_only_pair])
def test_k_composition_against_transformer_lens_and_the_formula(pair):
    model, reference = pair()
    with torch.no_grad():
        scores = k_composition_scores(model)
        torch.testing.assert_close(
            scores, reference.all_composition_scores("K")[0, :, 1, :], atol=1e-10, rtol=0
        )
        a0, b1 = model.blocks[0].attn, model.blocks[1].attn
        x_q, y = torch.randn(2, 16, dtype=torch.float64)
        for a in range(2):
            for b in range(2):
                W_OV, W_QK = a0.W_V[a] @ a0.W_O[a], b1.W_Q[b] @ b1.W_K[b].T
                composed = W_QK @ W_OV.T  # score of x_q against a key holding A's output of y
                by_hand = (x_q @ b1.W_Q[b]) @ ((y @ a0.W_V[a] @ a0.W_O[a]) @ b1.W_K[b])
                assert abs(x_q @ composed @ y - by_hand) < 1e-10
                expected = composed.norm() / (W_QK.norm() * W_OV.norm())
                assert abs(scores[a, b] - expected) < 1e-10
                OV = FactoredMatrix(a0.W_V[a], a0.W_O[a])
                QK = FactoredMatrix(b1.W_Q[b], b1.W_K[b].T)
                assert abs(scores[a, b] - (QK @ OV.T).norm() / (QK.norm() * OV.norm())) < 1e-10


def test_composition_score_bounds():
    W = torch.randn(6, 6, dtype=torch.float64)
    assert abs(composition_score(torch.eye(6, dtype=torch.float64), W) - 1 / 6**0.5) < 1e-12
    with pytest.raises(ValueError, match="W_B"):
        composition_score(W, torch.ones(6, 5))


def test_bad_layer_or_head_is_named():
    model, _ = gpt2_pair()
    with pytest.raises(ValueError, match="head"):
        ov_circuit(model, 0, 2)
    with pytest.raises(ValueError, match="layer_b"):
        k_composition_scores(model, 0, 0)
