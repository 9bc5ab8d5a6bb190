"""MLP and TransformerBlock against TransformerLens (pre-LN) and torch.nn.TransformerEncoderLayer (post-LN).

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

from transformer_course.blocks import MLP, TransformerBlock
from transformer_course.masking import padding_mask

D_MODEL, N_HEADS, D_HEAD, D_MLP = 32, 4, 8, 128


def tl_config(dtype: torch.dtype, act_fn: str = "gelu_new") -> HookedTransformerConfig:
    return HookedTransformerConfig(
        n_layers=1, d_model=D_MODEL, n_heads=N_HEADS, d_head=D_HEAD, d_mlp=D_MLP, n_ctx=16,
        d_vocab=50, act_fn=act_fn, normalization_type="LN", dtype=dtype,
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
    """GPT-2's gelu, written out from the paper's formula (Hendrycks & Gimpel's tanh approximation)."""
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
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, norm="pre", act_fn="gelu_new").to(dtype)
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
    names = ["hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post",
             "ln1.hook_scale", "attn.hook_pattern", "mlp.hook_post"]
    seen: dict[str, torch.Tensor] = {}
    for prefix, module in (("ours", ours), ("tl", reference)):
        modules = dict(module.named_modules())
        for name in names:
            modules[name].register_forward_hook(lambda _m, _i, out, key=f"{prefix}.{name}": seen.__setitem__(key, out))
        module(resid)
    for name in names:
        torch.testing.assert_close(seen[f"ours.{name}"], seen[f"tl.{name}"], atol=1e-10, rtol=0, msg=name)


def encoder_layer_state(layer: torch.nn.TransformerEncoderLayer) -> dict[str, torch.Tensor]:
    """Map nn.TransformerEncoderLayer weights (x @ W.T, heads concatenated) to our names."""
    q, k, v = layer.self_attn.in_proj_weight.chunk(3)
    bq, bk, bv = layer.self_attn.in_proj_bias.chunk(3)
    per_head = "(head d_head) d_model -> head d_model d_head"
    return {
        "attn.W_Q": einops.rearrange(q, per_head, head=N_HEADS),
        "attn.W_K": einops.rearrange(k, per_head, head=N_HEADS),
        "attn.W_V": einops.rearrange(v, per_head, head=N_HEADS),
        "attn.b_Q": einops.rearrange(bq, "(head d_head) -> head d_head", head=N_HEADS),
        "attn.b_K": einops.rearrange(bk, "(head d_head) -> head d_head", head=N_HEADS),
        "attn.b_V": einops.rearrange(bv, "(head d_head) -> head d_head", head=N_HEADS),
        "attn.W_O": einops.rearrange(layer.self_attn.out_proj.weight, "d_model (head d_head) -> head d_head d_model", head=N_HEADS),
        "attn.b_O": layer.self_attn.out_proj.bias,
        "ln1.w": layer.norm1.weight, "ln1.b": layer.norm1.bias,
        "ln2.w": layer.norm2.weight, "ln2.b": layer.norm2.bias,
        "mlp.W_in": layer.linear1.weight.T, "mlp.b_in": layer.linear1.bias,
        "mlp.W_out": layer.linear2.weight.T, "mlp.b_out": layer.linear2.bias,
    }


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_post_ln_block_matches_torch_encoder_layer_with_causal_mask(dtype, atol):
    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.TransformerEncoderLayer(
        D_MODEL, N_HEADS, dim_feedforward=D_MLP, dropout=0.0, activation="gelu",
        batch_first=True, norm_first=False, dtype=dtype,
    ).eval()
    randomize_(reference, generator)
    ours = TransformerBlock(D_MODEL, N_HEADS, D_HEAD, D_MLP, norm="post", act_fn="gelu").to(dtype)
    ours.load_state_dict(encoder_layer_state(reference), strict=True)
    x = torch.randn(3, 9, D_MODEL, generator=generator, dtype=dtype)
    future = torch.nn.Transformer.generate_square_subsequent_mask(9, dtype=dtype)  # -inf above the diagonal
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
    with pytest.raises(ValueError, match="norm: expected 'pre' or 'post', got 'middle'"):
        TransformerBlock(8, 2, 4, 32, norm="middle")
    block = TransformerBlock(8, 2, 4, 32)
    with pytest.raises(ValueError, match=r"resid: expected last dim d_model=8, got 6"):
        block(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"resid: expected shape \(batch, pos, d_model=8\), got shape \(3, 8\)"):
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
