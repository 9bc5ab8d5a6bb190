"""Checkers for chapter 6: GPT-2's embeddings, unembedding, MLP, the full forward pass and sampling.

Each checker builds the learner's class (or calls the learner's function) next to the course's
reference from `transformer_course.gpt2` / `transformer_course.blocks`, with identical weights,
and compares outputs. Known mistakes get targeted hints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from transformer_course.blocks import MLP as ReferenceMLP
from transformer_course.blocks import TransformerBlock
from transformer_course.checks import (
    CheckFailure,
    call,
    expect,
    expect_close,
    expect_hooks,
    expect_same_in_train_mode,
    load_reference_weights,
    passed,
)
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss, top_p_filter, train_step
from transformer_course.masking import causal_mask, combine_masks, padding_mask

__all__ = [
    "check_embed",
    "check_pos_embed",
    "check_unembed",
    "check_mlp",
    "check_transformer_block",
    "check_gpt2_forward",
    "check_generate",
    "check_top_p_filter",
    "check_train_step",
    "check_against_huggingface",
]

CFG = GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=37, n_ctx=12)


def _tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def _build(name: str, cls: type, *args: Any, **kwargs: Any) -> torch.nn.Module:
    return call(f"{name}.__init__", cls, *args, **kwargs)


def _param(module: torch.nn.Module, name: str, owner: str, shape: tuple[int, ...]) -> torch.nn.Parameter:
    param = getattr(module, name, None)
    expect(
        isinstance(param, torch.nn.Parameter),
        owner,
        f"expected a parameter named `{name}` (an nn.Parameter), got {type(param).__name__}.",
        f"create it in __init__: self.{name} = nn.Parameter(torch.empty{shape}).",
    )
    expect(
        tuple(param.shape) == shape,
        owner,
        f"`{name}` should have shape {shape}, got {tuple(param.shape)}.",
        "TransformerLens layout: matrices are (d_in, d_out), embeddings are (rows, d_model).",
    )
    return param


def _fill(*params: torch.nn.Parameter, seed: int = 1) -> None:
    """Random values, so a forward pass that ignores a parameter shows up."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in params:
            param.copy_(torch.randn(param.shape, generator=generator))


def check_embed(Embed: type) -> None:
    """`Embed(cfg)`: parameter `W_E (d_vocab, d_model)`; `forward(tokens)` looks up each token's row."""
    name = "Embed"
    embed = _build(name, Embed, CFG)
    W_E = _param(embed, "W_E", name, (CFG.d_vocab, CFG.d_model))
    _fill(W_E)
    tokens = _tokens()
    out = call(f"{name}.forward", embed, tokens)
    expected = F.embedding(tokens, W_E.detach())
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        expect(
            not torch.allclose(out.detach(), expected * math.sqrt(CFG.d_model)),
            name,
            "the embeddings are scaled by sqrt(d_model).",
            "that scale belongs to the original transformer (Vaswani et al.); GPT-2 uses W_E[tokens] as it is.",
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
    pos_embed = _build(name, PosEmbed, CFG)
    W_pos = _param(pos_embed, "W_pos", name, (CFG.n_ctx, CFG.d_model))
    _fill(W_pos)
    tokens = _tokens(batch=3, pos=7) % CFG.n_ctx  # ids below n_ctx, so indexing W_pos by token id also runs
    out = call(f"{name}.forward", pos_embed, tokens)
    expected = W_pos.detach()[:7].expand(3, 7, CFG.d_model)
    if isinstance(out, torch.Tensor) and out.shape == expected.shape:
        by_token = W_pos.detach()[tokens]
        expect(
            not torch.allclose(out.detach(), by_token),
            name,
            "the output is W_pos indexed by the token ids.",
            "position embeddings depend on where a token is (0, 1, ..., pos-1), not on which token it is.",
        )
    expect_close(
        out,
        expected,
        name,
        "return W_pos[:pos] for every sequence: shape (batch, pos, d_model), e.g. with einops.repeat.",
    )
    passed(name)


def check_unembed(Unembed: type) -> None:
    """`Unembed(cfg)`: parameters `W_U (d_model, d_vocab)` and `b_U (d_vocab,)`, initialised
    N(0, init_range) and zero; `forward(x) = x @ W_U + b_U`."""
    name = "Unembed"
    torch.manual_seed(0)
    unembed = _build(name, Unembed, CFG)
    W_U = _param(unembed, "W_U", name, (CFG.d_model, CFG.d_vocab))
    b_U = _param(unembed, "b_U", name, (CFG.d_vocab,))
    expect(
        torch.count_nonzero(b_U).item() == 0,
        name,
        f"`b_U` should start at zero, got values from {b_U.min().item():.3g} to {b_U.max().item():.3g}.",
        "biases are initialised to zeros (torch.zeros), not ones: a bias of one shifts every logit at the start.",
    )
    std = W_U.detach().std().item()
    expect(
        abs(std - CFG.init_range) < 0.3 * CFG.init_range,
        name,
        f"`W_U` should start with standard deviation init_range={CFG.init_range}, got {std:.3g}.",
        "initialise it with nn.init.normal_(self.W_U, std=cfg.init_range).",
    )
    _fill(W_U, b_U)
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


def check_mlp(MLP: type) -> None:
    """`MLP(d_model, d_mlp, act_fn="gelu_new")`: `W_out(gelu_new(x @ W_in + b_in)) + b_out`."""
    name = "MLP"
    d_model, d_mlp = 16, 64
    mlp = _build(name, MLP, d_model, d_mlp)
    W_in = _param(mlp, "W_in", name, (d_model, d_mlp))
    b_in = _param(mlp, "b_in", name, (d_mlp,))
    W_out = _param(mlp, "W_out", name, (d_mlp, d_model))
    b_out = _param(mlp, "b_out", name, (d_model,))
    _fill(W_in, b_in, W_out, b_out)
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(3))
    out = call(f"{name}.forward", mlp, x)

    def reference(act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return act(x @ W_in.detach() + b_in.detach()) @ W_out.detach() + b_out.detach()

    expected = reference(lambda h: F.gelu(h, approximate="tanh"))
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and not torch.allclose(out.detach(), expected, atol=1e-5):
        for wrong, hint in (
            (F.gelu, "GPT-2 uses gelu_new, the tanh approximation: F.gelu(x, approximate='tanh'), not the exact erf GELU."),
            (F.relu, "the activation is GELU (gelu_new), not ReLU."),
        ):
            expect(
                not torch.allclose(out.detach(), reference(wrong), atol=1e-5),
                name,
                "the activation function is not GPT-2's.",
                hint,
            )
    expect_close(out, expected, name, "x @ W_in + b_in, then gelu_new, then @ W_out + b_out.")

    for act_fn in ("relu", "gelu"):
        where = f"{name}(act_fn={act_fn!r})"
        theirs = call(where, MLP, d_model, d_mlp, act_fn=act_fn)
        reference = ReferenceMLP(d_model, d_mlp, act_fn=act_fn)
        reference.load_state_dict(mlp.state_dict())
        theirs.load_state_dict(mlp.state_dict())
        expect_close(call(where, theirs, x), reference(x).detach(), where,
                     "use the activation the module was built with, ACTIVATIONS[self.act_fn].")
    expect_hooks(
        name, mlp, reference_mlp(mlp, d_model, d_mlp),
        {
            "hook_pre": "pass x @ W_in + b_in (before the activation) through self.hook_pre.",
            "hook_post": "pass the activation's output through self.hook_post, before W_out.",
        },
        x,
        atol=1e-6,
    )
    passed(name)


def reference_mlp(mlp: torch.nn.Module, d_model: int, d_mlp: int) -> torch.nn.Module:
    reference = ReferenceMLP(d_model, d_mlp)
    reference.load_state_dict(mlp.state_dict())
    return reference


BLOCK_HOOKS = {
    "hook_resid_pre": "pass the incoming residual stream through self.hook_resid_pre first.",
    "hook_attn_out": "hook_attn_out gets what attention adds to the stream (after dropout).",
    "hook_resid_mid": "hook_resid_mid gets the stream after the attention sublayer.",
    "hook_mlp_out": "hook_mlp_out gets what the MLP adds to the stream (after dropout).",
    "hook_resid_post": "hook_resid_post gets the block's output.",
}


def _block_variants(block: TransformerBlock, x: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The outputs of the classic block mistakes, built from the reference's own sublayers."""
    pos = x.shape[1]
    causal = combine_masks(causal_mask(pos), mask)

    def attn(h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return block.attn(h, mask=m)

    pre = lambda h, m: (lambda r: r + block.mlp(block.ln2(r)))(h + attn(block.ln1(h), m))  # noqa: E731
    post = lambda h, m: (lambda r: block.ln2(r + block.mlp(r)))(block.ln1(h + attn(h, m)))  # noqa: E731
    right, wrong = (pre, post) if block.norm == "pre" else (post, pre)
    variants = {
        "attention must be causal: call self.attn(..., mask=mask, causal=True), so no position "
        "sees a later one.": right(x, mask),
        f"this is {'post' if block.norm == 'pre' else 'pre'}-LN; with norm={block.norm!r} "
        + ("normalise each sublayer's input: x = x + attn(ln1(x)), then x = x + mlp(ln2(x))."
           if block.norm == "pre" else "normalise after each residual sum: x = ln1(x + attn(x))."): wrong(x, causal),
        "the mask you are given is ignored: pass it on to attention (mask=mask).": right(x, causal_mask(pos)),
    }
    if block.norm == "pre":
        normed = block.ln1(x)
        mid = normed + attn(normed, causal)
        variants["only the sublayer's input is normalised; the residual stream itself stays as it "
                 "is: x = x + attn(ln1(x)), not ln1(x) + attn(ln1(x))."] = mid + block.mlp(block.ln2(mid))
        mid = attn(block.ln1(x), causal)
        hint = "a residual connection is missing: add each sublayer's output to the stream, x = x + ..."
        variants[hint] = block.mlp(block.ln2(mid))
        variants[hint + " (the attention's)"] = mid + block.mlp(block.ln2(mid))
    return variants


def check_transformer_block(cls: type) -> None:
    """`TransformerBlock(d_model, n_heads, d_head, d_mlp, *, ln_eps, norm, act_fn, dropout)`:
    causal self-attention and an MLP on the residual stream, pre-LN or post-LN."""
    name = "TransformerBlock"
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    padding = padding_mask(torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]), 0)
    for norm in ("pre", "post"):
        torch.manual_seed(5)
        reference = TransformerBlock(16, 4, 4, 32, norm=norm).double().eval()
        generator = torch.Generator().manual_seed(6)
        with torch.no_grad():
            for param in reference.parameters():
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64))
        block = _build(f"{name}(norm={norm!r})", cls, 16, 4, 4, 32, norm=norm).double()
        load_reference_weights(name, block, reference, "ln1, attn, ln2, mlp")
        block.eval()
        for mask, label in ((None, "no mask"), (padding, "a padding mask")):
            where = f"{name}(norm={norm!r}), {label}"
            with torch.no_grad():
                out = call(where, block, x, mask)
                expected = reference(x, mask)
                if isinstance(out, torch.Tensor) and out.shape == expected.shape and not _same(out, expected):
                    for hint, wrong in _block_variants(reference, x, mask).items():
                        expect(not _same(out, wrong), where, "values differ from the reference.", hint)
            expect_close(out, expected, where, "x = x + dropout(attn(ln1(x), causal mask)); "
                         "x = x + dropout(mlp(ln2(x))) for pre-LN.", atol=1e-8)
        expect_hooks(f"{name}(norm={norm!r})", block, reference, BLOCK_HOOKS, x, atol=1e-8)
        theirs = _build(name, cls, 16, 4, 4, 32, norm=norm, dropout=0.3).double()
        ours = TransformerBlock(16, 4, 4, 32, norm=norm, dropout=0.3).double()
        theirs.load_state_dict(ours.state_dict())
        expect_same_in_train_mode(
            f"{name}(norm={norm!r}, dropout=0.3)", theirs, ours, x,
            hint="apply self.dropout to each sublayer's output before adding it to the stream "
            "(twice: attention, MLP), and nowhere else.",
        )
    passed(name)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.detach().double(), b.detach().double(), atol=1e-8)


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
    model = _build(name, GPT2Class, CFG)
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
            (run(embed), "the position embedding is missing: add pos_embed(tokens) to embed(tokens)."),
            (run(embed + pos, final_ln=False), "apply ln_final to the residual stream before the unembedding."),
            (
                reference.unembed(reference.ln_final(embed + pos)),
                "the blocks did not run: pass the residual stream through every block in self.blocks.",
            ),
        )
    if isinstance(out, torch.Tensor) and out.shape == expected.shape and not torch.allclose(out.detach(), expected, atol=1e-5):
        for wrong, hint in variants:
            expect(not torch.allclose(out.detach(), wrong, atol=1e-5), name, "the logits are wrong.", hint)
    expect_close(
        out, expected, name, "embed + pos_embed, then each block in turn, then ln_final, then unembed.", atol=1e-4
    )
    expect_hooks(
        name, model, reference,
        {
            "hook_embed": "pass the token embeddings, embed(tokens), through self.hook_embed.",
            "hook_pos_embed": "pass the position embeddings, pos_embed(tokens), through self.hook_pos_embed.",
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
    model = _build(name, GPT2Class, cfg)
    model.load_state_dict(reference.state_dict())
    expect_same_in_train_mode(
        f"{name} (dropout=0.3)", model, reference, tokens,
        hint="apply self.dropout once, to the sum of the token and position embeddings, before the blocks.",
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


def _expect_nucleus(name: str, generate: Callable[..., torch.Tensor], model: GPT2, prompt: torch.Tensor) -> None:
    """With `top_p`, every sample lies in the nucleus of the model's distribution."""
    with torch.no_grad():
        logits = model(prompt)[:, -1].float()
    nucleus = top_p_filter(logits, 0.6)[0].isfinite().nonzero().flatten()
    torch.manual_seed(10)
    drawn = call(name, generate, model, prompt.expand(2000, -1), 1, top_p=0.6)[:, -1]
    expect(
        bool(torch.isin(drawn, nucleus).all()) and len(drawn.unique()) == len(nucleus),
        f"{name} (top_p=0.6)",
        f"the samples use the tokens {sorted(drawn.unique().tolist())}, the nucleus is {nucleus.tolist()}.",
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
            bool(torch.isin(mine, top.indices[row]).all()) and worst < 0.06,  # 0.06: over 5 std errors
            f"{name} (top_k=3, four different prompts)",
            f"row {row} does not sample from its own 3 most likely tokens "
            f"(frequencies {freq.tolist()} for its top 3).",
            "take the k-th largest logit of each row (topk over dim=-1, keep a (batch, 1) threshold), "
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


def check_generate(generate: Callable[..., torch.Tensor]) -> None:
    """`generate(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, generator=None)`."""
    name = "generate"
    model = _reference_model(seed=3)
    prompt = _tokens(batch=2, pos=4, seed=4)

    try:
        out = generate(model, prompt, 3, temperature=0)
    except NotImplementedError:
        out = call(name, generate, model, prompt, 3, temperature=0)  # reports the blank with its hint
    except Exception as exc:
        raise CheckFailure(
            f"`{name}` raised {type(exc).__name__} with temperature=0: {exc}\nHint: temperature=0 means greedy "
            "decoding: take the argmax of the logits instead of dividing by zero."
        ) from exc
    expect(isinstance(out, torch.Tensor), name, f"expected a tensor, got {type(out).__name__}.")
    expect(
        tuple(out.shape) == (2, 7),
        name,
        f"with 4 prompt tokens and max_new_tokens=3 expected shape (2, 7), got {tuple(out.shape)}.",
        "return the prompt followed by the new tokens: torch.cat([tokens, next_token], dim=1) each step.",
    )
    expect(torch.equal(out[:, :4], prompt), name, "the output does not start with the prompt.")
    expect(
        torch.equal(out, _greedy(model, prompt, 3)),
        name,
        "temperature=0 should pick the most likely next token every step.",
        "use logits[:, -1, :] (the last position) and argmax when temperature == 0; don't divide by zero.",
    )

    try:
        long = generate(model, prompt, CFG.n_ctx + 2, temperature=0)
    except ValueError as exc:
        raise CheckFailure(
            f"`{name}` raised ValueError when the sequence grew past n_ctx={CFG.n_ctx}: {exc}\nHint: feed only the "
            "last n_ctx tokens to the model: tokens[:, -model.cfg.n_ctx:]."
        ) from exc
    expect(
        torch.equal(long, _greedy(model, prompt, CFG.n_ctx + 2)),
        name,
        "generating past n_ctx tokens gives wrong tokens.",
        "feed only the last n_ctx tokens to the model: tokens[:, -model.cfg.n_ctx:].",
    )

    # Sampling: many copies of one prompt, one new token each; frequencies must follow the softmax.
    n = 6000
    one = prompt[:1]
    with torch.no_grad():
        logits = model(one)[0, -1].double()
    torch.manual_seed(5)
    for temperature, top_k in ((1.0, None), (0.5, None), (1.0, 3)):
        drawn = call(name, generate, model, one.expand(n, -1), 1, temperature=temperature, top_k=top_k)
        expect(
            isinstance(drawn, torch.Tensor) and tuple(drawn.shape) == (n, 5),
            name,
            f"expected shape ({n}, 5), got {tuple(drawn.shape) if isinstance(drawn, torch.Tensor) else drawn!r}.",
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
        probs = scaled.softmax(-1)
        worst = (freq - probs).abs().max().item()
        if worst > 0.03:  # about 4 standard errors for n=6000
            greedy_share = (drawn[:, -1] == logits.argmax()).double().mean().item()
            hint = "sample with torch.multinomial(softmax(logits / temperature), 1)."
            if greedy_share > 0.99:
                hint = "with temperature > 0, sample from the distribution instead of taking the argmax."
            elif temperature != 1.0:
                wrong = _frequencies(drawn[:, -1])
                if (wrong - (logits * temperature).softmax(-1)).abs().max().item() < 0.03:
                    hint = "divide the logits by the temperature (a low temperature sharpens), don't multiply."
            raise CheckFailure(
                f"`{name}`: samples at temperature={temperature}, top_k={top_k} do not follow the model's "
                f"distribution (frequency off by {worst:.3f}).\nHint: {hint}"
            )
    _expect_top_k_per_row(name, generate, model)
    _expect_nucleus(name, generate, model, prompt[:1])
    _expect_generator_is_used(name, generate, model, prompt)
    passed(name)


def check_against_huggingface(model: torch.nn.Module, hf_model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """Compare a GPT-2 holding Hugging Face's weights with the Hugging Face model itself, component
    by component (embeddings, each block's output, the final norm, the logits), in float32 with
    tolerance 1e-4, and say which component first differs."""
    name = "GPT2 with Hugging Face's weights"
    model.eval(), hf_model.eval()
    with torch.no_grad():
        hf = hf_model(tokens, output_hidden_states=True)
        logits, cache = call(name, model.run_with_cache, tokens)
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    stages = [("embeddings", cache["hook_embed"] + cache["hook_pos_embed"], hf.hidden_states[0],
               "embed(tokens) + pos_embed(tokens): W_E and W_pos came from wte and wpe.")]
    for layer in range(model.cfg.n_layers - 1):
        stages.append((f"block {layer}", cache[f"blocks.{layer}.hook_resid_post"], hf.hidden_states[layer + 1],
                       "your TransformerBlock: x + attn(ln1(x)), then x + mlp(ln2(x))."))
    stages += [
        ("last block and ln_final", model.ln_final(cache[last]), hf.hidden_states[-1],
         "the last block, then ln_final (Hugging Face applies its final norm to the last hidden state)."),
        ("logits", logits, hf.logits, "unembed: x @ W_U + b_U, with W_U the transpose of lm_head.weight."),
    ]
    for stage, ours, theirs, hint in stages:
        worst = (ours.float() - theirs.float()).abs().max().item()
        print(f"{stage:<24} max |difference| {worst:.1e}")
        expect(worst < 1e-4, f"{name}, {stage}", f"differs from Hugging Face's by up to {worst:.3g}.", hint)
    passed(name)


def check_top_p_filter(fn: Callable[..., torch.Tensor]) -> None:
    """`fn(logits, top_p)`: per row, keep the fewest most likely tokens whose probabilities
    reach `top_p` (the one that crosses it included); the others become -inf."""
    name = "top_p_filter"
    generator = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 11, generator=generator, dtype=torch.float64) * torch.tensor([[0.5], [1], [2], [4]],
                                                                                          dtype=torch.float64)
    for top_p in (0.3, 0.75, 0.95, 1.0, 1e-6):
        where = f"{name}(logits of 4 different rows, top_p={top_p})"
        actual = call(where, fn, logits.clone(), top_p)
        expected = top_p_filter(logits, top_p)
        expect(isinstance(actual, torch.Tensor) and actual.shape == logits.shape, where,
               f"expected a tensor of shape {tuple(logits.shape)}, got {getattr(actual, 'shape', type(actual))}.")
        kept, wanted = actual.isfinite(), expected.isfinite()
        if torch.equal(kept, wanted):
            expect_close(actual.masked_fill(~kept, 0), logits.masked_fill(~wanted, 0), where,
                         "return the kept logits unchanged (the softmax renormalises them later).", atol=1e-12)
            continue
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        crossing = (sorted_probs.cumsum(-1) <= top_p).scatter(-1, order, sorted_probs.cumsum(-1) <= top_p)
        if torch.equal(kept, crossing) or not kept.any(-1).all():
            hint = ("keep the token whose probability carries the total past top_p: drop a token only "
                    "when the mass *before* it already reaches top_p (so the top token always stays).")
        elif torch.equal(kept.sort(-1, descending=True).values, wanted.sort(-1, descending=True).values) or (
                kept.sum(-1) == wanted.sum(-1)).all():
            hint = "the right number of tokens, the wrong ones: scatter the mask from sorted order back to vocabulary order."
        else:
            hint = "sort each row's probabilities (softmax, not raw logits) in descending order and cumsum along the row."
        expect(False, where, f"kept {kept.sum(-1).tolist()} tokens per row, expected {wanted.sum(-1).tolist()}.", hint)
    uniform = torch.zeros(2, 8, dtype=torch.float64)
    kept = call(name, fn, uniform, 0.5).isfinite().sum(-1)
    expect(kept.tolist() == [4, 4], f"{name}(8 equal logits, top_p=0.5)", f"kept {kept.tolist()} tokens per row, expected 4.",
           "with ties any 4 of the 8 will do, but exactly 4.")
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
        was_training = ours.training
        with torch.no_grad():
            eval_loss = lm_loss(ours.eval()(tokens), targets).item()
        ours.train(was_training)
        torch.manual_seed(100 + step)
        loss = call(name, fn, theirs, their_optimizer, tokens, targets, grad_clip=0.5)
        torch.manual_seed(100 + step)
        expected = train_step(ours, our_optimizer, tokens, targets, grad_clip=0.5)
        where = f"{name} (step {step + 1}, dropout 0.2, SGD, grad_clip=0.5)"
        expect(isinstance(loss, float), where, f"expected the loss as a Python float, got {type(loss).__name__}.",
               "return loss.item(): a float frees the graph and is what a log or a plot wants.")
        if not math.isclose(loss, expected, rel_tol=1e-5):
            hint = "loss = lm_loss(model(tokens), targets), computed before the update."
            if math.isclose(loss, eval_loss, rel_tol=1e-5):
                hint = "the model ran in eval mode: call model.train() first, so dropout is on while training."
            expect(False, where, f"returned loss {loss:.6f}, expected {expected:.6f}.", hint)
        drift = max((a - b).abs().max().item() for a, b in zip(theirs.parameters(), ours.parameters()))
        if drift > 1e-5:
            hint = "zero the gradients before backward (optimizer.zero_grad()), so steps don't add up."
            if step == 0:
                hint = ("clip the gradients' global norm after backward and before optimizer.step(): "
                        "torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).")
            expect(False, where, f"the parameters after the update differ by up to {drift:.3g}.", hint)
    passed(name)
