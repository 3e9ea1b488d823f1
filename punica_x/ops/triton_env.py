"""Triton for the batch-invariant CUDA kernels (ops.triton_gemm, ops.triton_norm,
attention.triton_paged): imported here once, with a clear error where it is missing.

CUDA builds of torch carry Triton; on a CPU it runs only under its interpreter
(TRITON_INTERPRET=1, set before the kernels are defined: the CPU tests do so)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - the CUDA builds of torch carry it
    raise ImportError(
        "the batch-invariant CUDA kernels are written in Triton, which is not installed "
        "(CUDA builds of torch carry it; pip install triton)"
    ) from e

__all__ = ["tl", "triton"]
