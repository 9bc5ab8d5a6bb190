"""The chapter 10 checkers (`checks.interpretability`): the reference passes, valid alternatives
pass, a blank fails, and each chapter 10 mistake of the bug catalogue is named (each written out
here as a learner would write it)."""

from __future__ import annotations

import einops
import pytest
import torch
from checking import fails

from transformer_course import ablation, attribution, head_detectors, patching
from transformer_course.checks.interpretability import (
    check_ablation_hook,
    check_first_token_scores,
    check_induction_scores,
    check_logit_attribution,
    check_patch_residual,
    check_prev_token_scores,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
CHECKS = {
    check_prev_token_scores: (head_detectors.prev_token_scores, "prev_token_scores"),
    check_first_token_scores: (head_detectors.first_token_scores, "first_token_scores"),
    check_induction_scores: (head_detectors.induction_scores, "induction_scores"),
    check_logit_attribution: (attribution.logit_attribution, "logit_attribution"),
    check_ablation_hook: (ablation.ablation_hook, "ablation_hook"),
    check_patch_residual: (patching.patch_residual, "patch_residual"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_reference_passes(check, capsys):
    reference, name = CHECKS[check]
    check(reference)
    assert f"✓ {name} passes every check" in capsys.readouterr().out


def blank(*args, **kwargs):
    raise NotImplementedError("Exercise 10.x: write it (hints below the cell)")


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_blank_fails(check):
    fails(check, blank, "not implemented", "Exercise 10.x")


def test_valid_alternatives_pass():
    def induction_by_loops(pattern, seg_len):  # an index gather instead of .diagonal
        q = torch.arange(pattern.shape[-1] - seg_len, pattern.shape[-1])
        return pattern[:, :, q, q - seg_len + 1].mean(dim=(0, 2))

    def prev_by_einops(pattern):
        q = torch.arange(1, pattern.shape[-1])
        return einops.reduce(pattern[:, :, q, q - 1], "b h q -> h", "mean")

    def ablation_in_place(heads, kind="zero", mean=None):
        def hook(z, hook):
            z = z.clone()
            for head in heads:
                z[:, :, head] = 0 if kind == "zero" else mean[:, head]
            return z

        return hook

    check_induction_scores(induction_by_loops)
    check_prev_token_scores(prev_by_einops)
    check_ablation_hook(ablation_in_place)


def test_induction_score_at_the_wrong_offset_is_named():
    def duplicate_token(pattern, seg_len):
        return pattern.diagonal(-seg_len, dim1=-2, dim2=-1)[..., -seg_len:].mean(dim=(0, -1))

    fails(check_induction_scores, duplicate_token, "earlier occurrence itself")

    def one_off(pattern, seg_len):
        return pattern.diagonal(-seg_len - 1, dim1=-2, dim2=-1)[..., -(seg_len - 1) :].mean((0, -1))

    fails(check_induction_scores, one_off, "one off")


def test_attribution_without_the_final_norm_scale_is_named():
    def unscaled(model, cache, tokens):
        cache = dict(cache)
        cache["ln_final.hook_scale"] = torch.ones_like(cache["ln_final.hook_scale"])
        return attribution.logit_attribution(model, cache, tokens)

    fails(check_logit_attribution, unscaled, "final norm's scale")


def _patch_with(where):
    """`patch_residual` with the patched slice chosen by `where(p)`."""

    def patch(model, clean_tokens, corrupted_tokens, metric):
        names = [f"blocks.{layer}.hook_resid_pre" for layer in range(model.cfg.n_layers)]
        _, cache = model.run_with_cache(clean_tokens, names_filter=names)
        results = torch.zeros(model.cfg.n_layers, clean_tokens.shape[1])
        for layer, name in enumerate(names):
            for p in range(clean_tokens.shape[1]):

                def hook(act, hook, p=p, name=name):
                    act = act.clone()
                    act[where(p)] = cache[name][where(p)]
                    return act

                with torch.no_grad():
                    logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, hook)])
                results[layer, p] = float(metric(logits))
        return results

    return patch


def test_patching_every_position_or_the_wrong_one_is_named():
    check_patch_residual(_patch_with(lambda p: (slice(None), p)))  # written out: it passes
    fails(check_patch_residual, _patch_with(lambda p: (slice(None),)), "every position")
    last = lambda p: (slice(None), min(p + 1, 4))  # noqa: E731
    fails(check_patch_residual, _patch_with(last), "wrong position")


def test_ablation_hook_that_returns_nothing_is_named():
    def forgets(heads, kind="zero", mean=None):
        def hook(z, hook):
            z = z.clone()
            z[:, :, heads] = 0

        return hook

    fails(check_ablation_hook, forgets, "returned NoneType", "return the edited z")
