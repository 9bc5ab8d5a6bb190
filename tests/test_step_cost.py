"""What a step costs (`transformer_course.step_cost`), against the tensors themselves on the CPU.

- Parameters and gradients: the models' own `numel()` and gradient bytes, exactly.
- AdamW's state after a step: the state tensors' bytes; exactly the formula's two running means
  for the course's AdamW, plus one 4-byte step counter per parameter tensor for PyTorch's.
- Activations: the bytes autograd saves (`SavedTensorBytes`), measured at batch 2 and batch 4
  and divided by the 2 x seq_len tokens between them, so what does not grow with the batch
  (the mask, the RoPE tables, einsum's copies of the weights) drops out. The formula itemises
  every tensor the einsum attention path saves: within 1% (we see < 0.02%). For a fused kernel
  it counts the kernel's saved output apart from the heads' input to W_O, and the keys and
  values repeated for every query head; on the CPU, GPT-2's two share memory, and so do the
  modern decoder's repeated keys and values when there is one key-value head: within 8% (we
  see the formula exact for the decoder with 2 key-value heads, up to 5.7% over otherwise).
- FLOPs: equal to `benchmarks/gpt2.py`'s count (nanoGPT's formula) for GPT-2, and within 2% of
  `torch.utils.flop_counter.FlopCounterMode` on a forward and backward (which counts the
  matmuls; the formula also counts the biases and norm gains, <1% at d_model 128).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from transformer_course.attention import set_fast_path
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.llama import Llama, LlamaConfig
from transformer_course.optim import AdamW
from transformer_course.step_cost import (
    SavedTensorBytes,
    StepCost,
    activation_bytes_per_token,
    flop_param_count,
    flops_per_token,
    param_count,
    step_cost,
)

ROOT = Path(__file__).resolve().parents[1]
V = 101
CONFIGS = {
    "gpt2": GPT2Config(d_model=48, n_layers=2, n_heads=4, d_vocab=V, n_ctx=32),
    "gpt2-tied": GPT2Config(
        d_model=48, n_layers=2, n_heads=4, d_vocab=V, n_ctx=32, tie_embeddings=True
    ),
    "gpt2-wide-heads": GPT2Config(
        d_model=48, n_layers=1, n_heads=3, d_head=20, d_mlp=100, d_vocab=V, n_ctx=32
    ),
    "llama": LlamaConfig(d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_vocab=V, n_ctx=32),
    "llama-tied": LlamaConfig(
        d_model=48, n_layers=2, n_heads=4, n_kv_heads=1, d_vocab=V, n_ctx=32, tie_embeddings=True
    ),
}
EINSUM_RTOL, FUSED_RTOL, FLOP_RTOL = 0.01, 0.08, 0.02


def build(cfg):
    torch.manual_seed(0)
    return GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)


def batch(cfg, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch_size)
    tokens = torch.randint(0, cfg.d_vocab, (batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", CONFIGS)
def test_parameters_gradients_and_adamw_state(name):
    cfg = CONFIGS[name]
    model = build(cfg)
    params = list(model.parameters())  # a tied W_E once
    assert param_count(cfg) == sum(p.numel() for p in params)
    cost = step_cost(cfg, 16, batch_size=2)
    assert cost.params == sum(p.numel() * p.element_size() for p in params)
    for optimizer_cls, counters in ((torch.optim.AdamW, 4 * len(params)), (AdamW, 0)):
        model = build(cfg)
        optimizer = optimizer_cls(model.parameters(), lr=1e-3)
        tokens, targets = batch(cfg, 2, 16)
        lm_loss(model(tokens), targets).backward()
        grads = [p.grad for p in model.parameters()]
        assert cost.grads == sum(g.numel() * g.element_size() for g in grads)
        optimizer.step()
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        assert sum(t.numel() * t.element_size() for t in state) == cost.adamw_state + counters


def measured_bytes_per_token(model, cfg, seq_len: int) -> float:
    saved = []
    for batch_size in (2, 4):  # not 1: einsum lays a batch of one out differently
        tokens, targets = batch(cfg, batch_size, seq_len)
        with SavedTensorBytes(exclude=model.parameters()) as counter:
            lm_loss(model(tokens), targets)
        saved.append(counter.bytes)
    return (saved[1] - saved[0]) / (2 * seq_len)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("fused", [False, True], ids=["einsum", "fused"])
def test_activations_per_token_match_what_autograd_saves(name, fused):
    cfg = CONFIGS[name]
    model = set_fast_path(build(cfg), fused)
    for seq_len in (8, 24):  # the einsum path's share grows with the context
        expected = activation_bytes_per_token(cfg, seq_len, fused_attention=fused)
        measured = measured_bytes_per_token(model, cfg, seq_len)
        assert measured == pytest.approx(expected, rel=FUSED_RTOL if fused else EINSUM_RTOL)


def test_attention_patterns_grow_with_the_context_a_fused_kernel_does_not():
    cfg = CONFIGS["gpt2"]
    per_position = 4 * cfg.n_layers * 2 * cfg.n_heads  # two float32 patterns per head
    einsum = [activation_bytes_per_token(cfg, n) for n in (8, 24)]
    assert einsum[1] - einsum[0] == per_position * 16
    fused = [activation_bytes_per_token(cfg, n, fused_attention=True) for n in (8, 24)]
    assert fused[0] == fused[1] < einsum[0]


def benchmark_module():
    spec = importlib.util.spec_from_file_location("benchmark_gpt2", ROOT / "benchmarks/gpt2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tied", [False, True])
def test_flops_equal_the_benchmarks_count(tied):
    benchmark = benchmark_module()
    cfg = GPT2Config(d_model=64, n_layers=3, n_heads=4, d_vocab=V, n_ctx=48, tie_embeddings=tied)
    model = build(cfg)
    assert flop_param_count(cfg) == benchmark.flop_params(model)
    for seq_len in (1, 17, 48):
        assert flops_per_token(cfg, seq_len) == benchmark.flops_per_token(model, seq_len)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_flops_match_the_matmuls_pytorch_counts(family):
    sizes = dict(d_model=128, n_layers=2, n_heads=4, d_vocab=V, n_ctx=64)
    cfg = GPT2Config(**sizes) if family == "gpt2" else LlamaConfig(**sizes, n_kv_heads=2)
    model = build(cfg)
    tokens, targets = batch(cfg, 2, 64)
    with FlopCounterMode(display=False) as counter:
        lm_loss(model(tokens), targets).backward()
    measured = counter.get_total_flops() / tokens.numel()
    assert flops_per_token(cfg, 64) == pytest.approx(measured, rel=FLOP_RTOL)


def test_step_cost_adds_up():
    cfg = GPT2Config()  # GPT-2 small
    cost = step_cost(cfg, 1024, batch_size=8)
    assert isinstance(cost, StepCost)
    # Hugging Face's 124,439,808, and the course's untied unembedding W_U and its bias b_U.
    assert cost.n_params == 124_439_808 + 768 * 50257 + 50257
    assert cost.params == cost.grads == cost.adamw_state / 2 == 4 * cost.n_params
    assert cost.tokens == 8192
    assert cost.activations == 8192 * activation_bytes_per_token(cfg, 1024)
    assert cost.total == 16 * cost.n_params + cost.activations
    assert cost.flops == 8192 * flops_per_token(cfg, 1024)
    assert "AdamW state" in str(cost) and "MiB" in str(cost)


def test_saved_tensor_bytes_counts_each_memory_block_once():
    x = torch.randn(10, 10, requires_grad=True)
    w = torch.randn(10, 10, requires_grad=True)
    with SavedTensorBytes() as saved:
        x @ w  # saves x and w
    assert saved.bytes == 2 * 400
    with SavedTensorBytes(exclude=[w]) as saved:
        x @ w
        x.t() @ x  # two views of x: one memory block
    assert saved.bytes == 400
    assert saved.shapes == [(10, 10)] * 4


def test_clear_errors():
    cfg = CONFIGS["gpt2"]
    with pytest.raises(TypeError, match="cfg: expected a GPT2Config or a LlamaConfig, got dict"):
        step_cost({}, 8)
    with pytest.raises(ValueError, match="seq_len: expected at most n_ctx=32, got 33"):
        step_cost(cfg, 33)
    with pytest.raises(ValueError, match="seq_len: expected a positive int, got 0"):
        flops_per_token(cfg, 0)
    with pytest.raises(ValueError, match="batch_size: expected a positive int, got 0"):
        step_cost(cfg, 8, batch_size=0)
    with pytest.raises(ValueError, match="fused_attention: expected True or False"):
        activation_bytes_per_token(cfg, 8, fused_attention="yes")
    with pytest.raises(TypeError, match=r"exclude\[0\]: expected a torch.Tensor"):
        SavedTensorBytes(exclude=[3])
