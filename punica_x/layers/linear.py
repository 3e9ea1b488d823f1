"""Dense projections of the shared backbone, fused over the slices that read one input
(q|k|v, gate|up), with the batch's LoRA add-ons applied through SGMV."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from punica_x.core import LoraBatchMeta
from punica_x.ops.sgmv import SgmvBackend, add_lora_sgmv


class LoraLinear(nn.Module):
    """y = x @ W^T (+ bias) + per-segment LoRA.

    weight: [sum(out_slices), in_features]; `group` names the LoRA projection group whose
    SGMV metadata (one per step) this layer reads."""

    def __init__(
        self,
        in_features: int,
        out_slices: tuple[int, ...],
        group: str,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_slices = out_slices
        self.group = group
        out = sum(out_slices)
        self.weight = nn.Parameter(
            torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def forward(
        self, x: torch.Tensor, lora: LoraBatchMeta | None, layer: int, backend: SgmvBackend | None
    ) -> torch.Tensor:
        """x: [T, in_features] -> [T, sum(out_slices)]."""
        y = F.linear(x, self.weight, self.bias)
        if lora is not None:
            w = lora.groups.get(self.group)
            if w is not None and w.max_rank:
                add_lora_sgmv(y, x, w, layer, lora.workspace, backend)
        return y

    def load_slice(
        self, index: int, tensor: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        """Copy one slice's weight [out_slices[index], in_features] into the fused weight."""
        lo = sum(self.out_slices[:index])
        hi = lo + self.out_slices[index]
        if tuple(tensor.shape) != (hi - lo, self.in_features):
            raise ValueError(
                f"slice {index} of {self.group}: expected shape "
                f"{(hi - lo, self.in_features)}, got {tuple(tensor.shape)}"
            )
        self.weight[lo:hi].copy_(tensor)
        if bias is not None and self.bias is not None:
            self.bias[lo:hi].copy_(bias)
