"""What one training step costs: memory (parameters, gradients, AdamW's state, activations) and
FLOPs, from a model's configuration alone, for the course's GPT-2 and its modern decoder.

In float32 with AdamW every parameter costs 16 bytes whatever the batch: 4 for itself, 4 for
its gradient and 8 for AdamW's two running means. Activations, the tensors autograd saves in the
forward for the backward, cost bytes per token instead, and attention's share grows with the
context: the einsum attention keeps each head's n_ctx x n_ctx pattern, a fused (FlashAttention)
kernel only each query's log-sum-exp. FLOPs are counted as nanoGPT's `estimate_mfu` counts them
(and `benchmarks/gpt2.py`): per token, `6 N + 12 L H Q T` (see `flops_per_token`).

The counts are checked against the tensors themselves: `SavedTensorBytes` measures what autograd
saves, which is the activation memory a step holds at the end of its forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from transformer_course import validate
from transformer_course.gpt2 import GPT2, GPT2Config
from transformer_course.llama import Llama, LlamaConfig

__all__ = [
    "FLOAT32_BYTES",
    "param_count",
    "flop_param_count",
    "flops_per_token",
    "activation_bytes_per_token",
    "StepCost",
    "step_cost",
    "SavedTensorBytes",
    "collective_bytes_per_step",
]

FLOAT32_BYTES = 4
ID_BYTES = 8  # an int64 token id


def param_count(cfg: GPT2Config | LlamaConfig) -> int:
    """The number of parameters of `GPT2(cfg)` or `Llama(cfg)`, a tied embedding counted once.

    Course: chapter 8, exercise 8.1, checked by checks.scaling.check_param_count.
    """
    d, v, n_heads, d_head = cfg.d_model, cfg.d_vocab, cfg.n_heads, cfg.d_head
    if _is_gpt2(cfg):
        attention = 4 * n_heads * d * d_head + 3 * n_heads * d_head + d  # W_Q W_K W_V W_O, biases
        mlp = 2 * d * cfg.d_mlp + cfg.d_mlp + d  # W_in W_out, b_in b_out
        block = 2 * 2 * d + attention + mlp  # two layer norms, w and b each
        embeddings = v * d + cfg.n_ctx * d  # W_E, W_pos
        unembed = v + (0 if cfg.tie_embeddings else d * v)  # b_U, and W_U unless tied
        return embeddings + cfg.n_layers * block + 2 * d + unembed
    d_kv = cfg.n_kv_heads * d_head
    attention = 2 * n_heads * d * d_head + 2 * d * d_kv  # W_Q W_O, and the fewer W_K W_V
    block = 2 * d + attention + 3 * d * cfg.d_mlp  # two RMSNorms (w only), SwiGLU
    unembed = 0 if cfg.tie_embeddings else d * v
    return v * d + cfg.n_layers * block + d + unembed


def flop_param_count(cfg: GPT2Config | LlamaConfig) -> int:
    """N in the FLOP count: the parameters that do matmul work for each token. The embedding
    tables are left out (a lookup costs no FLOPs) and the unembedding counted (for a tied model,
    `W_E` once, as the unembedding), as `benchmarks/gpt2.py` counts them.

    Course: chapter 8.
    """
    lookups = cfg.d_model * (cfg.d_vocab + (cfg.n_ctx if _is_gpt2(cfg) else 0))  # W_E, W_pos
    tied = cfg.d_vocab * cfg.d_model if cfg.tie_embeddings else 0
    return param_count(cfg) - lookups + tied


def flops_per_token(cfg: GPT2Config | LlamaConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward and backward) at context `seq_len`: 6 N + 12 L H Q T.

    A matmul's multiply-add is 2 FLOPs per parameter and token in the forward, and the backward
    does it twice (once for the inputs' gradients, once for the weights'): 6 N. Attention's two
    matmuls, scores `q k^T` and the weighted sum of values, have no parameters: 2 x 2 H Q T per
    token and layer in the forward, three times that with the backward (L layers, H query heads
    of size Q, T positions). Causal attention could skip half of them; the count does not.

    Course: chapter 8, exercise 8.2, checked by checks.scaling.check_flops_per_token.
    """
    validate.positive_int("seq_len", seq_len)
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.d_head * seq_len
    return 6 * flop_param_count(cfg) + attention


def activation_bytes_per_token(
    cfg: GPT2Config | LlamaConfig, seq_len: int, *, fused_attention: bool = False
) -> int:
    """The bytes autograd saves for the backward, per token, in float32 at context `seq_len`.

    Each block saves (counting float32 values; d = d_model, a = n_heads * d_head, f = d_mlp):

    - each of its two norms: the vector it normalises, the normalised vector, and one scale per
      token: 2 d + 1;
    - attention: its input (d); the queries, keys and values, keys and values with every query
      head's copy (3 a); the heads' outputs before W_O (a); and the pattern, one n_ctx-long row
      per head and query: GPT-2 keeps it twice (the softmax, then the masked pattern it
      multiplies the values with: 2 H T), the modern decoder once (H T). A fused kernel (with
      `fused_attention=True`, `attention.set_fast_path`) keeps no pattern: its output (a) and
      each head's log-sum-exp (H) instead, as FlashAttention does;
    - the MLP: its input (d) and GPT-2's pre- and post-GELU neurons (2 f), or for SwiGLU the
      gate, its sigmoid, silu(gate), the linear path and their product (5 f).

    Then the final norm (2 d + 1), the unembedding's input (d), the log-softmax of the logits
    in the loss (d_vocab) and the token ids and targets (int64). Dropout (off by default) would
    add its masks; they are not counted.

    Course: chapter 8.
    """
    validate.positive_int("seq_len", seq_len)
    validate.flag("fused_attention", fused_attention)
    d, f, n_heads = cfg.d_model, cfg.d_mlp, cfg.n_heads
    a = n_heads * cfg.d_head
    norm = 2 * d + 1
    gpt2 = _is_gpt2(cfg)
    if fused_attention:
        pattern = a + n_heads  # the kernel's output and log-sum-exp
    else:
        pattern = (2 if gpt2 else 1) * n_heads * seq_len
    attention = d + 3 * a + a + pattern
    mlp = d + (2 if gpt2 else 5) * f
    block = 2 * norm + attention + mlp
    floats = cfg.n_layers * block + norm + d + cfg.d_vocab
    return FLOAT32_BYTES * floats + 2 * ID_BYTES


@dataclass(frozen=True)
class StepCost:
    """The memory and compute of one float32 AdamW training step, in bytes and FLOPs.

    `params`, `grads` and `adamw_state` are per model (whatever the batch); `activations` is
    for the whole batch, `activations_per_token` for one token; `flops` for the whole batch.

    Course: chapter 8.
    """

    n_params: int
    tokens: int
    params: int
    grads: int
    adamw_state: int
    activations_per_token: int
    flops_per_token: int

    @property
    def activations(self) -> int:
        return self.activations_per_token * self.tokens

    @property
    def total(self) -> int:
        """Bytes held at the end of the forward pass: everything above."""
        return self.params + self.grads + self.adamw_state + self.activations

    @property
    def flops(self) -> int:
        return self.flops_per_token * self.tokens

    def __str__(self) -> str:
        rows = [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("AdamW state", self.adamw_state),
            (f"activations ({self.tokens} tokens)", self.activations),
            ("total", self.total),
        ]
        lines = [f"{name:<28}{size / 2**20:>12,.1f} MiB" for name, size in rows]
        lines.append(f"{'FLOPs per step':<28}{self.flops:>16.3g}")
        return "\n".join(lines)


def step_cost(
    cfg: GPT2Config | LlamaConfig,
    seq_len: int,
    *,
    batch_size: int = 1,
    fused_attention: bool = False,
) -> StepCost:
    """What one training step of `GPT2(cfg)` or `Llama(cfg)` costs on `batch_size` sequences of
    `seq_len` tokens, in float32 with AdamW (two float32 running means per parameter).

    Course: chapter 8.
    """
    _is_gpt2(cfg)
    validate.positive_int("seq_len", seq_len)
    validate.positive_int("batch_size", batch_size)
    if seq_len > cfg.n_ctx:
        raise ValueError(f"seq_len: expected at most n_ctx={cfg.n_ctx}, got {seq_len}")
    n = param_count(cfg)
    return StepCost(
        n_params=n,
        tokens=batch_size * seq_len,
        params=FLOAT32_BYTES * n,
        grads=FLOAT32_BYTES * n,
        adamw_state=2 * FLOAT32_BYTES * n,
        activations_per_token=activation_bytes_per_token(
            cfg, seq_len, fused_attention=fused_attention
        ),
        flops_per_token=flops_per_token(cfg, seq_len),
    )


class SavedTensorBytes:
    """Measure the bytes autograd saves for the backward inside a `with` block:

        with SavedTensorBytes(exclude=model.parameters()) as saved:
            loss = lm_loss(model(tokens), targets)
        saved.bytes

    Every tensor an operation saves passes `torch.autograd.graph.saved_tensors_hooks`; each
    memory block (storage) is counted once however many views of it are saved, and the
    storages of `exclude` (the parameters, which are not activations) are not counted.

    Course: chapter 8.
    """

    def __init__(self, exclude: Any = ()) -> None:
        exclude = validate.tensors("exclude", list(exclude))
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._sizes: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []  # of every tensor saved, repeats included
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        self.shapes.append(tuple(t.shape))
        if storage.data_ptr() not in self._excluded:
            # Saved tensors stay alive until the backward, so no two share an address.
            self._sizes[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def collective_bytes_per_step(
    cfg: GPT2Config | LlamaConfig,
    parallel: str,
    *,
    world_size: int,
    compute_bytes: int = FLOAT32_BYTES,
    replicate_below: int = 0,
) -> dict[str, int]:
    """The bytes each rank hands to each kind of collective in one training step (the payloads
    `ranks.CollectiveBytes` counts), by strategy, with N parameters:

    - `"ddp"` (`DataParallel`): every gradient all-reduced once, 4 N bytes in float32;
    - `"zero1"` (`DataParallel` with a `ShardedOptimizer`): the same, and every parameter
      broadcast from its owner after the step, 4 N;
    - `"fsdp"` (`FullyShardedDataParallel`): every weight all-gathered for its forward in the
      compute dtype (`compute_bytes` per parameter, a tied one once per use) and at most once
      more in the backward (only where the backward needs it: a bias's gradient needs no
      weight, and einsum keeps its own copies), and every use's gradient reduce-scattered in
      float32. The gathers' count is an upper bound: 2 compute_bytes N. Parameters with fewer
      than `replicate_below` elements stay whole on every rank: no gather, and each use's
      gradient all-reduced in float32 instead of reduce-scattered.

    Each parameter is padded to a multiple of `world_size` elements under FSDP, and
    `DataParallel` sends one flag per parameter tensor with its gradients: a few bytes more than
    the formula, which counts neither.

    Course: chapter 8.
    """
    _is_gpt2(cfg)
    validate.positive_int("world_size", world_size)
    validate.positive_int("compute_bytes", compute_bytes)
    validate.integer("replicate_below", replicate_below, low=0)
    n = param_count(cfg)
    gradients = {"all_reduce": FLOAT32_BYTES * n}
    if parallel == "ddp":
        return gradients
    if parallel == "zero1":
        return {**gradients, "broadcast": FLOAT32_BYTES * n}
    if parallel == "fsdp":
        tied = cfg.d_vocab * cfg.d_model if cfg.tie_embeddings else 0  # W_E used twice
        uses = n + tied
        replicated = _elements_below(cfg, replicate_below)
        replicated += tied if tied < replicate_below else 0
        sharded = uses - replicated
        counts = {"all_gather": 2 * compute_bytes * sharded}
        counts["reduce_scatter"] = FLOAT32_BYTES * sharded
        if replicated:
            counts["all_reduce"] = FLOAT32_BYTES * replicated
        return counts
    raise ValueError(f"parallel: expected 'ddp', 'zero1' or 'fsdp', got {parallel!r}")


def _elements_below(cfg: GPT2Config | LlamaConfig, threshold: int) -> int:
    """The elements of the model's parameter tensors (a tied one once) with fewer than
    `threshold` elements each, from the model's own shapes (built on the meta device)."""
    with torch.device("meta"):
        model = GPT2(cfg) if _is_gpt2(cfg) else Llama(cfg)
    return sum(p.numel() for p in model.parameters() if p.numel() < threshold)


def _is_gpt2(cfg: Any) -> bool:
    """True for a `GPT2Config`, False for a `LlamaConfig`; anything else is an error."""
    if isinstance(cfg, GPT2Config):
        return True
    if isinstance(cfg, LlamaConfig):
        return False
    raise TypeError(f"cfg: expected a GPT2Config or a LlamaConfig, got {type(cfg).__name__}")
