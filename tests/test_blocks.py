"""MLP and TransformerBlock against TransformerLens (pre-LN), torch.nn.TransformerEncoderLayer and
torch.nn.TransformerDecoderLayer (post-LN and pre-LN, with and without the causal mask).

Tolerances: float64 comparisons use atol=1e-10; float32 ones atol=1e-5 (the brief's contract
for loading TransformerLens / Hugging Face weights).
"""

from __future__ import annotations

import einops
import pytest
import torch
from transformer_lens.components import MLP as TLMLP
from transformer_lens.components import TransformerBlock as TLTransformerBlock
from transformer_lens.config import HookedTransformerConfig
from transformer_lens.hook_points import HookPoint

from transformer_course.blocks import MLP, TransformerBlock, residual_sublayer
from transformer_course.layernorm import LayerNorm
from transformer_course.masking import padding_mask

D_MODEL, N_HEADS, D_HEAD, D_MLP = 32, 4, 8, 128


def tl_config(dtype: torch.dtype, act_fn: str = "gelu_new") -> HookedTransformerConfig:
    return HookedTransformerConfig(
        n_layers=1,
        d_model=D_MODEL,
        n_heads=N_HEADS,
        d_head=D_HEAD,
        d_mlp=D_MLP,
        n_ctx=16,
        d_vocab=50,
        act_fn=act_fn,
        normalization_type="LN",
        dtype=dtype,
    )


def randomize_(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Non-trivial values for every parameter (layer-norm gains, biases too)."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def load_from(ours: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Load a TransformerLens state dict; its only extra entries are attention's mask buffers."""
    state = reference.state_dict()
    extra = {k for k in state if k not in ours.state_dict()}
    assert all(k.endswith(("attn.mask", "attn.IGNORE")) for k in extra), extra
    ours.load_state_dict({k: v for k, v in state.items() if k not in extra}, strict=True)


@pytest.mark.parametrize("act_fn", ["gelu_new", "gelu", "relu"])
def test_mlp_matches_transformer_lens_float64(act_fn):
    generator = torch.Generator().manual_seed(0)
    reference = TLMLP(tl_config(torch.float64, act_fn))
    randomize_(reference, generator)
    ours = MLP(D_MODEL, D_MLP, act_fn=act_fn).double()
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 7, D_MODEL, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(ours(x), reference(x), atol=1e-10, rtol=0)


def test_gelu_new_is_gpt2_tanh_formula():
    """GPT-2's gelu, written out from the paper's formula (Hendrycks & Gimpel's tanh
    approximation)."""
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    expected = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    mlp = MLP(1, 1, act_fn="gelu_new").double()
    with torch.no_grad():
        mlp.W_in.fill_(1.0)
        mlp.W_out.fill_(1.0)
    torch.testing.assert_close(mlp(x[:, None])[:, 0], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_pre_ln_block_matches_transformer_lens(dtype, atol):
    generator = torch.Generator().manual_seed(0)
    reference = TLTransformerBlock(tl_config(dtype), block_index=0)
    randomize_(reference, generator)
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, norm="pre", act_fn="gelu_new").to(
        dtype
    )
    load_from(ours, reference)
    resid = torch.randn(3, 11, D_MODEL, generator=generator, dtype=dtype)
    torch.testing.assert_close(ours(resid), reference(resid), atol=atol, rtol=0)


def test_pre_ln_block_hooks_match_transformer_lens():
    generator = torch.Generator().manual_seed(1)
    reference = TLTransformerBlock(tl_config(torch.float64), block_index=0)
    randomize_(reference, generator)
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP).double()
    load_from(ours, reference)
    resid = torch.randn(2, 6, D_MODEL, generator=generator, dtype=torch.float64)
    names = [
        "hook_resid_pre",
        "hook_attn_out",
        "hook_resid_mid",
        "hook_mlp_out",
        "hook_resid_post",
        "ln1.hook_scale",
        "attn.hook_pattern",
        "mlp.hook_post",
    ]
    seen: dict[str, torch.Tensor] = {}
    for prefix, module in (("ours", ours), ("tl", reference)):
        modules = dict(module.named_modules())
        for name in names:
            modules[name].register_forward_hook(
                lambda _m, _i, out, key=f"{prefix}.{name}": seen.__setitem__(key, out)
            )
        module(resid)
    for name in names:
        torch.testing.assert_close(
            seen[f"ours.{name}"], seen[f"tl.{name}"], atol=1e-10, rtol=0, msg=name
        )


def attention_state(attn: torch.nn.MultiheadAttention, prefix: str) -> dict[str, torch.Tensor]:
    """Map nn.MultiheadAttention weights (x @ W.T, heads concatenated) to our per-head names."""
    q, k, v = attn.in_proj_weight.chunk(3)
    bq, bk, bv = attn.in_proj_bias.chunk(3)
    per_head = "(head d_head) d_model -> head d_model d_head"
    bias = "(head d_head) -> head d_head"
    out = "d_model (head d_head) -> head d_head d_model"
    return {
        f"{prefix}.W_Q": einops.rearrange(q, per_head, head=N_HEADS),
        f"{prefix}.W_K": einops.rearrange(k, per_head, head=N_HEADS),
        f"{prefix}.W_V": einops.rearrange(v, per_head, head=N_HEADS),
        f"{prefix}.b_Q": einops.rearrange(bq, bias, head=N_HEADS),
        f"{prefix}.b_K": einops.rearrange(bk, bias, head=N_HEADS),
        f"{prefix}.b_V": einops.rearrange(bv, bias, head=N_HEADS),
        f"{prefix}.W_O": einops.rearrange(attn.out_proj.weight, out, head=N_HEADS),
        f"{prefix}.b_O": attn.out_proj.bias,
    }


def norm_state(norm: torch.nn.LayerNorm, prefix: str) -> dict[str, torch.Tensor]:
    return {f"{prefix}.w": norm.weight, f"{prefix}.b": norm.bias}


def mlp_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        "mlp.W_in": layer.linear1.weight.T,
        "mlp.b_in": layer.linear1.bias,
        "mlp.W_out": layer.linear2.weight.T,
        "mlp.b_out": layer.linear2.bias,
    }


def encoder_layer_state(layer: torch.nn.TransformerEncoderLayer) -> dict[str, torch.Tensor]:
    """Map nn.TransformerEncoderLayer weights to our names."""
    return {
        **attention_state(layer.self_attn, "attn"),
        **mlp_state(layer),
        **norm_state(layer.norm1, "ln1"),
        **norm_state(layer.norm2, "ln2"),
    }


def decoder_layer_state(layer: torch.nn.TransformerDecoderLayer) -> dict[str, torch.Tensor]:
    """Map nn.TransformerDecoderLayer weights to our names: its norm2 sits before (pre-LN) or
    after (post-LN) the cross-attention, our `ln_cross`; its norm3 is our MLP's `ln2`."""
    return {
        **attention_state(layer.self_attn, "attn"),
        **attention_state(layer.multihead_attn, "cross_attn"),
        **mlp_state(layer),
        **norm_state(layer.norm1, "ln1"),
        **norm_state(layer.norm2, "ln_cross"),
        **norm_state(layer.norm3, "ln2"),
    }


def torch_layer(layer_class, generator, *, norm: str, activation: str, dtype: torch.dtype):
    """A randomized `nn.TransformerEncoderLayer` or `DecoderLayer` at the test's sizes, in eval
    mode with no dropout: the reference our block is loaded from."""
    reference = layer_class(
        D_MODEL,
        N_HEADS,
        dim_feedforward=D_MLP,
        dropout=0.0,
        activation=activation,
        batch_first=True,
        norm_first=norm == "pre",
        dtype=dtype,
    ).eval()
    randomize_(reference, generator)
    return reference


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_post_ln_block_matches_torch_encoder_layer_with_causal_mask(dtype, atol):
    generator = torch.Generator().manual_seed(0)
    reference = torch_layer(
        torch.nn.TransformerEncoderLayer, generator, norm="post", activation="gelu", dtype=dtype
    )
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, norm="post", act_fn="gelu").to(dtype)
    ours.load_state_dict(encoder_layer_state(reference), strict=True)
    x = torch.randn(3, 9, D_MODEL, generator=generator, dtype=dtype)
    future = torch.nn.Transformer.generate_square_subsequent_mask(
        9, dtype=dtype
    )  # -inf above the diagonal
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x, src_mask=future), atol=atol, rtol=0)


def test_padding_mask_is_combined_with_causal_mask():
    """With padding, the result equals TL's block run with the same key mask (attention_mask)."""
    generator = torch.Generator().manual_seed(2)
    reference = TLTransformerBlock(tl_config(torch.float64), block_index=0)
    randomize_(reference, generator)
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP).double()
    load_from(ours, reference)
    tokens = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 3, 4, 5]])  # 0 = padding, on the left
    resid = torch.randn(2, 5, D_MODEL, generator=generator, dtype=torch.float64)
    expected = reference(resid, attention_mask=(tokens != 0).long())
    actual = ours(resid, mask=padding_mask(tokens, pad_id=0))
    real = tokens != 0  # padded query rows see no key at all; only real positions are compared
    torch.testing.assert_close(actual[real], expected[real], atol=1e-10, rtol=0)
    assert torch.isfinite(actual).all()


def test_block_is_causal():
    """Changing a later position never changes an earlier output."""
    torch.manual_seed(0)
    block = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, norm="post").double()
    x = torch.randn(1, 8, D_MODEL, dtype=torch.float64)
    y = x.clone()
    y[:, 5:] += torch.randn(1, 3, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(block(x)[:, :5], block(y)[:, :5], atol=1e-12, rtol=0)
    assert not torch.allclose(block(x)[:, 5:], block(y)[:, 5:])


def test_bad_arguments_have_clear_errors():
    with pytest.raises(ValueError, match="act_fn"):
        MLP(8, 32, act_fn="swish")
    with pytest.raises(ValueError, match=r"norm: expected one of \['post', 'pre'\], got 'middle'"):
        TransformerBlock(8, 2, 4, 32, norm="middle")
    block = TransformerBlock(8, 2, 4, 32)
    with pytest.raises(ValueError, match=r"resid: expected last dim d_model=8, got 6"):
        block(torch.randn(2, 3, 6))
    with pytest.raises(
        ValueError, match=r"resid: expected shape \(batch, pos, d_model=8\), got shape \(3, 8\)"
    ):
        block(torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"x: expected last dim d_model=8, got 5"):
        MLP(8, 32)(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"resid: expected at least one position, got shape"):
        block(torch.randn(2, 0, 8))
    with pytest.raises(ValueError, match=r"x: expected dtype torch.float32 \(the dtype of the"):
        block(torch.randn(2, 3, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_block_with_a_large_residual_stream(dtype):
    """A residual stream of size ~1000 (where float16 squares overflow): what attention and the
    MLP add is finite and close to what the float64 block adds."""
    torch.manual_seed(0)
    block = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP).double()
    randomize_(block, torch.Generator().manual_seed(1))
    x = 1000 * torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    _, expected = block.run_with_cache(x)
    _, actual = block.to(dtype).run_with_cache(x.to(dtype))
    for name in ("hook_attn_out", "hook_mlp_out", "hook_resid_post"):
        assert actual[name].dtype == dtype and torch.isfinite(actual[name]).all()
        scale = expected[name].abs().max().item()
        tolerance = 4 * torch.finfo(dtype).eps * scale
        torch.testing.assert_close(actual[name].double(), expected[name], atol=tolerance, rtol=0)


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_encoder_block_matches_torch_encoder_layer(norm, dtype, atol):
    """`causal=False`: every position sees every other, except the padding `mask` hides."""
    generator = torch.Generator().manual_seed(3)
    reference = torch_layer(
        torch.nn.TransformerEncoderLayer, generator, norm=norm, activation="relu", dtype=dtype
    )
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, norm=norm, act_fn="relu", causal=False)
    ours.to(dtype).load_state_dict(encoder_layer_state(reference), strict=True)
    tokens = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 0, 0, 0]])
    x = torch.randn(2, 5, D_MODEL, generator=generator, dtype=dtype)
    with torch.no_grad():
        expected = reference(x, src_key_padding_mask=tokens == 0)
        torch.testing.assert_close(ours(x, padding_mask(tokens, 0)), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_decoder_block_matches_torch_decoder_layer(norm, dtype, atol):
    """`cross_attention=True`: causal self-attention, then queries from the stream attend to the
    `context` (keys and values), with the context's padding hidden, then the MLP."""
    generator = torch.Generator().manual_seed(4)
    reference = torch_layer(
        torch.nn.TransformerDecoderLayer, generator, norm=norm, activation="relu", dtype=dtype
    )
    ours = TransformerBlock(
        D_MODEL, N_HEADS, D_HEAD, D_MLP, norm=norm, act_fn="relu", cross_attention=True
    )
    ours.to(dtype).load_state_dict(decoder_layer_state(reference), strict=True)
    x = torch.randn(2, 6, D_MODEL, generator=generator, dtype=dtype)
    context = torch.randn(2, 4, D_MODEL, generator=generator, dtype=dtype)
    source = torch.tensor([[5, 6, 7, 8], [3, 4, 0, 0]])
    future = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=dtype)
    with torch.no_grad():
        expected = reference(x, context, tgt_mask=future, memory_key_padding_mask=source == 0)
        actual = ours(x, context=context, context_mask=padding_mask(source, 0))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_residual_sublayer_is_the_papers_formula(norm):
    generator = torch.Generator().manual_seed(5)
    resid = torch.randn(2, 3, 8, generator=generator, dtype=torch.float64)
    ln = LayerNorm(8).double()
    randomize_(ln, generator)
    weight = torch.randn(8, 8, generator=generator, dtype=torch.float64)

    def sublayer(x):
        return torch.tanh(x @ weight)

    seen = []
    out = residual_sublayer(
        resid,
        sublayer,
        ln,
        norm=norm,
        dropout=lambda t: 2 * t,
        hook_out=lambda t: seen.append(t) or t,
    )
    # Written out by hand, with a stand-in "dropout" that doubles, so its place shows.
    added = 2 * sublayer(ln(resid) if norm == "pre" else resid)
    expected = resid + added if norm == "pre" else ln(resid + added)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(seen[0], added, atol=1e-12, rtol=0)
    patched = residual_sublayer(
        resid, sublayer, ln, norm=norm, dropout=lambda t: t, hook_out=torch.zeros_like
    )
    torch.testing.assert_close(patched, resid if norm == "pre" else ln(resid), atol=1e-12, rtol=0)


def test_decoder_block_hooks_see_each_sublayer():
    """With pre-LN the stream is the running sum of what each sublayer adds."""
    torch.manual_seed(6)
    block = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, cross_attention=True).double()
    randomize_(block, torch.Generator().manual_seed(7))
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    context = torch.randn(2, 3, D_MODEL, dtype=torch.float64)
    out, cache = block.run_with_cache(x, context=context)
    names = [
        "hook_resid_pre",
        "hook_attn_out",
        "hook_resid_mid",
        "hook_cross_attn_out",
        "hook_resid_mid_cross",
        "hook_mlp_out",
        "hook_resid_post",
    ]
    assert [name for name in cache.keys() if name in names] == names
    torch.testing.assert_close(cache["hook_resid_mid"], x + cache["hook_attn_out"])
    mid = cache["hook_resid_mid"] + cache["hook_cross_attn_out"]
    torch.testing.assert_close(cache["hook_resid_mid_cross"], mid)
    torch.testing.assert_close(out, mid + cache["hook_mlp_out"])
    assert cache["cross_attn.hook_pattern"].shape == (2, N_HEADS, 5, 3)


def test_a_block_without_cross_attention_has_transformer_lens_hooks_only():
    block = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP)
    reference = TLTransformerBlock(tl_config(torch.float32), block_index=0)

    def hooks(module):
        return {name for name, m in module.named_modules() if isinstance(m, HookPoint)}

    assert hooks(block) <= hooks(reference) and "hook_resid_mid" in hooks(block)
    assert not hasattr(block, "cross_attn")


def test_context_goes_with_cross_attention_only():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"context: expected the encoder output.*got None"):
        TransformerBlock(8, 2, 4, 32, cross_attention=True)(x)
    with pytest.raises(ValueError, match=r"context: expected None \(the block has no cross"):
        TransformerBlock(8, 2, 4, 32)(x, context=x)
    with pytest.raises(ValueError, match=r"context: expected batch size 2 \(the batch size of x\)"):
        TransformerBlock(8, 2, 4, 32, cross_attention=True)(x, context=x[:1])
    with pytest.raises(ValueError, match="causal: expected True or False, got 1"):
        TransformerBlock(8, 2, 4, 32, causal=1)


def test_layer_norm_eps_reaches_every_norm():
    block = TransformerBlock(8, 2, 4, 32, layer_norm_eps=1e-3, cross_attention=True)
    assert block.ln1.eps == block.ln_cross.eps == block.ln2.eps == 1e-3


@pytest.mark.parametrize("cross_attention", [False, True])
def test_dropout_acts_in_train_mode_only(cross_attention):
    torch.manual_seed(8)
    block = TransformerBlock(8, 2, 4, 32, dropout=0.5, cross_attention=cross_attention)
    x = torch.randn(2, 4, 8)
    context = x[:, :3] if cross_attention else None
    block.eval()
    torch.testing.assert_close(block(x, context=context), block(x, context=context))
    block.train()
    assert not torch.allclose(block(x, context=context), block(x, context=context))
