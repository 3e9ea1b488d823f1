"""Dense projections of the shared backbone: y = x @ W^T (+ bias), W given as [N, K].

Backends (chosen once per model, by device and dtype, or $PUNICA_X_DENSE_BACKEND):
* ``cpu``: W packed into panels [ceil(N/48), K, 48] for the compiled GEMM in csrc/dense
  (float32 on CPU). MKL's unpacked sgemm re-packs W on every call, which dominates decode
  steps (8..64 rows): the packed kernel is ~1.6x faster there and no slower for prefill.
* ``torch``: W stored transposed, [K, N] contiguous, and ``x @ W_t`` (any device/dtype;
  on CPU this layout is itself 2.5x faster than F.linear's x @ W^T for small M).
"""

from __future__ import annotations

from typing import Protocol

import torch

from punica_x.env import DENSE_BACKEND
from punica_x.ops.registry import Registry, cpu_float32_else_torch


class DenseBackend(Protocol):
    name: str

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] weight -> the layout forward() reads."""

    def forward(
        self, x: torch.Tensor, prepared: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [M, K] -> [M, N]."""


class TorchDense:
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().contiguous()

    def forward(self, x, prepared, n, bias):
        return x @ prepared if bias is None else torch.addmm(bias, x, prepared)


class PackedCpuDense:
    name = "cpu"

    def __init__(self) -> None:
        from punica_x.ops._build import load_dense_extension

        self.ext = load_dense_extension()

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return self.ext.pack(weight.contiguous())

    def forward(self, x, prepared, n, bias):
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        self.ext.gemm(y, x.contiguous(), prepared, n, bias)
        return y


BACKENDS: Registry[DenseBackend] = Registry(
    "dense",
    DENSE_BACKEND,
    {"cpu": PackedCpuDense, "torch": TorchDense},
    default=cpu_float32_else_torch,
    needs={"cpu": ("cpu", torch.float32)},
)


def get_dense_backend(
    device: torch.device | str, dtype: torch.dtype, name: str | None = None
) -> DenseBackend:
    return BACKENDS.get(device, dtype, name)
