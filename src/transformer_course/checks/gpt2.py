"""Checkers for chapter 6's workbook (06_gpt2): GPT-2's embeddings and unembedding, the MLP and
the transformer block, the forward pass, top-p filtering, sampling, the training step, batches
of a token stream and the KV cache."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer_course.attention import LayerCache
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
)
from transformer_course.gpt2 import GPT2, GPT2Config, generate, lm_loss, top_p_filter, train_step
from transformer_course.masking import causal_mask, padding_mask
from transformer_course.runtime import evaluating

CFG = GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=37, n_ctx=12)


def _tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, CFG.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed)
    )


def _build(name: str, cls: type, *args, params: dict[str, tuple]) -> torch.nn.Module:
    """The learner's module, after checking its parameters' names and shapes; their values
    random, so a forward pass that ignores one shows up."""
    module = call(f"{name}.__init__", cls, *args)
    for param, shape in params.items():
        got = getattr(module, param, None)
        shaped = isinstance(got, torch.nn.Parameter) and tuple(got.shape) == shape
        problem = f"expected a parameter `{param}` (an nn.Parameter) of shape {shape}, got "
        hint = "TransformerLens layout: matrices are (d_in, d_out), embeddings (rows, d_model)."
        expect(shaped, name, problem + f"{describe(got)}.", hint)
    return module


def _filled(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for k, param in enumerate(module.parameters()):
            param.copy_(randn(*param.shape, seed=k, dtype=param.dtype))
    return module


def check_embed(cls: type) -> None:
    """`Embed(cfg)`: parameter `W_E (d_vocab, d_model)`; `forward(tokens)` looks up each token's
    row."""
    name, tokens = "Embed", _tokens()
    embed = _filled(_build(name, cls, CFG, params={"W_E": (CFG.d_vocab, CFG.d_model)}))
    expected = F.embedding(tokens, embed.W_E.detach())
    scaled = "the embeddings are scaled by sqrt(d_model), as in Vaswani et al.; GPT-2 uses "
    mistakes = {scaled + "W_E[tokens] as it is.": expected * math.sqrt(CFG.d_model)}
    hint = "row t of W_E is the embedding of token id t: index W_E with the tokens."
    expect_close(call(f"{name}.forward", embed, tokens), expected, name, hint, mistakes=mistakes)
    passed(name)


def check_pos_embed(cls: type) -> None:
    """`PosEmbed(cfg)`: parameter `W_pos (n_ctx, d_model)`; `forward(tokens)` returns the first
    `pos` rows, repeated over the batch."""
    name, tokens = "PosEmbed", _tokens() % CFG.n_ctx  # ids below n_ctx: indexing by id runs too
    pos_embed = _filled(_build(name, cls, CFG, params={"W_pos": (CFG.n_ctx, CFG.d_model)}))
    W_pos = pos_embed.W_pos.detach()
    hint = "position embeddings depend on where a token is (0, 1, ..., pos-1), not on which token "
    mistakes = {f"the output is W_pos indexed by the token ids: {hint}it is.": W_pos[tokens]}
    hint = "return W_pos[:pos] for every sequence, shape (batch, pos, d_model): einops.repeat."
    actual, expected = call(f"{name}.forward", pos_embed, tokens), W_pos[:7].expand(3, 7, -1)
    expect_close(actual, expected, name, hint, mistakes=mistakes)
    passed(name)


def check_unembed(cls: type) -> None:
    """`Unembed(cfg)`: parameters `W_U (d_model, d_vocab)` and `b_U (d_vocab,)`, initialised
    N(0, init_range) and zero; `forward(x) = x @ W_U + b_U`."""
    name, x = "Unembed", randn(2, 5, CFG.d_model, seed=2, dtype=torch.float32)
    torch.manual_seed(0)
    params = {"W_U": (CFG.d_model, CFG.d_vocab), "b_U": (CFG.d_vocab,)}
    unembed = _build(name, cls, CFG, params=params)
    b_U, std = unembed.b_U.detach(), unembed.W_U.detach().std().item()
    hint = "biases start at zeros (torch.zeros), not ones: a bias of one shifts every logit."
    expect(not b_U.any(), name, f"`b_U` should start at zero, got {describe(b_U)}.", hint)
    problem = f"`W_U` should start with standard deviation {CFG.init_range}, got {std:.3g}."
    hint = "initialise it with nn.init.normal_(self.W_U, std=cfg.init_range)."
    expect(abs(std - CFG.init_range) < 0.3 * CFG.init_range, name, problem, hint)
    W_U, b_U = _filled(unembed).W_U.detach(), unembed.b_U.detach()
    mistakes = {"the output does not include the bias: add b_U after the matrix product.": x @ W_U}
    actual = call(f"{name}.forward", unembed, x)
    expect_close(actual, x @ W_U + b_U, name, "logits are x @ W_U + b_U.", mistakes=mistakes)
    passed(name)


def check_mlp(cls: type) -> None:
    """`MLP(d_model, d_mlp, act_fn="gelu_new")`: `W_out(act(x @ W_in + b_in)) + b_out`, with the
    activation it was built with, its hook points fed."""
    name, x = "MLP", randn(2, 5, 16, seed=3, dtype=torch.float32)
    params = {"W_in": (16, 64), "b_in": (64,), "W_out": (64, 16), "b_out": (16,)}
    mlp = _filled(_build(name, cls, 16, 64, params=params))
    W_in, b_in, W_out, b_out = (getattr(mlp, p).detach() for p in params)
    act = lambda f: f(x @ W_in + b_in) @ W_out + b_out
    mistakes = {
        "GPT-2 uses gelu_new, the tanh approximation: F.gelu(x, approximate='tanh'), not the "
        "exact erf GELU.": act(F.gelu),
        "the activation is GELU (gelu_new), not ReLU.": act(F.relu),
    }
    hint = "x @ W_in + b_in, then gelu_new, then @ W_out + b_out."
    expected = act(lambda h: F.gelu(h, approximate="tanh"))
    expect_close(call(f"{name}.forward", mlp, x), expected, name, hint, mistakes=mistakes)
    for act_fn in ("relu", "gelu"):
        where = f"{name}(act_fn={act_fn!r})"
        theirs, reference = call(where, cls, 16, 64, act_fn=act_fn), ReferenceMLP(16, 64, act_fn)
        reference.load_state_dict(mlp.state_dict()), theirs.load_state_dict(mlp.state_dict())
        hint = "use the activation the module was built with, ACTIVATIONS[self.act_fn]."
        expect_close(call(where, theirs, x), reference(x).detach(), where, hint)
    reference = ReferenceMLP(16, 64)
    reference.load_state_dict(mlp.state_dict())
    hooks = {
        "hook_pre": "pass x @ W_in + b_in (before the activation) through self.hook_pre.",
        "hook_post": "pass the activation's output through self.hook_post, before W_out.",
    }
    expect_hooks(name, mlp, reference, hooks, x, atol=1e-6)
    passed(name)


def check_transformer_block(cls: type) -> None:
    """`TransformerBlock(d_model, n_heads, d_head, d_mlp, *, norm, dropout, ...)`: causal
    self-attention and an MLP on the residual stream, pre-LN or post-LN, with and without a
    padding mask."""
    x = randn(2, 5, 16, seed=4)
    padding = padding_mask(torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]), 0)
    cases = [("no mask", (x,), {}), ("a padding mask", (x, padding), {})]
    hint = "pre-LN: x = x + dropout(attn(ln1(x), mask, causal)), x = x + dropout(mlp(ln2(x)))."
    for norm in ("pre", "post"):
        expect_block(f"TransformerBlock(norm={norm!r})", cls, dict(norm=norm), cases, hint=hint)
    passed("TransformerBlock")


def _reference_model(seed: int = 0, cfg: GPT2Config = CFG) -> GPT2:
    """The course's GPT-2 with noise on every parameter, so a forward pass that skips a bias,
    a layer-norm gain or a component shows up in the logits."""
    torch.manual_seed(seed)
    return perturb(GPT2(cfg), seed=seed + 1, scale=0.1).eval()


def check_gpt2_forward(cls: type) -> None:
    """`GPT2(cfg).forward(tokens)`: embed + position embed, the blocks, `ln_final`, unembed; the
    embeddings through their hook points; dropout on their sum."""
    name, reference, tokens = "GPT2", _reference_model(), _tokens(batch=2, pos=9)
    model = call(f"{name}.__init__", cls, CFG)
    load_reference_weights(name, model, reference, "embed, pos_embed, blocks, ln_final, unembed")
    with torch.no_grad():
        embed, pos = reference.embed(tokens), reference.pos_embed(tokens)

        def run(residual: torch.Tensor, final_ln: bool = True) -> torch.Tensor:
            for block in reference.blocks:
                residual = block(residual)
            return reference.unembed(reference.ln_final(residual) if final_ln else residual)

        mistakes = {
            "the position embedding is missing: add pos_embed(tokens) to embed(tokens).": run(
                embed
            ),
            "apply ln_final to the residual stream before the unembedding.": run(
                embed + pos, False
            ),
            "the blocks did not run: pass the residual stream through every block in self.blocks.": (
                reference.unembed(reference.ln_final(embed + pos))
            ),
        }
        actual = call(f"{name}.forward", model.eval(), tokens)
    hint = "embed + pos_embed, then each block in turn, then ln_final, then unembed."
    expect_close(actual, reference(tokens), name, hint, atol=1e-4, mistakes=mistakes)
    hooks = {
        "hook_embed": "pass the token embeddings, embed(tokens), through self.hook_embed.",
        "hook_pos_embed": "pass pos_embed(tokens) through self.hook_pos_embed.",
    }
    expect_hooks(name, model, reference, hooks, tokens, atol=1e-6)
    torch.manual_seed(0)
    reference = GPT2(GPT2Config(**{**vars(CFG), "dropout": 0.3}))
    model = call(f"{name}.__init__", cls, reference.cfg)
    model.load_state_dict(reference.state_dict())
    hint = "apply self.dropout once, to the sum of the embeddings, before the blocks."
    where = f"{name} (dropout=0.3)"
    expect_same_in_train_mode(where, model, reference, tokens, hint=hint, atol=1e-5)
    passed(name)


def _top_p_mistakes(logits: torch.Tensor, top_p: float) -> dict[str, torch.Tensor]:
    """The outputs of the classic top-p bugs, keyed by their hint."""
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    past = probs.cumsum(-1) > top_p  # drops the token that crosses top_p too
    before = probs.cumsum(-1) - probs >= top_p
    return {
        "keep the token whose probability carries the total past top_p: drop a token only when "
        "the mass *before* it already reaches top_p (so the top token always stays).": (
            logits.masked_fill(past.scatter(-1, order, past), -math.inf)
        ),
        "the right number of tokens, the wrong ones: scatter the mask from sorted order back to "
        "vocabulary order.": logits.masked_fill(before, -math.inf),
        "return the kept logits unchanged (the softmax renormalises them later).": top_p_filter(
            logits, top_p
        ).log_softmax(-1),
    }


def check_top_p_filter(fn: Callable[..., torch.Tensor]) -> None:
    """`fn(logits, top_p)`: per row, keep the fewest most likely tokens whose probabilities
    reach `top_p` (the one that crosses it included); the others become -inf."""
    name, rows = "top_p_filter", torch.tensor([[0.5], [1], [2], [4]], dtype=torch.float64)
    logits = randn(4, 11, seed=12) * rows
    hint = "sort each row's probabilities (softmax, not raw logits) in descending order, cumsum."
    for top_p in (0.3, 0.75, 0.95, 1.0, 1e-6):
        where = f"{name}(logits of 4 different rows, top_p={top_p})"
        actual, mistakes = call(where, fn, logits.clone(), top_p), _top_p_mistakes(logits, top_p)
        expect_close(actual, top_p_filter(logits, top_p), where, hint, mistakes=mistakes)
    kept = call(name, fn, torch.zeros(2, 8, dtype=torch.float64), 0.5).isfinite().sum(-1).tolist()
    problem, where = f"kept {kept} tokens per row, expected 4.", f"{name}(8 equal logits, 0.5)"
    expect(kept == [4, 4], where, problem, "with ties any 4 of the 8 will do, but exactly 4.")
    passed(name)


def _greedy(model: GPT2, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    return generate(model, tokens, steps, temperature=0)


def _expect_greedy(name: str, fn: Callable, model: GPT2, prompt: torch.Tensor) -> None:
    """temperature=0: the prompt followed by the most likely token each step, also past n_ctx."""
    zero = "temperature=0 means greedy decoding: take the argmax instead of dividing by zero."
    out = call(f"{name}(temperature=0)", fn, model, prompt, 3, temperature=0, hint=zero)
    got = tuple(getattr(out, "shape", ()))
    hint = "return the prompt followed by the new tokens: torch.cat([tokens, next_token], dim=1)."
    expect(
        got == (2, 7), name, f"4 prompt tokens and 3 new ones: expected (2, 7), got {got}.", hint
    )
    expect(
        torch.equal(out[:, :4], prompt), name, "the output does not start with the prompt.", hint
    )
    hint = "use logits[:, -1, :] (the last position) and argmax when temperature == 0."
    expect_close(out, _greedy(model, prompt, 3), f"{name}(temperature=0)", hint)
    crop, steps = "feed only the last n_ctx tokens to the model: tokens[:, -model.cfg.n_ctx:].", 14
    where = f"{name}(temperature=0), growing past n_ctx={CFG.n_ctx}"
    long = call(where, fn, model, prompt, steps, temperature=0, hint=crop)
    expect_close(long, _greedy(model, prompt, steps), where, crop)


def _sampling(logits: torch.Tensor, steps: str, temperature=1.0, top_k=None, top_p=None):
    """The distribution of the next token when `steps` go in order: divide by the temperature
    (t), multiply by it (m), top_k (k), top_p (p)."""
    for step in steps:
        if step in "tm":
            logits = logits / temperature if step == "t" else logits * temperature
        elif step == "k" and top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
        elif step == "p" and top_p is not None:
            logits = top_p_filter(logits[None], top_p)[0]
    return logits.softmax(-1)


SAMPLING_MISTAKES = {  # the order of the steps each gives
    "divide the logits by the temperature (a low temperature sharpens), don't multiply.": "mkp",
    "divide by the temperature first: top_k and top_p filter the scaled logits (top_p on "
    "unscaled logits keeps another nucleus).": "kpt",
    "apply top_k before top_p: the nucleus is taken among the top_k tokens.": "tpk",
    "top_p is ignored: after temperature and top_k, filter with your top_p_filter.": "tk",
    "top_k is ignored: keep only the top_k largest logits of each row.": "tp",
}
SAMPLING_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.5, top_p=0.6),
    dict(temperature=2.0, top_k=8, top_p=0.5),
    dict(temperature=0.7, top_k=6, top_p=0.8),
]


def _expect_sampling(name: str, fn: Callable, model: GPT2, one: torch.Tensor, **options) -> None:
    """Many copies of one prompt, one new token each: the tokens the reference draws under the
    same seed, or samples whose frequencies follow the reference's distribution."""
    n, where = 4000, f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"
    torch.manual_seed(5)
    drawn = call(where, fn, model, one.expand(n, -1), 1, **options)
    got = tuple(getattr(drawn, "shape", ()))
    expect(got == (n, 2), where, f"expected shape ({n}, 2), got {got}.")
    torch.manual_seed(5)
    if torch.equal(drawn, generate(model, one.expand(n, -1), 1, **options)):
        return
    with torch.no_grad():
        logits = model(one)[0, -1].double()
    freq = torch.bincount(drawn[:, -1], minlength=CFG.d_vocab).double() / n
    wanted = _sampling(logits, "tkp", **options)
    if (freq - wanted).abs().max() < 0.03 and not freq[wanted == 0].any():  # about 4 std errors
        return
    mistakes = {
        hint: _sampling(logits, steps, **options) for hint, steps in SAMPLING_MISTAKES.items()
    }
    argmax = "with temperature > 0, sample from the distribution instead of taking the argmax."
    mistakes[argmax] = F.one_hot(logits.argmax(), CFG.d_vocab).double()
    worst = (freq - wanted).abs().max().item()
    problem = f"the samples do not follow the model's distribution (off by up to {worst:.3f})."
    expect_no_known_mistake(where, freq, mistakes, atol=0.03, problem=problem)
    hint = "sample with torch.multinomial(softmax(filtered logits / temperature), 1)."
    expect(False, where, problem, hint)


def _expect_top_k_per_row(name: str, fn: Callable, model: GPT2) -> None:
    """Rows with different prompts: each row samples from its own top k, not row 0's."""
    prompts, n, where = (
        _tokens(batch=4, pos=3, seed=8),
        1500,
        f"{name}(top_k=3, four different prompts)",
    )
    with torch.no_grad():
        top = model(prompts)[:, -1].double().topk(3, dim=-1)
    torch.manual_seed(9)
    drawn = call(where, fn, model, prompts.repeat_interleave(n, dim=0), 1, top_k=3)[:, -1]
    for row in range(len(prompts)):
        mine = drawn[row * n : (row + 1) * n, None] == top.indices[row]
        freq = mine.double().mean(0)
        own = mine.any(-1).all() and (freq - top.values[row].softmax(-1)).abs().max() < 0.06
        shares = [round(f, 3) for f in freq.tolist()]
        problem = f"row {row} does not sample from its own 3 most likely tokens ({shares})."
        hint = "take the k-th largest logit of each row (topk over dim=-1, a (batch, 1) threshold)."
        expect(own, where, problem, hint)


def check_generate(fn: Callable[..., torch.Tensor]) -> None:
    """`generate(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
    generator=None)`: greedy at temperature 0 (also past n_ctx); samples that follow the
    softmax of the logits divided by the temperature, then filtered by top_k and top_p, in
    every combination; top-k per row; draws from `generator`; eval mode and no gradients with
    the model's mode restored."""
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
        runs.append(call(name, fn, model, prompt, 6, generator=torch.Generator().manual_seed(11)))
    hint = "draw every random number from the generator you are given: "
    hint += "torch.multinomial(probs, 1, generator=generator)."
    problem = "two runs with the same generator seed gave different tokens."
    expect(
        torch.equal(*runs), f"{name}(generator=Generator().manual_seed(11)), twice", problem, hint
    )
    model = _reference_model(seed=3, cfg=GPT2Config(**{**vars(CFG), "dropout": 0.5}))
    out = expect_evaluating(name, fn, model, prompt, 6, temperature=0)
    where = f"{name}(temperature=0), a model with dropout=0.5 in train mode"
    expect_close(out, _greedy(model, prompt, 6), where, "generate in eval mode: no dropout.")
    passed(name)


def check_train_step(fn: Callable[..., float]) -> None:
    """`fn(model, optimizer, tokens, targets, *, grad_clip)`: train mode, fresh gradients, the loss,
    backward, gradients clipped unless grad_clip is None, one update; returns the loss as a
    float."""
    name = "train_step"
    tokens, targets = _tokens(batch=3, pos=6, seed=13), _tokens(batch=3, pos=6, seed=14)
    cfg = GPT2Config(**{**vars(CFG), "dropout": 0.2})
    for grad_clip in (0.5, None):
        models = []
        for _ in range(2):  # the learner's and the reference's, left in eval mode on purpose
            torch.manual_seed(15)
            model = GPT2(cfg).eval()
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.5)))
        (theirs, their_optimizer), (ours, our_optimizer) = models
        for step in range(2):
            where = f"{name} (step {step + 1}, dropout 0.2, SGD, grad_clip={grad_clip})"
            with evaluating(ours):
                eval_loss = lm_loss(ours(tokens), targets).item()
            none = "" if grad_clip else "grad_clip=None means no clipping: skip clip_grad_norm_."
            torch.manual_seed(100 + step)
            loss = call(
                where, fn, theirs, their_optimizer, tokens, targets, grad_clip=grad_clip, hint=none
            )
            torch.manual_seed(100 + step)
            expected = train_step(ours, our_optimizer, tokens, targets, grad_clip=grad_clip)
            problem = f"expected the loss as a Python float, got {describe(loss)}."
            hint = "return loss.item(): a float frees the graph and is what a log or a plot wants."
            expect(isinstance(loss, float), where, problem, hint)
            eval_mode = "the model ran in eval mode: call model.train() first, so dropout is on."
            hint = "loss = lm_loss(model(tokens), targets), computed before the update."
            expect_close(loss, expected, where, hint, mistakes={eval_mode: eval_loss})
            drift = max(
                (a - b).abs().max().item() for a, b in zip(theirs.parameters(), ours.parameters())
            )
            problem = f"the parameters after the update differ by up to {drift:.3g}."
            hint = (
                "zero the gradients before backward (optimizer.zero_grad()), so steps don't add up."
            )
            if step == 0:
                hint = "clip the gradients' global norm after backward, before optimizer.step(): "
                hint += "torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)."
            expect(drift <= 1e-5, where, problem, hint)
    passed(name)


def check_against_huggingface(model: torch.nn.Module, hf_model: torch.nn.Module, tokens) -> None:
    """Compare a GPT-2 holding Hugging Face's weights with the Hugging Face model itself, component
    by component (embeddings, each block's output, the final norm, the logits), in float32 with
    tolerance 1e-4, and say which component first differs."""
    name, n_layers = "GPT2 with Hugging Face's weights", model.cfg.n_layers
    with evaluating(model), evaluating(hf_model):
        hf = hf_model(tokens, output_hidden_states=True)
        logits, cache = call(name, model.run_with_cache, tokens)
        last = model.ln_final(cache[f"blocks.{n_layers - 1}.hook_resid_post"])
    embeddings = cache["hook_embed"] + cache["hook_pos_embed"]
    block = "your TransformerBlock: x + attn(ln1(x)), then x + mlp(ln2(x))."
    stages = [("embeddings", embeddings, hf.hidden_states[0], "embed + pos_embed (wte and wpe).")]
    stages += [
        (
            f"block {layer}",
            cache[f"blocks.{layer}.hook_resid_post"],
            hf.hidden_states[layer + 1],
            block,
        )
        for layer in range(n_layers - 1)
    ]
    stages += [
        ("last block and ln_final", last, hf.hidden_states[-1], "the last block, then ln_final."),
        ("logits", logits, hf.logits, "unembed: x @ W_U + b_U, W_U the transpose of lm_head."),
    ]
    for stage, ours, theirs, hint in stages:
        worst = (ours.float() - theirs.float()).abs().max().item()
        print(f"{stage:<24} max |difference| {worst:.1e}")
        expect(
            worst < 1e-4,
            f"{name}, {stage}",
            f"differs from Hugging Face's by up to {worst:.3g}.",
            hint,
        )
    passed(name)


def _draw_windows(name: str, fn: Callable, data, batch_size: int, n_ctx: int, seed: int | None):
    """The learner's `(x, y)` for one call (with a generator seeded `seed`, or none), checked
    for its form: two tensors of shape `(batch_size, n_ctx)` holding ids of `data`."""
    where = f"{name}(data of {len(data)} tokens, batch_size={batch_size}, n_ctx={n_ctx})"
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    hint = "if an index ran past the end of data: the targets of the last window end at data[-1], "
    hint += "so a window starts at most at len(data) - n_ctx - 1 (randint's high is exclusive)."
    out = call(where, fn, data, batch_size, n_ctx, generator=generator, hint=hint)
    pair = (
        isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    )
    expect(pair, where, f"expected a pair of tensors (x, y), got {describe(out)}.")
    for label, t in zip("xy", out):
        got, shape = tuple(t.shape), (batch_size, n_ctx)
        problem = f"{label} should have shape {shape} (batch_size, n_ctx), got {got}."
        expect(got == shape, where, problem, "one window of n_ctx tokens per row, batch_size rows.")
        problem = f"{label} should hold ids taken from data (dtype {data.dtype}), got {t.dtype}."
        hint = "index data with the positions of each window, so the ids keep their dtype."
        expect(t.dtype == data.dtype and bool(torch.isin(t, data).all()), where, problem, hint)
    return out


def _expect_shifted(where: str, x: torch.Tensor, y: torch.Tensor, position: torch.Tensor) -> None:
    """Each row of `x` is consecutive tokens and `y` the same window one token later
    (`position[id]` is where the distinct id sits in the data)."""
    px, py = position[x], position[y]
    hint = "each row is data[start : start + n_ctx] for its own start."
    consecutive = bool((px.diff(dim=1) == 1).all())
    expect(consecutive, where, "a row of x is not a window of consecutive tokens of data.", hint)
    hint = "the targets are the next tokens: y = data[start + 1 : start + n_ctx + 1]."
    mistakes = {
        "the targets are the inputs themselves; " + hint: px,
        "the targets come one token before the inputs, not after; " + hint: px - 1,
    }
    if not torch.equal(py, px + 1):
        expect_no_known_mistake(where, py, mistakes, problem="y is not x shifted by one token.")
        expect(False, where, "y is not x shifted by one token.", hint)


def check_sample_batch(fn: Callable) -> None:
    """`sample_batch(data, batch_size, n_ctx, *, generator=None) -> (x, y)`: random windows of
    `n_ctx` tokens of the 1-d `data`, one per row, and the same windows one token later: shapes
    and dtype, targets shifted by one, every window reachable and none past the end, rows that
    differ, and repeatable draws from `generator`."""
    name, n = "sample_batch", 1000
    # Distinct ids in a shuffled order, so an id says where in data it was taken from.
    data = torch.randperm(n, generator=torch.Generator().manual_seed(18)) + 3
    position = torch.empty(n + 3, dtype=torch.long)
    position[data] = torch.arange(n)
    x, y = _draw_windows(name, fn, data, 64, 8, seed=19)
    where = f"{name}(data of {n} tokens, batch_size=64, n_ctx=8)"
    _expect_shifted(where, x, y, position)
    windows = position[x[:, 0]].unique().numel()
    hint = "draw one start per row (torch.randint(..., (batch_size,))), so the rows differ."
    expect(windows >= 32, where, f"the 64 rows hold only {windows} different windows.", hint)
    x, y = _draw_windows(name, fn, data[:10], 600, 4, seed=20)  # 6 windows, each about as often
    where = f"{name}(data of 10 tokens, batch_size=600, n_ctx=4)"
    _expect_shifted(where, x, y, position)
    counts = torch.bincount(position[x[:, 0]], minlength=6)
    problem = (
        f"windows start at {sorted(position[x[:, 0]].unique().tolist())}; expected each of 0-5."
    )
    hint = "the last window starts at len(data) - n_ctx - 1 (its targets end at data[-1]) and the "
    hint += "first at 0: torch.randint(len(data) - n_ctx, ...) draws exactly those."
    expect(counts[0] > 0 and counts[5] > 0, where, problem, hint)
    share = (counts.double() / counts.sum()).tolist()
    problem = f"the 6 windows come with shares {[round(v, 3) for v in share]}, not 1/6 each."
    hint = "draw each start uniformly: torch.randint(len(data) - n_ctx, (batch_size,))."
    expect(max(abs(v - 1 / 6) for v in share) < 0.07, where, problem, hint)  # 4.5 std errors

    def inputs(global_seed: int, seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        return _draw_windows(name, fn, data, 8, 8, seed=seed)[0]

    first, again, other = inputs(1, seed=21), inputs(2, seed=21), inputs(1, seed=22)
    problem = "two calls with equally seeded generators gave different windows."
    hint = (
        "draw the starts from the generator you are given: torch.randint(..., generator=generator)."
    )
    expect(torch.equal(first, again), f"{name}(..., generator seeded 21), twice", problem, hint)
    problem = "generators with different seeds gave the same windows."
    hint = "draw the starts from the generator you are given, not from a generator of your own."
    expect(
        not torch.equal(first, other), f"{name}(..., generator seeded 21, then 22)", problem, hint
    )
    x, y = _draw_windows(name, fn, data, 4, 8, seed=None)  # the global generator
    _expect_shifted(f"{name}(..., generator=None)", x, y, position)
    passed(name)


KV_ATOL = 1e-6  # the logits within this of the model's own forward pass, in float64
KV_CHUNKS = (5, 1, 1, 1, 3)  # a prompt, three tokens one at a time, then three at once
KV_KEYS_HINT = (
    "the new queries attend to the wrong keys: each may see every cached key and the new keys up "
    "to its own. Concatenate the cached keys and values before attending, and mask with "
    "causal_mask(q_len, k_len), which aligns the last query with the last key "
    "(F.scaled_dot_product_attention's is_causal=True aligns the first query with the first key)."
)

KV_NEW_KEYS_HINT = (
    "the new queries attend to the wrong keys: new tokens fed together still see only the keys "
    "up to their own; mask them with causal_mask(q_len, k_len) whenever there is a cache."
)


def _expect_cache(
    where: str, cache: object, cfg: GPT2Config, batch: int, seen: int, new: int
) -> None:
    """The cache after `seen` positions, `new` of them from the last call: per block a pair
    (keys, values), each `(batch, n_heads, seen, d_head)`."""
    pairs = isinstance(cache, (list, tuple)) and len(cache) == cfg.n_layers
    pairs = pairs and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in cache)
    problem = f"expected the cache as a list of {cfg.n_layers} (keys, values) pairs, one per block"
    hint = "return [(k, v) for each block], each (batch, n_heads, positions so far, d_head)."
    expect(pairs, where, f"{problem}, got {describe(cache)}.", hint)
    shape = (batch, cfg.n_heads, seen, cfg.d_head)
    for layer, pair in enumerate(cache):
        for label, t in zip(("keys", "values"), pair):
            got = tuple(getattr(t, "shape", ()))
            stale = len(got) == 4 and seen > new and got[2] in (new, seen - new)
            problem = f"block {layer}'s cached {label} should have shape {shape}, got {got}."
            hint = "the cache was not appended to: concatenate the new keys and values to the "
            hint += "cached ones (torch.cat(..., dim=-2)) and return the longer cache."
            expect(
                got == shape, where, problem, hint if stale else "(batch, n_heads, pos, d_head)."
            )


def _replay(name: str, fn: Callable, model: GPT2, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` to the learner's `fn` in the chunks of KV_CHUNKS, each call with the cache
    the previous one returned; the logits of every position."""
    cache, start, logits = None, 0, []
    for new in KV_CHUNKS:
        where = f"{name}(model, {new} new token{'s' * (new > 1)}, a cache of {start} positions)"
        with torch.no_grad():
            out = call(where, fn, model, tokens[:, start : start + new], cache)
        expect(
            isinstance(out, tuple) and len(out) == 2,
            where,
            f"expected (logits, cache), got {describe(out)}.",
        )
        chunk, cache = out
        shape, got = (tokens.shape[0], new, model.cfg.d_vocab), tuple(getattr(chunk, "shape", ()))
        hint = "one row of logits per new token: (batch, new, d_vocab)."
        expect(got == shape, where, f"expected logits of shape {shape}, got {got}.", hint)
        start += new
        _expect_cache(where, cache, model.cfg, tokens.shape[0], start, new)
        logits.append(chunk.detach())
    return torch.cat(logits, dim=1)


def _cached_logits(model: GPT2, tokens: torch.Tensor, offset: bool, mask: Callable) -> torch.Tensor:
    """The reference's logits when `tokens` come in the chunks of KV_CHUNKS, with the positions of
    new tokens counted after the cached ones (`offset`) or from 0, and `mask(q_len, k_len)` as
    the attention mask: the output of a classic KV-cache mistake."""
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
    then of tokens fed one and three at a time with the cache, must be those of
    `model(all tokens)` within 1e-6 (float64, two rows that differ), and greedy decoding with
    the cache must give the tokens greedy decoding without it gives."""
    name, model = "forward_with_cache", _reference_model(seed=5).double()
    tokens = _tokens(batch=2, pos=sum(KV_CHUNKS), seed=16)
    logits = _replay(name, fn, model, tokens)
    with torch.no_grad():
        expected = model(tokens)
        mistakes = {
            "the new tokens' positions do not count the cached ones: token i of the new ones sits "
            "at position len(cache) + i: add W_pos[start : start + new], not W_pos[:new].": (
                _cached_logits(model, tokens, False, causal_mask)
            ),
            KV_KEYS_HINT: _cached_logits(model, tokens, True, lambda q, k: causal_mask(k)[:q]),
            KV_NEW_KEYS_HINT: _cached_logits(
                model, tokens, True, lambda q, k: causal_mask(q) if q == k else None
            ),
        }
    diff = (logits.double() - expected).abs().nan_to_num(math.inf).amax(dim=(0, 2))
    if (diff > KV_ATOL).any():
        position = int((diff > KV_ATOL).nonzero()[0])
        call_index = max(i for i in range(len(KV_CHUNKS)) if sum(KV_CHUNKS[:i]) <= position)
        cached, new = sum(KV_CHUNKS[:call_index]), KV_CHUNKS[call_index]
        where = f"{name}, position {position}, in the call with {new} new token{'s' * (new > 1)} "
        where += f"after {cached} cached ones"
        problem = f"the logits differ from model(tokens)'s by up to {diff[position]:.3g} (tolerance {KV_ATOL:g}, float64)."
        expect_no_known_mistake(where, logits, mistakes, atol=KV_ATOL, problem=problem)
        hint = "the new tokens go through the same model as model(tokens): positions after the "
        hint += "cached ones, each block's keys and values appended to its cache before attending, "
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
