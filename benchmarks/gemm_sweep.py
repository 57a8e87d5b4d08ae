"""The decode step's four GEMMs per layer (QKV, O, gate-up, down) at decode batch sizes, timed as
the engine runs them: one call per layer, each layer its own weight (so none stays in L2), captured
in a CUDA graph. cuBLAS (F.linear, what the engine runs) against Triton tilings of the same product,
to say whether a kernel of keel's own could read the weights faster (benchmarks/README.md: at 256
rows cuBLAS's tiles leave a second wave on 132 SMs, about 1 TB/s of weights).

    python benchmarks/gemm_sweep.py [--shapes 0.5b 1.5b] [--rows 128 256]

One JSON line per shape, rows, GEMM and variant: us per call and weight bytes per second; then
the fastest Triton tiling per GEMM against cuBLAS. `--check` compares every tiling's result with
F.linear first (and runs under TRITON_INTERPRET=1 on a CPU, in float16, without timing)."""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from keel.bench.workloads import QWEN25_SHAPES

# this folder's scripts run with it on sys.path
from graph_timing import graph_seconds

TILINGS = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, num_warps=w, num_stages=s)
    for bm in (64, 128, 256)
    for bn in (32, 64, 128)
    for bk in (64, 128)
    for w in (4, 8)
    for s in (3, 4)
    if bm * bn <= 128 * 128
]
# Split-K for the GEMMs of few output columns (O and down: 896 at 0.5B), whose tiles alone leave SMs
# idle: each split adds its partial product into a float32 output with atomics.
TILINGS += [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, SPLIT_K=split, num_warps=4, num_stages=s)
    for bm in (64, 128)
    for bn in (32, 64)
    for split in (2, 4, 8)
    for s in (3, 4)
]


@triton.jit
def _linear_kernel(
    X,
    W,
    Y,
    M,
    N,
    K,
    x_m,
    w_n,
    y_m,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Y [M, N] = X [M, K] @ W[N, K]^T, fp32 accumulation; one program per BLOCK_M x BLOCK_N tile
    (and K split), the N tiles of one M tile next to each other so a weight tile is read by few
    programs. With SPLIT_K > 1, Y is float32 and zeroed, and each split adds its part."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    for k in range(pid_k * k_len, min(K, (pid_k + 1) * k_len), BLOCK_K):
        x = tl.load(
            X + rows[:, None] * x_m + (k + ks)[None, :],
            mask=(rows[:, None] < M) & (k + ks < K)[None, :],
            other=0.0,
        )
        w = tl.load(
            W + cols[:, None] * w_n + (k + ks)[None, :],
            mask=(cols[:, None] < N) & (k + ks < K)[None, :],
            other=0.0,
        )
        acc += tl.dot(x, tl.trans(w))
    out = Y + rows[:, None] * y_m + cols[None, :]
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out, acc.to(Y.dtype.element_ty), mask=inside)
    else:
        tl.atomic_add(out, acc, mask=inside)


def triton_linear(x: torch.Tensor, w: torch.Tensor, tiling: dict) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    split = tiling["SPLIT_K"]
    y = (
        torch.empty(m, n, device=x.device, dtype=x.dtype)
        if split == 1
        else torch.zeros(m, n, device=x.device, dtype=torch.float32)
    )
    blocks = {key: tiling[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
    grid = (triton.cdiv(n, tiling["BLOCK_N"]), triton.cdiv(m, tiling["BLOCK_M"]), split)
    launch = (
        {}
        if x.device.type == "cpu"
        else dict(num_warps=tiling["num_warps"], num_stages=tiling["num_stages"])
    )
    _linear_kernel[grid](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), **blocks, **launch
    )
    return y if split == 1 else y.to(x.dtype)


def gemms(shape: str) -> dict[str, tuple[int, int]]:
    """Each decode GEMM's (K, N): the engine's fused QKV and gate-up weights."""
    c = QWEN25_SHAPES[shape]
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    dim = hidden // heads
    return {
        "qkv": (hidden, (heads + 2 * kv) * dim),
        "o": (hidden, hidden),
        "gate_up": (hidden, 2 * c["intermediate_size"]),
        "down": (c["intermediate_size"], hidden),
    }


def check(device: str, dtype: torch.dtype) -> None:
    """Every tiling against F.linear on odd sizes (edges masked)."""
    torch.manual_seed(0)
    x, w = (
        torch.randn(100, 200, device=device, dtype=dtype),
        torch.randn(150, 200, device=device, dtype=dtype),
    )
    expected = F.linear(x.float(), w.float())
    splits = [t for t in TILINGS if t["SPLIT_K"] > 1]
    for tiling in TILINGS if device == "cuda" else TILINGS[:2] + splits[:2]:
        error = (triton_linear(x, w, tiling).float() - expected).abs().max().item()
        assert error < 0.5, (tiling, error)
    print("check ok", flush=True)


def sweep(shape: str, rows: int) -> None:
    layers = QWEN25_SHAPES[shape]["num_hidden_layers"]
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for name, (k, n) in gemms(shape).items():
        x = torch.randn(rows, k, **bf16)
        weights = [torch.randn(n, k, **bf16) * 0.02 for _ in range(layers)]
        variants = {
            "cublas": lambda w, x=x: F.linear(x, w),
            "cublaslt": lambda w, x=x: F.linear(x, w),
        }
        variants.update(
            {json.dumps(t): (lambda w, t=t, x=x: triton_linear(x, w, t)) for t in TILINGS}
        )
        results = {}
        for variant, fn in variants.items():
            torch.backends.cuda.preferred_blas_library(
                "cublaslt" if variant == "cublaslt" else "cublas"
            )
            try:
                seconds = (
                    graph_seconds(lambda fn=fn, weights=weights: [fn(w) for w in weights]) / layers
                )
            # the tiling's buffers exceed shared memory
            except triton.runtime.errors.OutOfResources:
                continue
            results[variant] = seconds
            print(
                json.dumps(
                    {
                        "shape": shape,
                        "rows": rows,
                        "gemm": name,
                        "variant": variant,
                        "us": 1e6 * seconds,
                        "weight_tb_per_s": n * k * 2 / seconds / 1e12,
                    }
                ),
                flush=True,
            )
        torch.backends.cuda.preferred_blas_library("cublas")
        best = min((v for v in results if not v.startswith("cublas")), key=results.get)
        print(
            "best",
            json.dumps(
                {
                    "shape": shape,
                    "rows": rows,
                    "gemm": name,
                    "cublas_us": 1e6 * results["cublas"],
                    "cublaslt_us": 1e6 * results["cublaslt"],
                    "triton_us": 1e6 * results[best],
                    "tiling": json.loads(best),
                }
            ),
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    p.add_argument(
        "--check", action="store_true", help="compare with F.linear (a CPU runs this only)"
    )
    args = p.parse_args()
    on_gpu = torch.cuda.is_available()
    if args.check or not on_gpu:
        check("cuda" if on_gpu else "cpu", torch.bfloat16 if on_gpu else torch.float16)
    if not on_gpu:
        return
    for shape in args.shapes:
        for rows in args.rows:
            sweep(shape, rows)


if __name__ == "__main__":
    main()
