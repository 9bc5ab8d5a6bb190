"""Checkers for chapter 9's workbook (09_assistant): the chat format's labels and response mask,
per-token log-probs and entropy (float32 whatever the model's dtype), the masked mean (an empty
row gives 0) and sum, the SFT loss with gradient accumulation, LoRA, the DPO loss,
group-normalised advantages and the policy-gradient losses, each against the reference with the
bug catalogue's mistakes named."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer_course import chat, dpo, fine_tuning, logprobs, policy_gradient
from transformer_course.checks.harness import (
    call,
    describe,
    expect,
    expect_close,
    expect_no_known_mistake,
    expect_raises,
    passed,
    randn,
    seeded,
    shape_of,
)
from transformer_course.llama import Llama, LlamaConfig
from transformer_course.tokenization import BPETokenizer

PROMPTS = ["What is 2 + 5?", "What is 12 + 30?", "hi"]  # rows of three lengths: padding
RESPONSES = ["the answer is 7", "the answer is 42", "the answer is 1234567"]
CHAT_TEXT = "".join(
    f"{chat.USER}What is {i} + {i + 3}?{chat.ASSISTANT}the answer is {2 * i + 3}{chat.END}"
    for i in range(30)
)
KEYS = ("input_ids", "labels", "response_mask")


@functools.cache
def _chat_tokenizer() -> BPETokenizer:
    """A small BPE tokenizer with the chat tokens special (made once)."""
    return BPETokenizer.train(CHAT_TEXT, 280, special_tokens=chat.CHAT_TOKENS)


def _chat_rows(tokenizer, prompts, responses) -> list[tuple[list[int], list[int]]]:
    """Each row's prompt ids (with the chat markup) and response ids (with the end token)."""
    return [
        (tokenizer.encode(chat.chat_prompt(p)), tokenizer.encode(r + chat.END))
        for p, r in zip(prompts, responses)
    ]


def _chat_mistakes(tokenizer, prompts, responses) -> dict[str, dict[str, Tensor]]:
    """What each classic slip gives, per key: {key: {hint: that key's tensor}}."""
    rows = _chat_rows(tokenizer, prompts, responses)
    longest = max(len(p) + len(r) for p, r in rows)
    full = torch.full((len(rows), longest), tokenizer.special_tokens[chat.END])
    spans = {name: torch.zeros(full.shape, dtype=torch.bool) for name in ("right", "no end")}
    spans["prompt too"] = spans["right"].clone()
    for i, (p, r) in enumerate(rows):
        full[i, : len(p) + len(r)] = torch.tensor(p + r)
        spans["right"][i, len(p) : len(p) + len(r)] = True
        spans["no end"][i, len(p) : len(p) + len(r) - 1] = True
        spans["prompt too"][i, : len(p) + len(r)] = True
    return {
        "labels": {
            "labels not shifted: the label at position t is the token after input_ids[t], "
            "so labels = full[:, 1:] where input_ids = full[:, :-1].": full[:, :-1]
        },
        "response_mask": {
            "the mask is one position off: it must be aligned with the labels (a position is "
            "on when its label is a response token), not with input_ids.": spans["right"][:, :-1],
            "the end token is part of the response: the model must learn to stop, so its "
            "label is on in the mask.": spans["no end"][:, 1:],
            "the prompt is given, not learned: the mask is on only where the label is a "
            "response token or the end token.": spans["prompt too"][:, 1:],
        },
    }


def _expect_exact(got, wanted: Tensor, where: str, hint: str, mistakes=None) -> None:
    """Integer or boolean tensors equal to `wanted` (a bool mask may come as 0/1 integers)."""
    expect(isinstance(got, Tensor), where, f"expected a tensor, got {describe(got)}.")
    shape = tuple(wanted.shape)
    expect(shape_of(got) == shape, where, f"expected shape {shape}, got {shape_of(got)}.", hint)
    expect(not got.is_floating_point(), where, f"expected integers, got {got.dtype}.", hint)
    problem = f"values differ from the reference at {int((got != wanted).sum())} positions."
    if not torch.equal(got.to(wanted.dtype), wanted):
        expect_no_known_mistake(where, got, mistakes or {}, problem=problem)
        expect(False, where, problem, hint)


def check_tokenize_chat(fn: Callable) -> None:
    """`tokenize_chat(prompts, responses, tokenizer)` against the reference, exactly: rows of
    three lengths (right padding with the end id); bad input refused."""
    tokenizer = _chat_tokenizer()
    where = "tokenize_chat(3 prompts, 3 responses, tokenizer)"
    got = call(where, fn, PROMPTS, RESPONSES, tokenizer)
    keys = f"a dict with the keys {', '.join(KEYS)}"
    expect(isinstance(got, dict), where, f"expected {keys}, got {describe(got)}.")
    expect(set(KEYS) <= set(got), where, f"expected {keys}, got the keys {sorted(got)}.")
    wanted = chat.tokenize_chat(PROMPTS, RESPONSES, tokenizer)
    mistakes = _chat_mistakes(tokenizer, PROMPTS, RESPONSES)
    hints = {
        "input_ids": "each row is the prompt's ids (with the chat markup) then the response's "
        "(with <|end|>), right-padded with the <|end|> id to the longest row; input_ids drops "
        "the last position.",
        "labels": "labels are the same padded rows without their first position.",
        "response_mask": "on exactly where the label is a response token or the row's own end "
        "token; off on the prompt and the padding.",
    }
    for key in KEYS:
        _expect_exact(got[key], wanted[key], f"{where}[{key!r}]", hints[key], mistakes.get(key))
    refuse = "refuse it with a ValueError that names the argument."
    for label, args in {
        "an empty response": (["What is 1 + 1?"], [""], tokenizer),
        "a prompt holding the text <|end|>": (["What is <|end|>?"], ["x"], tokenizer),
        "a response holding the text <|user|>": (["What?"], ["<|user|>hi"], tokenizer),
    }.items():
        expect_raises(f"tokenize_chat with {label}", refuse, fn, *args, errors=(ValueError,))
    where = "tokenize_chat with a conversation longer than n_ctx=5"
    longer = lambda: fn(PROMPTS, RESPONSES, tokenizer, n_ctx=5)
    expect_raises(where, refuse, longer, errors=(ValueError,))
    passed("tokenize_chat")


# d_model 16, 2 layers, 4 heads, 2 KV heads, d_head 6, d_mlp 24, d_vocab 37, n_ctx 16
TINY = LlamaConfig(16, 2, 4, 2, 6, 24, 37, 16)


def _sharp_model(dtype: torch.dtype = torch.float64) -> Llama:
    """A tiny decoder with large weights: sharp distributions, log-probs far below 0."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Llama(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)
    return model.to(dtype).eval()


UPCAST_HINT = "take the log-softmax in float32 (call .float() on the logits first) and return "
UPCAST_HINT += "float32: a bfloat16 log-softmax keeps 8 bits."


def _expect_float32(got, where: str) -> None:
    """A float32 tensor, whatever the dtype of the model or logits it came from."""
    expect(isinstance(got, Tensor), where, f"expected a float32 tensor, got {describe(got)}.")
    expect(got.dtype == torch.float32, where, f"expected float32, got {got.dtype}.", UPCAST_HINT)


def check_response_log_probs(fn: Callable) -> None:
    """`response_log_probs(model, input_ids, labels)` against the reference: 1e-5 (float32 by
    contract) from a float64 and from a bfloat16 model, far-from-uniform distributions."""
    ids = torch.randint(37, (3, 9), generator=seeded(1))
    labels = torch.randint(37, (3, 9), generator=seeded(2))
    for dtype in (torch.float64, torch.bfloat16):
        model = _sharp_model(dtype)
        where = f"response_log_probs({str(dtype)[6:]} model, input_ids (3, 9), labels (3, 9))"
        with torch.no_grad():
            got = call(where, fn, model, ids, labels)
            wanted = logprobs.response_log_probs(model, ids, labels)
            log_probs = model(ids).float().log_softmax(-1)
            low = model(ids).log_softmax(-1).gather(-1, labels[..., None])[..., 0].float()
        wrong = {
            "the log-prob of labels[b, t] (the next token), not of input_ids[b, t]: gather "
            "the labels.": log_probs.gather(-1, ids[..., None])[..., 0],
            "log-probabilities, not probabilities: take the log-softmax.": log_probs.exp().gather(
                -1, labels[..., None]
            )[..., 0],
        }
        if dtype == torch.bfloat16:
            wrong[UPCAST_HINT] = low
        _expect_float32(got, where)
        hint = "the log-softmax of the model's logits over the vocabulary, at each label."
        expect_close(got, wanted, where, hint, atol=1e-5, rtol=1e-6, mistakes=wrong)
    passed("response_log_probs")


def check_token_entropy(fn: Callable) -> None:
    """`token_entropy(logits)` against the reference: 1e-5 (float32 by contract), from float64
    and bfloat16 logits, tokens that cannot come (logits of -inf) among them."""
    logits = 4 * randn(3, 4, 11, seed=3)
    logits[0, :, 3:] = -torch.inf  # three tokens possible
    logits[1, 2, 1:] = -torch.inf  # one token certain: entropy 0
    for dtype in (torch.float64, torch.bfloat16):
        x = logits.to(dtype)
        where = f"token_entropy({str(dtype)[6:]} logits (3, 4, 11), some of them -inf)"
        got = call(where, fn, x)
        _expect_float32(got, where)
        wanted = logprobs.token_entropy(x)
        log_p = x.float().log_softmax(-1)
        if got.isnan().any():
            problem = "the result contains NaN where some logits are -inf."
            hint = "a token that cannot come has p = 0 and log p = -inf, and 0 * -inf is NaN: "
            hint += "it adds 0 to the entropy, so leave it out (or clamp log p to a finite value)."
            expect(False, where, problem, hint)
        finite = log_p.clamp(min=-1e30)
        wrong = {
            "the entropy in nats: the natural log, not log2.": -(log_p.exp() * finite).sum(-1)
            / torch.log(torch.tensor(2.0)),
        }
        hint = "H = -sum_v p_v log p_v over the vocabulary (the last dimension)."
        expect_close(got, wanted, where, hint, atol=1e-5, rtol=0, mistakes=wrong)
    passed("token_entropy")


MASK = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
EMPTY_HINT = "a row with an empty mask gives 0, not 0 / 0 = NaN: divide by the count clamped to 1."


def check_masked_mean(fn: Callable) -> None:
    """`masked_mean(x, mask, dim)` against the reference, an empty row included: 1e-12."""
    x = randn(3, 5, seed=1)
    for dim in (None, 0, 1):
        where = f"masked_mean(x (3, 5), mask, dim={dim})"
        hint = "sum x where the mask is on, divided by how many entries are on."
        wanted = logprobs.masked_mean(x, MASK, dim)
        got = call(where, fn, x, MASK, dim)
        if dim == 1 and isinstance(got, torch.Tensor):
            expect(not got.isnan().any(), where, "the result contains NaN.", EMPTY_HINT)
        expect_close(got, wanted, where, hint, atol=1e-12, rtol=0)
    passed("masked_mean")


def check_masked_normalize(fn: Callable) -> None:
    """`masked_normalize(x, mask, dim, normalize_constant)` against the reference: 1e-12."""
    x = randn(3, 5, seed=2)
    for dim, constant in ((None, 1.0), (0, 2.5), (1, 4.0)):
        where = f"masked_normalize(x (3, 5), mask, dim={dim}, normalize_constant={constant})"
        got = call(where, fn, x, MASK, dim, normalize_constant=constant)
        wanted = logprobs.masked_normalize(x, MASK, dim, constant)
        wrong = {
            "divide by normalize_constant, not by the number of entries that are on (that is "
            "masked_mean).": logprobs.masked_mean(x, MASK, dim),
            "sum only the entries where the mask is on.": x.sum(dim=dim) / constant,
        }
        if constant != 1.0:
            wrong["divide by normalize_constant, not multiply."] = wanted * constant**2
        hint = "the sum of x where the mask is on, divided by normalize_constant."
        expect_close(got, wanted, where, hint, atol=1e-12, rtol=0, mistakes=wrong)
    passed("masked_normalize")


SFT_PROMPTS = ["What is 2 + 5?", "What is 12 + 30?", "hi", "What is 9 + 9?"]
SFT_RESPONSES = ["the answer is 7", "the answer is 42", "the answer is 1234567", "18"]
ACCUMULATE_HINT = "divide by n_response_tokens (the count of the whole batch the step sees), "
ACCUMULATE_HINT += "not by this part's own count: then the parts' gradients add up to the whole's."


def _sft_model() -> Llama:
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = Llama(LlamaConfig(16, 2, 4, 2, 6, 24, _chat_tokenizer().vocab_size, 32))
    return model.double()


def check_sft_loss(fn: Callable) -> None:
    """`sft_loss(model, batch, n_response_tokens)` against the reference, whole and in micro
    batches whose gradients accumulate to the whole batch's: 1e-6 relative (the log-probs are
    float32 by contract)."""
    batch = chat.tokenize_chat(SFT_PROMPTS, SFT_RESPONSES, _chat_tokenizer())
    n = int(batch["response_mask"].sum())
    model = _sft_model()
    with torch.no_grad():
        log_probs = logprobs.response_log_probs(model, batch["input_ids"], batch["labels"])
    for rows in (slice(0, 4), slice(0, 1), slice(1, 4)):
        part = {key: value[rows] for key, value in batch.items()}
        label = "the whole batch" if rows == slice(0, 4) else f"rows {rows.start}:{rows.stop}"
        where = f"sft_loss(model, {label} of 4 conversations, n_response_tokens={n})"
        model.zero_grad(set_to_none=True)
        got = call(where, fn, model, part, n)
        with torch.no_grad():
            wanted = fine_tuning.sft_loss(model, part, n)
        mask = part["response_mask"]
        mine = log_probs[rows]
        wrong = {
            "log-probs summed over the prompt too: only the response tokens (response_mask) "
            "are learned.": -mine.sum() / n,
            "the loss is the negative log-likelihood: minus the summed log-probs.": mine[mask].sum()
            / n,
        }
        if int(mask.sum()) != n:
            wrong[ACCUMULATE_HINT] = -mine[mask].sum() / int(mask.sum())
        hint = "minus the response tokens' log-probs, summed, divided by n_response_tokens."
        expect_close(got, wanted, where, hint, atol=1e-9, rtol=1e-6, mistakes=wrong)
        expect(isinstance(got, Tensor) and got.requires_grad, where, "it has no gradient.", hint)
    model.zero_grad(set_to_none=True)
    fine_tuning.sft_loss(model, batch, n).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        call("sft_loss", fn, model, {k: v[rows] for k, v in batch.items()}, n).backward()
    where = "sft_loss on micro batches of 1, 2 and 1 rows, backward on each: the gradients"
    for got, wanted in zip((p.grad for p in model.parameters()), whole):
        expect_close(got, wanted, where, ACCUMULATE_HINT, atol=1e-9, rtol=1e-6)
    passed("sft_loss")


LORA_NAMES = "lora_A (rank, in_features) and lora_B (out_features, rank)"
B_ZERO = "B initialised non-zero: the model changes before training. A starts random and B at "
B_ZERO += "zero, so the update B A is zero until B learns."
NO_RANK = "scaled by alpha without /rank: the update is (alpha / rank) * B A."


def check_lora_linear(cls: type) -> None:
    """`LoRALinear(base, rank, alpha)`: frozen base, trainable `lora_A` and `lora_B`, the model
    unchanged at first; with random A and B the forward, its gradients and `merged()` against
    the formula: 1e-10 in float64."""
    for d_in, d_out, rank, alpha, bias in ((6, 5, 2, 6.0, True), (4, 7, 4, 16.0, False)):
        with torch.random.fork_rng():
            torch.manual_seed(rank)
            base = nn.Linear(d_in, d_out, bias=bias).double()
        x = randn(2, 3, d_in, seed=rank)
        name = f"LoRALinear(nn.Linear({d_in}, {d_out}, bias={bias}), rank={rank}, alpha={alpha})"
        lora = call(name, cls, base, rank, alpha)
        params = dict(lora.named_parameters()) if isinstance(lora, nn.Module) else {}
        shapes = {"lora_A": (rank, d_in), "lora_B": (d_out, rank)}
        found = {key: tuple(p.shape) for key, p in params.items()}
        for key, shape in shapes.items():
            problem = f"expected a parameter `{key}` of shape {shape}; found {found}."
            expect(found.get(key) == shape, name, problem, f"make {LORA_NAMES} in __init__.")
        trainable = sorted(key for key, p in params.items() if p.requires_grad)
        problem = f"expected only lora_A and lora_B to train, got {trainable}."
        hint = "freeze the base layer (requires_grad_(False)): LoRA trains only A and B."
        expect(trainable == ["lora_A", "lora_B"], name, problem, hint)
        A, B = lora.lora_A, lora.lora_B
        problem = "lora_A is all zeros: with A and B both zero, neither ever gets a gradient."
        expect(bool(A.detach().abs().sum() > 0), name, problem, "draw A at random, as PEFT does.")
        with torch.no_grad():
            first = call(f"{name}.forward", lora, x)
            expect_close(first, base(x), f"{name}, before training", B_ZERO, atol=1e-10, rtol=0)
            A.copy_(randn(rank, d_in, seed=10)), B.copy_(randn(d_out, rank, seed=11))
        got = call(f"{name}.forward", lora, x)
        update = x @ A.detach().T @ B.detach().T
        wanted = base(x).detach() + alpha / rank * update
        wrong = {NO_RANK: wanted + (alpha - alpha / rank) * update}
        if alpha / rank != 1:
            wrong["scale the update by alpha / rank."] = base(x).detach() + update
        where = f"{name} with random lora_A and lora_B"
        hint = "base(x) + (alpha / rank) * x A^T B^T."
        expect_close(got, wanted, where, hint, atol=1e-10, rtol=0, mistakes=wrong)
        got.square().sum().backward()
        ref_A, ref_B = A.detach().clone().requires_grad_(), B.detach().clone().requires_grad_()
        (base(x).detach() + alpha / rank * x @ ref_A.T @ ref_B.T).square().sum().backward()
        for key, param, ref in (("lora_A", A, ref_A), ("lora_B", B, ref_B)):
            hint = "compute the update from self.lora_A and self.lora_B themselves."
            expect_close(param.grad, ref.grad, f"{where}: {key}.grad", hint, atol=1e-9, rtol=0)
        merged = call(f"{name}.merged", lora.merged, hint="merged() reads self.scaling.")
        with torch.no_grad():
            hint = "set self.scaling = alpha / rank: merged() (given) folds it into the weight."
            expect_close(merged(x), wanted, f"{name}.merged()", hint, atol=1e-10, rtol=0)
    passed("LoRALinear")


NO_REFERENCE = "the reference model's log-probs are missing: the reward is beta * (policy - "
NO_REFERENCE += "reference)."
BETA_OUTSIDE = "beta on the wrong side: it multiplies the margin inside the sigmoid, not the loss."
DPO_MISTAKES = {
    NO_REFERENCE: lambda pc, pr, rc, rr, beta: -F.logsigmoid(beta * (pc - pr)).mean(),
    BETA_OUTSIDE: lambda pc, pr, rc, rr, beta: -beta * F.logsigmoid((pc - rc) - (pr - rr)).mean(),
}


def check_dpo_loss(fn: Callable) -> None:
    """`dpo_loss(pc, pr, rc, rr, beta)` against the paper's formula: 1e-10 in float64."""
    pc, pr, rc, rr = (-10 * randn(6, seed=s).abs() for s in range(4))
    for beta in (0.1, 2.0):
        where = f"dpo_loss(4 tensors (6,), beta={beta})"
        wrong = {h: f(pc, pr, rc, rr, beta) for h, f in DPO_MISTAKES.items()}
        hint = "-log sigmoid(beta * ((pc - rc) - (pr - rr))), averaged over the pairs."
        got = call(where, fn, pc, pr, rc, rr, beta)
        wanted = dpo.dpo_loss(pc, pr, rc, rr, beta)
        expect_close(got, wanted, where, hint, atol=1e-10, rtol=0, mistakes=wrong)
    passed("dpo_loss")


REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 2.0], dtype=torch.float64)


def _batch_normalized(rewards, group_size, *, eps=1e-6, normalize_by_std=True):
    advantages = rewards - rewards.mean()
    return (advantages / (rewards.std() + eps) if normalize_by_std else advantages), rewards


def check_group_normalized_rewards(fn: Callable) -> None:
    """`group_normalized_rewards` with and without the std, against the reference: 1e-12."""
    for by_std in (True, False):
        where = f"group_normalized_rewards(8 rewards, 4, normalize_by_std={by_std})"
        got = call(where, fn, REWARDS, 4, eps=1e-6, normalize_by_std=by_std)
        expect(isinstance(got, tuple) and len(got) == 2, where, "expected (advantages, raw).")
        wanted = policy_gradient.group_normalized_rewards(REWARDS, 4, normalize_by_std=by_std)
        batch = _batch_normalized(REWARDS, 4, normalize_by_std=by_std)[0]
        wrong = {
            "normalised over the whole batch: each group of group_size rollouts has its "
            "own mean and std (view(-1, group_size)).": batch
        }
        hint = "per group: (r - mean) / (std + eps), std unbiased as torch.std."
        expect_close(got[0], wanted[0], where, hint, atol=1e-12, rtol=0, mistakes=wrong)
    passed("group_normalized_rewards")


def check_policy_gradient_loss(fn: Callable) -> None:
    """The three kinds against the reference, and GRPO's gradient (the ratio must carry it,
    the clipped surrogate take the min): 1e-12 in float64."""
    logp = -randn(4, 5, seed=5).abs()
    old = logp + 0.4 * randn(4, 5, seed=6)
    adv = randn(4, 1, seed=7)
    for kind, kwargs in (
        ("no_baseline", dict(rewards=adv)),
        ("reinforce_with_baseline", dict(advantages=adv)),
        ("grpo_clip", dict(advantages=adv, old_log_probs=old, clip_range=0.2)),
    ):
        where = f"policy_gradient_loss(log_probs (4, 5), kind={kind!r})"
        lp, ref = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        got = call(where, fn, lp, kind=kind, **kwargs)
        wanted = policy_gradient.policy_gradient_loss(ref, kind=kind, **kwargs)
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(0.8, 1.2)
        wrong = {
            "max instead of min: the surrogate is -min(ratio A, clip(ratio) A).": -torch.maximum(
                ratio * adv, clipped * adv
            )
        }
        hint = "per token, minus the advantage (or reward) times the log-prob (or the ratio)."
        expect_close(
            got,
            wanted.detach(),
            where,
            hint,
            atol=1e-12,
            rtol=0,
            mistakes=wrong if kind == "grpo_clip" else None,
        )
        expect(
            got.requires_grad,
            where,
            "the loss has no gradient.",
            "the ratio exp(log_probs - old_log_probs) must keep log_probs' gradient.",
        )
        got.sum().backward(), wanted.sum().backward()
        expect_close(
            lp.grad,
            ref.grad,
            f"{where}, the gradient",
            "detach old_log_probs only, never log_probs.",
            atol=1e-12,
            rtol=0,
        )
    passed("policy_gradient_loss")
