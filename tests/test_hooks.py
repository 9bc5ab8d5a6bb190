"""Caching and hooks (chapter 10) on the course's GPT-2 and attention-only model, against the
same weights in TransformerLens's `HookedTransformer` (no weight processing).

The models here are shared by the chapter 10 tests: tiny, float64, every parameter (biases and
norm gains too) randomised so that nothing cancels by accident. Tolerances: activations and
logits against TransformerLens within 1e-10 in float64 (the same operations in another order).
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from transformer_course import hooks
from transformer_course.attention_only import (
    AttentionOnlyConfig,
    AttentionOnlyTransformer,
    to_hooked_transformer,
)
from transformer_course.gpt2 import GPT2, GPT2Config

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
SIZES = dict(d_model=16, n_layers=2, n_heads=2, d_vocab=23, n_ctx=16)


def randomise_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved by seeded noise of 0.3 (norm gains stay near 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


@functools.cache
def gpt2_pair() -> tuple[GPT2, HookedTransformer]:
    """A tiny course GPT-2 in float64 and the `HookedTransformer` holding its weights."""
    torch.manual_seed(0)
    model = randomise_(GPT2(GPT2Config(**SIZES)).double()).eval()
    cfg = HookedTransformerConfig(
        **SIZES, d_head=8, d_mlp=64, act_fn="gelu_new", normalization_type="LN", dtype=torch.float64
    )
    reference = HookedTransformer(cfg)
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(key.endswith(("mask", "IGNORE")) for key in missing)
    return model, reference.eval()


@functools.cache
def attention_only_pair(normalization_type: str | None = "LN"):
    """A tiny attention-only model in float64 and its `HookedTransformer`."""
    torch.manual_seed(1)
    cfg = AttentionOnlyConfig(**SIZES, normalization_type=normalization_type)
    model = randomise_(AttentionOnlyTransformer(cfg).double(), seed=1).eval()
    return model, to_hooked_transformer(model)


def tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, SIZES["d_vocab"], (batch, pos), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("pair", [gpt2_pair, attention_only_pair])
def test_run_with_cache_matches_transformer_lens(pair):
    model, reference = pair()
    logits, cache = hooks.run_with_cache(model, tokens())
    ref_logits, ref_cache = reference.run_with_cache(tokens())
    torch.testing.assert_close(logits, ref_logits, atol=1e-10, rtol=0)
    shared = set(cache) & set(ref_cache.keys())
    assert {
        "blocks.1.attn.hook_pattern",
        "blocks.0.hook_resid_pre",
        "blocks.1.attn.hook_z",
    } <= shared
    seen = torch.ones(7, 7, dtype=torch.bool).tril()  # masked scores: -inf here, -1e5 in TL
    for name in shared:
        ours, theirs = cache[name], ref_cache[name]
        if name.endswith("hook_attn_scores"):
            ours, theirs = ours[..., seen], theirs[..., seen]
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=0, msg=name)
    assert not model.training


def test_cache_keeps_only_the_names_asked_for():
    model, _ = gpt2_pair()
    _, cache = hooks.run_with_cache(model, tokens(), ["blocks.0.attn.hook_pattern"])
    assert list(cache) == ["blocks.0.attn.hook_pattern"]
    assert cache["blocks.0.attn.hook_pattern"].shape == (3, 2, 7, 7)


def test_a_hook_edits_the_activation_like_transformer_lens():
    model, reference = gpt2_pair()
    name = "blocks.1.hook_resid_pre"
    double = lambda act, hook: 2 * act
    logits = hooks.run_with_hooks(model, tokens(), {name: double})
    expected = reference.run_with_hooks(tokens(), fwd_hooks=[(name, double)])
    torch.testing.assert_close(logits, expected, atol=1e-10, rtol=0)
    assert (logits - model(tokens())).abs().max() > 0.1  # the edit changed the output


def test_misspelt_hook_name_lists_near_matches():
    model, _ = gpt2_pair()
    with pytest.raises(KeyError, match="did you mean 'blocks.0.attn.hook_pattern'"):
        hooks.run_with_cache(model, tokens(), ["blocks.0.attn.hook_patern"])
    with pytest.raises(KeyError, match="blocks.0.hook_resid_pre"):
        hooks.run_with_hooks(model, tokens(), {"blocks.0.hook_resid_pr": lambda a, h: a})


def test_cache_without_the_activation_says_what_it_holds():
    model, _ = gpt2_pair()
    _, cache = hooks.run_with_cache(model, tokens(), ["blocks.0.attn.hook_pattern"])
    with pytest.raises(KeyError, match="no activation named 'blocks.1.attn.hook_z'.*hook_pattern"):
        hooks.activation(cache, "blocks.1.attn.hook_z")


def test_hook_that_returns_nothing_is_an_error():
    model, _ = gpt2_pair()

    def forgets(act, hook):
        act = act.clone()
        act[:] = 0

    with pytest.raises(ValueError, match="expected it to return the edited activation"):
        hooks.run_with_hooks(model, tokens(), {"blocks.0.attn.hook_z": forgets})
