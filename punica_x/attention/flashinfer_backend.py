"""FlashInfer paged attention for CUDA runners (the [gpu] extra).

One BatchPrefillWithPagedKVCacheWrapper per runner serves prefill chunks and decodes in a
single launch (ragged queries, causal, paged KV in HND layout: per layer, K and V are
[num_blocks, N_kv, P, D] views of the punica-x cache). FlashInfer reports the log-sum-exp in
base 2; it is converted to the natural log used by attention.merge.

A sliding window (`window_left` = W - 1) and logit soft-capping are plan-time parameters in
FlashInfer, so a model whose layers differ (Gemma's local and global layers) plans one
wrapper per distinct (window, softcap) of the step, on its first layer that asks for it.

Not exercised on the CPU-only development machine: its tests are marked `gpu`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from punica_x.attention.paged import SeqSpan

WORKSPACE_BYTES = 128 << 20
# Head sizes FlashInfer's paged prefill kernels are built for; others fail inside the kernel
# dispatch ("Invalid configuration"), so they are refused up front.
HEAD_DIMS = (64, 128, 256)


@dataclass
class FlashInferPlan:
    """indexes: (qo_indptr, kv_indptr, kv_indices, last_page_len) int32 on the device;
    planned: wrappers planned for this step, by (window, softcap)."""

    backend: FlashInferAttention
    device: torch.device
    block_size: int
    indexes: tuple[torch.Tensor, ...]
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    planned: dict[tuple[int, float], object] = field(default_factory=dict)

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv[self.slot_blocks, layer, 0, :, self.slot_offsets] = k
        kv[self.slot_blocks, layer, 1, :, self.slot_offsets] = v

    def attend(self, q, kv, layer: int, scale: float, window: int = 0, softcap: float = 0.0):
        """As the other backends' attend; window / softcap: see the module docstring."""
        key = (window, softcap)
        if key not in self.planned:
            self.planned[key] = self.backend.planned_wrapper(self, scale, window, softcap)
        wrapper = self.planned[key]
        out, lse = wrapper.run(q, (kv[:, layer, 0], kv[:, layer, 1]), return_lse=True)
        return out, lse.float() * math.log(2.0)


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self) -> None:
        try:
            import flashinfer
        except ImportError as exc:  # the [gpu] extra is missing
            raise ImportError(
                "the flashinfer attention backend needs: pip install 'punica-x[gpu]'"
            ) from exc
        self._flashinfer = flashinfer
        self._wrappers: dict[tuple, object] = {}
        self.num_qo_heads = self.num_kv_heads = self.head_dim = 0
        self.dtype = torch.float16
        self.scale = 1.0

    def configure(
        self, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> FlashInferAttention:
        """A backend bound to one model's heads (plan() needs them), with wrappers of its own,
        so engines of different models in one process never share one. Raises ValueError for
        a head size or dtype FlashInfer has no kernel for."""
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"FlashInfer has no kernel for head_dim {head_dim} (has {HEAD_DIMS})")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashInfer attention needs float16 or bfloat16, not {dtype}")
        bound = FlashInferAttention()
        bound.num_qo_heads, bound.num_kv_heads, bound.head_dim = (
            num_qo_heads,
            num_kv_heads,
            head_dim,
        )
        bound.dtype = dtype
        bound.scale = head_dim**-0.5
        return bound

    def _wrapper(self, key):
        """One wrapper per (device, window, softcap): a plan lives in its wrapper."""
        if key not in self._wrappers:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=key[0])
            self._wrappers[key] = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "HND"
            )
        return self._wrappers[key]

    def planned_wrapper(self, plan: FlashInferPlan, scale: float, window: int, softcap: float):
        """The wrapper for (window, softcap), planned over this step's sequences."""
        wrapper = self._wrapper((plan.device, window, softcap))
        wrapper.plan(
            *plan.indexes,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            plan.block_size,
            causal=True,
            sm_scale=scale,
            window_left=window - 1 if window else -1,
            logits_soft_cap=softcap or None,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return wrapper

    def plan(self, spans: list[SeqSpan], block_size: int, device: torch.device) -> FlashInferPlan:
        spans = sorted(spans, key=lambda s: s.row_start)
        qo, kv_ptr, indices, last, slot_b, slot_o = [0], [0], [], [], [], []
        for sp in spans:
            nb = -(-sp.kv_len // block_size)
            qo.append(qo[-1] + sp.num_rows)
            indices.extend(sp.block_ids[:nb])
            kv_ptr.append(len(indices))
            last.append(sp.kv_len - (nb - 1) * block_size)
            for pos in range(sp.kv_len - sp.num_rows, sp.kv_len):
                slot_b.append(sp.block_ids[pos // block_size])
                slot_o.append(pos % block_size)
        i32 = dict(dtype=torch.int32, device=device)
        indexes = tuple(torch.tensor(x, **i32) for x in (qo, kv_ptr, indices, last))
        i64 = dict(dtype=torch.int64, device=device)
        return FlashInferPlan(
            self,
            device,
            block_size,
            indexes,
            torch.tensor(slot_b, **i64),
            torch.tensor(slot_o, **i64),
        )
