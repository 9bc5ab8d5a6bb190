"""Chapter 5's training step on the device: steps per second, and how busy the GPU is.

For each batch size the full profile's model trains for `--steps` timed steps (after a warm-up)
with the course's loop, then `--profile-steps` more under `torch.profiler`, which gives the
share of the wall time the GPU spent running kernels ("busy"), the kernels each step launches
and the operators that cost the most host and device time. `--compile` then times the same
model with its blocks compiled, as the full profile trains (`training.compiled_blocks`),
and prints its speed against eager's; its warm-up includes the compilation.

    python benchmarks/translation.py                          # the full profile's setup
    python benchmarks/translation.py --batch-sizes 256 1024 --compile

`curve` trains one setup, the profile's with any of `--batch-size`, `--lr`, `--warmup` and
`--dropout` changed, and prints validation BLEU (greedy, all references) against training time,
to choose how long the full profile trains:

    python benchmarks/translation.py curve --batch-size 512 --lr 1e-3 --warmup 800 --max-steps 3000

`--profile quick --max-words 3` with a few steps (`--steps 1 --warmup 1`, or `curve --max-steps
1`) runs either in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
from torch.nn.attention import sdpa_kernel

from transformer_course.attention import set_fast_path
from transformer_course.encoder_decoder import EncoderDecoderTransformer
from transformer_course.runtime import get_device
from transformer_course.tokenization import BPETokenizer
from transformer_course.training import TrainConfig, compiled_blocks, train
from transformer_course.translation import (
    ATTENTION_BACKENDS,
    SETUPS,
    LengthBatches,
    TranslationSetup,
    corpus_bleu,
    load_splits,
    model_config,
    run_dir,
    seq2seq_loss,
    train_tokenizer,
    translate_test,
)


def tokenizer_for(setup) -> BPETokenizer:
    path = run_dir(setup) / "tokenizer.json"
    if path.exists():
        return BPETokenizer.load(path)
    tokenizer = train_tokenizer(load_splits(setup.max_words)["train"], setup.vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    return tokenizer


def build(setup, tokenizer, device):
    torch.manual_seed(0)
    return set_fast_path(EncoderDecoderTransformer(model_config(setup, tokenizer)).to(device))


def blocks_of(model: EncoderDecoderTransformer) -> list[torch.nn.Module]:
    return [*model.encoder, *model.decoder]


def steps(model, batches, setup, n, *, evaluate=None, eval_every=0):
    """`n` steps of the course's loop with the setup's schedule (inverse square root: a curve
    point at step k is what a run stopped at step k gives)."""
    cfg = TrainConfig(
        max_steps=n,
        lr=setup.lr,
        warmup_steps=setup.warmup_steps,
        lr_schedule="inverse_sqrt",
        betas=(0.9, 0.98),
        grad_clip=1.0,
        log_every=eval_every or n,
        eval_every=eval_every,
        progress=evaluate is not None,
    )

    def loss(m, batch):
        return seq2seq_loss(m, batch, smoothing=setup.label_smoothing, pad_id=batches.pad)

    with sdpa_kernel(ATTENTION_BACKENDS):
        return train(model, cfg, batches, loss, evaluate=evaluate)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile_setup(args) -> TranslationSetup:
    """The profile's setup, with `--max-words` when given."""
    setup = SETUPS[args.profile]
    return setup if args.max_words is None else replace(setup, max_words=args.max_words)


def speed(args) -> None:
    device = get_device()
    base = profile_setup(args)
    tokenizer = tokenizer_for(base)
    pairs = load_splits(base.max_words)["train"]
    print(f"device {device}; {len(pairs)} training pairs; setup {base}", flush=True)
    for batch_size in args.batch_sizes:
        setup = replace(base, batch_size=batch_size)
        batches = LengthBatches(
            tokenizer, pairs, batch_size, device=device, buckets=setup.length_buckets
        )
        rates = {}
        for mode in ("eager", "compiled") if args.compile else ("eager",):
            model = build(setup, tokenizer, device)
            compiling = compiled_blocks(blocks_of(model)) if mode == "compiled" else nullcontext()
            with compiling:
                rates[mode] = time_steps(args, model, batches, setup, mode)
        if args.compile:
            print(f"  compiled: {rates['compiled'] / rates['eager']:.2f}x eager's steps/s")


def time_steps(args, model, batches, setup, mode) -> float:
    """Warm up, time and profile `model`'s steps; returns its steps per second."""
    device = next(model.parameters()).device
    started = time.perf_counter()
    steps(model, batches, setup, args.warmup)
    sync(device)
    warm = time.perf_counter() - started
    started = time.perf_counter()
    history = steps(model, batches, setup, args.steps)
    sync(device)
    rate = args.steps / (time.perf_counter() - started)
    tokens = sum(int((batches(s)[2] != batches.pad).sum()) for s in range(args.steps))
    print(
        f"batch {setup.batch_size:5d} {mode}: warm-up {warm:.0f}s, {rate:.2f} steps/s, "
        f"{tokens * rate / args.steps:,.0f} target tokens/s, "
        f"last loss {history.train_loss[-1]:.3f}, "
        f"{batches.distinct_shapes()} shapes/epoch of {len(batches)} batches",
        flush=True,
    )
    if device.type != "cuda" or not args.profile_steps:
        return rate
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        steps(model, batches, setup, args.profile_steps)
        sync(device)
        wall = time.perf_counter() - started
    table = prof.key_averages()
    on_cpu = [e for e in table if e.device_type == torch.autograd.DeviceType.CPU]
    busy = sum(e.self_device_time_total for e in on_cpu) / 1e6 / wall
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    print(
        f"  profiled {args.profile_steps} steps: wall {wall:.2f}s, GPU busy {busy:.0%}, "
        f"{kernels / args.profile_steps:,.0f} kernels a step"
    )
    print(table.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    print(table.table(sort_by="self_device_time_total", row_limit=12), flush=True)
    return rate


def curve(args) -> None:
    device = get_device()
    options = dict(batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup)
    options["dropout"] = args.dropout
    changed = {name: value for name, value in options.items() if value is not None}
    setup = replace(profile_setup(args), **changed)
    tokenizer = tokenizer_for(setup)
    splits = load_splits(setup.max_words)
    batches = LengthBatches(
        tokenizer, splits["train"], setup.batch_size, device=device, buckets=setup.length_buckets
    )
    valid = splits["valid"][: args.valid_pairs]
    model = build(setup, tokenizer, device)
    print(f"curve {setup}", flush=True)
    started, evaluating_s = time.perf_counter(), 0.0

    @torch.compiler.set_stance("force_eager")  # decoding's shapes would each compile anew
    def evaluate(model) -> dict[str, float]:
        """Greedy BLEU on the validation pairs; its time is not counted as training."""
        nonlocal evaluating_s
        sync(device)
        begun = time.perf_counter()
        _, hypotheses, references = translate_test(model, tokenizer, valid)
        bleu = corpus_bleu(hypotheses, references).score
        training_s = begun - started - evaluating_s
        evaluating_s += time.perf_counter() - begun
        print(f"train {training_s:6.0f}s | valid BLEU {bleu:.1f}", flush=True)
        return {"valid_bleu": bleu}

    with compiled_blocks(blocks_of(model)) if args.compile else nullcontext():
        steps(model, batches, setup, args.max_steps, evaluate=evaluate, eval_every=args.eval_every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode")
    parser.add_argument("--profile", choices=sorted(SETUPS), default="full")
    parser.add_argument(
        "--max-words", type=int, help="override the profile's longest sentence, in words"
    )
    parser.add_argument(
        "--compile", action="store_true", help="also time (curve: train) with compiled blocks"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[256])
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--profile-steps", type=int, default=20)
    c = sub.add_parser("curve")
    profiles = "default: the profile's"
    c.add_argument("--batch-size", type=int, help=f"sentence pairs per step ({profiles})")
    c.add_argument("--lr", type=float, help=f"peak learning rate ({profiles})")
    c.add_argument("--warmup", type=int, help=f"learning-rate warm-up steps ({profiles})")
    c.add_argument("--dropout", type=float, help=f"({profiles})")
    c.add_argument("--max-steps", type=int, default=3000)
    c.add_argument("--eval-every", type=int, default=500)
    c.add_argument("--valid-pairs", type=int, default=1200)
    args = parser.parse_args()
    if args.max_words is not None and args.max_words < 1:
        parser.error(f"--max-words: expected an int >= 1, got {args.max_words}")
    if os.environ.get("TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["TORCH_THREADS"]))
    (curve if args.mode == "curve" else speed)(args)


if __name__ == "__main__":
    main()
