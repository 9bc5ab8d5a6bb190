"""The chapter 7 checkers (`checks.llama`): the reference passes, valid alternatives pass, a blank
fails with its hint, and each classic mistake is named (each written out here as a small variant
of the reference, as a learner would write it)."""

from __future__ import annotations

import math

import einops
import pytest
import torch
import torch.nn.functional as F
from checking import fails

from transformer_course import llama, optim, rope
from transformer_course.checks.llama import (
    check_adamw,
    check_clip_grad_norm,
    check_cross_entropy,
    check_grouped_query_attention,
    check_llama,
    check_llama_block,
    check_rope_angles,
    check_rotary_embedding,
    check_rotate_pairs,
    check_silu,
    check_swiglu,
)
from transformer_course.encoder_decoder import sinusoidal_positional_encoding
from transformer_course.masking import causal_mask
from transformer_course.runtime import upcast

CHECKS = {  # checker: (the reference, its name in the ✓ line)
    check_rope_angles: (rope.rope_angles, "rope_angles"),
    check_rotate_pairs: (rope.rotate_pairs, "rotate_pairs"),
    check_rotary_embedding: (rope.RotaryEmbedding, "RotaryEmbedding"),
    check_silu: (llama.silu, "silu"),
    check_swiglu: (llama.SwiGLU, "SwiGLU"),
    check_grouped_query_attention: (llama.GroupedQueryAttention, "GroupedQueryAttention"),
    check_llama_block: (llama.LlamaBlock, "LlamaBlock"),
    check_llama: (llama.Llama, "Llama"),
    check_cross_entropy: (optim.cross_entropy, "cross_entropy"),
    check_clip_grad_norm: (optim.clip_grad_norm, "clip_grad_norm"),
    check_adamw: (optim.AdamW, "AdamW"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_reference_passes(check, capsys):
    reference, name = CHECKS[check]
    check(reference)
    assert f"✓ {name} passes every check" in capsys.readouterr().out


def blank(*args, **kwargs):
    raise NotImplementedError("Exercise 7.x: write it (hints below the cell)")


def learner(base: type, **methods) -> type:
    """The reference class with the learner's methods: what a workbook cell defines."""
    return type(f"Learner{base.__name__}", (base,), methods)


@pytest.mark.parametrize(
    "check, candidate",
    [
        (check_rope_angles, blank),
        (check_rotary_embedding, learner(rope.RotaryEmbedding, forward=blank)),
        (check_grouped_query_attention, learner(llama.GroupedQueryAttention, forward=blank)),
        (check_llama, learner(llama.Llama, forward=blank)),
        (check_adamw, learner(optim.AdamW, _update=blank)),
    ],
)
def test_blank_fails_with_its_hint(check, candidate):
    fails(check, candidate, "not implemented", "Exercise 7.x")


# RoPE


def angles_with(bug=""):
    def rope_angles(positions, d_head, theta=10000.0):
        theta = 10000.0 if bug == "fixed theta" else theta
        two_i = torch.arange(0, d_head, 2).float() / (2 if bug == "i" else 1)
        exponent = two_i / (d_head / 2 if bug == "over" else d_head)
        freqs = theta ** (exponent if bug == "sign" else -exponent)
        p = torch.arange(positions.shape[-1]) if bug == "ignored" else positions + (bug == "off")
        angles = p.float()[..., None] * freqs
        return angles.double() if bug == "float64" else angles

    return rope_angles


def test_rope_angles_alternative_passes():
    def in_float64(positions, d_head, theta=10000.0):
        freqs = torch.exp(
            -math.log(theta) * torch.arange(0, d_head, 2, dtype=torch.float64) / d_head
        )
        return (positions[..., None] * freqs).float()

    check_rope_angles(in_float64)


@pytest.mark.parametrize(
    "bug, word",
    [
        ("sign", "negative exponent"),
        ("i", "2i, the pair's first dim"),
        ("over", "divides by d_head"),
        ("ignored", "positions ignored"),
        ("off", "off by one"),
        ("fixed theta", "theta is an argument"),
        ("float64", "float32"),
    ],
)
def test_rope_angles_mistakes_are_named(bug, word):
    fails(check_rope_angles, angles_with(bug), word)


def pairs_with(bug=""):
    def rotate_pairs(x, cos, sin):
        y = x if bug == "in x's dtype" else upcast(x)
        cos, sin = (cos.to(x.dtype), sin.to(x.dtype)) if bug == "in x's dtype" else (cos, sin)
        a, b = y.chunk(2, dim=-1) if bug == "halves" else (y[..., 0::2], y[..., 1::2])
        sin = -sin if bug == "other way" else sin
        turned = (a * cos - b * sin, a * sin + b * cos)
        if bug in ("halves", "interleaved"):
            return torch.cat(turned, dim=-1).to(x.dtype)
        out = torch.stack(turned, dim=-1).flatten(-2)
        if bug == "in place":
            return x.copy_(out)
        return out if bug == "float32 out" else out.to(x.dtype)

    return rotate_pairs


def test_rotate_pairs_alternatives_pass():
    """Complex numbers, as Meta's code; and a bfloat16 rotation done in bfloat16 is close enough."""

    def complex_numbers(x, cos, sin):
        pairs = torch.view_as_complex(upcast(x).double().unflatten(-1, (-1, 2)).contiguous())
        turned = pairs * torch.complex(cos.double(), sin.double())
        return torch.view_as_real(turned).flatten(-2).to(x.dtype)

    check_rotate_pairs(complex_numbers)
    check_rotate_pairs(pairs_with("in x's dtype"))


@pytest.mark.parametrize(
    "bug, word",
    [
        ("halves", "wrong pairing"),
        ("other way", "other way"),
        ("interleaved", "interleaved back wrongly"),
        ("float32 out", "x's dtype"),
        ("in place", "in place"),
    ],
)
def test_rotate_pairs_mistakes_are_named(bug, word):
    fails(check_rotate_pairs, pairs_with(bug), word)


def rotary_with(bug=""):
    def forward(self, x, positions=None, *, offset=0):
        if bug != "unchecked" and positions is None and offset + x.shape[-2] > self.n_ctx:
            raise ValueError(f"offset: {offset} + {x.shape[-2]} positions past n_ctx={self.n_ctx}")
        if positions is None or bug == "positions ignored":
            start = 0 if bug == "offset ignored" else offset + (bug == "off by one")
            return rope.rotate_pairs(
                x, *(t[start : start + x.shape[-2]] for t in (self.cos, self.sin))
            )
        return rope.rotate_pairs(x, self.cos[positions], self.sin[positions])

    return learner(rope.RotaryEmbedding, forward=forward)


def test_rotary_embedding_alternative_passes():
    def forward(self, x, positions=None, *, offset=0):
        if positions is None:
            positions = torch.arange(offset, offset + x.shape[-2])
        if positions.max() >= self.n_ctx:
            raise ValueError(f"positions: expected below n_ctx={self.n_ctx}")
        return rope.apply_rope(x, positions, self.theta)

    check_rotary_embedding(learner(rope.RotaryEmbedding, forward=forward))
    check_rotary_embedding(rotary_with())


@pytest.mark.parametrize(
    "bug, word",
    [
        ("offset ignored", "not offset under a KV cache"),
        ("positions ignored", "positions ignored"),
        ("off by one", "the first of the pos rows is self.cos[offset]"),
    ],
)
def test_rotary_embedding_mistakes_are_named(bug, word):
    fails(check_rotary_embedding, rotary_with(bug), word)


def test_rotary_embedding_without_its_range_check_is_caught():
    fails(check_rotary_embedding, rotary_with("unchecked"), "offset=32", "ValueError")


def test_float32_inside_for_float64_inputs_is_told_precision_not_formula():
    def rotate_in_float32(x, cos, sin):
        return rope.rotate_pairs(x.float(), cos.float(), sin.float())

    fails(check_rotate_pairs, rotate_in_float32, "float32 output", "precision", "float64 here")

    def cross_entropy_in_float32(logits, targets):
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())

    fails(check_cross_entropy, cross_entropy_in_float32, "float32 output", "precision")


def test_rotary_embedding_past_its_tables_or_returning_nothing_is_named():
    def past_the_tables(self, x, positions=None, *, offset=0):
        rows = slice(offset, offset + x.shape[-2]) if positions is None else positions
        cos, sin, (a, b) = self.cos[rows], self.sin[rows], (x[..., 0::2], x[..., 1::2])
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

    past = learner(rope.RotaryEmbedding, forward=past_the_tables)
    fails(check_rotary_embedding, past, "offset=32", "refuse offset + pos > n_ctx")
    nothing = learner(rope.RotaryEmbedding, forward=lambda self, x, positions=None, offset=0: None)
    fails(check_rotary_embedding, nothing, "RotaryEmbedding.forward(x)", "got None")


# SiLU, SwiGLU


def test_silu_alternative_passes():
    check_silu(lambda x: x / (1 + torch.exp(-x)))


@pytest.mark.parametrize(
    "fn, word",
    [
        (torch.sigmoid, "sigmoid(x) alone"),
        (lambda x: x * torch.tanh(x), "tanh"),
        (F.gelu, "GELU"),
        (lambda x: F.silu(x.double()), "dtype"),
        (lambda x: x.mul_(torch.sigmoid(x)), "in place"),
        (lambda x: F.silu(x.float()).to(x.dtype), "differ"),  # float64 computed in float32
    ],
)
def test_silu_mistakes_are_named(fn, word):
    fails(check_silu, fn, word)


def swiglu_with(post):
    def forward(self, x):
        gate, linear = self.hook_pre(x @ self.W_gate), self.hook_pre_linear(x @ self.W_in)
        return self.hook_post(post(gate, linear)) @ self.W_out

    return learner(llama.SwiGLU, forward=forward)


def test_swiglu_alternative_passes():
    check_swiglu(swiglu_with(lambda gate, linear: F.silu(gate) * linear))


@pytest.mark.parametrize(
    "post, word",
    [
        (lambda gate, linear: gate * F.silu(linear), "wrong branch"),
        (lambda gate, linear: F.silu(gate) * F.silu(linear), "both branches"),
        (lambda gate, linear: F.silu(gate * linear), "after the product"),
        (lambda gate, linear: F.silu(linear), "no gate"),
    ],
)
def test_swiglu_mistakes_are_named(post, word):
    fails(check_swiglu, swiglu_with(post), word)


def test_swiglu_that_discards_what_a_hook_returns_is_named():
    def forward(self, x):
        gate, linear = x @ self.W_gate, x @ self.W_in
        self.hook_pre(gate), self.hook_pre_linear(linear)
        return self.hook_post(F.silu(gate) * linear) @ self.W_out

    fails(check_swiglu, learner(llama.SwiGLU, forward=forward), "hook_pre", "returns")


def test_swiglu_for_three_dims_only_is_named():
    def forward(self, x):
        gate = self.hook_pre(einops.einsum(x, self.W_gate, "b p m, m f -> b p f"))
        linear = self.hook_pre_linear(einops.einsum(x, self.W_in, "b p m, m f -> b p f"))
        return self.hook_post(F.silu(gate) * linear) @ self.W_out

    fails(check_swiglu, learner(llama.SwiGLU, forward=forward), "(5, 16)", "leading dims")


def test_swiglu_with_a_hook_fed_the_wrong_tensor_is_named():
    def forward(self, x):
        gate, linear = self.hook_pre(F.silu(x @ self.W_gate)), self.hook_pre_linear(x @ self.W_in)
        return self.hook_post(gate * linear) @ self.W_out

    fails(check_swiglu, learner(llama.SwiGLU, forward=forward), "hook_pre", "before silu")


# Grouped-query attention


class BuggyGQA(llama.GroupedQueryAttention):
    """Grouped-query attention written out (the fused path with SDPA's enable_gqa), one bug."""

    bug = ""

    def forward(self, x, *, cache=None):
        bug, positions = self.bug, torch.arange(x.shape[1])
        if cache is not None and cache.k is not None and bug != "from zero":
            positions = positions + cache.k.shape[-2]

        def turn(t):  # RoPE on (batch, pos, head, d_head)
            return rope.apply_rope(t.transpose(1, 2), positions, self.rotary.theta).transpose(1, 2)

        q, k, v = (
            einops.einsum(x, W, "b p m, h m d -> b p h d") for W in (self.W_Q, self.W_K, self.W_V)
        )
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        q = self.hook_rot_q(turn(q))
        k = self.hook_rot_k(k if bug == "keys not turned" else turn(k))
        v = turn(v) if bug == "values turned" else v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # heads first
        group = self.n_heads // self.n_kv_heads
        if bug == "repeated before the cache":
            k, v, group = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), 1
        if bug == "unrotated cache":  # cache the keys before RoPE, then turn them all from 0
            k_raw = einops.einsum(x, self.W_K, "b p m, h m d -> b h p d")
            k, v = cache.extend(k_raw, v) if cache is not None else (k_raw, v)
            k = rope.apply_rope(k, torch.arange(k.shape[-2]), self.rotary.theta)
        elif cache is not None:
            k, v = cache.extend(k, v)
        mask = causal_mask(q.shape[-2], k.shape[-2])
        if self.fast_path and bug != "fast path ignored":
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            order = "(group kv)" if bug == "wrong order" else "(kv group)"
            k, v = (einops.repeat(t, f"b kv p d -> b {order} p d", group=group) for t in (k, v))
            scores = q @ k.mT / (1.0 if bug == "unscaled" else math.sqrt(self.d_head))
            scores = scores if bug == "no mask" else scores.masked_fill(~mask, -math.inf)
            z = self.hook_pattern(scores.softmax(-1)) @ v
        z = self.hook_z(z.transpose(1, 2))
        return einops.einsum(z, self.W_O, "b p h d, h d m -> b p m")


def gqa_with(bug=""):
    return type(f"GQA_{bug or 'ok'}", (BuggyGQA,), {"bug": bug})


def test_gqa_alternative_passes(capsys):
    check_grouped_query_attention(gqa_with())
    assert "✓ GroupedQueryAttention passes every check" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, words",
    [
        ("values turned", ["n_kv_heads=4", "RoPE applied to the values"]),
        ("keys not turned", ["RoPE not applied to the keys"]),
        ("wrong order", ["n_kv_heads=2", "wrong order", "h // group"]),
        ("from zero", ["through a KV cache", "not offset under a KV cache"]),
        ("no mask", ["no causal mask"]),
        ("unscaled", ["sqrt(d_head)"]),
        ("repeated before the cache", ["cached keys", "keeps n_kv_heads"]),
        ("unrotated cache", ["the cached keys", "after RoPE"]),
        ("fast path ignored", ["fast_path=True", "hook_pattern ran", "_attend_fused"]),
    ],
)
def test_gqa_mistakes_are_named(bug, words):
    fails(check_grouped_query_attention, gqa_with(bug), *words)


# The block and the model


def block_with(bug=""):
    def forward(self, x, *, cache=None):
        x = self.hook_resid_pre(x)
        if bug == "post-norm":
            x = self.ln1(x + self.attn(x, cache=cache))
            return self.ln2(x + self.mlp(x))
        if bug == "stream normalised":
            x = self.ln1(x)
            x = self.ln2(x + self.attn(x, cache=cache))
            return x + self.mlp(x)
        attn_out = self.hook_attn_out(
            self.attn(self.ln1(x), cache=None if bug == "no cache" else cache)
        )
        mid = self.hook_resid_mid(x + attn_out)
        mlp_out = self.hook_mlp_out(self.mlp(self.ln2(x if bug == "mlp reads x" else mid)))
        return self.hook_resid_post(mid + mlp_out)

    return learner(llama.LlamaBlock, forward=forward)


def test_llama_block_alternative_passes():
    check_llama_block(block_with())


@pytest.mark.parametrize(
    "bug, word",
    [
        ("post-norm", "post-norm"),
        ("stream normalised", "residual stream itself is normalised"),
        ("mlp reads x", "the MLP reads the block input"),
        ("no cache", "not passed to attention"),
    ],
)
def test_llama_block_mistakes_are_named(bug, word):
    fails(check_llama_block, block_with(bug), word)


def llama_with(bug=""):
    def forward(self, tokens):
        residual = self.hook_embed(self.embed.W_E[tokens])  # indexing: as good as embed(tokens)
        if bug == "position embedding":
            positions = sinusoidal_positional_encoding(tokens.shape[1], self.cfg.d_model)
            residual = residual + positions.to(residual.dtype)
        for block in self.blocks:
            residual = block(residual)
        residual = residual if bug == "no final norm" else self.ln_final(residual)
        if bug in ("always W_E", "always W_U"):
            return residual @ (self.embed.W_E.T if bug == "always W_E" else self.unembed.W_U)
        return self.unembed(residual)

    return learner(llama.Llama, forward=forward)


def test_llama_alternative_passes(capsys):
    check_llama(llama_with())
    assert "✓ Llama passes every check" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bug, words",
    [
        ("no final norm", ["final norm is forgotten"]),
        ("position embedding", ["hook_resid_pre", "no position embedding"]),
        ("always W_E", ["tie=False", "tied unembedding"]),
        ("always W_U", ["tie=True", "raised AttributeError", "may be tied"]),
    ],
)
def test_llama_mistakes_are_named(bug, words):
    fails(check_llama, llama_with(bug), *words)


def test_llama_that_differs_from_hugging_face_only_is_caught():
    """A model right against the reference but wrong on Hugging Face's weights: one whose
    `from_huggingface` keeps Hugging Face's halves layout of W_Q and W_K."""

    @classmethod
    def from_huggingface(cls, hf_model):
        model = llama.Llama.from_huggingface.__func__(cls, hf_model)
        with torch.no_grad():
            for block in model.blocks:
                for W in (block.attn.W_Q, block.attn.W_K):
                    W.copy_(rope.adjacent_to_halves(W))
        return model

    fails(check_llama, learner(llama.Llama, from_huggingface=from_huggingface), "from_huggingface")


# The training step by hand


def xent_with(bug=""):
    def cross_entropy(logits, targets):
        x, dim = (
            {"in bfloat16": logits, "always float32": logits.float()}.get(bug, upcast(logits)),
            1 if bug == "wrong dim" else -1,
        )
        if bug != "overflow":
            x = x - x.amax(dim, keepdim=True).detach()
        log_probs = x * (bug != "no target") - x.exp().sum(dim, keepdim=True).log()
        losses = log_probs.gather(-1, targets[..., None]) * (1 if bug == "sign" else -1)
        return losses.sum() if bug == "sum" else losses.mean()

    return cross_entropy


def test_cross_entropy_alternatives_pass():
    def logsumexp(logits, targets):
        x = logits.float() if logits.dtype == torch.bfloat16 else logits
        return (x.logsumexp(-1) - x.gather(-1, targets[..., None])[..., 0]).mean()

    check_cross_entropy(logsumexp)
    check_cross_entropy(xent_with())


@pytest.mark.parametrize(
    "bug, word",
    [
        ("sum", "sum instead of mean"),
        ("wrong dim", "wrong dim"),
        ("no target", "target logit is not subtracted"),
        ("sign", "sign is flipped"),
        ("overflow", "exp overflows"),
        ("in bfloat16", "compute in float32"),
        ("always float32", "differ"),
    ],
)
def test_cross_entropy_mistakes_are_named(bug, word):
    fails(check_cross_entropy, xent_with(bug), word)


def clip_with(bug=""):
    def clip_grad_norm(parameters, max_norm):
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        params = params if bug == "generator read twice" else list(params)
        norms = torch.stack([p.grad.norm() for p in params if p.grad is not None])
        total = norms.sum() if bug == "sum" else norms.norm()
        for p, norm in zip((p for p in params if p.grad is not None), norms):
            factor = max_norm / ((norm if bug == "per parameter" else total) + 1e-6)
            p.grad.mul_(factor if bug == "no cap" else factor.clamp(max=1.0))
        if bug == "after":
            return torch.stack([p.grad.norm() for p in params if p.grad is not None]).norm()
        return total

    return clip_grad_norm


def test_clip_grad_norm_alternative_passes():
    check_clip_grad_norm(clip_with())


@pytest.mark.parametrize(
    "bug, word",
    [
        ("per parameter", "clipped on its own"),
        ("no cap", "no cap at 1"),
        ("after", "measured before"),
        ("sum", "sum of norms"),
        ("generator read twice", "generator"),
    ],
)
def test_clip_grad_norm_mistakes_are_named(bug, word):
    fails(check_clip_grad_norm, clip_with(bug), word)


def adamw_with(bug="", torch_style=False):
    def _update(self, param, group):
        lr = self.defaults["lr"] if bug == "fixed lr" else group["lr"]
        settings = self.defaults if bug == "defaults" else group
        (beta1, beta2), eps, decay = settings["betas"], settings["eps"], settings["weight_decay"]
        if bug == "own state":  # kept where state_dict() does not look
            self.__dict__.setdefault("mine", {})
        state = self.mine.setdefault(param, {}) if bug == "own state" else self.state[param]
        if not state:
            state.update(step=0, m=torch.zeros_like(param), v=torch.zeros_like(param))
        state["step"] += 1
        t, m, v, g = state["step"], state["m"], state["v"], param.grad
        c1, c2 = (1.0, 1.0) if bug == "no bias correction" else (1 - beta1**t, 1 - beta2**t)
        if bug == "l2":
            g = g + decay * param
        elif bug != "after":
            param.mul_(1 - lr * decay / (c1 if bug == "corrected decay" else 1.0))
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if torch_style:  # PyTorch's way of writing the same step
            param.addcdiv_(m, v.sqrt() / math.sqrt(c2) + eps, value=-lr / c1)
        else:
            denom = (v / c2 + eps).sqrt() if bug == "eps inside" else (v / c2).sqrt() + eps
            param.sub_(lr * (m / c1) / denom)
        if bug == "after":
            param.mul_(1 - lr * decay)

    return learner(optim.AdamW, _update=_update)


def test_adamw_alternatives_pass():
    check_adamw(adamw_with())
    check_adamw(adamw_with(torch_style=True))


@pytest.mark.parametrize(
    "bug, word",
    [
        ("no bias correction", "bias correction missing"),
        ("corrected decay", "applied to the weight decay"),
        ("l2", "Adam with L2"),
        ("after", "decay comes after the update"),
        ("eps inside", "eps inside the square root"),
        ("fixed lr", "lr not read from the group"),
        ("defaults", "group['betas'], not self.defaults"),
        ("own state", "self.state[param]"),
    ],
)
def test_adamw_mistakes_are_named(bug, word):
    fails(check_adamw, adamw_with(bug), word)
