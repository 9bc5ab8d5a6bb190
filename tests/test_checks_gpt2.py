"""The chapter-6 checkers (`checks.gpt2`): the reference passes, a blank fails with its hint,
classic bugs get targeted hints (each bug is written out here as a small variant of the
reference) and valid alternatives pass."""

from __future__ import annotations

import copy
import math

import einops
import pytest
import torch
import torch.nn.functional as F
from checking import fails
from torch import nn

from transformer_course.attention import scaled_dot_product_attention
from transformer_course.checks.gpt2 import (
    check_against_huggingface,
    check_cosine_lr,
    check_embed,
    check_estimate_loss,
    check_generate,
    check_gpt2_forward,
    check_kv_cache,
    check_pos_embed,
    check_sample_batch,
    check_top_p_filter,
    check_train_loop,
    check_train_step,
    check_unembed,
    check_weight_conversion,
)
from transformer_course.checks.harness import CheckFailure
from transformer_course.gpt2 import (
    GPT2,
    Embed,
    PosEmbed,
    Unembed,
    forward_with_cache,
    generate,
    top_p_filter,
    train_loop,
    train_step,
)
from transformer_course.gpt2_weights import convert_hf_gpt2_state_dict
from transformer_course.masking import causal_mask
from transformer_course.runtime import evaluating
from transformer_course.training import History, cosine_lr, estimate_loss, sample_batch


@pytest.mark.parametrize(
    "check, reference",
    [
        (check_embed, Embed),
        (check_pos_embed, PosEmbed),
        (check_unembed, Unembed),
        (check_gpt2_forward, GPT2),
        (check_generate, generate),
        (check_sample_batch, sample_batch),
        (check_kv_cache, forward_with_cache),
    ],
)
def test_reference_passes(check, reference, capsys):
    check(reference)
    assert "passes every check" in capsys.readouterr().out


# Blanks: what the exercise workbook hands out.


class BlankEmbed(Embed):
    def forward(self, tokens):
        raise NotImplementedError("index W_E with the tokens")


class BlankPosEmbed(PosEmbed):
    def forward(self, tokens):
        raise NotImplementedError("slice W_pos to the sequence length")


class BlankUnembed(Unembed):
    def __init__(self, cfg):
        raise NotImplementedError("create W_U and b_U")


class BlankGPT2(GPT2):
    def forward(self, tokens):
        raise NotImplementedError("embed, blocks, ln_final, unembed")


def blank_generate(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
    raise NotImplementedError("loop: crop, forward, last logits, sample, append")


def blank_sample_batch(data, batch_size, n_ctx, *, generator=None):
    raise NotImplementedError("Exercise 6.10: write sample_batch (hints below the cell)")


def blank_forward_with_cache(model, tokens, cache=None):
    raise NotImplementedError("Exercise 6.11: write forward_with_cache (hints below the cell)")


@pytest.mark.parametrize(
    "check, blank, hint",
    [
        (check_embed, BlankEmbed, "index W_E"),
        (check_pos_embed, BlankPosEmbed, "slice W_pos"),
        (check_unembed, BlankUnembed, "create W_U"),
        (check_gpt2_forward, BlankGPT2, "ln_final"),
        (check_generate, blank_generate, "crop"),
        (check_sample_batch, blank_sample_batch, "Exercise 6.10"),
        (check_kv_cache, blank_forward_with_cache, "Exercise 6.11"),
    ],
)
def test_blank_fails_with_its_hint(check, blank, hint):
    fails(check, blank, "not implemented", hint)


# Bugs.


class ScaledEmbed(Embed):
    def forward(self, tokens):
        return self.W_E[tokens] * math.sqrt(self.cfg.d_model)


def test_embed_rejects_vaswani_scale():
    fails(check_embed, ScaledEmbed, "sqrt(d_model)")


class PosEmbedByToken(PosEmbed):
    def forward(self, tokens):
        return self.W_pos[tokens]


class PosEmbedNoBatch(PosEmbed):
    def forward(self, tokens):
        return self.W_pos[: tokens.shape[1]]


def test_pos_embed_rejects_indexing_by_token_and_missing_batch():
    fails(check_pos_embed, PosEmbedByToken, "not on which token")
    fails(check_pos_embed, PosEmbedNoBatch, "shape")


class UnembedBiasOnes(Unembed):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.b_U = nn.Parameter(
            torch.ones(cfg.d_vocab)
        )  # the catalogue's "biases initialised to ones"


class UnembedNoBias(Unembed):
    def forward(self, x):
        return x @ self.W_U


class UnembedTransposed(Unembed):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.W_U = nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_model) * cfg.init_range)


def test_unembed_rejects_bias_ones_missing_bias_and_wrong_layout():
    fails(check_unembed, UnembedBiasOnes, "zeros")
    fails(check_unembed, UnembedNoBias, "bias")
    fails(check_unembed, UnembedTransposed, "shape")


class NoPositionGPT2(GPT2):
    def forward(self, tokens):
        residual = self.embed(tokens)
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))


class NoFinalNormGPT2(GPT2):
    def forward(self, tokens):
        residual = self.embed(tokens) + self.pos_embed(tokens)
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(residual)


def test_gpt2_forward_rejects_missing_parts():
    fails(check_gpt2_forward, NoPositionGPT2, "position embedding")
    fails(check_gpt2_forward, NoFinalNormGPT2, "ln_final")


def _sampler(
    pick_logits,
    *,
    crop=True,
    temperature_op=lambda logits, t: logits / t,
    top_k_largest=True,
    greedy=False,
):
    """A generate() with one knob turned wrong at a time."""

    @torch.no_grad()
    def sample(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            context = tokens[:, -model.cfg.n_ctx :] if crop else tokens
            logits = pick_logits(model(context))
            if temperature == 0 or greedy:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = temperature_op(logits, temperature)
                if top_k is not None:
                    values = logits.topk(top_k, dim=-1, largest=top_k_largest).values[:, -1:]
                    drop = logits < values if top_k_largest else logits > values
                    logits = logits.masked_fill(drop, -math.inf)
                next_token = torch.multinomial(logits.softmax(-1), 1)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    return sample


def last(logits):
    return logits[:, -1]


def test_generate_rejects_classic_sampling_bugs():
    fails(check_generate, _sampler(last, crop=False), "n_ctx")
    fails(check_generate, _sampler(lambda logits: logits[:, 0]), "last position")
    fails(check_generate, _sampler(last, temperature_op=lambda logits, t: logits * t), "divide")
    fails(check_generate, _sampler(last, greedy=True), "instead of taking the argmax")
    fails(check_generate, _sampler(last, top_k_largest=False), "top_k")


def test_generate_rejects_division_by_zero_temperature():
    @torch.no_grad()
    def divides(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            probs = (model(tokens[:, -model.cfg.n_ctx :])[:, -1] / temperature).softmax(-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
        return tokens

    fails(check_generate, divides, "greedy")


# Families: hooks, optional arguments, dropout in train and eval mode, rows that differ.


class UnhookedGPT2(GPT2):
    def forward(self, tokens):
        residual = self.dropout(self.embed(tokens) + self.pos_embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))


class LateDropoutGPT2(GPT2):
    def forward(self, tokens):
        residual = self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(self.pos_embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(self.dropout(residual)))


def test_gpt2_forward_rejects_missing_hooks_and_misplaced_dropout():
    fails(check_gpt2_forward, UnhookedGPT2, "hook_embed", "never received")
    fails(check_gpt2_forward, LateDropoutGPT2, "train mode", "before the blocks")


def test_generate_rejects_a_top_k_threshold_taken_from_the_first_row():
    @torch.no_grad()
    def first_row_threshold(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1]
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    threshold = logits[0].topk(top_k).values[-1]  # the bug: row 0's k-th largest
                    logits = logits.masked_fill(logits < threshold, -math.inf)
                next_token = torch.multinomial(logits.softmax(-1), 1)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    fails(check_generate, first_row_threshold, "four different prompts", "each row")


def test_generate_alternatives_pass():
    """Top-k by scattering the kept logits into -inf, and sampling with a Gumbel-max trick."""

    def scatter_gumbel(
        model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, generator=None
    ):
        with evaluating(model):
            return _gumbel_loop(model, tokens, max_new_tokens, temperature, top_k, top_p, generator)

    def _gumbel_loop(model, tokens, max_new_tokens, temperature, top_k, top_p, generator):
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1]
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    values, indices = logits.topk(top_k, dim=-1)
                    logits = torch.full_like(logits, -math.inf).scatter(-1, indices, values)
                if top_p is not None:
                    logits = top_p_filter(logits, top_p)
                uniform = torch.rand(logits.shape, generator=generator)
                gumbel = -torch.log(-torch.log(uniform))
                next_token = (logits + gumbel).argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    check_generate(scatter_gumbel)


def _full_generate(*, order="tkp", evaluate=True, no_grad=True, restore=True):
    """A complete generate() whose steps run in `order` (t: temperature, k: top_k, p: top_p),
    with the model in eval mode, gradients off and the model's mode restored, as asked."""

    def sample(
        model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, generator=None
    ):
        was_training = model.training
        if evaluate:
            model.eval()
        with torch.set_grad_enabled(not no_grad):
            for _ in range(max_new_tokens):
                logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1].float()
                if temperature == 0:
                    next_token = logits.argmax(-1, keepdim=True)
                else:
                    for step in order:
                        if step == "t":
                            logits = logits / temperature
                        elif step == "k" and top_k is not None:
                            kth = logits.topk(top_k, dim=-1).values[:, -1:]
                            logits = logits.masked_fill(logits < kth, -math.inf)
                        elif step == "p" and top_p is not None:
                            logits = top_p_filter(logits, top_p)
                    next_token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
                tokens = torch.cat([tokens, next_token], dim=1)
        if restore:
            model.train(was_training)
        return tokens

    return sample


def test_generate_written_out_passes():
    check_generate(_full_generate())


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"order": "kpt"}, ["temperature=0.5, top_p=0.6", "divide by the temperature first"]),
        ({"order": "tpk"}, ["top_k=8, top_p=0.5", "apply top_k before top_p"]),
        ({"evaluate": False}, ["train mode", "dropout", "evaluating(model)"]),
        ({"no_grad": False}, ["gradients were tracked", "torch.no_grad()"]),
        ({"restore": False}, ["left in eval mode", "restore"]),
    ],
)
def test_generate_sampling_order_and_modes_are_named(knob, words):
    """Top-p before the temperature or before top-k, and a model left in train mode, with
    gradients on, or not restored to its mode, are each named."""
    fails(check_generate, _full_generate(**knob), *words)


def test_generate_rejects_an_ignored_generator():
    @torch.no_grad()
    def global_rng(
        model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, generator=None
    ):
        return generate(
            model, tokens, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p
        )

    fails(check_generate, global_rng, "same generator seed", "generator=generator")


def test_generate_that_returns_float_ids_is_named():
    def float_ids(model, tokens, max_new_tokens, **options):
        return generate(model, tokens, max_new_tokens, **options).float()

    fails(check_generate, float_ids, "int64 tensor of shape (4000, 2), got a float32 tensor")


# Top-p filtering and the training step.


def test_top_p_filter_and_train_step_references_pass(capsys):
    check_top_p_filter(top_p_filter)
    check_train_step(train_step)
    assert capsys.readouterr().out.count("passes every check") == 2


def test_top_p_filter_bugs_are_named():
    def drops_the_crossing_token(logits, top_p):
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        drop = probs.cumsum(-1) > top_p
        return logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)

    fails(check_top_p_filter, drops_the_crossing_token, "mass *before* it")

    def stays_sorted(logits, top_p):
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        return logits.masked_fill(
            probs.cumsum(-1) - probs >= top_p, -math.inf
        )  # mask in sorted order

    fails(check_top_p_filter, stays_sorted, "never went back to vocabulary order")

    def keeps_the_first_but_drops_the_crossing_token(logits, top_p):
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        drop = probs.cumsum(-1) > top_p
        drop[..., 0] = False  # the likeliest always stays
        return logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)

    fails(check_top_p_filter, keeps_the_first_but_drops_the_crossing_token, "carries the total")

    def returns_sorted_logits(logits, top_p):
        ordered = logits.sort(-1, descending=True).values
        probs = ordered.softmax(-1)
        return ordered.masked_fill(probs.cumsum(-1) - probs >= top_p, -math.inf)

    with pytest.raises(CheckFailure) as info:
        check_top_p_filter(returns_sorted_logits)
    assert "come back in sorted order" in str(info.value)
    assert "nan" not in str(info.value), str(info.value)

    def renormalises(logits, top_p):
        return top_p_filter(logits, top_p).log_softmax(-1)

    fails(check_top_p_filter, renormalises, "kept logits unchanged")


def test_top_p_filter_alternative_passes():
    def with_a_loop(logits, top_p):
        out = torch.full_like(logits, -math.inf)
        for row in range(logits.shape[0]):
            probs = logits[row].softmax(-1)
            total = 0.0
            for index in probs.argsort(descending=True).tolist():
                if total >= top_p:
                    break
                out[row, index], total = logits[row, index], total + probs[index].item()
        return out

    check_top_p_filter(with_a_loop)


def _step(*, train=True, zero=True, clip=True, item=True):
    def step(model, optimizer, tokens, targets, *, grad_clip=1.0):
        if train:
            model.train()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        if zero:
            optimizer.zero_grad()
        loss.backward()
        if clip and grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        return loss.item() if item else loss

    return step


@pytest.mark.parametrize(
    ("bug", "words"),
    [
        ({"train": False}, ["model.train()"]),
        ({"zero": False}, ["zero_grad"]),
        ({"clip": False}, ["clip_grad_norm_"]),
        ({"item": False}, ["loss.item()"]),
    ],
)
def test_train_step_bugs_are_named(bug, words):
    fails(check_train_step, _step(**bug), *words)


def test_train_step_alternative_passes():
    check_train_step(_step())


def test_train_step_that_clips_with_grad_clip_none_is_named():
    def clips_always(model, optimizer, tokens, targets, *, grad_clip=1.0):
        model.train()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        return loss.item()

    fails(check_train_step, clips_always, "grad_clip=None", "no clipping")


# Batches of a token stream.


def _windows(*, shift=1, low=0, high_extra=0, per_row=True, use_generator=True, own_seed=False):
    """A sample_batch with one knob turned wrong at a time; `shift=1` and the rest as given is
    the reference's behaviour, written as nanoGPT writes it (a list of slices)."""

    def sample(data, batch_size, n_ctx, *, generator=None):
        if own_seed:
            generator = torch.Generator().manual_seed(0)
        if not use_generator:
            generator = None
        high = len(data) - n_ctx + high_extra
        starts = torch.randint(low, high, (batch_size if per_row else 1,), generator=generator)
        starts = starts.expand(batch_size)
        x = torch.stack([data[i : i + n_ctx] for i in starts.tolist()])
        y = torch.stack([data[i + shift : i + shift + n_ctx] for i in starts.tolist()])
        return x, y

    return sample


def test_sample_batch_alternative_passes(capsys):
    check_sample_batch(_windows())
    assert "passes every check" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"shift": 0}, ["not x shifted", "the inputs themselves"]),
        ({"low": 1, "shift": -1}, ["one token before"]),
        ({"high_extra": -1}, ["last window", "len(data) - n_ctx - 1"]),
        ({"high_extra": 1}, ["past the end of data", "exclusive"]),
        ({"per_row": False}, ["different windows", "one start per row"]),
        ({"use_generator": False}, ["equally seeded generators", "generator=generator"]),
        ({"own_seed": True}, ["different seeds gave the same windows"]),
    ],
)
def test_sample_batch_bugs_are_named(knob, words):
    fails(check_sample_batch, _windows(**knob), *words)


def test_sample_batch_with_shifted_token_ids_is_caught():
    """Adding one to the ids instead of taking the next token passes on data = arange(n), which
    is why the check draws from a shuffled stream."""

    def adds_one(data, batch_size, n_ctx, *, generator=None):
        x, _ = sample_batch(data, batch_size, n_ctx, generator=generator)
        return x, x + 1

    fails(check_sample_batch, adds_one, "not x shifted by one token", "next tokens")


def test_sample_batch_that_returns_lists_or_ids_not_in_data_is_named():
    def lists(data, batch_size, n_ctx, *, generator=None):
        return tuple(t.tolist() for t in sample_batch(data, batch_size, n_ctx, generator=generator))

    fails(check_sample_batch, lists, "shape (64, 8) and dtype int64, got ([[")

    def far_targets(data, batch_size, n_ctx, *, generator=None):
        x, y = sample_batch(data, batch_size, n_ctx, generator=generator)
        return x, y + len(data)  # past every id of data

    fails(check_sample_batch, far_targets, "y is not x shifted by one token")


# The KV cache.


def cached_forward(*, append=True, offset=True, mask="causal_mask", sdpa=False):
    """A forward_with_cache with one knob turned wrong at a time. `mask`: "causal_mask"
    (bottom-right aligned, right), "tril" (the same mask written by hand, right), "top_left"
    (`causal_mask(k_len)[:q_len]`), "is_causal" (SDPA's `is_causal=True`, top-left aligned too)
    or "none_with_cache" (the new tokens see each other's keys)."""

    def forward(model, tokens, cache=None):
        start = 0 if cache is None else cache[0][0].shape[-2]
        new = tokens.shape[1]
        positions = (
            model.pos_embed.W_pos[start : start + new] if offset else model.pos_embed.W_pos[:new]
        )
        residual = model.embed(tokens) + positions
        new_cache = []
        for layer, block in enumerate(model.blocks):
            attn, x = block.attn, block.ln1(residual)
            q, k, v = (
                torch.einsum("bpd,hde->bhpe", x, W) + b[:, None]
                for W, b in ((attn.W_Q, attn.b_Q), (attn.W_K, attn.b_K), (attn.W_V, attn.b_V))
            )
            keys, values = k, v
            if cache is not None:
                keys = torch.cat([cache[layer][0], k], dim=-2)
                values = torch.cat([cache[layer][1], v], dim=-2)
            new_cache.append((keys, values) if append else (k, v))
            k_len = keys.shape[-2]
            if mask == "causal_mask":
                allowed = causal_mask(new, k_len)
            elif mask == "tril":
                allowed = torch.ones(new, k_len, dtype=torch.bool).tril(k_len - new)
            elif mask == "top_left":
                allowed = causal_mask(k_len)[:new]
            elif mask == "none_with_cache":
                allowed = causal_mask(new) if cache is None else None
            else:  # "is_causal"
                allowed = None
            if sdpa or mask == "is_causal":
                z = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=allowed, is_causal=mask == "is_causal"
                )
            else:
                z, _ = scaled_dot_product_attention(q, keys, values, allowed)
            out = torch.einsum("bhpe,hed->bpd", z, attn.W_O) + attn.b_O
            residual = residual + out
            residual = residual + block.mlp(block.ln2(residual))
        return model.unembed(model.ln_final(residual)), new_cache

    return forward


def test_kv_cache_alternatives_pass():
    check_kv_cache(cached_forward(mask="tril", sdpa=True))
    check_kv_cache(cached_forward(sdpa=True))


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"append": False}, ["not appended", "torch.cat"]),
        ({"offset": False}, ["positions do not count the cached ones", "W_pos[start"]),
        ({"mask": "top_left"}, ["wrong keys", "causal_mask(q_len, k_len)"]),
        ({"mask": "is_causal"}, ["wrong keys", "is_causal=True"]),
        ({"mask": "none_with_cache"}, ["3 new tokens after 8", "wrong keys"]),
    ],
)
def test_kv_cache_bugs_are_named(knob, words):
    fails(check_kv_cache, cached_forward(**knob), *words)


def test_kv_cache_with_an_unnamed_bug_says_which_call_and_position():
    def off_with_a_cache(model, tokens, cache=None):
        logits, longer = forward_with_cache(model, tokens, cache)
        return (logits if cache is None else logits + 1e-3), longer

    where = "position 5, in the call with 1 new token after 5 cached ones"
    fails(check_kv_cache, off_with_a_cache, where, "as in model(tokens)")


def test_kv_cache_that_returns_the_old_cache_is_caught():
    def keeps_old(model, tokens, cache=None):
        logits, longer = forward_with_cache(model, tokens, cache)
        return logits, longer if cache is None else cache

    fails(check_kv_cache, keeps_old, "not appended")


def test_kv_cache_that_is_not_pairs_of_tensors_is_named():
    def listed_keys(model, tokens, cache=None):
        logits, pairs = forward_with_cache(model, tokens, cache)
        return logits, [(k.tolist(), v) for k, v in pairs]

    fails(check_kv_cache, listed_keys, "a pair (keys, values)", "got [['list', (2, 2, 5, 8)]")

    def keys_only(model, tokens, cache=None):
        logits, pairs = forward_with_cache(model, tokens, cache)
        return logits, [k for k, _ in pairs]

    fails(check_kv_cache, keys_only, "got [(2, 2, 5, 8), (2, 2, 5, 8)]")

    def numbers(model, tokens, cache=None):
        return forward_with_cache(model, tokens, cache)[0], [1, 2]

    fails(check_kv_cache, numbers, "got ['int', 'int']")


# Hugging Face's weights.


def _convert(*, transpose=False, order="QKV", heads="(head d)", drop=(), copied=""):
    """A conversion written out as a learner would, with one thing wrong at a time: Conv1D
    weights transposed, c_attn's thirds in another `order`, the heads split as `heads`, the
    keys whose names contain one of `drop` left out, and `copied` "KQ": K's taken from Q's."""

    def convert(hf, *, n_layers, n_heads):
        conv = (lambda w: w.T) if transpose else (lambda w: w)
        split = lambda t, pattern: einops.rearrange(t, pattern.replace("H", heads), head=n_heads)
        state = {
            "embed.W_E": hf["transformer.wte.weight"],
            "pos_embed.W_pos": hf["transformer.wpe.weight"],
            "ln_final.w": hf["transformer.ln_f.weight"],
            "ln_final.b": hf["transformer.ln_f.bias"],
            "unembed.W_U": hf["lm_head.weight"].T,
            "unembed.b_U": torch.zeros_like(hf["lm_head.weight"][:, 0]),
        }
        for i in range(n_layers):
            src, dst = f"transformer.h.{i}.", f"blocks.{i}."
            weights = dict(zip(order, map(conv, hf[src + "attn.c_attn.weight"].chunk(3, dim=1))))
            biases = dict(zip(order, hf[src + "attn.c_attn.bias"].chunk(3)))
            for part in (weights, biases) if copied else ():
                part[copied[0]] = part[copied[1]]
            for x in "QKV":
                state[f"{dst}attn.W_{x}"] = split(weights[x], "m H -> head m d")
                state[f"{dst}attn.b_{x}"] = split(biases[x], "H -> head d")
            state[dst + "attn.W_O"] = split(conv(hf[src + "attn.c_proj.weight"]), "H m -> head d m")
            state[dst + "attn.b_O"] = hf[src + "attn.c_proj.bias"]
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                state[f"{dst}{ours}.w"] = hf[f"{src}{theirs}.weight"]
                state[f"{dst}{ours}.b"] = hf[f"{src}{theirs}.bias"]
            for ours, theirs in (("in", "c_fc"), ("out", "c_proj")):
                state[f"{dst}mlp.W_{ours}"] = conv(hf[f"{src}mlp.{theirs}.weight"])
                state[f"{dst}mlp.b_{ours}"] = hf[f"{src}mlp.{theirs}.bias"]
        return {k: v for k, v in state.items() if not any(part in k for part in drop)}

    return convert


def test_weight_conversion_reference_and_a_written_out_one_pass(capsys):
    check_weight_conversion(convert_hf_gpt2_state_dict)
    check_weight_conversion(_convert())
    assert capsys.readouterr().out.count("passes every check") == 2


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"transpose": True}, ["W_Q", "don't transpose"]),
        ({"order": "KQV"}, ["`W_Q` holds c_attn's K part", "[Q | K | V]"]),
        ({"order": "QVK"}, ["`W_K` holds c_attn's V part"]),
        ({"copied": "KQ"}, ["`W_K` holds c_attn's Q part"]),
        ({"order": "VKQ"}, ["`W_Q` holds c_attn's V part"]),
        ({"heads": "(d head)"}, ["W_Q", "(head d_head), heads outermost"]),
        ({"drop": ("attn.b_", "mlp.b_")}, ["missing", "every bias counts"]),
        ({"drop": (".ln",)}, ["missing", "layer norms have gains and biases"]),
        ({"drop": ("unembed",)}, ["unembed.W_U", "tied to its embedding"]),
    ],
)
def test_weight_conversion_mistakes_are_named(knob, words):
    fails(check_weight_conversion, _convert(**knob), *words)


def test_weight_conversion_with_an_untransposed_lm_head_or_float32_is_named():
    def lm_head_as_is(hf, *, n_layers, n_heads):
        state = convert_hf_gpt2_state_dict(hf, n_layers=n_layers, n_heads=n_heads)
        return {**state, "unembed.W_U": hf["lm_head.weight"]}

    fails(check_weight_conversion, lm_head_as_is, "unembed.W_U", "lm_head.weight transposed")

    def float32(hf, *, n_layers, n_heads):
        state = convert_hf_gpt2_state_dict(hf, n_layers=n_layers, n_heads=n_heads)
        return {k: v.float() for k, v in state.items()}

    fails(check_weight_conversion, float32, "float32 tensor", "dtype")

    def blank(hf, *, n_layers, n_heads):
        raise NotImplementedError("Exercise 6.12: convert the weights")

    fails(check_weight_conversion, blank, "not implemented", "Exercise 6.12")


# The validation loss.


def _estimate(*, evaluate=True, no_grad=True, restore=True, mean=True, batches=None, own=True):
    """An estimate_loss written out, with one thing wrong at a time."""

    def estimate(model, data, *, batch_size, n_ctx, n_batches, generator=None):
        was_training = model.training
        if evaluate:
            model.eval()
        with torch.set_grad_enabled(not no_grad):
            losses = [
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                for x, y in (
                    sample_batch(data, batch_size, n_ctx, generator=generator if own else None)
                    for _ in range(batches or n_batches)
                )
            ]
        if restore:
            model.train(was_training)
        elif evaluate:
            model.train()
        return sum(losses) / (len(losses) if mean else 1)

    return estimate


def test_estimate_loss_reference_and_a_written_out_one_pass(capsys):
    check_estimate_loss(estimate_loss)
    check_estimate_loss(_estimate())
    assert capsys.readouterr().out.count("passes every check") == 2


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"evaluate": False}, ["train mode", "dropout", "evaluating(model)"]),
        ({"no_grad": False}, ["gradients were tracked", "torch.no_grad()"]),
        ({"restore": False}, ["came in eval mode and left in train mode", "restore"]),
        ({"mean": False}, ["n_batches=3", "take their mean"]),
        ({"batches": 1}, ["n_batches=3", "not just the first"]),
        ({"own": False}, ["generator=generator"]),
    ],
)
def test_estimate_loss_mistakes_are_named(knob, words):
    fails(check_estimate_loss, _estimate(**knob), *words)


def test_estimate_loss_that_returns_a_tensor_is_named():
    def tensor(model, data, **options):
        return torch.tensor(estimate_loss(model, data, **options))

    fails(check_estimate_loss, tensor, "returned a float32 tensor", "item()")


# The cosine schedule.


def _cosine(*, warm=1, ahead=0, floor=True, clamp=True, period=1.0):
    def cosine(step, *, lr, warmup_steps, max_steps, min_lr=0.0):
        if step < warmup_steps:
            return lr * (step + warm) / warmup_steps
        progress = (step - warmup_steps + ahead) / max(1, max_steps - warmup_steps)
        progress = min(progress, 1.0) if clamp else progress
        low = min_lr if floor else 0.0
        return low + (lr - low) * (1 + math.cos(period * math.pi * progress)) / 2

    return cosine


def test_cosine_lr_reference_and_a_written_out_one_pass(capsys):
    check_cosine_lr(cosine_lr)
    check_cosine_lr(_cosine())
    assert capsys.readouterr().out.count("passes every check") == 2


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"warm": 0}, ["at step 0", "steps count from 0"]),
        ({"ahead": 1}, ["(step - warmup_steps) / (max_steps - warmup_steps)"]),
        ({"floor": False}, ["decay to min_lr, not to zero"]),
        ({"clamp": False}, ["at step 11", "clamp the progress"]),
        ({"period": 2.0}, ["half a cosine"]),
    ],
)
def test_cosine_lr_mistakes_are_named(knob, words):
    fails(check_cosine_lr, _cosine(**knob), *words)


def test_cosine_lr_that_divides_by_a_zero_warmup_or_returns_a_tensor_is_named():
    def divides(step, *, lr, warmup_steps, max_steps, min_lr=0.0):
        warm = min(1.0, (step + 1) / warmup_steps)  # ZeroDivisionError without a warmup
        options = dict(lr=lr, warmup_steps=warmup_steps, max_steps=max_steps, min_lr=min_lr)
        return cosine_lr(step, **options) if warm == 1.0 else lr * warm

    fails(check_cosine_lr, divides, "warmup_steps=0", "ZeroDivisionError")

    def tensor(step, **options):
        return torch.tensor(cosine_lr(step, **options))

    fails(check_cosine_lr, tensor, "returned a float32 tensor", "return a float")


# The training loop.


def _loop(
    *,
    zero=True,
    lr_shift=0,
    lr_late=False,
    groups="all",
    clip="before",
    best="copy",
    evals="",
    train=True,
    eval_mode=True,
):
    """A train_loop written out (no train_step), with one thing wrong at a time."""

    def loop(model, optimizer, get_batch, evaluate, *, max_steps, lr_at, eval_every, grad_clip=1.0):
        history = History()
        for step in range(max_steps):
            if not lr_late:
                for group in optimizer.param_groups[: 1 if groups == "first" else None]:
                    group["lr"] = lr_at(step + lr_shift)
            if train:
                model.train()
            tokens, targets = get_batch(step)
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
            if zero:
                optimizer.zero_grad()
            loss.backward()
            if clip == "before" and grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            if clip == "after" and grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            if lr_late:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(step)
            history.step.append(step)
            history.train_loss.append(loss.item())
            history.lr.append(lr_at(step))
            due = step % eval_every == 0 if evals == "from_zero" else (step + 1) % eval_every == 0
            if due or (evals != "no_final" and step + 1 == max_steps):
                if not train:
                    model.eval()  # and never back to train mode
                if eval_mode:
                    with evaluating(model):
                        val_loss = evaluate(model)
                else:
                    val_loss = evaluate(model)
                history.evals.append({"step": step + 1, "val_loss": val_loss})
                so_far = history.best.get("val_loss", math.inf)
                lower = val_loss <= so_far if best == "later on a tie" else val_loss < so_far
                if best == "last" or lower:
                    history.best = {"step": step + 1, "val_loss": val_loss}
                    state = model.state_dict()
                    history.best_state = state if best == "live" else copy.deepcopy(state)
        return history

    return loop


def test_train_loop_reference_and_a_written_out_one_pass(capsys):
    check_train_loop(train_loop)
    check_train_loop(_loop())
    assert capsys.readouterr().out.count("passes every check") == 2


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"zero": False}, ["gradients accumulated", "zero_grad()"]),
        ({"lr_shift": 1}, ["rate the optimizer used at step 0", "not lr_at(step + 1)"]),
        ({"lr_late": True}, ["rate the optimizer used at step 0", "before the step"]),
        ({"groups": "first"}, ["parameter groups", "every group"]),
        ({"clip": "after"}, ["grad_clip=0.05", "before optimizer.step()"]),
        ({"clip": "never"}, ["grad_clip=0.05", "before optimizer.step()"]),
        ({"best": "live"}, ["best_state", ".clone()"]),
        ({"best": "last"}, ["History.best", "not the last"]),
        ({"evals": "no_final"}, ["evaluation", "after the last step too"]),
        ({"evals": "from_zero"}, ["evaluation 0: expected 3, got 1", "(step + 1) % eval_every"]),
        ({"train": False}, ["eval mode, without dropout", "model.train()"]),
    ],
)
def test_train_loop_mistakes_are_named(knob, words):
    fails(check_train_loop, _loop(**knob), *words)


def test_train_loop_that_keeps_the_later_of_two_equal_losses_passes():
    check_train_loop(_loop(best="later on a tie"))  # `<=`: a tie is free


def test_train_loop_that_leaves_the_model_in_eval_mode_is_named():
    def ends_in_eval(*args, **options):
        history = train_loop(*args, **options)
        args[0].eval()
        return history

    fails(check_train_loop, ends_in_eval, "left in eval mode after the loop", "train mode")


def test_train_loop_that_drops_grad_clip_is_named():
    def default_clip(model, optimizer, get_batch, evaluate, **options):
        options.pop("grad_clip")
        return train_loop(model, optimizer, get_batch, evaluate, **options)  # clips at 1.0

    fails(check_train_loop, default_clip, "grad_clip=0.05", "before optimizer.step()")


def test_train_loop_that_evaluates_in_train_mode_is_named():
    fails(check_train_loop, _loop(eval_mode=False), "evaluated in train mode", "evaluating(model)")


def test_train_loop_history_that_is_not_numbers_is_named():
    def rates_not_kept(*args, **kwargs):
        history = train_loop(*args, **kwargs)
        history.lr = [None] * len(history.lr)
        return history

    fails(check_train_loop, rates_not_kept, "History.lr", "[None, None")


# The model and its stages against Hugging Face's.


def test_gpt2_whose_parts_are_named_otherwise_is_told_the_names():
    class Renamed(GPT2):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.final_norm = self.ln_final
            del self.ln_final

    fails(check_gpt2_forward, Renamed, "reference weights do not load", "ln_final")


def test_against_huggingface_passes_a_converted_model_and_names_the_stage_that_differs(capsys):
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    sizes = dict(n_layer=3, n_head=2, n_embd=16, n_positions=10, vocab_size=29)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFConfig(**sizes, bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(29, (2, 10), generator=torch.Generator().manual_seed(1))
    model = GPT2.from_huggingface(hf)
    check_against_huggingface(model, hf, tokens)
    assert "block 1" in capsys.readouterr().out
    with torch.no_grad():
        model.blocks[1].mlp.b_out += 0.1
    against = lambda model: check_against_huggingface(model, hf, tokens)
    fails(against, model, "block 1", "differs by up to 0.1", "TransformerBlock")


def test_against_huggingface_names_a_forward_that_returns_no_logits():
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    class Tupled(GPT2):
        def forward(self, tokens):
            return (super().forward(tokens),)

    sizes = dict(n_layer=2, n_head=2, n_embd=16, n_positions=10, vocab_size=29)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFConfig(**sizes, bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(29, (2, 10), generator=torch.Generator().manual_seed(1))
    against = lambda model: check_against_huggingface(model, hf, tokens)
    fails(against, Tupled.from_huggingface(hf), "logits", "expected shape (2, 10, 29), got tuple")


def test_generate_with_one_top_k_threshold_for_the_whole_batch_is_named():
    def batch_threshold(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, **options):
        if top_k is None:
            return generate(model, tokens, max_new_tokens, temperature=temperature, **options)
        with evaluating(model):
            for _ in range(max_new_tokens):
                logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1] / temperature
                kth = logits.flatten().topk(top_k).values[-1]  # one for the whole batch
                probs = logits.masked_fill(logits < kth, -math.inf).softmax(-1)
                tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
        return tokens

    fails(check_generate, batch_threshold, "top_k=3, four different prompts", "one per row")


def test_pos_embed_without_the_batch_dim_is_told_so():
    class NoBatch(PosEmbed):
        def forward(self, tokens):
            return self.W_pos[: tokens.shape[1]]

    fails(check_pos_embed, NoBatch, "got (7, 16)", "leading dims (3,) are missing")
