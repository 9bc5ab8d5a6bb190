"""Forward+backward time and peak memory of the course's attention against PyTorch's.

Compares, on the same weights and a causal mask:

* `einsum`     `MultiHeadAttention` on its default path, which materialises the pattern;
* `fast`       `MultiHeadAttention(fast_path=True)`, through `F.scaled_dot_product_attention`;
* `sdpa`       a minimal layer: fused input projection, `F.scaled_dot_product_attention`, output
               projection, on PyTorch's default kernel;
* `sdpa_math`  the same layer forced onto SDPA's math backend (which, like `einsum`, builds the
               full pattern);
* `torch_mha`  `torch.nn.MultiheadAttention(batch_first=True)`, `need_weights=False`.

and prints the ratios the course aims for: einsum / sdpa_math <= 1.5, fast / sdpa <= 1.05.
Timings are medians of `--repeats` rounds, the implementations interleaved within each round
so that load from other processes hits all of them alike.

Peak memory is measured with `torch.profiler` (`profile_memory=True`): every op's own
allocations minus frees, summed in the order the ops started, maximised over one
forward+backward (so at op granularity: a buffer an op allocates and frees internally is not
seen), above what was held before the step. It counts the tensors autograd saves for the
backward pass, which is where the materialised pattern costs memory. On CUDA
`torch.cuda.max_memory_allocated` does the same job. (The profiler logs two `USDT` lines per
measurement on stderr.)

`--shape BATCH SEQ D_MODEL N_HEADS` (repeatable) measures those shapes instead of the two in
`CONFIGS`, e.g. `--shape 2 32 64 4 --repeats 1` for a run of a few seconds.

Usage: python benchmarks/attention.py [--repeats 5] [--threads 1] [--device cpu]
                                      [--shape BATCH SEQ D_MODEL N_HEADS ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import einops
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from transformer_course.attention import MultiHeadAttention
from transformer_course.masking import causal_mask

CONFIGS = [
    {"batch": 8, "seq": 256, "d_model": 512, "n_heads": 8},
    {"batch": 1, "seq": 1024, "d_model": 512, "n_heads": 8},
]


class SDPALayer(nn.Module):
    """Multi-head attention the way PyTorch code usually writes it, holding `mha`'s weights."""

    def __init__(self, mha: MultiHeadAttention, backend: SDPBackend | None = None) -> None:
        super().__init__()
        self.n_heads, self.backend = mha.n_heads, backend
        W_in = [
            einops.rearrange(W, "head d_model d_head -> (head d_head) d_model")
            for W in (mha.W_Q, mha.W_K, mha.W_V)
        ]
        self.in_proj = nn.Linear(mha.d_model, 3 * mha.n_heads * mha.d_head)
        self.out_proj = nn.Linear(mha.n_heads * mha.d_head, mha.d_model)
        with torch.no_grad():
            self.in_proj.weight.copy_(torch.cat(W_in))
            self.in_proj.bias.copy_(torch.cat([b.reshape(-1) for b in (mha.b_Q, mha.b_K, mha.b_V)]))
            self.out_proj.weight.copy_(
                einops.rearrange(mha.W_O, "head d_head d_model -> d_model (head d_head)")
            )
            self.out_proj.bias.copy_(mha.b_O)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = einops.rearrange(
            self.in_proj(x), "b p (three h d) -> three b h p d", three=3, h=self.n_heads
        )
        if self.backend is None:
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            with sdpa_kernel(self.backend):
                z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(einops.rearrange(z, "b h p d -> b p (h d)"))


def implementations(
    cfg: dict, device: torch.device
) -> tuple[dict[str, Callable[[Tensor], Tensor]], Tensor]:
    mha = MultiHeadAttention(cfg["d_model"], cfg["n_heads"]).to(device)
    fast = MultiHeadAttention(cfg["d_model"], cfg["n_heads"], fast_path=True).to(device)
    fast.load_state_dict(mha.state_dict())
    sdpa, sdpa_math = SDPALayer(mha).to(device), SDPALayer(mha, SDPBackend.MATH).to(device)
    torch_mha = nn.MultiheadAttention(cfg["d_model"], cfg["n_heads"], batch_first=True).to(device)
    torch_mha.load_state_dict(
        {
            "in_proj_weight": sdpa.in_proj.weight,
            "in_proj_bias": sdpa.in_proj.bias,
            "out_proj.weight": sdpa.out_proj.weight,
            "out_proj.bias": sdpa.out_proj.bias,
        }
    )
    mask = causal_mask(cfg["seq"], device=device)
    fns = {
        "einsum": lambda x: mha(x, mask=mask),
        "fast": lambda x: fast(x, mask=mask),
        "sdpa": lambda x: sdpa(x, mask),
        "sdpa_math": lambda x: sdpa_math(x, mask),
        "torch_mha": lambda x: torch_mha(x, x, x, attn_mask=~mask, need_weights=False)[0],
    }
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["d_model"], device=device, requires_grad=True)
    return fns, x


def step(fn: Callable[[Tensor], Tensor], x: Tensor) -> None:
    fn(x).sum().backward()
    x.grad = None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_all(fns: dict, x: Tensor, repeats: int, device: torch.device) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        step(fn, x)
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            step(fn, x)
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_memory(fn: Callable[[Tensor], Tensor], x: Tensor, device: torch.device) -> int:
    """Bytes allocated at the peak of one forward+backward, above what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(fn, x)
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage  # allocations minus frees made by this op itself
        peak = max(peak, held)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--shape",
        type=int,
        nargs=4,
        action="append",
        metavar=("BATCH", "SEQ", "D_MODEL", "N_HEADS"),
        help="measure this shape instead of the default two (repeatable)",
    )
    args = parser.parse_args()
    configs = CONFIGS
    if args.shape:
        configs = [dict(zip(("batch", "seq", "d_model", "n_heads"), shape)) for shape in args.shape]
    for cfg in configs:
        if min(cfg.values()) < 1 or cfg["d_model"] % cfg["n_heads"]:
            parser.error(f"--shape: expected positive ints, d_model a multiple of n_heads: {cfg}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected an int >= 1, got {args.repeats}")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} thread(s), "
        f"float32, causal mask, median of {args.repeats} forward+backward steps"
    )
    for cfg in configs:
        fns, x = implementations(cfg, device)
        times = time_all(fns, x, args.repeats, device)
        label = ", ".join(f"{k} {v}" for k, v in cfg.items())
        print(f"\n{label}")
        for name, seconds in times.items():
            print(f"  {name:10s} {seconds * 1e3:9.1f} ms   {seconds / times['sdpa']:5.2f}x sdpa")
        print(f"  einsum / sdpa_math = {times['einsum'] / times['sdpa_math']:.2f} (goal <= 1.5)")
        print(f"  fast / sdpa        = {times['fast'] / times['sdpa']:.2f} (goal <= 1.05)")
        pattern_mib = cfg["batch"] * cfg["n_heads"] * cfg["seq"] ** 2 * 4 / 2**20
        print(f"  one (batch, head, q_pos, k_pos) float32 pattern: {pattern_mib:.0f} MiB")
        for name in ("einsum", "fast", "sdpa_math", "sdpa"):
            print(f"  peak memory {name:10s} {peak_memory(fns[name], x, device) / 2**20:8.0f} MiB")


if __name__ == "__main__":
    main()
