"""Training-step time of the course's GPT-2 against Hugging Face's `GPT2LMHeadModel`.

Both models get the same architecture, batch and optimizer (AdamW, fused on CUDA), and each
step is forward + backward + optimizer step. The two are timed in alternating rounds in the
same process, so machine load affects both alike; the report is the median step time.
On a GPU the step also runs under bf16 autocast (optionally `--compile`), and the report adds
the model FLOPs utilisation (MFU) against the device's peak. FLOPs are counted as nanoGPT does
(`estimate_mfu`, after the PaLM paper's appendix B), per token of a training step:

    6 * N  +  12 * L * H * Q * T

with N the parameters that do matmul work per token: every parameter except the token and
position embedding tables (a lookup costs no FLOPs), but with the unembedding `W_U` (for a tied
model, `W_E` counted once as the unembedding); L layers, H heads of size Q, T positions. The
6 is 2 (multiply-add) x 3 (forward, and backward for inputs and for weights); 12 * L * H * Q * T
is attention's score and value matmuls, which have no parameters.

    python benchmarks/gpt2.py                    # CPU: nanoGPT's baby GPT (4 layers, 128 wide)
    python benchmarks/gpt2.py --size small       # GPT-2 small (124M), block 1024 (for a GPU)
    python benchmarks/gpt2.py --size small --compile --peak-tflops 989   # H100 SXM, dense bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from transformer_course.attention import set_fast_path
from transformer_course.gpt2 import GPT2, lm_loss
from transformer_course.runtime import get_device

SIZES = {
    "baby": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=65, n_positions=64, batch=12),
    "small": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, n_positions=1024, batch=16),
}


def flop_params(model: GPT2) -> int:
    """N in the FLOP count: the non-embedding parameters plus the unembedding."""
    unembedding_in_W_E = model.embed.W_E.numel() if model.cfg.tie_embeddings else 0
    return model.num_params(non_embedding=True) + unembedding_in_W_E


def flops_per_token(model: GPT2, seq_len: int) -> float:
    """Training FLOPs per token, 6 N + 12 L H Q T (see the module docstring)."""
    cfg = model.cfg
    return 6 * flop_params(model) + 12 * cfg.n_layers * cfg.n_heads * cfg.d_head * seq_len


def step_timer(
    model: torch.nn.Module, loss_of: Callable, tokens: torch.Tensor, amp: bool
) -> Callable[[], float]:
    device = tokens.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = loss_of(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def print_profile(name: str, step: Callable[[], float], n: int) -> None:
    """What `n` steps cost on the device: the kernels a step launches, their time, and the
    operators that took the most of it."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n):
            step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time_total for e in kernels) / 1e3 / n
    counts = f": {len(kernels) / n:,.0f} kernels, {busy_ms:.2f} ms of them a step"
    print(f"--- {name}, {n} steps" + (counts if kernels else ""))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="baby")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per model")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="device peak (H100 SXM dense bf16: 989)"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="then profile this many steps of each model"
    )
    args = parser.parse_args()

    device = get_device()
    size = SIZES[args.size]
    amp = device.type == "cuda"
    hf_config = HFGPT2Config(
        n_layer=size["n_layer"],
        n_head=size["n_head"],
        n_embd=size["n_embd"],
        vocab_size=size["vocab_size"],
        n_positions=size["n_positions"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_config).to(device).train()
    ours = set_fast_path(GPT2.from_huggingface(hf)).to(device).train()
    loss = lm_loss
    if args.compile:  # Hugging Face's loss is part of its forward, so ours is compiled too
        hf.compile()
        ours.compile()
        loss = torch.compile(lm_loss)
    tokens = torch.randint(
        0, size["vocab_size"], (size["batch"], size["n_positions"]), device=device
    )

    timers = {
        "ours": step_timer(ours, lambda m, t: loss(m(t)[:, :-1], t[:, 1:]), tokens, amp),
        "huggingface": step_timer(hf, lambda m, t: m(t, labels=t).loss, tokens, amp),
    }
    for timer in timers.values():
        for _ in range(args.warmup):
            timer()
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.steps):  # alternate, so load on a shared machine hits both alike
        for name, timer in timers.items():
            times[name].append(timer())

    per_token = flops_per_token(ours, tokens.shape[1])
    n_tokens = tokens.numel()
    report = {
        "device": str(device),
        "size": args.size,
        "params": ours.num_params(),
        "flop_params": flop_params(ours),
        "flops_per_token": per_token,
        "batch": list(tokens.shape),
        "amp_bf16": amp,
        "compile": args.compile,
    }
    for name, values in times.items():
        median = statistics.median(values)
        entry = {"step_ms": round(1000 * median, 2), "tokens_per_s": round(n_tokens / median)}
        if device.type == "cuda":
            entry["mfu"] = round(per_token * n_tokens / median / (args.peak_tflops * 1e12), 4)
        report[name] = entry
    report["ratio_ours_over_hf"] = round(
        report["ours"]["step_ms"] / report["huggingface"]["step_ms"], 3
    )
    print(json.dumps(report, indent=1), flush=True)
    for name, timer in timers.items():  # after the report: it stands even if this is cut short
        if args.profile_steps:
            print_profile(name, timer, args.profile_steps)


if __name__ == "__main__":
    main()
