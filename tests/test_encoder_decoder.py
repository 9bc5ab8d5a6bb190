"""The encoder–decoder model against `torch.nn.Transformer`, plus its masks, its configuration
and the label-smoothed loss."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_course import decoding, encoder_decoder, translation
from transformer_course.attention import set_fast_path
from transformer_course.encoder_decoder import (
    EncoderDecoderTransformer,
    Seq2SeqConfig,
    label_smoothed_cross_entropy,
    sinusoidal_positional_encoding,
)

PAD, BOS, EOS = 0, 1, 2


def small_config(**overrides) -> Seq2SeqConfig:
    settings = dict(
        src_vocab=23,
        tgt_vocab=19,
        d_model=16,
        n_heads=4,
        n_layers=2,
        d_mlp=24,
        dropout=0.0,
        max_len=32,
    )
    settings.update(overrides)
    return Seq2SeqConfig(**settings)


def batch_with_padding():
    # Rows of different lengths, right-padded; every row has at least one real token.
    src = torch.tensor(
        [[5, 6, 7, 8, 9, 10], [11, 12, 3, PAD, PAD, PAD], [4, PAD, PAD, PAD, PAD, PAD]]
    )
    tgt = torch.tensor([[BOS, 5, 6, 7, 8], [BOS, 9, PAD, PAD, PAD], [BOS, 3, 4, 5, PAD]])
    return src, tgt


def paper_positional_encoding(max_len: int, d_model: int) -> torch.Tensor:
    # Written out element by element from section 3.5 of Vaswani et al. (2017).
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    for pos in range(max_len):
        for i in range(d_model // 2):
            pe[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d_model))
            pe[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d_model))
    return pe


def test_positional_encoding_matches_the_paper():
    ours = sinusoidal_positional_encoding(50, 12)
    torch.testing.assert_close(ours.double(), paper_positional_encoding(50, 12), atol=1e-6, rtol=0)


def _copy_attention(ours, theirs: nn.MultiheadAttention, n_heads: int) -> None:
    d_model = theirs.embed_dim
    d_head = d_model // n_heads
    with torch.no_grad():
        for k, name in enumerate("QKV"):
            weight = theirs.in_proj_weight[
                k * d_model : (k + 1) * d_model
            ]  # (head*d_head, d_model)
            bias = theirs.in_proj_bias[k * d_model : (k + 1) * d_model]
            getattr(ours, f"W_{name}").copy_(
                weight.T.reshape(d_model, n_heads, d_head).permute(1, 0, 2)
            )
            getattr(ours, f"b_{name}").copy_(bias.reshape(n_heads, d_head))
        ours.W_O.copy_(theirs.out_proj.weight.T.reshape(n_heads, d_head, d_model))
        ours.b_O.copy_(theirs.out_proj.bias)


def _copy_norm(ours, theirs: nn.LayerNorm) -> None:
    with torch.no_grad():
        ours.w.copy_(theirs.weight)
        ours.b.copy_(theirs.bias)


def _copy_mlp(ours, linear1: nn.Linear, linear2: nn.Linear) -> None:
    with torch.no_grad():
        ours.W_in.copy_(linear1.weight.T)
        ours.b_in.copy_(linear1.bias)
        ours.W_out.copy_(linear2.weight.T)
        ours.b_out.copy_(linear2.bias)


def reference_transformer(cfg: Seq2SeqConfig) -> nn.Transformer:
    """torch's Transformer with the same norm placement; post-LN stacks without an extra final
    norm."""
    kwargs = dict(
        d_model=cfg.d_model,
        nhead=cfg.n_heads,
        dim_feedforward=cfg.d_mlp,
        dropout=0.0,
        batch_first=True,
        norm_first=cfg.norm == "pre",
        activation=cfg.act_fn,
    )
    final = (lambda: nn.LayerNorm(cfg.d_model)) if cfg.norm == "pre" else (lambda: None)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(**kwargs), cfg.n_layers, norm=final(), enable_nested_tensor=False
    )
    decoder = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(**kwargs), cfg.n_layers, norm=final()
    )
    return nn.Transformer(
        d_model=cfg.d_model,
        nhead=cfg.n_heads,
        custom_encoder=encoder,
        custom_decoder=decoder,
        batch_first=True,
    )


def map_weights(ours: EncoderDecoderTransformer, theirs: nn.Transformer) -> None:
    for block, layer in zip(ours.encoder, theirs.encoder.layers):
        _copy_attention(block.attn, layer.self_attn, ours.cfg.n_heads)
        _copy_mlp(block.mlp, layer.linear1, layer.linear2)
        _copy_norm(block.ln1, layer.norm1)
        _copy_norm(block.ln2, layer.norm2)
    for block, layer in zip(ours.decoder, theirs.decoder.layers):
        _copy_attention(block.attn, layer.self_attn, ours.cfg.n_heads)
        _copy_attention(block.cross_attn, layer.multihead_attn, ours.cfg.n_heads)
        _copy_mlp(block.mlp, layer.linear1, layer.linear2)
        _copy_norm(block.ln1, layer.norm1)
        _copy_norm(block.ln_cross, layer.norm2)
        _copy_norm(block.ln2, layer.norm3)
    if ours.cfg.norm == "pre":
        _copy_norm(ours.ln_enc, theirs.encoder.norm)
        _copy_norm(ours.ln_dec, theirs.decoder.norm)


def reference_logits(
    ours: EncoderDecoderTransformer, theirs: nn.Transformer, src, tgt
) -> torch.Tensor:
    """Embeddings, masks and the output projection written independently around torch's
    Transformer."""
    cfg = ours.cfg
    dtype = ours.b_U.dtype
    pe = paper_positional_encoding(cfg.max_len, cfg.d_model).to(dtype)

    def embed(tokens, W_E):
        return F.embedding(tokens, W_E) * math.sqrt(cfg.d_model) + pe[: tokens.shape[1]]

    # torch's boolean masks mean the opposite of ours: True = may NOT attend.
    causal = torch.triu(torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool), diagonal=1)
    out = theirs(
        embed(src, ours.src_embed.W_E),
        embed(tgt, ours.tgt_embed.W_E),
        tgt_mask=causal,
        src_key_padding_mask=src == PAD,
        tgt_key_padding_mask=tgt == PAD,
        memory_key_padding_mask=src == PAD,
    )
    return out @ ours.W_U + ours.b_U


@pytest.mark.parametrize(
    ("norm", "act_fn", "dtype", "atol"),
    [
        ("post", "relu", torch.float64, 1e-10),
        ("pre", "gelu", torch.float64, 1e-10),
        ("post", "relu", torch.float32, 2e-5),
    ],
)
def test_equals_torch_transformer(norm, act_fn, dtype, atol):
    torch.manual_seed(0)
    cfg = small_config(norm=norm, act_fn=act_fn)
    theirs = reference_transformer(cfg).to(dtype)
    ours = EncoderDecoderTransformer(cfg).to(dtype)
    map_weights(ours, theirs)
    src, tgt = batch_with_padding()
    theirs.train()  # keeps torch off its inference fast path, which skips padded positions
    torch.testing.assert_close(
        ours(src, tgt), reference_logits(ours, theirs, src, tgt), atol=atol, rtol=0
    )
    set_fast_path(ours, True)  # the SDPA path computes the same thing
    torch.testing.assert_close(
        ours(src, tgt), reference_logits(ours, theirs, src, tgt), atol=atol, rtol=0
    )


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_does_not_change_real_positions(norm):
    torch.manual_seed(1)
    model = EncoderDecoderTransformer(small_config(norm=norm)).double()
    src = torch.tensor([[5, 6, 7]])
    tgt = torch.tensor([[BOS, 8, 9]])
    alone = model(src, tgt)
    padded = model(F.pad(src, (0, 4), value=PAD), F.pad(tgt, (0, 2), value=PAD))
    torch.testing.assert_close(padded[:, :3], alone, atol=1e-12, rtol=0)


def test_decoder_is_causal():
    torch.manual_seed(2)
    model = EncoderDecoderTransformer(small_config()).double()
    src = torch.tensor([[5, 6, 7, 8]])
    tgt = torch.tensor([[BOS, 3, 4, 5, 6]])
    changed = tgt.clone()
    changed[0, 3:] = torch.tensor([9, 10])
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(
        a[:, :3], b[:, :3], atol=1e-12, rtol=0
    )  # the future cannot leak back
    assert (a[:, 3:] - b[:, 3:]).abs().max() > 1e-3  # while the changed positions do change


def test_tied_and_shared_embeddings_are_one_matrix():
    model = EncoderDecoderTransformer(
        small_config(src_vocab=19, share_embeddings=True, tie_embeddings=True)
    )
    assert model.src_embed is model.tgt_embed and not hasattr(model, "W_U")
    src, tgt = batch_with_padding()
    x = model.decode(tgt, model.encode(src), model.src_mask(src))
    assert x.shape == (3, 5, 19)
    with pytest.raises(ValueError, match="share_embeddings"):
        small_config(share_embeddings=True)


def test_bad_input_gets_clear_errors():
    model = EncoderDecoderTransformer(small_config())
    with pytest.raises(ValueError, match=r"src: expected at most n_ctx=32 positions, got 40"):
        model(torch.ones(1, 40, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tgt: expected ids in \[0, d_vocab=19\)"):
        model(torch.ones(1, 4, dtype=torch.long), torch.full((1, 3), 19))
    with pytest.raises(TypeError, match="src: expected an integer tensor"):
        model(torch.ones(1, 4), torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="d_model"):
        small_config(d_model=15, n_heads=3)


def test_label_smoothing_matches_torch():
    torch.manual_seed(3)
    logits = torch.randn(4, 7, 11, dtype=torch.float64)
    targets = torch.randint(1, 11, (4, 7))
    targets[1, 4:] = PAD
    ours = label_smoothed_cross_entropy(logits, targets, smoothing=0.1, ignore_index=PAD)
    theirs = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1, ignore_index=PAD
    )
    torch.testing.assert_close(ours, theirs.float(), atol=1e-6, rtol=0)
    plain = label_smoothed_cross_entropy(logits, targets, smoothing=0.0)
    torch.testing.assert_close(
        plain, F.cross_entropy(logits.flatten(0, 1), targets.flatten()).float(), atol=1e-6, rtol=0
    )


# ---- bad input by kind ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.float16])
def test_token_tensors_of_a_non_index_dtype_are_refused(dtype):
    """uint8 and bool tensors would index W_E as a boolean mask, not as ids."""
    model = EncoderDecoderTransformer(small_config())
    src, tgt = batch_with_padding()
    with pytest.raises(TypeError, match=rf"src: expected an integer tensor .* got {dtype}"):
        model(src.to(dtype), tgt)
    with pytest.raises(TypeError, match=rf"tgt: expected an integer tensor .* got {dtype}"):
        model(src, tgt.to(dtype))


def test_int32_tokens_give_the_same_logits():
    model = EncoderDecoderTransformer(small_config())
    src, tgt = batch_with_padding()
    torch.testing.assert_close(model(src.int(), tgt.int()), model(src, tgt), atol=0, rtol=0)


def test_zero_length_tokens_are_named():
    model = EncoderDecoderTransformer(small_config())
    src, tgt = batch_with_padding()
    with pytest.raises(ValueError, match=r"tgt: expected .* at least one position, got \(3, 0"):
        model(src, tgt[:, :0])
    with pytest.raises(ValueError, match=r"src: expected .* at least one position, got \(3, 0"):
        model(src[:, :0], tgt)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(pad_id=19), r"pad_id: expected an int id in \[0, 19\), got 19"),
        (dict(pad_id=1.5), r"pad_id: expected an int id .* got 1.5"),
        (dict(layer_norm_eps=0.0), "eps: expected a finite number"),
        (dict(act_fn="swish"), "act_fn: expected one of"),
    ],
)
def test_config_is_validated_before_building(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


def test_the_papers_d_ff_sets_and_reads_d_mlp():
    """COURSE.md's contract writes the MLP width as `d_ff`, the paper's name, in the sixth slot."""
    by_name = Seq2SeqConfig(src_vocab=11, tgt_vocab=11, d_ff=64)
    by_position = Seq2SeqConfig(11, 11, 32, 4, 2, 64)
    assert by_name.d_mlp == by_name.d_ff == by_position.d_mlp == by_position.d_ff == 64
    assert "d_ff" not in {f.name for f in dataclasses.fields(by_name)}  # one field, two names
    assert dataclasses.replace(by_name, d_model=64).d_mlp == 64
    assert Seq2SeqConfig(11, 11, d_mlp=96).d_ff == 96
    with pytest.raises(ValueError, match="d_ff: .* got d_ff=64 and d_mlp=96"):
        Seq2SeqConfig(11, 11, d_mlp=96, d_ff=64)
    with pytest.raises(ValueError, match="d_mlp: expected a positive int, got 0"):
        Seq2SeqConfig(11, 11, d_ff=0)
    model = EncoderDecoderTransformer(Seq2SeqConfig(11, 11, 16, 4, 1, d_ff=40))
    assert model.encoder[0].mlp.d_mlp == model.decoder[0].mlp.d_mlp == 40


def test_blocks_are_the_one_transformer_block_with_hooks():
    model = EncoderDecoderTransformer(small_config(dropout=0.1))
    encoder, decoder = model.encoder[0], model.decoder[0]
    assert not encoder.causal and not encoder.cross_attention
    assert decoder.causal and decoder.cross_attention
    src, tgt = batch_with_padding()
    seen = []
    decoder.hook_cross_attn_out.add_hook(lambda tensor, hook: seen.append(tensor.shape))
    model.eval()(src, tgt)
    decoder.hook_cross_attn_out.remove_hooks()
    assert seen == [(3, 5, 16)]


def test_contract_names_are_found_in_encoder_decoder():
    """Decoding and `translate` live beside the chapter's other code; COURSE.md lists them here."""
    assert encoder_decoder.greedy_decode is decoding.greedy_decode
    assert encoder_decoder.beam_search is decoding.beam_search
    assert encoder_decoder.translate is translation.translate
    with pytest.raises(AttributeError, match="no attribute 'pad_batch'"):
        encoder_decoder.pad_batch  # noqa: B018
