"""Attention backends over the paged KV cache, chosen per device through a small registry.

A backend's plan(spans, block_size, device) is made once per step; the plan's
write_kv(kv, layer, k, v) and attend(q, kv, layer, scale) -> (out, lse) run per layer.
Backends: "cpu" (compiled kernel, default on CPU), "torch" (pure PyTorch reference, any
device), "flashinfer" (CUDA, the [gpu] extra)."""

from __future__ import annotations

from functools import cache

import torch

from punica_x.env import ATTENTION_BACKEND


def _torch():
    from punica_x.attention.paged import TorchAttention

    return TorchAttention()


def _cpu():
    from punica_x.attention.cpu import CpuAttention

    return CpuAttention()


def _flashinfer():
    from punica_x.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention()


_REGISTRY = {"cpu": _cpu, "torch": _torch, "flashinfer": _flashinfer}


@cache
def _instantiate(name: str):
    return _REGISTRY[name]()


def get_attention_backend(device: torch.device | str, name: str | None = None):
    """`name`, else $PUNICA_X_ATTENTION_BACKEND, else cpu / flashinfer by device type."""
    device = torch.device(device)
    name = name or ATTENTION_BACKEND.get() or ("flashinfer" if device.type == "cuda" else "cpu")
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention backend cannot run on {device}")
    return _instantiate(name)
