"""Head ablation (chapter 10): the hooks against direct edits of `z`, and the loss with each head
removed against the same run written here with TransformerLens's `HookedTransformer`.

Tolerance: 1e-10 in float64.
"""

from __future__ import annotations

import pytest
import torch
from test_hooks import attention_only_pair, gpt2_pair, tokens

from transformer_course.ablation import ablation_hook, head_ablation_losses, mean_z
from transformer_course.head_detectors import per_token_loss

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


def test_hooks_edit_only_their_heads_and_leave_the_input():
    z = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    given = z.clone()
    zeroed = ablation_hook([1], "zero")(given, None)
    assert torch.equal(given, z)
    assert (zeroed[:, :, 1] == 0).all() and torch.equal(zeroed[:, :, [0, 2]], z[:, :, [0, 2]])
    mean = z.mean(0)
    averaged = ablation_hook([0, 2], "mean", mean)(given, None)
    assert torch.equal(averaged[:, :, [0, 2]], mean[None, :, [0, 2]].expand(2, 5, 2, 4))
    assert torch.equal(averaged[:, :, 1], z[:, :, 1])


@pytest.mark.parametrize("kind", ["zero", "mean"])
@pytest.mark.parametrize("pair", [gpt2_pair, attention_only_pair])
def test_losses_equal_transformer_lens_runs(pair, kind):
    model, reference = pair()
    toks = tokens(batch=4, pos=6, seed=3)
    losses = head_ablation_losses(model, toks, kind=kind)
    _, cache = reference.run_with_cache(toks)
    for layer in range(2):
        for head in range(2):
            name = f"blocks.{layer}.attn.hook_z"

            def hook(z, hook, head=head, name=name):
                z = z.clone()
                z[:, :, head] = 0 if kind == "zero" else cache[name][:, :, head].mean(0)
                return z

            logits = reference.run_with_hooks(toks, fwd_hooks=[(name, hook)]).detach()
            expected = float(per_token_loss(logits, toks).mean())
            assert abs(losses[layer, head] - expected) < 1e-10
    intact = float(per_token_loss(model(toks).detach(), toks).mean())
    assert (losses - intact).abs().max() > 1e-3  # removing a head changes the loss


def test_mean_z_is_the_batch_mean():
    model, reference = gpt2_pair()
    toks = tokens(batch=4, pos=6)
    expected = reference.run_with_cache(toks)[1]["blocks.1.attn.hook_z"].mean(0)
    torch.testing.assert_close(mean_z(model, toks, 1), expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "call, error, word",
    [
        (lambda: ablation_hook([0], "half"), ValueError, "kind"),
        (lambda: ablation_hook([0], "mean"), ValueError, "mean"),
        (lambda: ablation_hook([3])(torch.zeros(1, 2, 3, 4), None), ValueError, "heads"),
    ],
)
def test_bad_input_is_named(call, error, word):
    with pytest.raises(error, match=word):
        call()
