"""Train GPT-2 on Tiny Shakespeare from the command line (one process, or many under torchrun).

Profiles reproduce nanoGPT's shakespeare_char runs:

    python scripts/train_gpt2.py --profile baby   # CPU "baby GPT": 4 layers, 4 heads, 128 wide,
                                                  # n_ctx 64, batch 12, 2000 steps; val loss ~1.88
    python scripts/train_gpt2.py --profile full   # GPU: 6/6/384, n_ctx 256, batch 64, dropout 0.3,
                                                  # 2000 steps (nanoGPT: 5000); val loss ~1.47

Training keeps the model with the lowest validation loss (nanoGPT saves a checkpoint only when
validation improves): the script reports it with its step, samples from it and, with
`--checkpoint-dir`, saves it as `best.pt` beside the last state (`checkpoint.pt`, for resuming).
With nanoGPT's dropout of 0.2 the model overfits early: validation is lowest near step 1250
(1.48 on an H100, with a 2000- or a 5000-step schedule), then rises. So the full profile's cosine
schedule is fitted to 2000 steps, validation is measured every 125 steps, and dropout is 0.3,
which of 0.2, 0.25, 0.3 and 0.35 gave the lowest validation loss (1.466-1.469; 0.2 gave 1.481).

Any setting can be overridden (`--max-steps 200 --n-layers 2`), `--tokenizer bpe` trains the
chapter-1 byte-level BPE tokenizer instead of using characters, and `--text-file` trains on
another text. Several processes share one global batch of `--batch-size` sequences:

    torchrun --standalone --nproc_per_node=2 scripts/train_gpt2.py --profile baby

Each rank draws the same global batch for a step and keeps its own slice, so the run computes
the same updates as one process with the whole batch (DistributedDataParallel averages the
gradients). Only rank 0 prints and writes files. `--parallel` trains with chapter 8's own
wrappers instead of PyTorch's, and reports the bytes each rank handed to the collectives per
training step, against the formula (`step_cost.collective_bytes_per_step`):

    torchrun --standalone --nproc_per_node=2 scripts/train_gpt2.py --parallel ddp
    torchrun --standalone --nproc_per_node=2 scripts/train_gpt2.py --parallel fsdp

`ddp` is `data_parallel.DataParallel` (25 MiB buckets), `fsdp` is
`sharded.FullyShardedDataParallel` (each rank keeps a slice of the weights, gradients and AdamW
state; no checkpoints then, and the sample comes from the last weights, gathered), `none` one
process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from transformer_course.attention import set_fast_path
from transformer_course.data_parallel import DataParallel
from transformer_course.gpt2 import GPT2, GPT2Config, generate, lm_loss
from transformer_course.ranks import CollectiveBytes
from transformer_course.runtime import get_device, seed_everything
from transformer_course.sharded import FullyShardedDataParallel
from transformer_course.step_cost import collective_bytes_per_step
from transformer_course.tokenization import GPT2_SPLIT_PATTERN, BPETokenizer, CharTokenizer
from transformer_course.training import (
    History,
    TrainConfig,
    atomic_write,
    compiled_blocks,
    estimate_loss,
    sample_batch,
    train,
)

# nanoGPT's config/train_shakespeare_char.py; "baby" is the CPU variant from its README.
# fmt: off
PROFILES = {
    "baby": dict(
        n_layers=4, n_heads=4, d_model=128, n_ctx=64, batch_size=12, max_steps=2000, lr=1e-3,
        min_lr=1e-4, warmup_steps=100, dropout=0.0, eval_every=250, eval_batches=200,
    ),
    "full": dict(
        n_layers=6, n_heads=6, d_model=384, n_ctx=256, batch_size=64, max_steps=2000, lr=1e-3,
        min_lr=1e-4, warmup_steps=100, dropout=0.3, eval_every=125, eval_batches=200,
    ),
}
# fmt: on
COMMON = dict(weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0, seed=1337, bpe_vocab=512)
AT_LEAST_ONE = ("n_layers", "n_heads", "d_model", "n_ctx", "batch_size", "eval_batches")
LOSSES = ("train_loss", "val_loss")
PARALLEL = {  # --parallel: chapter 8's wrapper of the model
    "none": None,
    "ddp": lambda model: DataParallel(model, bucket_size_mb=25),
    "fsdp": FullyShardedDataParallel,
}
Tokenizer = CharTokenizer | BPETokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="baby")
    parser.add_argument("--tokenizer", choices=("char", "bpe"), default="char")
    parser.add_argument(
        "--text-file", type=Path, help="train on this text instead of Tiny Shakespeare"
    )
    parser.add_argument(
        "--out", type=Path, help="write results.json (config, history, final losses) here"
    )
    parser.add_argument(
        "--checkpoint-dir", type=Path, help="save (and resume from) checkpoints here"
    )
    parser.add_argument("--device", help="cpu, cuda, mps (default: the best available)")
    parser.add_argument(
        "--compile", action="store_true", help="train with the blocks and the loss compiled"
    )
    parser.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    parser.add_argument("--tie-embeddings", action="store_true", help="W_U = W_E transposed")
    parser.add_argument(
        "--parallel",
        choices=sorted(PARALLEL),
        help="chapter 8's data parallelism (default under torchrun: PyTorch's DDP)",
    )
    parser.add_argument(
        "--sample-tokens", type=int, default=300, help="tokens to sample at the end"
    )
    for name, value in {**PROFILES["baby"], **COMMON}.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None)
    parser.add_argument("--block-size", dest="n_ctx", type=int, help="nanoGPT's name for --n-ctx")
    args = parser.parse_args(argv)
    for name, value in {**PROFILES[args.profile], **COMMON}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("max_steps", "warmup_steps", "eval_every", "sample_tokens", *AT_LEAST_ONE):
        low = 1 if name in AT_LEAST_ONE else 0
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag}: expected an int >= {low}, got {getattr(args, name)}")
    if args.bpe_vocab < 256:
        parser.error(f"--bpe-vocab: expected at least the 256 byte tokens, got {args.bpe_vocab}")
    if args.parallel == "fsdp" and args.checkpoint_dir is not None:
        parser.error("--checkpoint-dir: not with --parallel fsdp (each rank holds a slice)")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out: expected a directory, got the file {args.out}")
    try:  # the whole configuration, before any data is read or any tokenizer trained
        model_config(args, d_vocab=1)
        train_config(args, progress=False)
    except ValueError as error:
        parser.error(str(error))
    return args


def model_config(args: argparse.Namespace, d_vocab: int) -> GPT2Config:
    return GPT2Config(
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        d_vocab=d_vocab,
        n_ctx=args.n_ctx,
        dropout=args.dropout,
        tie_embeddings=args.tie_embeddings,
    )


def train_config(args: argparse.Namespace, progress: bool) -> TrainConfig:
    return TrainConfig(
        max_steps=args.max_steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        lr_schedule="cosine",
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        betas=(args.beta1, args.beta2),
        grad_clip=args.grad_clip,
        eval_every=args.eval_every,
        log_every=args.eval_every,
        checkpoint_dir=args.checkpoint_dir,
        amp=not args.no_amp,
        seed=args.seed,
        progress=progress,
        best_metric="val_loss",
    )


def setup_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """Join the process group when launched by torchrun; returns (rank, world size, device)."""
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def load_data(args: argparse.Namespace) -> tuple[str, Tokenizer, torch.Tensor, torch.Tensor]:
    """The text, its tokenizer, and the token ids of its first 90% (training) and the rest
    (validation), as nanoGPT splits it."""
    if args.text_file is not None:
        text = args.text_file.read_text(encoding="utf-8")
    else:
        from transformer_course.data import load_text

        text = load_text("tinyshakespeare")
    split = int(0.9 * len(text))
    if args.tokenizer == "char":
        tokenizer = CharTokenizer(text)
    else:
        tokenizer = BPETokenizer.train(text[:split], args.bpe_vocab, pattern=GPT2_SPLIT_PATTERN)
    train_data = torch.tensor(tokenizer.encode(text[:split]), dtype=torch.long)
    val_data = torch.tensor(tokenizer.encode(text[split:]), dtype=torch.long)
    return text, tokenizer, train_data, val_data


def report(
    args: argparse.Namespace,
    result: dict,
    history: History,
    model: GPT2,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
) -> None:
    """Print the last and the best evaluation, sample from the best model, write results.json."""
    for name, record in (("last", result["final"]), ("best", result["best"])):
        losses = ", ".join(f"{k} {record[k]:.4f}" for k in LOSSES if k in record)
        print(f"{name}: step {record.get('step')}: {losses}", flush=True)
    first = result["first_step_seconds"]
    took = f"training took {result['train_seconds']:.0f} s"
    if first is not None:
        compiling = " (compiling)" if args.compile else ""
        rest = result["train_seconds"] - first
        took += f": the first step {first:.0f} s{compiling}, then {rest:.0f} s"
    print(took, flush=True)
    if result["bytes_per_step"]:
        for what, sizes in result["bytes_per_step"].items():
            listed = ", ".join(f"{name} {size / 2**20:.2f} MiB" for name, size in sizes.items())
            print(f"bytes per rank and step, {what}: {listed}", flush=True)
    if history.best_state is not None:
        model.load_state_dict(history.best_state)  # the last weights stay in checkpoint.pt
    if args.sample_tokens:
        prompt = torch.tensor([prompt_ids], device=next(model.parameters()).device)
        sample = generate(model, prompt, args.sample_tokens, temperature=0.8, top_k=200)
        best = history.best
        source = f"the best model (step {best['step']})" if best else "the last model"
        print(f"sample from {source}:\n" + tokenizer.decode(sample[0].tolist()), flush=True)
    if args.out is not None:
        atomic_write(args.out / "results.json", json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device) if args.device else get_device()
    rank, world, device = setup_distributed(device)
    if args.parallel == "none" and world > 1:
        raise ValueError(f"--parallel none: expected one process, got {world}; use ddp or fsdp")
    if args.parallel in ("ddp", "fsdp") and world == 1:
        raise ValueError(
            f"--parallel {args.parallel}: expected several processes, got 1; launch with "
            "torchrun --standalone --nproc_per_node=2"
        )
    if args.batch_size % world:
        raise ValueError(
            f"--batch-size: expected a multiple of the {world} processes, got {args.batch_size}"
        )
    seed_everything(args.seed)
    text, tokenizer, train_data, val_data = load_data(args)

    cfg = model_config(args, d_vocab=tokenizer.vocab_size)
    model = set_fast_path(GPT2(cfg).to(device))
    # --compile: the blocks share one compiled graph (see compiled_blocks), and the loss is
    # compiled so that the float32 logits are never materialised
    loss = torch.compile(lm_loss) if args.compile else lm_loss
    train_cfg = train_config(args, progress=rank == 0)
    if args.parallel == "fsdp":  # the best weights would be one rank's slices
        train_cfg = replace(train_cfg, best_metric=None)
    sent = CollectiveBytes()
    per_rank = args.batch_size // world

    fetched: list[float] = []  # when the first two batches were asked for

    def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's global batch, drawn identically on every rank; this rank keeps its slice."""
        if len(fetched) < 2:
            fetched.append(time.perf_counter())
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        x, y = sample_batch(train_data, args.batch_size, args.n_ctx, generator=generator)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return x[rows].to(device), y[rows].to(device)

    def loss_fn(wrapped: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return loss(wrapped(x), y)

    def evaluate(_: torch.nn.Module) -> dict[str, float]:
        generator = torch.Generator().manual_seed(args.seed)
        sizes = dict(batch_size=args.batch_size, n_ctx=args.n_ctx, n_batches=args.eval_batches)
        with sent.paused():  # count the training steps' communication only
            return {
                "train_loss": estimate_loss(model, train_data, generator=generator, **sizes),
                "val_loss": estimate_loss(model, val_data, generator=generator, **sizes),
            }

    if rank == 0:
        print(
            f"{args.profile} profile on {device} x{world}: {model.num_params():,} parameters, "
            f"vocab {cfg.d_vocab} ({args.tokenizer}), {len(train_data):,} train / "
            f"{len(val_data):,} val tokens",
            flush=True,
        )
    started = time.perf_counter()
    wrapped = []

    def parallel(module: torch.nn.Module) -> torch.nn.Module:
        wrapped.append(PARALLEL[args.parallel](module))
        return wrapped[-1]

    with sent, compiled_blocks(model.blocks) if args.compile else nullcontext():
        history = train(
            model,
            train_cfg,
            get_batch,
            loss_fn,
            evaluate=evaluate,
            parallel=parallel if PARALLEL.get(args.parallel) else None,
        )
    wall = time.perf_counter() - started
    if args.parallel == "fsdp":  # every rank gathers; rank 0 samples from the whole model
        state = wrapped[0].gather_full_params()
        model = GPT2(cfg).to(device)
        model.load_state_dict(state)
    communication = None
    if args.parallel in ("ddp", "fsdp"):
        expected = collective_bytes_per_step(cfg, args.parallel, world_size=world)
        communication = {
            "measured": {k: v // args.max_steps for k, v in sorted(sent.bytes.items())},
            "formula": expected,
        }

    result = {
        "command": "python scripts/train_gpt2.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "profile": args.profile,
        "world_size": world,
        "device": str(device),
        "model": asdict(cfg),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "final": history.evals[-1] if history.evals else {},
        "best": history.best,
        "train_seconds": round(wall, 1),
        # the first step's time (with --compile, mostly compiling), and the rest's
        "first_step_seconds": round(fetched[1] - fetched[0], 1) if len(fetched) == 2 else None,
        "bytes_per_step": communication,
        "history": history.to_dict(),
    }
    if rank == 0:
        # Start as a speech does, after a newline (or, with none in the text, its first token).
        prompt_ids = tokenizer.encode("\n") if "\n" in text else train_data[:1].tolist()
        report(args, result, history, model, tokenizer, prompt_ids)
    if world > 1:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
