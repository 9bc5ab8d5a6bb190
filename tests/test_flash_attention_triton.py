"""FlashAttention-2 in Triton (`transformer_course.flash_attention_triton`), run on the CPU by
Triton's interpreter; tests/test_cuda.py runs the same kernels compiled, on a GPU.

`TRITON_INTERPRET=1` makes `triton.jit` build a kernel for the interpreter (NumPy, on CPU
tensors) instead of the GPU. It is read when a kernel is decorated, that is when the module is
imported, and it holds for the whole process: set here, it would also turn the kernels of
tests/test_cuda.py and torch.compile's into interpreted ones in the same pytest process. So the
kernels run in a child process, this file run as a script with the variable set: it loads the
cases this file wrote, runs each through `FlashAttentionTriton` (forward, what it saves,
backward) and writes what came out; the tests compare that with the references, computed here.

References: the course's `flash_attention` and PyTorch's `F.scaled_dot_product_attention`
(with `causal_mask`: with more keys than queries the last query sees every key) in float32,
and `torch.logsumexp` of the scores in float64 for the saved L (1e-5; we see 5e-7).
Tolerances on the output, four times them on the gradients: float32 2e-5 (we see at most
1.5e-6; a wrong rescaling of the running sums or a mask off by one is far outside it); float16
against the float32 references on the same (rounded) inputs 2e-3, as in
tests/test_flash_attention.py (we see at most 7e-4 on the output and 1.8e-3 on the gradients:
the rounding of the results to float16). Not bfloat16: the interpreter's `tl.dot` multiplies
bfloat16 bit patterns as integers (triton-lang/triton#11584, unsupported there), so the module
refuses it there; tests/test_cuda.py checks it on the GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformer_course import flash_attention_triton as triton_attention
from transformer_course.attention import causal_mask
from transformer_course.flash_attention import flash_attention
from transformer_course.flash_attention_triton import FlashAttentionTriton, flash_attention_triton

TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (CUDA PyTorch on Linux brings it; `pip install triton` for "
    "its CPU interpreter)",
)
TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}  # Triton's names for torch's dtypes
FLOAT32_ATOL = 2e-5
FLOAT16_ATOL = 2e-3  # on the output; 4 times this on the gradients
# (leading dims, n_queries, n_keys, d) against the module's tiles (float32: 64 queries x 32 keys
# forward, 32 x 32 backward): lengths that are not multiples of a tile, several tiles, whole
# tiles, one query, every head dim. With 135 keys for 70 queries, the last key a causal tile
# of queries sees is alone in its key tile: skipping one tile too many shows.
SHAPES = {
    "ragged": ((2, 3), 37, 37, 16),
    "more keys than queries": ((2,), 70, 135, 32),
    "more queries than keys": ((), 45, 20, 16),
    "whole tiles": ((1, 2), 64, 64, 64),
    "one query (d=128)": ((3,), 1, 40, 128),
}


def case_names() -> list[str]:
    """`shape, causal, dtype[, non-contiguous]`: every shape in float32 (causal where there
    are no more queries than keys), two in float16, one with non-contiguous inputs."""
    names = []
    for shape, (_, n_queries, n_keys, _) in SHAPES.items():
        for causal in [False, True][: 2 if n_queries <= n_keys else 1]:
            names.append(f"{shape}, causal={causal}, float32")
            if shape in ("ragged", "more keys than queries"):
                names.append(f"{shape}, causal={causal}, float16")
    names += ["ragged, causal=True, float32, non-contiguous"]
    return names


def make_case(name: str, seed: int) -> dict:
    """q, k, v and an upstream gradient for the case `name`; heads-major views of
    (batch, position, head, d) tensors if it says non-contiguous."""
    shape, causal, dtype, *layout = name.split(", ")
    lead, n_queries, n_keys, d = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)

    def make(n: int) -> torch.Tensor:
        if layout:  # (batch, n, heads, d) seen as (batch, heads, n, d)
            return torch.randn(*lead[:-1], n, lead[-1], d, generator=g).transpose(-3, -2)
        return torch.randn(*lead, n, d, generator=g)

    dtype = getattr(torch, dtype)
    q, k, v, grad_out = (make(n).to(dtype) for n in (n_queries, n_keys, n_keys, n_queries))
    return {"q": q, "k": k, "v": v, "grad_out": grad_out, "causal": causal == "causal=True"}


def apply_saving(q, k, v, causal) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`FlashAttentionTriton.apply(q, k, v, causal)` and the tensors it saved for the backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = FlashAttentionTriton.apply(q, k, v, causal)
    return out, saved


def run_cases(cases_path: Path, results_path: Path) -> None:
    """The child's work, under TRITON_INTERPRET=1: each case through `FlashAttentionTriton`."""
    results = {}
    for name, case in torch.load(cases_path).items():
        q, k, v = (case[x].requires_grad_() for x in "qkv")
        out, saved = apply_saving(q, k, v, case["causal"])
        grads = torch.autograd.grad(out, (q, k, v), case["grad_out"])
        results[name] = {
            "out": out.detach(),
            "grads": [g.detach() for g in grads],
            "saved": [t.detach() for t in saved],
            "saved_inputs_are_the_inputs": [a is b for a, b in zip(saved, (q, k, v))],
            "inputs_contiguous": q.is_contiguous(),
        }
    try:
        flash_attention_triton(*(torch.ones(2, 5, 16, dtype=torch.bfloat16),) * 3)
    except ValueError as e:
        results["bfloat16"] = str(e)
    torch.save(results, results_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[dict, dict]:
    """Every case's inputs, and what the kernels made of them in the interpreter's process: one
    such process a session, also when pytest-xdist spreads these tests over several workers."""
    cases = {name: make_case(name, seed) for seed, name in enumerate(case_names())}
    folder = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' folders share this session's parent
        folder = folder.parent
    cases_file, results_file = (folder / f"triton_interpreter_{x}.pt" for x in ("cases", "results"))
    import fcntl  # POSIX, as Triton is: the workers take turns, the first runs the process

    with open(folder / "triton_interpreter.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not results_file.exists():
            torch.save(cases, cases_file)
            result = subprocess.run(
                [sys.executable, __file__, str(cases_file), str(results_file)],
                env={**os.environ, "TRITON_INTERPRET": "1"},
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, (
                f"the interpreter's process failed:\n{result.stderr[-5000:]}"
            )
    return cases, torch.load(results_file)


def references(case: dict) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(output, gradients) of `flash_attention` and of SDPA in float32 on the case's inputs."""
    q, k, v = (case[x].float().requires_grad_() for x in "qkv")
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    mask = causal_mask(n_queries, n_keys) if case["causal"] else None
    found = []
    for out in (
        flash_attention(q, k, v, case["causal"]),
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
    ):
        grads = torch.autograd.grad(out, (q, k, v), case["grad_out"].float())
        found.append((out.detach(), list(grads)))
    return found


@TRITON
@pytest.mark.parametrize("name", case_names())
def test_the_kernels_match_flash_attention_and_sdpa(interpreted, name):
    cases, results = interpreted
    case, result = cases[name], results[name]
    atol = FLOAT32_ATOL if case["q"].dtype == torch.float32 else FLOAT16_ATOL
    assert result["out"].dtype == case["q"].dtype and result["out"].shape == case["q"].shape
    assert result["inputs_contiguous"] == ("non-contiguous" not in name)
    for expected_out, expected_grads in references(case):
        torch.testing.assert_close(result["out"].float(), expected_out, atol=atol, rtol=0)
        for x, got, want in zip("qkv", result["grads"], expected_grads):
            assert got.dtype == case[x].dtype and got.shape == case[x].shape
            torch.testing.assert_close(got.float(), want, atol=4 * atol, rtol=0, msg=f"d{x}")


@TRITON
@pytest.mark.parametrize("name", case_names())
def test_saves_q_k_v_the_output_and_one_float32_log_sum_exp(interpreted, name):
    cases, results = interpreted
    case, result = cases[name], results[name]
    q, k = case["q"], case["k"]
    saved = result["saved"]
    assert [tuple(t.shape) for t in saved] == [
        tuple(q.shape),
        tuple(k.shape),
        tuple(case["v"].shape),
        tuple(q.shape),
        tuple(q.shape[:-1]),
    ]
    assert result["saved_inputs_are_the_inputs"] == [True, True, True]
    assert torch.equal(saved[3], result["out"])
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if case["causal"]:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    assert saved[4].dtype == torch.float32
    torch.testing.assert_close(saved[4].double(), torch.logsumexp(scores, -1), atol=1e-5, rtol=0)


@TRITON
def test_the_interpreter_refuses_bfloat16(interpreted):
    _, results = interpreted
    assert results["bfloat16"].startswith(
        "q: expected torch.float16 or torch.float32 in Triton's interpreter (TRITON_INTERPRET=1)"
    )


def triton_type(arg: str, dtype: str) -> str:
    """A kernel argument's type for `triton.compile`: pointers to `dtype` (to float32 for L and
    D), int32 lengths, a float32 scale, and the rest compile-time constants."""
    if arg.endswith("_ptr"):
        return "*fp32" if arg in ("lse_ptr", "delta_ptr") else f"*{dtype}"
    return {"n_queries": "i32", "n_keys": "i32", "scale": "fp32"}.get(arg, "constexpr")


@TRITON
@pytest.mark.parametrize(("dtype", "head_dim"), [("bf16", 64), ("bf16", 128), ("fp32", 32)])
def test_the_kernels_compile_for_an_h100(dtype, head_dim):
    """The interpreter does not compile; Triton compiles for a GPU it is not running on: every
    kernel, causal, with the tiles the module launches, for an H100 (sm_90), in half precision
    (tensor cores; d=128 takes the most shared memory) and in float32 (full-precision matmuls).
    Each fits an H100's 227 KiB of shared memory a program."""
    if triton_attention._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was set when the suite imported the module")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    tiles = triton_attention._tiles(getattr(torch, TORCH_DTYPE[dtype]), head_dim)
    for name, launch in tiles.items():
        kernel = getattr(triton_attention, f"_{name}_kernel")
        launch = dict(launch)
        options = {key: launch.pop(key) for key in ("num_warps", "num_stages") if key in launch}
        signature = {arg: triton_type(arg, dtype) for arg in kernel.arg_names}
        constants = {"HEAD_DIM": head_dim, **launch}
        if "CAUSAL" in signature:
            constants["CAUSAL"] = True
        compiled = compile(
            ASTSource(kernel, signature, constants),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
        assert compiled.asm["cubin"], name
        assert compiled.metadata.shared <= 227 * 1024, name


@TRITON
def test_refuses_cpu_tensors_outside_the_interpreter():
    if triton_attention._INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 was set when the suite imported the module")
    q = torch.randn(2, 5, 16)
    message = "q: expected a CUDA tensor (Triton compiles the kernels for the GPU), got device cpu"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}; .*TRITON_INTERPRET=1"):
        flash_attention_triton(q, q, q)


@TRITON
def test_clear_errors():
    q, k = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    bad = {
        "q: expected head dim d in (16, 32, 64, 128), got d=48": (q.new_ones(2, 5, 48),) * 3,
        "q: expected head dim d in (16, 32, 64, 128), got d=8": (q[..., :8],) * 3,
        "q: expected dtype torch.float16, torch.bfloat16 or torch.float32, got torch.float64": (
            q.double(),
            k.double(),
            k.double(),
        ),
        # flash_attention's own checks
        "v: expected k_pos=7 positions (dim -2 of k), got 6": (q, k, k[:, :6]),
        "k: expected leading dims (2,) (those of q), got (1,)": (q, k[:1], k[:1]),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            flash_attention_triton(*args)
    with pytest.raises(ValueError, match="k: expected at least n_queries=7 positions"):
        flash_attention_triton(k, q, q, causal=True)
    with pytest.raises(ValueError, match="causal: expected True or False, got 1"):
        FlashAttentionTriton.apply(q, k, k, 1)


def test_imports_and_refuses_to_run_without_triton():
    """With `import triton` failing, the module imports and a call says what is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import torch\n"
        "from transformer_course.flash_attention_triton import flash_attention_triton\n"
        "q = torch.randn(2, 5, 16)\n"
        "try:\n"
        "    flash_attention_triton(q, q, q)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("FlashAttentionTriton needs Triton, which is not installed")


if __name__ == "__main__":  # the interpreter's process: python THIS_FILE CASES RESULTS
    run_cases(Path(sys.argv[1]), Path(sys.argv[2]))
