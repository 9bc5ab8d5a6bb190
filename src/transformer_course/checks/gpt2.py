"""Checkers for chapter 6's workbook (06_gpt2): GPT-2's embeddings and unembedding, the MLP and
the transformer block, the forward pass, top-p filtering, sampling, the training step, batches
of a token stream and the KV cache."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer_course.attention import LayerCache
from transformer_course.blocks import ACTIVATIONS
from transformer_course.blocks import MLP as ReferenceMLP
from transformer_course.checks.harness import (
    call,
    describe,
    expect,
    expect_block,
    expect_close,
    expect_evaluating,
    expect_hooks,
    expect_no_known_mistake,
    expect_same_in_train_mode,
    load_reference_weights,
    passed,
    perturb,
    randn,
    seeded,
    shape_of,
)
from transformer_course.gpt2 import GPT2, GPT2Config, generate, lm_loss, top_p_filter, train_step
from transformer_course.masking import causal_mask, padding_mask
from transformer_course.runtime import evaluating

CFG = GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=37, n_ctx=12)


def _tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.d_vocab, (batch, pos), generator=seeded(seed))


def _build(name: str, cls: type, *args, params: dict[str, tuple]) -> torch.nn.Module:
    """The learner's module, once its parameters' names and shapes are TransformerLens's."""
    module = call(f"{name}.__init__", cls, *args)
    for param, shape in params.items():
        got = getattr(module, param, None)
        shaped = isinstance(got, torch.nn.Parameter) and tuple(got.shape) == shape
        hint = "TransformerLens layout: matrices are (d_in, d_out), embeddings (rows, d_model)."
        expect(shaped, name, f"expected a parameter `{param}` {shape}, got {describe(got)}.", hint)
    return module


def check_embed(cls: type) -> None:
    """`Embed(cfg)`: parameter `W_E (d_vocab, d_model)`; `forward(tokens)` looks up each row."""
    name, tokens = "Embed", _tokens()
    embed = perturb(_build(name, cls, CFG, params={"W_E": (CFG.d_vocab, CFG.d_model)}), 0, 1.0)
    expected, actual = F.embedding(tokens, embed.W_E.detach()), call(name, embed, tokens)
    scaled = {"the embeddings are scaled by sqrt(d_model); GPT-2 uses W_E[tokens].": expected * 4}
    hint = "row t of W_E is the embedding of token id t: index W_E with the tokens."
    expect_close(actual, expected, name, hint, mistakes=scaled)
    passed(name)


def check_pos_embed(cls: type) -> None:
    """`PosEmbed(cfg)`: parameter `W_pos (n_ctx, d_model)`; `forward(tokens)` returns the first
    `pos` rows, repeated over the batch."""
    name, tokens = "PosEmbed", _tokens() % CFG.n_ctx  # ids below n_ctx: indexing by id runs too
    pos_embed = _build(name, cls, CFG, params={"W_pos": (CFG.n_ctx, CFG.d_model)})
    W_pos = perturb(pos_embed, 0, 1.0).W_pos.detach()
    by_token = "W_pos is indexed by the token ids: a position depends on where, not on which token."
    by_token = {by_token: W_pos[tokens]}
    hint = "return W_pos[:pos] for every sequence, shape (batch, pos, d_model): einops.repeat."
    actual, expected = call(name, pos_embed, tokens), W_pos[:7].expand(3, 7, -1)
    expect_close(actual, expected, name, hint, mistakes=by_token)
    passed(name)


def check_unembed(cls: type) -> None:
    """`Unembed(cfg)`: parameters `W_U (d_model, d_vocab)` and `b_U (d_vocab,)`, initialised
    N(0, init_range) and zero; `forward(x) = x @ W_U + b_U`."""
    name, x = "Unembed", randn(2, 5, CFG.d_model, seed=2, dtype=torch.float32)
    torch.manual_seed(0)
    d_model, d_vocab = CFG.d_model, CFG.d_vocab
    unembed = _build(name, cls, CFG, params={"W_U": (d_model, d_vocab), "b_U": (d_vocab,)})
    b_U, std = unembed.b_U.detach(), unembed.W_U.detach().std().item()
    hint = "biases start at zeros (torch.zeros), not ones: a bias of one shifts every logit."
    expect(not b_U.any(), name, f"`b_U` should start at zero, got {describe(b_U)}.", hint)
    problem, hint = f"`W_U`'s std is {std:.3g}.", "nn.init.normal_(self.W_U, std=cfg.init_range)."
    expect(abs(std - CFG.init_range) < 0.3 * CFG.init_range, name, problem, hint)
    W_U, b_U = perturb(unembed, 0, 1.0).W_U.detach(), unembed.b_U.detach()
    no_bias = {"the output does not include the bias: add b_U.": x @ W_U}
    expect_close(call(name, unembed, x), x @ W_U + b_U, name, "x @ W_U + b_U.", mistakes=no_bias)
    passed(name)


def check_mlp(cls: type) -> None:
    """`MLP(d_model, d_mlp, act_fn="gelu_new")`: `W_out(act(x @ W_in + b_in)) + b_out`, with the
    activation it was built with, its hook points fed."""
    name, x = "MLP", randn(2, 5, 16, seed=3, dtype=torch.float32)
    params = {"W_in": (16, 64), "b_in": (64,), "W_out": (64, 16), "b_out": (16,)}
    mlp = perturb(_build(name, cls, 16, 64, params=params), 0, 1.0)
    W_in, b_in, W_out, b_out = (getattr(mlp, p).detach() for p in params)
    act = lambda f: f(x @ W_in + b_in) @ W_out + b_out
    mistakes = {
        "GPT-2 uses gelu_new, F.gelu(x, approximate='tanh'), not the exact GELU.": act(F.gelu),
        "the activation is GELU (gelu_new), not ReLU.": act(F.relu),
    }
    hint, expected = "x @ W_in + b_in, gelu_new, @ W_out + b_out.", act(ACTIVATIONS["gelu_new"])
    expect_close(call(name, mlp, x), expected, name, hint, mistakes=mistakes)
    for act_fn in ("relu", "gelu", "gelu_new"):
        where = f"{name}(act_fn={act_fn!r})"
        theirs, reference = call(where, cls, 16, 64, act_fn=act_fn), ReferenceMLP(16, 64, act_fn)
        reference.load_state_dict(mlp.state_dict()), theirs.load_state_dict(mlp.state_dict())
        hint = "use the activation the module was built with, ACTIVATIONS[self.act_fn]."
        expect_close(call(where, theirs, x), reference(x).detach(), where, hint)
    hooks = {
        "hook_pre": "pass x @ W_in + b_in (before the activation) through self.hook_pre.",
        "hook_post": "pass the activation's output through self.hook_post, before W_out.",
    }
    expect_hooks(name, mlp, reference, hooks, x, atol=1e-6)
    passed(name)


def check_transformer_block(cls: type) -> None:
    """`TransformerBlock(d_model, n_heads, d_head, d_mlp, *, norm, dropout, ...)`: causal
    self-attention and an MLP on the residual stream, pre-LN or post-LN, with or without a mask."""
    x, padding = randn(2, 5, 16, seed=4), torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]])
    cases = [("no mask", (x,), {}), ("a padding mask", (x, padding_mask(padding, 0)), {})]
    hint = "pre-LN: x = x + dropout(attn(ln1(x), mask, causal)), x = x + dropout(mlp(ln2(x)))."
    for norm in ("pre", "post"):
        expect_block(f"TransformerBlock(norm={norm!r})", cls, dict(norm=norm), cases, hint=hint)
    passed("TransformerBlock")


def _reference_model(seed: int = 0, dropout: float = 0.0) -> GPT2:
    """The course's GPT-2 with noise on every parameter, so that skipping one shows."""
    torch.manual_seed(seed)
    return perturb(GPT2(GPT2Config(**{**vars(CFG), "dropout": dropout})), seed + 1, 0.1).eval()


def check_gpt2_forward(cls: type) -> None:
    """`GPT2(cfg).forward(tokens)`: embed + position embed, the blocks, `ln_final`, unembed; the
    embeddings through their hook points; dropout on their sum."""
    name, reference, tokens = "GPT2", _reference_model(), _tokens(batch=2, pos=9)
    model = call(f"{name}.__init__", cls, CFG)
    load_reference_weights(name, model, reference, "embed, pos_embed, blocks, ln_final, unembed")
    with torch.no_grad():
        embed, pos = reference.embed(tokens), reference.pos_embed(tokens)

        def run(residual: torch.Tensor, blocks=reference.blocks, final_ln=True) -> torch.Tensor:
            for block in blocks:
                residual = block(residual)
            return reference.unembed(reference.ln_final(residual) if final_ln else residual)

        mistakes = {
            "the position embedding is missing: add pos_embed(tokens).": run(embed),
            "apply ln_final before the unembedding.": run(embed + pos, final_ln=False),
            "the blocks did not run: pass the stream through every block.": run(embed + pos, ()),
        }
        actual = call(f"{name}.forward", model.eval(), tokens)
    hint = "embed + pos_embed, then each block in turn, then ln_final, then unembed."
    expect_close(actual, reference(tokens), name, hint, atol=1e-4, mistakes=mistakes)
    hooks = {
        "hook_embed": "pass the token embeddings, embed(tokens), through self.hook_embed.",
        "hook_pos_embed": "pass pos_embed(tokens) through self.hook_pos_embed.",
    }
    expect_hooks(name, model, reference, hooks, tokens, atol=1e-6)
    reference = _reference_model(dropout=0.3)
    model = call(f"{name}.__init__", cls, reference.cfg)
    model.load_state_dict(reference.state_dict())
    hint, where = "apply self.dropout to the embeddings, before the blocks.", f"{name} (dropout)"
    expect_same_in_train_mode(where, model, reference, tokens, hint=hint, atol=1e-5)
    passed(name)


def check_top_p_filter(fn: Callable[..., torch.Tensor]) -> None:
    """`fn(logits, top_p)`: per row, keep the fewest most likely tokens whose probabilities
    reach `top_p` (the one that crosses it included); the others become -inf."""
    name = "top_p_filter"
    logits = randn(4, 11, seed=12) * torch.tensor([[0.5], [1], [2], [4]], dtype=torch.float64)
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    hint = "sort each row's probabilities (softmax, not raw logits) in descending order, cumsum."
    for top_p in (0.3, 0.75, 0.95, 1.0, 1e-6):
        past, before = probs.cumsum(-1) > top_p, probs.cumsum(-1) - probs >= top_p
        past = past.scatter(-1, order, past)
        mistakes = {
            "keep the token that carries the total past top_p: drop a token only when the mass "
            "*before* it reaches top_p.": logits.masked_fill(past, -math.inf),
            "the right number of tokens, the wrong ones: scatter the mask back from sorted order "
            "to vocabulary order.": logits.masked_fill(before, -math.inf),
            "return the kept logits unchanged.": top_p_filter(logits, top_p).log_softmax(-1),
        }
        where = f"{name}(logits of 4 different rows, top_p={top_p})"
        actual = call(where, fn, logits.clone(), top_p)
        expect_close(actual, top_p_filter(logits, top_p), where, hint, mistakes=mistakes)
    kept = call(name, fn, torch.zeros(2, 8, dtype=torch.float64), 0.5).isfinite().sum(-1).tolist()
    problem, where = f"kept {kept} tokens per row, expected 4.", f"{name}(8 equal logits, 0.5)"
    expect(kept == [4, 4], where, problem, "with ties any 4 of the 8 will do, but exactly 4.")
    passed(name)


def _greedy(model: GPT2, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    return generate(model, tokens, steps, temperature=0)


def _expect_greedy(name: str, fn: Callable, model: GPT2, prompt: torch.Tensor) -> None:
    """temperature=0: the prompt followed by the most likely token each step, also past n_ctx."""
    zero, where = "temperature=0 is greedy: argmax, don't divide.", f"{name}(temperature=0)"
    out = call(where, fn, model, prompt, 3, temperature=0, hint=zero)
    hint = "return the prompt followed by the new tokens: torch.cat([tokens, next_token], dim=1)."
    expect(shape_of(out) == (2, 7), where, f"expected shape (2, 7), got {shape_of(out)}.", hint)
    expect(torch.equal(out[:, :4], prompt), where, "it does not start with the prompt.", hint)
    hint = "use logits[:, -1, :] (the last position) and argmax when temperature == 0."
    expect_close(out, _greedy(model, prompt, 3), where, hint)
    crop, where = "feed only the last n_ctx tokens: tokens[:, -n_ctx:].", f"{where}, past n_ctx"
    long = call(where, fn, model, prompt, 14, temperature=0, hint=crop)
    expect_close(long, _greedy(model, prompt, 14), where, crop)


def _sampling(logits: torch.Tensor, steps: str, temperature=1.0, top_k=None, top_p=None):
    """The next token's distribution with `steps` in order: divide by the temperature (t),
    multiply by it (m), top_k (k), top_p (p)."""
    for step in steps:
        if step in "tm":
            logits = logits / temperature if step == "t" else logits * temperature
        elif step == "k" and top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
        elif step == "p" and top_p is not None:
            logits = top_p_filter(logits[None], top_p)[0]
    return logits.softmax(-1)


SAMPLING_MISTAKES = [  # (the hint, the order of the steps that gives the mistake)
    ("divide the logits by the temperature (a low temperature sharpens), don't multiply.", "mkp"),
    ("divide by the temperature first: top_k and top_p filter the scaled logits.", "kpt"),
    ("apply top_k before top_p: the nucleus is taken among the top_k tokens.", "tpk"),
    ("top_p is ignored: after temperature and top_k, filter with your top_p_filter.", "tk"),
    ("top_k is ignored: keep only the top_k largest logits of each row.", "tp"),
]
SAMPLING_CASES = [  # those without top_p first
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.5, top_p=0.6),
    dict(temperature=2.0, top_k=8, top_p=0.5),
    dict(temperature=0.7, top_k=6, top_p=0.8),
]


def _expect_sampling(name: str, fn: Callable, model: GPT2, one: torch.Tensor, **options) -> None:
    """Many copies of a one-token prompt, one new token each: the reference's draws under the same
    seed, or frequencies that follow the reference's distribution."""
    n, where = 4000, f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"
    torch.manual_seed(5)
    drawn = call(where, fn, model, one.expand(n, -1), 1, **options)
    expect(shape_of(drawn) == (n, 2), where, f"expected shape ({n}, 2), got {shape_of(drawn)}.")
    torch.manual_seed(5)
    if torch.equal(drawn, generate(model, one.expand(n, -1), 1, **options)):
        return
    with torch.no_grad():
        logits = model(one)[0, -1].double()
    freq = torch.bincount(drawn[:, -1], minlength=CFG.d_vocab).double() / n
    wanted = _sampling(logits, "tkp", **options)
    if (freq - wanted).abs().max() < 0.03 and not freq[wanted == 0].any():  # about 4 std errors
        return
    mistakes = {hint: _sampling(logits, order, **options) for hint, order in SAMPLING_MISTAKES}
    argmax = "with temperature > 0, sample from the distribution instead of taking the argmax."
    mistakes[argmax] = F.one_hot(logits.argmax(), CFG.d_vocab).double()
    problem = (
        f"the samples do not follow the distribution (off by {(freq - wanted).abs().max():.3f})"
    )
    expect_no_known_mistake(where, freq, mistakes, atol=0.03, problem=problem)
    expect(False, where, problem, "sample with torch.multinomial(softmax(filtered logits), 1).")


def _expect_top_k_per_row(name: str, fn: Callable, model: GPT2) -> None:
    """Rows with different prompts: each row samples from its own top k, not row 0's."""
    prompts, n, where = _tokens(4, 3, seed=8), 1500, f"{name}(top_k=3, four different prompts)"
    with torch.no_grad():
        top = model(prompts)[:, -1].double().topk(3, dim=-1)
    torch.manual_seed(9)
    drawn = call(where, fn, model, prompts.repeat_interleave(n, dim=0), 1, top_k=3)[:, -1]
    hint = "take the k-th largest logit of each row (topk over dim=-1, a (batch, 1) threshold)."
    for row in range(len(prompts)):
        mine = drawn[row * n : (row + 1) * n, None] == top.indices[row]
        freq = mine.double().mean(0)
        own = mine.any(-1).all() and (freq - top.values[row].softmax(-1)).abs().max() < 0.06
        expect(own, where, f"row {row} does not sample from its own 3 likeliest tokens.", hint)


def check_generate(fn: Callable[..., torch.Tensor]) -> None:
    """`generate(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
    generator=None)`: greedy at temperature 0 (also past n_ctx); samples from the softmax of the
    logits divided by the temperature, then filtered by top_k and top_p, in every combination;
    top-k per row; draws from `generator`; eval mode, no gradients, the model's mode restored."""
    name, model, prompt = "generate", _reference_model(seed=3), _tokens(batch=2, pos=4, seed=4)
    _expect_greedy(name, fn, model, prompt)
    for options in SAMPLING_CASES[:3]:
        _expect_sampling(name, fn, model, prompt[:1, :1], **options)
    _expect_top_k_per_row(name, fn, model)
    for options in SAMPLING_CASES[3:]:
        _expect_sampling(name, fn, model, prompt[:1, :1], **options)
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        runs.append(call(name, fn, model, prompt, 6, generator=seeded(11)))
    hint = "draw every random number from the generator: multinomial(..., generator=generator)."
    problem = "two runs with the same generator seed gave different tokens."
    expect(torch.equal(*runs), f"{name}(generator=seeded(11)), twice", problem, hint)
    model = _reference_model(seed=3, dropout=0.5)
    out = expect_evaluating(name, fn, model, prompt, 6, temperature=0)
    where = f"{name}(temperature=0), a model with dropout=0.5 in train mode"
    expect_close(out, _greedy(model, prompt, 6), where, "generate in eval mode: no dropout.")
    passed(name)


def check_train_step(fn: Callable[..., float]) -> None:
    """`fn(model, optimizer, tokens, targets, *, grad_clip)`: train mode, fresh gradients, the loss,
    backward, gradients clipped unless grad_clip is None, one update; returns the loss, a float."""
    name, tokens, targets = "train_step", _tokens(3, 6, seed=13), _tokens(3, 6, seed=14)
    eval_mode = "the model ran in eval mode: call model.train() first, so dropout is on."
    clip = "clip the gradients' global norm after backward, before optimizer.step(): "
    clip += "torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)."
    for grad_clip in (0.5, None):
        theirs, ours = _reference_model(15, dropout=0.2), _reference_model(15, dropout=0.2)
        their_sgd, our_sgd = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (theirs, ours))
        none = "" if grad_clip else "grad_clip=None means no clipping: skip clip_grad_norm_."
        for step in range(2):  # the models come in eval mode: the step must switch to train
            where = f"{name} (step {step + 1}, dropout 0.2, SGD, grad_clip={grad_clip})"
            with evaluating(ours):
                mistakes = {eval_mode: lm_loss(ours(tokens), targets).item()}
            torch.manual_seed(100 + step)
            args = (theirs, their_sgd, tokens, targets)
            loss = call(where, fn, *args, grad_clip=grad_clip, hint=none)
            torch.manual_seed(100 + step)
            expected = train_step(ours, our_sgd, tokens, targets, grad_clip=grad_clip)
            expect(isinstance(loss, float), where, f"returned {describe(loss)}.", "loss.item()")
            hint = "loss = lm_loss(model(tokens), targets), computed before the update."
            expect_close(loss, expected, where, hint, mistakes=mistakes)
            drift = max((a - b).abs().max() for a, b in zip(theirs.parameters(), ours.parameters()))
            zero = "zero the gradients before backward (optimizer.zero_grad()), or steps add up."
            hint = zero if step else clip
            expect(drift <= 1e-5, where, f"the update is off by {drift:.3g}.", hint)
    passed(name)


def check_against_huggingface(model: torch.nn.Module, hf_model: torch.nn.Module, tokens) -> None:
    """Compare a GPT-2 holding Hugging Face's weights with the Hugging Face model itself, component
    by component (embeddings, each block's output, the final norm, the logits), in float32 with
    tolerance 1e-4, and say which component first differs."""
    name, last = "GPT2 with Hugging Face's weights", model.cfg.n_layers - 1
    with evaluating(model), evaluating(hf_model):
        hf = hf_model(tokens, output_hidden_states=True)
        logits, cache = call(name, model.run_with_cache, tokens)
        final = model.ln_final(cache[f"blocks.{last}.hook_resid_post"])
    stages = {"embeddings": (cache["hook_embed"] + cache["hook_pos_embed"], "embed + pos_embed.")}
    for layer in range(last):
        block = "your TransformerBlock: x + attn(ln1(x)), then x + mlp(ln2(x))."
        stages[f"block {layer}"] = (cache[f"blocks.{layer}.hook_resid_post"], block)
    stages["last block and ln_final"] = (final, "the last block, then ln_final.")
    stages["logits"] = (logits, "unembed: x @ W_U + b_U, W_U the transpose of lm_head.weight.")
    for (stage, (ours, hint)), theirs in zip(stages.items(), [*hf.hidden_states, hf.logits]):
        worst = (ours.float() - theirs.float()).abs().max().item()
        print(f"{stage:<24} max |difference| {worst:.1e}")
        expect(worst < 1e-4, f"{name}, {stage}", f"differs by up to {worst:.3g}.", hint)
    passed(name)


def _draw_windows(name: str, fn: Callable, data, batch_size: int, n_ctx: int, seed: int | None):
    """The learner's `(x, y)` for one call (with a generator seeded `seed`, or none), once they
    are two tensors of shape `(batch_size, n_ctx)` holding ids of `data`."""
    where = f"{name}(data of {len(data)} tokens, batch_size={batch_size}, n_ctx={n_ctx})"
    hint = "if an index ran past the end of data: the targets of the last window end at data[-1], "
    hint += "so a window starts at most at len(data) - n_ctx - 1 (randint's high is exclusive)."
    generator = None if seed is None else seeded(seed)
    out = call(where, fn, data, batch_size, n_ctx, generator=generator, hint=hint)
    shapes = [shape_of(t) for t in out] if isinstance(out, tuple) else describe(out)
    problem = f"expected x and y of shape {(batch_size, n_ctx)}, got {shapes}."
    expect(shapes == [(batch_size, n_ctx)] * 2, where, problem, "one window per row.")
    ids = all(t.dtype == data.dtype and torch.isin(t, data).all() for t in out)
    hint = "index data with the positions of each window, so the ids keep their dtype."
    expect(ids, where, "x and y should hold ids taken from data.", hint)
    return out


def _expect_shifted(where: str, x: torch.Tensor, y: torch.Tensor, position: torch.Tensor) -> None:
    """Each row of `x` is consecutive tokens and `y` the same window one token later
    (`position[id]` is where the distinct id sits in the data)."""
    px, py = position[x], position[y]
    hint = "each row is data[start : start + n_ctx] for its own start."
    expect(bool((px.diff(dim=1) == 1).all()), where, "a row of x is not a window of data.", hint)
    hint = "the targets are the next tokens: y = data[start + 1 : start + n_ctx + 1]."
    problem = "y is not x shifted by one token."
    mistakes = {
        "the targets are the inputs themselves; " + hint: px,
        "the targets come one token before the inputs, not after; " + hint: px - 1,
    }
    if not torch.equal(py, px + 1):
        expect_no_known_mistake(where, py, mistakes, problem=problem)
        expect(False, where, problem, hint)


def check_sample_batch(fn: Callable) -> None:
    """`sample_batch(data, batch_size, n_ctx, *, generator=None) -> (x, y)`: random windows of
    `n_ctx` tokens of the 1-d `data`, one per row, and the same windows one token later: shapes
    and dtype, targets shifted by one, every window reachable and none past the end, rows that
    differ, and repeatable draws from `generator`."""
    name, n = "sample_batch", 1000
    # Distinct ids in a shuffled order, so an id says where in data it was taken from.
    data, position = torch.randperm(n, generator=seeded(18)) + 3, torch.empty(n + 3).long()
    position[data] = torch.arange(n)
    x, y = _draw_windows(name, fn, data, 64, 8, seed=19)
    _expect_shifted(where := f"{name}(data of {n} tokens, batch_size=64, n_ctx=8)", x, y, position)
    windows, hint = position[x[:, 0]].unique().numel(), "draw one start per row: (batch_size,)."
    expect(windows >= 32, where, f"the 64 rows hold only {windows} different windows.", hint)
    x, y = _draw_windows(name, fn, data[:10], 600, 4, seed=20)  # 6 windows, each about as often
    _expect_shifted(where := f"{name}(data of 10 tokens, batch_size=600, n_ctx=4)", x, y, position)
    starts = position[x[:, 0]]
    problem = f"windows start at {sorted(starts.unique().tolist())}; expected each of 0-5."
    hint = "the last window starts at len(data) - n_ctx - 1 (its targets end at data[-1]), the "
    hint += "first at 0: torch.randint(len(data) - n_ctx, ...) draws exactly those."
    expect(starts.min() == 0 and starts.max() == 5, where, problem, hint)
    shares = (torch.bincount(starts, minlength=6) / len(starts)).tolist()
    problem = f"the 6 windows come with shares {[round(v, 3) for v in shares]}, not 1/6 each."
    hint = "draw each start uniformly: torch.randint(len(data) - n_ctx, (batch_size,))."
    expect(max(abs(v - 1 / 6) for v in shares) < 0.07, where, problem, hint)  # 4.5 std errors
    runs = []
    for global_seed, seed in ((1, 21), (2, 21), (1, 22)):
        torch.manual_seed(global_seed)
        runs.append(_draw_windows(name, fn, data, 8, 8, seed=seed)[0])
    hint = "draw the starts from the generator you are given: randint(..., generator=generator)."
    problem = "two calls with equally seeded generators gave different windows."
    expect(torch.equal(runs[0], runs[1]), f"{name}(generator seeded 21), twice", problem, hint)
    problem = "generators with different seeds gave the same windows."
    expect(not torch.equal(runs[0], runs[2]), f"{name}(generators seeded 21, 22)", problem, hint)
    x, y = _draw_windows(name, fn, data, 4, 8, seed=None)  # the global generator
    _expect_shifted(f"{name}(..., generator=None)", x, y, position)
    passed(name)


KV_ATOL = 1e-6  # the logits within this of the model's own forward pass, in float64
KV_CHUNKS = (5, 1, 1, 1, 3)  # a prompt, three tokens one at a time, then three at once
KV_KEYS = "the new queries attend to the wrong keys: each sees every cached key and the new keys "
KV_MISTAKES = [  # (the hint; new positions after the cached ones?; the mask of q_len, k_len)
    (
        "the new tokens' positions do not count the cached ones: token i of the new ones sits at "
        "position len(cache) + i: add W_pos[start : start + new], not W_pos[:new].",
        False,
        causal_mask,
    ),
    (
        KV_KEYS + "up to its own: mask with causal_mask(q_len, k_len), which aligns the last "
        "query with the last key (SDPA's is_causal=True aligns the first with the first).",
        True,
        lambda q_len, k_len: causal_mask(k_len)[:q_len],
    ),
    (
        KV_KEYS + "up to its own, also when fed together: causal_mask(q_len, k_len) with a cache.",
        True,
        lambda q_len, k_len: causal_mask(q_len) if q_len == k_len else None,
    ),
]


def _replay(name: str, fn: Callable, model: GPT2, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` to the learner's `fn` in the chunks of KV_CHUNKS, each call with the cache
    the previous one returned, checking each cache; the logits of every position."""
    cache, start, logits, (batch, n_layers) = None, 0, [], (tokens.shape[0], model.cfg.n_layers)
    for new in KV_CHUNKS:
        where = f"{name}(model, {new} new token{'s' * (new > 1)}, a cache of {start} positions)"
        with torch.no_grad():
            out = call(where, fn, model, tokens[:, start : start + new], cache)
        expect(isinstance(out, tuple) and len(out) == 2, where, "expected (logits, cache).")
        (chunk, cache), start = out, start + new
        shape = (batch, new, model.cfg.d_vocab)
        problem = f"expected logits of shape {shape} (batch, new, d_vocab), got {shape_of(chunk)}."
        expect(shape_of(chunk) == shape, where, problem)
        pairs = isinstance(cache, (list, tuple)) and len(cache) == n_layers
        shapes = [[shape_of(t) for t in pair] for pair in cache] if pairs else describe(cache)
        shape = (batch, model.cfg.n_heads, start, model.cfg.d_head)
        hint = "return [(k, v) for each block], each (batch, n_heads, positions so far, d_head)."
        if pairs and any(len(s) == 4 and s[2] < start for pair in shapes for s in pair):
            hint = "the cache was not appended to: torch.cat the new keys and values to it."
        problem = f"expected per block a pair (keys, values), each of shape {shape}; got {shapes}."
        expect(shapes == [[shape] * 2] * n_layers, where, problem, hint)
        logits.append(chunk.detach())
    return torch.cat(logits, dim=1)


def _cached_logits(model: GPT2, tokens: torch.Tensor, offset: bool, mask: Callable):
    """The reference's logits with `tokens` fed in the chunks of KV_CHUNKS, the new positions
    counted after the cached ones (`offset`) or from 0, attention masked by `mask(q_len, k_len)`."""
    caches, start, logits = [LayerCache() for _ in model.blocks], 0, []
    for new in KV_CHUNKS:
        first = start * offset
        x = model.embed(tokens[:, start : start + new]) + model.pos_embed.W_pos[first : first + new]
        for block, cache in zip(model.blocks, caches):
            x = x + block.attn(block.ln1(x), mask=mask(new, start + new), cache=cache)
            x = x + block.mlp(block.ln2(x))
        logits.append(model.unembed(model.ln_final(x)))
        start += new
    return torch.cat(logits, dim=1)


def check_kv_cache(fn: Callable) -> None:
    """`forward_with_cache(model, tokens, cache=None) -> (logits, cache)`: the logits of a prompt,
    then of tokens fed one and three at a time with the cache, are those of `model(all tokens)`
    within 1e-6 (float64, two rows that differ); greedy decoding with the cache gives the tokens
    greedy decoding without it gives."""
    name, model = "forward_with_cache", _reference_model(seed=5).double()
    tokens = _tokens(batch=2, pos=sum(KV_CHUNKS), seed=16)
    logits = _replay(name, fn, model, tokens)
    with torch.no_grad():
        expected = model(tokens)
        mistakes = {hint: _cached_logits(model, tokens, *how) for hint, *how in KV_MISTAKES}
    error = (logits.double() - expected).abs().nan_to_num(math.inf).amax(dim=(0, 2))
    if (error > KV_ATOL).any():
        position = int((error > KV_ATOL).nonzero()[0])
        calls = max(i for i in range(len(KV_CHUNKS)) if sum(KV_CHUNKS[:i]) <= position)
        new, cached = KV_CHUNKS[calls], sum(KV_CHUNKS[:calls])
        where = f"{name}, position {position}, in the call with {new} new token{'s' * (new > 1)} "
        where += f"after {cached} cached ones"
        problem = f"the logits differ from model(tokens)'s (tolerance {KV_ATOL:g}, float64)."
        expect_no_known_mistake(where, logits, mistakes, atol=KV_ATOL, problem=problem)
        hint = "the new tokens go through the model as in model(tokens): positions after the "
        hint += "cached ones, keys and values appended to each block's cache before attending, "
        hint += "causal_mask(q_len, k_len), then the MLP, ln_final and unembed."
        expect(False, where, problem, hint)
    prompt, steps = tokens[:, : KV_CHUNKS[0]], CFG.n_ctx - KV_CHUNKS[0]
    where = f"{name}, greedy decoding of {steps} tokens"
    with torch.no_grad():
        out, cache = call(where, fn, model, prompt, None)
        decoded = prompt
        for step in range(steps):
            decoded = torch.cat([decoded, out[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
            if step < steps - 1:
                out, cache = call(where, fn, model, decoded[:, -1:], cache)
    hint = "feed each new token alone, with the cache the previous call returned."
    expect_close(decoded, _greedy(model, prompt, steps), where, hint)
    passed(name)
