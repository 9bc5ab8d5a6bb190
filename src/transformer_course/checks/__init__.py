"""Exercise checkers, one module per chapter's workbook, built from `checks.harness`: each prints
that the learner's code passes or raises `CheckFailure` with a hint naming the likely mistake."""

from transformer_course.checks.attention import check_attention_scores as check_attention_scores
from transformer_course.checks.attention import (
    check_multi_head_attention as check_multi_head_attention,
)
from transformer_course.checks.attention import (
    check_scaled_dot_product_attention as check_scaled_dot_product_attention,
)
from transformer_course.checks.gpt2 import check_against_huggingface as check_against_huggingface
from transformer_course.checks.gpt2 import check_cosine_lr as check_cosine_lr
from transformer_course.checks.gpt2 import check_embed as check_embed
from transformer_course.checks.gpt2 import check_estimate_loss as check_estimate_loss
from transformer_course.checks.gpt2 import check_generate as check_generate
from transformer_course.checks.gpt2 import check_gpt2_forward as check_gpt2_forward
from transformer_course.checks.gpt2 import check_kv_cache as check_kv_cache
from transformer_course.checks.gpt2 import check_pos_embed as check_pos_embed
from transformer_course.checks.gpt2 import check_sample_batch as check_sample_batch
from transformer_course.checks.gpt2 import check_top_p_filter as check_top_p_filter
from transformer_course.checks.gpt2 import check_train_loop as check_train_loop
from transformer_course.checks.gpt2 import check_train_step as check_train_step
from transformer_course.checks.gpt2 import check_unembed as check_unembed
from transformer_course.checks.gpt2 import check_weight_conversion as check_weight_conversion
from transformer_course.checks.harness import CheckFailure as CheckFailure
from transformer_course.checks.layernorm import check_layernorm as check_layernorm
from transformer_course.checks.layernorm import check_rmsnorm as check_rmsnorm
from transformer_course.checks.masking import check_causal_mask as check_causal_mask
from transformer_course.checks.masking import check_combine_masks as check_combine_masks
from transformer_course.checks.masking import check_masked_softmax as check_masked_softmax
from transformer_course.checks.masking import check_padding_mask as check_padding_mask
from transformer_course.checks.tokenization import check_bpe_encode as check_bpe_encode
from transformer_course.checks.tokenization import check_char_tokenizer as check_char_tokenizer
from transformer_course.checks.tokenization import check_decode_ids as check_decode_ids
from transformer_course.checks.tokenization import check_encode_chunk as check_encode_chunk
from transformer_course.checks.tokenization import check_get_pair_counts as check_get_pair_counts
from transformer_course.checks.tokenization import check_merge_pair as check_merge_pair
from transformer_course.checks.tokenization import check_train_merges as check_train_merges
from transformer_course.checks.translation import check_beam_search as check_beam_search
from transformer_course.checks.translation import check_encoder_decoder as check_encoder_decoder
from transformer_course.checks.translation import check_greedy_decode as check_greedy_decode
from transformer_course.checks.translation import check_inverse_sqrt_lr as check_inverse_sqrt_lr
from transformer_course.checks.translation import check_label_smoothing as check_label_smoothing
from transformer_course.checks.translation import check_mlp as check_mlp
from transformer_course.checks.translation import (
    check_positional_encoding as check_positional_encoding,
)
from transformer_course.checks.translation import check_residual_sublayer as check_residual_sublayer
from transformer_course.checks.translation import check_seq2seq_block as check_seq2seq_block
from transformer_course.checks.translation import check_token_embedding as check_token_embedding
