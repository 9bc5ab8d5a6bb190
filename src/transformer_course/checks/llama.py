"""Checkers for chapter 7's workbook (07_llama): RoPE (its angles, the rotation of pairs, the
module with its tables), SiLU and SwiGLU, grouped-query attention with a KV cache, the Llama
block and model (also against Hugging Face's `LlamaForCausalLM`), and the training step's
cross-entropy, gradient clipping and AdamW by hand against PyTorch's own."""

from __future__ import annotations

import functools
from collections.abc import Callable

import einops
import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course import llama, rope
from transformer_course.attention import LayerCache
from transformer_course.checks.attention import SCALE_HINT
from transformer_course.checks.harness import (
    call,
    describe,
    expect,
    expect_cached,
    expect_close,
    expect_hooks,
    expect_raises,
    expect_unchanged,
    load_reference_weights,
    matches,
    passed,
    perturb,
    randn,
    seeded,
    shape_of,
)

# d_model 16, 2 layers, 4 heads, 2 KV heads, d_head 6, d_mlp 24, d_vocab 37, n_ctx 16: d_head
# is not d_model // n_heads and RoPE's base not 10000, so that neither can be assumed.
CFG = llama.LlamaConfig(16, 2, 4, 2, 6, 24, 37, 16, rope_theta=100.0)
HF_SIZES = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2)
HF_SIZES |= dict(num_attention_heads=4, head_dim=6, max_position_embeddings=16)  # CFG's
HF_SIZES["rope_parameters"] = {"rope_type": "default", "rope_theta": 100.0}
CUTS = (3, 4, 5)  # where a KV cache's calls cut 7 positions: a prompt, two single tokens, two
FROM_ZERO = torch.cat([torch.arange(len(p)) for p in torch.arange(7).tensor_split(CUTS)])
GQA_OPTIONS = dict(n_ctx=16, rope_theta=100.0)
THETA = "theta in the wrong place: pair i turns by p * theta^(-2i / d_head): "
ANGLE_MISTAKES = {
    THETA + "a negative exponent, so the frequencies fall with i.": dict(sign=1),
    THETA + "2i, the pair's first dim (arange(0, d_head, 2)), not i.": dict(two=1),
    THETA + "the exponent divides by d_head, not d_head / 2.": dict(over=2),
    "positions ignored: multiply by the positions given, not by arange(pos).": dict(arange=True),
    "off by one: use the positions as given (position 0 turns by 0).": dict(shift=1),
    "theta is an argument: use it, not a fixed 10000.": dict(theta=1e4),
}
PAIR_MISTAKES = {
    "the wrong pairing: dims 2i and 2i+1 turn together; dim i with dim i + d_head/2 is "
    "Hugging Face's rotate_half layout.": dict(split="halves", join="halves"),
    "that turns the other way: (a, b) -> (a cos - b sin, a sin + b cos).": dict(sign=-1),
    "each pair is interleaved back wrongly: pair i goes back to dims 2i and 2i+1 (stack on a "
    "new last dim, then flatten), not to i and i + d_head/2.": dict(join="halves"),
}
SWIGLU_MISTAKES = {  # the hint: the neurons it gives from the gate x W_gate and linear x W_in
    "the gate is on the wrong branch: silu(x W_gate) * (x W_in).": lambda g, u: g * F.silu(u),
    "silu on both branches: x W_in stays linear.": lambda g, u: F.silu(g) * F.silu(u),
    "silu after the product: silu(x W_gate), then times x W_in.": lambda g, u: F.silu(g * u),
    "no gate: multiply silu(x W_gate) by the linear branch x W_in.": lambda g, u: F.silu(u),
}
SWIGLU_HOOKS = {
    "hook_pre": "pass x W_gate, the gate before silu, through self.hook_pre.",
    "hook_pre_linear": "pass x W_in, the linear branch, through self.hook_pre_linear.",
    "hook_post": "pass silu(x W_gate) * (x W_in), before W_out, through self.hook_post.",
}
GQA_MISTAKES = {  # the hint: the knobs of `_gqa` that give it
    "RoPE applied to the values: it turns the queries and the keys only.": dict(rotate="qkv"),
    "RoPE not applied to the keys: turn them too, so q·k sees their distance.": dict(rotate="q"),
    "KV heads repeated in the wrong order: query head h reads KV head h // group, so repeat "
    "each KV head group times in a row: '(kv_head group)'.": dict(order="(group kv)"),
    "no causal mask: a position attends to itself and earlier positions only.": dict(causal=False),
    SCALE_HINT: dict(scale=1.0),
}
GQA_HINT = "q, k, v = x W_Q, x W_K, x W_V; RoPE on q and k; query head h reads KV head h // group;"
GQA_HINT += " causal softmax(q k^T / sqrt(d_head)) @ v; then W_O."
CACHE_HINT = "rotate the new q and k at positions start, start + 1, ... (start: the cached ones), "
CACHE_HINT += "k, v = cache.extend(k, v), then attend with a causal mask (q_pos, k_pos)."
START_HINT = "positions not offset under a KV cache: the new tokens come after the cached ones, "
START_HINT += "self._rotate(t, start) with start = cache.k.shape[-2] once the cache holds keys."
FUSED_HINT = "self.fast_path picks the path: self._attend_fused(q, k, v) when it is set, else "
FUSED_HINT += "self._attend(q, k, v), whose pattern passes hook_pattern."
GQA_HOOKS = {
    "hook_q": "pass x W_Q, before RoPE, (batch, pos, head, d_head), through self.hook_q.",
    "hook_k": "pass x W_K, before RoPE, with n_kv_heads heads, through self.hook_k.",
    "hook_v": "pass x W_V, with n_kv_heads heads, through self.hook_v.",
    "hook_rot_q": "pass the queries after RoPE through self.hook_rot_q.",
    "hook_rot_k": "pass the keys after RoPE, n_kv_heads heads, through self.hook_rot_k.",
    "hook_pattern": "the causal softmax of q k^T / sqrt(d_head), (batch, head, q_pos, k_pos).",
    "hook_z": "pass pattern @ v, as (batch, pos, head, d_head), through self.hook_z.",
}
XENT_MISTAKES = {
    "sum instead of mean: average over every position.": dict(reduce="sum"),
    "log_softmax over the wrong dim: over the vocabulary, the last dim.": dict(dim=1),
    "the target logit is not subtracted: logsumexp(x) - x[t].": dict(target=0.0),
    "the sign is flipped: the loss is minus the log-probability of the target.": dict(sign=1.0),
}
OVERFLOW = "exp overflows past 88 in float32 (inf, then NaN): subtract each row's max before exp "
OVERFLOW += "(the log-sum-exp trick): log(sum(exp(x - m))) - (x[t] - m)."
CLIP_MISTAKES = {
    "each parameter clipped on its own: one factor for all, from the norm of all the "
    "gradients as one vector.": dict(per_param=True),
    "no cap at 1: gradients whose norm is already below max_norm were scaled up; they stay "
    "as they are.": dict(cap=False),
    "the norm after clipping is returned: return the norm measured before.": dict(after=True),
    "the sum of norms is not the global L2 norm: sqrt(sum of squared norms).": dict(total="sum"),
}
CLIP_HINT = "one factor for every gradient, from the norm of all of them as one vector, and "
CLIP_HINT += "never above 1; list(parameters) first: it may be a generator."
NO_GRAD = "skip the parameters whose .grad is None."
ADAMW_MISTAKES = {
    "bias correction missing: m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t), "
    "t from 1.": dict(bias=False),
    "the bias correction is applied to the weight decay: it corrects m and v only; decay "
    "by lr * weight_decay * p.": dict(decay="corrected"),
    "weight decay through the gradient (g + weight_decay * p) is Adam with L2: AdamW decays "
    "the weights apart from it, p -= lr * weight_decay * p.": dict(decay="l2"),
    "the decay comes after the update: decay p first, then the Adam step.": dict(decay="after"),
    "eps inside the square root: divide by sqrt(v_hat) + eps.": dict(eps_in=True),
    "lr not read from the group: a loop sets group['lr'] every step.": dict(decay="fixed lr"),
}
STEPS, START, GRADS = 50, randn(17, seed=1), randn(50, 17, seed=2)  # a (3, 4) and a (5,), flat
ADAMW_HINT = "p *= 1 - lr * weight_decay; update m and v; p -= lr * m_hat / (sqrt(v_hat) + eps); "
ADAMW_HINT += "every hyperparameter read from `group`."
GROUPS = [  # two parameter groups' own settings: the second takes betas and eps from AdamW's
    dict(lr=0.1, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.5),
    dict(lr=0.1, weight_decay=0.0),
]


def _angles(positions, d_head, theta=1e4, *, sign=-1, two=2, over=1, shift=0, arange=False):
    """`p * theta^(-2i / d_head)` in float64, with the knobs a mistake turns."""
    p = (torch.arange(positions.shape[-1]) if arange else positions).double() + shift
    i = torch.arange(d_head // 2, dtype=torch.float64)
    return p[..., None] * theta ** (sign * two * i / (d_head / over))


def check_rope_angles(fn: Callable) -> None:
    """`rope_angles(positions, d_head, theta=10000.0)`: float32 (..., pos, d_head / 2), 1e-5."""
    hint = "the angle of pair i at position p is p * theta^(-2i / d_head), i < d_head / 2."
    float32 = "compute the angles in float32 (positions.float()), as Meta and Hugging Face do."
    for positions, d_head, theta in [  # theta None: its default
        (torch.tensor([5, 0, 3, 9, 2]), 8, None),
        (torch.tensor([[0, 1, 2], [7, 4, 11]]), 6, 500.0),
        (torch.arange(4), 4, 2.5),
    ]:
        args, given = (positions, d_head, theta)[: 2 + bool(theta)], dict(theta=theta or 1e4)
        where = f"rope_angles({', '.join(map(str, (positions.tolist(), *args[1:])))})"
        actual, problem = call(where, fn, *args), "expected float32 angles."
        expect(getattr(actual, "dtype", None) == torch.float32, where, problem, float32)
        wrong = {h: _angles(positions, d_head, **{**given, **k}) for h, k in ANGLE_MISTAKES.items()}
        expected = _angles(positions, d_head, **given).float()
        expect_close(actual, expected, where, hint, atol=1e-5, rtol=1e-5, mistakes=wrong)
    passed("rope_angles")


def _turn(x, cos, sin, *, sign=1, split="pairs", join="pairs"):
    """Each pair (a, b) of `x` turned to (a cos - b sin, a sin + b cos), with a mistake's knobs."""
    a, b = (x[..., 0::2], x[..., 1::2]) if split == "pairs" else x.chunk(2, dim=-1)
    turned = (a * cos - sign * b * sin, sign * a * sin + b * cos)
    return torch.stack(turned, -1).flatten(-2) if join == "pairs" else torch.cat(turned, -1)


def check_rotate_pairs(fn: Callable) -> None:
    """`rotate_pairs(x, cos, sin)` against complex numbers: 1e-10 in float64; half precision."""
    name, x, angles = "rotate_pairs", randn(2, 3, 5, 8, seed=1), 3 * randn(5, 4, seed=2)
    cos, sin = angles.cos(), angles.sin()
    pairs = torch.view_as_complex(einops.rearrange(x, "... (half two) -> ... half two", two=2))
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    wrong = {h: _turn(x, cos, sin, **k) for h, k in PAIR_MISTAKES.items()}
    hint = "pair i, (a, b) = (x[2i], x[2i+1]), becomes (a cos - b sin, a sin + b cos)."
    given = x.clone()
    actual = call(name, fn, given, cos, sin)
    expect_close(actual, expected, name, hint, atol=1e-10, rtol=1e-10, mistakes=wrong)
    expect_unchanged(name, given, x)
    hint = "compute in float32 (upcast(x)), return x's dtype."
    for dtype in (torch.bfloat16, torch.float16):
        where = f"{name} ({str(dtype)[6:]} x, float32 cos and sin)"
        actual = call(where, fn, x.to(dtype), cos.float(), sin.float())
        problem = f"returned {describe(actual)}."
        expect(getattr(actual, "dtype", None) == dtype, where, problem, hint)
        expect_close(actual, expected.to(dtype), where, hint, atol=3e-2, rtol=2e-2)
    passed(name)


def check_rotary_embedding(cls: type) -> None:
    """`RotaryEmbedding(...).forward(x, positions=None, *, offset=0)`: `apply_rope`'s, 1e-6."""
    not_offset = "positions not offset under a KV cache: without `positions`, x sits at "
    not_offset += "positions offset, offset + 1, ...: the rows self.cos[offset : offset + pos]."
    ignored = "explicit positions ignored: rotate by self.cos[positions], self.sin[positions]."
    one_off = "off by one: the first of the pos rows is self.cos[offset], position 0 at offset 0."
    name, theta, x = "RotaryEmbedding", 500.0, randn(2, 3, 6, 8, seed=1)
    module = call(f"{name}.__init__", cls, 8, 32, theta).double()  # its tables stay float32
    given, arange = torch.tensor([4, 0, 9, 2, 2, 7]), torch.arange(6)
    for label, kwargs, hint in [
        ("x", {}, "rotate_pairs(x, ...) with the rows self.cos[:pos], self.sin[:pos]."),
        ("x, offset=5", {"offset": 5}, not_offset),
        (f"x, positions={given.tolist()}", {"positions": given}, ignored),
        ("x, positions (2, 1, 6)", {"positions": given + torch.arange(2)[:, None, None]}, ignored),
    ]:
        positions = kwargs.get("positions", arange + kwargs.get("offset", 0))
        wrong = {one_off: rope.apply_rope(x, positions + 1, theta)}
        wrong |= {hint: rope.apply_rope(x, arange, theta)} if kwargs else {}
        where, expected = f"{name}.forward({label})", rope.apply_rope(x, positions, theta)
        actual = call(where, module, x, **kwargs)
        expect_close(actual, expected, where, hint, atol=1e-6, mistakes=wrong)
    q, k = randn(2, 2, 10, 8, seed=2).unbind(0)
    scores = lambda m, n: call(name, module, q, offset=m) @ call(name, module, k, offset=n).mT
    base, where = scores(0, 0).detach(), f"{name}(q at positions m.., k at n..)"
    relative = "RoPE turns q and k by their positions, so q·k depends only on m - n."
    atol = 1e-4 * float(base.abs().max())  # the rounding of float32 angles (measured 1e-7)
    expect_close(scores(7, 7), base, f"{where}, m = n = 7", relative, atol=atol)
    moved = matches(scores(3, 0), base, atol)
    expect(not moved, f"{where}, m = 3, n = 0", "the scores did not change.", not_offset)
    hint = "the tables end at position n_ctx - 1: refuse offset + pos > n_ctx with a ValueError "
    hint += "that says so, rather than rotating by missing rows."
    for past, offset in ((x[..., :1, :], 32), (x, 30)):  # positions up to 32 and 35
        where = f"{name}(n_ctx=32).forward(x of {past.shape[-2]} positions, offset={offset})"
        beyond = functools.partial(module, offset=offset)
        expect_raises(where, hint, beyond, past, errors=(ValueError,))
    passed(name)


def check_silu(fn: Callable) -> None:
    """`silu(x)` against `F.silu`: 1e-12 in float64; float32 and bfloat16 kept, to 1e-2."""
    mistakes = {
        "that is sigmoid(x) alone: SiLU multiplies it by x, x * sigmoid(x).": torch.sigmoid,
        "tanh is not the sigmoid: SiLU is x * sigmoid(x).": lambda x: x * torch.tanh(x),
        "that is GELU, x times the normal CDF; SiLU uses the sigmoid: x * sigmoid(x).": F.gelu,
    }
    name, x = "silu", torch.linspace(-30, 30, 240, dtype=torch.float64).reshape(2, 3, 40)
    hint = "x * torch.sigmoid(x): sigmoid stays finite where exp(-x) overflows."
    wrong, given = {h: f(x) for h, f in mistakes.items()}, x.clone()
    actual = call(name, fn, given)
    expect_close(actual, F.silu(x), name, hint, atol=1e-12, rtol=1e-12, mistakes=wrong)
    expect_unchanged(name, given, x)
    for dtype in (torch.float32, torch.bfloat16):
        where, y = f"{name} ({str(dtype)[6:]} x from -120 to 120)", (4 * x).to(dtype)
        actual = call(where, fn, y)
        problem = f"expected a result in x's dtype, got {describe(actual)}."
        expect(getattr(actual, "dtype", None) == dtype, where, problem, hint)
        expect_close(actual, F.silu(y), where, hint, atol=1e-2, rtol=1e-2)
    passed(name)


def check_swiglu(cls: type) -> None:
    """`SwiGLU(d_model, d_mlp)`: W_out(silu(x W_gate) * (x W_in)), 1e-10 in float64, hooks."""
    name, x, sizes = "SwiGLU", randn(2, 5, CFG.d_model, seed=2), (CFG.d_model, CFG.d_mlp)
    reference = perturb(llama.SwiGLU(*sizes).double(), seed=1, scale=0.5)
    mlp = call(f"{name}.__init__", cls, *sizes).double()
    load_reference_weights(name, mlp, reference, "W_gate, W_in, W_out (no biases)")
    W = {key: value.detach() for key, value in reference.named_parameters()}
    gate, linear = x @ W["W_gate"], x @ W["W_in"]
    wrong = {h: f(gate, linear) @ W["W_out"] for h, f in SWIGLU_MISTAKES.items()}
    expected, hint = (F.silu(gate) * linear) @ W["W_out"], "W_out(silu(x W_gate) * (x W_in))."
    expect_close(call(name, mlp, x), expected, name, hint, atol=1e-10, rtol=1e-10, mistakes=wrong)
    where, hint = f"{name}(x of shape (5, {CFG.d_model}))", "'...' for any leading dims of x."
    actual = call(where, mlp, x[0], hint=hint)
    expect_close(actual, expected[0], where, hint, atol=1e-10, rtol=1e-10)
    expect_hooks(name, mlp, reference, SWIGLU_HOOKS, x)
    passed(name)


def _gqa(attn, x, positions=None, *, rotate="qk", order="(kv group)", causal=True, scale=None):
    """`attn`'s output by other means (`apply_rope`, SDPA), with the knobs a mistake turns."""
    positions = torch.arange(x.shape[1]) if positions is None else positions
    turn, group = lambda t: rope.apply_rope(t, positions, attn.rotary.theta), attn.n_heads
    qkv = (x[:, None] @ W for W in (attn.W_Q, attn.W_K, attn.W_V))  # (batch, head, pos, d_head)
    q, k, v = (turn(t) if c in rotate else t for c, t in zip("qkv", qkv))
    kv = (einops.repeat(t, f"b kv p d -> b {order} p d", group=group // t.shape[1]) for t in (k, v))
    z = F.scaled_dot_product_attention(q, *kv, is_causal=causal, scale=scale)
    return (z @ attn.W_O).sum(1)


def check_grouped_query_attention(cls: type) -> None:
    """`GroupedQueryAttention(...).forward(x, *, cache=None)`: 4, 2, 1 KV heads, 1e-8, float64."""
    name, x = "GroupedQueryAttention", randn(2, 7, 16, seed=1)
    pieces = x.tensor_split(CUTS, dim=1)  # a KV cache's calls
    for n_kv_heads in (4, 2, 1):
        where, sizes = f"{name}(n_heads=4, n_kv_heads={n_kv_heads})", (16, 4, n_kv_heads, 6)
        reference = perturb(llama.GroupedQueryAttention(*sizes, **GQA_OPTIONS).double(), 1, 0.5)
        module = call(f"{where}.__init__", cls, *sizes, **GQA_OPTIONS).double()
        load_reference_weights(where, module, reference, "W_Q, W_K, W_V, W_O")
        with torch.no_grad():
            expected, wrong_start = reference(x), {START_HINT: _gqa(reference, x, FROM_ZERO)}
            wrong = {h: _gqa(reference, x, **k) for h, k in GQA_MISTAKES.items()}
            keys = x[:, None] @ reference.W_K  # (batch, kv_head, pos, d_head), then RoPE
            keys = rope.apply_rope(keys, torch.arange(x.shape[1]), GQA_OPTIONS["rope_theta"])
        for fast in (False, True):
            module.fast_path, at = fast, f"{where}, fast_path={fast}"
            expect_close(call(at, module, x), expected, at, GQA_HINT, atol=1e-8, mistakes=wrong)
            hooked = "hook_pattern" in call(at, module.run_with_cache, x)[1]
            problem = f"hook_pattern {'ran' if hooked else 'did not run'}."
            expect(hooked != fast, at, problem, FUSED_HINT)
            cache, at = LayerCache(), f"{at}, through a KV cache in 4 calls"
            out = torch.cat([call(at, module, piece, cache=cache) for piece in pieces], dim=1)
            expect_close(out, expected, at, CACHE_HINT, atol=1e-8, mistakes=wrong_start)
            shape, got = tuple(keys.shape), shape_of(cache.k)
            hint = "extend the cache before repeating the KV heads: it keeps n_kv_heads of them."
            expect(got == shape, at, f"the cached keys are {got}; expected {shape}.", hint)
            hint = "cache the keys after RoPE, each turned once at its own position."
            expect_close(cache.k, keys, f"{at}, the cached keys", hint, atol=1e-8)
        module.fast_path = False
        expect_hooks(where, module, reference, GQA_HOOKS, x)
    passed(name)


def check_llama_block(cls: type) -> None:
    """`LlamaBlock(cfg).forward(x, *, cache=None)`: pre-norm, 1e-8 in float64, hooks, a cache."""
    hooks = {
        "hook_resid_pre": "pass the block's input x through self.hook_resid_pre.",
        "hook_attn_out": "pass what attention adds, attn(ln1(x)), through self.hook_attn_out.",
        "hook_resid_mid": "pass x + attn(ln1(x)) through self.hook_resid_mid.",
        "hook_mlp_out": "pass what the MLP adds, mlp(ln2(resid_mid)), through self.hook_mlp_out.",
        "hook_resid_post": "pass resid_mid + mlp(ln2(resid_mid)) through self.hook_resid_post.",
    }
    no_cache = "the cache is not passed to attention: self.attn(self.ln1(x), cache=cache)."
    name, x = "LlamaBlock", randn(2, 7, CFG.d_model, seed=1)
    torch.manual_seed(0)
    reference = perturb(llama.LlamaBlock(CFG).double(), seed=1)
    block = call(f"{name}.__init__", cls, CFG).double()
    load_reference_weights(name, block, reference, "ln1, attn, ln2, mlp")
    attn, mlp, ln1, ln2 = reference.attn, reference.mlp, reference.ln1, reference.ln2
    with torch.no_grad():
        mid, post, normed = x + attn(ln1(x)), ln1(x + attn(x)), ln2(ln1(x) + attn(ln1(x)))
        mistakes = {
            "post-norm: normalise the sublayers' inputs, not their sums.": ln2(post + mlp(post)),
            "the residual stream itself is normalised: add attn(ln1(x)) to x, "
            "not to ln1(x).": normed + mlp(normed),
            "the MLP reads the block input: mlp(ln2(x + attn(ln1(x)))).": mid + mlp(ln2(x)),
        }
        expected = reference(x)
    hint = "pre-norm: each sublayer reads its own normalised copy of the stream and adds its "
    hint += "output to the stream itself; the attention first, then the MLP."
    expect_close(call(name, block, x), expected, name, hint, atol=1e-8, mistakes=mistakes)
    expect_hooks(name, block, reference, hooks, x)
    expect_cached(f"{name}, a KV cache", block, reference, x, CUTS, no_cache)
    passed(name)


def check_llama(cls: type) -> None:
    """`Llama(cfg).forward(tokens)`, tied or not: 1e-8 against the reference in float64, 1e-4
    against Hugging Face's (its RMSNorm computes in float32: measured 2e-6)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    no_pos = "Llama has no position embedding (RoPE turns q and k inside attention), and its "
    no_pos += "unembedding may be tied (no W_U): embed, the blocks, ln_final, then self.unembed."
    hooks = {"hook_embed": "pass embed(tokens) through self.hook_embed."}
    hooks["blocks.0.hook_resid_pre"] = "the first block reads embed(tokens) itself. " + no_pos
    name, tokens = "Llama", torch.randint(CFG.d_vocab, (2, 9), generator=seeded(2))
    hint = "embed(tokens), each block in turn, ln_final, then self.unembed."
    for tie in (False, True):
        cfg, where = llama.LlamaConfig(**{**vars(CFG), "tie_embeddings": tie}), f"{name}(tie={tie})"
        torch.manual_seed(0)
        reference = perturb(llama.Llama(cfg).double(), seed=1).eval()
        model = call(f"{where}.__init__", cls, cfg).double().eval()
        load_reference_weights(where, model, reference, "embed, blocks, ln_final, unembed")
        with torch.no_grad():
            actual = call(where, model, tokens, hint=no_pos)
            residual = torch.nn.Sequential(*reference.blocks)(reference.embed(tokens))
            mistakes = {
                "the final norm is forgotten: apply ln_final first.": reference.unembed(residual),
                "the tied unembedding ignored or forced: self.unembed uses W_U, or W_E when "
                "tied.": reference.ln_final(residual) @ reference.embed.W_E.T,
            }
        expect_hooks(where, model, reference, hooks, tokens)
        expect_close(actual, reference(tokens), where, hint, atol=1e-8, mistakes=mistakes)
    for n_kv_heads, tie in ((2, False), (1, True)):
        where = f"{name}.from_huggingface(LlamaForCausalLM, n_kv_heads={n_kv_heads}, tie={tie})"
        config = LlamaConfig(**HF_SIZES, num_key_value_heads=n_kv_heads, tie_word_embeddings=tie)
        torch.manual_seed(0)
        hf = perturb(LlamaForCausalLM(config).double(), seed=n_kv_heads).eval()
        model = call(where, cls.from_huggingface, hf).eval()
        with torch.no_grad():
            actual, expected = call(where, model, tokens), hf(tokens).logits
        expect_close(actual, expected, where, hint, atol=1e-4, rtol=1e-4)
    passed(name)


def _xent(logits, targets, *, dim=-1, target=1.0, sign=-1.0, reduce="mean"):
    """Cross-entropy in float64, with the knobs a mistake turns."""
    x = logits.detach().double()
    x = x - x.amax(dim, keepdim=True)  # the log-sum-exp trick, as the workbook writes it
    log_probs = x * target - x.logsumexp(dim, keepdim=True)
    return getattr(sign * log_probs.gather(-1, targets[..., None]), reduce)()


def check_cross_entropy(fn: Callable) -> None:
    """`cross_entropy(logits, targets)` and its gradient against `F.cross_entropy`."""
    name, logits = "cross_entropy", (3 * randn(2, 5, 11, seed=1)).requires_grad_()
    targets, where = torch.randint(11, (2, 5), generator=seeded(2)), f"{name}(logits (2, 5, 11))"
    ours = lambda logits, targets: F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    wrong = {h: _xent(logits, targets, **k) for h, k in XENT_MISTAKES.items()}
    loss, hint = call(where, fn, logits, targets), "the mean of logsumexp(x) - x[target]."
    expect_close(loss, ours(logits, targets), where, hint, atol=1e-10, rtol=1e-10, mistakes=wrong)
    keep = "build the loss from logits with torch operations (no .item(), no .detach())."
    call(f"{where}.backward()", loss.backward, hint=keep)
    (grad,) = torch.autograd.grad(ours(logits, targets), logits)
    expect_close(logits.grad, grad, f"{where}, the gradient", keep, atol=1e-10)
    big, targets = 1e4 * randn(3, 7, seed=3, dtype=torch.float32), torch.tensor([0, 6, 2])
    where = f"{name}(float32 logits of size 1e4)"
    expect_close(call(where, fn, big, targets), ours(big, targets), where, OVERFLOW, atol=1e-2)
    half, targets = (3 * randn(2, 5, 100, seed=4)).bfloat16(), torch.arange(10).reshape(2, 5)
    where, expected = f"{name}(bfloat16 logits)", ours(half.float(), targets)
    hint = "compute in float32 (upcast(logits)) and return that loss: bfloat16 keeps 8 bits."
    expect_close(call(where, fn, half, targets), expected, where, hint, atol=1e-4, rtol=1e-4)
    passed(name)


def _clip(grads, max_norm, *, per_param=False, cap=True, after=False, total="l2"):
    """The norm returned and the clipped gradients, flat, with the knobs a mistake turns."""
    norms = torch.stack([g.norm() for g in grads])
    norm = norms.sum() if total == "sum" else norms.norm()
    factors = (max_norm / ((norms if per_param else norm) + 1e-6)).expand(len(grads))
    clipped = [g * f for g, f in zip(grads, factors.clamp(max=1.0) if cap else factors)]
    norm = torch.stack([g.norm() for g in clipped]).norm() if after else norm
    return torch.cat([norm[None], *(g.flatten() for g in clipped)])


def check_clip_grad_norm(fn: Callable) -> None:
    """`clip_grad_norm(parameters, max_norm)` against `clip_grad_norm_`: 1e-10 in float64."""
    flat = lambda norm, params: torch.cat([norm.reshape(1), *(p.grad.flatten() for p in params)])
    for label, max_norm, count, given in [  # how many of the parameters, passed how
        ("3 parameters, one without a gradient, norm 11", 1.0, 3, list),
        ("a generator of them, as model.parameters()", 5.0, 3, iter),
        ("a single tensor, norm 10", 100.0, 1, lambda params: params[0]),
    ]:
        where = f"clip_grad_norm({label}, max_norm={max_norm})"
        ours, theirs = ([torch.nn.Parameter(randn(n, seed=n)) for n in (12, 5, 3)] for _ in "ab")
        for param in ours[:2] + theirs[:2]:  # the third has no gradient
            param.grad = 3 * randn(param.numel(), seed=param.numel() + 1)
        grads = [param.grad.clone() for param in ours[:count][:2]]
        norm = call(where, fn, given(ours[:count]), max_norm, hint=NO_GRAD)
        problem, hint = f"returned {describe(norm)}.", "return the norm, a 0-dim tensor."
        expect(isinstance(norm, Tensor) and norm.numel() == 1, where, problem, hint)
        expect(ours[2].grad is None, where, "a parameter without a gradient got one.", NO_GRAD)
        expected = torch.nn.utils.clip_grad_norm_(given(theirs[:count]), max_norm)
        wrong = {h: _clip(grads, max_norm, **k) for h, k in CLIP_MISTAKES.items()}
        where, actual = f"{where}: the norm, then the gradients", flat(norm, ours[:count][:2])
        expected = flat(expected, theirs[:count][:2])
        expect_close(actual, expected, where, CLIP_HINT, atol=1e-10, rtol=1e-10, mistakes=wrong)
    passed("clip_grad_norm")


def _adamw(p, grads, lrs, *, lr, betas, eps, weight_decay, bias=True, decay="", eps_in=False):
    """AdamW's parameters (flat) after each step, with the knobs a mistake turns."""
    (beta1, beta2), m, v, out = betas, torch.zeros_like(p), torch.zeros_like(p), []
    for t, (g, step_lr) in enumerate(zip(grads, lrs), start=1):
        step_lr = lr if decay == "fixed lr" else step_lr
        c1, c2 = (1 - beta1**t, 1 - beta2**t) if bias else (1.0, 1.0)
        g = g + weight_decay * p if decay == "l2" else g
        if decay not in ("l2", "after"):
            p = p * (1 - step_lr * weight_decay / (c1 if decay == "corrected" else 1.0))
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        p = p - step_lr * m / c1 / ((v / c2 + eps).sqrt() if eps_in else (v / c2).sqrt() + eps)
        out.append(p := p * (1 - step_lr * weight_decay) if decay == "after" else p)
    return torch.stack(out)


def _trajectory(where: str, make: Callable, hyper: dict, lrs=(), groups=(), resume_at=None):
    """The parameters (flat) after each step of `make(params, **hyper)`, each parameter in its
    own group if `groups` gives their settings; the first group's lr set to `lrs` as a schedule
    does; at step `resume_at`, a new optimizer loaded from the old one's `state_dict()`."""
    params = [torch.nn.Parameter(t.clone()) for t in (START[:12].view(3, 4), START[12:])]
    given = [dict(params=[p], **s) for p, s in zip(params, groups)] if groups else params
    new = lambda: call(f"{where}.__init__", make, given, **hyper)
    optimizer, out = new(), []
    for step, grad in enumerate(GRADS):
        if step == resume_at:
            state, optimizer = optimizer.state_dict(), new()
            call(f"{where}.load_state_dict", optimizer.load_state_dict, state)
        if lrs:
            optimizer.param_groups[0]["lr"] = lrs[step]
        params[0].grad, params[1].grad = grad[:12].view(3, 4).clone(), grad[12:].clone()
        call(f"{where}.step", optimizer.step)
        out.append(torch.cat([param.detach().flatten() for param in params]))
    return torch.stack(out)


def check_adamw(cls: type) -> None:
    """`AdamW._update(param, group)` against `torch.optim.AdamW`: 1e-10 in float64 (2e-16)."""
    for case in [(0.1, (0.8, 0.95), 1e-3, 0.5), (1e-2, (0.9, 0.999), 1e-8, 1e-2)]:
        hyper = dict(zip(("lr", "betas", "eps", "weight_decay"), case))
        where = f"AdamW({', '.join(f'{k}={v}' for k, v in hyper.items())}), {STEPS} steps"
        lrs = [hyper["lr"] * (1 + step % 4) / 4 for step in range(STEPS)]
        actual = _trajectory(where, cls, hyper, lrs)
        expected = _trajectory("torch.optim.AdamW", torch.optim.AdamW, hyper, lrs)
        wrong = {h: _adamw(START, GRADS, lrs, **hyper, **k) for h, k in ADAMW_MISTAKES.items()}
        where += ", group['lr'] changed every step: the parameters after each step"
        expect_close(actual, expected, where, ADAMW_HINT, atol=1e-10, rtol=1e-10, mistakes=wrong)
    where = "AdamW with two parameter groups, each with its own betas, eps and weight_decay"
    hyper = dict(betas=(0.5, 0.9), eps=1e-2)  # AdamW's own, the second group's
    expected = _trajectory(where, torch.optim.AdamW, hyper, groups=GROUPS)
    hint = "read lr, betas, eps and weight_decay from the group: group['betas'], not self.defaults."
    actual = _trajectory(where, cls, hyper, groups=GROUPS)
    expect_close(actual, expected, where, hint, atol=1e-10, rtol=1e-10)
    where += ", saved with state_dict() half-way and loaded into a new AdamW"
    hint = "keep each parameter's step count and running means in self.state[param], which "
    hint += "state_dict() saves and load_state_dict() restores."
    actual = _trajectory(where, cls, hyper, groups=GROUPS, resume_at=STEPS // 2)
    expect_close(actual, expected, where, hint, atol=1e-10, rtol=1e-10)
    passed("AdamW")
