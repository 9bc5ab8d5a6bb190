# %% [markdown]
# # Chapter 5 workbook: the encoder–decoder Transformer
#
# You will build Vaswani et al.'s translation model, then train it and translate with it:
#
# 1. the sinusoidal positional encoding;
# 2. the token embedding, scaled by $\sqrt{d_\text{model}}$, plus the positions;
# 3. the position-wise MLP;
# 4. the residual sublayer, pre-LN and post-LN: the norm and dropout around every attention and
#    MLP;
# 5. one block for both stacks: self-attention (causal in the decoder), cross-attention to the
#    source (in the decoder), then the MLP;
# 6. the model that assembles your embedding and blocks into an encoder and a decoder;
# 7. the label-smoothed cross-entropy loss;
# 8. the paper's learning-rate schedule;
# 9. greedy decoding, and 10. beam search.
#
# At the end **your** model trains for a few minutes on English→Spanish and translates real
# sentences with **your** decoding. It is yours all the way down: the first cell loads the parts
# you built in chapters 1–4 (your BPE tokenizer, attention, masks and layer norm) from the files
# their workbooks saved, checks each one again, and prints whose each part is. A part you have
# not finished is replaced by the course's, and the table says why. Each check cell compares
# your code with the course's reference, tells you which classic mistake your output matches
# when they differ, and once it passes saves your part for chapter 6 (`keep`).

# %% tags=nbval-ignore-output
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course.checks.translation import (
    check_beam_search,
    check_encoder_decoder,
    check_greedy_decode,
    check_inverse_sqrt_lr,
    check_label_smoothing,
    check_mlp,
    check_positional_encoding,
    check_residual_sublayer,
    check_seq2seq_block,
    check_token_embedding,
)
from transformer_course.parts import keep, load_parts, whose_parts
from transformer_course.runtime import describe_run, seed_everything

# Your chapters 1-4 (each checked again) and the course's tools, in this notebook.
load_parts(globals(), chapter=5)
seed_everything(0)
print(describe_run())

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
keep(sinusoidal_positional_encoding)

# %% [markdown]
# ## Exercise 5.2: the scaled token embedding
#
# The embedding matrix `W_E` is initialised with standard deviation $1/\sqrt{d_\text{model}}$, so
# each embedding vector has length about 1 while each positional vector has length about
# $\sqrt{d_\text{model}/2}$. Multiplying the embedding by $\sqrt{d_\text{model}}$ (section 3.4 of
# the paper) puts the two on the same scale. Return the scaled embeddings plus the encoding of
# their positions, after dropout.

# %% [exercise] transformer_course.encoder_decoder:TokenEmbedding blank=forward difficulty=1 importance=4 minutes=10
# hint: Look up the embeddings, scale them, add the positional encoding for as many positions as the
#   input has, apply dropout.
# hint: The scale is `math.sqrt(self.d_model)`; the encoding must match the embedding's dtype and
#   device.

# %% [check]
check_token_embedding(TokenEmbedding)
keep(TokenEmbedding)

# %% [markdown]
# ## Exercise 5.3: the MLP
#
# Attention moves information between positions; the MLP (the paper's "position-wise
# feed-forward network") then processes every position on its own, with the same weights at
# every position. It widens the vector from `d_model` to `d_mlp` dimensions (four times
# `d_model` in the paper and in GPT-2), applies a nonlinearity $\phi$ and projects back:
#
# $$\text{MLP}(x) = \phi\left(x W_\text{in} + b_\text{in}\right) W_\text{out} + b_\text{out},$$
#
# with `W_in` of shape `(d_model, d_mlp)` and `W_out` of shape `(d_mlp, d_model)`. Without
# $\phi$ the two maps would collapse into one linear map. The paper's $\phi$ is ReLU,
# $\max(0, x)$; GPT-2's is `gelu_new`, a smooth curve close to ReLU (the tanh approximation of
# GELU). `ACTIVATIONS[self.act_fn]` is the one this MLP was built with. `x` has shape
# `(..., d_model)`: any leading dimensions, every position alike. Pass the widened
# pre-activation through `hook_pre` and the activation's output through `hook_post`.

# %% [exercise] transformer_course.blocks:MLP blank=forward difficulty=2 importance=4 minutes=10
# hint: Two learned projections with biases, `W_in`/`b_in` then `W_out`/`b_out`, and the
#   activation between them; every position is processed alike.
# hint: `x @ self.W_in + self.b_in` is the widened pre-activation; the hooks see it, then the
#   activation's output.

# %% [check]
check_mlp(MLP)
keep(MLP)

# %% [markdown]
# ## Exercise 5.4: the residual sublayer
#
# Every attention and every MLP of the model sits in the same wrapping: its output goes through
# dropout, is added to the residual stream, and a layer norm keeps the stream's scale in check.
# Where the norm goes is the difference between the paper's **post-LN** and the **pre-LN** that
# GPT-2 and most modern models use (chapter 4):
#
# * `norm="post"` (the paper): the sublayer reads the stream as it is, and the layer norm
#   normalises the stream *after* the sublayer's contribution has been added to it;
# * `norm="pre"` (GPT-2): the layer norm normalises only what the sublayer reads; its
#   contribution is added to the stream itself, which is never normalised here.
#
# `sublayer` is any function of the stream (an attention, the MLP); `ln` a layer norm;
# `dropout` a dropout module. Pass what the sublayer adds to the stream, after dropout, through
# `hook_out` (a TransformerLens hook point, so it can be inspected) and add what `hook_out`
# returns: a hook may replace the tensor.

# %% [exercise] transformer_course.blocks:residual_sublayer difficulty=2 importance=5 minutes=10
# docstring: One sublayer (`sublayer`, an attention or the MLP) with its dropout, residual
#   connection and layer norm `ln`, placed as `norm` says ("pre" or "post"). What the
#   sublayer adds to the stream, after dropout, passes through `hook_out`.
# hint: Compute what the sublayer adds first: dropout of the sublayer's output, passed through
#   `hook_out`. Which input the sublayer reads depends on `norm`.
# hint: Pre-LN adds that to `resid` as it is; post-LN normalises the sum `resid + out`, so the
#   norm comes after the add.

# %% [check]
check_residual_sublayer(residual_sublayer)
keep(residual_sublayer)

# %% [markdown]
# ## Exercise 5.5: one block for the encoder and the decoder
#
# The encoder and the decoder are built from the same block, with two switches:
#
# * `causal`: the decoder's self-attention must not see later target positions (a position
#   would read the very token it must predict); the encoder's sees the whole source.
#   `MultiHeadAttention(x, mask=..., causal=...)` adds the causal mask for you.
# * `cross_attention`: the decoder's block has a second attention between self-attention and
#   the MLP, **cross-attention**: queries from the residual stream, keys and values from
#   `context`, the encoder's output. `context_mask` hides the source padding.
#
# Write `forward` with your `residual_sublayer` from exercise 5.4, once per sublayer, each with
# its own layer norm (`ln1` for self-attention, `ln_cross` for cross-attention, `ln2` for the
# MLP), `self.dropout`, and its hook (`hook_attn_out`, `hook_cross_attn_out`, `hook_mlp_out`).
# Pass the stream through `hook_resid_pre` first, `hook_resid_mid` after self-attention,
# `hook_resid_mid_cross` after cross-attention and `hook_resid_post` last. `mask` (from the
# padding of the stream's own tokens) goes to the self-attention, and so does `cache`
# (chapter 6's KV cache, None until then).

# %% [exercise] transformer_course.blocks:TransformerBlock blank=forward difficulty=3 importance=5 minutes=25
# hint: Three sublayers in order: self-attention, cross-attention (only when
#   `self.cross_attention`), the MLP. Each is one call of `residual_sublayer`; the attention
#   ones need a small function of the stream that calls the attention module.
# hint: Self-attention attends from the stream to itself with `mask` and `causal=self.causal`;
#   cross-attention takes its queries from the stream and its keys and values from `context`,
#   hidden where `context_mask` says.
# hint: Call `self._validate_inputs(resid, context)` first for clear errors, and give
#   `residual_sublayer` `norm=self.norm` and `dropout=self.dropout` every time.

# %% [check]
check_seq2seq_block(TransformerBlock)
keep(TransformerBlock)

# %% [markdown]
# ## Exercise 5.6: the whole model
#
# The class below assembles your parts: `src_embed` and `tgt_embed` are your `TokenEmbedding`
# (one shared table when `cfg.share_embeddings`), `encoder` and `decoder` are stacks of your
# `TransformerBlock` (non-causal without cross-attention; causal with it). Write the two halves:
#
# * `encode(src)`: embed the source, run every encoder block with the source padding mask
#   (`self.src_mask(src)`), and with pre-LN finish with `self.ln_enc` (pre-LN blocks never
#   normalise the stream itself).
# * `decode(tgt, memory, src_mask)`: embed the target; every decoder block gets the target's
#   own padding mask (the blocks add the causal part themselves), the memory as `context` and
#   `src_mask` as `context_mask`; with pre-LN finish with `self.ln_dec`; the logits are
#   `x @ W_U + b_U`, where `W_U` is `tgt_embed.W_E.T` when the embeddings are tied
#   (`cfg.tie_embeddings`, as in the paper) and `self.W_U` otherwise.
#
# Both refuse ids outside the vocabulary with a clear error (an id of -1 would otherwise read
# the last row of `W_E` without a word): `validate.token_tensor(name, tokens, d_vocab,
# n_ctx=...)` (given) raises it, for `"src"` against `cfg.src_vocab` and `"tgt"` against
# `cfg.tgt_vocab`, and also refuses more than `cfg.n_ctx` positions.

# %% [exercise] transformer_course.encoder_decoder:EncoderDecoderTransformer blank=encode,decode difficulty=3 importance=5 minutes=25
# hint: `encode`: after the id check, the embedded source goes through the encoder blocks in
#   turn, every one with the same source padding mask.
# hint: `decode` builds `padding_mask(tgt, pad_id)` once and passes it to every decoder block,
#   with `context=memory` and `context_mask=src_mask`.

# %% [check]
check_encoder_decoder(EncoderDecoderTransformer)
keep(EncoderDecoderTransformer)

# %% [markdown]
# ## Exercise 5.7: label smoothing
#
# Instead of a one-hot target, train against $(1-\varepsilon)\cdot\text{one\_hot} + \varepsilon/V$
# (Szegedy et al., 2016; the paper uses $\varepsilon = 0.1$). The loss becomes
# $(1-\varepsilon)\cdot\text{NLL} + \varepsilon\cdot\text{mean}_v(-\log p_v)$: the model is pushed a
# little towards spreading probability, which hurts perplexity but helps BLEU. Positions whose
# target is `ignore_index` (padding) must not count, not even in the average's denominator; a
# batch in which every target is `ignore_index` has nothing to average and its loss is 0 (not
# 0 / 0 = NaN). `ignore_index=None` means every position counts.

# %% [exercise] transformer_course.encoder_decoder:label_smoothed_cross_entropy difficulty=3 importance=4 minutes=20
# hint: Work with `log_softmax` of the logits. The loss mixes the negative log-likelihood of the
#   target with the mean negative log-probability over the whole vocabulary.
# hint: Weight them `1 - smoothing` and `smoothing`; then average over the positions whose target is
#   not `ignore_index` only (count only those in the denominator).

# %% [check]
check_label_smoothing(label_smoothed_cross_entropy)
keep(label_smoothed_cross_entropy)

# %% [markdown]
# ## Exercise 5.8: the learning-rate schedule
#
# The paper raises the learning rate linearly for `warmup_steps` steps and then lets it fall
# with the inverse square root of the step. With steps counted from 0 and $n$ = step + 1:
#
# $$\text{lr}(n) = \text{lr}_\text{peak} \cdot \min\left(\frac{n}{\text{warmup}},
# \sqrt{\frac{\text{warmup}}{n}}\right)$$
#
# (The paper's $d_\text{model}^{-0.5}\min(n^{-0.5}, n\cdot\text{warmup}^{-1.5})$ is this
# with $\text{lr}_\text{peak} = (d_\text{model}\cdot\text{warmup})^{-0.5}$.) Warmup keeps
# the first updates small while Adam's statistics are still noisy. `warmup_steps=0` means no
# warmup: it gives the rates of `warmup_steps=1`, starting at `lr`.

# %% [exercise] transformer_course.training:inverse_sqrt_lr difficulty=1 importance=3 minutes=10
# hint: The two branches meet at n = warmup_steps, where both equal 1: that is the peak.

# %% [check]
check_inverse_sqrt_lr(inverse_sqrt_lr)
keep(inverse_sqrt_lr)

# %% [markdown]
# ## Exercise 5.9: greedy decoding
#
# Encode the source once. Start every row with `<s>`; at each step run the decoder on the tokens
# so far, take the most likely next token at the last position and append it. A row is finished
# when it produces `</s>` (keep appending padding to it while the others go on); stop when every
# row is finished or after `max_new_tokens` new tokens. Return the generated ids without `<s>` and
# `</s>`. Decode in evaluation mode, without gradients, and give the model its own mode back
# afterwards: the course's context manager `evaluating` does all three.
#
# `max_len` is the former name of `max_new_tokens`; with both `None` there is no length to stop
# at, which is a `ValueError`. `_decode_args(model, src, bos_id, eos_id, max_new_tokens,
# max_len)` (given) checks every argument and returns the number of new tokens.

# %% [exercise] transformer_course.decoding:greedy_decode difficulty=3 importance=5 minutes=25
# hint: Encode once; start every row with `bos_id`; each step decodes everything generated so far
#   and appends the most likely next token of the last position (`next_token_logits` gives
#   those logits and refuses NaN).
# hint: Rows finish at different steps: remember which rows have produced `eos_id` (keep padding
#   them) and stop when all have, or after `max_new_tokens` new tokens.
# hint: Return one list per row: the generated ids without `bos_id`, cut before the first `eos_id`.

# %% [check]
check_greedy_decode(greedy_decode)
keep(greedy_decode)

# %% [markdown]
# ## Exercise 5.10: beam search
#
# Greedy decoding commits to the likeliest next token even when a less likely one leads to a
# likelier translation. Beam search keeps the `beam_size` best partial translations instead,
# each *live beam* scored by the sum of its tokens' log-probabilities. Decode each source row
# on its own. At each step:
#
# 1. extend every live beam by every token and take the `2 * beam_size` best extensions;
# 2. walk them best first until `beam_size` of them go on: each that does not end is a live
#    beam of the next step; each that ends with `</s>` *before that point* is set aside as a
#    finished translation (an `</s>` further down the list is not among the best, and is
#    dropped);
# 3. stop when `beam_size` translations have finished, or after `max_new_tokens` steps.
#
# A finished translation's score is its total log-probability divided by
# `length ** length_penalty`, its *length* counting its tokens and its `</s>`, not `<s>`
# (`[5, 6, </s>]` has length 3): long translations are not punished for having more factors
# below one. Return the best finished translation of each row, without `<s>` and `</s>`; if
# none finished within `max_new_tokens` steps, the live beams compete instead, each scored the
# same way over its own length. A beam of one is greedy decoding. The arguments are checked as
# in greedy decoding (`_decode_args`, with `beam_size`).

# %% [exercise] transformer_course.decoding:beam_search difficulty=4 importance=3 minutes=40
# hint: Decode one source row at a time: encode it once, and keep a (beams, length) tensor of
#   live hypotheses with a (beams,) tensor of their scores, starting from `<s>` and 0.
# hint: Each step: `log_softmax` of the last position's logits for every live beam, add each
#   beam's score, flatten, take the top 2 * beam_size; `divmod(index, vocab)` gives the beam and
#   the token.
# hint: Walk the candidates best first: an end token moves its beam to the finished list (with
#   the length-normalised score, `step + 1` tokens long), anything else joins the next live set,
#   and the walk stops at beam_size live. After the loop, no finished one means the live compete.

# %% [check]
check_beam_search(beam_search)
keep(beam_search)

# %% [markdown]
# ## Your translator
#
# Everything is in place: your tokenizer, attention, masks and layer norm from chapters 1–4,
# your embedding, MLP, residual sublayer, block and model, your loss and schedule, your
# decoding. The data is Tatoeba's English→Spanish pairs of at most six words; the test
# sentences were never seen in training (the split is by English sentence). Your `BPETokenizer`
# learns one byte-level vocabulary for both languages from the training pairs; the course's
# `LengthBatches` groups sentences of similar length into batches, and its training loop
# (`transformer_course.training.train`, chapter 5's shared loop; you write one yourself in
# chapter 6) trains your model with your `label_smoothed_cross_entropy` and your
# `inverse_sqrt_lr`: 800 steps, a few minutes on a CPU (the `full` profile's 1,000 train on the
# GPU when there is one, `get_device()`). They give rough but recognisable
# Spanish: the loss falls to under half its start, and greedy test BLEU reaches 3 or more (the
# cells assert both). The book page trains 1,000 steps and usually scores higher.

# %% [check] tags=nbval-ignore-output
from transformer_course.decoding import BOS, EOS, PAD, SPECIAL_TOKENS, pad_batch
from transformer_course.runtime import get_device
from transformer_course.tokenizer_files import GPT2_SPLIT_PATTERN
from transformer_course.training import TrainConfig, train
from transformer_course.translation import (
    SETUPS,
    LengthBatches,
    corpus_bleu,
    load_splits,
    model_config,
    references_by_source,
)

setup = SETUPS["quick"]
splits = load_splits(setup.max_words)
text = "\n".join(f"{english}\n{spanish}" for english, spanish in splits["train"])
tokenizer = BPETokenizer.train(  # your tokenizer, with your merges
    text, setup.vocab_size, pattern=GPT2_SPLIT_PATTERN, special_tokens=SPECIAL_TOKENS
)
pad, bos, eos = (tokenizer.special_tokens[t] for t in (PAD, BOS, EOS))
seed_everything(0)
device = get_device()
model = EncoderDecoderTransformer(model_config(setup, tokenizer)).to(device)
set_fast_path(model, True)  # PyTorch's fused attention kernel in your attention: faster
whose_parts(globals(), chapter=5)


def loss_fn(model, batch):
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    smoothing = setup.label_smoothing
    return label_smoothed_cross_entropy(logits, tgt_out, smoothing=smoothing, ignore_index=pad)


def schedule(step):
    return inverse_sqrt_lr(step, lr=setup.lr, warmup_steps=setup.warmup_steps)


config = TrainConfig(
    max_steps=by_profile(quick=800, full=setup.max_steps), lr=setup.lr, lr_schedule=schedule,
    betas=(0.9, 0.98), grad_clip=1.0, log_every=200, seed=setup.seed,
)
batches = LengthBatches(tokenizer, splits["train"], setup.batch_size, device=device)
history = train(model, config, batches, loss_fn)
set_fast_path(model, False)
model.cpu()  # back from the GPU, if it trained there: your decoders below run on the CPU
first, last = history.train_loss[:20], history.train_loss[-20:]  # 20 steps each
assert sum(last) < sum(first) / 2, "your model learned: its loss fell to under half its start"

# %% [markdown]
# Translate sentences the model has never seen, with your greedy decoding and your beam search,
# and score 300 test sentences with BLEU against every reference translation Tatoeba lists.


# %% [check] tags=nbval-ignore-output
def translate_with(decoder, sentences, **options):
    src = pad_batch([tokenizer.encode(s) + [eos] for s in sentences], pad)
    rows = decoder(model.eval(), src, bos_id=bos, eos_id=eos, max_new_tokens=model.cfg.n_ctx, **options)
    return [tokenizer.decode(row) for row in rows]


sources, references = references_by_source(splits["test"])
sources, references = sources[:300], references[:300]
greedy = translate_with(greedy_decode, sources)
beam = translate_with(beam_search, sources[:8], beam_size=4)
for source, g, b, refs in zip(sources[:8], greedy, beam, references):
    print(f"{source}\n    greedy: {g}\n    beam 4: {b}\n    Tatoeba: {refs[0]}")
bleu = corpus_bleu(greedy, references).score
print(f"test BLEU, greedy, 300 sentences: {bleu:.1f}")
assert bleu >= by_profile(quick=3, full=6), "your translator translates: test BLEU well above 0"
