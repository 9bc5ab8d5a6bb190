"""The components on every device: the CPU always, CUDA when there is one (skipped otherwise).

Each component runs on the device, in float32 and under bfloat16 autocast, and is compared with
an independent reference (PyTorch, Hugging Face) computed in float32 **on the CPU**, so a GPU
runner tests the GPU kernels against known-good numbers. Tolerances:

- float32: `FLOAT32_ATOL` (1e-4) on values of order 1. CUDA does float32 matmuls in full
  precision by default (TF32 is off), so only summation order differs: ~1e-6.
- bf16 autocast: `BF16_RTOL` (4%) of the reference's largest magnitude. bf16 keeps 8 bits of
  mantissa (relative rounding 0.4% per op); through two layers the CPU shows 0.7-1%.

Also here: SDPA's flash kernel on the fast path with `causal=True` (no mask built), a few
training steps under `torch.compile`, a non-finite step skipped by the device's optimizer, and
chapter 10's tools on a model on the device (training log, attribution, patching, ablation,
circuits) against TransformerLens on the CPU.

FlashAttention-2 in Triton, compiled for the GPU (tests/test_flash_attention_triton.py runs the
same kernels in Triton's CPU interpreter), against SDPA and the course's `flash_attention` in
float32 on the CPU, output and gradients, on the same (rounded) inputs. Tolerances, as a share
of the reference's largest magnitude: `TRITON_RTOL`, bf16 2% and float16 0.4%. The output, the
pattern and dS are rounded to the input dtype before (or after) a matmul: bf16 keeps 8 bits of
mantissa (relative rounding up to 0.4% per value), float16 11 (0.05%). The same float16 cases in
Triton's CPU interpreter stay within 0.06% (SDPA's own half-precision math on the CPU: 0.09%
in float16, 0.9% in bf16). float32, whose matmuls run in full precision: `FLOAT32_ATOL`.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
import transformer_lens.patching as tl_patching

# Helpers shared with the CPU-only reference tests (pytest puts tests/ on sys.path).
from test_encoder_decoder import (
    batch_with_padding,
    map_weights,
    reference_logits,
    reference_transformer,
    small_config,
)
from test_gpt2 import TINY, hf_model
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformer_lens import FactoredMatrix

from transformer_course.ablation import head_ablation_losses
from transformer_course.attention import (
    MultiHeadAttention,
    scaled_dot_product_attention,
    set_fast_path,
)
from transformer_course.attention_only import (
    AttentionOnlyConfig,
    AttentionOnlyTransformer,
    to_hooked_transformer,
)
from transformer_course.attribution import attribution_names, logit_attribution
from transformer_course.circuits import full_ov_circuit, k_composition_scores
from transformer_course.encoder_decoder import EncoderDecoderTransformer, Seq2SeqConfig
from transformer_course.flash_attention import flash_attention
from transformer_course.flash_attention_triton import flash_attention_triton
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.head_detectors import induction_scores, repeated_tokens
from transformer_course.hooks import run_with_cache
from transformer_course.induction import train_induction
from transformer_course.layernorm import LayerNorm, RMSNorm
from transformer_course.masking import causal_mask, combine_masks, padding_mask
from transformer_course.patching import logit_difference, patch_head_all_pos, patch_residual
from transformer_course.training import (
    CHECKPOINT_NAME,
    TrainConfig,
    compiled_blocks,
    read_checkpoint,
    train,
)
from transformer_course.translation import seq2seq_loss

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
PRECISIONS = ["float32", "bf16"]
FLOAT32_ATOL = 1e-4
BF16_RTOL = 0.04
TRITON_RTOL = {torch.bfloat16: 0.02, torch.float16: 0.004}


def run_on(device: str, precision: str, fn, *args):
    """`fn(*args)` on `device`, no gradients, bf16 autocast if asked, as float32 on the CPU."""
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = fn(*args)
    return out.float().cpu()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, precision: str) -> None:
    assert actual.shape == expected.shape and actual.isfinite().all()
    atol = FLOAT32_ATOL if precision == "float32" else BF16_RTOL * expected.abs().max().item()
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def to(device: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_masks_are_built_on_the_device(device):
    mask = causal_mask(5, 7, device=device)
    assert mask.device.type == device
    # Written out independently: query i (aligned to the last keys) sees keys 0 .. i + 2.
    expected = torch.tensor([[j <= i + 2 for j in range(7)] for i in range(5)])
    assert torch.equal(mask.cpu(), expected)
    tokens = torch.tensor([[3, 4, 0], [5, 0, 0]], device=device)
    expected = torch.tensor([[[[1, 1, 0]]], [[[1, 0, 0]]]], dtype=torch.bool)
    assert torch.equal(padding_mask(tokens, 0).cpu(), expected)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_attention_matches_torch_sdpa(device, precision):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=generator) for _ in range(3))
    mask = combine_masks(causal_mask(6), torch.rand(2, 1, 1, 6, generator=generator) > 0.3)
    mask[..., 0] = True  # every query keeps a key: SDPA's output for a fully masked row is NaN
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = lambda *t: scaled_dot_product_attention(*t)[0]  # noqa: E731
    actual = run_on(device, precision, ours, *to(device, q, k, v, mask))
    assert_matches(actual, expected, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_norms_match_torch(device, precision):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 16, generator=generator) * 3 + 1
    for ours, reference in (
        (LayerNorm(16), lambda m: F.layer_norm(x, (16,), m.w, m.b, 1e-5)),
        (RMSNorm(16), lambda m: F.rms_norm(x, (16,), m.w, 1e-6)),
    ):
        with torch.no_grad():
            for param in ours.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
        expected = reference(ours).detach()
        actual = run_on(device, precision, ours.to(device), x.to(device))
        assert_matches(actual, expected, precision)


def reference_self_attention(mha: MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor):
    """Multi-head attention written with torch's SDPA and plain matmuls, on the CPU in float32."""
    q, k, v = (
        (x @ W.transpose(0, 1).flatten(1)).unflatten(-1, W.shape[::2]) + b
        for W, b in ((mha.W_Q, mha.b_Q), (mha.W_K, mha.b_K), (mha.W_V, mha.b_V))
    )
    z = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    return z.transpose(1, 2).flatten(2) @ mha.W_O.flatten(0, 1) + mha.b_O


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_multi_head_attention_fast_causal_path_matches_the_masked_reference(device, precision):
    torch.manual_seed(2)
    mha = MultiHeadAttention(16, 4)
    with torch.no_grad():
        for param in mha.parameters():
            param.normal_(std=0.3)
    x = torch.randn(2, 7, 16)
    keep = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])[:, None, None, :]
    with torch.no_grad():
        causal = reference_self_attention(mha, x, causal_mask(7))
        causal_and_padding = reference_self_attention(mha, x, causal_mask(7) & keep)
    mha.to(device)
    x_dev, keep_dev = to(device, x, keep)
    for fast in (False, True):
        mha.fast_path = fast
        causal_only = run_on(device, precision, lambda: mha(x_dev, causal=True))
        assert_matches(causal_only, causal, precision)
        padded = run_on(device, precision, lambda: mha(x_dev, mask=keep_dev, causal=True))
        assert_matches(padded, causal_and_padding, precision)
        # causal=True is the same as passing the causal mask.
        explicit = run_on(device, precision, lambda: mha(x_dev, mask=causal_mask(7, device=device)))
        assert_matches(causal_only, explicit, precision)
        # Fewer queries than keys: the last query sees every key (causal_mask's KV-cache alignment).
        shorter = run_on(device, precision, lambda: mha(x_dev[:, 3:], context=x_dev, causal=True))
        assert_matches(shorter, causal[:, 3:], precision)


@pytest.mark.parametrize("device", DEVICES)
def test_fast_causal_path_runs_on_the_flash_kernel(device):
    """With only the flash backend allowed, SDPA raises unless it can use it (on CUDA a
    materialised mask rules it out). On CUDA flash needs half precision: bf16 autocast there."""
    torch.manual_seed(3)
    mha = MultiHeadAttention(64, 4, fast_path=True)
    x = torch.randn(2, 32, 64)
    with torch.no_grad():
        expected = reference_self_attention(mha, x, causal_mask(32))
    precision = "bf16" if device == "cuda" else "float32"
    mha.to(device)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        actual = run_on(device, precision, lambda: mha(x.to(device), causal=True))
    assert_matches(actual, expected, precision)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_gpt2_matches_hugging_face(device, precision, fast):
    reference = hf_model()
    ours = set_fast_path(GPT2.from_huggingface(reference).eval(), fast).to(device)
    shape = (3, TINY["n_positions"])
    tokens = torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(tokens).logits
    assert_matches(run_on(device, precision, ours, tokens.to(device)), expected, precision)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("device", DEVICES)
def test_encoder_decoder_matches_torch_transformer(device, precision, fast):
    torch.manual_seed(5)
    cfg = small_config(norm="post", act_fn="relu")
    theirs = reference_transformer(cfg).train()  # train mode: torch's padding-skipping path is off
    ours = EncoderDecoderTransformer(cfg).eval()
    map_weights(ours, theirs)
    src, tgt = batch_with_padding()
    with torch.no_grad():
        expected = reference_logits(ours, theirs, src, tgt)
    set_fast_path(ours, fast)
    actual = run_on(device, precision, ours.to(device), *to(device, src, tgt))
    assert_matches(actual, expected, precision)


# (dtype, leading dims, n_queries, n_keys, d, causal): a causal 1k context in both half
# precisions; lengths that are not multiples of a tile, more keys than queries (a KV cache's
# queries) and more queries than keys; every head dim.
TRITON_CASES = [
    (torch.bfloat16, (2, 4), 1024, 1024, 64, True),
    (torch.float16, (2, 4), 1024, 1024, 64, True),
    (torch.bfloat16, (3,), 1000, 1100, 128, True),
    (torch.float16, (2, 2), 777, 555, 32, False),
    (torch.float32, (2,), 100, 300, 16, True),
    (torch.float32, (1, 2), 64, 64, 128, False),
]


@CUDA
@pytest.mark.parametrize(("dtype", "lead", "n_queries", "n_keys", "d", "causal"), TRITON_CASES)
def test_triton_flash_attention_matches_sdpa_and_flash_attention(
    dtype, lead, n_queries, n_keys, d, causal
):
    pytest.importorskip("triton", reason="Triton is not installed")
    generator = torch.Generator().manual_seed(9)
    q, k, v, grad_out = (
        torch.randn(*lead, n, d, generator=generator).to(dtype)
        for n in (n_queries, n_keys, n_keys, n_queries)
    )
    on_gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    out = flash_attention_triton(*on_gpu, causal)
    grads = torch.autograd.grad(out, on_gpu, grad_out.cuda())
    assert all(t.dtype == dtype for t in (out, *grads))
    actual = [t.float().cpu() for t in (out, *grads)]
    inputs = [t.float().requires_grad_() for t in (q, k, v)]
    mask = causal_mask(n_queries, n_keys) if causal else None
    for reference in (
        F.scaled_dot_product_attention(*inputs, attn_mask=mask),
        flash_attention(*inputs, causal),
    ):
        expected = [reference, *torch.autograd.grad(reference, inputs, grad_out.float())]
        for name, got, want in zip(("out", "dq", "dk", "dv"), actual, expected):
            want = want.detach()
            atol = FLOAT32_ATOL
            if dtype != torch.float32:
                atol = TRITON_RTOL[dtype] * want.abs().max().item()
            assert got.shape == want.shape and got.isfinite().all(), name
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=name)


def tiny_training_run(device: str, *, compiled: bool, **settings):
    torch.manual_seed(6)
    cfg = GPT2Config(d_model=32, n_layers=1, n_heads=4, d_vocab=61, n_ctx=16)
    model = set_fast_path(GPT2(cfg)).to(device)
    if compiled:
        # Inductor on the GPU; on the CPU aot_eager traces the same graphs without compiling C++.
        model.compile(backend="inductor" if device == "cuda" else "aot_eager", fullgraph=True)
    data = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(7)).to(device)
    cfg = TrainConfig(max_steps=6, lr=3e-3, log_every=3, progress=False, **settings)
    return train(model, cfg, lambda step: data, lambda m, b: lm_loss(m(b[:, :-1]), b[:, 1:]))


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), DEVICES[1]])
def test_a_few_training_steps_under_torch_compile_match_eager(device):
    """Under bf16 autocast on CUDA (the loop's default) compiled kernels round differently: 2%."""
    eager = tiny_training_run(device, compiled=False)
    compiled = tiny_training_run(device, compiled=True)
    assert all(math.isfinite(loss) for loss in compiled.train_loss)
    assert compiled.train_loss[-1] < compiled.train_loss[0]
    rtol = 0.02 if device == "cuda" else 1e-5
    assert compiled.train_loss == pytest.approx(eager.train_loss, rel=rtol)


@CUDA
def test_compiled_blocks_train_the_encoder_decoder_as_eager_on_cuda():
    """Chapter 5's full profile on a GPU: padded batches at the bucket lengths (12 is no multiple
    of 8, as the memory-efficient attention kernel likes its mask), bf16 autocast: 2%."""
    cfg = Seq2SeqConfig(
        src_vocab=97, tgt_vocab=97, d_model=64, n_heads=4, n_layers=2, d_mlp=128, dropout=0.0,
        n_ctx=64, pad_id=0, share_embeddings=True, tie_embeddings=True,
    )  # fmt: skip
    lengths = [(12, 8), (24, 12), (8, 8), (12, 24)]
    generator = torch.Generator().manual_seed(3)
    batches = []
    for src_len, tgt_len in lengths:
        src = torch.randint(1, 97, (8, src_len), generator=generator)
        tgt = torch.randint(1, 97, (8, tgt_len + 1), generator=generator)
        src[::2, -3:], tgt[1::2, -4:] = 0, 0
        batches.append(tuple(t.cuda() for t in (src, tgt[:, :-1], tgt[:, 1:])))
    runs = []
    for compiled in (False, True):
        torch.manual_seed(4)
        model = set_fast_path(EncoderDecoderTransformer(cfg)).cuda()
        blocks = [*model.encoder, *model.decoder]
        train_cfg = TrainConfig(max_steps=8, lr=1e-3, log_every=4, progress=False)
        with compiled_blocks(blocks, fullgraph=True) if compiled else nullcontext():
            runs.append(train(model, train_cfg, lambda step: batches[step % 4], seq2seq_loss))
    eager, compiled = runs
    assert all(math.isfinite(loss) for loss in compiled.train_loss)
    assert compiled.train_loss == pytest.approx(eager.train_loss, rel=0.02)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_step_is_not_taken_on_the_device(device, fused, tmp_path):
    torch.manual_seed(8)
    model = nn.Linear(4, 1).to(device)
    x = torch.randn(8, 4, device=device)

    def get_batch(step):
        return x * (math.nan if step == 4 else 1.0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    cfg = TrainConfig(
        max_steps=8,
        lr=1e-2,
        log_every=6,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
        progress=False,
    )
    with pytest.raises(FloatingPointError, match="step 4"):
        train(model, cfg, get_batch, lambda m, b: m(b).square().mean(), optimizer=optimizer)
    assert all(p.isfinite().all() for p in model.parameters())  # NaN step skipped, the next taken
    saved = read_checkpoint(tmp_path / CHECKPOINT_NAME)
    assert saved["step"] == 4  # written before step 4; nothing after it
    assert all(t.isfinite().all() for t in saved["model"].values())


@pytest.mark.parametrize("device", DEVICES)
def test_interpretability_tools_on_the_device_match_transformer_lens(device):
    """Chapter 10 as book page 10 runs it on a GPU: an attention-only model trained on the device,
    then its attribution, patching and circuits, each on the device (patching's as TransformerLens
    puts its own) and equal, in float32, to TransformerLens on the CPU; mean-ablation equal to
    the same on the CPU (TransformerLens has none)."""
    cfg = AttentionOnlyConfig(
        d_model=32, n_layers=2, n_heads=4, d_vocab=16, n_ctx=16, normalization_type=None,
        init_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AttentionOnlyTransformer(cfg).to(device)
    run = train_induction(model, steps=3, batch_size=4, eval_every=2, seed=0)
    assert run.steps == [0, 2, 3] and run.scores.shape == (3, 2, 4) and run.scores.isfinite().all()
    model.eval()
    reference = to_hooked_transformer(copy.deepcopy(model).cpu())
    tokens = repeated_tokens(4, 4, cfg.d_vocab, seed=1)
    corrupted = tokens.clone()
    corrupted[:, 3] = (tokens[:, 3] + 1) % cfg.d_vocab
    here, corrupted_here = to(device, tokens, corrupted)

    def metric(logits):
        answer, wrong = to(logits.device, tokens[:, 3], corrupted[:, 3])
        return logit_difference(logits, answer, wrong, position=-2)

    def close(actual, expected):
        assert actual.device.type == device
        torch.testing.assert_close(actual.detach().cpu(), expected, atol=FLOAT32_ATOL, rtol=0)

    with torch.no_grad():
        _, cache = run_with_cache(model, here, attribution_names(model))
        parts, _ = logit_attribution(model, cache, here)
        right = reference(tokens)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
        close(parts.sum(0), right)
        _, lens_cache = reference.run_with_cache(tokens)
        name = "blocks.1.attn.hook_pattern"
        _, cache = run_with_cache(model, here, [name])
        close(induction_scores(cache[name], 4), induction_scores(lens_cache[name], 4))
        lens_ov = FactoredMatrix(
            reference.W_E @ reference.W_V[1, 2], reference.W_O[1, 2] @ reference.W_U
        )
        close(full_ov_circuit(model, 1, 2), lens_ov.AB)
        k_scores = reference.all_composition_scores("K")[0, :, 1, :]
        close(k_composition_scores(model), k_scores)
    patched = patch_residual(model, here, corrupted_here, metric)
    by_head = patch_head_all_pos(model, here, corrupted_here, metric)
    close(patched, tl_patching.get_act_patch_resid_pre(reference, corrupted, lens_cache, metric))
    lens_head = tl_patching.get_act_patch_attn_head_out_all_pos
    close(by_head, lens_head(reference, corrupted, lens_cache, metric))
    hooked = to_hooked_transformer(model)  # TransformerLens on the device, as on book page 10
    _, device_cache = hooked.run_with_cache(here)
    lens_patched = tl_patching.get_act_patch_resid_pre(hooked, corrupted_here, device_cache, metric)
    assert (patched - lens_patched).abs().max() < FLOAT32_ATOL  # as book page 10 compares them
    ablated = head_ablation_losses(model, here, kind="mean")
    assert ablated.isfinite().all()
    torch.testing.assert_close(
        ablated, head_ablation_losses(copy.deepcopy(model).cpu(), tokens, kind="mean"),
        atol=FLOAT32_ATOL, rtol=0,
    )  # fmt: skip
