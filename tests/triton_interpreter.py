"""Triton's interpreter for the batch-invariant CUDA kernels' tests on a CPU.

tests/conftest.py sets TRITON_INTERPRET=1 where no CUDA device is, before any kernel is
defined, so the kernels run on CPU tensors through numpy. Two of the interpreter's own
arithmetic faults (triton 3.9) are mended for the tests' duration by `mended()`:
* tl.dot is numpy's matmul: of bfloat16 it multiplies the raw 16-bit patterns as integers
  (the interpreter stores bfloat16 as uint16), and of float32 it is BLAS, whose order of
  additions depends on where a row sits in the tile. Mended by `_dot`: the operands widened
  to float32 (exactly), each output element's K products summed into a partial in an order
  that is a function of the dot's shape (the tile: M x N over K) alone, then the partial
  added to the accumulator. The order is the same for every element of one tile, as a GPU's
  MMA instruction treats every row and column of its tile alike: a row's position in the
  tile or the batch changes nothing. But it differs from tile shape to tile shape, as on a
  GPU, where another BLOCK_M/BLOCK_N/BLOCK_K (or warp count, or split-K) is another MMA
  instruction mix with its own internal order of additions: a kernel that picks its tile by
  the row count gives a row other bits alone than in a batch, here as there. (A fixed order
  k = 0, 1, ... for every shape, as this module had, let such a kernel pass.) The model
  (`_dot_order`): with s = bits(M) + 2 bits(N) + 3 bits(K) (bits: int.bit_length), k runs in
  groups of g = 2 << (s % 4) (at most the largest power of two dividing K), each group
  summed as a pairwise tree when (s // 4) is odd, else from its first k up, the groups'
  sums added in k order; doubling any one of M, N, K changes g (K >= 16). The orders are
  arbitrary (no GPU's own): what the tests need is that it is one per shape and not one for
  all shapes. The interpreter sees the dot's shape only: a warp or stage count chosen by the
  row count, the same tile otherwise, changes no bits here;
* float32 -> bfloat16 truncates: rounded to nearest even, as the GPU and torch round.
Neither touches a GPU run."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch


def interpreted() -> bool:
    """Whether the kernels run in the interpreter here (no CUDA device)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device() -> str:
    return "cpu" if interpreted() else "cuda"


def _widen(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def _round_bf16(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _dot_order(m: int, n: int, k: int) -> tuple[int, bool]:
    """(g, tree) of an M x N tile over K: the products summed in groups of g k's, each group
    a pairwise tree or in k order, the groups' sums in k order (module docstring)."""
    s = m.bit_length() + 2 * n.bit_length() + 3 * k.bit_length()
    return min(2 << s % 4, k & -k), (s // 4) % 2 == 1


def _dot(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x [..., M, K] @ y [..., K, N] in float32, each element's sum in its tile's order."""
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    g, tree = _dot_order(m, n, k)
    xk, yk = np.moveaxis(x, -1, 0), np.moveaxis(y, -2, 0)  # k first: [K, ..., M], [K, ..., N]
    prod = (xk[..., :, None] * yk[..., None, :]).reshape(k // g, g, *xk.shape[1:], n)
    if tree:
        while prod.shape[1] > 1:
            prod = prod[:, 0::2] + prod[:, 1::2]
        groups = prod[:, 0]
    else:
        groups = prod[:, 0]
        for i in range(1, g):
            groups = groups + prod[:, i]
    part = groups[0]
    for j in range(1, k // g):
        part = part + groups[j]
    return part


@contextlib.contextmanager
def mended():
    """The interpreter with bfloat16 dot products and float32 -> bfloat16 rounding mended
    (a no-op on CUDA)."""
    if not interpreted():
        yield
        return
    tl = pytest.importorskip("triton.language")
    from triton.runtime import interpreter as it

    builder = it.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def wide(h):
        return _widen(h.data) if h.dtype.scalar == tl.bfloat16 else h.data.astype(np.float32)

    def create_dot(self, a, b, d, *args):
        part = _dot(wide(a), wide(b))
        return it.TensorHandle(d.data.astype(np.float32) + part, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return it.TensorHandle(_round_bf16(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    try:
        yield
    finally:
        builder.create_dot, builder.cast_impl = dot, cast


def skip_without_triton():
    """Skip unless Triton is importable (its kernels run on CUDA or in the interpreter): from
    the environment (CUDA builds of torch carry it), else from $VENV/triton, where
    scripts/test-deps.sh puts it for this test process alone (not in site-packages, where
    torch would import it in every process)."""
    own = Path(sys.prefix) / "triton"
    if importlib.util.find_spec("triton") is None and own.is_dir():
        sys.path.append(str(own))
    pytest.importorskip("triton")
    if not interpreted() and not torch.cuda.is_available():
        pytest.skip("Triton's kernels need CUDA or TRITON_INTERPRET=1")
