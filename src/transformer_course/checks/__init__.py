"""Exercise checkers: each compares a learner's function or class with the course's reference.

One module per chapter's workbook (`checks.tokenization` for `01_tokenization`, ...,
`checks.translation`, `checks.gpt2`), all built from `checks.harness`. A checker prints one line
saying the exercise passes, or raises `CheckFailure` with a hint naming the likely mistake; in a
notebook the message shows alone, never the checker's code.
"""

from transformer_course.checks.attention import (
    check_attention_scores,
    check_multi_head_attention,
    check_scaled_dot_product_attention,
)
from transformer_course.checks.gpt2 import (
    check_against_huggingface,
    check_embed,
    check_generate,
    check_gpt2_forward,
    check_kv_cache,
    check_mlp,
    check_pos_embed,
    check_sample_batch,
    check_top_p_filter,
    check_train_step,
    check_transformer_block,
    check_unembed,
)
from transformer_course.checks.harness import CheckFailure
from transformer_course.checks.layernorm import check_layernorm, check_rmsnorm
from transformer_course.checks.masking import (
    check_causal_mask,
    check_combine_masks,
    check_masked_softmax,
    check_padding_mask,
)
from transformer_course.checks.tokenization import (
    check_bpe_encode,
    check_char_tokenizer,
    check_decode_ids,
    check_encode_chunk,
    check_get_pair_counts,
    check_merge_pair,
    check_train_merges,
)
from transformer_course.checks.translation import (
    check_beam_search,
    check_encoder_decoder,
    check_greedy_decode,
    check_inverse_sqrt_lr,
    check_label_smoothing,
    check_positional_encoding,
    check_residual_sublayer,
    check_seq2seq_block,
    check_token_embedding,
)

__all__ = [
    "CheckFailure",
    "check_against_huggingface",
    "check_attention_scores",
    "check_beam_search",
    "check_bpe_encode",
    "check_causal_mask",
    "check_char_tokenizer",
    "check_combine_masks",
    "check_decode_ids",
    "check_embed",
    "check_encode_chunk",
    "check_encoder_decoder",
    "check_generate",
    "check_get_pair_counts",
    "check_gpt2_forward",
    "check_greedy_decode",
    "check_inverse_sqrt_lr",
    "check_kv_cache",
    "check_label_smoothing",
    "check_layernorm",
    "check_masked_softmax",
    "check_merge_pair",
    "check_mlp",
    "check_multi_head_attention",
    "check_padding_mask",
    "check_pos_embed",
    "check_positional_encoding",
    "check_residual_sublayer",
    "check_rmsnorm",
    "check_sample_batch",
    "check_scaled_dot_product_attention",
    "check_seq2seq_block",
    "check_token_embedding",
    "check_top_p_filter",
    "check_train_merges",
    "check_train_step",
    "check_transformer_block",
    "check_unembed",
]
