"""The chapter 10 checkers (`checks.interpretability`): the reference passes, valid alternatives
pass, a blank fails, and each chapter 10 mistake of the bug catalogue is named (each written out
here as a learner would write it)."""

from __future__ import annotations

import einops
import pytest
import torch
from checking import fails

from transformer_course import ablation, attribution, circuits, head_detectors, hooks, patching
from transformer_course.checks.interpretability import (
    check_ablation_hook,
    check_first_token_scores,
    check_induction_scores,
    check_k_composition_scores,
    check_logit_attribution,
    check_patch_head_all_pos,
    check_patch_residual,
    check_prev_token_scores,
    check_repeat_losses,
    check_run_with_hooks,
)
from transformer_course.runtime import evaluating

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
CHECKS = {
    check_run_with_hooks: (hooks.run_with_hooks, "run_with_hooks"),
    check_prev_token_scores: (head_detectors.prev_token_scores, "prev_token_scores"),
    check_first_token_scores: (head_detectors.first_token_scores, "first_token_scores"),
    check_induction_scores: (head_detectors.induction_scores, "induction_scores"),
    check_repeat_losses: (head_detectors.repeat_losses, "repeat_losses"),
    check_logit_attribution: (attribution.logit_attribution, "logit_attribution"),
    check_ablation_hook: (ablation.ablation_hook, "ablation_hook"),
    check_patch_residual: (patching.patch_residual, "patch_residual"),
    check_patch_head_all_pos: (patching.patch_head_all_pos, "patch_head_all_pos"),
    check_k_composition_scores: (circuits.k_composition_scores, "k_composition_scores"),
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


def _run_with_hooks(*, skip_unknown=False, check_returns=True, remove=True, use_hooks=True):
    """`run_with_hooks` as a learner might write it, each safeguard optional."""

    def run(model, tokens, fwd_hooks):
        if skip_unknown:  # a misspelt name quietly hooks nothing
            fwd_hooks = {n: fn for n, fn in fwd_hooks.items() if n in model.hook_dict}

        def returning(fn):
            def hook(act, hook):
                out = fn(act, hook)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"the hook returned {type(out).__name__}")
                return out

            return hook

        pairs = [(n, returning(fn) if check_returns else fn) for n, fn in fwd_hooks.items()]
        with evaluating(model):
            if not use_hooks:
                return model(tokens)
            if not remove:
                for n, fn in pairs:
                    model.add_hook(n, fn)
                return model(tokens)
            return model.run_with_hooks(tokens, fwd_hooks=pairs)

    return run


def test_run_with_hooks_mistakes_are_named():
    check_run_with_hooks(_run_with_hooks())  # written out with TransformerLens's own calls
    fails(check_run_with_hooks, _run_with_hooks(use_hooks=False), "changed nothing")
    fails(check_run_with_hooks, _run_with_hooks(remove=False), "stayed on the model")
    fails(check_run_with_hooks, _run_with_hooks(skip_unknown=True), "misspelt", "accepted")
    fails(check_run_with_hooks, _run_with_hooks(check_returns=False), "returns nothing")


def test_repeat_losses_mistakes_are_named():
    def by_index(loss, seg_len):  # positions of the predicted tokens, counted from the end
        pos = loss.shape[-1] + 1
        second = torch.arange(pos - seg_len + 1, pos) - 1
        return loss[:, second - seg_len], loss[:, second]

    check_repeat_losses(by_index)
    fails(check_repeat_losses, lambda loss, s: (loss[:, -2 * s : -s], loss[:, -s:]), "first token")
    one_off = lambda loss, s: (loss[:, -(2 * s - 1) : -s], loss[:, -s:-1])  # noqa: E731
    fails(check_repeat_losses, one_off, "one off")
    from_start = lambda loss, s: (loss[:, : s - 1], loss[:, -(s - 1) :])  # noqa: E731
    fails(check_repeat_losses, from_start, "with BOS")


def _patch_heads_with(where):
    """`patch_head_all_pos` with the patched slice of `hook_z` chosen by `where(head)`."""

    def patch(model, clean_tokens, corrupted_tokens, metric):
        n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
        results = torch.zeros(n_layers, n_heads)
        for layer in range(n_layers):
            name = f"blocks.{layer}.attn.hook_z"
            _, cache = model.run_with_cache(clean_tokens, names_filter=[name])
            for head in range(n_heads):

                def hook(z, hook, head=head, name=name, cache=cache):
                    z = z.clone()
                    z[where(head)] = cache[name][where(head)]
                    return z

                with torch.no_grad():
                    logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(name, hook)])
                results[layer, head] = float(metric(logits))
        return results

    return patch


def test_patching_every_head_or_a_position_is_named():
    check_patch_head_all_pos(_patch_heads_with(lambda h: (slice(None), slice(None), h)))
    fails(check_patch_head_all_pos, _patch_heads_with(lambda h: (slice(None),)), "every head")
    fails(check_patch_head_all_pos, _patch_heads_with(lambda h: (slice(None), h)), "position h")


def _composition_with(product, normalise=True, transpose=False):
    """K-composition scores computed head pair by head pair with `product(W_OV_a, layer_b, b)`."""

    def scores(model, layer_a=0, layer_b=1):
        n = model.cfg.n_heads
        out = torch.zeros(n, n, dtype=model.embed.W_E.dtype)
        for a in range(n):
            attn_a = model.blocks[layer_a].attn
            W_OV = attn_a.W_V[a] @ attn_a.W_O[a]
            for b in range(n):
                attn_b = model.blocks[layer_b].attn
                W_QK, W_OV_b = attn_b.W_Q[b] @ attn_b.W_K[b].T, attn_b.W_V[b] @ attn_b.W_O[b]
                W, other = product(W_OV, W_QK, W_OV_b)
                size = (
                    torch.linalg.norm(W)
                    if not normalise
                    else torch.linalg.norm(W) / (torch.linalg.norm(W_OV) * torch.linalg.norm(other))
                )
                out[a, b] = size
        return out.T if transpose else out

    return scores


def test_composition_mistakes_are_named():
    k = lambda ov, qk, ov_b: (qk @ ov.T, qk)  # noqa: E731
    check_k_composition_scores(_composition_with(k))
    fails(check_k_composition_scores, _composition_with(lambda ov, qk, ov_b: (ov @ qk, qk)), "Q-")
    v = lambda ov, qk, ov_b: (ov @ ov_b, ov_b)  # noqa: E731
    fails(check_k_composition_scores, _composition_with(v), "V-composition")
    fails(
        check_k_composition_scores,
        _composition_with(lambda ov, qk, ov_b: (qk @ ov, qk)),
        "transpose",
    )
    fails(check_k_composition_scores, _composition_with(k, normalise=False), "norms")
    fails(check_k_composition_scores, _composition_with(k, transpose=True), "not the transpose")
