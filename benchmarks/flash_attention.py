"""FlashAttention-2 in Triton against PyTorch's flash kernel (CUDA); the PyTorch tiles against
plain attention (CPU).

On CUDA: `flash_attention_triton` against `F.scaled_dot_product_attention` held to SDPA's flash
backend (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`: FlashAttention-2's own CUDA kernels), in
bfloat16, causal, by default batch 4 x 16 heads x 4096 positions x d 64. It prints the median
time of a forward and of a forward+backward, the peak memory of a forward+backward above the
inputs, the ratio triton / sdpa_flash, and how far apart the two outputs are.

On the CPU there is no Triton kernel to time (Triton's interpreter is for tests, not speed):
the course's `flash_attention` (the tiles as a Python loop) against plain attention
(`attention.scaled_dot_product_attention` with `causal_mask`), float32, causal, by default
batch 1 x 4 heads x 2048 positions x d 64. It prints the bytes autograd saves for the backward
(`step_cost.SavedTensorBytes`: plain attention keeps the n x n pattern, the tiles keep q, k, v,
the output and one log-sum-exp per query) and the median time of a forward+backward. Timings
are medians of `--repeats` rounds, the two implementations interleaved within each round.

    python benchmarks/flash_attention.py               # on a GPU: Triton against SDPA's flash
    python benchmarks/flash_attention.py --device cpu  # the tiles' memory against plain attention

`--batch`, `--heads`, `--context` and `--head-dim` change the size (e.g. `--context 256
--repeats 1` for a run of seconds); `--device` defaults to CUDA where there is one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from transformer_course.attention import scaled_dot_product_attention
from transformer_course.flash_attention import flash_attention
from transformer_course.flash_attention_triton import flash_attention_triton
from transformer_course.masking import causal_mask
from transformer_course.step_cost import SavedTensorBytes

DEFAULTS = {  # batch, heads, context, head dim
    "cuda": {"batch": 4, "heads": 16, "context": 4096, "head_dim": 64},
    "cpu": {"batch": 1, "heads": 4, "context": 2048, "head_dim": 64},
}
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


def sdpa_flash(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA on its flash backend only (it raises rather than fall back to another kernel)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def forward_backward(attend: Attend, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor) -> None:
    attend(q, k, v).backward(grad_out)
    for t in (q, k, v):
        t.grad = None


def median_times(
    fns: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> dict[str, float]:
    """Median seconds of each call, after one warm-up call each (Triton compiles on its first)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """MiB allocated at the peak of `fn()` above what was allocated before it (CUDA)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def compare_on_cuda(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, repeats: int) -> None:
    attends: dict[str, Attend] = {
        "triton": lambda q, k, v: flash_attention_triton(q, k, v, causal=True),
        "sdpa_flash": sdpa_flash,
    }
    with torch.no_grad():
        forward = median_times(
            {name: lambda a=attend: a(q, k, v) for name, attend in attends.items()},
            repeats,
            q.device,
        )
        gap = (attends["triton"](q, k, v) - sdpa_flash(q, k, v)).abs().max().item()
    steps = {
        name: lambda a=a: forward_backward(a, q, k, v, grad_out) for name, a in attends.items()
    }
    both = median_times(steps, repeats, q.device)
    print(f"{'':12s} {'forward ms':>11s} {'fwd+bwd ms':>11s} {'peak MiB':>9s}")
    for name, step in steps.items():
        peak = peak_mib(step, q.device)
        print(f"{name:12s} {forward[name] * 1e3:11.3f} {both[name] * 1e3:11.3f} {peak:9.0f}")
    print(
        f"triton / sdpa_flash: forward {forward['triton'] / forward['sdpa_flash']:.2f}, "
        f"forward+backward {both['triton'] / both['sdpa_flash']:.2f}"
    )
    print(f"largest |triton - sdpa_flash| in the output: {gap:.2e}")


def compare_on_cpu(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, repeats: int) -> None:
    mask = causal_mask(q.shape[-2])
    attends: dict[str, Attend] = {
        "flash_attention": lambda q, k, v: flash_attention(q, k, v, causal=True),
        "plain attention": lambda q, k, v: scaled_dot_product_attention(q, k, v, mask)[0],
    }
    saved = {}
    for name, attend in attends.items():
        with SavedTensorBytes() as counter:
            out = attend(q, k, v)
        saved[name] = counter.bytes / 2**20
        del out  # frees what it saved
    steps = {
        name: lambda a=a: forward_backward(a, q, k, v, grad_out) for name, a in attends.items()
    }
    seconds = median_times(steps, repeats, q.device)
    print(f"{'':16s} {'saved MiB':>10s} {'fwd+bwd ms':>11s}")
    for name in attends:
        print(f"{name:16s} {saved[name]:10.1f} {seconds[name] * 1e3:11.1f}")
    print(
        f"saved for the backward: plain / flash = "
        f"{saved['plain attention'] / saved['flash_attention']:.1f}x"
    )
    print(f"time: flash / plain = {seconds['flash_attention'] / seconds['plain attention']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="positions (queries = keys)")
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=10, help="rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device on this machine")
    sizes = {
        name: default if getattr(args, name) is None else getattr(args, name)
        for name, default in DEFAULTS[device.type].items()
    }
    for flag, value in [*sizes.items(), ("repeats", args.repeats), ("threads", args.threads)]:
        if value < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an int >= 1, got {value}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (sizes["batch"], sizes["heads"], sizes["context"], sizes["head_dim"])
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"torch {torch.__version__}, {name}, {torch.get_num_threads()} thread(s), {dtype}, "
        f"causal, batch {shape[0]} x {shape[1]} heads x {shape[2]} positions x d {shape[3]}, "
        f"median of {args.repeats}"
    )
    compare = compare_on_cuda if device.type == "cuda" else compare_on_cpu
    compare(q, k, v, grad_out, args.repeats)


if __name__ == "__main__":
    main()
