"""Direct logit attribution (chapter 10) against TransformerLens's `ActivationCache`
(`stack_head_results`, `decompose_resid`, `apply_ln_to_stack`) on the same weights.

Tolerances: the parts sum to the logit within 1e-10 in float64 and 1e-5 in float32 (logits
of order 1 to 10); each part equals TransformerLens's within 1e-10 in float64.
"""

from __future__ import annotations

import pytest
import torch
from test_hooks import attention_only_pair, gpt2_pair, tokens

from transformer_course import hooks
from transformer_course.attribution import attribution_names, logit_attribution

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


def next_token_logits(logits, toks):
    return logits[:, :-1].gather(-1, toks[:, 1:, None])[..., 0]


@pytest.mark.parametrize(
    "pair", [gpt2_pair, attention_only_pair, lambda: attention_only_pair(None)]
)
def test_parts_sum_to_the_logit_and_equal_transformer_lens(pair):
    model, reference = pair()
    toks = tokens()
    logits, cache = hooks.run_with_cache(model, toks, attribution_names(model))
    shares, labels = logit_attribution(model, cache, toks)
    assert shares.shape == (len(labels), 3, 6)
    torch.testing.assert_close(shares.sum(0), next_token_logits(logits, toks), atol=1e-10, rtol=0)
    _, ref_cache = reference.run_with_cache(toks)
    directions = reference.W_U[:, toks[:, 1:]]
    w = reference.ln_final.w if model.cfg.__dict__.get("normalization_type", "LN") else 1.0

    def to_logit(stack):
        stack = ref_cache.apply_ln_to_stack(stack, layer=-1)[:, :, :-1] * w
        return torch.einsum("pbsd,dbs->pbs", stack, directions)

    heads = [i for i, label in enumerate(labels) if label[0] == "L" and label[-1].isdigit()]
    expected_heads = to_logit(ref_cache.stack_head_results(layer=-1))
    torch.testing.assert_close(shares[heads], expected_heads, atol=1e-10, rtol=0)
    resid, resid_labels = ref_cache.decompose_resid(layer=-1, incl_embeds=True, return_labels=True)
    expected = dict(zip(resid_labels, to_logit(resid)))
    torch.testing.assert_close(shares[labels.index("embed")], expected["embed"], atol=1e-10, rtol=0)
    for layer in range(2):  # a layer's heads and b_O make its attn_out
        attn = [
            i
            for i, label in enumerate(labels)
            if label.startswith(f"L{layer}") and "MLP" not in label
        ]
        torch.testing.assert_close(
            shares[attn].sum(0), expected[f"{layer}_attn_out"], atol=1e-10, rtol=0
        )
        if f"{layer}_mlp_out" in expected:
            mlp = shares[labels.index(f"L{layer} MLP")]
            torch.testing.assert_close(mlp, expected[f"{layer}_mlp_out"], atol=1e-10, rtol=0)


def test_float32_parts_sum_to_the_logit():
    model, _ = gpt2_pair()
    model32 = type(model)(model.cfg)
    model32.load_state_dict(model.state_dict())
    toks = tokens(seed=4)
    logits, cache = hooks.run_with_cache(model32.float(), toks, attribution_names(model32))
    shares, _ = logit_attribution(model32, cache, toks)
    assert shares.dtype == torch.float32
    torch.testing.assert_close(shares.sum(0), next_token_logits(logits, toks), atol=1e-5, rtol=0)


def test_frozen_scale_is_not_each_parts_own():
    """Normalising each part by its own scale breaks the sum: the frozen scale is the point."""
    model, _ = gpt2_pair()
    toks = tokens()
    logits, cache = hooks.run_with_cache(model, toks, attribution_names(model))
    shares, _ = logit_attribution(model, cache, toks)
    cache["ln_final.hook_scale"] = torch.ones_like(cache["ln_final.hook_scale"])
    unscaled, _ = logit_attribution(model, cache, toks)
    assert (unscaled.sum(0) - next_token_logits(logits, toks)).abs().max() > 0.1


def test_missing_activation_and_wrong_tokens_are_errors():
    model, _ = gpt2_pair()
    toks = tokens()
    _, cache = hooks.run_with_cache(model, toks, ["hook_embed", "hook_pos_embed"])
    with pytest.raises(KeyError, match="blocks.0.attn.hook_z"):
        logit_attribution(model, cache, toks)
    _, cache = hooks.run_with_cache(model, toks, attribution_names(model))
    with pytest.raises(ValueError, match=r"tokens: expected shape \(3, 7\)"):
        logit_attribution(model, cache, toks[:, :5])
