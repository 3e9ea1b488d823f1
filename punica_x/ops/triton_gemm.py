"""The batch-invariant dense projection on CUDA: y = x @ W^T (+ bias) in Triton, W given as
[N, K], one reduction order per output element whatever the row count (ops.invariance).

cuBLAS picks its kernel, tile and split-K by M (the rows of a step), so a row's sums run in
another order alone than in a batch of 32. Here every call of a weight runs one compiled
kernel: the tile (BLOCK_M x BLOCK_N, K in steps of BLOCK_K) and the warp count are
constants, never chosen by M; the row count is not specialised on (do_not_specialize),
there is no split-K, and each output element's sum runs over K from 0 up in BLOCK_K steps,
each step one tl.dot of the same shape: the row's position in the batch and its neighbours
change nothing of its arithmetic (vLLM #27433 and Thinking Machines' batch_invariant_ops hold
BLOCK_K fixed the same way; here the M and N tiles are fixed too, so one instruction mix
serves every M). Accumulation in float32; float32 inputs multiply in IEEE float32 (no TF32).

A decode step of a few rows wastes most of a BLOCK_M = 64 tile, but decode is bound by
reading W, which the tile reads once per BLOCK_N columns whatever M is. Where Triton runs:
CUDA, or Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).
"""

from __future__ import annotations

import torch

from punica_x.ops.registry import TRITON_DTYPES
from punica_x.ops.triton_env import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["m"])
def _gemm_kernel(
    x,
    w,
    bias,
    y,
    m,
    n,
    k,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """x: [m, k] row-major; w: [n, k] row-major; y: [m, n] = x @ w^T (+ bias [n])."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)  # offsets past 2^31 (a 256k vocab)
    cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(
            x + rows[:, None] * k + ks[None, :], (rows[:, None] < m) & (ks[None, :] < k), 0.0
        )
        b = tl.load(
            w + cols[:, None] * k + ks[None, :], (cols[:, None] < n) & (ks[None, :] < k), 0.0
        )
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:
        acc += tl.load(bias + cols, cols < n, 0.0).to(tl.float32)[None, :]
    keep = (rows[:, None] < m) & (cols[None, :] < n)
    tl.store(y + rows[:, None] * n + cols[None, :], acc.to(y.dtype.element_ty), keep)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (same dtype and device) -> [M, N] in x's dtype, batch-invariant."""
    if x.dtype not in TRITON_DTYPES or w.dtype != x.dtype:
        raise ValueError(
            f"the triton GEMM takes float32/float16/bfloat16 x and W of one dtype, "
            f"got {x.dtype} and {w.dtype}"
        )
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x is [{m}, {k}] but W is {list(w.shape)}")
    x, w = x.contiguous(), w.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
    _gemm_kernel[grid](
        x,
        w,
        bias if bias is not None else w,
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return y


class TritonDense:
    """The dense backend of the batch-invariant mode on CUDA (ops.dense's interface)."""

    name = "triton"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def forward(self, x, prepared, n, bias):
        return gemm(x, prepared, bias)

    def rows(self, prepared: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """W[ids]: [T, K] (a tied LM head serving as the embedding)."""
        return prepared[ids]
