"""Checkers for chapter 8's workbook (08_scaling): what a step costs (parameters, FLOPs) here;
FlashAttention-2 in `checks.flash_attention`, gradient buckets and data parallelism in
`checks.data_parallel`, the sharded optimizer and FSDP in `checks.sharded`, all re-exported
here, the module the workbook imports its checkers from."""

from __future__ import annotations

from collections.abc import Callable

from transformer_course import step_cost
from transformer_course.checks.data_parallel import check_data_parallel, check_make_buckets
from transformer_course.checks.flash_attention import (
    check_flash_attention_backward,
    check_flash_attention_forward,
    check_flash_attention_function,
)
from transformer_course.checks.harness import (
    call,
    describe,
    expect,
    expect_no_known_mistake,
    passed,
)
from transformer_course.checks.sharded import check_fsdp, check_sharded_optimizer
from transformer_course.gpt2 import GPT2, GPT2Config
from transformer_course.llama import LlamaConfig

__all__ = [
    "check_data_parallel",
    "check_flash_attention_backward",
    "check_flash_attention_forward",
    "check_flash_attention_function",
    "check_flops_per_token",
    "check_fsdp",
    "check_make_buckets",
    "check_param_count",
    "check_sharded_optimizer",
]

CONFIGS = {  # heads of a size other than d_model // n_heads, odd vocabularies, tied or not
    "GPT-2": GPT2Config(
        d_model=24, n_layers=2, n_heads=3, d_head=10, d_mlp=40, d_vocab=37, n_ctx=9
    ),
    "GPT-2, tied": GPT2Config(d_model=16, n_layers=3, n_heads=2, d_vocab=31, tie_embeddings=True),
    "modern decoder": LlamaConfig(d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_vocab=37),
    "modern decoder, tied": LlamaConfig(
        d_model=16,
        n_layers=1,
        n_heads=4,
        n_kv_heads=1,
        d_head=6,
        d_mlp=20,
        d_vocab=29,
        tie_embeddings=True,
    ),
}


def _param_count_mistakes(cfg) -> dict[str, int]:
    """What `param_count(cfg)` returns for each classic slip, {hint: value}."""
    right = step_cost.param_count(cfg)
    d, v, layers = cfg.d_model, cfg.d_vocab, cfg.n_layers
    mistakes = {}
    if cfg.tie_embeddings:
        mistakes["a tied unembedding is W_E itself (one tensor): count it once."] = right + v * d
    else:
        mistakes["the unembedding W_U (d_model, d_vocab) is missing."] = right - v * d
    if isinstance(cfg, GPT2Config):
        mistakes["GPT-2's position table W_pos (n_ctx, d_model) is missing."] = (
            right - cfg.n_ctx * d
        )
        biases = layers * (3 * cfg.n_heads * cfg.d_head + d + cfg.d_mlp + d) + v
        mistakes["the biases are missing: b_Q, b_K, b_V, b_O, b_in, b_out and b_U."] = (
            right - biases
        )
        norms = 2 * (2 * layers + 1) * d
        mistakes["the layer norms' w and b are missing (two per block, one at the end)."] = (
            right - norms
        )
        attention = 4 * cfg.n_heads * d * cfg.d_head
        mistakes["the heads have size d_head (cfg.d_head), not d_model // n_heads."] = (
            right
            - layers * (attention + 3 * cfg.n_heads * cfg.d_head)
            + layers * (4 * d * d + 3 * d)
        )
    else:
        mistakes[
            "the modern decoder's RMSNorms have a gain w each (two per block, one at the end)."
        ] = right - (2 * layers + 1) * d
        extra = 2 * layers * (cfg.n_heads - cfg.n_kv_heads) * d * cfg.d_head
        mistakes["W_K and W_V have n_kv_heads heads, not n_heads."] = right + extra
        mistakes["SwiGLU has three matrices: W_gate, W_in and W_out."] = (
            right - layers * d * cfg.d_mlp
        )
    return mistakes


def check_param_count(param_count: Callable) -> None:
    """`param_count(cfg)` against the parameters of the models themselves: GPT-2 and the modern
    decoder, tied and untied, heads of a size other than d_model / n_heads."""
    from transformer_course.llama import Llama

    for label, cfg in CONFIGS.items():
        model = GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)
        expected = sum(p.numel() for p in model.parameters())  # a tied W_E once
        where = f"param_count({label})"
        got = call(where, param_count, cfg)
        expect(isinstance(got, int), where, f"expected an int, got {describe(got)}.")
        mistakes = {h: n for h, n in _param_count_mistakes(cfg).items() if n != expected}
        problem = f"expected {expected:,} parameters (the model's own count), got {got:,}."
        expect_no_known_mistake(where, got, mistakes, problem=problem)
        pieces = "matrix, bias, norm gain and bias" if isinstance(cfg, GPT2Config) else "matrix"
        hint = f"count each {pieces} of one block, times n_layers, plus what sits outside the "
        hint += "blocks: the embedding tables, the final norm and the unembedding."
        expect(got == expected, where, problem, hint)
    passed("param_count")


def check_flops_per_token(flops_per_token: Callable) -> None:
    """`flops_per_token(cfg, seq_len)` against 6 N + 12 L H Q T, at several contexts."""
    for label, cfg in CONFIGS.items():
        n = step_cost.flop_param_count(cfg)
        heads = cfg.n_layers * cfg.n_heads * cfg.d_head
        for seq_len in (1, 7, 9):
            where = f"flops_per_token({label}, seq_len={seq_len})"
            got = call(where, flops_per_token, cfg, seq_len)
            expect(isinstance(got, int), where, f"expected an int, got {describe(got)}.")
            expected = 6 * n + 12 * heads * seq_len
            mistakes = {
                "the forward only: the backward costs twice the forward (6 N, not 2 N), "
                "attention included.": 2 * n + 4 * heads * seq_len,
                "attention's two matmuls (scores and the weighted sum of values) have no "
                "parameters but cost 12 L H Q T per token.": 6 * n,
                "attention's matmuls in the forward only: with the backward, three times "
                "4 L H Q T.": 6 * n + 4 * heads * seq_len,
                "N is `flop_param_count(cfg)`: an embedding lookup costs no FLOPs.": (
                    6 * step_cost.param_count(cfg) + 12 * heads * seq_len
                ),
                "H Q is n_heads * d_head (cfg.d_head), not d_model.": (
                    6 * n + 12 * cfg.n_layers * cfg.d_model * seq_len
                ),
            }
            mistakes = {h: n for h, n in mistakes.items() if n != expected}
            problem = f"expected {expected:,} FLOPs per token, got {got:,}."
            expect_no_known_mistake(where, got, mistakes, problem=problem)
            expect(got == expected, where, problem, "6 N + 12 L H Q T (see the formula above).")
    passed("flops_per_token")
