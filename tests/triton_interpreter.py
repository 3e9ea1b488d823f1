"""Triton's interpreter for the batch-invariant CUDA kernels' tests on a CPU.

tests/conftest.py sets TRITON_INTERPRET=1 where no CUDA device is, before any kernel is
defined, so the kernels run on CPU tensors through numpy. Two of the interpreter's own
arithmetic faults (triton 3.9) are mended for the tests' duration by `mended()`:
* tl.dot is numpy's matmul: of bfloat16 it multiplies the raw 16-bit patterns as integers
  (the interpreter stores bfloat16 as uint16), and of float32 it is BLAS, whose order of
  additions depends on where a row sits in the tile. Mended: the operands widened to float32
  (exactly), each output element's products summed over k = 0, 1, ... in that order, then
  added to the accumulator: the same for every row, as a GPU's MMA instruction treats every
  row of its tile alike, and a change of the K tile changes the bits, as on a GPU;
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
        x, y = wide(a), wide(b)
        part = x[..., :, 0:1] * y[..., 0:1, :]
        for i in range(1, x.shape[-1]):
            part = part + x[..., :, i : i + 1] * y[..., i : i + 1, :]
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
