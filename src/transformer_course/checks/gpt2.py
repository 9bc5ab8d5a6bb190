"""Checkers for chapter 6's workbook (06_gpt2): GPT-2's parts and forward pass, sampling, batches,
training and its schedule, the validation loss, the KV cache and Hugging Face's weights."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import einops
import torch
import torch.nn.functional as F

from transformer_course import training
from transformer_course.attention import LayerCache
from transformer_course.checks.harness import (
    EVAL_HINT,
    build_module,
    call,
    describe,
    expect,
    expect_close,
    expect_evaluating,
    expect_hooks,
    expect_no_known_mistake,
    expect_same_in_train_mode,
    expect_schedule,
    expect_series,
    load_reference_weights,
    matches,
    passed,
    perturb,
    randn,
    seeded,
    shape_of,
)
from transformer_course.gpt2 import GPT2, GPT2Config, generate, top_p_filter, train_loop, train_step
from transformer_course.gpt2_weights import convert_hf_gpt2_state_dict
from transformer_course.masking import causal_mask
from transformer_course.runtime import evaluating

CFG = GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=37, n_ctx=12)


def _tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.d_vocab, (batch, pos), generator=seeded(seed))


def _reference_model(seed: int = 0, dropout: float = 0.0) -> GPT2:
    """The course's GPT-2 with noise on every parameter, so that skipping one shows."""
    torch.manual_seed(seed)
    return perturb(GPT2(GPT2Config(**{**vars(CFG), "dropout": dropout})), seed + 1, 0.1).eval()


def check_embed(cls: type) -> None:
    """`Embed(cfg)`: parameter `W_E (d_vocab, d_model)`; `forward(tokens)` looks up each row."""
    name, tokens = "Embed", _tokens()
    embed = build_module(name, cls, CFG, params={"W_E": (CFG.d_vocab, CFG.d_model)})
    expected = F.embedding(tokens, perturb(embed, 0, 1.0).W_E.detach())
    scaled = {"the embeddings are scaled by sqrt(d_model); GPT-2 uses W_E[tokens].": expected * 4}
    hint = "row t of W_E is the embedding of token id t: index W_E with the tokens."
    expect_close(call(name, embed, tokens), expected, name, hint, mistakes=scaled)
    passed(name)


def check_pos_embed(cls: type) -> None:
    """`PosEmbed(cfg)`: parameter `W_pos (n_ctx, d_model)`; the first `pos` rows per sequence."""
    name, tokens = "PosEmbed", _tokens() % CFG.n_ctx  # ids below n_ctx: indexing by id runs too
    pos_embed = build_module(name, cls, CFG, params={"W_pos": (CFG.n_ctx, CFG.d_model)})
    W_pos = perturb(pos_embed, 0, 1.0).W_pos.detach()
    by_token = "W_pos is indexed by the token ids: a position depends on where, not on which token."
    hint = "return W_pos[:pos] for every sequence, shape (batch, pos, d_model): einops.repeat."
    actual, expected = call(name, pos_embed, tokens), W_pos[:7].expand(3, 7, -1)
    expect_close(actual, expected, name, hint, mistakes={by_token: W_pos[tokens]})
    passed(name)


def check_unembed(cls: type) -> None:
    """`Unembed(cfg)`: `W_U (d_model, d_vocab)`, `b_U (d_vocab,)` from zero; `x @ W_U + b_U`."""
    name, x = "Unembed", randn(2, 5, CFG.d_model, seed=2, dtype=torch.float32)
    torch.manual_seed(0)
    params = {"W_U": (CFG.d_model, CFG.d_vocab), "b_U": (CFG.d_vocab,)}
    unembed = build_module(name, cls, CFG, params=params)
    b_U, std = unembed.b_U.detach(), unembed.W_U.detach().std().item()
    hint = "biases start at zeros (torch.zeros), not ones: a bias of one shifts every logit."
    expect(not b_U.any(), name, f"`b_U` should start at zero, got {describe(b_U)}.", hint)
    problem, hint = f"`W_U`'s std is {std:.3g}.", "nn.init.normal_(self.W_U, std=cfg.init_range)."
    expect(abs(std - CFG.init_range) < 0.3 * CFG.init_range, name, problem, hint)
    W_U, b_U = perturb(unembed, 0, 1.0).W_U.detach(), unembed.b_U.detach()
    no_bias = {"the output does not include the bias: add b_U.": x @ W_U}
    expect_close(call(name, unembed, x), x @ W_U + b_U, name, "x @ W_U + b_U.", mistakes=no_bias)
    passed(name)


def check_gpt2_forward(cls: type) -> None:
    """`GPT2(cfg).forward(tokens)`: embeddings (hooked, dropout), blocks, `ln_final`, unembed."""
    name, reference, tokens = "GPT2", _reference_model(), _tokens(batch=2, pos=9)
    model = call(f"{name}.__init__", cls, CFG)
    load_reference_weights(name, model, reference, "embed, pos_embed, blocks, ln_final, unembed")
    no_pos = [("hook_pos_embed", lambda pos, hook: torch.zeros_like(pos))]
    hint = "the position embedding is missing: add pos_embed(tokens)."
    mistakes = {hint: reference.run_with_hooks(tokens, fwd_hooks=no_pos)}
    last = reference.run_with_cache(tokens)[1][f"blocks.{CFG.n_layers - 1}.hook_resid_post"]
    mistakes["apply ln_final before the unembedding."] = reference.unembed(last)
    actual = call(f"{name}.forward", model.eval(), tokens)
    hint = "embed + pos_embed, then each block in turn, then ln_final, then unembed."
    expect_close(actual, reference(tokens), name, hint, atol=1e-4, mistakes=mistakes)
    hooks = {"hook_embed": "embed(tokens)", "hook_pos_embed": "pos_embed(tokens)"}
    hooks = {hook: f"pass {what} through self.{hook}." for hook, what in hooks.items()}
    expect_hooks(name, model, reference, hooks, tokens, atol=1e-6)
    reference = _reference_model(dropout=0.3)
    model = call(f"{name}.__init__", cls, reference.cfg)
    hint, where = "apply self.dropout to the embeddings, before the blocks.", f"{name} (dropout)"
    expect_same_in_train_mode(where, model, reference, tokens, hint=hint, atol=1e-5)
    passed(name)


def check_top_p_filter(fn: Callable[..., torch.Tensor]) -> None:
    """`fn(logits, top_p)`: keep each row's fewest likeliest tokens reaching top_p; -inf else."""
    logits = randn(4, 11, seed=12) * torch.tensor([[0.5], [1], [2], [4]], dtype=torch.float64)
    probs, order = logits.softmax(-1).sort(-1, descending=True)
    hint = "sort each row's probabilities (softmax, not raw logits) in descending order, cumsum."
    for top_p in (0.3, 0.75, 0.95, 1.0, 1e-6):
        past, before = probs.cumsum(-1) > top_p, probs.cumsum(-1) - probs >= top_p
        past = past.scatter(-1, order, past)
        first_kept = past.clone()
        first_kept[torch.arange(4), order[:, 0]] = False
        sorted_logits = logits.sort(-1, descending=True).values
        crossing = "the token that carries the total past top_p is dropped: a token stays while "
        crossing += "the mass *before* it has not reached top_p, so the nucleus reaches top_p."
        mistakes = {
            crossing: logits.masked_fill(past, -math.inf),
            crossing + " ": logits.masked_fill(first_kept, -math.inf),
            "the right number of tokens, the wrong ones: the keep/drop decision, made in sorted "
            "order, never went back to vocabulary order.": logits.masked_fill(before, -math.inf),
            "the logits come back in sorted order: return them in the vocabulary's order, each "
            "at its own id.": sorted_logits.masked_fill(
                probs.cumsum(-1) - probs >= top_p, -math.inf
            ),
            "return the kept logits unchanged.": top_p_filter(logits, top_p).log_softmax(-1),
        }
        where = f"top_p_filter(logits of 4 different rows, top_p={top_p})"
        actual = call(where, fn, logits.clone(), top_p)
        expect_close(actual, top_p_filter(logits, top_p), where, hint, mistakes=mistakes)
    passed("top_p_filter")


def _sampling(logits: torch.Tensor, steps: str, temperature=1.0, top_k=None, top_p=None):
    """The next token's distribution after `steps`: t(emperature), m(ultiply), k, p."""
    for step in steps:
        if step in "tm":
            logits = logits / temperature if step == "t" else logits * temperature
        elif step == "k" and top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
        elif step == "p" and top_p is not None:
            logits = top_p_filter(logits[None], top_p)[0]
    return logits.softmax(-1)


SAMPLING_MISTAKES = {  # the hint: the order of the steps that gives the mistake
    "divide the logits by the temperature (a low temperature sharpens), don't multiply.": "mkp",
    "divide by the temperature first: top_k and top_p filter the scaled logits.": "kpt",
    "apply top_k before top_p: the nucleus is taken among the top_k tokens.": "tpk",
}
SAMPLING_CASES = [  # generate's options, the temperature always given
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=0.5, top_p=0.6),
    dict(temperature=2.0, top_k=8, top_p=0.5),
    dict(temperature=0.7, top_k=6, top_p=0.8),
]


def _expect_sampling(name: str, fn: Callable, model: GPT2, one: torch.Tensor, **options) -> None:
    """Copies of a one-token prompt, a token each: their frequencies, the reference's odds."""
    n, where = 4000, f"{name}({', '.join(f'{k}={v}' for k, v in options.items())})"
    torch.manual_seed(5)
    drawn = call(where, fn, model, one.expand(n, -1), 1, **options)
    problem = f"expected token ids, an int64 tensor of shape ({n}, 2), got {describe(drawn)}."
    expect(shape_of(drawn) == (n, 2) and drawn.dtype == torch.int64, where, problem)
    logits = model(one)[0, -1].detach().double()
    freq = (drawn[:, -1:] == torch.arange(CFG.d_vocab)).double().mean(0)  # ids out of range: none
    wanted = _sampling(logits, "tkp", **options)
    worst = (freq - wanted).abs().max()
    if worst < 0.03 and not freq[wanted == 0].any():  # about 4 standard errors
        return
    mistakes = {h: _sampling(logits, steps, **options) for h, steps in SAMPLING_MISTAKES.items()}
    argmax = "with temperature > 0, sample from the distribution instead of taking the argmax."
    if options.get("top_k") is not None:  # rows alike: a batch-wide k-th largest is the max
        argmax = f"only the likeliest token was drawn, though top_k={options['top_k']} keeps "
        argmax += f"{options['top_k']}: {ROW_THRESHOLD}"
    mistakes[argmax] = F.one_hot(logits.argmax(), CFG.d_vocab).double()
    problem = f"the samples do not follow the distribution (off by {worst:.3f})"
    expect_no_known_mistake(where, freq, mistakes, atol=0.03, problem=problem)
    expect(False, where, problem, "sample with torch.multinomial(softmax(filtered logits), 1).")


def _expect_top_k_per_row(name: str, fn: Callable, model: GPT2) -> None:
    """Rows with different prompts: each row samples from its own top k, not row 0's."""
    prompts, n, where = _tokens(4, 3, seed=8), 1500, f"{name}(top_k=3, four different prompts)"
    top = model(prompts)[:, -1].detach().double().topk(3, dim=-1)
    torch.manual_seed(9)
    rows = prompts.repeat_interleave(n, dim=0)
    drawn = call(where, fn, model, rows, 1, top_k=3, hint=ROW_THRESHOLD)[:, -1]
    hint = ROW_THRESHOLD
    mine = drawn.reshape(len(prompts), n, 1) == top.indices[:, None]  # row, draw, its top 3
    for row, freq in enumerate(mine.double().mean(1)):
        own = mine[row].any(-1).all() and (freq - top.values[row].softmax(-1)).abs().max() < 0.06
        expect(own, where, f"row {row} does not sample from its own 3 likeliest tokens.", hint)


ROW_THRESHOLD = "each row keeps its own top_k: the threshold is the k-th largest logit of that "
ROW_THRESHOLD += "row, one per row, not one for the whole batch."


def check_generate(fn: Callable[..., torch.Tensor]) -> None:
    """`generate(model, tokens, max_new_tokens, *, temperature, top_k, top_p, generator)`."""
    name, model, prompt = "generate", _reference_model(seed=3), _tokens(batch=2, pos=4, seed=4)
    zero, where = "temperature=0 is greedy: argmax, don't divide.", f"{name}(temperature=0)"
    out = call(where, fn, model, prompt, 3, temperature=0, hint=zero)
    hint = "use logits[:, -1, :] (the last position) and argmax when temperature == 0."
    expect_close(out, generate(model, prompt, 3, temperature=0), where, hint)
    crop, where = "feed only the last n_ctx tokens: tokens[:, -n_ctx:].", f"{where}, past n_ctx"
    long = call(where, fn, model, prompt, 14, temperature=0, hint=crop)
    expect_close(long, generate(model, prompt, 14, temperature=0), where, crop)
    for options in SAMPLING_CASES:
        if options == dict(temperature=1.0, top_k=3):  # first top_k with different prompts
            _expect_top_k_per_row(name, fn, model)
        _expect_sampling(name, fn, model, prompt[:1, :1], **options)
    torch.manual_seed(1)  # the second run finds the global generator where the first left it
    runs = [call(name, fn, model, prompt, 6, generator=seeded(11)) for _ in range(2)]
    hint = "draw every random number from the generator: multinomial(..., generator=generator)."
    problem = "two runs with the same generator seed gave different tokens."
    expect(torch.equal(*runs), f"{name}(generator=seeded(11)), twice", problem, hint)
    expect_evaluating(name, fn, _reference_model(seed=3, dropout=0.5), prompt, 6, temperature=0)
    passed(name)


def check_train_step(fn: Callable[..., float]) -> None:
    """`fn(model, optimizer, tokens, targets, *, grad_clip)`: one step; returns the loss."""
    name, batch = "train_step", (_tokens(3, 6, seed=13), _tokens(3, 6, seed=14))
    eval_mode = "the model ran in eval mode: call model.train() first, so dropout is on."
    for grad_clip in (0.5, None):
        theirs, ours = _reference_model(15, dropout=0.2), _reference_model(15, dropout=0.2)
        their_sgd, our_sgd = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (theirs, ours))
        none = "" if grad_clip else "grad_clip=None means no clipping: skip clip_grad_norm_."
        for step in range(2):  # the models come in eval mode: the step must switch to train
            where = f"{name} (step {step + 1}, dropout 0.2, SGD, grad_clip={grad_clip})"
            with evaluating(ours):
                mistakes = {eval_mode: training.lm_loss(ours(batch[0]), batch[1]).item()}
            torch.manual_seed(100 + step)
            loss = call(where, fn, theirs, their_sgd, *batch, grad_clip=grad_clip, hint=none)
            torch.manual_seed(100 + step)
            expected = train_step(ours, our_sgd, *batch, grad_clip=grad_clip)
            expect(isinstance(loss, float), where, f"returned {describe(loss)}.", "loss.item()")
            hint = "loss = lm_loss(model(tokens), targets), computed before the update."
            expect_close(loss, expected, where, hint, mistakes=mistakes)
            drift = max((a - b).abs().max() for a, b in zip(theirs.parameters(), ours.parameters()))
            hint = ZERO_GRAD if step else CLIP
            expect(drift <= 1e-5, where, f"the update is off by {drift:.3g}.", hint)
    passed(name)


def check_against_huggingface(model: torch.nn.Module, hf_model: torch.nn.Module, tokens) -> None:
    """A GPT-2 holding Hugging Face's weights against Hugging Face's, stage by stage."""
    name, last = "GPT2 with Hugging Face's weights", model.cfg.n_layers - 1
    with evaluating(model), evaluating(hf_model):
        hf = hf_model(tokens, output_hidden_states=True)
        logits, cache = call(name, model.run_with_cache, tokens)
        final = model.ln_final(cache[f"blocks.{last}.hook_resid_post"])
    block = "your TransformerBlock: x + attn(ln1(x)), then x + mlp(ln2(x))."
    stages = {"embeddings": (cache["hook_embed"] + cache["hook_pos_embed"], "embed + pos_embed.")}
    stages |= {f"block {i}": (cache[f"blocks.{i}.hook_resid_post"], block) for i in range(last)}
    stages["last block and ln_final"] = (final, "the last block, then ln_final.")
    stages["logits"] = (logits, "unembed: x @ W_U + b_U, W_U the transpose of lm_head.weight.")
    for (stage, (ours, hint)), theirs in zip(stages.items(), [*hf.hidden_states, hf.logits]):
        where, shape, got = f"{name}, {stage}", tuple(theirs.shape), shape_of(ours)
        expect(got == shape, where, f"expected shape {shape}, got {got}.", hint)
        worst = (ours.float() - theirs.float()).abs().max().item()
        print(f"{stage:<24} max |difference| {worst:.1e}")
        expect(worst < 1e-4, where, f"differs by up to {worst:.3g}.", hint)
    passed(name)


def _windows(name: str, fn: Callable, data, position, batch_size: int, n_ctx: int, generator):
    """The starts of the learner's windows of `data` (`position[id]`: where id sits in it)."""
    where = f"{name}(data of {len(data)} tokens, batch_size={batch_size}, n_ctx={n_ctx})"
    hint = "an index ran past the end of data? The targets of the last window end at data[-1], "
    hint += "so a window starts at most at len(data) - n_ctx - 1 (randint's high is exclusive)."
    out = call(where, fn, data, batch_size, n_ctx, generator=generator, hint=hint)
    pair = isinstance(out, tuple) and all(isinstance(t, torch.Tensor) for t in out)
    shapes = [(shape_of(t), t.dtype) for t in out] if pair else describe(out)
    problem = f"expected x and y of shape {(batch_size, n_ctx)} and dtype int64, got {shapes}."
    hint = "one window per row, indexing data so that the ids keep their dtype."
    expect(shapes == [((batch_size, n_ctx), data.dtype)] * 2, where, problem, hint)
    px, py = (position[t.clamp(0, len(position) - 1)] for t in out)  # ids not in data: -n
    hint = "each row is data[start : start + n_ctx]."
    expect(bool((px.diff(dim=1) == 1).all()), where, "a row of x is not a window of data.", hint)
    hint = "the targets are the next tokens: y = data[start + 1 : start + n_ctx + 1]."
    mistakes = {"the targets are the inputs themselves; " + hint: px}
    mistakes["the targets come one token before the inputs, not after; " + hint] = px - 1
    expect_no_known_mistake(where, py, mistakes, problem="y is not x shifted by one token.")
    expect(torch.equal(py, px + 1), where, "y is not x shifted by one token.", hint)
    return px[:, 0]


def check_sample_batch(fn: Callable) -> None:
    """`sample_batch(data, batch_size, n_ctx, *, generator=None) -> (x, y)`."""
    name, n = "sample_batch", 1000
    # Distinct ids 3 to n + 2 shuffled, so an id says where in data it was taken from (others: -n).
    data, position = torch.randperm(n, generator=seeded(18)) + 3, torch.full((n + 4,), -n)
    position[data] = torch.arange(n)
    windows = _windows(name, fn, data, position, 64, 8, seeded(19)).unique().numel()
    where, hint = f"{name}(batch_size=64)", "draw one start per row: (batch_size,)."
    expect(windows >= 32, where, f"the 64 rows hold only {windows} different windows.", hint)
    starts = _windows(name, fn, data[:10], position, 600, 4, seeded(20))  # 6 windows, as often
    where, shown = f"{name}(data of 10 tokens, n_ctx=4)", sorted(starts.unique().tolist())
    hint = "every start from 0 to len(data) - n_ctx - 1 (the last window's targets end at "
    hint += "data[-1]) may be drawn, none past it: mind that randint's upper bound is exclusive."
    problem = f"windows start at {shown}; expected each of 0-5."
    expect(starts.min() == 0 and starts.max() == 5, where, problem, hint)
    torch.manual_seed(1)  # each call finds the global generator where the one before left it
    generators = (seeded(21), seeded(21), seeded(22), None)
    runs = [_windows(name, fn, data, position, 8, 8, generator) for generator in generators]
    hint = "draw the starts from the generator you are given: randint(..., generator=generator)."
    problem = "two calls with equally seeded generators gave different windows."
    expect(torch.equal(runs[0], runs[1]), f"{name}(generator seeded 21), twice", problem, hint)
    problem = "generators with different seeds gave the same windows."
    expect(not torch.equal(runs[0], runs[2]), f"{name}(generators seeded 21, 22)", problem, hint)
    passed(name)


KV_CHUNKS = (5, 1, 1, 1, 3)  # a prompt, three tokens one at a time, then three at once
KV_CALLS = [(new, sum(KV_CHUNKS[:i])) for i, new in enumerate(KV_CHUNKS)]  # (new, cached) each
KV_KEYS = "the new queries attend to the wrong keys: each sees every cached key and the new keys "
KV_MISTAKES = {  # what is wrong, as `_cached_logits`'s `wrong`: the hint
    "positions": "the new tokens' positions do not count the cached ones: token i of the new ones "
    "sits at position len(cache) + i: add W_pos[start : start + new], not W_pos[:new].",
    "top left": KV_KEYS + "up to its own: mask with causal_mask(q_len, k_len), which aligns the "
    "last query with the last key (SDPA's is_causal=True aligns the first with the first).",
    "together": KV_KEYS + "up to its own, also when fed together: causal_mask(q_len, k_len) "
    "with a cache.",
}


def _replay(name: str, fn: Callable, model: GPT2, tokens: torch.Tensor, chunks) -> torch.Tensor:
    """The logits of `tokens` fed to the learner's `fn` in `chunks`, each with the last cache."""
    cache, start, logits, (batch, n_layers) = None, 0, [], (tokens.shape[0], model.cfg.n_layers)
    shapes_in = lambda p: [shape_of(t) for t in p] if isinstance(p, (list, tuple)) else shape_of(p)
    for new in chunks:
        where = f"{name}(model, {new} new token{'s' * (new > 1)}, a cache of {start} positions)"
        out = call(where, fn, model, tokens[:, start : start + new], cache)
        expect(isinstance(out, tuple) and len(out) == 2, where, "expected (logits, cache).")
        (chunk, cache), start = out, start + new
        shape = (batch, new, model.cfg.d_vocab)
        problem = f"expected logits of shape {shape} (batch, new, d_vocab), got {shape_of(chunk)}."
        expect(shape_of(chunk) == shape, where, problem)
        pairs = isinstance(cache, (list, tuple)) and len(cache) == n_layers
        shapes = [shapes_in(pair) for pair in cache] if pairs else describe(cache)
        shape = (batch, model.cfg.n_heads, start, model.cfg.d_head)
        hint = "return [(k, v) for each block], each (batch, n_heads, positions so far, d_head)."
        kept = [s[2] for pair in shapes for s in pair if isinstance(s, tuple) and len(s) == 4]
        if pairs and any(positions < start for positions in kept):
            hint = "the cache was not appended to: torch.cat the new keys and values to it."
        problem = f"expected per block a pair (keys, values), each of shape {shape}; got {shapes}."
        expect(shapes == [[shape] * 2] * n_layers, where, problem, hint)
        logits.append(chunk.detach())
    return torch.cat(logits, dim=1)


def _cached_logits(model: GPT2, tokens: torch.Tensor, wrong: str) -> torch.Tensor:
    """The reference's logits fed in KV_CHUNKS, with what is `wrong` (a key of KV_MISTAKES)."""
    caches, logits = [LayerCache() for _ in model.blocks], []
    for new, start in KV_CALLS:
        end, first = start + new, 0 if wrong == "positions" else start
        right = causal_mask(new, end)
        masks = {"top left": causal_mask(end)[:new], "together": None if start else right}
        x = model.embed(tokens[:, start:end]) + model.pos_embed.W_pos[first : first + new]
        for block, cache in zip(model.blocks, caches):
            x = x + block.attn(block.ln1(x), mask=masks.get(wrong, right), cache=cache)
            x = x + block.mlp(block.ln2(x))
        logits.append(model.unembed(model.ln_final(x)))
    return torch.cat(logits, dim=1)


def check_kv_cache(fn: Callable) -> None:
    """`forward_with_cache(model, tokens, cache=None) -> (logits, cache)`, float64, 1e-6."""
    name, model = "forward_with_cache", _reference_model(seed=5).double().requires_grad_(False)
    tokens = _tokens(batch=2, pos=sum(KV_CHUNKS), seed=16)
    logits = _replay(name, fn, model, tokens, KV_CHUNKS)
    mistakes = {h: _cached_logits(model, tokens, w) for w, h in KV_MISTAKES.items()}
    error = (logits.double() - model(tokens)).abs().nan_to_num(math.inf).amax(dim=(0, 2))
    if (error > 1e-6).any():
        position = int((error > 1e-6).nonzero()[0])
        new, cached = next((new, cached) for new, cached in KV_CALLS if position < cached + new)
        where = f"{name}, position {position}, in the call with {new} new token{'s' * (new > 1)} "
        where += f"after {cached} cached ones"
        problem = "the logits differ from model(tokens)'s (tolerance 1e-6, float64)."
        expect_no_known_mistake(where, logits, mistakes, problem=problem)
        hint = "the new tokens go through the model as in model(tokens): positions after the "
        hint += "cached ones, keys and values appended to each block's cache before attending, "
        hint += "causal_mask(q_len, k_len), then the MLP, ln_final and unembed."
        expect(False, where, problem, hint)
    greedy = generate(model, tokens[:, :5], CFG.n_ctx - 5, temperature=0)  # up to n_ctx
    steps = [5] + [1] * (CFG.n_ctx - 6)  # the prompt, then one token at a time
    chosen = _replay(name, fn, model, greedy[:, :-1], steps)[:, 4:].argmax(-1)
    hint = "feed each new token alone, with the last call's cache."
    expect_close(chosen, greedy[:, 5:], f"{name}, greedy decoding up to n_ctx", hint)
    passed(name)


HEAD_LAYOUTS = {"W_Q": "m (head d) -> head m d", "W_O": "(head d) m -> head d m"}
HEAD_LAYOUTS["b_Q"] = "(head d) -> head d"  # Hugging Face's layout, heads side by side, and ours
TRANSPOSED = "Conv1D stores its weight as (d_in, d_out), the layout of x @ W: don't transpose it."
HEADS = "the head dimension is (head d_head), heads outermost: not '(d_head head)'."
MISSING = {  # a part of the missing keys' names: the hint
    "unembed": "GPT-2's unembedding is tied to its embedding: W_U = lm_head.weight.T, b_U zeros.",
    "ln": "the layer norms have gains and biases: ln_1.weight and .bias become ln1.w and .b.",
    "b_": "every bias counts: b_Q, b_K, b_V from c_attn.bias, b_O, b_in, b_out.",
}


def _conversion_mistakes(key: str, state: dict, n_heads: int) -> dict[str, torch.Tensor]:
    """What `key` of `state` holds after a Conv1D transposed, heads split wrongly, Q/K/V swapped."""
    block, leaf = key.rsplit(".", 1)
    if (layout := HEAD_LAYOUTS.get(leaf.replace("K", "Q").replace("V", "Q"))) is None:
        return {}
    flat = einops.rearrange(state[key], " -> ".join(layout.split(" -> ")[::-1]))
    split = lambda t, layout=layout: einops.rearrange(t, layout, head=n_heads)
    mistakes = {HEADS: split(flat, layout.replace("(head d)", "(d head)", 1))}
    if flat.ndim == 2:
        mistakes[TRANSPOSED] = split(flat.T)
    for other in "QKV".replace(leaf[-1], "") if leaf[-1] in "QKV" else "":
        hint = f"`{leaf}` holds c_attn's {other} part: c_attn is [Q | K | V] along dim 1."
        mistakes[hint] = state[f"{block}.{leaf[0]}_{other}"]
    return mistakes


def check_weight_conversion(fn: Callable[..., dict]) -> None:
    """`convert_hf_gpt2_state_dict(state, *, n_layers, n_heads)` on tiny random GPT-2s."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    name, tokens = "convert_hf_gpt2_state_dict", _tokens(2, 10) % 29
    for n_layers, n_heads in ((2, 3), (1, 2)):
        config = dict(n_layer=n_layers, n_head=n_heads, n_embd=8 * n_heads, n_positions=10)
        config = HFConfig(**config, vocab_size=29, bos_token_id=0, eos_token_id=0)  # dropout on
        torch.manual_seed(n_layers)
        hf = perturb(GPT2LMHeadModel(config).double(), seed=n_heads, scale=0.1).eval()
        sizes = dict(n_layers=n_layers, n_heads=n_heads)
        where = f"{name}(n_layers={n_layers}, n_heads={n_heads})"
        state = call(where, fn, hf.state_dict(), **sizes, hint=TRANSPOSED)
        expected = convert_hf_gpt2_state_dict(hf.state_dict(), **sizes)
        expect(isinstance(state, dict), where, f"returned {describe(state)}.", "return a dict.")
        missing = [key for key in expected if key not in state]
        hint = next((h for part, h in MISSING.items() if any(part in k for k in missing)), "")
        expect(not missing, where, f"keys are missing: {missing}.", hint)
        for key, wanted in expected.items():
            got, at, shape = state[key], f"{where}, {key}", tuple(wanted.shape)
            hint = TRANSPOSED if shape_of(got) == shape[::-1] else "see GPT2(cfg).state_dict()."
            hint = "W_U is lm_head.weight transposed." if key == "unembed.W_U" else hint
            problem = f"expected {shape} in {wanted.dtype}, got {describe(got)}."
            same = shape_of(got) == shape and got.dtype == wanted.dtype
            expect(same, at, problem, hint + " Keep each tensor's dtype.")
            mistakes = _conversion_mistakes(key, expected, n_heads)
            expect_close(got, wanted, at, "", atol=1e-12, rtol=0, mistakes=mistakes)
        model = GPT2(GPT2Config.from_huggingface(hf.config)).double().eval()
        call(f"GPT2.load_state_dict({name}(...))", model.load_state_dict, state)
        expected, where = hf(tokens).logits.detach(), f"{where}, the logits"
        expect_close(model(tokens), expected, where, "compare each key.", atol=1e-8)
    passed(name)


def check_estimate_loss(fn: Callable[..., float]) -> None:
    """`estimate_loss(model, data, *, batch_size, n_ctx, n_batches, generator=None)`."""
    name, model = "estimate_loss", _reference_model(seed=30, dropout=0.3)
    data = torch.randint(CFG.d_vocab, (200,), generator=seeded(31))
    for batch_size, n_ctx, n_batches in ((4, 8, 3), (2, 12, 1), (3, 5, 4)):
        sizes = dict(batch_size=batch_size, n_ctx=n_ctx, n_batches=n_batches)
        where = f"{name}({', '.join(f'{k}={v}' for k, v in sizes.items())}, generator=...)"
        torch.manual_seed(32)
        got = expect_evaluating(where, fn, model, data, **sizes, generator=seeded(33))
        estimate = functools.partial(training.estimate_loss, model, data, **sizes)
        expected = estimate(generator=seeded(33))
        torch.manual_seed(32)
        first = estimate(n_batches=1, generator=seeded(33))
        mistakes = {
            "draw the batches with sample_batch(..., generator=generator).": estimate(),
            "divide the summed losses by n_batches: take their mean.": n_batches * expected,
            "average all n_batches batches, not just the first.": first,
        }
        expect(isinstance(got, float), where, f"returned {describe(got)}.", "return loss.item().")
        hint = "the mean of lm_loss(model(x), y) over n_batches batches of sample_batch."
        expect_close(got, expected, where, hint, mistakes=mistakes)
    where = f"{name}(..., generator=None), the model in eval mode"
    torch.manual_seed(34)
    got = call(where, fn, model.eval(), data, batch_size=4, n_ctx=8, n_batches=2)
    torch.manual_seed(34)
    expected = training.estimate_loss(model, data, batch_size=4, n_ctx=8, n_batches=2)
    expect_close(got, expected, where, "generator=None: sample_batch's global generator.")
    hint = f"restore the model's own mode: {EVAL_HINT}"
    expect(not model.training, where, "the model came in eval mode and left in train mode.", hint)
    passed(name)


def _cosine(step: int, *, lr, warmup_steps, max_steps, min_lr=0.0, wrong="") -> float:
    """`cosine_lr` with what is `wrong` (a key of COSINE_MISTAKES)."""
    if step < warmup_steps:
        return lr * (step + (wrong != "from 0")) / warmup_steps
    progress = (step - warmup_steps + (wrong == "ahead")) / max(1, max_steps - warmup_steps)
    progress = progress if wrong == "unclamped" else min(1.0, progress)
    low = 0.0 if wrong == "to zero" else min_lr
    return low + 0.5 * (lr - low) * (1 + math.cos((1 + (wrong == "period")) * math.pi * progress))


COSINE_CASES = [  # with and without warmup, min_lr given and left at its default
    dict(lr=1.0, warmup_steps=3, max_steps=10, min_lr=0.1),
    dict(lr=6e-4, warmup_steps=0, max_steps=8, min_lr=6e-5),
    dict(lr=0.5, warmup_steps=5, max_steps=12),
]
COSINE_MISTAKES = {
    "from 0": "steps count from 0: warm up with lr * (step + 1) / warmup_steps.",
    "ahead": "the decay's progress is (step - warmup_steps) / (max_steps - warmup_steps).",
    "to zero": "decay to min_lr, not to zero: min_lr + (lr - min_lr) * (1 + cos(...)) / 2.",
    "unclamped": "after max_steps the rate stays at min_lr: clamp the progress at 1.",
    "period": "half a cosine, cos(pi * progress), goes from lr down to min_lr once.",
}


def check_cosine_lr(fn: Callable[..., float]) -> None:
    """`cosine_lr(step, *, lr, warmup_steps, max_steps, min_lr=0.0)`: steps 0 to max_steps + 5."""
    hint = "warm up linearly to lr, then half a cosine from lr down to min_lr at max_steps."
    mistakes = {h: functools.partial(_cosine, wrong=w) for w, h in COSINE_MISTAKES.items()}
    expect_schedule("cosine_lr", fn, training.cosine_lr, COSINE_CASES, mistakes, hint)
    passed("cosine_lr")


ZERO_GRAD = "zero the gradients every step (optimizer.zero_grad()) before backward."
CLIP = "clip the gradients' global norm after backward, before optimizer.step(): "
CLIP += "torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)."
HISTORY = "History holds each step's number (from 0), loss and rate, each evaluation's "
HISTORY += "{'step': steps done, 'val_loss': ...}, and in best the lowest one."


def _run_loop(name: str, fn: Callable, max_steps, eval_every, grad_clip, best, train_mode):
    """A tiny GPT-2 trained by the loop `fn`: history, model, and what hooks saw."""
    model = _reference_model(seed=40, dropout=0.2).train(train_mode)
    config = training.TrainConfig(max_steps=1, lr=0.5, weight_decay=0.1)
    optimizer = training.make_optimizer(model, config)
    seen: dict[str, list] = {key: [] for key in ("lrs", "norms", "stale", "modes", "evals")}
    data, lr_at = torch.randint(CFG.d_vocab, (100,), generator=seeded(41)), _lr_at(max_steps)

    def before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        seen["lrs"].append([group["lr"] for group in optimizer.param_groups])
        norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        seen["norms"].append(torch.stack(norms).norm().item() if norms else 0.0)

    def training_pass(model: torch.nn.Module, args) -> None:  # evaluations run without gradients
        if torch.is_grad_enabled():
            seen["modes"].append(model.training)

    def evaluate(model: torch.nn.Module) -> float:
        seen["evals"].append((len(seen["lrs"]), model.training, torch.is_grad_enabled()))
        with evaluating(model):
            loss = training.lm_loss(model(_tokens(4, 8, seed=42)), _tokens(4, 8, seed=43)).item()
        return loss - (len(seen["lrs"]) == best)  # the best is not the last

    optimizer.register_step_pre_hook(before_step)
    model.register_forward_pre_hook(training_pass)
    b_U = model.unembed.b_U  # runs before the new gradient is added to b_U.grad
    b_U.register_hook(lambda grad: seen["stale"].append(b_U.grad is not None and b_U.grad.any()))
    get_batch = lambda step: training.sample_batch(data, 4, 8, generator=seeded(100 + step))
    torch.manual_seed(44)
    options = dict(max_steps=max_steps, lr_at=lr_at, eval_every=eval_every, grad_clip=grad_clip)
    return call(name, fn, model, optimizer, get_batch, evaluate, **options), model, seen


def _lr_at(max_steps: int) -> Callable[[int], float]:
    schedule = dict(lr=3e-3, warmup_steps=2, max_steps=max_steps, min_lr=3e-4)
    return functools.partial(training.cosine_lr, **schedule)


def _same_state(state, wanted: dict) -> bool:
    same = isinstance(state, dict) and state.keys() == wanted.keys()
    return same and all(matches(state[key], value, atol=1e-6) for key, value in wanted.items())


def _expect_steps(where: str, seen: dict, ref: dict, max_steps, eval_every, grad_clip) -> None:
    """What each step did, as the optimizer and the hooks saw it, against the reference's."""
    hint = "set the rate of every group: for group in optimizer.param_groups: group['lr'] = lr."
    problem = "the optimizer's parameter groups stepped with different rates."
    expect(all(len(set(lrs)) == 1 for lrs in seen["lrs"]), where, problem, hint)
    lrs, wanted = [lrs[0] for lrs in seen["lrs"]], [lrs[0] for lrs in ref["lrs"]]
    ahead = [_lr_at(max_steps)(step + 1) for step in range(max_steps)]
    mistakes = {"steps count from 0: step `step` uses lr_at(step), not lr_at(step + 1).": ahead}
    mistakes["set the rate before the step it is for, not after it."] = [0.5, *wanted[:-1]]
    hint = "before each step set its rate, lr_at(step)."
    expect_series(where, "the rate the optimizer used at step", lrs, wanted, hint, mistakes)
    problem = "gradients accumulated: each backward added to the step before's."
    expect(not any(seen["stale"]), where, problem, ZERO_GRAD)
    hint = "train in train mode: model.train() (train_step does it), also after evaluating."
    expect(all(seen["modes"]), where, "a training step ran in eval mode, without dropout.", hint)
    norm = max(seen["norms"])
    problem = f"the optimizer stepped with gradients of norm {norm:.3g}."
    expect(grad_clip is None or norm <= grad_clip * (1 + 1e-6), where, problem, CLIP)
    every = "evaluate after every eval_every steps ((step + 1) % eval_every == 0) and the last."
    mistakes = {"evaluate after the last step too.": range(eval_every, max_steps + 1, eval_every)}
    wanted, done = [e[0] for e in ref["evals"]], [e[0] for e in seen["evals"]]
    expect_series(where, "evaluation", done, wanted, every, mistakes)
    hint = f"evaluate in eval mode, without gradients: {EVAL_HINT}"
    for index, state in ((1, "in train mode"), (2, "with gradients on")):
        expect(not any(e[index] for e in seen["evals"]), where, f"evaluated {state}.", hint)


def _numbers(history: training.History) -> dict[str, list]:
    evals = [v for e in history.evals for v in (e["step"], e["val_loss"])]
    best = [history.best["step"], history.best["val_loss"]]
    numbers = dict(step=history.step, train_loss=history.train_loss, lr=history.lr)
    return {**numbers, "evals": evals, "best": best}


def check_train_loop(fn: Callable[..., training.History]) -> None:
    """`train_loop(model, optimizer, get_batch, evaluate, *, ...)` against the reference."""
    for case in ((7, 3, 0.05, 6, True), (6, 2, None, 4, False)):  # ..., best at, train mode
        where = "train_loop(max_steps={}, eval_every={}, grad_clip={})".format(*case)
        where += f", dropout 0.2, the model in {'train' if case[-1] else 'eval'} mode"
        history, model, seen = _run_loop(where, fn, *case)
        wanted, reference, ref = _run_loop("reference", train_loop, *case)
        problem, hint = f"returned {describe(history)}.", "return the History you filled."
        expect(isinstance(history, training.History), where, problem, hint)
        _expect_steps(where, seen, ref, *case[:3])
        hint = "each step: set its rate, then train_step(model, optimizer, *get_batch(step), ...)."
        same = _same_state(model.state_dict(), reference.state_dict())
        expect(same, where, "the final weights differ from the reference's.", hint)
        problem = "the model was left in eval mode after the loop."
        hint = f"after the loop the model is in train mode, as training left it: {EVAL_HINT}"
        expect(model.training, where, problem, hint)
        got, last = call(f"{where}, its History", _numbers, history, hint=HISTORY), wanted.evals
        last = {"History.best keeps the lowest val_loss so far, not the last.": last[-1].values()}
        for field, expected in _numbers(wanted).items():
            what, mistakes = f"History.{field}, entry", last if field == "best" else {}
            expect_series(where, what, got[field], expected, HISTORY, mistakes, tol=1e-6)
        if not _same_state(history.best_state, wanted.best_state):
            live = _same_state(history.best_state, model.state_dict())
            hint = "keep a copy of the best evaluation's weights in best_state."
            hint += " state_dict() holds the live parameters: {k: v.detach().clone() ...}" * live
            expect(False, where, "History.best_state is not the best evaluation's weights.", hint)
    passed("train_loop")
