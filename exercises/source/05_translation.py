# %% [markdown]
# # Chapter 5 workbook: the encoder–decoder Transformer
#
# You will build the parts of Vaswani et al.'s translation model that are new in this chapter:
#
# 1. the sinusoidal positional encoding;
# 2. the token embedding, scaled by $\sqrt{d_\text{model}}$, plus the positions;
# 3. a decoder block: masked self-attention, cross-attention, MLP;
# 4. the label-smoothed cross-entropy loss;
# 5. greedy decoding.
#
# Attention, masks, layer norm and the MLP come from the earlier chapters. Each check cell
# compares your code with the course's reference and, when they differ, tells you which classic
# mistake your output matches. The chapter's book page trains the whole model on English→Spanish.

# %% tags=nbval-ignore-output
import math

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from transformer_course.attention import MultiHeadAttention
from transformer_course.blocks import MLP
from transformer_course.checks.encoder_decoder import (
    check_decoder_block,
    check_greedy_decode,
    check_label_smoothing,
    check_positional_encoding,
    check_token_embedding,
)
from transformer_course.encoder_decoder import EncoderDecoderTransformer, Seq2SeqConfig, _check_decode_args
from transformer_course.layernorm import LayerNorm
from transformer_course.runtime import describe, seed_everything

seed_everything(0)
print(describe())

# %% [markdown]
# ## Exercise 5.1: sinusoidal positional encoding
#
# Attention treats its input as a set, so the model needs to be told where each token is. The
# paper adds a fixed vector to each position:
#
# $$PE_{(pos,\,2i)} = \sin\!\left(\frac{pos}{10000^{2i/d_\text{model}}}\right), \qquad
# PE_{(pos,\,2i+1)} = \cos\!\left(\frac{pos}{10000^{2i/d_\text{model}}}\right)$$
#
# Even dimensions get the sine, odd dimensions the cosine, and the pair $(2i, 2i+1)$ shares one
# frequency. Positions start at 0. Compute in float64 and convert to `dtype` at the end.

# %% [exercise] transformer_course.encoder_decoder:sinusoidal_positional_encoding difficulty=2 importance=4 minutes=15
# hint: Dimensions `2i` and `2i + 1` share one frequency, `1 / 10000 ** (2i / d_model)`; build the
#   angle for every (position, i) at once by broadcasting a column against a row.
# hint: Fill the even columns with the sine of the angles and the odd columns with the cosine,
#   computing in float64 and converting at the end.

# %% [check]
check_positional_encoding(sinusoidal_positional_encoding)

# %% [markdown]
# ## Exercise 5.2: the scaled token embedding
#
# The embedding matrix `W_E` is initialised with standard deviation $1/\sqrt{d_\text{model}}$, so
# each embedding vector has length about 1 while each positional vector has length about
# $\sqrt{d_\text{model}/2}$. Multiplying the embedding by $\sqrt{d_\text{model}}$ (section 3.4 of
# the paper) puts the two on the same scale. Return
# `dropout(W_E[tokens] * sqrt(d_model) + PE[:pos])`.

# %% [exercise] transformer_course.encoder_decoder:TokenEmbedding blank=forward difficulty=1 importance=4 minutes=10
# hint: Look up the embeddings, scale them, add the positional encoding for as many positions as the
#   input has, apply dropout.
# hint: The scale is `math.sqrt(self.d_model)`; the encoding must match the embedding's dtype and
#   device.

# %% [check]
check_token_embedding(TokenEmbedding)

# %% [markdown]
# ## Exercise 5.3: a decoder block
#
# Three sublayers, each wrapped in dropout, a residual connection and a layer norm:
#
# 1. masked self-attention over the target so far (`tgt_mask` is causal: no peeking ahead);
# 2. cross-attention: queries from the decoder, keys and values from the encoder's output
#    `memory` (`src_mask` hides the source padding);
# 3. the position-wise MLP.
#
# With `norm="post"` (the paper) the norm comes after the sum: `x = ln(x + dropout(sublayer(x)))`.
# With `norm="pre"` it comes before the sublayer: `x = x + dropout(sublayer(ln(x)))`.
# `self.pre_norm` tells you which one to use.

# %% [exercise] transformer_course.encoder_decoder:DecoderBlock blank=forward difficulty=3 importance=5 minutes=20
# hint: Three sublayers in order: masked self-attention, cross-attention, MLP; each wrapped in
#   dropout, a residual sum and a layer norm.
# hint: Cross-attention takes its queries from the decoder and its keys and values from `memory`;
#   which mask hides the source padding?
# hint: `self.pre_norm` chooses `x = x + dropout(sublayer(ln(x)))` over `x = ln(x +
#   dropout(sublayer(x)))`.

# %% [check]
check_decoder_block(DecoderBlock)

# %% [markdown]
# ## Exercise 5.4: label smoothing
#
# Instead of a one-hot target, train against $(1-\varepsilon)\cdot\text{one\_hot} + \varepsilon/V$
# (Szegedy et al., 2016; the paper uses $\varepsilon = 0.1$). The loss becomes
# $(1-\varepsilon)\cdot\text{NLL} + \varepsilon\cdot\text{mean}_v(-\log p_v)$: the model is pushed a
# little towards spreading probability, which hurts perplexity but helps BLEU. Positions whose
# target is `ignore_index` (padding) must not count, not even in the average's denominator.

# %% [exercise] transformer_course.encoder_decoder:label_smoothed_cross_entropy difficulty=3 importance=4 minutes=20
# hint: Work with `log_softmax` of the logits. The loss mixes the negative log-likelihood of the
#   target with the mean negative log-probability over the whole vocabulary.
# hint: Weight them `1 - smoothing` and `smoothing`; then average over the positions whose target is
#   not `ignore_index` only (count only those in the denominator).

# %% [check]
check_label_smoothing(label_smoothed_cross_entropy)

# %% [markdown]
# ## Exercise 5.5: greedy decoding
#
# Encode the source once. Start every row with `<s>`; at each step run the decoder on the tokens
# so far, take the most likely next token at the last position and append it. A row is finished
# when it produces `</s>` (keep appending padding to it while the others go on); stop when every
# row is finished or after `max_len` new tokens. Return the generated ids without `<s>` and
# `</s>`.

# %% [exercise] transformer_course.encoder_decoder:greedy_decode difficulty=3 importance=5 minutes=25
# hint: Encode once; start every row with `bos_id`; each step decodes everything generated so far
#   and appends the most likely next token of the last position.
# hint: Rows finish at different steps: remember which rows have produced `eos_id` (keep padding
#   them) and stop when all have, or after `max_len` new tokens.
# hint: Return one list per row: the generated ids without `bos_id`, cut before the first `eos_id`.

# %% [check]
check_greedy_decode(greedy_decode)
