"""Attention backends over the paged KV cache, chosen per device through a small registry.

A backend's plan(spans, block_size, device) is made once per step; the plan's
write_kv(kv, layer, k, v) and attend(q, kv, layer, scale) -> (out, lse) run per layer.
Backends: "cpu" (compiled kernel, default on CPU), "torch" (pure PyTorch reference, any
device), "flashinfer" (CUDA, the [gpu] extra)."""

from __future__ import annotations

import logging

import torch

from punica_x.env import ATTENTION_BACKEND
from punica_x.ops.registry import Registry

log = logging.getLogger("punica_x.attention")


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
    default=lambda device, dtype: _default(device, dtype, None),
    needs={"cpu": ("cpu", None), "flashinfer": ("cuda", None)},
)


def _default(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> str:
    if device.type != "cuda":
        return "cpu"
    from punica_x.attention.flashinfer_backend import HEAD_DIMS

    fits = dtype in (None, torch.float16, torch.bfloat16) and head_dim in (None, *HEAD_DIMS)
    if not fits:
        log.info(
            "attention: FlashInfer has no kernel for head_dim=%s %s; using the torch backend",
            head_dim,
            dtype,
        )
    return "flashinfer" if fits else "torch"


def get_attention_backend(
    device: torch.device | str,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
):
    """`name`, else $PUNICA_X_ATTENTION_BACKEND, else by device: cpu on CPU; on CUDA
    flashinfer where it has a kernel for (dtype, head_dim), torch otherwise. A named
    backend that cannot run raises."""
    device = torch.device(device)
    name = name or ATTENTION_BACKEND.get() or _default(device, dtype, head_dim)
    return BACKENDS.get(device, None, name)
