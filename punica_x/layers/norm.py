"""RMSNorm, computed as Llama's reference (float32 statistics, weight applied last), through
the fused-layers backend; add() also folds in the residual add before it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.eps = eps
        self.fused = None  # set by the model once the backend is known

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.fused.rms_norm(x, self._parameters["weight"], self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x in place (the residual stream); returns rms_norm(residual)."""
        # the weight from _parameters: Module.__getattr__ costs ~0.5 us, twice per layer
        return self.fused.add_rms_norm(x, residual, self._parameters["weight"], self.eps)
