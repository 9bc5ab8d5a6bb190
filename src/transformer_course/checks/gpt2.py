"""Checkers for chapter 6: GPT-2's embeddings, unembedding and forward pass, sampling, the
training step, batches of a token stream and the KV cache. (The MLP's and the transformer
block's checkers are in `checks.blocks`.)

Each checker builds the learner's class (or calls the learner's function) next to the course's
reference from `transformer_course.gpt2` / `transformer_course.training`, with identical
weights, and compares outputs. Known mistakes get targeted hints.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer_course.checks import (
    CheckFailure,
    call,
    construct,
    expect,
    expect_close,
    expect_hooks,
    expect_parameter,
    expect_same_in_train_mode,
    fill_random,
    load_reference_weights,
    passed,
)
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss, top_p_filter, train_step
from transformer_course.runtime import evaluating

__all__ = [
    "check_embed",
    "check_pos_embed",
    "check_unembed",
    "check_gpt2_forward",
    "check_generate",
    "check_top_p_filter",
    "check_train_step",
    "check_against_huggingface",
    "check_sample_batch",
    "check_kv_cache",
]

CFG = GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=37, n_ctx=12)


def _tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, CFG.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed)
    )


def check_embed(Embed: type) -> None:
    """`Embed(cfg)`: parameter `W_E (d_vocab, d_model)`; `forward(tokens)` looks up each
    token's row."""
    name = "Embed"
    embed = construct(name, Embed, CFG)
    W_E = expect_parameter(embed, "W_E", name, (CFG.d_vocab, CFG.d_model))
    fill_random(W_E)
    tokens = _tokens()
    out = call(f"{name}.forward", embed, tokens)
    expected = F.embedding(tokens, W_E.detach())
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        expect(
            not torch.allclose(out.detach(), expected * math.sqrt(CFG.d_model)),
            name,
            "the embeddings are scaled by sqrt(d_model).",
            "that scale belongs to the original transformer (Vaswani et al.); GPT-2 uses "
            "W_E[tokens] as it is.",
        )
    expect_close(
        out,
        expected,
        name,
        "row t of W_E is the embedding of token id t: index W_E with the tokens.",
    )
    passed(name)


def check_pos_embed(PosEmbed: type) -> None:
    """`PosEmbed(cfg)`: parameter `W_pos (n_ctx, d_model)`; `forward(tokens)` returns the first
    `pos` rows, repeated over the batch."""
    name = "PosEmbed"
    pos_embed = construct(name, PosEmbed, CFG)
    W_pos = expect_parameter(pos_embed, "W_pos", name, (CFG.n_ctx, CFG.d_model))
    fill_random(W_pos)
    # Ids below n_ctx, so a forward pass that indexes W_pos by token id runs too.
    tokens = _tokens(batch=3, pos=7) % CFG.n_ctx
    out = call(f"{name}.forward", pos_embed, tokens)
    expected = W_pos.detach()[:7].expand(3, 7, CFG.d_model)
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        by_token = W_pos.detach()[tokens]
        expect(
            not torch.allclose(out.detach(), by_token),
            name,
            "the output is W_pos indexed by the token ids.",
            "position embeddings depend on where a token is (0, 1, ..., pos-1), not on which "
            "token it is.",
        )
    expect_close(
        out,
        expected,
        name,
        "return W_pos[:pos] for every sequence: shape (batch, pos, d_model), e.g. with "
        "einops.repeat.",
    )
    passed(name)


def check_unembed(Unembed: type) -> None:
    """`Unembed(cfg)`: parameters `W_U (d_model, d_vocab)` and `b_U (d_vocab,)`, initialised
    N(0, init_range) and zero; `forward(x) = x @ W_U + b_U`."""
    name = "Unembed"
    torch.manual_seed(0)
    unembed = construct(name, Unembed, CFG)
    W_U = expect_parameter(unembed, "W_U", name, (CFG.d_model, CFG.d_vocab))
    b_U = expect_parameter(unembed, "b_U", name, (CFG.d_vocab,))
    expect(
        torch.count_nonzero(b_U).item() == 0,
        name,
        f"`b_U` should start at zero, got values from {b_U.min().item():.3g} to "
        f"{b_U.max().item():.3g}.",
        "biases are initialised to zeros (torch.zeros), not ones: a bias of one shifts every "
        "logit at the start.",
    )
    std = W_U.detach().std().item()
    expect(
        abs(std - CFG.init_range) < 0.3 * CFG.init_range,
        name,
        f"`W_U` should start with standard deviation init_range={CFG.init_range}, got {std:.3g}.",
        "initialise it with nn.init.normal_(self.W_U, std=cfg.init_range).",
    )
    fill_random(W_U, b_U)
    x = torch.randn(2, 5, CFG.d_model, generator=torch.Generator().manual_seed(2))
    out = call(f"{name}.forward", unembed, x)
    expected = F.linear(x, W_U.detach().T, b_U.detach())
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        expect(
            not torch.allclose(out.detach(), F.linear(x, W_U.detach().T)),
            name,
            "the output does not include the bias.",
            "add b_U after the matrix product.",
        )
    expect_close(out, expected, name, "logits are x @ W_U + b_U.")
    passed(name)


def _reference_model(seed: int = 0) -> GPT2:
    """The course's GPT-2 with noise on every parameter, so a forward pass that skips a bias,
    a layer-norm gain or a component shows up in the logits."""
    torch.manual_seed(seed)
    model = GPT2(CFG).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def check_gpt2_forward(GPT2Class: type) -> None:
    """`GPT2(cfg).forward(tokens)`: embed + position embed, the blocks, `ln_final`, unembed."""
    name = "GPT2"
    reference = _reference_model()
    model = construct(name, GPT2Class, CFG)
    load_reference_weights(name, model, reference, "embed, pos_embed, blocks, ln_final, unembed")
    model.eval()
    tokens = _tokens(batch=2, pos=9)
    out = call(f"{name}.forward", model, tokens)
    with torch.no_grad():
        expected = reference(tokens)
        embed = reference.embed(tokens)
        pos = reference.pos_embed(tokens)

        def run(residual: torch.Tensor, final_ln: bool = True) -> torch.Tensor:
            for block in reference.blocks:
                residual = block(residual)
            return reference.unembed(reference.ln_final(residual) if final_ln else residual)

        variants = (
            (
                run(embed),
                "the position embedding is missing: add pos_embed(tokens) to embed(tokens).",
            ),
            (
                run(embed + pos, final_ln=False),
                "apply ln_final to the residual stream before the unembedding.",
            ),
            (
                reference.unembed(reference.ln_final(embed + pos)),
                "the blocks did not run: pass the residual stream through every block in "
                "self.blocks.",
            ),
        )
    if (
        isinstance(out, torch.Tensor)
        and out.shape == expected.shape
        and not torch.allclose(out.detach(), expected, atol=1e-5)
    ):
        for wrong, hint in variants:
            expect(
                not torch.allclose(out.detach(), wrong, atol=1e-5),
                name,
                "the logits are wrong.",
                hint,
            )
    expect_close(
        out,
        expected,
        name,
        "embed + pos_embed, then each block in turn, then ln_final, then unembed.",
        atol=1e-4,
    )
    expect_hooks(
        name,
        model,
        reference,
        {
            "hook_embed": "pass the token embeddings, embed(tokens), through self.hook_embed.",
            "hook_pos_embed": "pass the position embeddings, pos_embed(tokens), through "
            "self.hook_pos_embed.",
        },
        tokens,
        atol=1e-6,
    )
    _expect_model_dropout(name, GPT2Class, tokens)
    passed(name)


def _expect_model_dropout(name: str, GPT2Class: type, tokens: torch.Tensor) -> None:
    cfg = GPT2Config(**{**vars(CFG), "dropout": 0.3})
    torch.manual_seed(0)
    reference = GPT2(cfg)
    model = construct(name, GPT2Class, cfg)
    model.load_state_dict(reference.state_dict())
    expect_same_in_train_mode(
        f"{name} (dropout=0.3)",
        model,
        reference,
        tokens,
        hint="apply self.dropout once, to the sum of the token and position embeddings, before "
        "the blocks.",
        atol=1e-5,
    )


def _greedy(model: GPT2, tokens: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            next_token = model(tokens[:, -model.cfg.n_ctx :])[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    return tokens


def _frequencies(samples: torch.Tensor) -> torch.Tensor:
    return torch.bincount(samples, minlength=CFG.d_vocab).double() / samples.numel()


def _expect_nucleus(
    name: str, generate: Callable[..., torch.Tensor], model: GPT2, prompt: torch.Tensor
) -> None:
    """With `top_p`, every sample lies in the nucleus of the model's distribution."""
    with torch.no_grad():
        logits = model(prompt)[:, -1].float()
    nucleus = top_p_filter(logits, 0.6)[0].isfinite().nonzero().flatten()
    torch.manual_seed(10)
    drawn = call(name, generate, model, prompt.expand(2000, -1), 1, top_p=0.6)[:, -1]
    expect(
        bool(torch.isin(drawn, nucleus).all()) and len(drawn.unique()) == len(nucleus),
        f"{name} (top_p=0.6)",
        f"the samples use the tokens {sorted(drawn.unique().tolist())}, the nucleus is "
        f"{nucleus.tolist()}.",
        "after temperature and top_k, filter the logits with your top_p_filter before the softmax.",
    )


def _expect_top_k_per_row(name: str, generate: Callable[..., torch.Tensor], model: GPT2) -> None:
    """Rows with different prompts: each row samples from its own top k, not row 0's."""
    prompts = _tokens(batch=4, pos=3, seed=8)
    with torch.no_grad():
        logits = model(prompts)[:, -1].double()
    top = logits.topk(3, dim=-1)
    n = 1500
    torch.manual_seed(9)
    drawn = call(name, generate, model, prompts.repeat_interleave(n, dim=0), 1, top_k=3)[:, -1]
    for row in range(len(prompts)):
        mine = drawn[row * n : (row + 1) * n]
        freq = (mine[:, None] == top.indices[row]).double().mean(0)
        worst = (freq - top.values[row].softmax(-1)).abs().max().item()
        expect(
            bool(torch.isin(mine, top.indices[row]).all())
            and worst < 0.06,  # 0.06: over 5 std errors
            f"{name} (top_k=3, four different prompts)",
            f"row {row} does not sample from its own 3 most likely tokens "
            f"(frequencies {freq.tolist()} for its top 3).",
            "take the k-th largest logit of each row (topk over dim=-1, keep a (batch, 1) "
            "threshold), "
            "not of the first row or of the whole batch.",
        )


def _expect_generator_is_used(
    name: str, generate: Callable[..., torch.Tensor], model: GPT2, prompt: torch.Tensor
) -> None:
    """Two runs with equally seeded generators agree, whatever the global random state."""
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        generator = torch.Generator().manual_seed(11)
        runs.append(call(name, generate, model, prompt, 6, generator=generator))
    expect(
        torch.equal(runs[0], runs[1]),
        f"{name} (generator=torch.Generator().manual_seed(11), twice)",
        "two runs with the same generator seed gave different tokens.",
        "draw every random number from the generator you are given: "
        "torch.multinomial(probs, 1, generator=generator).",
    )


def _expect_greedy(
    name: str, generate: Callable[..., torch.Tensor], model: GPT2, prompt: torch.Tensor
) -> None:
    """temperature=0: the prompt followed by the most likely token each step, also past n_ctx."""
    try:
        out = generate(model, prompt, 3, temperature=0)
    except NotImplementedError:
        out = call(name, generate, model, prompt, 3, temperature=0)  # reports the blank
    except Exception as exc:
        raise CheckFailure(
            f"`{name}` raised {type(exc).__name__} with temperature=0: {exc}\nHint: "
            "temperature=0 means greedy decoding: take the argmax of the logits instead of "
            "dividing by zero."
        ) from exc
    expect(isinstance(out, torch.Tensor), name, f"expected a tensor, got {type(out).__name__}.")
    expect(
        tuple(out.shape) == (2, 7),
        name,
        f"with 4 prompt tokens and max_new_tokens=3 expected shape (2, 7), got {tuple(out.shape)}.",
        "return the prompt followed by the new tokens: torch.cat([tokens, next_token], dim=1) "
        "each step.",
    )
    expect(torch.equal(out[:, :4], prompt), name, "the output does not start with the prompt.")
    expect(
        torch.equal(out, _greedy(model, prompt, 3)),
        name,
        "temperature=0 should pick the most likely next token every step.",
        "use logits[:, -1, :] (the last position) and argmax when temperature == 0; don't divide "
        "by zero.",
    )
    crop = "feed only the last n_ctx tokens to the model: tokens[:, -model.cfg.n_ctx:]."
    try:
        long = generate(model, prompt, CFG.n_ctx + 2, temperature=0)
    except ValueError as exc:
        raise CheckFailure(
            f"`{name}` raised ValueError when the sequence grew past n_ctx={CFG.n_ctx}: "
            f"{exc}\nHint: {crop}"
        ) from exc
    expect(
        torch.equal(long, _greedy(model, prompt, CFG.n_ctx + 2)),
        name,
        "generating past n_ctx tokens gives wrong tokens.",
        crop,
    )


def _expect_samples_follow_the_softmax(
    name: str, generate: Callable[..., torch.Tensor], model: GPT2, one: torch.Tensor
) -> None:
    """Many copies of one prompt, one new token each: with temperature and top_k, the
    frequencies follow the softmax of the scaled, filtered logits."""
    n = 6000
    with torch.no_grad():
        logits = model(one)[0, -1].double()
    torch.manual_seed(5)
    for temperature, top_k in ((1.0, None), (0.5, None), (1.0, 3)):
        drawn = call(
            name, generate, model, one.expand(n, -1), 1, temperature=temperature, top_k=top_k
        )
        expect(
            isinstance(drawn, torch.Tensor) and tuple(drawn.shape) == (n, 5),
            name,
            f"expected shape ({n}, 5), got "
            f"{tuple(drawn.shape) if isinstance(drawn, torch.Tensor) else drawn!r}.",
        )
        scaled = logits / temperature
        if top_k is not None:
            kept = scaled.topk(top_k).indices
            expect(
                bool(torch.isin(drawn[:, -1], kept).all()),
                name,
                f"with top_k={top_k} a token outside the {top_k} most likely was sampled.",
                "keep the top_k largest logits and set the rest to -inf before the softmax.",
            )
            scaled = torch.full_like(scaled, -math.inf).scatter(0, kept, scaled[kept])
        freq = _frequencies(drawn[:, -1])
        worst = (freq - scaled.softmax(-1)).abs().max().item()
        if worst <= 0.03:  # about 4 standard errors for n=6000
            continue
        hint = "sample with torch.multinomial(softmax(logits / temperature), 1)."
        if (drawn[:, -1] == logits.argmax()).double().mean().item() > 0.99:
            hint = (
                "with temperature > 0, sample from the distribution instead of taking the argmax."
            )
        elif temperature != 1.0:
            if (freq - (logits * temperature).softmax(-1)).abs().max().item() < 0.03:
                hint = (
                    "divide the logits by the temperature (a low temperature sharpens), "
                    "don't multiply."
                )
        raise CheckFailure(
            f"`{name}`: samples at temperature={temperature}, top_k={top_k} do not follow the "
            f"model's distribution (frequency off by {worst:.3f}).\nHint: {hint}"
        )


def check_generate(generate: Callable[..., torch.Tensor]) -> None:
    """`generate(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
    generator=None)`: greedy at temperature 0 (also past n_ctx), samples that follow the
    softmax, top-k per row, the top-p nucleus, and draws from `generator`."""
    name = "generate"
    model = _reference_model(seed=3)
    prompt = _tokens(batch=2, pos=4, seed=4)
    _expect_greedy(name, generate, model, prompt)
    _expect_samples_follow_the_softmax(name, generate, model, prompt[:1])
    _expect_top_k_per_row(name, generate, model)
    _expect_nucleus(name, generate, model, prompt[:1])
    _expect_generator_is_used(name, generate, model, prompt)
    passed(name)


def check_against_huggingface(
    model: torch.nn.Module, hf_model: torch.nn.Module, tokens: torch.Tensor
) -> None:
    """Compare a GPT-2 holding Hugging Face's weights with the Hugging Face model itself, component
    by component (embeddings, each block's output, the final norm, the logits), in float32 with
    tolerance 1e-4, and say which component first differs."""
    name = "GPT2 with Hugging Face's weights"
    with evaluating(model), evaluating(hf_model):
        hf = hf_model(tokens, output_hidden_states=True)
        logits, cache = call(name, model.run_with_cache, tokens)
        last = model.ln_final(cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"])
    embeddings = cache["hook_embed"] + cache["hook_pos_embed"]
    stages = [
        (
            "embeddings",
            embeddings,
            hf.hidden_states[0],
            "embed(tokens) + pos_embed(tokens): W_E and W_pos came from wte and wpe.",
        )
    ]
    for layer in range(model.cfg.n_layers - 1):
        stages.append(
            (
                f"block {layer}",
                cache[f"blocks.{layer}.hook_resid_post"],
                hf.hidden_states[layer + 1],
                "your TransformerBlock: x + attn(ln1(x)), then x + mlp(ln2(x)).",
            )
        )
    stages += [
        (
            "last block and ln_final",
            last,
            hf.hidden_states[-1],
            "the last block, then ln_final (Hugging Face applies its final norm to the last "
            "hidden state).",
        ),
        (
            "logits",
            logits,
            hf.logits,
            "unembed: x @ W_U + b_U, with W_U the transpose of lm_head.weight.",
        ),
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


def check_top_p_filter(fn: Callable[..., torch.Tensor]) -> None:
    """`fn(logits, top_p)`: per row, keep the fewest most likely tokens whose probabilities
    reach `top_p` (the one that crosses it included); the others become -inf."""
    name = "top_p_filter"
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 11, generator=generator, dtype=torch.float64) * torch.tensor(
        [[0.5], [1], [2], [4]], dtype=torch.float64
    )
    for top_p in (0.3, 0.75, 0.95, 1.0, 1e-6):
        where = f"{name}(logits of 4 different rows, top_p={top_p})"
        actual = call(where, fn, logits.clone(), top_p)
        expected = top_p_filter(logits, top_p)
        expect(
            isinstance(actual, torch.Tensor) and actual.shape == logits.shape,
            where,
            f"expected a tensor of shape {tuple(logits.shape)}, got "
            f"{getattr(actual, 'shape', type(actual))}.",
        )
        kept, wanted = actual.isfinite(), expected.isfinite()
        if torch.equal(kept, wanted):
            expect_close(
                actual.masked_fill(~kept, 0),
                logits.masked_fill(~wanted, 0),
                where,
                "return the kept logits unchanged (the softmax renormalises them later).",
                atol=1e-12,
            )
            continue
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        crossing = (sorted_probs.cumsum(-1) <= top_p).scatter(
            -1, order, sorted_probs.cumsum(-1) <= top_p
        )
        if torch.equal(kept, crossing) or not kept.any(-1).all():
            hint = (
                "keep the token whose probability carries the total past top_p: drop a token only "
                "when the mass *before* it already reaches top_p (so the top token always stays)."
            )
        elif (
            torch.equal(
                kept.sort(-1, descending=True).values, wanted.sort(-1, descending=True).values
            )
            or (kept.sum(-1) == wanted.sum(-1)).all()
        ):
            hint = (
                "the right number of tokens, the wrong ones: scatter the mask from sorted order "
                "back to vocabulary order."
            )
        else:
            hint = (
                "sort each row's probabilities (softmax, not raw logits) in descending order and "
                "cumsum along the row."
            )
        expect(
            False,
            where,
            f"kept {kept.sum(-1).tolist()} tokens per row, expected {wanted.sum(-1).tolist()}.",
            hint,
        )
    uniform = torch.zeros(2, 8, dtype=torch.float64)
    kept = call(name, fn, uniform, 0.5).isfinite().sum(-1)
    expect(
        kept.tolist() == [4, 4],
        f"{name}(8 equal logits, top_p=0.5)",
        f"kept {kept.tolist()} tokens per row, expected 4.",
        "with ties any 4 of the 8 will do, but exactly 4.",
    )
    passed(name)


def check_train_step(fn: Callable[..., float]) -> None:
    """`fn(model, optimizer, tokens, targets, *, grad_clip)`: train mode, fresh gradients, the loss,
    backward, clipped gradients, one update; returns the loss as a float."""
    name = "train_step"
    cfg = GPT2Config(**{**vars(CFG), "dropout": 0.2})
    tokens, targets = _tokens(batch=3, pos=6, seed=13), _tokens(batch=3, pos=6, seed=14)

    def fresh() -> tuple[GPT2, torch.optim.Optimizer]:
        torch.manual_seed(15)
        model = GPT2(cfg).eval()  # left in eval mode on purpose: the step must switch to train
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    theirs, their_optimizer = fresh()
    ours, our_optimizer = fresh()
    for step in range(2):
        with evaluating(ours):
            eval_loss = lm_loss(ours(tokens), targets).item()
        torch.manual_seed(100 + step)
        loss = call(name, fn, theirs, their_optimizer, tokens, targets, grad_clip=0.5)
        torch.manual_seed(100 + step)
        expected = train_step(ours, our_optimizer, tokens, targets, grad_clip=0.5)
        where = f"{name} (step {step + 1}, dropout 0.2, SGD, grad_clip=0.5)"
        expect(
            isinstance(loss, float),
            where,
            f"expected the loss as a Python float, got {type(loss).__name__}.",
            "return loss.item(): a float frees the graph and is what a log or a plot wants.",
        )
        if not math.isclose(loss, expected, rel_tol=1e-5):
            hint = "loss = lm_loss(model(tokens), targets), computed before the update."
            if math.isclose(loss, eval_loss, rel_tol=1e-5):
                hint = (
                    "the model ran in eval mode: call model.train() first, so dropout is on "
                    "while training."
                )
            expect(False, where, f"returned loss {loss:.6f}, expected {expected:.6f}.", hint)
        drift = max(
            (a - b).abs().max().item() for a, b in zip(theirs.parameters(), ours.parameters())
        )
        if drift > 1e-5:
            hint = (
                "zero the gradients before backward (optimizer.zero_grad()), so steps don't add up."
            )
            if step == 0:
                hint = (
                    "clip the gradients' global norm after backward and before optimizer.step(): "
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)."
                )
            expect(
                False, where, f"the parameters after the update differ by up to {drift:.3g}.", hint
            )
    passed(name)


def _draw_windows(
    name: str,
    sample_batch: Callable,
    data: torch.Tensor,
    batch_size: int,
    n_ctx: int,
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's `(x, y)` for one call (with a generator seeded `seed`, or none), checked
    for its form: two tensors of shape `(batch_size, n_ctx)` holding ids of `data`."""
    where = f"{name}(data of {len(data)} tokens, batch_size={batch_size}, n_ctx={n_ctx})"
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    try:
        out = call(where, sample_batch, data, batch_size, n_ctx, generator=generator)
    except CheckFailure as failure:
        if not isinstance(failure.__cause__, (IndexError, RuntimeError)):
            raise
        raise CheckFailure(
            f"{failure}\nHint: if an index ran past the end of data: the targets of the last "
            "window end at data[-1], so a window starts at most at len(data) - n_ctx - 1 "
            "(torch.randint's upper bound is exclusive)."
        ) from failure.__cause__
    expect(
        isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out),
        where,
        f"expected a pair of tensors (x, y), got {type(out).__name__}.",
    )
    shape = (batch_size, n_ctx)
    for label, t in zip("xy", out):
        expect(
            tuple(t.shape) == shape,
            where,
            f"{label} should have shape {shape} (batch_size, n_ctx), got {tuple(t.shape)}.",
            "one window of n_ctx tokens per row, batch_size rows.",
        )
        expect(
            t.dtype == data.dtype and bool(torch.isin(t, data).all()),
            where,
            f"{label} should hold ids taken from data (dtype {data.dtype}), got dtype {t.dtype}.",
            "index data with the positions of each window, so the ids keep their dtype.",
        )
    return out


def _expect_shifted_windows(
    where: str, x: torch.Tensor, y: torch.Tensor, position: torch.Tensor
) -> None:
    """Each row of `x` is consecutive tokens and `y` the same window one token later
    (`position[id]` is where the distinct id sits in the data)."""
    px, py = position[x], position[y]
    expect(
        bool((px.diff(dim=1) == 1).all()),
        where,
        "a row of x is not a window of consecutive tokens of data.",
        "each row is data[start : start + n_ctx] for its own start.",
    )
    if not torch.equal(py, px + 1):
        hint = "the targets are the next tokens: y = data[start + 1 : start + n_ctx + 1]."
        if torch.equal(py, px):
            hint = "the targets are the inputs themselves; " + hint
        elif torch.equal(py, px - 1):
            hint = "the targets come one token before the inputs, not after; " + hint
        expect(False, where, "y is not x shifted by one token.", hint)


def check_sample_batch(sample_batch: Callable) -> None:
    """`sample_batch(data, batch_size, n_ctx, *, generator=None) -> (x, y)`: random windows
    of `n_ctx` tokens of the 1-d `data`, one per row, and the same windows one token later.
    Checked: shapes and dtype, targets shifted by one, every window reachable and none past the
    end, rows that differ, and repeatable draws from `generator`."""
    name = "sample_batch"
    # Distinct ids in a shuffled order, so an id says where in data it was taken from.
    n = 1000
    data = torch.randperm(n, generator=torch.Generator().manual_seed(18)) + 3
    position = torch.empty(n + 3, dtype=torch.long)
    position[data] = torch.arange(n)
    x, y = _draw_windows(name, sample_batch, data, 64, 8, seed=19)
    where = f"{name}(data of {n} tokens, batch_size=64, n_ctx=8)"
    _expect_shifted_windows(where, x, y, position)
    starts = position[x[:, 0]]
    expect(
        starts.unique().numel() >= 32,
        where,
        f"the 64 rows hold only {starts.unique().numel()} different windows.",
        "draw one start per row (torch.randint(..., (batch_size,))), so the rows differ.",
    )

    # A short stream: every one of its 6 windows must come, each about equally often.
    short = data[:10]
    x, y = _draw_windows(name, sample_batch, short, 600, 4, seed=20)
    where = f"{name}(data of 10 tokens, batch_size=600, n_ctx=4)"
    _expect_shifted_windows(where, x, y, position)
    counts = torch.bincount(position[x[:, 0]], minlength=6)
    expect(
        counts[0] > 0 and counts[5] > 0,
        where,
        f"windows start at {sorted(position[x[:, 0]].unique().tolist())}; expected each of 0-5.",
        "the last window starts at len(data) - n_ctx - 1 (its targets end at data[-1]) and "
        "the first at 0: torch.randint(len(data) - n_ctx, ...) draws exactly those.",
    )
    share = counts.double() / counts.sum()
    expect(
        bool((share - 1 / 6).abs().max() < 0.07),  # about 4.5 standard errors at n = 600
        where,
        f"the 6 windows come with shares {[round(v, 3) for v in share.tolist()]}, not 1/6 each.",
        "draw each start uniformly: torch.randint(len(data) - n_ctx, (batch_size,)).",
    )

    def inputs(global_seed: int, seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        return _draw_windows(name, sample_batch, data, 8, 8, seed=seed)[0]

    first, again, other = inputs(1, seed=21), inputs(2, seed=21), inputs(1, seed=22)
    expect(
        torch.equal(first, again),
        f"{name}(..., generator=torch.Generator().manual_seed(21)), twice",
        "two calls with equally seeded generators gave different windows.",
        "draw the starts from the generator you are given: torch.randint(..., "
        "generator=generator).",
    )
    expect(
        not torch.equal(first, other),
        f"{name}(..., generator seeded 21, then 22)",
        "generators with different seeds gave the same windows.",
        "draw the starts from the generator you are given instead of a generator of your own.",
    )
    x, y = _draw_windows(name, sample_batch, data, 4, 8, seed=None)  # the global generator
    _expect_shifted_windows(f"{name}(..., generator=None)", x, y, position)
    passed(name)


# The KV cache: logits within KV_ATOL (float64) of the model's own forward pass.
KV_ATOL = 1e-6
KV_CHUNKS = (5, 1, 1, 1, 3)  # a prompt, three tokens one at a time, then three at once
KV_HINTS = {
    "positions": "the new tokens' positions do not count the cached ones: token i of the new "
    "ones sits at position len(cache) + i, so add W_pos[start : start + new], not W_pos[:new].",
    "keys": "the new queries attend to the wrong keys: each may see every cached key and the new "
    "keys up to its own. Concatenate the cached keys and values before attending, and mask with "
    "causal_mask(q_len, k_len), which aligns the last query with the last key "
    "(F.scaled_dot_product_attention's is_causal=True aligns the first query with the first key).",
    "prompt": "with no cache the logits must equal model(tokens): embed at positions 0, 1, ..., "
    "then every block (x + attn(ln1(x)) with the causal mask, x + mlp(ln2(x))), ln_final, unembed.",
    "general": "the new tokens go through the same model as model(tokens) does: positions after "
    "the cached ones, each block's new keys and values appended to its cache before attending, "
    "causal_mask(q_len, k_len), then the MLP, ln_final and unembed.",
}


def _expect_cache(
    where: str, cache: object, cfg: GPT2Config, batch: int, seen: int, new: int
) -> None:
    """The cache after `seen` positions, `new` of them from the last call: per block a pair
    (keys, values), each `(batch, n_heads, seen, d_head)`."""
    pairs = isinstance(cache, (list, tuple)) and len(cache) == cfg.n_layers
    pairs = pairs and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in cache)
    expect(
        pairs,
        where,
        f"expected the cache as a list of {cfg.n_layers} (keys, values) pairs, one per block, "
        f"got {type(cache).__name__}.",
        "return [(k, v) for each block], each (batch, n_heads, positions so far, d_head).",
    )
    shape = (batch, cfg.n_heads, seen, cfg.d_head)
    for layer, pair in enumerate(cache):
        for label, t in zip(("keys", "values"), pair):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            hint = "(batch, n_heads, positions so far, d_head)."
            if isinstance(t, torch.Tensor) and t.ndim == 4 and seen > new:
                if t.shape[2] in (new, seen - new):
                    hint = (
                        "the cache was not appended to: concatenate the new keys and values to "
                        "the cached ones along the positions (torch.cat(..., dim=-2)) and return "
                        "the longer cache."
                    )
            expect(
                got == shape,
                where,
                f"block {layer}'s cached {label} should have shape {shape}, got {got}.",
                hint,
            )


def _replay(name: str, fn: Callable, model: GPT2, tokens: torch.Tensor) -> torch.Tensor:
    """Feed `tokens` to the learner's `fn` in the chunks of KV_CHUNKS, each call with the cache
    the previous one returned; the logits of every position."""
    cache, start, logits = None, 0, []
    batch = tokens.shape[0]
    for new in KV_CHUNKS:
        where = f"{name}(model, {new} new token{'s' * (new > 1)}, a cache of {start} positions)"
        with torch.no_grad():
            out = call(where, fn, model, tokens[:, start : start + new], cache)
        expect(
            isinstance(out, tuple) and len(out) == 2,
            where,
            f"expected (logits, cache), got {type(out).__name__}.",
        )
        chunk, cache = out
        shape = (batch, new, model.cfg.d_vocab)
        got = tuple(chunk.shape) if isinstance(chunk, torch.Tensor) else type(chunk).__name__
        expect(
            got == shape,
            where,
            f"expected logits of shape {shape}, got {got}.",
            "one row of logits per new token: (batch, new, d_vocab).",
        )
        start += new
        _expect_cache(where, cache, model.cfg, batch, start, new)
        logits.append(chunk.detach())
    return torch.cat(logits, dim=1)


def _first_wrong_position(logits: torch.Tensor, expected: torch.Tensor) -> tuple[int, float]:
    """The first position whose logits differ by more than KV_ATOL (-1 if none) and by how much."""
    diff = (logits.double() - expected).abs().nan_to_num(math.inf).amax(dim=(0, 2))
    wrong = (diff > KV_ATOL).nonzero().flatten().tolist()
    return (wrong[0], diff[wrong[0]].item()) if wrong else (-1, 0.0)


def _probe_models(model: GPT2) -> dict[str, GPT2]:
    """Copies of `model` in which one family of mistakes makes no difference: with every row of
    W_pos equal, positions don't matter; with W_V zero, every value is b_V, so attention gives
    the same output whichever keys a query sees."""
    same_positions, same_values = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        same_positions.pos_embed.W_pos.copy_(
            model.pos_embed.W_pos[:1].expand_as(model.pos_embed.W_pos)
        )
        for block in same_values.blocks:
            block.attn.W_V.zero_()
    return {"positions": same_positions, "keys": same_values}


def _cache_mistake(name: str, fn: Callable, model: GPT2, tokens: torch.Tensor, cached: int) -> str:
    """The hint for logits that differ when `cached` positions were cached: the family whose
    probe model the learner's code gets right, or the recipe for the call that went wrong."""
    for family, probe in _probe_models(model).items():
        try:
            logits = _replay(name, fn, probe, tokens)
        except CheckFailure:
            continue
        with torch.no_grad():
            if _first_wrong_position(logits, probe(tokens))[0] < 0:
                return KV_HINTS[family]
    return KV_HINTS["prompt" if cached == 0 else "general"]


def check_kv_cache(forward_with_cache: Callable) -> None:
    """`forward_with_cache(model, tokens, cache=None) -> (logits, cache)`: the logits of a prompt,
    then of tokens fed one and three at a time with the cache, must be those of
    `model(all tokens)` within 1e-6 (float64, two rows that differ), and greedy decoding with
    the cache must give the tokens greedy decoding without it gives."""
    name = "forward_with_cache"
    model = _reference_model(seed=5).double()
    tokens = _tokens(batch=2, pos=sum(KV_CHUNKS), seed=16)
    logits = _replay(name, forward_with_cache, model, tokens)
    with torch.no_grad():
        expected = model(tokens)
    position, worst = _first_wrong_position(logits, expected)
    if position >= 0:
        starts = [sum(KV_CHUNKS[:index]) for index in range(len(KV_CHUNKS))]
        call_index = max(index for index, start in enumerate(starts) if start <= position)
        cached, new = starts[call_index], KV_CHUNKS[call_index]
        expect(
            False,
            f"{name}, position {position}, in the call with {new} new "
            f"token{'s' * (new > 1)} after {cached} cached ones",
            f"the logits differ from model(tokens)'s by up to {worst:.3g} "
            f"(tolerance {KV_ATOL:g}, float64).",
            _cache_mistake(name, forward_with_cache, model, tokens, cached),
        )
    prompt, steps = tokens[:, : KV_CHUNKS[0]], CFG.n_ctx - KV_CHUNKS[0]
    where = f"{name}, greedy decoding of {steps} tokens"
    with torch.no_grad():
        out, cache = call(where, forward_with_cache, model, prompt, None)
        decoded = prompt
        for step in range(steps):
            next_token = out[:, -1].argmax(dim=-1, keepdim=True)
            decoded = torch.cat([decoded, next_token], dim=1)
            if step < steps - 1:
                out, cache = call(where, forward_with_cache, model, next_token, cache)
    expect(
        torch.equal(decoded, _greedy(model, prompt, steps)),
        where,
        "the tokens differ from greedy decoding without a cache.",
        "feed each new token alone, with the cache the previous call returned.",
    )
    passed(name)
