"""Where a GRPO step's time goes, and what chapter 7's KV cache saves when sampling rollouts.

Two measurements in one run, on a small untrained Llama (the times depend on sizes, not on
weights) and the chapter 9 task's prompts:

- rollout tokens per second sampled with the KV cache (`fine_tuning.complete`, one new token
  per forward) against without (chapter 6's `generate`, the whole sequence per forward), timed
  in alternating rounds so machine load affects both alike; the ratio is printed;
- one GRPO step (`grpo.grpo_train`, one step) split into sampling, scoring and the update.

    python benchmarks/grpo.py

The rollouts are `--rollouts // --group-size` prompts, `--group-size` responses each; larger
models and longer responses (`--d-model`, `--n-layers`, `--new-tokens`) make the cache's gain
larger.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformer_course.assistant_task import pretraining_text, task_splits
from transformer_course.chat import chat_prompt
from transformer_course.fine_tuning import complete, task_tokenizer
from transformer_course.gpt2 import generate
from transformer_course.grpo import grpo_train
from transformer_course.llama import Llama, LlamaConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    if not 1 <= args.group_size <= args.rollouts:
        parser.error(
            f"--group-size: expected between 1 and --rollouts={args.rollouts}, "
            f"got {args.group_size}"
        )
    torch.manual_seed(0)
    splits = task_splits(0)
    tokenizer = task_tokenizer(pretraining_text(splits["train"] + splits["harder"]), 290)
    cfg = LlamaConfig(
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=4,
        d_vocab=tokenizer.vocab_size,
        n_ctx=args.new_tokens + 32,
    )
    model = Llama(cfg).eval()
    prompt = splits["train"][0].prompt  # one prompt length: both sample one batch
    ids = torch.tensor([tokenizer.encode(chat_prompt(prompt))] * args.rollouts)
    cached, uncached = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        responses = complete(
            model,
            tokenizer,
            [prompt] * args.rollouts,
            max_new_tokens=args.new_tokens,
            temperature=1.0,
        )
        steps = max(map(len, responses))  # sampling stops when every row has ended
        cached.append(args.rollouts * steps / (time.perf_counter() - start))
        start = time.perf_counter()
        generate(model, ids, steps, temperature=1.0)
        uncached.append(args.rollouts * steps / (time.perf_counter() - start))
    with_cache, without = statistics.median(cached), statistics.median(uncached)
    print(
        f"rollout tokens/s with the KV cache {with_cache:,.0f}, without {without:,.0f}: "
        f"{with_cache / without:.1f}x"
    )
    step = grpo_train(
        model,
        tokenizer,
        splits["harder_train"],
        steps=1,
        prompts_per_step=args.rollouts // args.group_size,
        group_size=args.group_size,
        inner_steps=2,
        lr=1e-4,
        max_new_tokens=args.new_tokens,
        generator=torch.Generator().manual_seed(0),
    )
    parts = {k.removesuffix("_seconds"): v for k, v in step[0].items() if k.endswith("seconds")}
    total = sum(parts.values())
    print(
        "GRPO step: "
        + ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items())
        + f" of {total:.2f} s"
    )


if __name__ == "__main__":
    main()
