"""The modern decoder (chapter 7) against Hugging Face's `LlamaForCausalLM`, Meta's complex-number
RoPE and TransformerLens's `GatedMLP`.

Every Hugging Face model is built offline from a small `transformers.LlamaConfig` with seeded
random weights (norm gains too, so a loader that drops or misplaces one fails), and a RoPE base
other than the default, so a config that loses it fails. Tolerances:

- Logits against Hugging Face in float64: max abs diff 1e-10 (measured ~3e-14; logits of
  order 5). Hugging Face's `LlamaRMSNorm` computes in float32 whatever the dtype, which alone
  puts ~5e-6 between float64 models, so the float64 comparisons run it with that cast removed
  (its formula otherwise unchanged; `exact_hf_rmsnorm`). RoPE's angles are float32 on both sides.
- Logits against the unchanged Hugging Face model in float32: 1e-4 (measured ~1e-5).
- KV cache against the full forward, fused against einsum attention: 1e-10 in float64.
- RoPE against Meta's complex-number form: 1e-6 in float64 (measured ~1e-7): the same float32
  angles, but its complex64 e^(i angle) and float32 cos/sin differ in their last bits.
- The adjacent against the halves layout after the permutation, and `apply_rope_halves` against
  Hugging Face's rotation: 1e-12 in float64 (the same float32 cos and sin).
- Shifting every position by the same offset: the scores change by at most 1e-4 of their
  largest value, the rounding of float32 angles up to position ~350 (measured up to 3e-6).
- silu against `F.silu` and SwiGLU against its formula and TransformerLens: 1e-12 in float64.
"""

from __future__ import annotations

import einops
import pytest
import torch
import torch.nn.functional as F
from transformer_lens import HookedTransformerConfig
from transformer_lens.components import GatedMLP
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama

from transformer_course.attention import LayerCache, set_fast_path
from transformer_course.llama import (
    GroupedQueryAttention,
    Llama,
    LlamaBlock,
    LlamaConfig,
    SwiGLU,
    llama_forward_with_cache,
    llama_mlp_size,
    silu,
)
from transformer_course.llama_weights import convert_hf_llama_state_dict
from transformer_course.rope import (
    RotaryEmbedding,
    adjacent_to_halves,
    apply_rope,
    apply_rope_halves,
    halves_to_adjacent,
    rope_angles,
    rotate_half,
    rotate_pairs,
)

VOCAB, N_CTX = 61, 32
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=N_CTX,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100.0},
)
# (num_key_value_heads, tie_word_embeddings, head_dim): GQA, MHA, MQA, and GQA tied.
VARIANTS = {
    "gqa": (2, False, None),
    "mha": (4, False, None),
    "mqa-tied-d_head-12": (1, True, 12),
    "gqa-tied": (2, True, None),
}


def hf_llama(dtype=torch.float64, n_kv_heads=2, tie=False, head_dim=None) -> LlamaForCausalLM:
    config = HFLlamaConfig(
        **SMALL, num_key_value_heads=n_kv_heads, tie_word_embeddings=tie, head_dim=head_dim
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=dtype) * 0.3
            param.copy_(noise + (1.0 if "norm" in name else 0.0))
    return model


def tokens(batch=2, pos=N_CTX, seed=2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def exact_hf_rmsnorm(monkeypatch):
    """Hugging Face's RMSNorm without its cast to float32 (see the module docstring)."""

    def forward(self, hidden_states):
        mean_square = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(mean_square + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


# --- config ----------------------------------------------------------------------------------


def test_config_defaults_and_llama_mlp_size():
    cfg = LlamaConfig()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_vocab, cfg.n_ctx) == (
        768,
        12,
        12,
        50257,
        1024,
    )
    assert (cfg.n_kv_heads, cfg.d_head, cfg.d_mlp) == (12, 64, 2048)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (10000.0, 1e-5, False)
    assert llama_mlp_size(4096) == 10944
    assert llama_mlp_size(4096, multiple_of=256) == 11008  # Llama 2 7B
    assert LlamaConfig(d_model=64, n_heads=4, n_kv_heads=2).d_mlp == 192


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(n_heads=12, n_kv_heads=5), "n_kv_heads"),
        (dict(n_kv_heads=0), "n_kv_heads"),
        (dict(n_heads=4, d_model=32, d_head=7), "d_head"),
        (dict(d_model=30, n_heads=4), "d_model"),
        (dict(rope_theta=0.0), "rope_theta"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(tie_embeddings=1), "tie_embeddings"),
        (dict(d_vocab=0), "d_vocab"),
    ],
)
def test_config_rejects_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LlamaConfig(**kwargs)


def test_config_from_huggingface_reads_every_field():
    hf = HFLlamaConfig(
        vocab_size=70,
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        max_position_embeddings=40,
        rms_norm_eps=1e-4,
        tie_word_embeddings=True,
        initializer_range=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    assert LlamaConfig.from_huggingface(hf) == LlamaConfig(
        d_model=48,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        d_head=10,
        d_mlp=100,
        d_vocab=70,
        n_ctx=40,
        rope_theta=500.0,
        norm_eps=1e-4,
        tie_embeddings=True,
        init_range=0.05,
    )


@pytest.mark.parametrize(
    "overrides, word",
    [
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_parameters"),
    ],
)
def test_config_from_huggingface_refuses_what_the_model_does_not_have(overrides, word):
    with pytest.raises(ValueError, match=word):
        LlamaConfig.from_huggingface(HFLlamaConfig(**{**SMALL, **overrides}))


def test_config_from_huggingface_reads_swish_as_silu():
    """Hugging Face maps hidden_act "swish" to the same SiLU."""
    swish = LlamaConfig.from_huggingface(HFLlamaConfig(**SMALL, hidden_act="swish"))
    assert swish == LlamaConfig.from_huggingface(HFLlamaConfig(**SMALL))


# --- the model against Hugging Face ----------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_hugging_face_in_float64(variant, exact_hf_rmsnorm):
    n_kv_heads, tie, head_dim = VARIANTS[variant]
    reference = hf_llama(torch.float64, n_kv_heads, tie, head_dim)
    ours = Llama.from_huggingface(reference).eval()
    assert next(ours.parameters()).dtype == torch.float64
    assert (ours.cfg.n_kv_heads, ours.cfg.tie_embeddings) == (n_kv_heads, tie)
    assert ours.cfg.rope_theta == 100.0
    with torch.no_grad():
        expected, actual = reference(tokens()).logits, ours(tokens())
    assert actual.shape == expected.shape == (2, N_CTX, VOCAB)
    assert (actual - expected).abs().max().item() <= 1e-10


@pytest.mark.parametrize("variant", ["gqa", "mqa-tied-d_head-12"])
def test_matches_hugging_face_in_float32(variant):
    reference = hf_llama(torch.float32, *VARIANTS[variant])
    ours = Llama.from_huggingface(reference).eval()
    with torch.no_grad():
        expected, actual = reference(tokens()).logits, ours(tokens())
    assert (actual - expected).abs().max().item() <= 1e-4


def test_tied_unembedding_is_the_embedding_and_untied_is_its_own():
    tied = Llama.from_huggingface(hf_llama(n_kv_heads=1, tie=True))
    assert tied.unembed.W_E is tied.embed.W_E
    assert sum(p.numel() for p in tied.parameters()) == sum(
        p.numel() for p in hf_llama(n_kv_heads=1, tie=True).parameters()
    )
    untied = Llama.from_huggingface(hf_llama())
    assert all(isinstance(block, LlamaBlock) for block in untied.blocks)
    assert untied.unembed.W_U.shape == (32, VOCAB)
    assert not any(
        name.endswith(("b_U", "b_in", "b_O", "b_Q")) for name, _ in untied.named_parameters()
    )


def test_weight_conversion_names_a_missing_key():
    state = hf_llama().state_dict()
    del state["model.norm.weight"]
    with pytest.raises(TypeError, match="model.norm.weight"):
        convert_hf_llama_state_dict(state, n_layers=2, n_heads=4, n_kv_heads=2)


@pytest.mark.parametrize("not_hf", [torch.nn.Linear(2, 2), {"lm_head.weight": torch.ones(2)}])
def test_from_huggingface_refuses_what_is_not_a_hugging_face_llama(not_hf):
    with pytest.raises(TypeError, match="hf_model"):
        Llama.from_huggingface(not_hf)


# --- attention, hooks, KV cache --------------------------------------------------------------


def test_query_head_h_reads_key_value_head_h_over_group():
    torch.manual_seed(0)
    gqa = GroupedQueryAttention(16, 4, 2, n_ctx=8, init_range=0.5).double()
    mha = GroupedQueryAttention(16, 4, 4, n_ctx=8).double()
    with torch.no_grad():
        mha.W_Q.copy_(gqa.W_Q), mha.W_O.copy_(gqa.W_O)
        mha.W_K.copy_(gqa.W_K.repeat_interleave(2, dim=0))  # heads 0, 1 read kv head 0
        mha.W_V.copy_(gqa.W_V.repeat_interleave(2, dim=0))
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    assert (gqa(x) - mha(x)).abs().max().item() <= 1e-12


def test_hooks_rope_rotates_queries_and_keys_but_never_values():
    model = Llama.from_huggingface(hf_llama())
    _, cache = model.run_with_cache(tokens(pos=10))
    q, k, v = (cache[f"blocks.0.attn.hook_{name}"] for name in "qkv")
    assert (q.shape, k.shape, v.shape) == ((2, 10, 4, 8), (2, 10, 2, 8), (2, 10, 2, 8))
    for name, raw in (("q", q), ("k", k)):
        by_head = einops.rearrange(raw, "batch pos head d -> batch head pos d")
        expected = einops.rearrange(
            apply_rope(by_head, torch.arange(10), 100.0), "batch head pos d -> batch pos head d"
        )
        rotated = cache[f"blocks.0.attn.hook_rot_{name}"]
        assert (rotated - expected).abs().max().item() <= 1e-12
    values = einops.repeat(v, "batch pos kv_head d -> batch (kv_head group) pos d", group=2)
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert pattern.shape == (2, 4, 10, 10)
    assert torch.all(pattern.triu(diagonal=1) == 0)  # causal
    z = einops.rearrange(pattern @ values, "batch head pos d -> batch pos head d")
    assert (z - cache["blocks.0.attn.hook_z"]).abs().max().item() <= 1e-12
    for name in ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out"):
        assert cache[f"blocks.1.{name}"].shape == (2, 10, 32)
    assert cache["blocks.1.mlp.hook_pre_linear"].shape == (2, 10, 88)


@pytest.mark.parametrize("fast_path", [False, True])
def test_kv_cache_gives_the_full_forward_logits(fast_path):
    model = set_fast_path(Llama.from_huggingface(hf_llama(n_kv_heads=2)).eval(), fast_path)
    ids = tokens()
    with torch.no_grad():
        full = model(ids)
        cache, pieces = None, []
        for start, stop in ((0, 5), (5, 6), (6, 7), (7, 20), (20, N_CTX)):
            logits, cache = llama_forward_with_cache(model, ids[:, start:stop], cache)
            pieces.append(logits)
    assert len(cache) == 2 and cache[0][0].shape == (2, 2, N_CTX, 8)  # n_kv_heads, not n_heads
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() <= 1e-10
    with pytest.raises(ValueError, match="tokens.*start a new cache"):
        llama_forward_with_cache(model, ids[:, :1], cache)


def test_kv_cache_from_elsewhere_is_refused_naming_cache():
    """Each block's cache is used as given: one of another length, batch or model, or a cache
    with a block missing, would give wrong logits (zip stops at the shorter list) or a shape
    error deep inside attention."""
    model, ids = Llama.from_huggingface(hf_llama(n_kv_heads=2)).eval(), tokens()
    with torch.no_grad():
        _, three = llama_forward_with_cache(model, ids[:, :3])
        _, five = llama_forward_with_cache(model, ids[:, :5])
        for cache in (three[:1], three + three, [three[0], five[1]], [(None, None)] * 2, []):
            with pytest.raises(ValueError, match=r"cache: expected None or, for each of the 2"):
                llama_forward_with_cache(model, ids[:, 3:4], cache)
        with pytest.raises(ValueError, match=r"batch=1"):
            llama_forward_with_cache(model, ids[:1, 3:4], three)


def test_rope_refuses_what_it_cannot_do_and_indexes_small_int_positions():
    rotary, x = RotaryEmbedding(8, 16), torch.randn(5, 8)
    positions = torch.tensor([0, 3, 9, 2, 15])
    for dtype in (torch.uint8, torch.int8, torch.int16):  # uint8 would index as a mask
        assert torch.equal(rotary(x, positions.to(dtype)), rotary(x, positions))
    with pytest.raises(ValueError, match="offset: expected 0 when positions are given"):
        rotary(x, positions, offset=3)
    with pytest.raises(ValueError, match="d_head"):
        rotate_half(torch.arange(5.0))
    with pytest.raises(ValueError, match=r"d_head \(the last dim of x\).* got 5"):
        rotate_pairs(torch.ones(2, 5), torch.ones(2, 2), torch.ones(2, 2))
    for positions in ([0, 1, 2], torch.tensor(3), torch.arange(3.0), torch.ones(3, dtype=bool)):
        with pytest.raises(ValueError, match="positions: expected an integer"):
            rope_angles(positions, 8)


def test_layers_name_what_is_wrong_with_their_input():
    with pytest.raises(ValueError, match="x: expected dtype torch.float32 .* got torch.float64"):
        SwiGLU(8, 12)(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected shape .* pos >= 1, got shape \(1, 0, 16\)"):
        GroupedQueryAttention(16, 4, 2, n_ctx=8)(torch.randn(1, 0, 16))
    with pytest.raises(ValueError, match="norm_eps"):
        LlamaConfig(16, 1, 4, norm_eps=1e-50)
    config = HFLlamaConfig(**SMALL, initializer_range=0.0)  # unset: not needed to load
    assert LlamaConfig.from_huggingface(config).init_range == 0.02


def test_fast_path_matches_the_einsum_path():
    model = Llama.from_huggingface(hf_llama())
    with torch.no_grad():
        slow = model(tokens())
        fast = set_fast_path(model)(tokens())
    assert (fast - slow).abs().max().item() <= 1e-10


def test_layer_cache_holds_rotated_keys_at_offset_positions():
    torch.manual_seed(0)
    attn = GroupedQueryAttention(16, 4, 1, n_ctx=8).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    layer = LayerCache()
    first, second = attn(x[:, :4], cache=layer), attn(x[:, 4:], cache=layer)
    assert layer.k.shape == (1, 1, 6, 4)
    assert (torch.cat([first, second], dim=1) - attn(x)).abs().max().item() <= 1e-12


@pytest.mark.parametrize(
    "ids, word",
    [
        (torch.full((1, 3), VOCAB), "tokens"),
        (torch.zeros(1, N_CTX + 1, dtype=torch.long), "n_ctx"),
        (torch.zeros(1, 3), "tokens"),
    ],
)
def test_bad_tokens_give_clear_errors(ids, word):
    model = Llama(LlamaConfig(d_model=16, n_layers=1, n_heads=2, d_vocab=VOCAB, n_ctx=N_CTX))
    with pytest.raises((ValueError, TypeError), match=word):
        model(ids)


def test_attention_refuses_n_kv_heads_that_do_not_divide_n_heads():
    with pytest.raises(ValueError, match="n_kv_heads: expected a positive divisor of n_heads=4"):
        GroupedQueryAttention(16, 4, 3)


def test_bf16_close_to_float32():
    model = Llama.from_huggingface(hf_llama(torch.float32)).eval()
    with torch.no_grad():
        expected = model(tokens())
        actual = model.to(torch.bfloat16)(tokens())
    assert actual.dtype == torch.bfloat16
    assert model.blocks[0].attn.rotary.cos.dtype == torch.float32  # the angles stay float32
    assert (actual.float() - expected).abs().max().item() <= 0.05 * expected.abs().max().item()


# --- silu, SwiGLU ----------------------------------------------------------------------------


def test_silu_is_torchs():
    x = torch.linspace(-30, 30, 1001, dtype=torch.float64)
    assert (silu(x) - F.silu(x)).abs().max().item() <= 1e-12
    assert (silu(x.float()) - F.silu(x.float())).abs().max().item() <= 1e-5


def test_swiglu_matches_its_formula_and_transformer_lens():
    torch.manual_seed(0)
    ours = SwiGLU(16, 40, init_range=0.3).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    formula = (F.silu(x @ ours.W_gate) * (x @ ours.W_in)) @ ours.W_out
    assert (ours(x) - formula).abs().max().item() <= 1e-12
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=16, n_ctx=8, d_head=4, d_mlp=40, act_fn="silu", gated_mlp=True
    )
    reference = GatedMLP(cfg).double()
    reference.load_state_dict(
        {**ours.state_dict(), "b_in": torch.zeros(40), "b_out": torch.zeros(16)}
    )
    assert (ours(x) - reference(x)).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="d_model=16"):
        ours(torch.randn(2, 5, 15, dtype=torch.float64))


# --- RoPE ------------------------------------------------------------------------------------


def meta_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's Llama code (`precompute_freqs_cis`, `apply_rotary_emb`): adjacent pairs as complex
    numbers, multiplied by e^(i angle) in complex64 as there; the product in complex128."""
    d_head, pos = x.shape[-1], x.shape[-2]
    freqs = 1.0 / (theta ** (torch.arange(0, d_head, 2)[: d_head // 2].float() / d_head))
    angles = torch.outer(torch.arange(pos).float(), freqs)
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex128)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * freqs_cis).flatten(-2)


def test_rope_angles_and_rotate_pairs_by_hand():
    angles = rope_angles(torch.arange(3), d_head=4, theta=100.0)
    assert torch.allclose(angles, torch.tensor([[0.0, 0.0], [1.0, 0.1], [2.0, 0.2]]))
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # (pos, d_head)
    quarter = torch.tensor([[torch.pi / 2, 0.0]])  # pair 0 turns by 90 degrees, pair 1 not at all
    turned = rotate_pairs(x, quarter.cos(), quarter.sin())
    assert torch.allclose(turned, torch.tensor([[-2.0, 1.0, 3.0, 4.0]]), atol=1e-6)


def test_apply_rope_is_metas_adjacent_pairs_rotation():
    x = torch.randn(2, 3, 20, 16, dtype=torch.float64)
    for theta in (10000.0, 100.0):
        expected = meta_rope(x, theta)
        assert (apply_rope(x, torch.arange(20), theta) - expected).abs().max().item() <= 1e-6


def test_shifting_every_position_leaves_the_scores_unchanged():
    q, k = torch.randn(2, 4, 12, 16, dtype=torch.float64).unbind(0)
    positions = torch.arange(12)

    def scores(q_positions, k_positions):
        return apply_rope(q, q_positions) @ apply_rope(k, k_positions).transpose(-1, -2)

    base = scores(positions, positions)
    for offset in (1, 17, 333):
        shifted = scores(positions + offset, positions + offset)
        assert (shifted - base).abs().max().item() <= 1e-4 * base.abs().max().item()
    # Moving only the queries changes them: the scores see relative positions.
    assert (scores(positions + 3, positions) - base).abs().max().item() > 0.1


def test_adjacent_and_halves_layouts_agree_after_the_permutation():
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    positions = torch.arange(10)
    halves = apply_rope_halves(x, positions, 500.0)
    via_adjacent = adjacent_to_halves(apply_rope(halves_to_adjacent(x), positions, 500.0))
    assert (halves - via_adjacent).abs().max().item() <= 1e-12
    # apply_rope_halves is Hugging Face's rotation, with its cos and sin.
    config = HFLlamaConfig(**{**SMALL, "hidden_size": 64, "num_attention_heads": 4})
    config.rope_parameters["rope_theta"] = 500.0
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(x, positions[None])
    expected, _ = modeling_llama.apply_rotary_pos_emb(x[None], x[None], cos, sin)
    assert (halves - expected[0]).abs().max().item() <= 1e-12
    assert torch.equal(rotate_half(x), torch.cat([-x[..., 8:], x[..., :8]], dim=-1))


def test_permuted_weights_give_hugging_faces_scores():
    """Hugging Face's W_Q and W_K rows (halves layout), permuted by `halves_to_adjacent`, give the
    same scores with adjacent-pair RoPE as the unpermuted ones with Hugging Face's RoPE."""
    n_heads, d_head, d_model = 3, 8, 12
    W_Q, W_K = torch.randn(2, n_heads * d_head, d_model, dtype=torch.float64)
    x = torch.randn(7, d_model, dtype=torch.float64)
    positions = torch.arange(7)

    def scores(W_Q, W_K, rope):
        q, k = (
            einops.rearrange(x @ W.T, "pos (head d) -> head pos d", head=n_heads)
            for W in (W_Q, W_K)
        )
        return rope(q, positions) @ rope(k, positions).transpose(-1, -2)

    theirs = scores(W_Q, W_K, apply_rope_halves)
    ours = scores(
        halves_to_adjacent(W_Q, n_heads, dim=0), halves_to_adjacent(W_K, n_heads, dim=0), apply_rope
    )
    assert (ours - theirs).abs().max().item() <= 1e-12
    W = torch.randn(n_heads * d_head, d_model)
    assert torch.equal(adjacent_to_halves(halves_to_adjacent(W, n_heads, dim=0), n_heads, dim=0), W)
    assert halves_to_adjacent(torch.arange(8.0)).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_rotary_embedding_caches_apply_rope():
    rotary = RotaryEmbedding(16, 40, theta=300.0).double()
    assert rotary.cos.dtype == torch.float32 and rotary.cos.shape == (40, 8)
    assert list(rotary.state_dict()) == []  # nothing to save
    x = torch.randn(2, 3, 9, 16, dtype=torch.float64)
    positions = torch.arange(9) + 5
    expected = apply_rope(x, positions, 300.0)
    assert (rotary(x, positions) - expected).abs().max().item() <= 1e-12
    assert (rotary(x, offset=5) - expected).abs().max().item() <= 1e-12
    half = rotary.to(torch.bfloat16)(x.bfloat16(), offset=5)
    assert half.dtype == torch.bfloat16 and rotary.cos.dtype == torch.float32
    assert (half.double() - expected).abs().max().item() <= 0.05


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda: apply_rope(torch.randn(4, 7), torch.arange(4)), "d_head"),
        (lambda: RotaryEmbedding(7, 16), "d_head"),
        (lambda: apply_rope(torch.randn(4, 8), torch.arange(5)), "positions"),
        (lambda: apply_rope(torch.randn(4, 8), torch.arange(4.0)), "positions"),
        (lambda: apply_rope(torch.arange(8).reshape(1, 8), torch.arange(1)), "x"),
        (lambda: RotaryEmbedding(8, 16)(torch.randn(4, 8), torch.arange(13, 17)), "positions"),
        (lambda: RotaryEmbedding(8, 16)(torch.randn(4, 8), offset=13), "offset"),
        (lambda: RotaryEmbedding(8, 16)(torch.randn(4, 6)), "d_head=8"),
        (lambda: halves_to_adjacent(torch.randn(3, 12), n_heads=5), "n_heads"),
    ],
)
def test_rope_bad_inputs_name_the_argument(call, word):
    with pytest.raises(ValueError, match=word):
        call()


# --- the model against TransformerLens's HookedTransformer -----------------------------------

TL_BIASES = ("b_Q", "_b_K", "_b_V", "b_O", "b_in", "b_out", "b_U")
TL_ROTATED = ("hook_q", "hook_k", "hook_rot_q", "hook_rot_k")  # the dims RoPE pairs up


def random_tiny_llama() -> Llama:
    """A float64 GQA model (4 query heads, 2 KV heads, untied) with random weights, RMSNorm gains
    included, a RoPE base and an eps other than the defaults."""
    cfg = LlamaConfig(
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_vocab=50,
        n_ctx=16,
        rope_theta=100.0,
        norm_eps=1e-4,
        init_range=0.3,
    )
    torch.manual_seed(0)
    model = Llama(cfg).double().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".w"):  # the RMSNorm gains, all ones at init
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def hooked_transformer_holding(ours: Llama, layout: str, angles: str):
    """TransformerLens's `HookedTransformer` configured as `ours`, holding its weights: the same
    state-dict names except GQA's unrepeated `_W_K` `_W_V`, and TransformerLens's biases zero.

    `layout="halves"` runs TransformerLens's default (GPT-NeoX, Hugging Face) rotary with
    `adjacent_to_halves` applied to the d_head columns of W_Q and W_K. `angles="course"`
    replaces TransformerLens's float64 cos and sin tables by the course's float32 ones."""
    from transformer_lens import HookedTransformer

    cfg = ours.cfg
    reference = HookedTransformer(
        HookedTransformerConfig(
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            d_head=cfg.d_head,
            n_key_value_heads=cfg.n_kv_heads,
            d_mlp=cfg.d_mlp,
            d_vocab=cfg.d_vocab,
            n_ctx=cfg.n_ctx,
            act_fn="silu",
            gated_mlp=True,
            normalization_type="RMS",
            final_rms=True,
            eps=cfg.norm_eps,
            positional_embedding_type="rotary",
            rotary_base=cfg.rope_theta,
            rotary_adjacent_pairs=layout == "adjacent",
            dtype=torch.float64,
        )
    ).eval()
    state = reference.state_dict()
    biases = [name for name in state if name.rsplit(".", 1)[-1] in TL_BIASES]
    for name in biases:
        state[name] = torch.zeros_like(state[name])
    copied = []
    for name, weight in ours.state_dict().items():
        name = name.replace("attn.W_K", "attn._W_K").replace("attn.W_V", "attn._W_V")
        if layout == "halves" and name.endswith(("W_Q", "_W_K")):
            weight = adjacent_to_halves(weight)  # (head, d_model, d_head): per head, last dim
        assert state[name].shape == weight.shape, name
        state[name] = weight
        copied.append(name)
    assert {name for name, _ in reference.named_parameters()} == {*copied, *biases}
    if angles == "course":
        for layer, block in enumerate(ours.blocks):
            for table in ("cos", "sin"):  # TL's tables repeat each pair's value at its two dims
                ours_table = getattr(block.attn.rotary, table).double()  # (n_ctx, d_head / 2)
                if layout == "adjacent":
                    tl_table = ours_table.repeat_interleave(2, dim=-1)  # dims 2i and 2i + 1
                else:
                    tl_table = torch.cat((ours_table, ours_table), dim=-1)  # i and i + d_head/2
                name = f"blocks.{layer}.attn.rotary_{table}"
                assert state[name].shape == tl_table.shape, name
                state[name] = tl_table
    reference.load_state_dict(state)
    return reference


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
@pytest.mark.parametrize("layout", ["adjacent", "halves"])
@pytest.mark.parametrize("angles, tolerance", [("transformer_lens", 1e-5), ("course", 1e-12)])
def test_matches_transformer_lens_hooked_transformer(layout, angles, tolerance):
    """The logits and every hooked activation against TransformerLens's `HookedTransformer` with
    rotary positions, RMSNorm (same formula: `x / sqrt(mean(x^2) + eps) * w`), a SiLU-gated MLP
    and grouped-query attention (TL repeats KV heads with `repeat_interleave`: query head h reads
    KV head h // group, as the course does). Every course hook name exists in TransformerLens and
    each activation has the same shape there (`hook_k` `hook_v` `hook_rot_k` with n_kv_heads
    heads on both sides).

    Tolerance, relative to the largest magnitude of each reference tensor, in float64:

    - TransformerLens's own angles: 1e-5 (measured ~3e-7; logits ~2e-6 absolute on logits of
      order 6). TL computes the angles in float64 (`pos / base^(2i/d_head)`), the course in
      float32 as Meta's and Hugging Face's code do; an angle of up to 15 rad rounded in float32
      is off by ~1e-6 rad, and that is the whole difference:
    - the course's float32 cos and sin copied into TL's tables: 1e-12 (measured ~2e-15).

    `layout="halves"`: TL's default rotary turns dim i with dim i + d_head/2 (GPT-NeoX, Hugging
    Face); with W_Q's and W_K's columns permuted by `adjacent_to_halves` it gives the same model,
    its q and k (`hook_q` `hook_k` `hook_rot_q` `hook_rot_k`) in halves order, compared after
    `halves_to_adjacent`. Masked attention scores differ by convention (the course fills the
    most negative float, TL -inf), so the scores are compared where the causal mask allows.
    """
    ours = random_tiny_llama()
    reference = hooked_transformer_holding(ours, layout, angles)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, cache = ours.run_with_cache(ids)
        expected, tl_cache = reference.run_with_cache(ids)
    assert logits.shape == expected.shape == (2, 16, 50)
    assert (logits - expected).abs().max().item() <= tolerance * expected.abs().max().item()
    assert len(cache) == 43 and set(cache.keys()) <= set(tl_cache.keys())
    allowed = torch.ones(16, 16, dtype=torch.bool).tril()
    for name, actual in cache.items():
        theirs = tl_cache[name]
        assert actual.shape == theirs.shape, name
        if layout == "halves" and name.endswith(TL_ROTATED):
            theirs = halves_to_adjacent(theirs)
        if name.endswith("hook_attn_scores"):
            actual, theirs = actual[..., allowed], theirs[..., allowed]
        assert (actual - theirs).abs().max().item() <= tolerance * theirs.abs().max().item(), name
