"""Attention backends over the paged KV cache, chosen per device through a small registry.

A backend's plan(spans, block_size, device) is made once per step; the plan's
write_kv(kv, layer, k, v) and attend(q, kv, layer, scale) -> (out, lse) run per layer.
Backends: "cpu" (compiled kernel, default on CPU), "torch" (pure PyTorch reference, any
device), "flashinfer" (CUDA, the [gpu] extra)."""

from __future__ import annotations

import torch

from punica_x.env import ATTENTION_BACKEND
from punica_x.ops.registry import Registry


def _torch():
    from punica_x.attention.paged import TorchAttention

    return TorchAttention()


def _cpu():
    from punica_x.attention.cpu import CpuAttention

    return CpuAttention()


def _flashinfer():
    from punica_x.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention()


BACKENDS = Registry(
    "attention",
    ATTENTION_BACKEND,
    {"cpu": _cpu, "torch": _torch, "flashinfer": _flashinfer},
    default=lambda device, dtype: "flashinfer" if device.type == "cuda" else "cpu",
    needs={"cpu": ("cpu", None), "flashinfer": ("cuda", None)},
)


def get_attention_backend(device: torch.device | str, name: str | None = None):
    """`name`, else $PUNICA_X_ATTENTION_BACKEND, else cpu / flashinfer by device type."""
    return BACKENDS.get(device, None, name)
