"""The attention-only transformer against TransformerLens's `HookedTransformer(attn_only=True)`.

Random weights (biases and layer norms included), no download. Tolerances: float64 logits and
cached activations within max abs diff 1e-10; float32 logits within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from transformer_course.attention_only import (
    AttentionOnlyConfig,
    AttentionOnlyTransformer,
    to_hooked_transformer,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_model(normalization_type, dtype=torch.float64, device="cpu", seed=0):
    torch.manual_seed(seed)
    cfg = AttentionOnlyConfig(
        d_model=24, n_layers=2, n_heads=3, d_vocab=37, n_ctx=12,
        normalization_type=normalization_type,
    )  # fmt: skip
    model = AttentionOnlyTransformer(cfg).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for param in model.parameters():  # layer-norm gains stay near 1, all else random
            param.copy_(param.detach() + 0.3 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization_type", ["LN", None])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_same_logits_as_transformer_lens(device, normalization_type, dtype, tol):
    model = random_model(normalization_type, dtype, device)
    hooked = to_hooked_transformer(model)
    assert hooked.cfg.attn_only and hooked.cfg.normalization_type == normalization_type
    tokens = torch.randint(0, 37, (3, 12), device=device)
    with torch.no_grad():
        ours, theirs = model(tokens), hooked(tokens)
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)


@pytest.mark.parametrize("normalization_type", ["LN", None])
def test_cache_names_and_values_match_transformer_lens(normalization_type):
    model = random_model(normalization_type)
    hooked = to_hooked_transformer(model)
    tokens = torch.randint(0, 37, (2, 12))
    _, ours = model.run_with_cache(tokens)
    _, theirs = hooked.run_with_cache(tokens)
    # TransformerLens's unembedding has hook points of its own; ours is chapter 6's Unembed.
    assert set(ours.keys()) == set(theirs.keys()) - {"unembed.hook_in", "unembed.hook_out"}
    for name in ("blocks.1.attn.hook_pattern", "blocks.0.hook_resid_pre", "hook_pos_embed"):
        assert name in ours.keys()
    for name in ours.keys():
        if name.endswith("hook_attn_scores"):  # masked entries: -inf there, the dtype's min here
            allowed = torch.ones(12, 12, dtype=torch.bool).tril()
            ours_scores, theirs_scores = ours[name][..., allowed], theirs[name][..., allowed]
            torch.testing.assert_close(ours_scores, theirs_scores, atol=1e-10, rtol=0)
            continue
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-10, rtol=0, msg=name)


def test_hook_that_edits_an_activation_matches_transformer_lens():
    model = random_model("LN")
    hooked = to_hooked_transformer(model)
    tokens = torch.randint(0, 37, (2, 12))

    def uniform_head_1(pattern, hook):
        pattern[:, 1] = torch.ones(12, 12, dtype=pattern.dtype).tril()
        return pattern / pattern.sum(-1, keepdim=True)

    hooks = [("blocks.1.attn.hook_pattern", uniform_head_1)]
    ours = model.run_with_hooks(tokens, fwd_hooks=hooks)
    theirs = hooked.run_with_hooks(tokens, fwd_hooks=hooks)
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=0)
    assert (ours - model(tokens)).abs().max() > 1e-3, "the edit changed the logits"


def test_transformer_lens_weights_load_into_ours():
    hooked = to_hooked_transformer(random_model(None, seed=1))
    model = random_model(None, seed=2)
    model.load_state_dict(
        {k: v for k, v in hooked.state_dict().items() if not k.endswith(("mask", "IGNORE"))}
    )
    tokens = torch.randint(0, 37, (2, 12))
    torch.testing.assert_close(model(tokens), hooked(tokens), atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(normalization_type="RMS"), "normalization_type"),
        (dict(d_model=30, n_heads=4), "n_heads=4"),
        (dict(n_layers=0), "n_layers"),
        (dict(init_range=0.0), "init_range"),
    ],
)
def test_bad_config_is_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        AttentionOnlyConfig(**kwargs)


def test_bad_input_is_refused_by_name():
    model = random_model(None)
    with pytest.raises(ValueError, match="tokens"):
        model(torch.tensor([[0, 37]]))  # 37 is outside the vocabulary
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(1, 13, dtype=torch.long))  # longer than n_ctx
    with pytest.raises(TypeError, match="model: expected an AttentionOnlyTransformer"):
        to_hooked_transformer(torch.nn.Linear(2, 2))
