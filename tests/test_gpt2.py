"""GPT-2 against Hugging Face's `GPT2LMHeadModel` and TransformerLens's `HookedTransformer`.

Every reference model is built from a config with random weights (no download). Biases and
layer-norm parameters are randomised too, so a loader that drops or misplaces them fails.
Tolerances: float32 logits within max abs diff 1e-4 (the brief's bound); float64 within 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from transformer_course.attention import set_fast_path
from transformer_course.gpt2 import (
    GPT2,
    Embed,
    GPT2Config,
    PosEmbed,
    Unembed,
    forward_with_cache,
    generate,
    train_loop,
)
from transformer_course.gpt2_weights import convert_hf_gpt2_state_dict
from transformer_course.training import (
    TrainConfig,
    cosine_lr,
    estimate_loss,
    lm_loss,
    sample_batch,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
TINY = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=61, n_positions=16)


def randomise_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (biases and layer norms included) random values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(
                torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1
                + (param == 1) * 1.0
            )
    return model


def hf_model(dtype=torch.float32, **overrides) -> GPT2LMHeadModel:
    config = HFGPT2Config(
        **{**TINY, **overrides},
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return randomise_(GPT2LMHeadModel(config)).to(dtype).eval()


def tl_model(dtype=torch.float64) -> HookedTransformer:
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=32,
        n_heads=4,
        d_head=8,
        d_mlp=128,
        d_vocab=61,
        n_ctx=16,
        act_fn="gelu_new",
        normalization_type="LN",
        positional_embedding_type="standard",
        eps=1e-5,
        dtype=dtype,
        seed=0,
    )
    return randomise_(HookedTransformer(cfg)).eval()


def tiny_gpt2(**overrides) -> GPT2:
    torch.manual_seed(0)
    cfg = GPT2Config(
        **{**dict(d_model=32, n_layers=2, n_heads=4, d_vocab=61, n_ctx=16), **overrides}
    )
    return GPT2(cfg).eval()


def test_config_defaults_are_gpt2_small():
    cfg = GPT2Config()
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_mlp) == (
        768,
        12,
        12,
        64,
        3072,
    )
    assert (cfg.d_vocab, cfg.n_ctx, cfg.layer_norm_eps, cfg.init_range) == (50257, 1024, 1e-5, 0.02)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(d_model=30, n_heads=4), "a multiple of n_heads=4"),
        (dict(n_layers=0), "n_layers"),
        (dict(dropout=1.5), "dropout"),
        (dict(d_vocab=2.5), "d_vocab"),
    ],
)
def test_config_rejects_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        GPT2Config(**kwargs)


def test_component_shapes_and_initialisation():
    torch.manual_seed(0)
    cfg = GPT2Config(d_model=64, n_layers=2, n_heads=4, d_vocab=500, n_ctx=32)
    tokens = torch.randint(0, cfg.d_vocab, (3, 10))
    assert Embed(cfg)(tokens).shape == (3, 10, 64)
    pos = PosEmbed(cfg)
    out = pos(tokens)
    assert out.shape == (3, 10, 64) and torch.equal(out[1], pos.W_pos[:10])
    unembed = Unembed(cfg)
    assert unembed(torch.randn(3, 10, 64)).shape == (3, 10, 500)
    assert torch.equal(unembed.b_U, torch.zeros(500))
    model = GPT2(cfg)
    # GPT-2 scales the residual-writing projections by 1/sqrt(2 n_layers); the rest use init_range.
    assert abs(model.embed.W_E.std().item() - 0.02) < 0.002
    expected_residual_std = 0.02 / (2 * cfg.n_layers) ** 0.5
    for block in model.blocks:
        assert (
            abs(block.attn.W_O.std().item() - expected_residual_std) < 0.15 * expected_residual_std
        )
        assert (
            abs(block.mlp.W_out.std().item() - expected_residual_std) < 0.15 * expected_residual_std
        )
        assert abs(block.attn.W_Q.std().item() - 0.02) < 0.003
        for name, param in block.named_parameters():
            if name.rsplit(".", 1)[-1].startswith("b"):
                assert torch.equal(param, torch.zeros_like(param)), name


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_from_huggingface_matches_hf_logits_tiny(dtype, atol):
    reference = hf_model(dtype)
    ours = GPT2.from_huggingface(reference).eval()
    assert next(ours.parameters()).dtype == dtype
    tokens = torch.randint(
        0, TINY["vocab_size"], (3, TINY["n_positions"]), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = reference(tokens).logits
        actual = ours(tokens)
    assert actual.shape == expected.shape == (3, 16, 61)
    assert (actual - expected).abs().max().item() <= atol


def test_from_huggingface_matches_hf_logits_gpt2_small_architecture():
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(HFGPT2Config()).eval()  # GPT-2 small's shape, random weights
    ours = GPT2.from_huggingface(reference).eval()
    assert ours.cfg == GPT2Config()
    tokens = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens) - reference(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_from_huggingface_rejects_non_gpt2_variants():
    reference = hf_model(scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        GPT2.from_huggingface(reference)


@pytest.mark.parametrize("not_hf", [torch.nn.Linear(2, 2), {"lm_head.weight": torch.ones(2)}, "x"])
def test_from_huggingface_refuses_what_is_not_a_hugging_face_gpt2(not_hf):
    with pytest.raises(TypeError, match="hf_model: expected a Hugging Face GPT2LMHeadModel"):
        GPT2.from_huggingface(not_hf)


def test_config_from_huggingface_reads_every_field():
    hf_config = HFGPT2Config(**TINY, n_inner=None, layer_norm_epsilon=1e-6, initializer_range=0.03)
    cfg = GPT2Config.from_huggingface(hf_config)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_head) == (32, 2, 4, 8)
    assert (cfg.d_mlp, cfg.d_vocab, cfg.n_ctx) == (4 * 32, 61, 16)  # n_inner=None: 4 d_model
    assert (cfg.layer_norm_eps, cfg.init_range, cfg.act_fn) == (1e-6, 0.03, "gelu_new")
    assert GPT2Config.from_huggingface(HFGPT2Config(**TINY, n_inner=100)).d_mlp == 100
    with pytest.raises(ValueError, match="hf_config.reorder_and_upcast_attn: expected False"):
        GPT2Config.from_huggingface(HFGPT2Config(**TINY, reorder_and_upcast_attn=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weight_conversion_matches_transformer_lens_without_building_a_model(dtype):
    """The state-dict conversion alone, against TransformerLens's own `convert_gpt2_weights`:
    every tensor equal, in the dtype it came in; `b_U` (which TransformerLens leaves out) zero."""
    reference = hf_model(dtype)
    cfg = GPT2Config.from_huggingface(reference.config)
    ours = convert_hf_gpt2_state_dict(
        reference.state_dict(), n_layers=cfg.n_layers, n_heads=cfg.n_heads
    )
    tl_cfg = HookedTransformerConfig(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        d_head=cfg.d_head,
        d_mlp=cfg.d_mlp,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        act_fn="gelu_new",
    )
    theirs = convert_gpt2_weights(reference, tl_cfg)
    assert set(ours) == set(theirs) | {"unembed.b_U"}
    for name, expected in theirs.items():
        assert ours[name].dtype == dtype, name
        assert torch.equal(ours[name], expected), name
    assert torch.equal(ours["unembed.b_U"], torch.zeros(61, dtype=dtype))


def test_weight_conversion_names_a_missing_key():
    state = hf_model().state_dict()
    del state["lm_head.weight"]
    cfg = GPT2Config.from_huggingface(hf_model().config)
    with pytest.raises(TypeError, match="hf_state_dict: .* 'lm_head.weight' is missing"):
        convert_hf_gpt2_state_dict(state, n_layers=cfg.n_layers, n_heads=cfg.n_heads)


def test_tied_embeddings_are_one_matrix_and_match_hugging_face():
    reference = hf_model(tie_word_embeddings=True)  # the released GPT-2's layout
    assert reference.lm_head.weight is reference.transformer.wte.weight
    untied = GPT2.from_huggingface(reference)
    tied = GPT2(GPT2Config(**{**vars(untied.cfg), "tie_embeddings": True})).eval()
    state = untied.state_dict()
    state["unembed.W_E"] = state.pop("unembed.W_U").T
    tied.load_state_dict(state)
    assert tied.unembed.W_E is tied.embed.W_E
    assert tied.num_params() == untied.num_params() - 61 * 32  # W_U is gone
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(tied(tokens), reference(tokens).logits, atol=1e-4, rtol=0)
    # Both ends train the one matrix: its gradient is the embedding's plus the unembedding's.
    lm_loss(tied(tokens)[:, :-1], tokens[:, 1:]).backward()
    assert tied.embed.W_E.grad[~torch.isin(torch.arange(61), tokens[:, :-1])].abs().sum() > 0


def test_lm_loss_matches_hf_loss():
    reference = hf_model(torch.float64)
    ours = GPT2.from_huggingface(reference).eval()
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(tokens, labels=tokens).loss  # HF shifts the labels itself
        actual = lm_loss(ours(tokens)[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(actual, expected, atol=1e-10, rtol=0)


def test_transformer_lens_state_dict_loads_and_logits_match():
    reference = tl_model()
    ours = tiny_gpt2().double()
    result = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), reference(tokens), atol=1e-10, rtol=0)


def test_activations_match_transformer_lens_cache_by_name():
    reference = tl_model()
    ours = tiny_gpt2().double()
    ours.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(4))
    _, expected = reference.run_with_cache(tokens)
    logits, actual = ours.run_with_cache(tokens)
    assert logits.shape == (2, 11, 61)
    required = {
        "hook_embed",
        "hook_pos_embed",
        *(
            f"blocks.{layer}.{name}"
            for layer in range(2)
            for name in (
                "hook_resid_pre",
                "ln1.hook_normalized",
                "attn.hook_q",
                "attn.hook_k",
                "attn.hook_v",
                "attn.hook_pattern",
                "attn.hook_z",
                "hook_attn_out",
                "hook_resid_mid",
                "mlp.hook_pre",
                "mlp.hook_post",
                "hook_mlp_out",
                "hook_resid_post",
            )
        ),
        "ln_final.hook_normalized",
    }
    missing = required - set(actual.keys())
    assert not missing, f"hook points missing from our cache: {sorted(missing)}"
    for name in required:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-10, rtol=0, msg=name)


@pytest.mark.parametrize(
    "tokens, error, word",
    [
        (torch.zeros(1, 17, dtype=torch.long), ValueError, "n_ctx=16"),
        (torch.tensor([[1, 2, 61]]), ValueError, "d_vocab=61"),
        (torch.tensor([[1, -1, 3]]), ValueError, "d_vocab=61"),
        (torch.tensor([[1.0, 2.0]]), TypeError, "integer"),
        (torch.tensor([[True, False]]), TypeError, "integer"),
        (torch.tensor([[1, 2]], dtype=torch.uint8), TypeError, "torch.uint8"),  # indexes as a mask
        (torch.tensor([1, 2, 3]), ValueError, r"\(batch, pos\)"),
        (torch.zeros(2, 0, dtype=torch.long), ValueError, r"tokens: .* at least one position"),
        ([[1, 2, 3]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_tokens_give_clear_errors(tokens, error, word):
    model = tiny_gpt2()
    with pytest.raises(error, match=word):
        model(tokens)


def test_int32_tokens_work():
    model = tiny_gpt2()
    tokens = torch.randint(0, 61, (2, 5))
    torch.testing.assert_close(model(tokens.int()), model(tokens))


def greedy_loop(model: GPT2, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    """The textbook greedy decoder, written independently of `generate`."""
    out = tokens.clone()
    for _ in range(steps):
        with torch.no_grad():
            logits = model(out[:, -model.cfg.n_ctx :])
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


def test_generate_temperature_zero_is_greedy_and_crops_context():
    model = tiny_gpt2()
    prompt = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(5))
    out = generate(model, prompt, 20, temperature=0)  # 25 tokens > n_ctx=16: context is cropped
    assert out.shape == (3, 25) and out.dtype == prompt.dtype
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, greedy_loop(model, prompt, 20))


def test_generate_crops_a_prompt_longer_than_n_ctx():
    model = tiny_gpt2()
    prompt = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(9))
    out = generate(model, prompt, 3, temperature=0)
    assert torch.equal(out[:, :40], prompt)
    assert torch.equal(out[:, 40:], greedy_loop(model, prompt[:, -16:], 3)[:, 16:])


def test_generate_with_a_tiny_temperature_is_greedy():
    model = tiny_gpt2()
    prompt = torch.randint(0, 61, (3, 4), generator=torch.Generator().manual_seed(10))
    out = generate(model, prompt, 6, temperature=1e-40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, greedy_loop(model, prompt, 6))


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_generate_refuses_nan_logits_instead_of_emitting_token_0(temperature):
    model = tiny_gpt2()
    with torch.no_grad():
        model.unembed.b_U[5] = float("nan")
    with pytest.raises(FloatingPointError, match="logits after 2 tokens are not finite"):
        generate(model, torch.tensor([[1, 2]]), 3, temperature=temperature)


def test_generate_top_k_restricts_samples_to_the_k_most_likely():
    model = tiny_gpt2()
    prompt = torch.randint(0, 61, (4, 3), generator=torch.Generator().manual_seed(6))
    k = 3
    out = generate(
        model, prompt, 10, temperature=2.0, top_k=k, generator=torch.Generator().manual_seed(7)
    )
    with torch.no_grad():
        for step in range(3, out.shape[1]):
            logits = model(out[:, max(0, step - 16) : step])[:, -1]
            allowed = logits.topk(k, dim=-1).indices
            assert (allowed == out[:, step : step + 1]).any(dim=1).all(), (
                f"sample outside the top {k} at {step}"
            )
    # top_k=1 leaves one candidate: the same as greedy whatever the temperature.
    one = generate(
        model, prompt, 10, temperature=5.0, top_k=1, generator=torch.Generator().manual_seed(8)
    )
    assert torch.equal(one, greedy_loop(model, prompt, 10))


def test_generate_samples_follow_the_softmax():
    """With temperature 1 and no top_k, sample frequencies match the model's probabilities."""
    model = tiny_gpt2()
    prompt = torch.tensor([[4, 9, 2]])
    with torch.no_grad():
        probs = model(prompt)[0, -1].softmax(-1)
    draws = generate(model, prompt.expand(4000, 3), 1, generator=torch.Generator().manual_seed(9))[
        :, -1
    ]
    freq = torch.bincount(draws, minlength=61).double() / 4000
    assert (freq - probs.double()).abs().max().item() < 0.03  # ~4 standard errors at p = 0.1


def test_generate_restores_training_mode_and_checks_arguments():
    model = tiny_gpt2(dropout=0.1).train()
    prompt = torch.tensor([[1, 2]])
    generate(model, prompt, 2)
    assert model.training
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 2, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)


def test_forward_with_cache_gives_the_full_forward_passs_logits():
    """A prompt, then one token, then four at once: every position's logits are those of the
    model run on the whole sequence (float64, rows that differ)."""
    model = tiny_gpt2().double()
    with torch.no_grad():
        for param in model.parameters():  # biases and layer norms away from their init values
            param.add_(0.1 * torch.randn(param.shape, dtype=param.dtype))
    tokens = torch.randint(0, 61, (3, 16), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        expected = model(tokens)
        cache, logits = None, []
        for start, end in ((0, 7), (7, 8), (8, 12), (12, 16)):
            chunk, cache = forward_with_cache(model, tokens[:, start:end], cache)
            logits.append(chunk)
    torch.testing.assert_close(torch.cat(logits, dim=1), expected, atol=1e-10, rtol=0)
    assert [tuple(k.shape) for k, _ in cache] == [(3, 4, 16, 8)] * 2


def test_forward_with_cache_greedy_tokens_match_generate_and_refuse_past_n_ctx():
    model = tiny_gpt2()
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        logits, cache = forward_with_cache(model, prompt)
        tokens = prompt
        for _ in range(12):
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
            logits, cache = forward_with_cache(model, tokens[:, -1:], cache)
        assert torch.equal(tokens, generate(model, prompt, 12, temperature=0))
        with pytest.raises(ValueError, match="at most n_ctx=16 positions with the 16 cached"):
            forward_with_cache(model, tokens[:, -1:], cache)
        short = [(k[..., :4, :], v[..., :4, :]) for k, v in cache]
        for wrong in (cache[:1], [cache[0], short[1]], [(None, None)] * 2):
            with pytest.raises(ValueError, match="cache: expected None or, for each of the 2"):
                forward_with_cache(model, tokens[:, 4:5], wrong)
        with pytest.raises(ValueError, match=r"batch=1, n_heads=4"):
            forward_with_cache(model, tokens[:1, 4:5], short)


def test_fast_path_matches_the_einsum_path():
    reference = tl_model()
    model = tiny_gpt2().double()
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        slow = model(tokens)
        fast = set_fast_path(model)(tokens)
    assert all(block.attn.fast_path for block in model.blocks)
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=0)


def test_torch_compile_traces_forward_and_backward():
    """Dynamo traces the model (the aot_eager backend skips C++ code generation, keeping this
    fast)."""
    model = set_fast_path(tiny_gpt2())
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(12))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens), atol=1e-5, rtol=0)
    lm_loss(compiled(tokens)[:, :-1], tokens[:, 1:]).backward()
    assert model.embed.W_E.grad is not None


def test_bf16_autocast_close_to_float32():
    model = tiny_gpt2()
    tokens = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            actual = model(tokens)
    assert not torch.isnan(actual).any()
    assert (actual.float() - expected).abs().max().item() < 0.05  # bf16 keeps ~3 significant digits


def test_training_overfits_one_batch():
    model = tiny_gpt2().train()
    x, y = sample_batch(
        torch.randint(0, 61, (500,), generator=torch.Generator().manual_seed(0)), 4, 16
    )
    cfg = TrainConfig(
        max_steps=60, lr=1e-2, warmup_steps=5, lr_schedule="cosine", progress=False, log_every=0
    )
    history = train(model, cfg, lambda step: (x, y), lambda m, b: lm_loss(m(b[0]), b[1]))
    assert history.train_loss[0] > 3.5  # about ln(61) = 4.1 at initialisation
    assert history.train_loss[-1] < 0.5
    loss = estimate_loss(model, torch.cat([x[0], y[0, -1:]]), batch_size=1, n_ctx=16, n_batches=1)
    assert loss < 0.5


def test_train_loop_is_the_plain_loop_and_keeps_a_copy_of_the_best_weights():
    """Against the loop written out by hand: the same losses and learning rates, evaluations
    after steps 4, 8 and the last, and the weights of the best one, the middle one here (so a
    loop that keeps the live state dict instead of a copy ends up with the last weights)."""
    data = torch.randint(0, 61, (400,), generator=torch.Generator().manual_seed(21))

    def get_batch(step):
        return sample_batch(data, 4, 16, generator=torch.Generator().manual_seed(step))

    def lr_at(step):
        return cosine_lr(step, lr=3e-2, warmup_steps=2, max_steps=10)

    model, reference = tiny_gpt2(), tiny_gpt2()
    scores = iter([3.0, 1.0, 2.0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    history = train_loop(
        model, optimizer, get_batch, lambda m: next(scores), max_steps=10, lr_at=lr_at, eval_every=4
    )

    by_hand = torch.optim.AdamW(reference.parameters(), lr=0.0)
    losses, states = [], []
    for step in range(10):
        for group in by_hand.param_groups:
            group["lr"] = lr_at(step)
        reference.train()
        tokens, targets = get_batch(step)
        loss = lm_loss(reference(tokens), targets)
        by_hand.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        by_hand.step()
        losses.append(loss.item())
        if step + 1 in (4, 8, 10):
            states.append({k: v.clone() for k, v in reference.state_dict().items()})
    assert history.train_loss == pytest.approx(losses, rel=1e-6)
    assert history.lr == [lr_at(step) for step in range(10)]
    assert history.evals == [{"step": s, "val_loss": v} for s, v in ((4, 3.0), (8, 1.0), (10, 2.0))]
    assert history.best == {"step": 8, "val_loss": 1.0}
    for name, tensor in states[1].items():
        torch.testing.assert_close(history.best_state[name], tensor)
