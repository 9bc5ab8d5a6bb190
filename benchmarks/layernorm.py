"""Forward+backward time of the course's `LayerNorm` and `RMSNorm` against PyTorch's fused kernels.

The course's modules are written out in elementary tensor operations (mean, subtract, square,
mean, sqrt, divide, scale, shift), each a separate pass over memory with its own saved tensors
for the backward pass; `F.layer_norm` and `F.rms_norm` do it in one fused kernel. The ratio
ours / PyTorch says what that readability costs. Timings are medians of `--repeats` rounds,
the implementations interleaved within each round so that load from other processes hits
both alike.

`--shape BATCH POS D_MODEL` (repeatable) measures those shapes instead of the three in `SHAPES`,
e.g. `--shape 2 16 32 --repeats 1 --iters 1` for a run of a few seconds.

Usage: python benchmarks/layernorm.py [--repeats 7] [--threads 1] [--device cpu]
                                      [--shape BATCH POS D_MODEL ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course.layernorm import LayerNorm, RMSNorm

SHAPES = [(8, 128, 256), (8, 256, 768), (4, 512, 1024)]  # (batch, pos, d_model)


def forward_backward(fn: Callable[[Tensor], Tensor], x: Tensor, upstream: Tensor) -> None:
    x.grad = None
    (fn(x) * upstream).sum().backward()


def seconds(fn: Callable[[Tensor], Tensor], x: Tensor, upstream: Tensor, iters: int) -> float:
    """Mean wall time of one forward+backward over `iters` calls."""
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        forward_backward(fn, x, upstream)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="rounds; the median is reported")
    parser.add_argument("--iters", type=int, default=10, help="forward+backward calls per round")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        action="append",
        metavar=("BATCH", "POS", "D_MODEL"),
        help="measure this shape instead of the default three (repeatable)",
    )
    args = parser.parse_args()
    shapes = [tuple(shape) for shape in args.shape] if args.shape else SHAPES
    for flag, value in [("--repeats", args.repeats), ("--iters", args.iters)] + [
        ("--shape", size) for shape in shapes for size in shape
    ]:
        if value < 1:
            parser.error(f"{flag}: expected an int >= 1, got {value}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device={device.type} threads={args.threads} torch={torch.__version__} "
        f"median of {args.repeats} rounds x {args.iters} forward+backward"
    )
    print(f"{'norm':8s} {'shape':>16s} {'ours ms':>9s} {'torch ms':>9s} {'ours/torch':>11s}")
    for shape in shapes:
        d_model = shape[-1]
        x = torch.randn(shape, device=device, requires_grad=True)
        upstream = torch.randn(shape, device=device)
        ln, rms = LayerNorm(d_model).to(device), RMSNorm(d_model).to(device)
        pairs = {
            "layer": (
                ln,
                partial(
                    F.layer_norm, normalized_shape=(d_model,), weight=ln.w, bias=ln.b, eps=ln.eps
                ),
            ),
            "rms": (
                rms,
                partial(F.rms_norm, normalized_shape=(d_model,), weight=rms.w, eps=rms.eps),
            ),
        }
        for name, (ours, reference) in pairs.items():
            for fn in (ours, reference):  # warm up
                forward_backward(fn, x, upstream)
            times: dict[str, list[float]] = {"ours": [], "torch": []}
            for _ in range(args.repeats):
                times["ours"].append(seconds(ours, x, upstream, args.iters))
                times["torch"].append(seconds(reference, x, upstream, args.iters))
            ours_ms, torch_ms = (1e3 * statistics.median(times[k]) for k in ("ours", "torch"))
            ratio = ours_ms / torch_ms
            print(f"{name:8s} {str(shape):>16s} {ours_ms:9.3f} {torch_ms:9.3f} {ratio:11.2f}")


if __name__ == "__main__":
    main()
