"""Dense projections of the shared backbone, fused over the slices that read one input
(q|k|v, gate|up), with the batch's LoRA add-ons applied through SGMV."""

from __future__ import annotations

import torch
from torch import nn

from punica_x.ops.dense import DenseBackend, prefetches
from punica_x.ops.quant_dense import QuantBlocks, cat_blocks, dequantize_blocks
from punica_x.ops.sgmv import SgmvBackend, add_lora_sgmv
from punica_x.runtime import LoraBatchMeta


class Dense(nn.Module):
    """y = x @ W^T (+ bias). The checkpoint's weight ([out, in], as in nn.Linear) is loaded
    into `weight`, then prepare() converts it once into the dense backend's layout."""

    def __init__(
        self,
        in_features: int,
        out_slices: tuple[int, ...],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_slices = out_slices
        self.out_features = sum(out_slices)
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(
                torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False
            )
            if bias
            else None
        )
        self.backend: DenseBackend | None = None
        self.prefetches = False
        # slices loaded as quantized blocks (index: as load_slice's), until prepared
        self.quant_parts: dict[int | None, QuantBlocks] = {}

    def prepare(self, backend: DenseBackend) -> None:
        """Convert the loaded weight to the backend's layout (the original is dropped)."""
        self.weight = nn.Parameter(backend.prepare(self.weight.data), requires_grad=False)
        self.backend = backend
        self.prefetches = prefetches(backend)

    def quantized_weight(self) -> QuantBlocks | None:
        """The whole weight as one QuantBlocks when every slice was loaded quantized in one
        format; None when none was. Slices of mixed kinds are dequantized into `weight`
        (the float path) and None is returned."""
        if not self.quant_parts:
            return None
        keys = [None] if None in self.quant_parts else list(range(len(self.out_slices)))
        parts = [self.quant_parts.get(i) for i in keys]
        if all(p is not None for p in parts) and len({p.format for p in parts}) == 1:
            return cat_blocks(parts, parts[0].name)
        for index, part in self.quant_parts.items():
            self._copy_slice(index, "weight", dequantize_blocks(part, self.weight.dtype))
        self.quant_parts = {}
        return None

    def prepare_quantized(self, blocks: QuantBlocks, backend) -> None:
        """Serve `blocks` (the whole [out, in] weight) through a quantized backend; the
        float weight is never materialised."""
        if blocks.n != self.out_features or blocks.k != self.in_features:
            raise ValueError(
                f"{blocks.name}: {blocks.n} x {blocks.k} blocks for a "
                f"{self.out_features} x {self.in_features} weight"
            )
        self.weight = nn.Parameter(backend.prepare(blocks), requires_grad=False)
        self.backend, self.prefetches, self.quant_parts = backend, False, {}

    def dense(self, x: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features]. ``prefetch``: regions the next kernel
        reads, pulled into the caches during the GEMM where the backend can
        (ops.dense.prefetches)."""
        # weight and bias straight from _parameters (bias is there or a plain None): a
        # Module.__getattr__ lookup costs ~0.5 us, and a decode step makes ~120 of these calls
        params = self._parameters
        w, bias = params["weight"], params.get("bias")
        if prefetch is not None and self.prefetches:
            return self.backend.forward(x, w, self.out_features, bias, prefetch)
        return self.backend.forward(x, w, self.out_features, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W ([T] int64 -> [T, in_features]), read from the backend's layout
        (ops.dense.has_rows)."""
        return self.backend.rows(self.weight, ids, self.in_features)

    def load_slice(self, index: int | None, kind: str, tensor: torch.Tensor) -> bool:
        """Copy slice `index` of a checkpoint's weight ([out, in]) or bias ([out]) into the
        fused parameters (index None: all slices at once, a checkpoint that fuses them too);
        False if this layer has no such parameter."""
        lo = 0 if index is None else sum(self.out_slices[:index])
        hi = self.out_features if index is None else lo + self.out_slices[index]
        if isinstance(tensor, QuantBlocks):
            if kind != "weight" or (tensor.n, tensor.k) != (hi - lo, self.in_features):
                raise ValueError(
                    f"{tensor.name}: {kind} of {tensor.n} x {tensor.k} quantized values, "
                    f"expected a weight of {hi - lo} x {self.in_features}"
                )
            self.quant_parts[index] = tensor
            return True
        return self._copy_slice(index, kind, tensor)

    def _copy_slice(self, index: int | None, kind: str, tensor: torch.Tensor) -> bool:
        lo = 0 if index is None else sum(self.out_slices[:index])
        hi = self.out_features if index is None else lo + self.out_slices[index]
        target = self.bias if kind == "bias" else self.weight
        if target is None:
            return False
        want = (hi - lo,) + tuple(target.shape[1:])
        if tuple(tensor.shape) != want:
            raise ValueError(f"slice {index} {kind}: expected {want}, got {tuple(tensor.shape)}")
        target[lo:hi].copy_(tensor)
        return True


class LoraLinear(Dense):
    """A Dense plus per-segment LoRA; `group` names the LoRA projection group whose SGMV
    metadata (one per step) this layer reads."""

    def __init__(
        self,
        in_features: int,
        out_slices: tuple[int, ...],
        group: str,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(in_features, out_slices, bias, dtype, device)
        self.group = group

    def forward(
        self, x: torch.Tensor, lora: LoraBatchMeta | None, layer: int, backend: SgmvBackend | None
    ) -> torch.Tensor:
        """x: [T, in_features] -> [T, sum(out_slices)]. The dense GEMM prefetches the adapter
        weights the SGMV launch after it reads (on a backend that can, on the CPU)."""
        w = lora.groups.get(self.group) if lora is not None else None
        if w is None or not w.max_rank:
            return self.dense(x)
        spans = w.prefetch_layers if self.prefetches else None  # a CPU backend's
        y = self.dense(x, None if spans is None else spans[layer])
        if backend is None:
            add_lora_sgmv(y, x, w, layer, lora.workspace)
        else:
            w.launch(backend)(y, x, lora.workspace, layer)
        return y
